//! The transactional outbox: messages a handler sends commit with its work.
//!
//! A handler that sends a follow-up message straight to the broker either sends it before its
//! transaction commits (a rollback or a crash then leaves a *ghost*: an event for work that
//! never happened) or after (a crash in between *loses* it). With the outbox, a handler sends
//! through its [`Context`](crate::Context) instead ([`Context::send`](crate::Context::send),
//! [`Context::publish`](crate::Context::publish), [`Context::schedule`](crate::Context::schedule)):
//! the processor writes those messages as rows of an outbox table in the transaction that
//! claimed the incoming message and holds the handler's work, just before its commit. Work that
//! rolls back leaves no row; work that commits always has its rows. A [`Relay`] then sends the
//! committed rows on a broker ([`Publish`]) and deletes them once the broker has acknowledged
//! them (within [`RelayOptions::mark_delay`], many turns' rows in one statement).
//!
//! Outside a handler (an HTTP request that writes an order and publishes `OrderPlaced`), the
//! store's own API writes the same rows into the caller's transaction (`twice-sqlx`:
//! `SqlxOutbox::send`), with the same guarantee.
//!
//! # Stable outgoing ids
//!
//! Every outgoing message has its message id fixed *when its row is written*, so every send of
//! the row, whoever sends it and however often, carries the same id:
//!
//! - a message the caller gave an id keeps it (the caller's own stable key);
//! - otherwise, in a handler, the id is derived from the consumer, the incoming message id and
//!   the message's index among the handler's sends ([`outgoing_message_id`]): the same on every
//!   run of the handler for that message, so even a handler that runs twice without a claim
//!   ([`Mode::NaturallyIdempotent`](crate::Mode::NaturallyIdempotent)) sends the same ids;
//! - outside a handler, a writer made for a business key derives ids from that key and the
//!   index; without one the id is a new random one, stored in the row.
//!
//! A relay that dies after the broker acknowledged a message and before it deleted the row
//! sends the row again, with the same id. What drops the second copy depends on the broker:
//!
//! | broker | what drops a re-sent id |
//! |---|---|
//! | Azure Service Bus, `twice serve`, the embedded broker | the entity's duplicate detection (`RequiresDuplicateDetection`), within its window; and a twice processor's inbox downstream |
//! | NATS JetStream | the stream's duplicate window (`Nats-Msg-Id`); and the inbox downstream |
//! | RabbitMQ | nothing in the broker (it has no duplicate detection): the receiver's inbox is the guard |
//!
//! # Order
//!
//! Rows are sent in the order they were written within an *ordering key*: the messages of one
//! handler run (or of one outside writer) share a key, except that a message with a session id
//! takes the key of its destination and session, so a session's messages go out in order
//! whichever runs wrote them, and a message scheduled for later has a key of its own (it must
//! not hold back the rest). A row that fails for a while holds back the later rows of its key;
//! a row the broker refuses for good is *parked* (kept with its reason, never sent) and the
//! rows after it go on.
//!
//! # Several relays
//!
//! Any number of relays may serve one table: a relay *leases* the rows it sends (for
//! [`RelayOptions::lease_duration`]), and rows another relay holds are skipped. A relay that
//! dies leaves its leases to expire; the rows are then sent by another relay, with the same
//! ids. The store ([`OutboxStore`]) says how leases are taken (`twice-sqlx`: `FOR UPDATE SKIP
//! LOCKED` on PostgreSQL and MariaDB, the single writer on SQLite).
//!
//! A relay running in the process that commits does not need to lease what that process
//! writes: the processor writes a handler's rows already leased to it and hands them over in
//! memory once the transaction has committed ([`Wake`]). The relay sends them at once, without
//! reading the table; rows written elsewhere, and rows whose hand-over was lost, it leases.

mod marks;
mod relay;
mod store;

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::clock::Timestamp;
use crate::ids::MessageId;
use crate::message::Message;
use crate::trace_context::{self, TraceParent};
use crate::transport::TransportError;

pub use relay::{Relay, RelayCounters, RelayOptions, RelaySnapshot, Sent};
pub use store::{LeasedMessage, OutboxStats, OutboxStore};

/// The longest destination (entity path, queue, subject) an outgoing message may name:
/// Service Bus's limit on an entity path.
pub const MAX_DESTINATION_CHARS: usize = 260;

/// The longest message id an outgoing message may carry: the inbox key's limit downstream.
pub const MAX_MESSAGE_ID_CHARS: usize = 255;

/// The longest session id an outgoing message may carry: Service Bus's limit.
pub const MAX_SESSION_ID_CHARS: usize = 128;

/// A message on its way out: where it goes, the message (with its id set), and the key that
/// orders it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct OutgoingMessage {
    /// Where it goes: an entity path (a queue or a topic) on Service Bus, a queue on
    /// RabbitMQ, a subject on NATS.
    pub destination: String,
    /// The message; its `message_id` is always set.
    pub message: Message,
    /// Rows of one key are sent in the order they were written.
    pub ordering_key: String,
    /// When it was written (the writer's clock), for the relay's lag.
    pub created_at: Timestamp,
}

/// Why a message could not be put in the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The processor's inbox store has no outbox, so a handler cannot send through it.
    #[error(
        "the handler sent a message through ctx.send/publish/schedule, but the inbox store has \
         no outbox: give it one (twice-sqlx: SqlxInbox::with_outbox)"
    )]
    NotConfigured,
    /// The destination is empty or too long.
    #[error(
        "invalid destination {0:?}: give an entity, queue or subject name of 1 to \
         {MAX_DESTINATION_CHARS} characters"
    )]
    InvalidDestination(String),
    /// A field of the message is out of range.
    #[error("invalid outgoing message: {0}")]
    InvalidMessage(String),
}

impl OutboxError {
    /// The dead-letter reason of a message whose handler raised this error.
    pub fn dead_letter_reason(&self) -> &'static str {
        match self {
            Self::NotConfigured => crate::dead_letter_reasons::OUTBOX_NOT_CONFIGURED,
            Self::InvalidDestination(_) | Self::InvalidMessage(_) => {
                crate::dead_letter_reasons::INVALID_OUTGOING_MESSAGE
            }
        }
    }
}

/// The id of the `index`th (from 0) message sent by `consumer`'s handler for the incoming
/// message `incoming`: a name-based UUID, the same on every run of the handler for that
/// message.
///
/// ```
/// use twice::MessageId;
/// use twice::outbox::outgoing_message_id;
///
/// let incoming = MessageId::new("order-42-placed");
/// let a = outgoing_message_id("shipping", &incoming, 0);
/// assert_eq!(a, outgoing_message_id("shipping", &incoming, 0));
/// assert_ne!(a, outgoing_message_id("shipping", &incoming, 1));
/// assert_ne!(a, outgoing_message_id("billing", &incoming, 0));
/// ```
pub fn outgoing_message_id(consumer: &str, incoming: &MessageId, index: u32) -> MessageId {
    let index = index.to_string();
    MessageId::new(crate::idempotency::name_uuid(&[consumer, incoming.as_str(), &index, "outbox"]))
}

/// The id of the `index`th message written for the business key `key` by `producer` outside
/// a handler (see [`Outgoing::for_key`]).
pub fn keyed_message_id(producer: &str, key: &str, index: u32) -> MessageId {
    let index = index.to_string();
    MessageId::new(crate::idempotency::name_uuid(&[producer, key, &index, "outbox-key"]))
}

/// The ordering key of the messages of one handler run, or of one outside writer.
fn run_key(scope: &str, run: &str) -> String {
    format!("run:{}", crate::idempotency::name_uuid(&[scope, run]))
}

/// The ordering key of a destination's session: the same whoever writes to it.
fn session_key(destination: &str, session: &str) -> String {
    format!(
        "{SESSION_KEY_PREFIX}{}",
        crate::idempotency::name_uuid(&[destination, session, "session"])
    )
}

const SESSION_KEY_PREFIX: &str = "session:";

/// Whether rows of `ordering_key` may be written by more than one transaction: a session's
/// key is (every run that sends to the session writes under it); the key of one handler run,
/// of a scheduled message or of one outside writer is written by one transaction. Only rows of
/// such keys can have an earlier unsent row that another relay holds.
///
/// ```
/// use twice::outbox::{Outgoing, key_spans_transactions};
/// use twice::{Message, MessageId, Timestamp};
///
/// let run = Outgoing::for_message("shipping", &MessageId::new("m-1"), None, Timestamp::UNIX_EPOCH);
/// run.push("events", Message::new("a").with_session_id("customer-7"))?;
/// run.push("shipped", Message::new("b"))?;
/// let rows = run.take();
/// assert!(key_spans_transactions(&rows[0].ordering_key));
/// assert!(!key_spans_transactions(&rows[1].ordering_key));
/// # Ok::<(), twice::OutboxError>(())
/// ```
pub fn key_spans_transactions(ordering_key: &str) -> bool {
    ordering_key.starts_with(SESSION_KEY_PREFIX)
}

/// The messages one handler run (or one outside writer) sends: their ids and ordering keys
/// come from here. The processor makes one per attempt and writes what it holds into the
/// outbox before the commit; an attempt that rolls back drops it.
#[derive(Debug)]
pub struct Outgoing {
    scope: String,
    /// The incoming message id, or the writer's key.
    run: String,
    /// Derive ids from an incoming message (true) or from a business key (false); `None`:
    /// random ids.
    derive: Option<bool>,
    trace_parent: Option<TraceParent>,
    now: Timestamp,
    messages: Mutex<Vec<OutgoingMessage>>,
}

impl Outgoing {
    /// The outgoing messages of `consumer`'s handler for the message `incoming`, written at
    /// `now`; each carries `trace_parent` (the incoming message's trace) unless it has a trace
    /// context of its own.
    pub fn for_message(
        consumer: &str,
        incoming: &MessageId,
        trace_parent: Option<TraceParent>,
        now: Timestamp,
    ) -> Self {
        Self {
            scope: consumer.to_owned(),
            run: incoming.as_str().to_owned(),
            derive: Some(true),
            trace_parent,
            now,
            messages: Mutex::new(Vec::new()),
        }
    }

    /// Messages written outside a handler for the business key `key` (say `order-42`) by
    /// `producer`: ids derived from both and the index, so writing the same messages again
    /// for the same key gives the same ids.
    pub fn for_key(producer: &str, key: &str, now: Timestamp) -> Self {
        Self {
            scope: producer.to_owned(),
            run: key.to_owned(),
            derive: Some(false),
            trace_parent: None,
            now,
            messages: Mutex::new(Vec::new()),
        }
    }

    /// Messages written outside a handler with no key of their own: each gets a new random
    /// id (kept in its row), and they share one ordering key.
    pub fn random(now: Timestamp) -> Self {
        Self {
            scope: String::new(),
            run: MessageId::random().into_string(),
            derive: None,
            trace_parent: None,
            now,
            messages: Mutex::new(Vec::new()),
        }
    }

    /// Adds a message for `destination`; returns its id.
    ///
    /// # Errors
    ///
    /// [`OutboxError::InvalidDestination`] or [`OutboxError::InvalidMessage`] (an id, a
    /// session id or a destination out of range).
    pub fn push(&self, destination: &str, mut message: Message) -> Result<MessageId, OutboxError> {
        let chars = destination.chars().count();
        if chars == 0 || chars > MAX_DESTINATION_CHARS {
            return Err(OutboxError::InvalidDestination(destination.to_owned()));
        }
        if let Some(session) = &message.session_id {
            let len = session.as_str().chars().count();
            if len == 0 || len > MAX_SESSION_ID_CHARS {
                return Err(OutboxError::InvalidMessage(format!(
                    "the session id is {len} characters long; use 1 to {MAX_SESSION_ID_CHARS}"
                )));
            }
        }
        let mut messages = self.messages.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let index = u32::try_from(messages.len()).unwrap_or(u32::MAX);
        let id = match &message.message_id {
            Some(id) => {
                let len = id.as_str().chars().count();
                if len == 0 || len > MAX_MESSAGE_ID_CHARS {
                    return Err(OutboxError::InvalidMessage(format!(
                        "the message id is {len} characters long; use 1 to \
                         {MAX_MESSAGE_ID_CHARS}"
                    )));
                }
                id.clone()
            }
            None => match self.derive {
                Some(true) => outgoing_message_id(&self.scope, &MessageId::new(&*self.run), index),
                Some(false) => keyed_message_id(&self.scope, &self.run, index),
                None => MessageId::random(),
            },
        };
        message.message_id = Some(id.clone());
        if let Some(parent) = &self.trace_parent
            && trace_context::extract(&message).is_none()
        {
            trace_context::inject(&mut message, parent);
        }
        let ordering_key = if message.scheduled_enqueue_time.is_some() {
            format!("id:{}", crate::idempotency::name_uuid(&[&self.scope, &self.run, id.as_str()]))
        } else if let Some(session) = &message.session_id {
            session_key(destination, session.as_str())
        } else {
            run_key(&self.scope, &self.run)
        };
        messages.push(OutgoingMessage {
            destination: destination.to_owned(),
            message,
            ordering_key,
            created_at: self.now,
        });
        Ok(id)
    }

    /// How many messages are held.
    pub fn len(&self) -> usize {
        self.messages.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The messages, in the order they were added; the buffer is left empty.
    pub fn take(&self) -> Vec<OutgoingMessage> {
        std::mem::take(
            &mut *self.messages.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// Wakes a relay at once when rows it serves have committed, and hands it the rows this
/// process wrote for it: a cheap clone shared by the store, the processor and the relay.
///
/// A relay that runs attaches itself to its store's `Wake` ([`Wake::local_relay`] then names
/// it). A processor's store writes the rows of a handler's transaction already leased to that
/// relay, and once the transaction has committed hands them over in memory
/// ([`Staged::committed`]): the relay sends them without leasing them first, so a row costs its
/// insert and its deletion only, and goes out without a read of the table. Rows handed over
/// are checked for order against the table ([`OutboxStore::adopt`]) before they are sent.
///
/// A relay in another process is not woken; it finds the rows at its next poll
/// ([`RelayOptions::poll_interval`]). Rows whose hand-over was lost (a commit of unknown
/// outcome, a relay that stopped) are found once their lease ends.
#[derive(Clone, Debug, Default)]
pub struct Wake(Arc<WakeInner>);

#[derive(Debug, Default)]
struct WakeInner {
    notify: Notify,
    /// Set by a wake for rows the relay must lease (written unleased); a hand-over alone
    /// does not set it, since the relay sends those rows without reading the table.
    lease_wanted: AtomicBool,
    local: Mutex<Local>,
}

#[derive(Debug, Default)]
struct Local {
    relay: Option<LocalRelay>,
    handed: Vec<LeasedMessage>,
    attachments: u64,
}

#[derive(Debug)]
struct LocalRelay {
    owner: String,
    lease: std::time::Duration,
    attachment: u64,
}

/// The most rows handed over and not yet taken by the relay: beyond that, writers stop
/// leasing rows to it, and it leases them from the table as other processes' rows.
pub const MAX_HANDED_ROWS: usize = 10_000;

impl Wake {
    /// A new waker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wakes the relay to read the table (rows were written that it must lease); a wake
    /// given while it is busy is kept for its next wait.
    pub fn wake(&self) {
        self.0.lease_wanted.store(true, Ordering::Release);
        self.0.notify.notify_one();
    }

    /// Whether a wake asked for a read of the table since the last call.
    pub(crate) fn take_lease_wanted(&self) -> bool {
        self.0.lease_wanted.swap(false, Ordering::AcqRel)
    }

    /// Resolves at the next wake (or at once for a wake kept from before).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn woken(&self) {
        self.0.notify.notified().await;
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        self.0.local.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The relay of this process that rows written now may be leased to at once (its owner
    /// name and lease duration), if one is attached and keeps up with what it is handed.
    pub fn local_relay(&self) -> Option<(String, std::time::Duration)> {
        let local = self.local();
        let relay = local.relay.as_ref()?;
        (local.handed.len() < MAX_HANDED_ROWS).then(|| (relay.owner.clone(), relay.lease))
    }

    /// Attaches a relay as the one rows are handed to, until the returned guard drops; a
    /// second relay on the same store stays unattached and leases rows as usual.
    pub(crate) fn attach(&self, owner: &str, lease: std::time::Duration) -> Attachment {
        let mut local = self.local();
        if local.relay.is_some() {
            return Attachment { wake: None, attachment: 0 };
        }
        local.attachments += 1;
        let attachment = local.attachments;
        local.relay = Some(LocalRelay { owner: owner.to_owned(), lease, attachment });
        Attachment { wake: Some(self.clone()), attachment }
    }

    /// Hands `rows`, leased to `owner`, to the attached relay if it is still `owner`, and
    /// wakes it; a relay that is gone leaves them to the end of their leases.
    fn hand(&self, owner: &str, rows: Vec<LeasedMessage>) {
        let mut local = self.local();
        if local.relay.as_ref().is_some_and(|r| r.owner == owner) {
            local.handed.extend(rows);
        }
        drop(local);
        self.0.notify.notify_one();
    }
}

/// A relay's attachment to a [`Wake`]; dropped, the relay is detached and what it was
/// handed and did not take is left to its leases' end.
#[derive(Debug)]
pub(crate) struct Attachment {
    wake: Option<Wake>,
    attachment: u64,
}

impl Attachment {
    /// The rows handed over since the last call, in the order they were handed; none for a
    /// relay that is not the attached one.
    pub(crate) fn take_handed(&self) -> Vec<LeasedMessage> {
        match &self.wake {
            Some(wake) => std::mem::take(&mut wake.local().handed),
            None => Vec::new(),
        }
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if let Some(wake) = &self.wake {
            let mut local = wake.local();
            if local.relay.as_ref().is_some_and(|r| r.attachment == self.attachment) {
                local.relay = None;
                local.handed.clear();
            }
        }
    }
}

/// What a store's [`Inbox::stage`](crate::Inbox::stage) wrote: told, once the transaction
/// has committed, it wakes the relay of this process and hands it the rows written leased to
/// it. Dropped without [`Staged::committed`] (a rollback, a commit that failed), it does
/// nothing: rows that did commit are found once their lease ends.
#[derive(Debug, Default)]
#[must_use = "call committed() after the transaction commits, or the relay is not woken"]
pub struct Staged {
    wake: Option<Wake>,
    owner: String,
    rows: Vec<LeasedMessage>,
}

impl Staged {
    /// Nothing written.
    pub fn nothing() -> Self {
        Self::default()
    }

    /// Rows written unleased: the commit wakes the relay, which leases them.
    pub fn wake(wake: Wake) -> Self {
        Self { wake: Some(wake), owner: String::new(), rows: Vec::new() }
    }

    /// `rows` written leased to the local relay `owner` (see [`Wake::local_relay`]): the
    /// commit hands them over.
    pub fn handed_to(wake: Wake, owner: String, rows: Vec<LeasedMessage>) -> Self {
        Self { wake: Some(wake), owner, rows }
    }

    /// Whether anything was written.
    pub fn wrote(&self) -> bool {
        self.wake.is_some()
    }

    /// The transaction committed: the relay is handed the rows leased to it, or woken to
    /// lease the rows written unleased.
    pub fn committed(self) {
        if let Some(wake) = self.wake {
            if self.rows.is_empty() {
                wake.wake();
            } else {
                wake.hand(&self.owner, self.rows);
            }
        }
    }
}

/// Sends messages to a broker's entities: what a [`Relay`] needs from a broker. The embedded
/// broker, the Service Bus client, RabbitMQ and NATS JetStream implement it.
pub trait Publish: Send + Sync + fmt::Debug + 'static {
    /// The messaging system, as the OpenTelemetry semantic conventions name it.
    fn system(&self) -> &'static str {
        "unknown"
    }

    /// Whether the broker holds a message with a scheduled enqueue time until that time. When
    /// it does not, the relay keeps such a row until it is due and sends it then.
    fn schedules(&self) -> bool {
        false
    }

    /// Sends `message` (its id set) to `destination`; returns once the broker has stored it,
    /// or dropped it as a duplicate of an id it has seen.
    ///
    /// Errors the relay parks the row for (never to be retried): [`TransportError::EntityNotFound`],
    /// [`TransportError::Invalid`] (e.g. a message over the entity's size),
    /// [`TransportError::Unsupported`], and [`TransportError::Other`] that is not transient.
    /// Every other error is retried with a backoff.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored; the relay sends the
    /// row again with the same id.
    fn publish(
        &self,
        destination: &str,
        message: Message,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Sends `messages` to `destination`, stored in this order; returns once the broker has
    /// them all. The relay sends rows that go to one destination this way, in batches of at
    /// most [`RelayOptions::max_batch_bytes`] of bodies.
    ///
    /// On an error, [`BatchError::stored`] says how many of the first messages the broker
    /// surely has (the relay marks them sent); any of the others may have been stored too (the
    /// relay sends them again, with the same ids). A permanent error with more than one
    /// message not surely stored may be any one's, and the relay then sends those one by one
    /// to find which. The default sends them one by one with [`Publish::publish`] and stops
    /// at the first error.
    ///
    /// # Cancel safety
    ///
    /// As [`Publish::publish`].
    fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> impl Future<Output = Result<(), BatchError>> + Send {
        async move {
            for (stored, message) in messages.into_iter().enumerate() {
                self.publish(destination, message)
                    .await
                    .map_err(|error| BatchError { stored, error })?;
            }
            Ok(())
        }
    }
}

/// A batch that [`Publish::publish_batch`] could not send whole.
#[derive(Debug)]
pub struct BatchError {
    /// How many of the batch's first messages the broker surely has (0 for a broker that
    /// takes a batch all or nothing).
    pub stored: usize,
    /// Why the rest did not go.
    pub error: TransportError,
}

impl BatchError {
    /// None of the batch is surely stored.
    pub fn none(error: TransportError) -> Self {
        Self { stored: 0, error }
    }
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (the first {} of the batch were stored)", self.error, self.stored)
    }
}

impl std::error::Error for BatchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<P: Publish> Publish for Arc<P> {
    fn system(&self) -> &'static str {
        (**self).system()
    }

    fn schedules(&self) -> bool {
        (**self).schedules()
    }

    fn publish(
        &self,
        destination: &str,
        message: Message,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        (**self).publish(destination, message)
    }

    fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> impl Future<Output = Result<(), BatchError>> + Send {
        (**self).publish_batch(destination, messages)
    }
}

/// Whether the relay gives up on a row for `error` (parks it) rather than retrying.
pub fn is_permanent(error: &TransportError) -> bool {
    match error {
        TransportError::EntityNotFound(_)
        | TransportError::Invalid(_)
        | TransportError::Unsupported(_) => true,
        TransportError::Other { transient, .. } => !transient,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_per_run_and_index_and_a_given_id_is_kept() {
        let incoming = MessageId::new("m-1");
        let a = Outgoing::for_message("shipping", &incoming, None, Timestamp::from_millis(5));
        let first = a.push("shipped", Message::new("x")).expect("valid");
        let second = a.push("shipped", Message::new("y")).expect("valid");
        let own = a.push("shipped", Message::new("z").with_message_id("mine")).expect("valid");
        assert_ne!(first, second);
        assert_eq!(own, MessageId::new("mine"));
        // Another run of the same handler for the same message: the same ids.
        let b = Outgoing::for_message("shipping", &incoming, None, Timestamp::from_millis(9));
        assert_eq!(b.push("shipped", Message::new("x")).expect("valid"), first);
        assert_eq!(b.push("other", Message::new("y")).expect("valid"), second);
        let rows = a.take();
        assert_eq!(rows.len(), 3);
        assert!(a.is_empty());
        assert!(rows.iter().all(|r| r.ordering_key == rows[0].ordering_key));
        assert_eq!(rows[0].created_at, Timestamp::from_millis(5));
        assert_eq!(rows[1].message.message_id.as_ref(), Some(&second));
    }

    #[test]
    fn sessions_and_schedules_take_keys_of_their_own() {
        let one = Outgoing::for_message("c", &MessageId::new("1"), None, Timestamp::UNIX_EPOCH);
        let two = Outgoing::for_message("c", &MessageId::new("2"), None, Timestamp::UNIX_EPOCH);
        one.push("q", Message::new("a").with_session_id("s")).expect("valid");
        two.push("q", Message::new("b").with_session_id("s")).expect("valid");
        one.push("q", Message::new("c")).expect("valid");
        two.push("q", Message::new("d")).expect("valid");
        one.push("q", Message::new("e").with_scheduled_enqueue_time(Timestamp::from_millis(9)))
            .expect("valid");
        let (one, two) = (one.take(), two.take());
        assert_eq!(one[0].ordering_key, two[0].ordering_key, "one session, one key");
        assert_ne!(one[1].ordering_key, two[1].ordering_key, "two runs, two keys");
        assert_ne!(one[2].ordering_key, one[1].ordering_key, "a scheduled message is alone");
        assert_ne!(one[0].ordering_key, one[1].ordering_key);
    }

    #[test]
    fn keyed_writers_repeat_their_ids_and_random_ones_do_not() {
        let now = Timestamp::UNIX_EPOCH;
        let a = Outgoing::for_key("shop", "order-42", now).push("q", Message::new("x"));
        let b = Outgoing::for_key("shop", "order-42", now).push("q", Message::new("x"));
        assert_eq!(a.expect("valid"), b.expect("valid"));
        let c = Outgoing::random(now).push("q", Message::new("x")).expect("valid");
        let d = Outgoing::random(now).push("q", Message::new("x")).expect("valid");
        assert_ne!(c, d);
    }

    #[test]
    fn bad_destinations_and_fields_are_refused() {
        let o = Outgoing::random(Timestamp::UNIX_EPOCH);
        assert!(matches!(o.push("", Message::new("x")), Err(OutboxError::InvalidDestination(_))));
        let long = "q".repeat(MAX_DESTINATION_CHARS + 1);
        assert!(matches!(
            o.push(&long, Message::new("x")),
            Err(OutboxError::InvalidDestination(_))
        ));
        let id = "i".repeat(MAX_MESSAGE_ID_CHARS + 1);
        assert!(matches!(
            o.push("q", Message::new("x").with_message_id(id)),
            Err(OutboxError::InvalidMessage(_))
        ));
        let session = "s".repeat(MAX_SESSION_ID_CHARS + 1);
        assert!(matches!(
            o.push("q", Message::new("x").with_session_id(session)),
            Err(OutboxError::InvalidMessage(_))
        ));
        assert!(o.is_empty(), "nothing refused is kept");
    }

    #[test]
    fn the_incoming_trace_is_carried_unless_the_message_has_its_own() {
        let parent: TraceParent =
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().expect("valid");
        let own: TraceParent =
            "00-11111111111111111111111111111111-2222222222222222-01".parse().expect("valid");
        let o =
            Outgoing::for_message("c", &MessageId::new("1"), Some(parent), Timestamp::UNIX_EPOCH);
        o.push("q", Message::new("a")).expect("valid");
        let mut m = Message::new("b");
        trace_context::inject(&mut m, &own);
        o.push("q", m).expect("valid");
        let rows = o.take();
        assert_eq!(trace_context::extract(&rows[0].message), Some(parent));
        assert_eq!(trace_context::extract(&rows[1].message), Some(own));
    }
}
