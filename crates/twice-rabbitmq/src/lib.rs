//! A RabbitMQ transport for twice: the idempotent processor on a RabbitMQ quorum queue.
//!
//! ```no_run
//! # async fn example() -> Result<(), twice::TransportError> {
//! use twice::{Message, Receive as _, Transport as _};
//! use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
//!
//! let orders = RabbitMqTransport::connect(
//!     RabbitMqOptions::new("amqp://guest:guest@127.0.0.1:5672/%2f", "orders")
//!         .max_concurrent_calls(4),
//! )
//! .await?;
//! orders.send(Message::new("hello").with_message_id("order-1")).await?;
//! let got = orders.receive(10, std::time::Duration::from_secs(1)).await?;
//! for d in &got {
//!     orders.complete(d).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! # How Service Bus terms map onto RabbitMQ
//!
//! | twice | RabbitMQ |
//! |---|---|
//! | the entity | a durable quorum queue (declared on connect where missing, with the arguments below; used as it is where it exists) |
//! | `send` | `basic.publish` with publisher confirms, persistent, `mandatory`, tried again with the same message id until confirmed |
//! | `receive` | `basic.consume` with manual acks and a prefetch (`basic.qos`) of MaxConcurrentCalls |
//! | `complete` | `basic.ack` |
//! | `abandon` | a return that counts a delivery: `basic.nack` with requeue before RabbitMQ 4.3; from 4.3 a confirmed copy with the count in `twice-returns`, then `basic.ack` |
//! | `release` | `basic.nack` with requeue (counted by RabbitMQ before 4.3, not from 4.3) |
//! | `dead_letter` | a confirmed publish of the message to the dead-letter queue with the reason in headers, then `basic.ack` |
//! | DefaultMessageTimeToLive | `x-message-ttl` ([`RabbitMqOptions::message_time_to_live`], or the existing queue's); an expired message is dead-lettered |
//! | MaxDeliveryCount | `x-delivery-limit` = MaxDeliveryCount − 1, with `x-dead-letter-exchange` to the dead-letter queue (`at-least-once`); and the transport's own check |
//! | delivery count | `x-delivery-count` + `twice-returns` + 1 |
//! | message id | the identity policy ([`RabbitMqOptions::identity`]; default the `message-id` property) |
//! | lock, `renew_lock` | a lock kept by this transport, from the delivery; see below |
//! | `defer`, sessions, duplicate detection | none: [`TransportError::Unsupported`], or nothing (see below) |
//!
//! # Server versions
//!
//! The transport reads the server's version at connect ([`RabbitMqTransport::server_version`])
//! and follows what changed:
//!
//! - **4.0** gives a quorum queue declared without `x-delivery-limit` a limit of 20, and a
//!   queue at its limit without a dead-letter exchange drops the message. The transport declares
//!   its dead-letter queue (and a main queue with MaxDeliveryCount `None`) with
//!   `x-delivery-limit: -1`, no limit, so nothing dead-lettered is ever dropped.
//! - **4.3** no longer counts a requeueing `basic.nack` in the delivery count (nor a delivery
//!   requeued because its channel closed). The transport then counts itself: an abandon, or a
//!   lock that ran out, publishes a confirmed copy of the message carrying the count so far in
//!   the `twice-returns` header and acks the original, and a delivery whose count passes
//!   MaxDeliveryCount is moved to the dead-letter queue before any handler sees it. The copy
//!   goes to the back of the queue. A process that dies holding a message is not counted by
//!   4.3, so a message that kills every process that takes it is not stopped by
//!   MaxDeliveryCount there.
//!
//! The same counting applies to an existing queue that is not a quorum queue (a classic queue
//! counts nothing). Only RabbitMQ 3.10 was run here; 4.0 and 4.3 are covered by a proxy that
//! shows the transport their documented differences (`twice_testkit::proxy::amqp`).
//!
//! # Queues that exist
//!
//! A queue that exists is used with the arguments it has, never declared with others (which
//! RabbitMQ refuses with `PRECONDITION_FAILED`). The transport reads its arguments at connect,
//! takes its `x-message-ttl` and `x-delivery-limit` as they are, and says in
//! [`RabbitMqTransport::notes`] what is missing (a delivery limit, a dead-letter target) and
//! how to add it. The dead-letter queue `<queue>.dead-letter`, which only this transport uses,
//! is declared when missing.
//!
//! # The lock
//!
//! RabbitMQ has no lock with a duration: a delivery stays with its channel until it is acked,
//! the channel closes, or the broker's `consumer_timeout` (30 minutes by default) closes the
//! channel. So this transport keeps the lock itself: each delivery is locked for
//! [`RabbitMqOptions::lock_duration`] from the moment it reaches the client, whether or not a
//! handler has it yet. When the lock runs out, the transport returns the delivery to the queue,
//! counting a delivery (as Service Bus counts an expired lock), and a later settlement of that
//! delivery fails with [`TransportError::LockLost`]. `renew_lock` extends the lock by another
//! lock duration, but never past `consumer_timeout` after the delivery: renewing can only
//! shorten what the broker would allow, never lengthen it. The prefetch is
//! [`RabbitMqOptions::max_concurrent_calls`], so a delivery waits in the client for one handler
//! at most. A process that dies loses its channel, and RabbitMQ requeues its deliveries at once.
//!
//! An ack has no reply in AMQP 0-9-1: a completion lost with its connection comes back as a
//! redelivery, which the processor's inbox claim turns into a duplicate.
//!
//! # What RabbitMQ does not have
//!
//! - **Duplicate detection.** A message sent twice is delivered twice; the inbox claim makes the
//!   second copy a duplicate.
//! - **Defer and sessions.** `defer` returns [`TransportError::Unsupported`].
//! - **Properties on abandon.** A requeued message cannot be changed: `abandon` with properties
//!   returns [`TransportError::Unsupported`] (the processor abandons without any).
//! - **A release that does not count** before RabbitMQ 4.3.
//! - **Sequence numbers.** The sequence number of a delivery is its delivery tag: unique on its
//!   channel, not stable across deliveries.
//!
//! # Message identity
//!
//! The id the inbox claims comes from the identity policy ([`twice::MessageIdentity`],
//! [`RabbitMqOptions::identity`]): by default the `message-id` property. A message for which the
//! policy finds no id (RabbitMQ gives a message no identity of its own) is never handed to a
//! handler: the transport moves it to the dead-letter queue with the reason
//! [`MISSING_MESSAGE_ID`], unless the policy names such messages by a hash of their content.
//! [`send`](RabbitMqTransport::send) gives every message an id before its first publish (a
//! random one when the message has none), and tries a publish that was not confirmed again with
//! that id. A receiver on the dead-letter queue gets a message without an id under a random
//! id, new on every delivery.
//!
//! # Virtual hosts
//!
//! The entity's path ([`entity_path`]), and so the processor's default consumer, the scope of
//! its claims, is the queue's name in the default vhost `/` and `<vhost>/<queue>` in any other:
//! queues of one name in two vhosts, whose producers may number their messages alike, never
//! share claims. (A queue of the default vhost whose name is itself `<vhost>/<queue>` would;
//! name the consumer with `ProcessorOptions::consumer` if you have one.)
//!
//! # Connection loss
//!
//! A lost connection is noticed by the next call, which connects again and consumes again.
//! Deliveries of the old connection were requeued by the broker; settling them fails with
//! [`TransportError::LockLost`].

mod consume;
mod convert;
mod declare;
mod lock;
mod options;
mod publish;
mod version;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::FutureExt as _;
use lapin::options::{BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties};
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, Receive,
    ReceivedMessage, Timestamp, Transport, TransportError,
};

use crate::consume::Consuming;
use crate::lock::Lock;

pub use crate::options::RabbitMqOptions;
pub use crate::version::ServerVersion;
pub use twice::dead_letter_reasons::{MAX_DELIVERY_COUNT_EXCEEDED, MISSING_MESSAGE_ID};

/// The name of the dead-letter queue of `queue`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("{queue}.dead-letter")
}

/// What a queue is for: its arguments differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A queue with a delivery limit that dead-letters into its dead-letter queue.
    Main,
    /// A dead-letter queue: no limit, no dead-lettering of its own.
    DeadLetter,
}

/// Who counts the deliveries of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counting {
    /// The quorum queue (`x-delivery-count`), on RabbitMQ before 4.3.
    Broker,
    /// The transport, in `twice-returns` (RabbitMQ 4.3 and later, or a queue that counts
    /// nothing).
    Transport,
}

/// One connection and its publishing channel.
struct Link {
    generation: u64,
    connection: Connection,
    publisher: Channel,
}

struct Inner {
    options: RabbitMqOptions,
    role: Role,
    info: EntityInfo,
    dead_letter_queue: String,
    version: Option<ServerVersion>,
    counting: Counting,
    notes: Vec<String>,
    generations: AtomicU64,
    /// Deliveries that reached the client and are neither settled nor expired.
    held: Arc<AtomicU64>,
    // Tokio mutexes: held across the awaits of connecting and of waiting for a delivery.
    link: tokio::sync::Mutex<Option<Arc<Link>>>,
    consuming: tokio::sync::Mutex<Option<Consuming>>,
}

/// A [`Transport`] on one RabbitMQ quorum queue. Cheap to clone.
#[derive(Clone)]
pub struct RabbitMqTransport {
    inner: Arc<Inner>,
}

impl fmt::Debug for RabbitMqTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqTransport")
            .field("queue", &self.inner.options.queue)
            .field("role", &self.inner.role)
            .field("version", &self.inner.version)
            .finish_non_exhaustive()
    }
}

/// One delivery from RabbitMQ: the message and what settles it.
pub struct RabbitMqDelivery {
    message: ReceivedMessage,
    /// The `message-id` the message came with (the claim's id may come from elsewhere):
    /// copies of the message keep it.
    original_id: Option<MessageId>,
    acker: lapin::Acker,
    lock: Arc<Lock>,
}

impl fmt::Debug for RabbitMqDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqDelivery")
            .field("message_id", self.message.message_id())
            .field("delivery_count", &self.message.delivery_count)
            .finish_non_exhaustive()
    }
}

impl RabbitMqDelivery {
    /// The `message-id` property the message came with, if any (the id the inbox claims may
    /// come from elsewhere, by the identity policy; on a dead-letter queue a message without
    /// one is shown under a random id).
    pub fn original_message_id(&self) -> Option<&MessageId> {
        self.original_id.as_ref()
    }
}

impl Delivery for RabbitMqDelivery {
    fn message(&self) -> &ReceivedMessage {
        &self.message
    }
}

/// Maps a lapin error to a transport error, by AMQP reply code, never by text.
pub(crate) fn map_error(queue: &str, e: lapin::Error) -> TransportError {
    let transient = match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => {
                return TransportError::EntityNotFound(queue.to_owned());
            }
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => {
                return TransportError::Invalid(format!("queue {queue:?}: {amqp}"));
            }
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => false,
            _ => true,
        },
        lapin::ErrorKind::AuthProviderError(_) | lapin::ErrorKind::InvalidProtocolVersion(_) => {
            false
        }
        _ => true,
    };
    TransportError::Other { message: e.to_string(), transient, source: Some(Box::new(e)) }
}

impl RabbitMqTransport {
    /// Connects, reads the server's version, and finds the queue and its dead-letter queue:
    /// declared where they are missing (unless [`RabbitMqOptions::declare`] is off), the queue
    /// a quorum queue with `x-delivery-limit` and a dead-letter exchange; used as they are where
    /// they exist, with [`RabbitMqTransport::notes`] saying what is missing.
    ///
    /// # Errors
    ///
    /// When the broker is unreachable, the queue is missing and may not be declared
    /// ([`TransportError::EntityNotFound`]), or the broker refuses it.
    pub async fn connect(options: RabbitMqOptions) -> Result<Self, TransportError> {
        Self::open(options, Role::Main).await
    }

    async fn open(options: RabbitMqOptions, role: Role) -> Result<Self, TransportError> {
        let dead_letter_queue = dead_letter_queue_name(&options.queue);
        let connection = Connection::connect(&options.uri, ConnectionProperties::default())
            .await
            .map_err(|e| map_error(&options.queue, e))?;
        let mut notes = Vec::new();
        let version = match version::probe(&options.uri).await {
            Ok(Some(v)) => Some(v),
            Ok(None) | Err(_) => {
                notes.push(
                    "the server's version is unknown: RabbitMQ 3.x semantics are assumed".into(),
                );
                None
            }
        };
        let dead_letter_args = declare::arguments(version, None, None, None)?;
        let queue = match role {
            Role::DeadLetter => {
                declare::find(&connection, &options.queue, dead_letter_args, options.declare)
                    .await?
            }
            Role::Main => {
                // The dead-letter queue is the transport's own: made when missing.
                declare::find(&connection, &dead_letter_queue, dead_letter_args, options.declare)
                    .await?;
                let wanted = declare::arguments(
                    version,
                    options.max_delivery_count,
                    options.message_time_to_live,
                    Some(&dead_letter_queue),
                )?;
                declare::find(&connection, &options.queue, wanted, options.declare).await?
            }
        };
        let _ = connection.close(200, "connected".into()).await;
        let counting = if version.is_some_and(|v| !v.counts_nack()) || !queue.is_quorum() {
            Counting::Transport
        } else {
            Counting::Broker
        };
        let info = entity_info(&options, role, &queue);
        if role == Role::Main {
            notes.extend(queue_notes(&options, version, &queue, &dead_letter_queue));
        }
        for note in &notes {
            tracing::warn!(queue = %options.queue, "{note}");
        }
        let transport = Self {
            inner: Arc::new(Inner {
                options,
                role,
                info,
                dead_letter_queue,
                version,
                counting,
                notes,
                generations: AtomicU64::new(0),
                held: Arc::default(),
                link: tokio::sync::Mutex::new(None),
                consuming: tokio::sync::Mutex::new(None),
            }),
        };
        transport.link().await?;
        Ok(transport)
    }

    /// A transport on this queue's dead-letter queue (`<queue>.dead-letter`), on a connection
    /// of its own. Its messages carry the reason in
    /// [`ReceivedMessage::dead_letter_reason`].
    ///
    /// # Errors
    ///
    /// As [`RabbitMqTransport::connect`].
    pub async fn dead_letter_receiver(&self) -> Result<Self, TransportError> {
        let mut options = self.inner.options.clone();
        options.queue.clone_from(&self.inner.dead_letter_queue);
        Self::open(options, Role::DeadLetter).await
    }

    /// The queue's name.
    pub fn queue(&self) -> &str {
        &self.inner.options.queue
    }

    /// The server's version, read at connect (`None` when it said none).
    pub fn server_version(&self) -> Option<ServerVersion> {
        self.inner.version
    }

    /// What connecting found missing or set otherwise than the options say, each in one line
    /// with how to change it (also logged as warnings): empty for queues this transport
    /// declared on a known server.
    pub fn notes(&self) -> &[String] {
        &self.inner.notes
    }

    fn err(&self, e: lapin::Error) -> TransportError {
        map_error(&self.inner.options.queue, e)
    }

    /// The current connection, connecting again when it was lost.
    async fn link(&self) -> Result<Arc<Link>, TransportError> {
        let mut guard = self.inner.link.lock().await;
        if let Some(link) = guard.as_ref()
            && link.connection.status().connected()
            && link.publisher.status().connected()
        {
            return Ok(Arc::clone(link));
        }
        *guard = None;
        let o = &self.inner.options;
        let connection = Connection::connect(&o.uri, ConnectionProperties::default())
            .await
            .map_err(|e| self.err(e))?;
        let publisher = connection.create_channel().await.map_err(|e| self.err(e))?;
        publisher.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| self.err(e))?;
        let generation = self.inner.generations.fetch_add(1, Ordering::SeqCst) + 1;
        let link = Arc::new(Link { generation, connection, publisher });
        *guard = Some(Arc::clone(&link));
        Ok(link)
    }

    /// Sends a message with a publisher confirm: when this returns, RabbitMQ has it. A message
    /// without an id is given a random one before the first attempt, and a publish that was not
    /// confirmed is tried again with it for up to [`RabbitMqOptions::send_timeout`]. Returns the
    /// message id.
    ///
    /// # Errors
    ///
    /// [`TransportError::EntityNotFound`] when the queue does not exist; a transient error when
    /// no attempt was confirmed in time (the message may or may not have been stored: to send it
    /// again yourself, give it an id first).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored.
    pub async fn send(&self, mut message: Message) -> Result<MessageId, TransportError> {
        let id = message.message_id.get_or_insert_with(MessageId::random).clone();
        let clock = &self.inner.options.clock;
        let properties = convert::to_amqp(&message, clock.now(), &[])?;
        let queue = self.inner.options.queue.clone();
        let until = clock.now() + self.inner.options.send_timeout;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.publish_to(&queue, &message.body, properties.clone()).await {
                Ok(()) => return Ok(id),
                Err(e) if e.is_transient() && clock.now() + pause < until => {
                    tracing::debug!(queue = %queue, id = %id, "a publish was not confirmed; trying again with the same id: {e}");
                    clock.sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(crate) async fn publish_to(
        &self,
        queue: &str,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), TransportError> {
        self.publish_all(queue, vec![(body, properties)]).await.map_err(|e| e.error)
    }

    /// Publishes every message to `queue` in order (mandatory, confirmed), then waits for the
    /// confirms: one round trip's wait for the lot instead of one per message. On an error,
    /// says how many of the first messages were confirmed.
    pub(crate) async fn publish_all(
        &self,
        queue: &str,
        messages: Vec<(&[u8], lapin::BasicProperties)>,
    ) -> Result<(), twice::outbox::BatchError> {
        use twice::outbox::BatchError;
        let link = self.link().await.map_err(BatchError::none)?;
        let routing = declare::short(queue).map_err(BatchError::none)?;
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let mut confirms = Vec::with_capacity(messages.len());
        for (body, properties) in messages {
            let confirm = link
                .publisher
                .basic_publish("".into(), routing.clone(), options, body, properties)
                .await
                .map_err(|e| BatchError::none(self.err(e)))?;
            confirms.push(confirm);
        }
        for (stored, confirm) in confirms.into_iter().enumerate() {
            let error = match confirm.await {
                Ok(lapin::Confirmation::Ack(None)) => continue,
                // A mandatory message that no queue took comes back before the confirm.
                Ok(lapin::Confirmation::Ack(Some(_))) => {
                    TransportError::EntityNotFound(queue.to_owned())
                }
                Ok(_) => TransportError::Other {
                    message: format!("RabbitMQ refused a message for {queue:?}"),
                    transient: true,
                    source: None,
                },
                Err(e) => self.err(e),
            };
            return Err(BatchError { stored, error });
        }
        Ok(())
    }

    /// Deletes the queue and its dead-letter queue, with their messages.
    ///
    /// # Errors
    ///
    /// When the broker is unreachable.
    pub async fn delete(&self) -> Result<(), TransportError> {
        if let Some(c) = self.inner.consuming.lock().await.take() {
            let _ = c.channel.close(200, "deleting".into()).await;
        }
        let link = self.link().await?;
        for q in [&self.inner.options.queue, &self.inner.dead_letter_queue] {
            let Ok(q) = ShortString::try_new(q.as_str()) else { continue };
            link.publisher
                .queue_delete(q, QueueDeleteOptions::default())
                .await
                .map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// How many messages wait in the queue, not counting those delivered and not yet settled.
    ///
    /// # Errors
    ///
    /// When the broker is unreachable or the queue does not exist.
    pub async fn ready_count(&self) -> Result<u64, TransportError> {
        let link = self.link().await?;
        // A passive declare on a channel of its own: refused, it closes only that channel.
        let ch = link.connection.create_channel().await.map_err(|e| self.err(e))?;
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        let declared = ch
            .queue_declare(declare::short(self.queue())?, passive, FieldTable::default())
            .await
            .map_err(|e| self.err(e))?;
        let _ = ch.close(200, "done".into()).await;
        Ok(u64::from(declared.message_count()))
    }

    /// Removes every message waiting in the queue (not those delivered and not yet settled);
    /// returns how many. For emptying a queue before a run, not for dead-lettered messages,
    /// which deserve a copy first (`twice dlq purge`).
    ///
    /// # Errors
    ///
    /// When the broker is unreachable or the queue does not exist.
    pub async fn purge(&self) -> Result<u64, TransportError> {
        let link = self.link().await?;
        let ch = link.connection.create_channel().await.map_err(|e| self.err(e))?;
        let purged = ch
            .queue_purge(
                declare::short(self.queue())?,
                lapin::options::QueuePurgeOptions::default(),
            )
            .await
            .map_err(|e| self.err(e))?;
        let _ = ch.close(200, "done".into()).await;
        Ok(u64::from(purged))
    }

    /// How many deliveries have reached this transport and are neither settled nor past their
    /// lock (handed out, or waiting in the client for a `receive`): with
    /// [`RabbitMqTransport::ready_count`], the messages not yet done.
    pub fn unsettled(&self) -> u64 {
        self.inner.held.load(Ordering::SeqCst)
    }

    /// Closes the connection; deliveries not settled go back to the queue.
    pub async fn close(&self) {
        let _ = self.inner.consuming.lock().await.take();
        if let Some(link) = self.inner.link.lock().await.take() {
            let _ = link.connection.close(200, "closed".into()).await;
        }
    }

    /// Makes the delivery of `d` the moment it reaches the client: its lock starts now. `None`
    /// for a message that is moved to the dead-letter queue instead of being handed out (no id
    /// by the identity policy, or delivered more than MaxDeliveryCount times).
    fn accept(&self, d: lapin::message::Delivery) -> Option<RabbitMqDelivery> {
        let clock = &self.inner.options.clock;
        let now = clock.now();
        let mut message = convert::from_amqp(&d, now);
        let original_id = message.message.message_id.clone();
        let claimed = self.inner.options.identity.identify(&message.message);
        let lock = Arc::new(Lock::new(
            now + self.inner.options.lock_duration,
            now + self.inner.options.consumer_timeout,
            Arc::clone(&self.inner.held),
        ));
        let delivery = |message: ReceivedMessage| RabbitMqDelivery {
            message,
            original_id: original_id.clone(),
            acker: d.acker.clone(),
            lock: Arc::clone(&lock),
        };
        if self.inner.role == Role::DeadLetter {
            // A dead-letter queue has nowhere further to send it: it is shown, under an id of
            // its own for this delivery when it has none.
            message.message.message_id =
                claimed.or_else(|| original_id.clone()).or_else(|| Some(MessageId::random()));
        } else {
            let max = self.inner.info.max_delivery_count;
            let reason = match (&claimed, max) {
                (None, _) => Some(DeadLetterReason::new(
                    MISSING_MESSAGE_ID,
                    "the identity policy found no id for it, so its copies cannot be told apart",
                )),
                (Some(_), Some(max)) if message.delivery_count > max => {
                    Some(DeadLetterReason::new(
                        MAX_DELIVERY_COUNT_EXCEEDED,
                        format!("delivered more than {max} times"),
                    ))
                }
                _ => None,
            };
            message.message.message_id = claimed;
            if let Some(reason) = reason {
                lock.take_now();
                let this = self.clone();
                let d = delivery(message);
                tokio::spawn(async move {
                    if let Err(e) = this.move_to_dead_letter_queue(&d, &reason).await {
                        tracing::warn!(queue = %this.queue(), "moving a message to the dead-letter queue failed (it was requeued): {e}");
                    }
                });
                return None;
            }
        }
        message.lock_token = Some(twice::LockToken::random());
        message.locked_until = Some(lock.locked_until());
        let out = delivery(message);
        let weak = Arc::downgrade(&self.inner);
        let (expired, acker) = (out.copy_for_return(), d.acker.clone());
        Lock::expire_later(&lock, clock.clone(), move || return_later(weak, expired, acker));
        Some(out)
    }

    /// Returns a delivery to the queue, counting a delivery: a requeueing `basic.nack` where
    /// the broker counts it, otherwise a confirmed copy carrying the count and an ack of the
    /// original (requeued with a nack if the copy fails).
    async fn return_counted(
        &self,
        message: &ReceivedMessage,
        original_id: Option<&MessageId>,
        acker: &lapin::Acker,
    ) -> Result<(), TransportError> {
        let requeue = BasicNackOptions { requeue: true, ..BasicNackOptions::default() };
        if self.inner.counting == Counting::Broker {
            return settled(acker.nack(requeue).await);
        }
        let mut copy = message.message.clone();
        copy.message_id = original_id.cloned();
        let count = i64::from(message.delivery_count);
        let extra = [(convert::RETURNS, AMQPValue::LongLongInt(count))];
        let properties = convert::to_amqp(&copy, message.enqueued_time, &extra)?;
        let queue = self.inner.options.queue.clone();
        if let Err(e) = self.publish_to(&queue, &copy.body, properties).await {
            tracing::warn!(queue = %queue, "returning a message with its count failed; requeued without it: {e}");
            return settled(acker.nack(requeue).await);
        }
        settled(acker.ack(lapin::options::BasicAckOptions::default()).await)
    }

    /// Publishes a copy to the dead-letter queue with the reason, then acks the original; when
    /// the copy is refused, the original is requeued.
    async fn move_to_dead_letter_queue(
        &self,
        delivery: &RabbitMqDelivery,
        reason: &DeadLetterReason,
    ) -> Result<(), TransportError> {
        let message = &delivery.message;
        let count = i64::from(message.delivery_count);
        let source = self.queue().to_owned();
        let extra = [
            (convert::DEAD_LETTER_REASON, AMQPValue::LongString(reason.reason.as_str().into())),
            (
                convert::DEAD_LETTER_DESCRIPTION,
                AMQPValue::LongString(reason.description.as_str().into()),
            ),
            (convert::DEAD_LETTER_SOURCE, AMQPValue::LongString(source.as_str().into())),
            (convert::DELIVERY_COUNT, AMQPValue::LongLongInt(count)),
        ];
        let mut copy = message.message.clone();
        copy.message_id.clone_from(&delivery.original_id);
        let properties = convert::to_amqp(&copy, message.enqueued_time, &extra)?;
        let dlq = self.inner.dead_letter_queue.clone();
        if let Err(e) = self.publish_to(&dlq, &copy.body, properties).await {
            let requeue = BasicNackOptions { requeue: true, ..BasicNackOptions::default() };
            let _ = delivery.acker.nack(requeue).await;
            return Err(e);
        }
        settled(delivery.acker.ack(lapin::options::BasicAckOptions::default()).await)
    }

    /// Takes the settlement of `delivery` for this call, or says the lock is lost.
    fn take(&self, delivery: &RabbitMqDelivery) -> Result<(), TransportError> {
        if delivery.lock.take(self.inner.options.clock.now()) {
            Ok(())
        } else {
            Err(TransportError::LockLost)
        }
    }
}

/// What the expiry of a delivery's lock needs of it.
struct Returned {
    message: ReceivedMessage,
    original_id: Option<MessageId>,
}

impl RabbitMqDelivery {
    fn copy_for_return(&self) -> Returned {
        Returned { message: self.message.clone(), original_id: self.original_id.clone() }
    }
}

/// The expiry of a lock: the delivery goes back to the queue, counted.
fn return_later(
    weak: Weak<Inner>,
    returned: Returned,
    acker: lapin::Acker,
) -> futures::future::BoxFuture<'static, ()> {
    async move {
        let Some(inner) = weak.upgrade() else {
            // The transport is gone, and with it the channel: the broker requeued it.
            return;
        };
        let t = RabbitMqTransport { inner };
        // A failure means the channel is gone, and the broker requeued it anyway.
        let _ = t.return_counted(&returned.message, returned.original_id.as_ref(), &acker).await;
    }
    .boxed()
}

/// The entity's path, and so the processor's default consumer (the scope of its claims): the
/// queue's name in the default vhost `/`, and `<vhost>/<queue>` in any other, so that queues of
/// one name in two vhosts are two entities whose claims never meet.
pub fn entity_path(uri: &str, queue: &str) -> String {
    let vhost = uri.parse::<lapin::uri::AMQPUri>().map(|u| u.vhost).unwrap_or_else(|_| "/".into());
    if vhost == "/" { queue.to_owned() } else { format!("{vhost}/{queue}") }
}

/// What the entity is, as the queue has it.
fn entity_info(options: &RabbitMqOptions, role: Role, queue: &declare::Queue) -> EntityInfo {
    let mut info = EntityInfo::new(entity_path(&options.uri, &options.queue));
    info.lock_duration = options.lock_duration;
    info.duplicate_detection_window = None;
    info.requires_session = false;
    if role == Role::DeadLetter {
        // Dead-lettered messages stay until someone takes them, however often returned.
        info.max_delivery_count = None;
        info.message_time_to_live = None;
        return info;
    }
    let limit = queue
        .argument("x-delivery-limit")
        .and_then(convert::integer)
        .and_then(|n| u32::try_from(n).ok())
        .map(|n| n.saturating_add(1));
    info.max_delivery_count = match (options.max_delivery_count, limit) {
        (Some(w), Some(l)) => Some(w.min(l)),
        (w, l) => w.or(l),
    };
    info.message_time_to_live = match queue.arguments {
        Some(_) => queue
            .argument("x-message-ttl")
            .and_then(convert::integer)
            .and_then(|ms| u64::try_from(ms).ok())
            .map(Duration::from_millis)
            .or(options.message_time_to_live),
        None => options.message_time_to_live,
    };
    info
}

/// One line for each thing an existing queue lacks, with how to add it.
fn queue_notes(
    options: &RabbitMqOptions,
    version: Option<ServerVersion>,
    queue: &declare::Queue,
    dead_letter_queue: &str,
) -> Vec<String> {
    let name = &options.queue;
    let mut notes = Vec::new();
    if let Some(why) = &queue.unreadable {
        notes.push(format!("queue {name}: its arguments could not be read ({why})"));
        return notes;
    }
    if queue.created {
        return notes;
    }
    let policy = |definition: &str| {
        format!(
            "rabbitmqctl set_policy {name}-twice '^{}$' '{definition}' --apply-to queues",
            name.replace('.', "\\.")
        )
    };
    if !queue.is_quorum() {
        notes.push(format!(
            "queue {name} is not a quorum queue: RabbitMQ counts no deliveries on it, so the \
             transport counts them itself (a return republishes the message with its count); a \
             quorum queue counts them and keeps the message in place"
        ));
    }
    let limit = queue.argument("x-delivery-limit").and_then(convert::integer);
    let default_limit = version.is_some_and(ServerVersion::has_default_delivery_limit);
    if queue.is_quorum() && limit.is_none() && !default_limit {
        notes.push(format!(
            "queue {name} has no delivery limit: past MaxDeliveryCount the transport moves a \
             message itself, but only while a twice transport consumes; to make the broker do it, \
             add one: {}",
            policy(r#"{"delivery-limit": 9}"#)
        ));
    }
    if queue.argument("x-dead-letter-exchange").is_none() {
        notes.push(format!(
            "queue {name} has no dead-letter target (unless a policy gives one): what RabbitMQ \
             dead-letters itself (delivery limit, expiry) is dropped; add one: {}",
            policy(&format!(
                r#"{{"dead-letter-exchange": "", "dead-letter-routing-key": "{dead_letter_queue}"}}"#
            ))
        ));
    }
    notes
}

/// What an acker's answer means for the settlement: anything but a sent ack means the delivery
/// is gone with its channel, and the broker has requeued it.
fn settled(r: Result<bool, lapin::Error>) -> Result<(), TransportError> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) | Err(_) => Err(TransportError::LockLost),
    }
}

impl Receive for RabbitMqTransport {
    type Delivery = RabbitMqDelivery;

    /// # Cancel safety
    ///
    /// Cancel safe: deliveries not yet taken from the queue of arrivals stay there for the next
    /// call, and those taken are returned without another await.
    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<RabbitMqDelivery>, TransportError> {
        if max_messages == 0 {
            return Ok(Vec::new());
        }
        let timer = tokio::time::sleep(max_wait);
        tokio::pin!(timer);
        let mut guard = self.inner.consuming.lock().await;
        let link = self.link().await?;
        if !guard.as_ref().is_some_and(|c| c.is_current(link.generation)) {
            *guard = None;
            *guard = Some(consume::start(self, &link.connection, link.generation).await?);
        }
        let Some(consuming) = guard.as_mut() else { return Ok(Vec::new()) };
        let clock = &self.inner.options.clock;
        let mut out = Vec::new();
        while out.is_empty() {
            let next = tokio::select! {
                () = &mut timer => return Ok(out),
                next = consuming.arrivals.recv() => next,
            };
            let Some(first) = next else {
                *guard = None;
                return Err(TransportError::Other {
                    message: "the RabbitMQ consumer ended (its channel or connection closed)"
                        .into(),
                    transient: true,
                    source: None,
                });
            };
            // One whose lock ran out while it waited here is being returned by its expiry.
            let now = clock.now();
            out.extend(Some(first).filter(|d| d.lock.holds(now)));
            while out.len() < max_messages {
                match consuming.arrivals.try_recv() {
                    Ok(d) => out.extend(Some(d).filter(|d| d.lock.holds(now))),
                    Err(_) => break,
                }
            }
        }
        Ok(out)
    }

    async fn complete(&self, delivery: &RabbitMqDelivery) -> Result<(), TransportError> {
        self.take(delivery)?;
        settled(delivery.acker.ack(lapin::options::BasicAckOptions::default()).await)
    }

    async fn abandon(
        &self,
        delivery: &RabbitMqDelivery,
        properties: Properties,
    ) -> Result<(), TransportError> {
        if !properties.is_empty() {
            return Err(TransportError::Unsupported("abandon with properties on RabbitMQ"));
        }
        self.take(delivery)?;
        self.return_counted(&delivery.message, delivery.original_id.as_ref(), &delivery.acker).await
    }

    async fn dead_letter(
        &self,
        delivery: &RabbitMqDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        if self.inner.role == Role::DeadLetter {
            return Err(TransportError::Unsupported("dead-lettering from a dead-letter queue"));
        }
        self.take(delivery)?;
        self.move_to_dead_letter_queue(delivery, &reason).await
    }

    async fn defer(&self, _delivery: &RabbitMqDelivery) -> Result<(), TransportError> {
        Err(TransportError::Unsupported("defer on RabbitMQ"))
    }
}

impl Transport for RabbitMqTransport {
    fn entity(&self) -> &EntityInfo {
        &self.inner.info
    }

    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    async fn release(&self, delivery: &RabbitMqDelivery) -> Result<(), TransportError> {
        self.take(delivery)?;
        let requeue = BasicNackOptions { requeue: true, ..BasicNackOptions::default() };
        settled(delivery.acker.nack(requeue).await)
    }

    async fn renew_lock(&self, delivery: &RabbitMqDelivery) -> Result<Timestamp, TransportError> {
        let now = self.inner.options.clock.now();
        delivery.lock.renew(now, self.inner.options.lock_duration).ok_or(TransportError::LockLost)
    }
}
