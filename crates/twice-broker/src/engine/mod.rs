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
//! abandon, a lock that expired, a session lock that was lost or released with the message
//! still locked, and a restart that found the message locked. It does not rise on `release`
//! (the message never reached a handler), on `defer`, nor on receive-and-delete. When the count
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
//! lock on a message in the wrong state) is [`Error::Corrupt`]. The records of one send batch
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
//! - Releasing a session (or losing its lock) counts a delivery for each message still locked
//!   in it, as an abandon would. Renewing the lock of a session message renews the session.
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
mod durability;
mod entities;
mod internals;
mod record;
mod route;
mod seqmap;
mod sessions;
mod settle;
mod state;
mod timers;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use twice::{
    EntityInfo, LockToken, Message, MessageState, ReceivedMessage, SequenceNumber, SessionId,
    Timestamp, Value,
};

pub(crate) use record::{BodyKey, EntityId, Extra, PlacedState, Placement, Record, StoreKey};

use self::internals::check_max;
use self::state::{Aux, Bodies, Entity, FastMap, NO_SESSION, St, StoreIx};
use self::timers::{LockTimers, TimerKey};
use crate::config::{EntityDefinition, Rule};
use crate::error::Error;
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
/// past them a create is refused with [`Error::LimitExceeded`]. The defaults are Service Bus
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

    // ----- entities -----------------------------------------------------------------------

    /// Resolves `queue`, `topic`, `topic/Subscriptions/sub`, and any of these followed by
    /// `/$DeadLetterQueue` (case-insensitive, as every entity path).
    pub(crate) fn resolve(&self, path: &str) -> Result<EntityRef, Error> {
        let n = path.len().saturating_sub(DEAD_LETTER_SUFFIX.len());
        let (base, dead_letter) = match (path.get(..n), path.get(n..)) {
            (Some(base), Some(tail)) if tail.eq_ignore_ascii_case(DEAD_LETTER_SUFFIX) => {
                (base, true)
            }
            _ => (path, false),
        };
        // Most paths are already lower case: look them up without a copy.
        let slot = if base.bytes().any(|b| b.is_ascii_uppercase()) {
            self.by_path.get(&base.to_ascii_lowercase())
        } else {
            self.by_path.get(base)
        };
        let slot = *slot.ok_or_else(|| Error::EntityNotFound(path.to_owned()))?;
        let e = self.ent(slot).ok_or_else(|| Error::EntityNotFound(path.to_owned()))?;
        if dead_letter && e.is_topic() {
            return Err(Error::EntityNotFound(path.to_owned()));
        }
        Ok(EntityRef { slot, id: e.id, dead_letter })
    }

    /// The definition of an entity as it is now.
    pub(crate) fn definition(&self, entity: EntityRef) -> Result<EntityDefinition, Error> {
        let e = self.entity(entity)?;
        Ok(self.definition_of(e))
    }

    /// What a processor needs to know about the entity.
    pub(crate) fn entity_info(&self, entity: EntityRef) -> Result<EntityInfo, Error> {
        let e = self.entity(entity)?;
        let mut path = e.path.clone();
        if entity.dead_letter {
            path.push_str(DEAD_LETTER_SUFFIX);
        }
        let mut info = EntityInfo::new(path);
        info.lock_duration = e.lock_duration();
        info.max_delivery_count =
            (!entity.dead_letter && !e.is_topic()).then(|| e.max_delivery_count());
        info.duplicate_detection_window = e.dedup_window();
        info.requires_session = !entity.dead_letter && e.requires_session();
        Ok(info)
    }

    /// Every entity with its path, in creation order.
    pub(crate) fn entities(&self) -> Vec<(EntityRef, String)> {
        self.entities
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| {
                let e = e.as_ref()?;
                let slot = u32::try_from(slot).ok()?;
                Some((EntityRef { slot, id: e.id, dead_letter: false }, e.path.clone()))
            })
            .collect()
    }

    /// Runtime counts of an entity (of a topic: its scheduled messages). O(1).
    pub(crate) fn counts(&self, entity: EntityRef) -> Result<EntityCounts, Error> {
        let e = self.entity(entity)?;
        let c = e.main.counts;
        Ok(EntityCounts {
            active: c.active,
            locked: c.locked,
            deferred: c.deferred,
            scheduled: c.scheduled,
            dead_letter: e.dlq.msgs.len() as u64,
        })
    }

    /// Monotone counters of an entity since the engine started.
    pub(crate) fn counters(&self, entity: EntityRef) -> Result<Counters, Error> {
        Ok(self.entity(entity)?.counters)
    }

    /// Monotone counters of the whole engine since it started.
    pub(crate) fn total_counters(&self) -> Counters {
        self.totals
    }

    // ----- send -----------------------------------------------------------------------------

    /// Sends a batch to a queue or topic, all or nothing: every message is checked first
    /// (size, batch size, ids, session id on a session queue), then each is enqueued (or
    /// scheduled, if its `scheduled_enqueue_time` is in the future). A message without a
    /// message id gets a random one (32 hex digits).
    ///
    /// Batch rules (Service Bus): at most 4500 messages, and the batch's total size at most
    /// the maximum message size.
    #[cfg(test)]
    pub(crate) fn send(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        messages: Vec<Message>,
    ) -> Result<Vec<SendOutcome>, Error> {
        self.send_shared(now, entity, messages.into_iter().map(Arc::new).collect())
    }

    /// [`Engine::send`] of messages already shared: the engine keeps them as they are (a
    /// message without a message id is copied once to get one).
    pub(crate) fn send_shared(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        mut messages: Vec<Arc<Message>>,
    ) -> Result<Vec<SendOutcome>, Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        self.validate_batch(slot, &messages)?;
        for m in &mut messages {
            if m.message_id.is_none() {
                let id = self.random_message_id();
                Arc::make_mut(m).message_id = Some(id);
            }
        }
        let out = self.enqueue(now, slot, messages, true)?;
        self.pump(now);
        Ok(out)
    }

    /// Schedules messages for `at`; returns their sequence numbers (to cancel them).
    pub(crate) fn schedule(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        messages: Vec<Message>,
        at: Timestamp,
    ) -> Result<Vec<SequenceNumber>, Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        let mut messages: Vec<Arc<Message>> = messages.into_iter().map(Arc::new).collect();
        self.validate_batch(slot, &messages)?;
        for m in &mut messages {
            let m = Arc::make_mut(m);
            m.scheduled_enqueue_time = Some(at);
            if m.message_id.is_none() {
                m.message_id = Some(self.random_message_id());
            }
        }
        // Scheduling is not subject to duplicate detection: the caller needs a sequence number
        // for every message.
        let out = self.enqueue(now, slot, messages, false)?;
        self.pump(now);
        Ok(out
            .into_iter()
            .filter_map(|o| match o {
                SendOutcome::Enqueued(s) => Some(s),
                SendOutcome::Duplicate => None,
            })
            .collect())
    }

    /// Cancels scheduled messages of a queue or topic, all or nothing.
    pub(crate) fn cancel_scheduled(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<(), Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        let six = StoreIx::new(slot, false);
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let mut seqs = Vec::with_capacity(sequence_numbers.len());
        for s in sequence_numbers {
            let seq = s.get();
            match store.msgs.get(seq) {
                Some(m) if m.state == St::Scheduled && !seqs.contains(&seq) => seqs.push(seq),
                _ => return Err(Error::MessageNotFound(seq)),
            }
        }
        if !seqs.is_empty() {
            let key = self.key(six)?;
            self.emit(Record::Removed { store: key, sequences: seqs })?;
        }
        self.pump(now);
        Ok(())
    }

    // ----- receive --------------------------------------------------------------------------

    /// Receives up to `max` available messages of a queue or subscription (or a dead-letter
    /// queue), oldest first. When there are none and `waiter` is given, the waiter is parked:
    /// the next arrival serves it through [`Engine::take_ready`] (in the order waiters
    /// parked), until [`Engine::cancel_waiter`].
    pub(crate) fn receive(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        mode: ReceiveMode,
        max: usize,
        waiter: Option<WaiterId>,
    ) -> Result<Vec<Delivery>, Error> {
        self.tick(now);
        // Waiters parked earlier come first.
        self.serve_waiters(now);
        let six = self.receive_store(entity)?;
        check_max(max)?;
        self.check_waiter(waiter)?;
        if self.store(six).is_some_and(|s| s.sessions.is_some()) {
            let e = self.entity(entity)?;
            return Err(Error::SessionRequired(e.path.clone()));
        }
        let out = self.take_from(now, six, NO_SESSION, mode, max, None)?;
        if out.is_empty()
            && let Some(w) = waiter
        {
            self.park(w, Waiter { kind: WaitKind::Receive, six, mode, max });
        }
        self.pump(now);
        Ok(out)
    }

    /// Receives deferred messages by sequence number, all or nothing. On a session entity the
    /// caller must hold the messages' session.
    pub(crate) fn receive_deferred(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        sequence_numbers: &[SequenceNumber],
        mode: ReceiveMode,
        session: Option<SessionLock>,
    ) -> Result<Vec<Delivery>, Error> {
        self.tick(now);
        let six = self.receive_store(entity)?;
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let held = match (&store.sessions, session) {
            (Some(_), Some(lock)) => match self.session_locks.get(&lock) {
                Some(&(s6, sid)) if s6 == six => Some((lock, sid)),
                _ => return Err(Error::SessionLockLost),
            },
            (Some(_), None) => {
                return Err(Error::SessionRequired(self.entity(entity)?.path.clone()));
            }
            (None, Some(_)) => {
                return Err(Error::SessionsNotEnabled(self.entity(entity)?.path.clone()));
            }
            (None, None) => None,
        };
        // A deferred message's time to live is checked only now, when a receive tries it (as
        // in Service Bus): one that passed it expires, and is not found.
        let expired: Vec<i64> = sequence_numbers
            .iter()
            .map(|s| s.get())
            .filter(|&seq| {
                store.msgs.get(seq).is_some_and(|m| {
                    m.state == St::Deferred
                        && m.expires <= now
                        && held.is_none_or(|(_, sid)| m.session == sid)
                })
            })
            .collect();
        if !expired.is_empty() && !six.is_dlq() {
            for &seq in &expired {
                self.expire(now, six, seq)?;
            }
            self.pump(now);
            return Err(Error::MessageNotFound(expired[0]));
        }
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let mut seqs = Vec::with_capacity(sequence_numbers.len());
        for s in sequence_numbers {
            let seq = s.get();
            match store.msgs.get(seq) {
                Some(m)
                    if m.state == St::Deferred
                        && !seqs.contains(&seq)
                        && held.is_none_or(|(_, sid)| m.session == sid) =>
                {
                    seqs.push(seq);
                }
                _ => return Err(Error::MessageNotFound(seq)),
            }
        }
        let out = self.deliver(now, six, seqs, mode, held.map(|(l, _)| l))?;
        self.pump(now);
        Ok(out)
    }

    /// Browses messages from a sequence number on, without locking: available, locked,
    /// deferred and scheduled ones (not expired ones, except deferred ones, which expire only
    /// when a receive tries them). On a session entity, `session` limits
    /// it to one session (that filter scans the store).
    pub(crate) fn peek(
        &self,
        now: Timestamp,
        entity: EntityRef,
        from: SequenceNumber,
        max: usize,
        session: Option<&SessionId>,
    ) -> Result<Vec<Delivery>, Error> {
        let six = self.receive_store(entity)?;
        check_max(max)?;
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let sid = match session {
            None => None,
            Some(s) => match self.aux.names.lookup(s) {
                Some(sid) => Some(sid),
                None => return Ok(Vec::new()),
            },
        };
        Ok(store
            .msgs
            .range_from(from.get())
            .filter(|(_, m)| {
                (m.expires > now || m.state == St::Deferred)
                    && sid.is_none_or(|sid| m.session == sid)
            })
            .take(max)
            .map(|(seq, m)| self.delivery(seq, m, None))
            .collect())
    }

    /// Serves the parked waiters of every store that got available messages since they were
    /// last served. With [`EngineOptions::deferred_serving`], call it after each batch of
    /// calls, before [`Engine::take_ready`]; otherwise every call already did.
    pub(crate) fn serve_waiters(&mut self, now: Timestamp) {
        if self.waiters.is_empty() {
            self.aux.dirty.clear();
        } else {
            self.serve_dirty(now);
        }
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

    /// Parked waiters that were served since the last call, with their messages (empty when
    /// their entity or session went away).
    pub(crate) fn take_ready(&mut self) -> Vec<(WaiterId, Vec<Delivery>)> {
        std::mem::take(&mut self.ready)
    }

    /// Parked accept-next-session waiters that got a session (`None`: their entity went
    /// away).
    pub(crate) fn take_ready_sessions(&mut self) -> Vec<(WaiterId, Option<AcceptedSession>)> {
        std::mem::take(&mut self.ready_sessions)
    }

    /// Unparks a waiter (its timeout fired or its caller left); false if it was not parked.
    pub(crate) fn cancel_waiter(&mut self, waiter: WaiterId) -> bool {
        let Some(w) = self.waiters.remove(&waiter) else { return false };
        let Some(store) = self.store_mut(w.six) else { return true };
        match w.kind {
            WaitKind::Receive => store.waiters.retain(|&x| x != waiter),
            WaitKind::Accept => store.accept_waiters.retain(|&x| x != waiter),
            WaitKind::Session(lock) => {
                if let Some(&(_, sid)) = self.session_locks.get(&lock)
                    && let Some(s) = self
                        .store_mut(w.six)
                        .and_then(|s| s.sessions.as_mut())
                        .and_then(|ss| ss.table.get_mut(&sid))
                {
                    s.waiters.retain(|&x| x != waiter);
                }
            }
        }
        true
    }

    // ----- time -----------------------------------------------------------------------------

    /// The earliest time at which [`Engine::tick`] has something to do.
    pub(crate) fn next_deadline(&self) -> Option<Timestamp> {
        [
            self.lock_timers.first(),
            self.session_timers.first().map(|t| t.0),
            self.aux.ttl_timers.first().map(|t| t.0),
            self.aux.sched_timers.first().map(|t| t.0),
            self.dedup_timers.first().map(|t| t.0),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Processes everything due at `now`: scheduled messages, expired locks and session locks,
    /// expired messages, and the duplicate-detection purge. Every other call does this first,
    /// so a late tick never lets an expired lock settle or an expired message be delivered.
    pub(crate) fn tick(&mut self, now: Timestamp) {
        if self.next_deadline().is_some_and(|d| d <= now) {
            // Errors here are internal inconsistencies of records the engine itself built; the
            // timers are popped before acting, so a failure cannot loop.
            let _ = self.run_timers(now);
        }
        self.pump(now);
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

/// The size a message counts for against the size limit: its body, its header strings, and
/// its application property names and values.
pub(crate) fn message_size(m: &Message) -> usize {
    let strings = [
        m.message_id.as_ref().map(|i| i.as_str().len()),
        m.session_id.as_ref().map(|i| i.as_str().len()),
        m.correlation_id.as_ref().map(String::len),
        m.subject.as_ref().map(String::len),
        m.content_type.as_ref().map(String::len),
        m.to.as_ref().map(String::len),
        m.reply_to.as_ref().map(String::len),
        m.reply_to_session_id.as_ref().map(String::len),
        m.partition_key.as_ref().map(String::len),
    ];
    let props: usize = m.application_properties.iter().map(|(k, v)| k.len() + value_size(v)).sum();
    m.body.len() + strings.into_iter().flatten().sum::<usize>() + props
}

fn value_size(v: &Value) -> usize {
    match v {
        Value::Null | Value::Bool(_) | Value::Ubyte(_) | Value::Byte(_) => 1,
        Value::Ushort(_) | Value::Short(_) => 2,
        Value::Uint(_) | Value::Int(_) | Value::Float(_) | Value::Char(_) => 4,
        Value::Uuid(_) => 16,
        Value::Binary(b) => b.len(),
        Value::String(s) | Value::Symbol(s) => s.len(),
        _ => 8,
    }
}

/// A delivered message as the `twice` vocabulary has it: the stored message with the
/// broker-set fields, and the properties changed by abandon, defer or dead-letter merged into
/// its application properties. As in Service Bus, a dead-lettered message also carries its
/// reason and description as the application properties `DeadLetterReason` and
/// `DeadLetterErrorDescription` (which is where the AMQP wire has them).
pub(crate) fn received_message(message: &Message, meta: &DeliveryMeta) -> ReceivedMessage {
    received_message_owned(message.clone(), meta)
}

/// [`received_message`] of a message the caller owns.
pub(crate) fn received_message_owned(message: Message, meta: &DeliveryMeta) -> ReceivedMessage {
    let mut m = message;
    let mut r_extra = None;
    if let Some(extra) = &meta.extra {
        if let Some(changes) = &extra.action {
            changes.replay(&mut m);
        }
        let props = &mut m.application_properties;
        props.extend(extra.properties.iter().map(|(k, v)| (k.clone(), v.clone())));
        if let Some(reason) = &extra.dead_letter_reason {
            props.insert("DeadLetterReason".to_owned(), Value::String(reason.clone()));
        }
        if let Some(description) = &extra.dead_letter_description {
            props.insert(
                "DeadLetterErrorDescription".to_owned(),
                Value::String(description.clone()),
            );
        }
        r_extra = Some(extra);
    }
    let mut r = ReceivedMessage::new(m, meta.sequence_number, meta.enqueued_time);
    r.expires_at = meta.expires_at;
    r.lock_token = meta.lock_token;
    r.locked_until = meta.locked_until;
    r.delivery_count = meta.delivery_count;
    r.state = meta.state;
    if let Some(extra) = r_extra {
        r.dead_letter_reason = extra.dead_letter_reason.clone();
        r.dead_letter_error_description = extra.dead_letter_description.clone();
        r.dead_letter_source = extra.dead_letter_source.clone();
    }
    r
}
