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
//! | the entity | a work-queue stream (`<STREAM>`, subject `<subject>`) and a durable pull consumer with explicit acks, created on connect where missing, used as they are where they exist |
//! | `send` | a publish with `Nats-Msg-Id`, acknowledged by the stream, tried again with the same id until acknowledged |
//! | `receive` | a pull (`fetch`, then a waiting batch of one when nothing is there) |
//! | `complete` | `+ACK`, confirmed by the server |
//! | `abandon`, `release` | `-NAK`: redelivered at once, and JetStream counts the delivery either way |
//! | `dead_letter` | a publish of the message to the dead-letter stream with the reason in headers, then `+TERM` |
//! | lock, `renew_lock` | the consumer's `AckWait` as the lock duration; `+WPI` (in progress) restarts it |
//! | MaxDeliveryCount | see below |
//! | delivery count | `num_delivered` of the delivery |
//! | message id | the identity policy ([`NatsOptions::identity`]; default `Nats-Msg-Id`) |
//! | duplicate detection | `Nats-Msg-Id` within the stream's duplicate window |
//! | DefaultMessageTimeToLive | the stream's `max_age`, read on connect (zero: forever; [`NatsOptions::max_age`] when the transport creates the stream) |
//! | sequence number | the stream sequence |
//! | `defer`, sessions | none: [`TransportError::Unsupported`] |
//!
//! # Dead-lettering at MaxDeliveryCount
//!
//! The consumer this transport creates has no `MaxDeliver`: JetStream never gives up on a
//! message. A delivery whose `num_delivered` exceeds MaxDeliveryCount is never handed to a
//! handler: the transport publishes it to the dead-letter stream with the reason
//! [`MAX_DELIVERY_COUNT_EXCEEDED`] and terminates it. So the message moves when the delivery
//! after the last allowed one happens, as Service Bus moves it when the count would exceed the
//! limit. Should the move fail (the dead-letter stream unreachable), the delivery is sent back
//! with a delay (`-NAK` with a delay) and the move is tried again on its next delivery; should
//! the process die before the `+TERM`, the message comes back when its `AckWait` runs out.
//!
//! A consumer that already exists with a `MaxDeliver` (made by hand, or by an earlier version of
//! this transport) stops delivering a message at that count. The transport finds such messages
//! and moves them itself: from the server's `MAX_DELIVERIES` advisory while connected, and by a
//! sweep of the stream on connect and every lock duration after, which also finds those whose
//! advisory came while no transport was connected.
//!
//! Each dead-letter copy's `Nats-Msg-Id` names the original's stream, sequence and the moment
//! the stream stored it: a move tried again is dropped by the dead-letter stream's duplicate
//! window, and no other message (also none at the same sequence of a stream deleted and made
//! again) shares it.
//!
//! # The lock
//!
//! The lock is the consumer's `AckWait`, kept by the server: the transport reads it from the
//! consumer on connect (for a consumer that exists it may differ from
//! [`NatsOptions::lock_duration`], and then a note says so). The server starts `AckWait` when
//! it sends a message, which is after the transport asked for it: the transport counts each
//! lock from the moment it sent the pull request (and a renewal from the moment it sent the
//! `+WPI`), so its deadline is never later than the server's. A pull that waits for messages
//! waits at most a quarter of `AckWait` at a time, so a message never arrives with most of its
//! lock gone. The transport refuses a settlement after its deadline with
//! [`TransportError::LockLost`]: the server may already have delivered the message again.
//!
//! # Message identity
//!
//! The id the inbox claims comes from the identity policy ([`twice::MessageIdentity`],
//! [`NatsOptions::identity`]): by default the `Nats-Msg-Id` header. A message for which the
//! policy finds no id is dead-lettered with the reason [`MISSING_MESSAGE_ID`] and never handed
//! to a handler, unless the policy names such messages by a hash of their content. The
//! transport never derives an id from the message's place in the stream: a stream deleted and
//! made again starts its sequence at 1 again, and a reused id would complete a new message
//! without running its handler.
//!
//! [`send`](NatsTransport::send) gives a message without an id a random one *before* its first
//! publish, and tries the publish again with that same id until the stream acknowledges it (up
//! to [`NatsOptions::send_timeout`], never past the duplicate window): a publish whose
//! acknowledgement was lost is stored once.
//!
//! # Message properties
//!
//! Headers carry strings only: application properties come back as [`twice::Value::String`]
//! (a number is sent as its decimal text). The Service Bus fields travel in `Twice-*` headers.
//!
//! # Connection loss and a stream made again
//!
//! The client reconnects by itself. A pull cut off by the loss fails with a transient error;
//! deliveries taken before it can still be settled while their `AckWait` lasts. A pull that
//! finds the consumer gone (its stream was deleted and made again) makes the consumer again on
//! the new stream.

mod attach;
mod convert;
mod dead_letter;
mod options;
mod publish;
mod rescue;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt as _;
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, Receive,
    ReceivedMessage, Timestamp, Transport, TransportError,
};

use crate::dead_letter::{DeadLetters, Original};

pub use crate::options::NatsOptions;
pub use twice::dead_letter_reasons::{MAX_DELIVERY_COUNT_EXCEEDED, MISSING_MESSAGE_ID};

/// Every stream on the server at `url` with how many messages it holds, by name.
///
/// # Errors
///
/// When the server is unreachable.
pub async fn stream_counts(url: &str) -> Result<Vec<(String, u64)>, TransportError> {
    let client = async_nats::connect(url).await.map_err(|e| other("connecting to NATS", e))?;
    let context = jetstream::new(client);
    let mut streams = context.streams();
    let mut out = Vec::new();
    while let Some(info) = streams.next().await {
        let info = info.map_err(|e| other("listing the streams", e))?;
        out.push((info.config.name, info.state.messages));
    }
    out.sort();
    Ok(out)
}

/// The name of the dead-letter stream of `stream`.
pub fn dead_letter_stream_name(stream: &str) -> String {
    format!("{stream}_DEAD_LETTER")
}

struct Inner {
    options: NatsOptions,
    is_dead_letter: bool,
    info: EntityInfo,
    /// The consumer's `AckWait`: the lock.
    ack_wait: Duration,
    /// The stream's duplicate window, which bounds how long a send may be tried again.
    duplicate_window: Duration,
    subject: String,
    dead_letters: Option<DeadLetters>,
    context: jetstream::Context,
    /// The consumer; replaced when its stream was made again. A std Mutex: cloned out, never
    /// held across an await.
    consumer: std::sync::Mutex<jetstream::consumer::PullConsumer>,
    /// What connecting found missing or different.
    notes: Vec<String>,
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
    stored_at_nanos: i128,
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

/// How long past its wait a pull may go unanswered before it is given up.
const PULL_GRACE: Duration = Duration::from_secs(3);

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
    /// Connects, and creates the stream (work-queue retention, file storage, the duplicate
    /// window), its dead-letter stream and the durable pull consumer where they are missing.
    /// Where they exist they are used as they are: their settings are read, never changed, and
    /// [`NatsTransport::notes`] says what differs from the options or is missing.
    ///
    /// # Errors
    ///
    /// When the server is unreachable or refuses the stream or consumer, and
    /// [`TransportError::Invalid`] (with what to change) for an existing consumer that does not
    /// acknowledge explicitly or a dead-letter subject another stream takes.
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
        options.subject = self.inner.dead_letters.as_ref().map(|d| d.subject.clone());
        options.max_delivery_count = None;
        // Dead-lettered messages stay until someone takes them.
        options.max_age = Duration::ZERO;
        Self::open(options, true).await
    }

    async fn open(options: NatsOptions, is_dead_letter: bool) -> Result<Self, TransportError> {
        let attached = attach::attach(&options, is_dead_letter).await?;
        let subject = attached.subject.clone();
        let dead_letters = (!is_dead_letter).then(|| DeadLetters {
            context: attached.context.clone(),
            subject: attached.dead_letter_subject.clone(),
            source: options.stream.clone(),
        });
        let rescuer = match (&dead_letters, attached.max_deliver) {
            (Some(dl), Some(_)) => Some(
                rescue::start(
                    &attached.client,
                    rescue::Rescue {
                        dead_letters: dl.clone(),
                        consumer: options.consumer.clone(),
                        identity: options.identity.clone(),
                        every: attached.ack_wait.max(Duration::from_secs(1)),
                        clock: options.clock.clone(),
                    },
                )
                .await?,
            ),
            _ => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                options,
                is_dead_letter,
                info: attached.info,
                ack_wait: attached.ack_wait,
                duplicate_window: attached.duplicate_window,
                subject,
                dead_letters,
                context: attached.context,
                consumer: std::sync::Mutex::new(attached.consumer),
                notes: attached.notes,
                rescuer,
                newest: std::sync::Mutex::default(),
            }),
        })
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.inner.options.stream
    }

    /// What connecting found missing, or set otherwise than the options say, each in one line
    /// with how to change it (also logged as warnings): empty for a stream and consumer this
    /// transport created.
    pub fn notes(&self) -> &[String] {
        &self.inner.notes
    }

    /// Sends a message and waits for the stream to store it; returns its id (a random one when
    /// the message had none, fixed before the first attempt). A publish that is not
    /// acknowledged is tried again with the same id for up to [`NatsOptions::send_timeout`]
    /// (never past the stream's duplicate window), so a publish whose acknowledgement was lost
    /// is stored once. A message whose id the stream saw within its duplicate window is dropped
    /// by the server, and this returns `Ok` all the same.
    ///
    /// # Errors
    ///
    /// A transient error when no attempt was acknowledged in time: the message may or may not
    /// have been stored. To send it again yourself, give it an id first: a message without
    /// one gets a new random id on every call, and two calls may store two messages.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored.
    pub async fn send(&self, mut message: Message) -> Result<MessageId, TransportError> {
        let id = message.message_id.get_or_insert_with(MessageId::random).clone();
        let clock = &self.inner.options.clock;
        let window = self.inner.options.send_timeout.min(self.inner.duplicate_window);
        let until = clock.now() + window;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.send_to(&self.inner.subject, &message, &[]).await {
                Ok(_) => return Ok(id),
                Err(e) if clock.now() + pause < until => {
                    tracing::debug!(stream = %self.stream(), id = %id, "a publish was not acknowledged; trying again with the same id: {e}");
                    clock.sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Publishes once and returns whether the stream took it as a duplicate.
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

    /// Sends a message (which must carry an id) once and returns true when the stream dropped
    /// it as a duplicate of one sent within the duplicate window. Unlike
    /// [`NatsTransport::send`] it does not try again: a second attempt would report the first.
    ///
    /// # Errors
    ///
    /// [`TransportError::Invalid`] for a message without an id; otherwise a transient error
    /// when the stream did not acknowledge it.
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

    /// Reads up to `max` messages of the stream from sequence `from` on (the first one when
    /// `None`), without taking them: no delivery, no lock, no count. A dead-lettered copy
    /// shows its reason, description and source, and the id its original had (or, when that
    /// had none, the id of its move).
    ///
    /// # Errors
    ///
    /// When the server is unreachable or the stream does not exist.
    pub async fn peek(
        &self,
        from: Option<u64>,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        let mut stream = self
            .inner
            .context
            .get_stream(&self.inner.options.stream)
            .await
            .map_err(|e| other("opening the stream", e))?;
        let state = stream.info().await.map_err(|e| other("reading the stream", e))?.state.clone();
        let mut out = Vec::new();
        let mut sequence = from.unwrap_or(state.first_sequence).max(state.first_sequence);
        while out.len() < max && state.messages > 0 && sequence <= state.last_sequence {
            // The first stored message at or after `sequence`, skipping those acknowledged.
            let raw = match stream
                .raw_message_builder()
                .sequence(sequence)
                .next_by_subject(">")
                .send()
                .await
            {
                Ok(raw) => raw,
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
                {
                    break;
                }
                Err(e) => return Err(other("reading the stream", e)),
            };
            let parsed = convert::from_parts(Some(&raw.headers), raw.payload.clone());
            let enqueued =
                i64::try_from(raw.time.unix_timestamp_nanos() / 1_000_000).unwrap_or_default();
            let mut message = parsed.message;
            if message.message_id.is_none() {
                message.message_id = parsed.stored_id.map(MessageId::new);
            }
            let mut m = ReceivedMessage::new(
                message,
                twice::SequenceNumber::new(i64::try_from(raw.sequence).unwrap_or(i64::MAX)),
                Timestamp::from_millis(enqueued),
            );
            m.dead_letter_reason = parsed.reason;
            m.dead_letter_error_description = parsed.description;
            m.dead_letter_source = parsed.source;
            out.push(m);
            sequence = raw.sequence + 1;
        }
        Ok(out)
    }

    /// Removes every message of the stream; returns how many. For emptying a stream before a
    /// run, not for dead-lettered messages, which deserve a copy first (`twice dlq purge`).
    ///
    /// # Errors
    ///
    /// When the server is unreachable or the stream does not exist.
    pub async fn purge(&self) -> Result<u64, TransportError> {
        let s = self
            .inner
            .context
            .get_stream(&self.inner.options.stream)
            .await
            .map_err(|e| other("opening the stream", e))?;
        Ok(s.purge().await.map_err(|e| other("purging the stream", e))?.purged)
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

    /// The delivery of `raw`, pulled by a request sent at `requested`; `None` for one that is
    /// moved to the dead-letter stream instead of being handed out.
    fn accept(&self, raw: jetstream::Message, requested: Timestamp) -> Option<NatsDelivery> {
        let received = match convert::from_jetstream(&raw) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(stream = %self.stream(), "a delivery without JetStream metadata: {e}");
                return None;
            }
        };
        let mut message = received.message;
        let identity = &self.inner.options.identity;
        let claimed = identity.identify(&message.message);
        if self.inner.is_dead_letter {
            // Nothing further to send it to: it is shown, under the id of its move when its
            // original had none.
            message.message.message_id = claimed
                .or_else(|| message.message.message_id.clone())
                .or_else(|| received.stored_id.map(MessageId::new))
                .or_else(|| Some(MessageId::random()));
        } else {
            let exhausted =
                self.inner.info.max_delivery_count.filter(|max| received.delivered > *max);
            let reason = match (&claimed, exhausted) {
                (None, _) => Some(DeadLetterReason::new(
                    MISSING_MESSAGE_ID,
                    "the identity policy found no id for it, so its copies cannot be told apart",
                )),
                (Some(_), Some(max)) => Some(DeadLetterReason::new(
                    MAX_DELIVERY_COUNT_EXCEEDED,
                    format!("delivered more than {max} times"),
                )),
                (Some(_), None) => None,
            };
            message.message.message_id = claimed;
            if let Some(reason) = reason {
                let this = self.clone();
                let stored_at = received.stored_at_nanos;
                tokio::spawn(async move {
                    this.move_or_retry_later(&message, &reason, &raw, stored_at).await;
                });
                return None;
            }
        }
        let sequence = raw_sequence(&message);
        self.newest().insert(sequence, received.delivered);
        let until = requested + self.inner.ack_wait;
        message.lock_token = Some(twice::LockToken::random());
        message.locked_until = Some(until);
        Some(NatsDelivery {
            message,
            raw,
            settled: AtomicBool::new(false),
            locked_until: AtomicI64::new(until.as_millis()),
            stored_at_nanos: received.stored_at_nanos,
        })
    }

    /// Moves a delivery no handler may see to the dead-letter stream; when the move fails, the
    /// delivery is sent back with a delay, to be moved on its next delivery.
    async fn move_or_retry_later(
        &self,
        message: &ReceivedMessage,
        reason: &DeadLetterReason,
        raw: &jetstream::Message,
        stored_at_nanos: i128,
    ) {
        if let Err(e) = self.move_to_dead_letter_stream(message, reason, raw, stored_at_nanos).await
        {
            // Later deliveries wait longer: from one second to a minute.
            let n = message.delivery_count.saturating_sub(1).min(6);
            let delay = Duration::from_secs(1 << n).min(Duration::from_secs(60));
            tracing::warn!(stream = %self.stream(), sequence = %message.sequence_number, "moving a message to the dead-letter stream failed; it comes back in {delay:?} to be moved then: {e}");
            let _ = raw.ack_with(AckKind::Nak(Some(delay))).await;
        }
    }

    async fn move_to_dead_letter_stream(
        &self,
        message: &ReceivedMessage,
        reason: &DeadLetterReason,
        raw: &jetstream::Message,
        stored_at_nanos: i128,
    ) -> Result<(), TransportError> {
        let Some(dead_letters) = &self.inner.dead_letters else {
            return Err(TransportError::Unsupported("dead-lettering from a dead-letter stream"));
        };
        let original = Original {
            message: &message.message,
            sequence: raw_sequence(message),
            stored_at_nanos,
            delivery_count: Some(message.delivery_count),
        };
        dead_letters.store_copy(&original, reason).await?;
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

    fn consumer(&self) -> jetstream::consumer::PullConsumer {
        self.inner.consumer.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Pulls up to `max` messages, waiting up to `wait` for them (`None`: only those there
    /// now); each comes with the moment the request was sent.
    async fn pull(
        &self,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<(jetstream::Message, Timestamp)>, TransportError> {
        let requested = self.inner.options.clock.now();
        let consumer = self.consumer();
        let batch = match wait {
            None => consumer.fetch().max_messages(max).messages().await,
            Some(wait) => {
                consumer
                    .batch()
                    .max_messages(max)
                    .expires(wait.max(Duration::from_millis(10)))
                    .messages()
                    .await
            }
        };
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                self.reattach_if_gone().await;
                return Err(other("pulling", e));
            }
        };
        // A pull request the server never answers (lost with a server that was killed, or on
        // the way to it) would leave the batch waiting for ever: a fetch has no expiry, and the
        // client's own timer of a waiting pull comes late. The pull ends a grace period after
        // its wait; messages that came for it after that come back at `AckWait`.
        let clock = &self.inner.options.clock;
        let deadline = requested + wait.unwrap_or_default() + PULL_GRACE;
        let mut out = Vec::new();
        loop {
            let left = deadline.duration_since(clock.now());
            match tokio::time::timeout(left, batch.next()).await {
                Ok(Some(Ok(m))) => out.push((m, requested)),
                Ok(Some(Err(e))) => {
                    if out.is_empty() {
                        self.reattach_if_gone().await;
                    }
                    return if out.is_empty() { Err(other("pulling", e)) } else { Ok(out) };
                }
                Ok(None) => return Ok(out),
                Err(_) if out.is_empty() => {
                    return Err(TransportError::Other {
                        message: format!(
                            "pulling: the server did not answer a pull request within {:?}",
                            wait.unwrap_or_default() + PULL_GRACE
                        ),
                        transient: true,
                        source: None,
                    });
                }
                Err(_) => return Ok(out),
            }
        }
    }

    /// After a failed pull: when the consumer is gone (its stream was deleted and made again),
    /// makes it again and pulls from the new one from now on.
    async fn reattach_if_gone(&self) {
        match attach::reattach(&self.inner.context, &self.inner.options).await {
            Ok(Some(consumer)) => {
                *self.inner.consumer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    consumer;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(stream = %self.stream(), "the consumer could not be made again: {e}")
            }
        }
    }

    /// The longest one waiting pull waits: a quarter of the lock, so that a message it brings
    /// never has most of its lock gone.
    fn longest_pull(&self) -> Duration {
        (self.inner.ack_wait / 4).max(Duration::from_millis(10))
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
        let clock = self.inner.options.clock.clone();
        let until = clock.now() + max_wait;
        let mut out: Vec<NatsDelivery> = Vec::new();
        let raw = self.pull(max_messages, None).await?;
        out.extend(raw.into_iter().filter_map(|(m, at)| self.accept(m, at)));
        while out.is_empty() {
            // Nothing there: wait for one (a quarter of the lock at a time), then take what
            // else came with it.
            let left = until.duration_since(clock.now());
            if left.is_zero() {
                break;
            }
            let raw = self.pull(1, Some(left.min(self.longest_pull()))).await?;
            out.extend(raw.into_iter().filter_map(|(m, at)| self.accept(m, at)));
            if !out.is_empty() && max_messages > 1 {
                let raw = self.pull(max_messages - 1, None).await?;
                out.extend(raw.into_iter().filter_map(|(m, at)| self.accept(m, at)));
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
        if self.inner.dead_letters.is_none() {
            return Err(TransportError::Unsupported("dead-lettering from a dead-letter stream"));
        }
        self.take(delivery)?;
        self.move_to_dead_letter_stream(
            &delivery.message,
            &reason,
            &delivery.raw,
            delivery.stored_at_nanos,
        )
        .await
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
        // The server restarts AckWait when the +WPI reaches it, which is after now.
        let sent = clock.now();
        if delivery.settled.load(Ordering::SeqCst)
            || sent.as_millis() >= delivery.locked_until.load(Ordering::SeqCst)
        {
            return Err(TransportError::LockLost);
        }
        delivery.raw.double_ack_with(AckKind::Progress).await.map_err(|e| other("renewing", e))?;
        let until = sent + self.inner.ack_wait;
        delivery.locked_until.store(until.as_millis(), Ordering::SeqCst);
        Ok(until)
    }
}
