//! The options of a [`RabbitMqTransport`](crate::RabbitMqTransport).

use std::time::Duration;

use twice::{MessageIdentity, SharedClock};

/// RabbitMQ's own default `consumer_timeout`.
pub(crate) const RABBITMQ_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Options of a [`RabbitMqTransport`](crate::RabbitMqTransport), with Service Bus names and
/// defaults where Service Bus has the concept.
#[derive(Clone, Debug)]
pub struct RabbitMqOptions {
    pub(crate) uri: String,
    pub(crate) queue: String,
    pub(crate) lock_duration: Duration,
    /// The broker's `consumer_timeout`, and whether the user stated it.
    pub(crate) consumer_timeout: Duration,
    pub(crate) consumer_timeout_stated: bool,
    pub(crate) max_delivery_count: Option<u32>,
    pub(crate) message_time_to_live: Option<Duration>,
    pub(crate) prefetch: u16,
    pub(crate) declare: bool,
    pub(crate) identity: MessageIdentity,
    pub(crate) send_timeout: Duration,
    pub(crate) clock: SharedClock,
}

impl RabbitMqOptions {
    /// Options for `queue` on the broker at `uri` (`amqp://user:pass@host:port/vhost`), with the
    /// defaults: lock 60 s, `consumer_timeout` 30 minutes (RabbitMQ's default), MaxDeliveryCount
    /// 10, no message time to live, one concurrent call (a prefetch of 1), the queues declared
    /// on connect where they are missing, the `message-id` property as the message's identity
    /// (a message without one is dead-lettered), sends tried for up to 30 s, the system clock.
    pub fn new(uri: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            queue: queue.into(),
            lock_duration: Duration::from_secs(60),
            consumer_timeout: RABBITMQ_CONSUMER_TIMEOUT,
            consumer_timeout_stated: false,
            max_delivery_count: Some(10),
            message_time_to_live: None,
            prefetch: 1,
            declare: true,
            identity: MessageIdentity::message_id(),
            send_timeout: Duration::from_secs(30),
            clock: SharedClock::system(),
        }
    }

    /// How long a delivery stays locked to this receiver without a renewal, counted from the
    /// moment the broker's delivery reached the client (default 60 s).
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
    /// outlasts it, counted from the delivery. AMQP 0-9-1 cannot read the server's setting: set
    /// it to what the server is configured with. Once set, on RabbitMQ 3.12 and later the
    /// transport also states it to the broker for its consumer (`x-consumer-timeout`), so the
    /// broker and the transport agree whatever the server's global setting.
    #[must_use]
    pub fn consumer_timeout(mut self, d: Duration) -> Self {
        self.consumer_timeout = d;
        self.consumer_timeout_stated = true;
        self
    }

    /// The broker's `consumer_timeout` as configured here.
    pub fn get_consumer_timeout(&self) -> Duration {
        self.consumer_timeout
    }

    /// Deliveries before a message is dead-lettered (default 10; `None`: unlimited). It becomes
    /// the queue's `x-delivery-limit` when the queue is declared, and the transport also
    /// dead-letters a delivery past it itself (on a queue without a limit, and on RabbitMQ 4.3,
    /// whose `basic.nack` no longer counts).
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
    /// [`twice::EntityInfo::message_time_to_live`], which the processor checks the inbox's
    /// retention against. An expired message is dead-lettered with the reason
    /// `TTLExpiredException`.
    ///
    /// A queue that exists keeps its own: the transport reads its `x-message-ttl` on connect. A
    /// `message-ttl` policy cannot be read over AMQP 0-9-1: describe it here (RabbitMQ applies
    /// the shorter of argument and policy).
    #[must_use]
    pub fn message_time_to_live(mut self, ttl: Option<Duration>) -> Self {
        self.message_time_to_live = ttl;
        self
    }

    /// How long a message may wait in the queue.
    pub fn get_message_time_to_live(&self) -> Option<Duration> {
        self.message_time_to_live
    }

    /// How many messages the processor handles at once: the prefetch (`basic.qos`) is this
    /// many, so no delivery waits in the client for longer than one handler takes while its
    /// lock and the broker's `consumer_timeout` run (default 1).
    #[must_use]
    pub fn max_concurrent_calls(mut self, calls: usize) -> Self {
        self.prefetch = u16::try_from(calls.max(1)).unwrap_or(u16::MAX);
        self
    }

    /// How many unacknowledged deliveries RabbitMQ sends ahead (`basic.qos`, at least 1),
    /// directly; [`max_concurrent_calls`](Self::max_concurrent_calls) sets it to the
    /// processor's concurrency. A delivery waiting in the client has its lock and the broker's
    /// `consumer_timeout` running.
    #[must_use]
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// The prefetch.
    pub fn get_prefetch(&self) -> u16 {
        self.prefetch
    }

    /// Whether to declare the queue and its dead-letter queue on connect where they are missing
    /// (default true). A queue that exists is never declared again: it is used with the
    /// arguments it has.
    #[must_use]
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// Where the id the inbox claims comes from, and what becomes of a message without one
    /// (default: the `message-id` property; a message without it is dead-lettered with
    /// `MissingMessageId`). See [`MessageIdentity`].
    #[must_use]
    pub fn identity(mut self, identity: MessageIdentity) -> Self {
        self.identity = identity;
        self
    }

    /// How long [`send`](crate::RabbitMqTransport::send) goes on trying a publish the broker did
    /// not confirm, always with the same message id (default 30 s).
    #[must_use]
    pub fn send_timeout(mut self, d: Duration) -> Self {
        self.send_timeout = d;
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

    /// Whether the transport declares missing queues.
    pub fn get_declare(&self) -> bool {
        self.declare
    }

    /// The identity policy.
    pub fn get_identity(&self) -> &MessageIdentity {
        &self.identity
    }

    /// How long a send goes on trying.
    pub fn get_send_timeout(&self) -> Duration {
        self.send_timeout
    }

    /// The clock for lock deadlines.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}
