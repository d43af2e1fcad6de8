//! The boundary between the AMQP front end and the broker that stores the messages.
//!
//! The protocol engine speaks only to [`Backend`]; one module wires it to `twice-broker`.
//! Everything here is in twice's vocabulary (`Message`, `ReceivedMessage`, `LockToken`,
//! `SequenceNumber`, `SessionId`) and the broker's ([`ReceiveMode`], [`Settlement`], [`Rule`],
//! re-exported here): AMQP stays in the engine.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use twice::{LockToken, Message, ReceivedMessage, SequenceNumber, SessionId, Timestamp};
use twice_broker::MessageCounts;
use twice_broker::config::EntityDefinition;
// The broker's words, so that the trait reads in them and nothing converts between twins.
pub use twice_broker::config::Rule;
pub use twice_broker::{ReceiveMode, Settlement};

/// What an entity path names.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntityKind {
    /// A queue.
    Queue {
        /// Whether messages must carry a session id.
        requires_session: bool,
    },
    /// A topic: it can be sent to, not received from.
    Topic,
    /// A subscription of a topic.
    Subscription {
        /// Whether messages must carry a session id.
        requires_session: bool,
    },
    /// The dead-letter queue of a queue or subscription.
    DeadLetter,
}

impl EntityKind {
    /// Whether receivers need a session.
    pub fn requires_session(&self) -> bool {
        matches!(
            self,
            EntityKind::Queue { requires_session: true }
                | EntityKind::Subscription { requires_session: true }
        )
    }
}

/// Counts of one entity, for `/metrics` and `/entities`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntityStats {
    /// The entity path.
    pub path: String,
    /// `queue`, `topic` or `subscription`.
    pub kind: String,
    /// Messages available or locked.
    pub active: u64,
    /// Messages waiting for their time.
    pub scheduled: u64,
    /// Deferred messages.
    pub deferred: u64,
    /// Messages in the dead-letter queue.
    pub dead_letter: u64,
}

/// Why the broker refused an operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The message lock is gone.
    #[error("the lock supplied is invalid: it expired, or the message was already settled")]
    LockLost,
    /// The session lock is gone.
    #[error("the session lock was lost")]
    SessionLockLost,
    /// Another receiver holds the session.
    #[error("the requested session '{0}' cannot be accepted: it is locked by another receiver")]
    SessionCannotBeLocked(String),
    /// No such entity.
    #[error("the messaging entity '{0}' could not be found")]
    EntityNotFound(String),
    /// No such message (sequence number).
    #[error("message not found: {0}")]
    MessageNotFound(String),
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The entity is full (`MaxSizeInMegabytes`): the send changed nothing.
    #[error("{0}")]
    QuotaExceeded(String),
    /// An entity or rule of that name exists.
    #[error("the messaging entity '{0}' already exists")]
    AlreadyExists(String),
    /// The message is larger than the broker accepts.
    #[error("{0}")]
    MessageSizeExceeded(String),
    /// The operation is not offered.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
    /// The broker is shutting down or failed.
    #[error("the broker is unavailable: {0}")]
    Unavailable(String),
    /// A write or fsync of the broker's storage failed (a full disk, an I/O error): it
    /// accepts nothing more until restarted.
    #[error("the broker cannot serve until restarted: storage failed: {0}")]
    StorageFailed(String),
}

/// A locked session, held by one receiver link.
pub trait BackendSession: Send + Sync + std::fmt::Debug + 'static {
    /// The session id.
    fn session_id(&self) -> &SessionId;

    /// Until when the session lock holds.
    fn locked_until(&self) -> Timestamp;

    /// Receives up to `max` of the session's messages, waiting up to `max_wait` for the first.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future must not lose a message: a message taken but not returned is
    /// released (peek-lock) or stays (receive-and-delete).
    fn receive(
        &self,
        mode: ReceiveMode,
        max: usize,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BackendError>> + Send;

    /// Receives deferred messages of this session by sequence number.
    fn receive_deferred(
        &self,
        mode: ReceiveMode,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BackendError>> + Send;

    /// Settles a message of this session.
    fn settle(
        &self,
        lock: LockToken,
        how: Settlement,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Completes messages of this session; one result per lock, in order.
    ///
    /// The default settles them one by one; a broker that can complete many in one durable
    /// write should do so.
    fn complete_many(
        &self,
        locks: Vec<LockToken>,
    ) -> impl Future<Output = Vec<Result<(), BackendError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(locks.len());
            for lock in locks {
                out.push(self.settle(lock, Settlement::Complete).await);
            }
            out
        }
    }

    /// Renews the session lock.
    fn renew(&self) -> impl Future<Output = Result<Timestamp, BackendError>> + Send;

    /// Checks, on the broker's clock, that the session lock is still held: `Ok` while it is,
    /// [`BackendError::SessionLockLost`] once it expired or was released. It must not renew
    /// the lock.
    ///
    /// The default asks for no deferred messages, which checks the lock and takes nothing.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it changes nothing.
    fn check_lock(&self) -> impl Future<Output = Result<(), BackendError>> + Send {
        async move { self.receive_deferred(ReceiveMode::PeekLock, Vec::new()).await.map(drop) }
    }

    /// The session state.
    fn get_state(&self) -> impl Future<Output = Result<Option<Bytes>, BackendError>> + Send;

    /// Sets or clears the session state.
    fn set_state(
        &self,
        state: Option<Bytes>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Releases the session lock; unsettled messages become available again.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// The broker as the AMQP front end sees it. Implementations are cheap to clone.
///
/// Why a trait and not `twice_broker::Broker` itself: it is the one place where the connection
/// engine's needs from a broker are written down (a few dozen calls out of the broker's whole
/// API, every failure already a [`BackendError`] with its wire condition), and it lets a test
/// put a broker whose sends wait at a gate under the real connection code, which is how the
/// bound on a connection's bytes in flight is tested without timing.
pub trait Backend: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// A locked session.
    type Session: BackendSession;

    /// What `path` (normalised, e.g. `orders`, `t/subscriptions/s`, `q/$deadletterqueue`)
    /// names, if it exists.
    fn entity(&self, path: &str) -> impl Future<Output = Option<EntityKind>> + Send;

    /// Counts for every entity.
    fn stats(&self) -> impl Future<Output = Vec<EntityStats>> + Send;

    /// Whether the backend can serve; the reason when it cannot (its storage failed).
    fn health(&self) -> Result<(), String> {
        Ok(())
    }

    /// Sends messages (scheduled ones carry `scheduled_enqueue_time`); returns their sequence
    /// numbers (for a topic, one per message as the topic numbered it).
    fn send(
        &self,
        entity: &str,
        messages: Vec<Message>,
    ) -> impl Future<Output = Result<Vec<SequenceNumber>, BackendError>> + Send;

    /// Schedules messages (each carries its `scheduled_enqueue_time`); returns a sequence
    /// number for every one, since the number is what cancels it: scheduling is not subject to
    /// duplicate detection. The default sends them.
    fn schedule(
        &self,
        entity: &str,
        messages: Vec<Message>,
    ) -> impl Future<Output = Result<Vec<SequenceNumber>, BackendError>> + Send {
        self.send(entity, messages)
    }

    /// Cancels scheduled messages.
    fn cancel_scheduled(
        &self,
        entity: &str,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Receives up to `max` messages, waiting up to `max_wait` for the first.
    ///
    /// # Cancel safety
    ///
    /// As [`BackendSession::receive`].
    fn receive(
        &self,
        entity: &str,
        mode: ReceiveMode,
        max: usize,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BackendError>> + Send;

    /// Receives deferred messages by sequence number.
    fn receive_deferred(
        &self,
        entity: &str,
        mode: ReceiveMode,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BackendError>> + Send;

    /// Settles a locked message.
    fn settle(
        &self,
        entity: &str,
        lock: LockToken,
        how: Settlement,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Completes locked messages of `entity`; one result per lock, in order.
    ///
    /// The default settles them one by one; a broker that can complete many in one durable
    /// write should do so.
    fn complete_many(
        &self,
        entity: &str,
        locks: Vec<LockToken>,
    ) -> impl Future<Output = Vec<Result<(), BackendError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(locks.len());
            for lock in locks {
                out.push(self.settle(entity, lock, Settlement::Complete).await);
            }
            out
        }
    }

    /// Renews a message lock.
    fn renew_lock(
        &self,
        entity: &str,
        lock: LockToken,
    ) -> impl Future<Output = Result<Timestamp, BackendError>> + Send;

    /// Messages from `from` on (active, deferred and scheduled), without locking them.
    fn peek(
        &self,
        entity: &str,
        session: Option<SessionId>,
        from: SequenceNumber,
        max: usize,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, BackendError>> + Send;

    /// Locks the named session, or (with `None`) the next one with messages, waiting up to
    /// `max_wait`; `Ok(None)` when none came in time.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future must not leave a session locked.
    fn accept_session(
        &self,
        entity: &str,
        session: Option<SessionId>,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Option<Self::Session>, BackendError>> + Send;

    /// Session ids with messages or state, paged.
    fn list_sessions(
        &self,
        entity: &str,
        skip: usize,
        top: usize,
    ) -> impl Future<Output = Result<Vec<SessionId>, BackendError>> + Send;

    /// The definition of an entity, for the administration API (the default: not offered).
    fn admin_get(
        &self,
        path: &str,
    ) -> impl Future<Output = Result<EntityDefinition, BackendError>> + Send {
        let _ = path;
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Every entity, topics before their subscriptions, for the administration API.
    fn admin_list(
        &self,
    ) -> impl Future<Output = Result<Vec<EntityDefinition>, BackendError>> + Send {
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Creates an entity; [`BackendError::AlreadyExists`] when one has its path.
    fn admin_create(
        &self,
        definition: EntityDefinition,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = definition;
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Replaces an entity's properties (a subscription keeps its rules).
    fn admin_update(
        &self,
        definition: EntityDefinition,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = definition;
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Deletes an entity and its messages (a topic with its subscriptions).
    fn admin_delete(&self, path: &str) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = path;
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Empties every entity (messages of every kind, locks, session states, remembered ids)
    /// and keeps their definitions; returns how many entities there are.
    fn admin_reset(&self) -> impl Future<Output = Result<usize, BackendError>> + Send {
        async { Err(BackendError::Unsupported("the reset of every entity")) }
    }

    /// Runtime counts of an entity.
    fn admin_counts(
        &self,
        path: &str,
    ) -> impl Future<Output = Result<MessageCounts, BackendError>> + Send {
        let _ = path;
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Adds a rule to `topic`'s subscription `subscription`.
    fn admin_create_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (topic, subscription, rule);
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Replaces the rule of the same name of a subscription.
    fn admin_replace_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (topic, subscription, rule);
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Removes a rule of a subscription.
    fn admin_delete_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: &str,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (topic, subscription, rule);
        async { Err(BackendError::Unsupported("the administration API")) }
    }

    /// Adds a rule to a subscription.
    fn add_rule(
        &self,
        subscription: &str,
        rule: Rule,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Removes a rule from a subscription.
    fn remove_rule(
        &self,
        subscription: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// The rules of a subscription.
    fn rules(
        &self,
        subscription: &str,
    ) -> impl Future<Output = Result<Vec<Rule>, BackendError>> + Send;
}
