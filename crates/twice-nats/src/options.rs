//! The options of a [`NatsTransport`](crate::NatsTransport).

use std::time::Duration;

use twice::{MessageIdentity, SharedClock};

/// Options of a [`NatsTransport`](crate::NatsTransport), with Service Bus names and defaults
/// where Service Bus has the concept.
///
/// The lock duration, MaxDeliveryCount, duplicate window and `max_age` are what the transport
/// creates a stream or consumer with. A stream or consumer that exists is used as it is: the
/// transport reads its settings (the consumer's `AckWait` is the lock duration whatever
/// [`lock_duration`](Self::lock_duration) says) and reports what differs in
/// [`NatsTransport::notes`](crate::NatsTransport::notes).
#[derive(Clone, Debug)]
pub struct NatsOptions {
    pub(crate) url: String,
    pub(crate) stream: String,
    pub(crate) subject: Option<String>,
    pub(crate) dead_letter_subject: Option<String>,
    pub(crate) consumer: String,
    pub(crate) lock_duration: Duration,
    pub(crate) max_delivery_count: Option<u32>,
    pub(crate) duplicate_window: Duration,
    pub(crate) max_age: Duration,
    pub(crate) identity: MessageIdentity,
    pub(crate) send_timeout: Duration,
    pub(crate) create: bool,
    pub(crate) clock: SharedClock,
}

impl NatsOptions {
    /// Options for `stream` on the server at `url`, with the defaults: subject = the stream
    /// name in lower case, consumer `twice`, lock (AckWait) 60 s, MaxDeliveryCount 10, duplicate
    /// window 10 minutes (Service Bus's default), no `max_age`, the message id as the message's
    /// identity (a message without one is dead-lettered), sends retried for up to 30 s, the
    /// system clock.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            subject: None,
            dead_letter_subject: None,
            consumer: "twice".into(),
            lock_duration: Duration::from_secs(60),
            max_delivery_count: Some(10),
            duplicate_window: Duration::from_secs(600),
            max_age: Duration::ZERO,
            identity: MessageIdentity::message_id(),
            send_timeout: Duration::from_secs(30),
            create: true,
            clock: SharedClock::system(),
        }
    }

    /// The subject the stream stores, and sends go to (default: an existing stream's one
    /// subject, else the stream name in lower case).
    #[must_use]
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// The subject of the dead-letter stream (default: the subject followed by
    /// `.dead-letter`). Set it when the stream's own subjects would take that one (a stream on
    /// `orders.>` stores `orders.dead-letter`).
    #[must_use]
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// The durable consumer's name (default `twice`).
    #[must_use]
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.consumer = name.into();
        self
    }

    /// The lock duration: the `AckWait` of a consumer this transport creates (default 60 s).
    /// A consumer that exists keeps its own, which is the lock duration then.
    #[must_use]
    pub fn lock_duration(mut self, d: Duration) -> Self {
        self.lock_duration = d;
        self
    }

    /// Deliveries before a message is dead-lettered (default 10; `None`: unlimited).
    #[must_use]
    pub fn max_delivery_count(mut self, n: Option<u32>) -> Self {
        self.max_delivery_count = n.map(|n| n.max(1));
        self
    }

    /// The stream's duplicate window for `Nats-Msg-Id` (default 10 minutes).
    #[must_use]
    pub fn duplicate_window(mut self, d: Duration) -> Self {
        self.duplicate_window = d;
        self
    }

    /// The stream's `max_age` when this transport creates the stream (default zero: messages
    /// stay until acknowledged). A stream that exists keeps its own; either way
    /// [`twice::EntityInfo::message_time_to_live`] is what the server reports on connect, and
    /// the processor checks the inbox's retention against it.
    #[must_use]
    pub fn max_age(mut self, d: Duration) -> Self {
        self.max_age = d;
        self
    }

    /// Where the id the inbox claims comes from, and what becomes of a message without one
    /// (default: the `Nats-Msg-Id` header; a message without it is dead-lettered with
    /// `MissingMessageId`). See [`MessageIdentity`].
    #[must_use]
    pub fn identity(mut self, identity: MessageIdentity) -> Self {
        self.identity = identity;
        self
    }

    /// How long [`send`](crate::NatsTransport::send) goes on trying a publish the stream did
    /// not acknowledge, always with the same `Nats-Msg-Id` (default 30 s). It never retries
    /// past the stream's duplicate window, within which a second copy is dropped.
    #[must_use]
    pub fn send_timeout(mut self, d: Duration) -> Self {
        self.send_timeout = d;
        self
    }

    /// Whether to create the stream and its dead-letter stream where they are missing (default
    /// true). Off, a missing stream is [`twice::TransportError::EntityNotFound`]; the durable
    /// consumer is made where missing either way.
    #[must_use]
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// The clock for lock deadlines (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The server's URL.
    pub fn get_url(&self) -> &str {
        &self.url
    }

    /// The stream.
    pub fn get_stream(&self) -> &str {
        &self.stream
    }

    /// The subject the stream stores: the one set, else the stream name in lower case.
    pub fn get_subject(&self) -> String {
        self.subject.clone().unwrap_or_else(|| self.stream.to_lowercase())
    }

    /// The subject of the dead-letter stream: the one set, else the subject followed by
    /// `.dead-letter`.
    pub fn get_dead_letter_subject(&self) -> String {
        self.dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("{}.dead-letter", self.get_subject()))
    }

    /// The durable consumer's name.
    pub fn get_consumer(&self) -> &str {
        &self.consumer
    }

    /// The lock duration a created consumer gets (its `AckWait`).
    pub fn get_lock_duration(&self) -> Duration {
        self.lock_duration
    }

    /// Deliveries before a message is dead-lettered (`None`: unlimited).
    pub fn get_max_delivery_count(&self) -> Option<u32> {
        self.max_delivery_count
    }

    /// The duplicate window of a created stream.
    pub fn get_duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// The `max_age` of a stream this transport creates (zero: none).
    pub fn get_max_age(&self) -> Duration {
        self.max_age
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
