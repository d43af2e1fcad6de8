//! A RabbitMQ transport for twice: the idempotent processor on a RabbitMQ quorum queue.
//!
//! ```no_run
//! # async fn example() -> Result<(), twice::TransportError> {
//! use twice::{Message, Receive as _, Transport as _};
//! use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
//!
//! let orders = RabbitMqTransport::connect(
//!     RabbitMqOptions::new("amqp://guest:guest@127.0.0.1:5672/%2f", "orders"),
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
//! | the entity | a durable quorum queue (declared on connect, with the arguments below) |
//! | `send` | `basic.publish` with publisher confirms, persistent, `mandatory` |
//! | `receive` | `basic.consume` with manual acks and a prefetch (`basic.qos`) |
//! | `complete` | `basic.ack` |
//! | `abandon`, `release` | `basic.nack` with requeue: the quorum queue counts a delivery either way |
//! | `dead_letter` | a confirmed publish of the message to the dead-letter queue with the reason in headers, then `basic.ack` |
//! | DefaultMessageTimeToLive | `x-message-ttl` ([`RabbitMqOptions::message_time_to_live`]); an expired message is dead-lettered |
//! | MaxDeliveryCount | `x-delivery-limit` = MaxDeliveryCount − 1, with `x-dead-letter-exchange` to the dead-letter queue (`at-least-once`) |
//! | delivery count | `x-delivery-count` + 1 (the header counts returns; absent on the first delivery) |
//! | message id | the `message-id` property |
//! | lock, `renew_lock` | a lock kept by this transport; see below |
//! | `defer`, sessions, duplicate detection | none: [`TransportError::Unsupported`], or nothing (see below) |
//!
//! # The lock
//!
//! RabbitMQ has no lock with a duration: a delivery stays with its channel until it is acked,
//! the channel closes, or the broker's `consumer_timeout` (30 minutes by default) closes the
//! channel. So this transport keeps the lock itself: each delivery is locked for
//! [`RabbitMqOptions::lock_duration`] from the moment `receive` returns it. When the lock runs
//! out, the transport nacks the delivery with requeue (its count rises, as Service Bus counts an
//! expired lock), and a later settlement of that delivery fails with
//! [`TransportError::LockLost`]. `renew_lock` extends the lock by another lock duration, but
//! never past `consumer_timeout` after the delivery: renewing can only shorten what the broker
//! would allow, never lengthen it. A process that dies loses its channel, and RabbitMQ requeues
//! its deliveries at once.
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
//! - **A release that does not count.** `release` requeues, and the quorum queue counts it.
//! - **Sequence numbers.** The sequence number of a delivery is its delivery tag: unique on its
//!   channel, not stable across deliveries.
//!
//! # A message without an id
//!
//! A message whose `message-id` property is missing or empty cannot be told apart from another
//! (RabbitMQ gives a message no identity of its own), so it is never handed to a handler: the
//! transport moves it to the dead-letter queue with the reason [`MISSING_MESSAGE_ID`]. Its
//! [`send`](RabbitMqTransport::send) gives every message an id (a random one when the message has
//! none), so this only meets messages published by other clients. A receiver on the
//! dead-letter queue gets such a message with a random id, new on every delivery.
//!
//! # Connection loss
//!
//! A lost connection is noticed by the next call, which connects again and consumes again.
//! Deliveries of the old connection were requeued by the broker; settling them fails with
//! [`TransportError::LockLost`].

mod convert;
mod lock;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use lapin::options::{
    BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, Consumer};
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, Receive,
    ReceivedMessage, SharedClock, Timestamp, Transport, TransportError,
};

use crate::lock::Lock;

pub use twice::dead_letter_reasons::{MAX_DELIVERY_COUNT_EXCEEDED, MISSING_MESSAGE_ID};

/// The name of the dead-letter queue of `queue`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    format!("{queue}.dead-letter")
}

/// Options of a [`RabbitMqTransport`], with Service Bus names and defaults where Service Bus has
/// the concept.
#[derive(Clone, Debug)]
pub struct RabbitMqOptions {
    uri: String,
    queue: String,
    lock_duration: Duration,
    consumer_timeout: Duration,
    max_delivery_count: Option<u32>,
    message_time_to_live: Option<Duration>,
    prefetch: u16,
    declare: bool,
    clock: SharedClock,
}

impl RabbitMqOptions {
    /// Options for `queue` on the broker at `uri` (`amqp://user:pass@host:port/vhost`), with the
    /// defaults: lock 60 s, `consumer_timeout` 30 minutes (RabbitMQ's default), MaxDeliveryCount
    /// 10, no message time to live, prefetch 64, the queues declared on connect, the system
    /// clock.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            queue: queue.into(),
            lock_duration: Duration::from_secs(60),
            consumer_timeout: Duration::from_secs(30 * 60),
            max_delivery_count: Some(10),
            message_time_to_live: None,
            prefetch: 64,
            declare: true,
            clock: SharedClock::system(),
        }
    }

    /// How long a delivery stays locked to this receiver without a renewal (default 60 s).
    #[must_use]
    pub fn lock_duration(mut self, d: Duration) -> Self {
        self.lock_duration = d;
        self
    }

    /// The lock duration.
    pub fn get_lock_duration(&self) -> Duration {
        self.lock_duration
    }

    /// The broker's `consumer_timeout` (default 30 minutes, RabbitMQ's own default): no lock
    /// outlasts it. Set it to what the server is configured with.
    #[must_use]
    pub fn consumer_timeout(mut self, d: Duration) -> Self {
        self.consumer_timeout = d;
        self
    }

    /// The broker's `consumer_timeout` as configured here.
    pub fn get_consumer_timeout(&self) -> Duration {
        self.consumer_timeout
    }

    /// Deliveries before a message is dead-lettered (default 10; `None`: unlimited). It becomes
    /// the queue's `x-delivery-limit` when the queue is declared.
    #[must_use]
    pub fn max_delivery_count(mut self, n: Option<u32>) -> Self {
        self.max_delivery_count = n.map(|n| n.max(1));
        self
    }

    /// Deliveries before a message is dead-lettered.
    pub fn get_max_delivery_count(&self) -> Option<u32> {
        self.max_delivery_count
    }

    /// How long a message may wait in the queue (default `None`: forever). It becomes the
    /// queue's `x-message-ttl` when the queue is declared, and
    /// [`EntityInfo::message_time_to_live`], which the processor checks the inbox's retention
    /// against. An expired message is dead-lettered with the reason `TTLExpiredException`.
    ///
    /// AMQP 0-9-1 cannot read a queue's arguments or policies back: a queue declared elsewhere
    /// (with [`declare`](Self::declare) off) or given a `message-ttl` policy should be
    /// described here with the same time to live (RabbitMQ applies the shorter of argument
    /// and policy).
    #[must_use]
    pub fn message_time_to_live(mut self, ttl: Option<Duration>) -> Self {
        self.message_time_to_live = ttl;
        self
    }

    /// How long a message may wait in the queue.
    pub fn get_message_time_to_live(&self) -> Option<Duration> {
        self.message_time_to_live
    }

    /// How many unacknowledged deliveries RabbitMQ sends ahead (`basic.qos`, default 64, at
    /// least 1).
    #[must_use]
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// The prefetch.
    pub fn get_prefetch(&self) -> u16 {
        self.prefetch
    }

    /// Whether to declare the queue and its dead-letter queue on connect (default true). A queue
    /// that exists with other arguments is refused with [`TransportError::Invalid`].
    #[must_use]
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// The clock for locks (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The queue.
    pub fn get_queue(&self) -> &str {
        &self.queue
    }

    /// The server's URI.
    pub fn get_uri(&self) -> &str {
        &self.uri
    }

    /// Whether the transport declares the queue and its dead-letter queue.
    pub fn get_declare(&self) -> bool {
        self.declare
    }

    /// The clock for lock deadlines.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// What a queue is for: its arguments differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A queue with a delivery limit that dead-letters into its dead-letter queue.
    Main,
    /// A dead-letter queue: no limit, no dead-lettering of its own.
    DeadLetter,
}

/// One connection and its publishing channel.
struct Link {
    generation: u64,
    connection: Connection,
    publisher: Channel,
}

/// The consuming channel and its consumer.
struct Consuming {
    generation: u64,
    channel: Channel,
    consumer: Consumer,
}

struct Inner {
    options: RabbitMqOptions,
    role: Role,
    info: EntityInfo,
    dead_letter_queue: String,
    generations: AtomicU64,
    /// Deliveries handed out and neither settled nor expired.
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
            .finish_non_exhaustive()
    }
}

/// One delivery from RabbitMQ: the message and what settles it.
pub struct RabbitMqDelivery {
    message: ReceivedMessage,
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
    /// Connects and (unless [`RabbitMqOptions::declare`] is off) declares the queue, a quorum
    /// queue with `x-delivery-limit` and a dead-letter exchange, and its dead-letter queue.
    ///
    /// # Errors
    ///
    /// When the broker is unreachable, or the queue exists with other arguments
    /// ([`TransportError::Invalid`]).
    pub async fn connect(options: RabbitMqOptions) -> Result<Self, TransportError> {
        Self::open(options, Role::Main).await
    }

    async fn open(options: RabbitMqOptions, role: Role) -> Result<Self, TransportError> {
        let mut info = EntityInfo::new(options.queue.clone());
        info.lock_duration = options.lock_duration;
        info.max_delivery_count = match role {
            Role::Main => options.max_delivery_count,
            Role::DeadLetter => None,
        };
        info.duplicate_detection_window = None;
        info.requires_session = false;
        info.message_time_to_live = match role {
            Role::Main => options.message_time_to_live,
            // Dead-lettered messages stay until someone takes them.
            Role::DeadLetter => None,
        };
        let dead_letter_queue = dead_letter_queue_name(&options.queue);
        let transport = Self {
            inner: Arc::new(Inner {
                options,
                role,
                info,
                dead_letter_queue,
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
        if o.declare {
            self.declare(&publisher).await?;
        }
        let generation = self.inner.generations.fetch_add(1, Ordering::SeqCst) + 1;
        let link = Arc::new(Link { generation, connection, publisher });
        *guard = Some(Arc::clone(&link));
        Ok(link)
    }

    async fn declare(&self, channel: &Channel) -> Result<(), TransportError> {
        let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        let quorum = || {
            let mut args = FieldTable::default();
            args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
            args
        };
        let dlq = self.inner.dead_letter_queue.as_str();
        let name = |s: &str| {
            ShortString::try_new(s)
                .map_err(|_| TransportError::Invalid(format!("queue name {s:?} is too long")))
        };
        match self.inner.role {
            Role::DeadLetter => {
                channel
                    .queue_declare(name(&self.inner.options.queue)?, durable, quorum())
                    .await
                    .map_err(|e| self.err(e))?;
            }
            Role::Main => {
                channel
                    .queue_declare(name(dlq)?, durable, quorum())
                    .await
                    .map_err(|e| self.err(e))?;
                let mut args = quorum();
                if let Some(n) = self.inner.options.max_delivery_count {
                    // The quorum queue dead-letters a message returned with more returns than
                    // the limit: a limit of n − 1 returns allows n deliveries.
                    args.insert(
                        "x-delivery-limit".into(),
                        AMQPValue::LongLongInt(i64::from(n - 1)),
                    );
                }
                if let Some(ttl) = self.inner.options.message_time_to_live {
                    let millis = i64::try_from(ttl.as_millis()).map_err(|_| {
                        TransportError::Invalid(format!("message time to live {ttl:?} is too long"))
                    })?;
                    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(millis));
                }
                args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
                args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(dlq.into()));
                // At-least-once dead-lettering (the message leaves the queue only once the
                // dead-letter queue has it) requires rejecting publishes on overflow.
                args.insert(
                    "x-dead-letter-strategy".into(),
                    AMQPValue::LongString("at-least-once".into()),
                );
                args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
                channel
                    .queue_declare(name(&self.inner.options.queue)?, durable, args)
                    .await
                    .map_err(|e| self.err(e))?;
            }
        }
        Ok(())
    }

    /// Sends a message with a publisher confirm: when this returns, RabbitMQ has it. A message
    /// without an id is given a random one. Returns the message id.
    ///
    /// # Errors
    ///
    /// [`TransportError::EntityNotFound`] when the queue does not exist; a transient error when
    /// the broker refused the message or the connection was lost (the message may or may not
    /// have been stored: send it again with the same id).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored.
    pub async fn send(&self, mut message: Message) -> Result<MessageId, TransportError> {
        let id = message.message_id.get_or_insert_with(MessageId::random).clone();
        let now = self.inner.options.clock.now();
        let properties = convert::to_amqp(&message, now, &[])?;
        let queue = self.inner.options.queue.clone();
        self.publish(&queue, &message.body, properties).await?;
        Ok(id)
    }

    async fn publish(
        &self,
        queue: &str,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), TransportError> {
        let link = self.link().await?;
        let routing = ShortString::try_new(queue)
            .map_err(|_| TransportError::Invalid(format!("queue name {queue:?} is too long")))?;
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let confirm = link
            .publisher
            .basic_publish("".into(), routing, options, body, properties)
            .await
            .map_err(|e| self.err(e))?
            .await
            .map_err(|e| self.err(e))?;
        match confirm {
            lapin::Confirmation::Ack(None) => Ok(()),
            // A mandatory message that no queue took comes back before the confirm.
            lapin::Confirmation::Ack(Some(_)) => {
                Err(TransportError::EntityNotFound(queue.to_owned()))
            }
            _ => Err(TransportError::Other {
                message: format!("RabbitMQ refused a message for {queue:?}"),
                transient: true,
                source: None,
            }),
        }
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
        let q = ShortString::try_new(self.inner.options.queue.as_str())
            .map_err(|_| TransportError::Invalid("queue name too long".into()))?;
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        let declared =
            ch.queue_declare(q, passive, FieldTable::default()).await.map_err(|e| self.err(e))?;
        let _ = ch.close(200, "done".into()).await;
        Ok(u64::from(declared.message_count()))
    }

    /// How many deliveries this transport has handed out that are neither settled nor past
    /// their lock: with [`RabbitMqTransport::ready_count`], the messages not yet done.
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

    /// Makes a delivery of `delivery` from the lapin delivery; `None` for a message without an
    /// id, which is moved to the dead-letter queue instead.
    fn accept(&self, d: lapin::message::Delivery) -> Option<RabbitMqDelivery> {
        let clock = &self.inner.options.clock;
        let now = clock.now();
        let mut message = convert::from_amqp(&d, now);
        let anonymous = message.message.message_id.as_ref().is_none_or(|id| id.as_str().is_empty());
        if anonymous && self.inner.role == Role::DeadLetter {
            // A dead-letter queue has nowhere further to send it: it is shown, under an id of
            // its own for this delivery.
            message.message.message_id = Some(MessageId::random());
        } else if anonymous {
            let this = self.clone();
            tokio::spawn(async move { this.dead_letter_unidentified(message, d.acker).await });
            return None;
        }
        let lock = Arc::new(Lock::new(
            now + self.inner.options.lock_duration,
            now + self.inner.options.consumer_timeout,
            Arc::clone(&self.inner.held),
        ));
        message.lock_token = Some(twice::LockToken::random());
        message.locked_until = Some(lock.locked_until());
        Lock::expire_later(&lock, clock.clone(), d.acker.clone());
        Some(RabbitMqDelivery { message, acker: d.acker, lock })
    }

    async fn dead_letter_unidentified(&self, message: ReceivedMessage, acker: lapin::Acker) {
        let reason = DeadLetterReason::new(
            MISSING_MESSAGE_ID,
            "the message has no message-id property, so its copies cannot be told apart",
        );
        if let Err(e) = self.move_to_dead_letter_queue(&message, &reason, &acker).await {
            tracing::warn!(queue = %self.queue(), "moving a message without an id to the dead-letter queue failed: {e}");
        }
    }

    /// Publishes a copy to the dead-letter queue with the reason, then acks the original; when
    /// the copy is refused, the original is requeued.
    async fn move_to_dead_letter_queue(
        &self,
        message: &ReceivedMessage,
        reason: &DeadLetterReason,
        acker: &lapin::Acker,
    ) -> Result<(), TransportError> {
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
        let properties = convert::to_amqp(&message.message, message.enqueued_time, &extra)?;
        let dlq = self.inner.dead_letter_queue.clone();
        if let Err(e) = self.publish(&dlq, &message.message.body, properties).await {
            let requeue = BasicNackOptions { requeue: true, ..BasicNackOptions::default() };
            let _ = acker.nack(requeue).await;
            return Err(e);
        }
        settled(acker.ack(lapin::options::BasicAckOptions::default()).await)
    }
}

/// What an acker's answer means for the settlement: anything but a sent ack means the delivery
/// is gone with its channel, and the broker has requeued it.
fn settled(r: Result<bool, lapin::Error>) -> Result<(), TransportError> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) | Err(_) => Err(TransportError::LockLost),
    }
}

impl RabbitMqTransport {
    /// Takes the settlement of `delivery` for this call, or says the lock is lost.
    fn take(&self, delivery: &RabbitMqDelivery) -> Result<(), TransportError> {
        if delivery.lock.take(self.inner.options.clock.now()) {
            Ok(())
        } else {
            Err(TransportError::LockLost)
        }
    }
}

impl Receive for RabbitMqTransport {
    type Delivery = RabbitMqDelivery;

    /// # Cancel safety
    ///
    /// Cancel safe: deliveries not yet taken from the consumer stay in its buffer for the next
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
        let current = guard
            .as_ref()
            .is_some_and(|c| c.generation == link.generation && c.channel.status().connected());
        if !current {
            *guard = None;
            let channel = link.connection.create_channel().await.map_err(|e| self.err(e))?;
            channel
                .basic_qos(self.inner.options.prefetch, BasicQosOptions::default())
                .await
                .map_err(|e| self.err(e))?;
            let queue = ShortString::try_new(self.queue())
                .map_err(|_| TransportError::Invalid("queue name too long".into()))?;
            let consumer = channel
                .basic_consume(
                    queue,
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| self.err(e))?;
            *guard = Some(Consuming { generation: link.generation, channel, consumer });
        }
        let Some(consuming) = guard.as_mut() else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        while out.is_empty() {
            let next = tokio::select! {
                () = &mut timer => return Ok(out),
                next = consuming.consumer.next() => next,
            };
            let first = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => {
                    *guard = None;
                    return Err(self.err(e));
                }
                None => {
                    *guard = None;
                    return Err(TransportError::Other {
                        message: "the RabbitMQ consumer was cancelled".into(),
                        transient: true,
                        source: None,
                    });
                }
            };
            out.extend(self.accept(first));
            while out.len() < max_messages {
                match consuming.consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => out.extend(self.accept(d)),
                    _ => break,
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
        let requeue = BasicNackOptions { requeue: true, ..BasicNackOptions::default() };
        settled(delivery.acker.nack(requeue).await)
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
        self.move_to_dead_letter_queue(&delivery.message, &reason, &delivery.acker).await
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
