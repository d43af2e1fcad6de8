//! A NATS JetStream transport for twice: the idempotent processor on a JetStream work-queue
//! stream with a durable pull consumer.
//!
//! ```no_run
//! # async fn example() -> Result<(), twice::TransportError> {
//! use twice::{Message, Receive as _, Transport as _};
//! use twice_nats::{NatsOptions, NatsTransport};
//!
//! let orders = NatsTransport::connect(NatsOptions::new("nats://127.0.0.1:4222", "ORDERS")).await?;
//! orders.send(Message::new("hello").with_message_id("order-1")).await?;
//! for d in orders.receive(10, std::time::Duration::from_secs(1)).await? {
//!     orders.complete(&d).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! # How Service Bus terms map onto JetStream
//!
//! | twice | JetStream |
//! |---|---|
//! | the entity | a work-queue stream (`<STREAM>`, subject `<subject>`) and a durable pull consumer with explicit acks, created on connect |
//! | `send` | a publish with `Nats-Msg-Id`, acknowledged by the stream |
//! | `receive` | a pull (`fetch`, then a waiting batch of one when nothing is there) |
//! | `complete` | `+ACK`, confirmed by the server |
//! | `abandon`, `release` | `-NAK`: redelivered at once, and JetStream counts the delivery either way |
//! | `dead_letter` | a publish of the message to the dead-letter stream with the reason in headers, then `+TERM` |
//! | lock, `renew_lock` | `AckWait` as the lock duration; `+WPI` (in progress) restarts it |
//! | MaxDeliveryCount | see below |
//! | delivery count | `num_delivered` of the delivery |
//! | duplicate detection | `Nats-Msg-Id` within the stream's duplicate window |
//! | DefaultMessageTimeToLive | the stream's `max_age`, read on connect (zero: forever; [`NatsOptions::max_age`] when the transport creates the stream) |
//! | sequence number | the stream sequence |
//! | `defer`, sessions | none: [`TransportError::Unsupported`] |
//!
//! # Dead-lettering at MaxDeliveryCount
//!
//! The consumer's `MaxDeliver` is MaxDeliveryCount + 1. A delivery whose `num_delivered` exceeds
//! MaxDeliveryCount is never handed to a handler: the transport publishes it to the
//! dead-letter stream with the reason [`MAX_DELIVERY_COUNT_EXCEEDED`] and terminates it. So the
//! message moves when the delivery after the last allowed one happens, as Service Bus moves it
//! when the count would exceed the limit.
//!
//! Should that move not happen (the process died between the delivery and the `+TERM`),
//! JetStream stops redelivering at `MaxDeliver` and publishes a `MAX_DELIVERIES` advisory. A
//! connected transport listens for these advisories and moves the message itself: it reads it
//! from the stream by sequence, publishes it to the dead-letter stream with the same reason, and
//! deletes it from the stream. The dead-letter copy's `Nats-Msg-Id` is the original's stream
//! and sequence, so a message moved twice is stored once. An advisory sent while no transport
//! is connected is lost (advisories are core NATS messages), and its message stays in the
//! stream until someone moves it.
//!
//! # The lock
//!
//! The lock is the consumer's `AckWait`, kept by the server. The transport also keeps the
//! deadline it knows of, and refuses a settlement after it with [`TransportError::LockLost`]:
//! the server may already have delivered the message again. The server starts `AckWait` when
//! it sends the message, a little before this transport sees it, so for a moment near the end of
//! a lock two receivers may hold copies; the inbox claim decides between them.
//!
//! # Message properties
//!
//! Headers carry strings only: application properties come back as [`twice::Value::String`]
//! (a number is sent as its decimal text). The Service Bus fields travel in `Twice-*` headers.
//!
//! # A message without an id
//!
//! A message published without `Nats-Msg-Id` gets the id `<stream>:<stream sequence>`: the
//! stream gave it a place of its own, which every redelivery of it shares, so it is never merged
//! with another message. Two publications of the same content without an id are two messages.
//!
//! # Connection loss
//!
//! The client reconnects by itself. A pull cut off by the loss fails with a transient error;
//! deliveries taken before it can still be settled while their `AckWait` lasts.

mod convert;
mod rescue;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures::StreamExt as _;
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, Receive,
    ReceivedMessage, SharedClock, Timestamp, Transport, TransportError,
};

pub use twice::dead_letter_reasons::MAX_DELIVERY_COUNT_EXCEEDED;

/// Options of a [`NatsTransport`], with Service Bus names and defaults where Service Bus has the
/// concept.
#[derive(Clone, Debug)]
pub struct NatsOptions {
    url: String,
    stream: String,
    subject: Option<String>,
    consumer: String,
    lock_duration: Duration,
    max_delivery_count: Option<u32>,
    duplicate_window: Duration,
    max_age: Duration,
    clock: SharedClock,
}

impl NatsOptions {
    /// Options for `stream` on the server at `url`, with the defaults: subject = the stream
    /// name in lower case, consumer `twice`, lock (AckWait) 60 s, MaxDeliveryCount 10, duplicate
    /// window 10 minutes (Service Bus's default), no `max_age`, the system clock.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            subject: None,
            consumer: "twice".into(),
            lock_duration: Duration::from_secs(60),
            max_delivery_count: Some(10),
            duplicate_window: Duration::from_secs(600),
            max_age: Duration::ZERO,
            clock: SharedClock::system(),
        }
    }

    /// The subject the stream stores (default: the stream name in lower case).
    #[must_use]
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// The durable consumer's name (default `twice`).
    #[must_use]
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.consumer = name.into();
        self
    }

    /// The lock duration: the consumer's `AckWait` (default 60 s).
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
    /// [`EntityInfo::message_time_to_live`] is what the server reports on connect, and the
    /// processor checks the inbox's retention against it.
    #[must_use]
    pub fn max_age(mut self, d: Duration) -> Self {
        self.max_age = d;
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

    /// The durable consumer's name.
    pub fn get_consumer(&self) -> &str {
        &self.consumer
    }

    /// The lock duration (the consumer's `AckWait`).
    pub fn get_lock_duration(&self) -> Duration {
        self.lock_duration
    }

    /// Deliveries before a message is dead-lettered (`None`: unlimited).
    pub fn get_max_delivery_count(&self) -> Option<u32> {
        self.max_delivery_count
    }

    /// The stream's duplicate window.
    pub fn get_duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// The `max_age` of a stream this transport creates (zero: none).
    pub fn get_max_age(&self) -> Duration {
        self.max_age
    }

    /// The clock for lock deadlines.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// The name of the dead-letter stream of `stream`.
pub fn dead_letter_stream_name(stream: &str) -> String {
    format!("{stream}_DEAD_LETTER")
}

struct Inner {
    options: NatsOptions,
    info: EntityInfo,
    subject: String,
    dead_letter_subject: Option<String>,
    context: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    /// The task that moves messages JetStream stopped delivering to the dead-letter stream.
    rescuer: Option<tokio::task::AbortHandle>,
    /// The newest delivery count this transport has seen of each stream sequence it holds: a
    /// delivery older than that has lost its lock, whatever the clocks say. A std Mutex: a map
    /// operation, never held across an await.
    newest: std::sync::Mutex<std::collections::HashMap<u64, u32>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = &self.rescuer {
            task.abort();
        }
    }
}

/// A [`Transport`] on one JetStream stream and its durable pull consumer. Cheap to clone.
#[derive(Clone)]
pub struct NatsTransport {
    inner: Arc<Inner>,
}

impl fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTransport")
            .field("stream", &self.inner.options.stream)
            .field("consumer", &self.inner.options.consumer)
            .finish_non_exhaustive()
    }
}

/// One delivery from JetStream.
pub struct NatsDelivery {
    message: ReceivedMessage,
    raw: jetstream::Message,
    settled: AtomicBool,
    locked_until: AtomicI64,
}

impl fmt::Debug for NatsDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsDelivery")
            .field("message_id", self.message.message_id())
            .field("sequence_number", &self.message.sequence_number)
            .field("delivery_count", &self.message.delivery_count)
            .finish_non_exhaustive()
    }
}

impl Delivery for NatsDelivery {
    fn message(&self) -> &ReceivedMessage {
        &self.message
    }
}

pub(crate) fn other<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    what: &str,
    e: E,
) -> TransportError {
    let source = e.into();
    TransportError::Other {
        message: format!("{what}: {source}"),
        transient: true,
        source: Some(source),
    }
}

impl NatsTransport {
    /// Connects, creates the stream (work-queue retention, file storage, the duplicate window),
    /// its dead-letter stream and the durable pull consumer, or opens them if they exist.
    ///
    /// # Errors
    ///
    /// When the server is unreachable or refuses the stream or consumer.
    pub async fn connect(options: NatsOptions) -> Result<Self, TransportError> {
        Self::open(options, false).await
    }

    /// A transport on this stream's dead-letter stream (`<STREAM>_DEAD_LETTER`), with a consumer
    /// of the same name. Its messages carry the reason in
    /// [`ReceivedMessage::dead_letter_reason`].
    ///
    /// # Errors
    ///
    /// As [`NatsTransport::connect`].
    pub async fn dead_letter_receiver(&self) -> Result<Self, TransportError> {
        let mut options = self.inner.options.clone();
        options.stream = dead_letter_stream_name(&self.inner.options.stream);
        options.subject = self.inner.dead_letter_subject.clone();
        options.max_delivery_count = None;
        // Dead-lettered messages stay until someone takes them.
        options.max_age = Duration::ZERO;
        Self::open(options, true).await
    }

    async fn open(options: NatsOptions, is_dead_letter: bool) -> Result<Self, TransportError> {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .connect(options.url.as_str())
            .await
            .map_err(|e| other("connecting to NATS", e))?;
        let context = jetstream::new(client.clone());
        let subject = options.get_subject();
        let dead_letter_subject = (!is_dead_letter).then(|| format!("{subject}.dead-letter"));
        // JetStream refuses a duplicate window longer than the stream's `max_age`.
        let create = |name: String, subject: String, max_age: Duration| stream::Config {
            name,
            subjects: vec![subject],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: if max_age.is_zero() {
                options.duplicate_window
            } else {
                options.duplicate_window.min(max_age)
            },
            max_age,
            ..stream::Config::default()
        };
        if let Some(dl) = &dead_letter_subject {
            context
                .get_or_create_stream(create(
                    dead_letter_stream_name(&options.stream),
                    dl.clone(),
                    Duration::ZERO,
                ))
                .await
                .map_err(|e| other("creating the dead-letter stream", e))?;
        }
        let stream = context
            .get_or_create_stream(create(options.stream.clone(), subject.clone(), options.max_age))
            .await
            .map_err(|e| other("creating the stream", e))?;
        let max_deliver = options.max_delivery_count.map_or(-1, |n| i64::from(n) + 1);
        let consumer = stream
            .get_or_create_consumer(
                &options.consumer,
                pull::Config {
                    durable_name: Some(options.consumer.clone()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: options.lock_duration,
                    max_deliver,
                    max_ack_pending: 10_000,
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(|e| other("creating the consumer", e))?;
        let rescuer = match (&dead_letter_subject, options.max_delivery_count) {
            (Some(dl), Some(_)) => Some(
                rescue::start(&client, context.clone(), &options.stream, &options.consumer, dl)
                    .await?,
            ),
            _ => None,
        };
        let mut info = EntityInfo::new(options.stream.clone());
        info.lock_duration = options.lock_duration;
        info.max_delivery_count = options.max_delivery_count;
        // What the server has, which for a stream that existed may differ from the options.
        let config = &stream.cached_info().config;
        info.duplicate_detection_window = Some(config.duplicate_window);
        info.requires_session = false;
        // `max_age` removes a message however often it was delivered; zero keeps it forever.
        let max_age = config.max_age;
        info.message_time_to_live = (!max_age.is_zero()).then_some(max_age);
        Ok(Self {
            inner: Arc::new(Inner {
                options,
                info,
                subject,
                dead_letter_subject,
                context,
                consumer,
                rescuer,
                newest: std::sync::Mutex::default(),
            }),
        })
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.inner.options.stream
    }

    /// Sends a message and waits for the stream to store it; returns its id (a random one when
    /// the message had none). A message whose id the stream saw within its duplicate window is
    /// dropped by the server, and this returns `Ok` all the same.
    ///
    /// # Errors
    ///
    /// A transient error when the server did not acknowledge it (it may or may not have stored
    /// it: send it again with the same id).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored.
    pub async fn send(&self, mut message: Message) -> Result<MessageId, TransportError> {
        let id = message.message_id.get_or_insert_with(MessageId::random).clone();
        self.send_to(&self.inner.subject, &message, &[]).await?;
        Ok(id)
    }

    /// Publishes and returns whether the stream took it as a duplicate.
    async fn send_to(
        &self,
        subject: &str,
        message: &Message,
        extra: &[(&str, String)],
    ) -> Result<bool, TransportError> {
        let headers = convert::to_headers(message, extra);
        let ack = self
            .inner
            .context
            .publish_with_headers(subject.to_owned(), headers, message.body.clone())
            .await
            .map_err(|e| other("publishing", e))?
            .await
            .map_err(|e| other("waiting for the stream's acknowledgement", e))?;
        Ok(ack.duplicate)
    }

    /// Sends a message (which must carry an id) and returns true when the stream dropped it as
    /// a duplicate of one sent within the duplicate window.
    ///
    /// # Errors
    ///
    /// [`TransportError::Invalid`] for a message without an id; otherwise as
    /// [`NatsTransport::send`].
    ///
    /// # Cancel safety
    ///
    /// As [`NatsTransport::send`].
    pub async fn send_reporting_duplicate(&self, message: Message) -> Result<bool, TransportError> {
        if message.message_id.is_none() {
            return Err(TransportError::Invalid("duplicate detection needs a message id".into()));
        }
        self.send_to(&self.inner.subject, &message, &[]).await
    }

    /// How many messages the stream holds (not yet acknowledged).
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn message_count(&self) -> Result<u64, TransportError> {
        let mut s = self
            .inner
            .context
            .get_stream(&self.inner.options.stream)
            .await
            .map_err(|e| other("opening the stream", e))?;
        Ok(s.info().await.map_err(|e| other("reading the stream", e))?.state.messages)
    }

    /// Deletes the stream and its dead-letter stream, with their messages and consumers.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn delete(&self) -> Result<(), TransportError> {
        let streams = [
            self.inner.options.stream.clone(),
            dead_letter_stream_name(&self.inner.options.stream),
        ];
        for s in streams {
            // A stream already gone is fine.
            let _ = self.inner.context.delete_stream(&s).await;
        }
        Ok(())
    }

    fn accept(&self, raw: jetstream::Message) -> Option<NatsDelivery> {
        let clock = &self.inner.options.clock;
        let now = clock.now();
        let (mut message, delivered) = match convert::from_jetstream(
            &raw,
            &self.inner.options.stream,
        ) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(stream = %self.stream(), "a delivery without JetStream metadata: {e}");
                return None;
            }
        };
        if self.inner.options.max_delivery_count.is_some_and(|max| delivered > max) {
            let this = self.clone();
            tokio::spawn(async move {
                let reason = DeadLetterReason::new(
                    MAX_DELIVERY_COUNT_EXCEEDED,
                    format!(
                        "delivered more than {} times",
                        this.inner.info.max_delivery_count.unwrap_or_default()
                    ),
                );
                if let Err(e) = this.move_to_dead_letter_stream(&message, &reason, &raw).await {
                    tracing::warn!(stream = %this.stream(), "moving an exhausted message to the dead-letter stream failed: {e}");
                }
            });
            return None;
        }
        self.newest().insert(raw_sequence(&message), delivered);
        let until = now + self.inner.options.lock_duration;
        message.lock_token = Some(twice::LockToken::random());
        message.locked_until = Some(until);
        Some(NatsDelivery {
            message,
            raw,
            settled: AtomicBool::new(false),
            locked_until: AtomicI64::new(until.as_millis()),
        })
    }

    async fn move_to_dead_letter_stream(
        &self,
        message: &ReceivedMessage,
        reason: &DeadLetterReason,
        raw: &jetstream::Message,
    ) -> Result<(), TransportError> {
        let Some(subject) = &self.inner.dead_letter_subject else {
            return Err(TransportError::Unsupported("dead-lettering from a dead-letter stream"));
        };
        let mut copy = message.message.clone();
        // The copy keeps the stream's identity of the original, so that a retried move is
        // dropped by the dead-letter stream's duplicate window.
        copy.message_id = Some(MessageId::new(format!(
            "{}:{}",
            self.inner.options.stream, message.sequence_number
        )));
        let extra = [
            (convert::DEAD_LETTER_REASON, reason.reason.clone()),
            (convert::DEAD_LETTER_DESCRIPTION, reason.description.clone()),
            (convert::DEAD_LETTER_SOURCE, self.inner.options.stream.clone()),
            (convert::ORIGINAL_MESSAGE_ID, message.message_id().as_str().to_owned()),
            (convert::DELIVERY_COUNT, message.delivery_count.to_string()),
        ];
        self.send_to(subject, &copy, &extra).await?;
        raw.double_ack_with(AckKind::Term).await.map_err(|e| other("terminating", e))
    }

    fn newest(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, u32>> {
        self.inner.newest.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take(&self, delivery: &NatsDelivery) -> Result<(), TransportError> {
        let now = self.inner.options.clock.now();
        if now.as_millis() >= delivery.locked_until.load(Ordering::SeqCst) {
            return Err(TransportError::LockLost);
        }
        let sequence = raw_sequence(&delivery.message);
        {
            let mut newest = self.newest();
            // The server may deliver again a moment before this transport's deadline (it
            // started AckWait when it sent): a newer delivery here means this one is stale.
            if newest.get(&sequence).is_some_and(|n| *n > delivery.message.delivery_count) {
                return Err(TransportError::LockLost);
            }
            newest.remove(&sequence);
        }
        delivery
            .settled
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .map(|_| ())
            .map_err(|_| TransportError::LockLost)
    }

    async fn settle(&self, delivery: &NatsDelivery, kind: AckKind) -> Result<(), TransportError> {
        self.take(delivery)?;
        let r = delivery.raw.double_ack_with(kind).await.map_err(|e| other("settling", e));
        if r.is_err() {
            // Unconfirmed (the connection may be gone): the caller may try again while the
            // lock lasts.
            delivery.settled.store(false, Ordering::SeqCst);
        }
        r
    }

    async fn pull(
        &self,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<jetstream::Message>, TransportError> {
        let consumer = &self.inner.consumer;
        let mut batch = match wait {
            None => consumer.fetch().max_messages(max).messages().await,
            Some(wait) => {
                consumer
                    .batch()
                    .max_messages(max)
                    .expires(wait.max(Duration::from_millis(10)))
                    .messages()
                    .await
            }
        }
        .map_err(|e| other("pulling", e))?;
        let mut out = Vec::new();
        while let Some(m) = batch.next().await {
            out.push(m.map_err(|e| other("pulling", e))?);
        }
        Ok(out)
    }
}

/// The stream sequence of a received message.
fn raw_sequence(m: &ReceivedMessage) -> u64 {
    u64::try_from(m.sequence_number.get()).unwrap_or_default()
}

impl Receive for NatsTransport {
    type Delivery = NatsDelivery;

    /// # Cancel safety
    ///
    /// Cancel safe in the trait's sense: messages pulled for a call that was dropped come back
    /// when their `AckWait` runs out, with their count raised.
    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<NatsDelivery>, TransportError> {
        if max_messages == 0 {
            return Ok(Vec::new());
        }
        let mut out: Vec<NatsDelivery> = Vec::new();
        let raw = self.pull(max_messages, None).await?;
        out.extend(raw.into_iter().filter_map(|m| self.accept(m)));
        if out.is_empty() {
            // Nothing there: wait for one, then take what else came with it.
            let raw = self.pull(1, Some(max_wait)).await?;
            out.extend(raw.into_iter().filter_map(|m| self.accept(m)));
            if !out.is_empty() && max_messages > 1 {
                let raw = self.pull(max_messages - 1, None).await?;
                out.extend(raw.into_iter().filter_map(|m| self.accept(m)));
            }
        }
        Ok(out)
    }

    async fn complete(&self, delivery: &NatsDelivery) -> Result<(), TransportError> {
        self.settle(delivery, AckKind::Ack).await
    }

    async fn abandon(
        &self,
        delivery: &NatsDelivery,
        properties: Properties,
    ) -> Result<(), TransportError> {
        if !properties.is_empty() {
            return Err(TransportError::Unsupported("abandon with properties on NATS JetStream"));
        }
        self.settle(delivery, AckKind::Nak(None)).await
    }

    async fn dead_letter(
        &self,
        delivery: &NatsDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        if self.inner.dead_letter_subject.is_none() {
            return Err(TransportError::Unsupported("dead-lettering from a dead-letter stream"));
        }
        self.take(delivery)?;
        self.move_to_dead_letter_stream(&delivery.message, &reason, &delivery.raw).await
    }

    async fn defer(&self, _delivery: &NatsDelivery) -> Result<(), TransportError> {
        Err(TransportError::Unsupported("defer on NATS JetStream"))
    }
}

impl Transport for NatsTransport {
    fn entity(&self) -> &EntityInfo {
        &self.inner.info
    }

    fn system(&self) -> &'static str {
        "nats"
    }

    async fn release(&self, delivery: &NatsDelivery) -> Result<(), TransportError> {
        self.settle(delivery, AckKind::Nak(None)).await
    }

    async fn renew_lock(&self, delivery: &NatsDelivery) -> Result<Timestamp, TransportError> {
        let clock = &self.inner.options.clock;
        if delivery.settled.load(Ordering::SeqCst)
            || clock.now().as_millis() >= delivery.locked_until.load(Ordering::SeqCst)
        {
            return Err(TransportError::LockLost);
        }
        delivery.raw.double_ack_with(AckKind::Progress).await.map_err(|e| other("renewing", e))?;
        let until = clock.now() + self.inner.options.lock_duration;
        delivery.locked_until.store(until.as_millis(), Ordering::SeqCst);
        Ok(until)
    }
}
