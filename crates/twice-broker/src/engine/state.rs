//! The engine's in-memory state: entities, stores, message metadata and sessions (bodies are
//! in `bodies.rs`), with the bookkeeping that keeps every index in step with the messages.
//!
//! Every change to a message goes through [`place`], [`unplace`], [`detach`] and [`attach`]:
//! `detach` removes a message from every index its state puts it in (available set, timers,
//! counts, pins) and `attach` adds it back for its new state. Nothing else touches the indexes,
//! so they cannot drift from the messages.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use twice::{LockToken, SessionId, Timestamp};

use super::bodies::Bodies;
use super::fasthash::FastMap;
use super::record::{EntityId, Extra, PlacedState, StoreKey};
use super::seqmap::{SeqMap, SeqSet};
use super::{Counters, SessionLock, WaiterId};
use crate::config::{QueueProperties, Rule, SubscriptionProperties, TopicProperties};
use crate::error::Error;

/// No session (the interned id of a message without a session id).
pub(super) const NO_SESSION: u32 = u32::MAX;

/// A store inside the engine: entity slot and main/dead-letter, packed in a `u32` so that timer
/// keys stay small.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct StoreIx(u32);

impl StoreIx {
    pub(super) fn new(slot: u32, dead_letter: bool) -> Self {
        Self(slot << 1 | u32::from(dead_letter))
    }

    pub(super) fn slot(self) -> u32 {
        self.0 >> 1
    }

    pub(super) fn is_dlq(self) -> bool {
        self.0 & 1 == 1
    }
}

/// The state of a message in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum St {
    Available,
    Locked,
    Deferred,
    DeferredLocked,
    Scheduled,
}

impl From<PlacedState> for St {
    fn from(s: PlacedState) -> Self {
        match s {
            PlacedState::Active => St::Available,
            PlacedState::Locked => St::Locked,
            PlacedState::Deferred => St::Deferred,
            PlacedState::DeferredLocked => St::DeferredLocked,
            PlacedState::Scheduled => St::Scheduled,
        }
    }
}

impl From<St> for PlacedState {
    fn from(s: St) -> Self {
        match s {
            St::Available => PlacedState::Active,
            St::Locked => PlacedState::Locked,
            St::Deferred => PlacedState::Deferred,
            St::DeferredLocked => PlacedState::DeferredLocked,
            St::Scheduled => PlacedState::Scheduled,
        }
    }
}

/// What the engine keeps per message per store. Small on purpose: with bodies on disk this and
/// the body slot are all a queued message costs.
#[derive(Clone, Debug)]
pub(super) struct Meta {
    /// When it entered the store (scheduled: when it will).
    pub(super) enqueued: Timestamp,
    /// When it expires; `Timestamp::MAX` is never.
    pub(super) expires: Timestamp,
    /// Broker-set properties and dead-letter fields, rare enough to live behind a pointer.
    pub(super) extra: Option<Arc<Extra>>,
    /// Index of its body in [`Bodies`].
    pub(super) body: u32,
    /// The count of its next (or current) delivery.
    pub(super) delivery_count: u32,
    /// Interned session id, or [`NO_SESSION`].
    pub(super) session: u32,
    pub(super) state: St,
    /// Whether this message holds a pin on its body (keeps the message in memory).
    pub(super) pinned: bool,
    /// The turn its state last changed in (see [`super::Engine::set_turn`]).
    pub(super) changed: u16,
}

impl Meta {
    pub(super) fn is_locked(&self) -> bool {
        matches!(self.state, St::Locked | St::DeferredLocked)
    }
}

/// Runtime counts of one store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct StoreCounts {
    /// Available or locked.
    pub(super) active: u64,
    pub(super) locked: u64,
    pub(super) deferred: u64,
    pub(super) scheduled: u64,
}

/// The sessions of a session-enabled store.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    /// By interned session id.
    pub(super) table: FastMap<u32, Session>,
    /// Unlocked sessions with an available message, by their first available sequence number:
    /// accept-next takes the session whose oldest message is oldest.
    pub(super) ready: BTreeSet<(i64, u32)>,
}

/// One session of a store.
#[derive(Debug, Default)]
pub(super) struct Session {
    /// Available messages, in order.
    pub(super) avail: SeqSet,
    /// Messages of this session in the store, in any state.
    pub(super) refs: u32,
    pub(super) state: Option<Bytes>,
    pub(super) holder: Option<SessionLock>,
    pub(super) locked_until: Timestamp,
    /// Lock tokens of the messages the holder has locked.
    pub(super) locks: Vec<LockToken>,
    /// Receivers of the holder waiting for messages.
    pub(super) waiters: VecDeque<WaiterId>,
}

impl Session {
    fn is_idle(&self) -> bool {
        self.refs == 0 && self.state.is_none() && self.holder.is_none() && self.waiters.is_empty()
    }
}

/// One queue-like store.
#[derive(Debug, Default)]
pub(super) struct Store {
    /// Every message, by sequence number.
    pub(super) msgs: SeqMap<Meta>,
    /// Available messages of a store without sessions, in order.
    pub(super) avail: SeqSet,
    /// Present on the main store of a session-enabled entity.
    pub(super) sessions: Option<Box<Sessions>>,
    pub(super) counts: StoreCounts,
    /// Receivers waiting for messages.
    pub(super) waiters: VecDeque<WaiterId>,
    /// Receivers waiting for a session.
    pub(super) accept_waiters: VecDeque<WaiterId>,
    /// The bytes of its messages (see [`Bodies::size`]), against `MaxSizeInMegabytes`.
    pub(super) bytes: u64,
}

impl Store {
    pub(super) fn new(with_sessions: bool) -> Self {
        Self { sessions: with_sessions.then(Box::default), ..Self::default() }
    }

    /// Available messages in order, from the start.
    pub(super) fn available(&self, session: u32) -> Option<&SeqSet> {
        match &self.sessions {
            None => Some(&self.avail),
            Some(ss) => ss.table.get(&session).map(|s| &s.avail),
        }
    }

    fn avail_insert(&mut self, seq: i64, session: u32) {
        match &mut self.sessions {
            None => {
                self.avail.insert(seq);
            }
            Some(ss) => {
                let Some(s) = ss.table.get_mut(&session) else { return };
                let old = s.avail.first();
                s.avail.insert(seq);
                if s.holder.is_none() {
                    let new = s.avail.first();
                    if old != new {
                        if let Some(o) = old {
                            ss.ready.remove(&(o, session));
                        }
                        if let Some(n) = new {
                            ss.ready.insert((n, session));
                        }
                    }
                }
            }
        }
    }

    fn avail_remove(&mut self, seq: i64, session: u32) {
        match &mut self.sessions {
            None => {
                self.avail.remove(seq);
            }
            Some(ss) => {
                let Some(s) = ss.table.get_mut(&session) else { return };
                let old = s.avail.first();
                s.avail.remove(seq);
                if s.holder.is_none() {
                    let new = s.avail.first();
                    if old != new {
                        if let Some(o) = old {
                            ss.ready.remove(&(o, session));
                        }
                        if let Some(n) = new {
                            ss.ready.insert((n, session));
                        }
                    }
                }
            }
        }
    }

    /// The session entry, created when missing (taking a reference on the interned name).
    pub(super) fn session_entry<'a>(
        sessions: &'a mut Sessions,
        names: &mut Interner,
        session: u32,
    ) -> &'a mut Session {
        sessions.table.entry(session).or_insert_with(|| {
            names.incref(session);
            Session::default()
        })
    }

    /// Drops the session entry if nothing refers to it any more.
    pub(super) fn drop_session_if_idle(&mut self, names: &mut Interner, session: u32) {
        let Some(ss) = &mut self.sessions else { return };
        if ss.table.get(&session).is_some_and(Session::is_idle) {
            ss.table.remove(&session);
            names.decref(session);
        }
    }
}

/// Interned session ids: messages refer to their session by a `u32`, which also survives
/// moves between stores when the body is on disk.
#[derive(Debug, Default)]
pub(super) struct Interner {
    ids: HashMap<SessionId, u32>,
    names: Vec<(Option<SessionId>, u32)>,
    free: Vec<u32>,
}

impl Interner {
    /// The id of a name, without taking a reference.
    pub(super) fn lookup(&self, name: &SessionId) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The id of a name, creating it with no references when new. The caller takes a
    /// reference (through [`place`] or a session entry) before anything can drop it.
    pub(super) fn intern(&mut self, name: &SessionId) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.names.get_mut(id as usize) {
                    *slot = (Some(name.clone()), 0);
                }
                id
            }
            None => {
                self.names.push((Some(name.clone()), 0));
                u32::try_from(self.names.len() - 1).unwrap_or(NO_SESSION - 1)
            }
        };
        self.ids.insert(name.clone(), id);
        id
    }

    /// Frees an id created by [`Interner::intern`] that nobody took a reference on.
    pub(super) fn release_unused(&mut self, id: u32) {
        if self.names.get(id as usize).is_some_and(|(name, refs)| name.is_some() && *refs == 0) {
            self.incref(id);
            self.decref(id);
        }
    }

    pub(super) fn name(&self, id: u32) -> Option<&SessionId> {
        self.names.get(id as usize).and_then(|(n, _)| n.as_ref())
    }

    pub(super) fn incref(&mut self, id: u32) {
        if let Some((_, refs)) = self.names.get_mut(id as usize) {
            *refs += 1;
        }
    }

    pub(super) fn decref(&mut self, id: u32) {
        let Some((name, refs)) = self.names.get_mut(id as usize) else { return };
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            // A freed id is pushed once: `name` is only `Some` while the id is in use.
            if let Some(name) = name.take() {
                self.ids.remove(&name);
                self.free.push(id);
            }
        }
    }
}

/// The timers and shared tables that store bookkeeping touches, borrowed apart from the
/// entities.
#[derive(Debug, Default)]
pub(super) struct Aux {
    pub(super) bodies: Bodies,
    pub(super) names: Interner,
    /// Expiry of available and deferred messages.
    pub(super) ttl_timers: BTreeSet<(Timestamp, StoreIx, i64)>,
    /// Scheduled messages by due time.
    pub(super) sched_timers: BTreeSet<(Timestamp, StoreIx, i64)>,
    /// Stores (and sessions) that got an available message since the last pump.
    pub(super) dirty: Vec<(StoreIx, u32)>,
    /// The current turn, stamped on every message whose state changes.
    pub(super) turn: u16,
}

/// Removes a message from every index of its current state.
pub(super) fn detach(store: &mut Store, aux: &mut Aux, six: StoreIx, seq: i64, meta: &mut Meta) {
    match meta.state {
        St::Available => {
            store.avail_remove(seq, meta.session);
            store.counts.active -= 1;
        }
        St::Locked => {
            store.counts.active -= 1;
            store.counts.locked -= 1;
        }
        St::Deferred => store.counts.deferred -= 1,
        St::DeferredLocked => {
            store.counts.deferred -= 1;
            store.counts.locked -= 1;
        }
        St::Scheduled => {
            store.counts.scheduled -= 1;
            aux.sched_timers.remove(&(meta.enqueued, six, seq));
        }
    }
    if meta.expires != Timestamp::MAX && meta.state == St::Available {
        aux.ttl_timers.remove(&(meta.expires, six, seq));
    }
    if meta.pinned {
        aux.bodies.unpin(meta.body);
        meta.pinned = false;
    }
}

/// Adds a message to every index of its state. `store_pins` says whether messages in this
/// store keep their body in memory.
pub(super) fn attach(
    store: &mut Store,
    aux: &mut Aux,
    six: StoreIx,
    seq: i64,
    meta: &mut Meta,
    store_pins: bool,
) {
    meta.changed = aux.turn;
    match meta.state {
        St::Available => {
            store.avail_insert(seq, meta.session);
            store.counts.active += 1;
            aux.dirty.push((six, meta.session));
        }
        St::Locked => {
            store.counts.active += 1;
            store.counts.locked += 1;
        }
        St::Deferred => store.counts.deferred += 1,
        St::DeferredLocked => {
            store.counts.deferred += 1;
            store.counts.locked += 1;
        }
        St::Scheduled => {
            store.counts.scheduled += 1;
            aux.sched_timers.insert((meta.enqueued, six, seq));
        }
    }
    if meta.expires != Timestamp::MAX && meta.state == St::Available {
        aux.ttl_timers.insert((meta.expires, six, seq));
    }
    if store_pins || meta.state == St::Scheduled {
        aux.bodies.pin(meta.body);
        meta.pinned = true;
    }
}

/// Puts a new message into a store, taking references on its body and session.
pub(super) fn place(
    store: &mut Store,
    aux: &mut Aux,
    six: StoreIx,
    seq: i64,
    mut meta: Meta,
    store_pins: bool,
) -> Result<(), Error> {
    if store.msgs.contains_key(seq) {
        return Err(Error::Corrupt(format!("message {seq} placed twice in one store")));
    }
    if let Some(ss) = &mut store.sessions {
        if meta.session == NO_SESSION {
            return Err(Error::Corrupt(format!(
                "message {seq} without a session placed in a session store"
            )));
        }
        Store::session_entry(ss, &mut aux.names, meta.session).refs += 1;
    }
    if meta.session != NO_SESSION {
        aux.names.incref(meta.session);
    }
    aux.bodies.incref(meta.body);
    store.bytes += aux.bodies.size(meta.body);
    meta.pinned = false;
    attach(store, aux, six, seq, &mut meta, store_pins);
    store.msgs.insert(seq, meta);
    Ok(())
}

/// Takes a message out of a store, dropping its references (its body's too, unless
/// `keep_body`: the caller then owns that reference).
pub(super) fn unplace(
    store: &mut Store,
    aux: &mut Aux,
    six: StoreIx,
    seq: i64,
    keep_body: bool,
) -> Option<Meta> {
    let mut meta = store.msgs.remove(seq)?;
    store.bytes = store.bytes.saturating_sub(aux.bodies.size(meta.body));
    detach(store, aux, six, seq, &mut meta);
    if let Some(ss) = &mut store.sessions {
        if let Some(s) = ss.table.get_mut(&meta.session) {
            s.refs = s.refs.saturating_sub(1);
        }
        store.drop_session_if_idle(&mut aux.names, meta.session);
    }
    if meta.session != NO_SESSION {
        aux.names.decref(meta.session);
    }
    if !keep_body {
        aux.bodies.decref(meta.body);
    }
    Some(meta)
}

/// Duplicate-detection history of a queue or topic.
#[derive(Debug, Default)]
pub(super) struct Dedup {
    /// Message id → end of its window.
    pub(super) ids: HashMap<twice::MessageId, Timestamp>,
    /// The same, in insertion order, for the purge.
    pub(super) order: VecDeque<(Timestamp, twice::MessageId)>,
}

/// What kind of entity, with its properties.
#[derive(Debug)]
pub(super) enum Kind {
    Queue(QueueProperties),
    Topic { props: TopicProperties, subs: Vec<u32> },
    Subscription { topic: u32, name: String, props: SubscriptionProperties, rules: Vec<Rule> },
}

/// A queue, topic or subscription.
#[derive(Debug)]
pub(super) struct Entity {
    pub(super) id: EntityId,
    /// The path as created (`orders`, `events/Subscriptions/billing`).
    pub(super) path: String,
    pub(super) kind: Kind,
    /// The next sequence number (queues and topics).
    pub(super) next_seq: i64,
    /// Main queue (a topic's: its scheduled messages).
    pub(super) main: Store,
    /// Dead-letter queue (unused for topics).
    pub(super) dlq: Store,
    pub(super) dedup: Dedup,
    pub(super) counters: Counters,
}

impl Entity {
    pub(super) fn store(&self, dead_letter: bool) -> &Store {
        if dead_letter { &self.dlq } else { &self.main }
    }

    pub(super) fn store_mut(&mut self, dead_letter: bool) -> &mut Store {
        if dead_letter { &mut self.dlq } else { &mut self.main }
    }

    pub(super) fn key(&self, dead_letter: bool) -> StoreKey {
        StoreKey { entity: self.id, dead_letter }
    }

    pub(super) fn is_topic(&self) -> bool {
        matches!(self.kind, Kind::Topic { .. })
    }

    pub(super) fn lock_duration(&self) -> Duration {
        match &self.kind {
            Kind::Queue(p) => p.lock_duration,
            Kind::Subscription { props, .. } => props.lock_duration,
            Kind::Topic { .. } => Duration::from_secs(60),
        }
    }

    pub(super) fn max_delivery_count(&self) -> u32 {
        match &self.kind {
            Kind::Queue(p) => p.max_delivery_count,
            Kind::Subscription { props, .. } => props.max_delivery_count,
            Kind::Topic { .. } => u32::MAX,
        }
    }

    pub(super) fn default_ttl(&self) -> Option<Duration> {
        match &self.kind {
            Kind::Queue(p) => p.default_message_time_to_live,
            Kind::Topic { props, .. } => props.default_message_time_to_live,
            Kind::Subscription { props, .. } => props.default_message_time_to_live,
        }
    }

    pub(super) fn dead_letter_on_expiry(&self) -> bool {
        match &self.kind {
            Kind::Queue(p) => p.dead_lettering_on_message_expiration,
            Kind::Subscription { props, .. } => props.dead_lettering_on_message_expiration,
            Kind::Topic { .. } => false,
        }
    }

    /// `MaxSizeInMegabytes` of a queue or topic; `None` for a subscription, whose messages
    /// count for its topic.
    pub(super) fn max_size_in_megabytes(&self) -> Option<u64> {
        match &self.kind {
            Kind::Queue(p) => Some(p.max_size_in_megabytes),
            Kind::Topic { props, .. } => Some(props.max_size_in_megabytes),
            Kind::Subscription { .. } => None,
        }
    }

    pub(super) fn requires_session(&self) -> bool {
        match &self.kind {
            Kind::Queue(p) => p.requires_session,
            Kind::Subscription { props, .. } => props.requires_session,
            Kind::Topic { .. } => false,
        }
    }

    pub(super) fn forward_to(&self) -> Option<&str> {
        match &self.kind {
            Kind::Queue(p) => p.forward_to.as_deref(),
            Kind::Subscription { props, .. } => props.forward_to.as_deref(),
            Kind::Topic { .. } => None,
        }
    }

    pub(super) fn forward_dead_lettered_to(&self) -> Option<&str> {
        match &self.kind {
            Kind::Queue(p) => p.forward_dead_lettered_messages_to.as_deref(),
            Kind::Subscription { props, .. } => props.forward_dead_lettered_messages_to.as_deref(),
            Kind::Topic { .. } => None,
        }
    }

    /// The duplicate-detection window, when duplicate detection is on.
    pub(super) fn dedup_window(&self) -> Option<Duration> {
        match &self.kind {
            Kind::Queue(p) if p.requires_duplicate_detection => {
                Some(p.duplicate_detection_history_time_window)
            }
            Kind::Topic { props, .. } if props.requires_duplicate_detection => {
                Some(props.duplicate_detection_history_time_window)
            }
            _ => None,
        }
    }

    /// Whether messages in this store keep their body in memory: they may have to be routed
    /// (through a topic's filters) after their body went to disk. True for the main queue of
    /// an entity that forwards dead-lettered messages, and for the dead-letter queue of an
    /// entity that forwards (a resubmitted message is forwarded again).
    pub(super) fn store_pins(&self, dead_letter: bool) -> bool {
        if dead_letter {
            self.forward_to().is_some()
        } else {
            self.forward_dead_lettered_to().is_some()
        }
    }
}
