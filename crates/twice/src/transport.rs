//! The [`Transport`] trait: what the processor needs from a broker.
//!
//! The vocabulary is the common ground of the brokers twice runs on:
//!
//! | twice         | Service Bus (peek-lock)  | NATS JetStream        | RabbitMQ (quorum queue)        |
//! |---------------|--------------------------|-----------------------|--------------------------------|
//! | `receive`     | receive with lock        | pull fetch            | basic.consume with prefetch    |
//! | `complete`    | complete                 | `Ack`                 | basic.ack                      |
//! | `abandon`     | abandon (count + 1)      | `Nak`                 | basic.nack requeue (count + 1) |
//! | `dead_letter` | dead-letter              | `Term` (+ DLQ stream) | basic.reject → dead-letter exchange |
//! | `defer`       | defer                    | —                     | —                              |
//! | `release`     | release (no count)       | `Nak` with delay 0    | basic.nack requeue             |
//! | `renew_lock`  | renew lock               | `InProgress`          | — (no lock expiry)             |
//! | `redeliver_later` | schedule a copy, complete | `Nak` with delay   | — (optional; default: unsupported) |
//!
//! A transport that lacks an operation returns [`TransportError::Unsupported`].

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::ids::SessionId;
use crate::message::{Properties, ReceivedMessage};

/// An error from a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The lock on the message is gone (expired, or the message was settled elsewhere): the
    /// message may already be with another receiver.
    #[error("the lock on the message was lost (it expired or the message was already settled)")]
    LockLost,
    /// The lock on the session is gone.
    #[error("the session lock was lost")]
    SessionLockLost,
    /// The entity does not exist.
    #[error("messaging entity {0:?} not found")]
    EntityNotFound(String),
    /// The transport does not offer this operation.
    #[error("{0} is not supported by this transport")]
    Unsupported(&'static str),
    /// The caller passed something the broker rejects.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The connection is closed or the broker is shutting down.
    #[error("the transport is closed")]
    Closed,
    /// Anything else, with the transport's own error inside.
    #[error("transport error: {message}")]
    Other {
        /// What went wrong.
        message: String,
        /// Whether retrying the same call may succeed.
        transient: bool,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl TransportError {
    /// Whether the lock on the message (or its session) is lost.
    pub fn is_lock_lost(&self) -> bool {
        matches!(self, Self::LockLost | Self::SessionLockLost)
    }

    /// Whether retrying the call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Other { transient: true, .. })
    }
}

/// What the processor needs to know about the entity it receives from, to check that the inbox
/// keeps processed ids long enough.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntityInfo {
    /// The entity path, e.g. `orders` or `events/Subscriptions/billing`.
    pub path: String,
    /// How long a lock lasts before the message is delivered again.
    pub lock_duration: Duration,
    /// Deliveries before the message is dead-lettered; `None` when unlimited.
    pub max_delivery_count: Option<u32>,
    /// The duplicate-detection window, when duplicate detection is on.
    pub duplicate_detection_window: Option<Duration>,
    /// Whether messages must carry a session id.
    pub requires_session: bool,
    /// The longest a message lives on the entity (its default time to live), when the
    /// transport knows it and it is finite: until then an abandoned message can come back.
    pub message_time_to_live: Option<Duration>,
    /// How long the entity's dead-letter queue keeps a message after dead-lettering it, when
    /// the transport knows it and it is finite: until then the message can be resubmitted with
    /// its id. `None`: kept until someone removes it, or not known (Service Bus keeps
    /// dead-lettered messages forever); see
    /// [`ProcessorOptions::max_resubmit_age`](crate::ProcessorOptions::max_resubmit_age).
    pub dead_letter_time_to_live: Option<Duration>,
}

impl EntityInfo {
    /// Entity info with the Service Bus defaults (lock 60 s, 10 deliveries, no duplicate
    /// detection, no sessions).
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            lock_duration: Duration::from_secs(60),
            max_delivery_count: Some(10),
            duplicate_detection_window: None,
            requires_session: false,
            message_time_to_live: None,
            dead_letter_time_to_live: None,
        }
    }
}

/// Why a message is dead-lettered.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DeadLetterReason {
    /// A short machine-readable reason, e.g. `DeserializationFailed`.
    pub reason: String,
    /// A human-readable description.
    pub description: String,
}

impl DeadLetterReason {
    /// A reason and its description.
    pub fn new(reason: impl Into<String>, description: impl Into<String>) -> Self {
        Self { reason: reason.into(), description: description.into() }
    }
}

/// A message delivery that can be settled: the transport's handle plus the message.
pub trait Delivery: Send + Sync + fmt::Debug + 'static {
    /// The message.
    fn message(&self) -> &ReceivedMessage;
}

impl Delivery for ReceivedMessage {
    fn message(&self) -> &ReceivedMessage {
        self
    }
}

/// What a receiver of either kind does: receive messages locked for it, and settle them. An
/// entity's receiver ([`Transport`]) and a session's ([`SessionReceiver`]) build on it, as
/// Service Bus's session receiver extends its receiver.
///
/// Implementations are cheap to share (`&self` everywhere) and safe to call from many tasks.
pub trait Receive: Send + Sync + fmt::Debug + 'static {
    /// The handle of one delivery.
    type Delivery: Delivery;

    /// Receives up to `max_messages` messages, each locked for this receiver (of a session:
    /// that session's, in order). Waits up to `max_wait` for the first one; returns an empty
    /// vector if none came.
    ///
    /// # Cancel safety
    ///
    /// Implementations must not lose messages when the future is dropped: a message locked
    /// but not returned is released or comes back when its lock expires.
    fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Delivery>, TransportError>> + Send;

    /// Completes the message: it is done and removed.
    fn complete(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Abandons the message: it is unlocked for redelivery and its delivery count rises,
    /// after merging `properties` into its application properties.
    fn abandon(
        &self,
        delivery: &Self::Delivery,
        properties: Properties,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Moves the message to the dead-letter queue with a reason.
    fn dead_letter(
        &self,
        delivery: &Self::Delivery,
        reason: DeadLetterReason,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Defers the message: it stays, receivable only by its sequence number.
    fn defer(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;
}

/// A receiver on one entity of a broker, with peek-lock settlement.
pub trait Transport: Receive {
    /// The entity this transport receives from.
    fn entity(&self) -> &EntityInfo;

    /// The scope of the inbox keys of a processor on this entity that is given no consumer
    /// name ([`ProcessorOptions::consumer`](crate::ProcessorOptions::consumer)): one name per
    /// entity, the same however the entity is spelled and from whichever receiver, and
    /// different for every other entity whose messages may share the inbox table. The default
    /// is the entity path exactly as [`Transport::entity`] gives it, for brokers whose names
    /// are case-sensitive and global; a transport whose broker folds case or has more than one
    /// namespace for names overrides it: see
    /// [Claim scope](crate::processor#claim-scope) for each transport's rule.
    fn claim_scope(&self) -> &str {
        &self.entity().path
    }

    /// Reads the entity's properties from the broker where the transport can (lock duration,
    /// MaxDeliveryCount, time to live, sessions, duplicate detection), so that the processor's
    /// checks and its lock renewal rest on what the broker does rather than on defaults. The
    /// processor calls it once as it starts, before its checks; afterwards
    /// [`Transport::entity`] answers with what it read. The default returns
    /// [`Transport::entity`] as it is.
    ///
    /// # Errors
    ///
    /// [`TransportError::EntityNotFound`] when the broker has no such entity; a transport that
    /// cannot read the properties (no right to, no way to) goes on with what it has and says
    /// so in a log line, rather than fail.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    fn read_entity(&self) -> impl Future<Output = Result<EntityInfo, TransportError>> + Send {
        async { Ok(self.entity().clone()) }
    }

    /// The messaging system, as the OpenTelemetry semantic conventions name it in
    /// `messaging.system` (`servicebus`, `rabbitmq`, `nats`, ...): recorded on the span of
    /// every message. The default is `unknown`.
    fn system(&self) -> &'static str {
        "unknown"
    }

    /// Releases the lock without counting a delivery (the message was never handed to a
    /// handler).
    fn release(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Renews the lock; returns the new locked-until time.
    fn renew_lock(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<Timestamp, TransportError>> + Send;

    /// Settles the delivery so that the message is delivered again no sooner than `delay` from
    /// now, with `properties` merged into its application properties, and without raising its
    /// delivery count (delayed redelivery, as MassTransit's `UseDelayedRedelivery` and
    /// NServiceBus's delayed retries do it).
    ///
    /// The message that comes back must keep its message id, body and properties, and must not
    /// be dropped by the broker's duplicate detection; a transport that cannot promise that
    /// returns [`TransportError::Unsupported`], as the default implementation does, and the
    /// processor then abandons the message instead.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in general: dropped midway, the message may have been scheduled again
    /// and still be locked here, so it can come back twice (the claim makes that harmless).
    fn redeliver_later(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
        properties: Properties,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = (delivery, delay, properties);
        async { Err(TransportError::Unsupported("delayed redelivery")) }
    }
}

/// A transport whose entity has sessions: a receiver first locks a session, then receives that
/// session's messages in order.
pub trait SessionTransport: Transport {
    /// A locked session.
    type Session: SessionReceiver<Delivery = Self::Delivery>;

    /// Locks the next session that has messages, waiting up to `max_wait` for one; `None` if
    /// none became available.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a session locked but not returned is released.
    fn accept_next_session(
        &self,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Option<Self::Session>, TransportError>> + Send;

    /// Locks the named session; fails if another receiver holds it.
    fn accept_session(
        &self,
        session_id: &SessionId,
    ) -> impl Future<Output = Result<Self::Session, TransportError>> + Send;
}

/// A session held by this receiver. Dropping it without [`SessionReceiver::close`] lets the
/// session lock expire. What it receives are that session's messages, in order.
pub trait SessionReceiver: Receive {
    /// The session id.
    fn session_id(&self) -> &SessionId;

    /// Until when the session lock holds, as of the last accept or renewal.
    fn locked_until(&self) -> Timestamp;

    /// Renews the session lock; returns the new locked-until time.
    fn renew_session_lock(&self) -> impl Future<Output = Result<Timestamp, TransportError>> + Send;

    /// Releases one of the session's messages without counting a delivery (no handler saw
    /// it): it stays first in the session, for this receiver. The default returns
    /// [`TransportError::Unsupported`], and the processor abandons the message instead.
    fn release(
        &self,
        delivery: &Self::Delivery,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = delivery;
        async { Err(TransportError::Unsupported("release a message of a session")) }
    }

    /// The session state, if any was set.
    fn get_state(
        &self,
    ) -> impl Future<Output = Result<Option<bytes::Bytes>, TransportError>> + Send;

    /// Sets (or with `None` clears) the session state.
    fn set_state(
        &self,
        state: Option<bytes::Bytes>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Releases the session lock; its unsettled messages become available again.
    fn close(self) -> impl Future<Output = Result<(), TransportError>> + Send
    where
        Self: Sized;
}
