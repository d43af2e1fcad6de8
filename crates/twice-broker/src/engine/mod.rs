//! The broker engine: a pure state machine with Azure Service Bus semantics.
//!
//! **API in one paragraph.** [`Engine`] owns every entity, message and lock; it does no I/O and
//! reads no clock: every call that depends on time takes `now`. Resolve a path once with
//! [`Engine::resolve`] and pass the [`EntityRef`] to [`Engine::send_shared`] /
//! [`Engine::schedule`],
//! [`Engine::receive`] (peek-lock or receive-and-delete, up to N, parking a [`WaiterId`] when
//! nothing is there), and settle by [`LockToken`] with [`Engine::complete`] / `abandon` /
//! `dead_letter` / `defer` / `release` / `renew_lock`. Sessions: [`Engine::accept_session`]
//! returns an [`AcceptedSession`] whose [`SessionLock`] is used for `receive_session`,
//! `renew_session_lock`, `release_session` and session state. After any batch of calls the
//! runtime calls [`Engine::serve_waiters`] (with [`EngineOptions::deferred_serving`]), drains
//! [`Engine::take_records`] (write, fsync once, then reply), [`Engine::take_ready`] /
//! [`Engine::take_ready_sessions`] (parked waiters that were served) and
//! [`Engine::take_freed`], numbers the next batch with [`Engine::set_turn`], and sleeps until
//! [`Engine::next_deadline`] to call [`Engine::tick`]. A [`Delivery`] carries the message in
//! memory or the [`Location`] of the record holding it, and the turn its message last changed
//! in; [`received_message`] turns it into a [`twice::ReceivedMessage`]. Durability goes through
//! [`Record`]s: [`Engine::set_location`] once a record carrying a body is written (the body
//! stays in memory while [`EngineOptions::body_cache_bytes`] allows),
//! [`Engine::replay`] + [`Engine::finish_recovery`] at start, and for compaction
//! [`Engine::checkpoint_records`], [`Engine::segment_refs`], [`Engine::live_in_segment`] and
//! [`Engine::relocate`]. Entities come from [`Engine::create_entity`],
//! [`Engine::update_entity`], [`Engine::apply_definitions`] (a configuration file) and
//! [`Engine::delete_entity`]; [`Engine::counts`] and [`Engine::counters`] are O(1).
//!
//! # The delivery count
//!
//! [`twice::ReceivedMessage::delivery_count`] is 1-based: a message's first delivery carries 1.
//! The count rises by one when a peek-lock delivery ends without settling the message: an
//! abandon, a lock that expired, a session lock that expired with the message still locked,
//! and a restart that found the message locked. It does not rise on `release` (the message
//! never reached a handler), on the release of a session, on `defer`, nor on
//! receive-and-delete. When the count
//! of the next delivery would exceed the entity's `MaxDeliveryCount`, the message goes to the
//! dead-letter queue instead, with `DeadLetterReason` `MaxDeliveryCountExceeded` (it keeps that
//! count there). The Service Bus AMQP header `delivery-count` is 0-based: it carries the count
//! minus one.
//!
//! # Recovery
//!
//! Every change is a [`Record`]; replaying the log in order rebuilds entities, messages,
//! delivery counts, states, session states and duplicate-detection ids. Locks are not
//! recorded as tokens: a record says a message was locked, so after a restart
//! [`Engine::finish_recovery`] makes every message that was locked at the crash available
//! again (deferred ones stay deferred) with its delivery count raised by one, dead-lettering
//! it when that exceeds `MaxDeliveryCount`, and writes records for that. Session locks are not
//! durable either. A record that settles, locks or moves a message the engine does not have is
//! ignored: its message was written in a segment that compaction removed after the message
//! left. Any other inconsistency (a message for an unknown entity, a message placed twice, a
//! lock on a message in the wrong state) is [`Error::Corrupt`](crate::error::Error::Corrupt). The records of one send batch
//! are all-or-nothing: a batch cut short at the end of the log was never acknowledged and is
//! dropped.
//!
//! # Choices where Service Bus leaves room
//!
//! - Sequence numbers count per queue or topic; a topic's subscriptions share its numbers,
//!   and a dead-lettered message keeps its number in the dead-letter queue. Auto-forwarding and
//!   resubmitting give a new number in the receiving entity.
//! - A message matching several rules of one subscription is copied to it once.
//! - Scheduled messages stay in the queue or topic they were sent to until their time (so
//!   they are cancelled by that entity's sequence number), then take a new sequence number,
//!   as in Service Bus, and are forwarded or fanned out: a scheduled message queues behind
//!   every message sent before its time.
//!   `schedule` is not subject to duplicate detection (it must return a number per message);
//!   a `send` with a future `scheduled_enqueue_time` is.
//! - A locked message whose time to live passes stays with its receiver, who may still
//!   complete it; it expires when its lock ends.
//! - A deferred message whose time to live passes stays deferred until a receive by its
//!   sequence number tries it; that receive expires it and finds no message.
//! - Losing a session's lock (it expired) counts a delivery for each message still locked in
//!   it, as an abandon would; releasing the session leaves their counts as they were.
//!   Renewing the lock of a session message renews the session.
//!   Accept-next takes the free session whose oldest available message is oldest.
//! - Resubmitting a dead-lettered message clears its dead-letter fields, keeps the properties
//!   changed by abandon, and starts its delivery count again at 1.
//! - A message reaching a session-enabled subscription (or a forwarding target) without a
//!   session id is dead-lettered there with reason `Session ID is null`; sent directly to a
//!   session-enabled queue it is rejected. A `ForwardTo` naming an entity that does not exist
//!   when a message arrives leaves the message where it is.
//!
//! Old segments must be deleted oldest first: a segment may go when it and every older one
//! hold no live message (`segment_refs == 0`, after relocating what was live), since later
//! records (a raised delivery count, a deferral) only make sense on top of earlier ones.

mod apply;
mod bodies;
mod deliver;
mod durability;
mod entities;
mod fasthash;
mod lookups;
mod record;
mod route;
mod send;
mod seqmap;
mod sessions;
mod settle;
mod state;
mod timers;
mod waiters;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use rand::RngCore;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use twice::{LockToken, Message, MessageState, SequenceNumber, SessionId, Timestamp};

pub(crate) use self::deliver::{received_message, received_message_owned};
pub(crate) use self::send::message_size;
pub(crate) use record::{BodyKey, EntityId, Extra, PlacedState, Placement, Record, StoreKey};

use self::bodies::Bodies;
use self::fasthash::FastMap;
use self::state::{Aux, Entity, StoreIx};
use self::timers::{LockTimers, TimerKey};
use crate::config::{EntityDefinition, Rule};
// The engine speaks the public words for these: they are plain data, with no I/O behind them.
pub(crate) use crate::vocabulary::{ReceiveMode, SendOutcome};

/// Service Bus's largest batch, in messages.
pub(crate) const MAX_BATCH_MESSAGES: usize = 4500;
/// The default largest message (and batch), in bytes: Service Bus standard tier, 256 KiB.
pub(crate) const DEFAULT_MAX_MESSAGE_SIZE: usize = 256 * 1024;
/// The longest message id, session id or partition key.
pub(crate) const MAX_ID_LEN: usize = 128;
/// How many times a message may be auto-forwarded before it is dead-lettered with
/// `MaxTransferHopCountExceeded`.
pub(crate) const MAX_TRANSFER_HOPS: u32 = 4;

/// The suffix of a dead-letter queue's path (matched case-insensitively).
pub(crate) const DEAD_LETTER_SUFFIX: &str = "/$DeadLetterQueue";

/// Where a record is in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct Location {
    /// The segment file.
    pub(crate) segment: u32,
    /// The byte offset of the record in the segment.
    pub(crate) offset: u64,
    /// The record's length in bytes.
    pub(crate) len: u32,
}

/// Settings of an [`Engine`].
#[derive(Clone, Debug)]
pub(crate) struct EngineOptions {
    /// Whether the engine keeps [`Record`]s for [`Engine::take_records`]. Off in memory mode,
    /// where nothing is written.
    pub(crate) durable: bool,
    /// The largest message, and the largest batch, in bytes (see [`message_size`]).
    pub(crate) max_message_size: usize,
    /// The seed of the generator of lock tokens, session locks and assigned message ids when
    /// `entropy` is `None`: tests set it to repeat a run.
    pub(crate) seed: u64,
    /// The 256-bit seed of that generator (a CSPRNG), which the runtime draws from the
    /// operating system: a lock token then says nothing about the next ones, and a token
    /// from before a restart never matches a new lock.
    pub(crate) entropy: Option<[u8; 32]>,
    /// How many bytes of recently stored messages stay in memory after
    /// [`Engine::set_location`], so that they are delivered without reading the log (oldest
    /// first out). 0 drops each as soon as its record is written.
    pub(crate) body_cache_bytes: usize,
    /// Whether parked waiters are served only by [`Engine::serve_waiters`] (and before any
    /// receive that could overtake them) rather than at the end of every call. The runtime
    /// serves them once per turn, so that a receiver woken under load takes a batch instead
    /// of the first message that arrived.
    pub(crate) deferred_serving: bool,
    /// Whether messages the engine lets go of are kept for [`Engine::take_freed`] rather than
    /// dropped, so that the runtime can have them freed by its callers (on the threads that
    /// allocated them, off the broker's task).
    pub(crate) collect_freed: bool,
    /// The caps on queues and topics, subscriptions per topic and rules per subscription.
    pub(crate) limits: Limits,
}

/// One rule added to or removed from a subscription ([`Engine::change_rules`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RuleChange {
    /// This rule was added after the others.
    Added(Box<Rule>),
    /// The rule of this name was removed.
    Removed(String),
}

/// How many entities a namespace, subscriptions a topic and rules a subscription may hold;
/// past them a create is refused with [`Error::LimitExceeded`](crate::error::Error::LimitExceeded). The defaults are Service Bus
/// Standard's quotas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Queues and topics in the namespace (subscriptions do not count).
    pub(crate) max_entities: usize,
    /// Subscriptions of one topic.
    pub(crate) max_subscriptions_per_topic: usize,
    /// Rules of one subscription.
    pub(crate) max_rules_per_subscription: usize,
}

/// Service Bus Standard's cap on the queues and topics of a namespace.
pub(crate) const DEFAULT_MAX_ENTITIES: usize = 10_000;
/// Service Bus Standard's cap on the subscriptions of a topic.
pub(crate) const DEFAULT_MAX_SUBSCRIPTIONS_PER_TOPIC: usize = 2_000;
/// Service Bus's cap on the SQL filters of a topic, here on the rules of a subscription.
pub(crate) const DEFAULT_MAX_RULES_PER_SUBSCRIPTION: usize = 2_000;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_entities: DEFAULT_MAX_ENTITIES,
            max_subscriptions_per_topic: DEFAULT_MAX_SUBSCRIPTIONS_PER_TOPIC,
            max_rules_per_subscription: DEFAULT_MAX_RULES_PER_SUBSCRIPTION,
        }
    }
}

impl Default for EngineOptions {
    /// Durable, 256 KiB messages, a random 64-bit seed, no body cache, waiters served at once, freed
    /// messages dropped.
    fn default() -> Self {
        Self {
            durable: true,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            seed: uuid::Uuid::new_v4().as_u64_pair().0,
            entropy: None,
            body_cache_bytes: 0,
            deferred_serving: false,
            collect_freed: false,
            limits: Limits::default(),
        }
    }
}

/// A resolved entity path: a queue, topic or subscription, or a dead-letter queue. Cheap to
/// copy; cache it. It stays valid until the entity is deleted (a re-created entity of the same
/// name is a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct EntityRef {
    slot: u32,
    id: EntityId,
    dead_letter: bool,
}

impl EntityRef {
    /// Whether this is a `$DeadLetterQueue`.
    pub(crate) fn is_dead_letter(&self) -> bool {
        self.dead_letter
    }

    fn six(self) -> StoreIx {
        StoreIx::new(self.slot, self.dead_letter)
    }
}

/// Chosen by the runtime for each parked receive or accept-session request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct WaiterId(pub(crate) u64);

/// The lock on an accepted session; names the session in every session call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SessionLock(u64);

/// Where a delivered message's body is.
#[derive(Clone, Debug)]
pub(crate) enum Body {
    /// In memory.
    Memory(Arc<Message>),
    /// In the record at this location ([`Record::message`] of it).
    Stored(Location),
}

/// What the broker set on a delivered message.
#[derive(Clone, Debug)]
pub(crate) struct DeliveryMeta {
    pub(crate) sequence_number: SequenceNumber,
    pub(crate) enqueued_time: Timestamp,
    pub(crate) expires_at: Option<Timestamp>,
    pub(crate) lock_token: Option<LockToken>,
    pub(crate) locked_until: Option<Timestamp>,
    pub(crate) delivery_count: u32,
    pub(crate) state: MessageState,
    /// Properties modified by abandon/defer/dead-letter, and the dead-letter fields.
    pub(crate) extra: Option<Arc<Extra>>,
}

/// One delivered (or peeked) message.
#[derive(Clone, Debug)]
pub(crate) struct Delivery {
    pub(crate) body: Body,
    pub(crate) meta: DeliveryMeta,
    /// The turn (see [`Engine::set_turn`]) in which the message's state last changed before
    /// this delivery: the records it was delivered on are in that turn's commit or earlier.
    pub(crate) changed: u16,
}

/// A session locked by a receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AcceptedSession {
    pub(crate) lock: SessionLock,
    pub(crate) session_id: SessionId,
    pub(crate) locked_until: Timestamp,
}

/// A session listed by [`Engine::sessions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SessionSummary {
    pub(crate) session_id: SessionId,
    /// Whether it has a message that has not expired (in any state: available, locked,
    /// deferred or scheduled).
    pub(crate) has_messages: bool,
    pub(crate) state: Option<Bytes>,
}

/// Runtime counts of an entity (Service Bus `CountDetails`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EntityCounts {
    /// Available plus locked messages (Service Bus `ActiveMessageCount`).
    pub(crate) active: u64,
    /// Messages locked by a receiver (peek-lock, including locked deferred ones).
    pub(crate) locked: u64,
    /// Deferred messages (including locked ones).
    pub(crate) deferred: u64,
    /// Scheduled messages.
    pub(crate) scheduled: u64,
    /// Messages in the dead-letter queue.
    pub(crate) dead_letter: u64,
}

/// Monotone counters of an entity or of the whole engine, since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) sent: u64,
    pub(crate) duplicates: u64,
    pub(crate) received: u64,
    pub(crate) completed: u64,
    pub(crate) abandoned: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) lock_lost: u64,
    pub(crate) expired: u64,
}

/// A live stored message of a segment being compacted ([`Engine::live_in_segment`]).
#[derive(Clone, Debug)]
pub(crate) struct MessageRef {
    /// Where its body is now.
    pub(crate) location: Location,
    body: BodyKey,
    placements: Vec<(StoreIx, i64)>,
}

#[derive(Clone, Copy, Debug)]
struct Lock {
    six: StoreIx,
    seq: i64,
    until: Timestamp,
    session: Option<SessionLock>,
    /// Where its deadline is filed; `None` for a session's message, which the session lock
    /// times.
    timer: Option<TimerKey>,
}

#[derive(Clone, Copy, Debug)]
enum WaitKind {
    Receive,
    Session(SessionLock),
    Accept,
}

#[derive(Clone, Copy, Debug)]
struct Waiter {
    kind: WaitKind,
    six: StoreIx,
    mode: ReceiveMode,
    max: usize,
}

/// The broker's state machine. See the module documentation.
#[derive(Debug)]
pub(crate) struct Engine {
    opts: EngineOptions,
    /// Entities by slot; a deleted entity leaves `None` (slots are not reused).
    entities: Vec<Option<Entity>>,
    /// Lower-case path → slot.
    by_path: HashMap<String, u32>,
    by_id: FastMap<EntityId, u32>,
    next_entity_id: u64,
    aux: Aux,
    locks: FastMap<LockToken, Lock>,
    lock_timers: LockTimers,
    session_locks: FastMap<SessionLock, (StoreIx, u32)>,
    session_timers: std::collections::BTreeSet<(Timestamp, SessionLock)>,
    /// (end of the oldest window, slot) per entity with duplicate-detection history.
    dedup_timers: std::collections::BTreeSet<(Timestamp, u32)>,
    waiters: FastMap<WaiterId, Waiter>,
    ready: Vec<(WaiterId, Vec<Delivery>)>,
    ready_sessions: Vec<(WaiterId, Option<AcceptedSession>)>,
    records: Vec<Record>,
    /// Records of a send batch being replayed, applied when its last record arrives.
    pending_batch: Vec<(Record, Location)>,
    /// The generator of lock tokens, session locks and assigned message ids.
    rng: StdRng,
    totals: Counters,
}

impl Engine {
    /// An engine with no entities.
    pub(crate) fn new(options: EngineOptions) -> Self {
        let rng = match options.entropy {
            Some(seed) => StdRng::from_seed(seed),
            None => StdRng::seed_from_u64(options.seed),
        };
        let mut bodies = Bodies::with_cache(options.body_cache_bytes);
        if options.collect_freed {
            bodies.collect_freed();
        }
        Self {
            entities: Vec::new(),
            by_path: HashMap::new(),
            by_id: FastMap::default(),
            next_entity_id: 1,
            aux: Aux { bodies, ..Aux::default() },
            locks: FastMap::default(),
            lock_timers: LockTimers::default(),
            session_locks: FastMap::default(),
            session_timers: Default::default(),
            dedup_timers: Default::default(),
            waiters: FastMap::default(),
            ready: Vec::new(),
            ready_sessions: Vec::new(),
            records: Vec::new(),
            pending_batch: Vec::new(),
            rng,
            totals: Counters::default(),
            opts: options,
        }
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.rng.next_u64()
    }

    /// A fresh lock token: a version-4 UUID of 122 bits from the engine's CSPRNG.
    pub(super) fn next_token(&mut self) -> LockToken {
        let mut bytes = [0u8; 16];
        self.rng.fill_bytes(&mut bytes);
        LockToken::from_uuid(uuid::Builder::from_random_bytes(bytes).into_uuid())
    }

    /// Messages the engine let go of since the last call, with
    /// [`EngineOptions::collect_freed`]: dropping them frees them.
    pub(crate) fn take_freed(&mut self) -> Vec<Arc<Message>> {
        self.aux.bodies.take_freed()
    }

    /// Numbers the turn whose records the next calls make: every message whose state changes
    /// is stamped with `turn` (modulo 2^16), and deliveries carry the stamp their message had
    /// (see [`Delivery::changed`]). The runtime passes the number of the commit those records
    /// will go to, so a delivery tells which commit it depends on.
    pub(crate) fn set_turn(&mut self, turn: u64) {
        self.aux.turn = u16::try_from(turn & 0xffff).unwrap_or(0);
    }
}

/// A subscription created without rules gets the `$Default` rule, as in Service Bus.
fn with_default_rule(definition: EntityDefinition) -> EntityDefinition {
    match definition {
        EntityDefinition::Subscription { topic, name, properties, rules } if rules.is_empty() => {
            EntityDefinition::subscription(topic, name, properties, vec![Rule::default_rule()])
        }
        d => d,
    }
}
