//! The engine's private machinery: lookups, validation, delivery, unlocking, dead-lettering,
//! expiry, sessions, timers and the serving of parked receivers. The calls in `mod.rs` are
//! made of these.

use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;

use twice::{LockToken, Message, MessageId, MessageState, Properties, SequenceNumber, Timestamp};

use super::route::{Item, Router};
use super::state::{Entity, Kind, Meta, NO_SESSION, St, Store, StoreIx};
use super::{
    AcceptedSession, BodyKey, Counters, Delivery, DeliveryMeta, Engine, EntityRef, Lock,
    MAX_BATCH_MESSAGES, MAX_ID_LEN, PlacedState, Placement, ReceiveMode, Record, SendOutcome,
    SessionLock, StoreKey, WaitKind, Waiter, WaiterId, message_size, record, seqmap, state,
};
use crate::config::EntityDefinition;
use crate::dead_letter_reasons;
use crate::error::Error;

impl Engine {
    pub(super) fn ent(&self, slot: u32) -> Option<&Entity> {
        self.entities.get(slot as usize).and_then(Option::as_ref)
    }

    pub(super) fn ent_mut(&mut self, slot: u32) -> Option<&mut Entity> {
        self.entities.get_mut(slot as usize).and_then(Option::as_mut)
    }

    pub(super) fn entity(&self, r: EntityRef) -> Result<&Entity, Error> {
        self.ent(r.slot)
            .filter(|e| e.id == r.id)
            .ok_or_else(|| Error::EntityNotFound(format!("entity #{} (deleted)", r.id.0)))
    }

    pub(super) fn store(&self, six: StoreIx) -> Option<&Store> {
        self.ent(six.slot()).map(|e| e.store(six.is_dlq()))
    }

    pub(super) fn store_mut(&mut self, six: StoreIx) -> Option<&mut Store> {
        self.ent_mut(six.slot()).map(|e| e.store_mut(six.is_dlq()))
    }

    pub(super) fn meta(&self, six: StoreIx, seq: i64) -> Option<&Meta> {
        self.store(six)?.msgs.get(seq)
    }

    pub(super) fn session_mut(&mut self, six: StoreIx, sid: u32) -> Option<&mut state::Session> {
        self.store_mut(six)?.sessions.as_mut()?.table.get_mut(&sid)
    }

    pub(super) fn key(&self, six: StoreIx) -> Result<StoreKey, Error> {
        self.ent(six.slot())
            .map(|e| e.key(six.is_dlq()))
            .ok_or_else(|| Error::Corrupt("a store of a deleted entity".to_owned()))
    }

    pub(super) fn count(&mut self, slot: u32, f: impl Fn(&mut Counters)) {
        f(&mut self.totals);
        if let Some(e) = self.ent_mut(slot) {
            f(&mut e.counters);
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

    pub(super) fn random_message_id(&mut self) -> MessageId {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut id = [0u8; 32];
        let words = [self.next_u64(), self.next_u64()];
        for (i, digit) in id.iter_mut().enumerate() {
            let word = words[i / 16];
            let shift = 60 - 4 * (i % 16);
            *digit = HEX[usize::try_from((word >> shift) & 0xf).unwrap_or(0)];
        }
        MessageId::new(std::str::from_utf8(&id).map(str::to_owned).unwrap_or_default())
    }

    /// Applies a record made by a call and keeps it for the log.
    pub(super) fn emit(&mut self, mut rec: Record) -> Result<(), Error> {
        self.apply(&mut rec, None)?;
        if self.opts.durable {
            self.records.push(rec);
        }
        Ok(())
    }

    /// Emits records in order.
    pub(super) fn emit_all(&mut self, recs: impl IntoIterator<Item = Record>) -> Result<(), Error> {
        recs.into_iter().try_for_each(|rec| self.emit(rec))
    }

    pub(super) fn definition_of(&self, e: &Entity) -> EntityDefinition {
        match &e.kind {
            Kind::Queue(p) => EntityDefinition::queue(e.path.clone(), p.clone()),
            Kind::Topic { props, .. } => EntityDefinition::topic(e.path.clone(), props.clone()),
            Kind::Subscription { topic, name, props, rules } => EntityDefinition::subscription(
                self.ent(*topic).map(|t| t.path.clone()).unwrap_or_default(),
                name.clone(),
                props.clone(),
                rules.clone(),
            ),
        }
    }

    pub(super) fn send_target(&self, r: EntityRef) -> Result<u32, Error> {
        let e = self.entity(r)?;
        if r.dead_letter || matches!(e.kind, Kind::Subscription { .. }) {
            return Err(Error::InvalidOperation(format!(
                "cannot send to {:?}: send to a queue or topic",
                e.path
            )));
        }
        Ok(r.slot)
    }

    pub(super) fn receive_store(&self, r: EntityRef) -> Result<StoreIx, Error> {
        let e = self.entity(r)?;
        if e.is_topic() {
            return Err(Error::InvalidOperation(format!(
                "cannot receive from topic {:?}: receive from one of its subscriptions",
                e.path
            )));
        }
        Ok(r.six())
    }

    pub(super) fn check_waiter(&self, waiter: Option<WaiterId>) -> Result<(), Error> {
        match waiter {
            Some(w) if self.waiters.contains_key(&w) => {
                Err(Error::InvalidArgument(format!("waiter {} is already parked", w.0)))
            }
            _ => Ok(()),
        }
    }

    pub(super) fn validate_batch(&self, slot: u32, messages: &[Arc<Message>]) -> Result<(), Error> {
        if messages.len() > MAX_BATCH_MESSAGES {
            return Err(Error::InvalidArgument(format!(
                "a batch holds at most {MAX_BATCH_MESSAGES} messages, not {}",
                messages.len()
            )));
        }
        let limit = self.opts.max_message_size;
        let e =
            self.ent(slot).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let mut total = 0usize;
        for m in messages {
            let size = message_size(m);
            if size > limit {
                return Err(Error::MessageSizeExceeded { size, limit });
            }
            total = total.saturating_add(size);
            if let Some(id) = &m.message_id {
                check_id("message id", id.as_str())?;
            }
            if let Some(id) = &m.session_id {
                check_id("session id", id.as_str())?;
            }
            if let Some(key) = &m.partition_key
                && key.len() > MAX_ID_LEN
            {
                return Err(Error::InvalidArgument(format!(
                    "a partition key has at most {MAX_ID_LEN} characters"
                )));
            }
            if m.time_to_live.is_some_and(|t| t.is_zero()) {
                return Err(Error::InvalidArgument("a time to live must be positive".to_owned()));
            }
            if m.session_id.is_none() && e.requires_session() {
                return Err(Error::SessionIdRequired(e.path.clone()));
            }
        }
        if total > limit {
            return Err(Error::MessageSizeExceeded { size: total, limit });
        }
        self.check_quota(slot, total)
    }

    /// Fails with [`Error::QuotaExceeded`] when `adding` bytes sent to the queue or topic in
    /// `slot` would take it past its `MaxSizeInMegabytes`. A topic's send is counted once per
    /// subscription, the most copies it can make.
    fn check_quota(&self, slot: u32, adding: usize) -> Result<(), Error> {
        let Some(e) = self.ent(slot) else { return Ok(()) };
        let Some(max) = e.max_size_in_megabytes() else { return Ok(()) };
        let copies = match &e.kind {
            Kind::Topic { subs, .. } => subs.len().max(1),
            _ => 1,
        };
        let adding = u64::try_from(adding.saturating_mul(copies)).unwrap_or(u64::MAX);
        let size = self.entity_bytes(slot);
        if size.saturating_add(adding) > max.saturating_mul(1024 * 1024) {
            return Err(Error::QuotaExceeded {
                entity: e.path.clone(),
                size,
                adding,
                max_size_in_megabytes: max,
            });
        }
        Ok(())
    }

    /// The bytes an entity holds against its `MaxSizeInMegabytes`: its own and its dead-letter
    /// queue's, and for a topic its subscriptions' too (each copy counts).
    pub(super) fn entity_bytes(&self, slot: u32) -> u64 {
        let Some(e) = self.ent(slot) else { return 0 };
        let own = |e: &Entity| e.store(false).bytes + e.store(true).bytes;
        let mut total = own(e);
        if let Kind::Topic { subs, .. } = &e.kind {
            total += subs.iter().filter_map(|&s| self.ent(s)).map(own).sum::<u64>();
        }
        total
    }

    /// Enqueues validated messages, one `Sent` record each.
    pub(super) fn enqueue(
        &mut self,
        now: Timestamp,
        slot: u32,
        messages: Vec<Arc<Message>>,
        dedup: bool,
    ) -> Result<Vec<SendOutcome>, Error> {
        let n = messages.len();
        let mut out = Vec::with_capacity(n);
        let first_record = self.records.len();
        let target = self
            .ent(slot)
            .map(|e| e.id)
            .ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        for (i, m) in messages.into_iter().enumerate() {
            if dedup && self.is_duplicate(now, slot, &m) {
                out.push(SendOutcome::Duplicate);
                self.count(slot, |c| c.duplicates += 1);
                continue;
            }
            let message = m;
            let mut router = Router::new(now);
            let mut placements = Vec::new();
            let seq = self.route_send(&mut router, slot, &message, &mut placements)?;
            self.emit(Record::Sent {
                target,
                sequence: seq,
                at: now,
                message: record::StoredMessage(message),
                placements,
                more: i + 1 < n,
                body: BodyKey::NONE,
            })?;
            self.count(slot, |c| c.sent += 1);
            out.push(SendOutcome::Enqueued(SequenceNumber::new(seq)));
        }
        // A duplicate at the end of the batch leaves the last record saying more follow.
        if let Some(Record::Sent { more, .. }) = self.records[first_record..].last_mut() {
            *more = false;
        }
        Ok(out)
    }

    pub(super) fn is_duplicate(&self, now: Timestamp, slot: u32, m: &Message) -> bool {
        let (Some(e), Some(id)) = (self.ent(slot), &m.message_id) else { return false };
        e.dedup_window().is_some() && e.dedup.ids.get(id).is_some_and(|&end| end > now)
    }

    pub(super) fn park(&mut self, w: WaiterId, waiter: Waiter) {
        let six = waiter.six;
        let kind = waiter.kind;
        self.waiters.insert(w, waiter);
        match kind {
            WaitKind::Receive => {
                if let Some(s) = self.store_mut(six) {
                    s.waiters.push_back(w);
                }
            }
            WaitKind::Accept => {
                if let Some(s) = self.store_mut(six) {
                    s.accept_waiters.push_back(w);
                }
            }
            WaitKind::Session(lock) => {
                if let Some(&(six, sid)) = self.session_locks.get(&lock)
                    && let Some(s) = self.session_mut(six, sid)
                {
                    s.waiters.push_back(w);
                }
            }
        }
    }

    pub(super) fn check_tokens(&self, tokens: &[LockToken]) -> Result<(), Error> {
        for (i, t) in tokens.iter().enumerate() {
            if !self.locks.contains_key(t) || tokens[..i].contains(t) {
                return Err(Error::MessageLockLost);
            }
        }
        Ok(())
    }

    pub(super) fn remove_lock(&mut self, token: &LockToken) -> Option<Lock> {
        let lock = self.locks.remove(token)?;
        match lock.session {
            None => {
                if let Some(key) = lock.timer {
                    let locks = &self.locks;
                    self.lock_timers.remove(key, lock.until, *token, |k, u| {
                        locks.get(k).is_some_and(|l| l.until == u)
                    });
                }
            }
            Some(sl) => {
                if let Some(&(six, sid)) = self.session_locks.get(&sl)
                    && let Some(s) = self.session_mut(six, sid)
                {
                    s.locks.retain(|t| t != token);
                }
            }
        }
        Some(lock)
    }

    /// Takes up to `max` available messages of a store (of one session on a session store)
    /// and delivers them.
    pub(super) fn take_from(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        session: u32,
        mode: ReceiveMode,
        max: usize,
        lock: Option<SessionLock>,
    ) -> Result<Vec<Delivery>, Error> {
        let Some(store) = self.store(six) else { return Ok(Vec::new()) };
        let mut seqs = Vec::new();
        let mut expired = Vec::new();
        for seq in store.available(session).into_iter().flat_map(seqmap::SeqSet::iter) {
            if seqs.len() >= max {
                break;
            }
            match store.msgs.get(seq) {
                Some(m) if m.expires <= now => expired.push(seq),
                Some(_) => seqs.push(seq),
                None => {}
            }
        }
        for seq in expired {
            self.expire(now, six, seq)?;
        }
        self.deliver(now, six, seqs, mode, lock)
    }

    /// Locks (or removes) the chosen messages and builds their deliveries.
    pub(super) fn deliver(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        seqs: Vec<i64>,
        mode: ReceiveMode,
        session: Option<SessionLock>,
    ) -> Result<Vec<Delivery>, Error> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.key(six)?;
        let n = seqs.len() as u64;
        self.count(six.slot(), |c| c.received += n);
        match mode {
            ReceiveMode::ReceiveAndDelete => {
                let out: Vec<Delivery> = seqs
                    .iter()
                    .filter_map(|&seq| Some(self.delivery(seq, self.meta(six, seq)?, None)))
                    .collect();
                self.emit(Record::Removed { store: key, sequences: seqs })?;
                Ok(out)
            }
            ReceiveMode::PeekLock => {
                // The stamps from before the lock, which changes them.
                let changed: Vec<u16> =
                    seqs.iter().map(|&s| self.meta(six, s).map_or(0, |m| m.changed)).collect();
                self.emit(Record::Locked { store: key, sequences: seqs.clone() })?;
                let (duration, session_until) = match session {
                    Some(sl) => {
                        let until = self
                            .session_locks
                            .get(&sl)
                            .and_then(|&(six, sid)| {
                                self.store(six)?.sessions.as_ref()?.table.get(&sid)
                            })
                            .map_or(now, |s| s.locked_until);
                        (Duration::ZERO, Some(until))
                    }
                    None => {
                        (self.ent(six.slot()).map_or(Duration::ZERO, Entity::lock_duration), None)
                    }
                };
                let mut out = Vec::with_capacity(seqs.len());
                for (i, seq) in seqs.into_iter().enumerate() {
                    let token = self.next_token();
                    let until = session_until.unwrap_or(now + duration);
                    let timer = match session {
                        None => Some(self.lock_timers.insert(until, token, duration)),
                        Some(sl) => {
                            if let Some(&(s6, sid)) = self.session_locks.get(&sl)
                                && let Some(s) = self.session_mut(s6, sid)
                            {
                                s.locks.push(token);
                            }
                            None
                        }
                    };
                    self.locks.insert(token, Lock { six, seq, until, session, timer });
                    if let Some(m) = self.meta(six, seq) {
                        let mut d = self.delivery(seq, m, Some((token, until)));
                        d.changed = changed.get(i).copied().unwrap_or(d.changed);
                        out.push(d);
                    }
                }
                Ok(out)
            }
        }
    }

    pub(super) fn delivery(
        &self,
        seq: i64,
        m: &Meta,
        lock: Option<(LockToken, Timestamp)>,
    ) -> Delivery {
        Delivery {
            changed: m.changed,
            body: self.aux.bodies.body(m.body),
            meta: DeliveryMeta {
                sequence_number: SequenceNumber::new(seq),
                enqueued_time: m.enqueued,
                expires_at: (m.expires != Timestamp::MAX).then_some(m.expires),
                lock_token: lock.map(|l| l.0),
                locked_until: lock.map(|l| l.1),
                delivery_count: m.delivery_count,
                state: match m.state {
                    St::Deferred | St::DeferredLocked => MessageState::Deferred,
                    St::Scheduled => MessageState::Scheduled,
                    St::Available | St::Locked => MessageState::Active,
                },
                extra: m.extra.clone(),
            },
        }
    }

    /// Ends a delivery that never reached a handler (a release): the message is available again
    /// with its delivery count unchanged.
    pub(super) fn unlock_uncounted(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        seq: i64,
    ) -> Result<(), Error> {
        let Some(meta) = self.meta(six, seq) else { return Ok(()) };
        let (dc, state) = (meta.delivery_count, unlocked_state(meta.state));
        let key = self.key(six)?;
        self.emit(Record::Updated {
            store: key,
            sequence: seq,
            delivery_count: dc,
            state,
            properties: None,
        })?;
        self.expire_if_due(now, six, seq)
    }

    /// Ends a delivery that did not settle the message: the count rises, and past
    /// `MaxDeliveryCount` the message is dead-lettered.
    pub(super) fn unlock_counted(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        seq: i64,
        properties: Option<Properties>,
    ) -> Result<(), Error> {
        let Some(m) = self.meta(six, seq) else { return Ok(()) };
        let dc = m.delivery_count.saturating_add(1);
        let state = unlocked_state(m.state);
        let max = self.ent(six.slot()).map_or(u32::MAX, Entity::max_delivery_count);
        if !six.is_dlq() && dc > max {
            let description =
                format!("Message could not be consumed after {max} delivery attempts.");
            return self.dead_letter_move(
                now,
                six,
                seq,
                dc,
                Some(dead_letter_reasons::MAX_DELIVERY_COUNT_EXCEEDED.to_owned()),
                Some(description),
                properties,
            );
        }
        let key = self.key(six)?;
        self.emit(Record::Updated {
            store: key,
            sequence: seq,
            delivery_count: dc,
            state,
            properties,
        })?;
        self.expire_if_due(now, six, seq)
    }

    #[allow(clippy::too_many_arguments)] // reason: one call site per dead-letter cause, each needs all of them
    pub(super) fn dead_letter_move(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        seq: i64,
        delivery_count: u32,
        reason: Option<String>,
        description: Option<String>,
        properties: Option<Properties>,
    ) -> Result<(), Error> {
        let Some(m) = self.meta(six, seq) else { return Ok(()) };
        let mut extra = m.extra.as_deref().cloned().unwrap_or_default();
        if let Some(p) = properties {
            extra.properties.extend(p);
        }
        extra.dead_letter_reason = reason;
        extra.dead_letter_description = description;
        let message = self.aux.bodies.message(m.body);
        let ttl = match &message {
            Some(msg) => msg.time_to_live,
            None => (m.expires != Timestamp::MAX).then(|| m.expires.duration_since(m.enqueued)),
        };
        extra.time_to_live = ttl;
        let item = Item {
            ttl,
            message,
            has_session: m.session != NO_SESSION,
            delivery_count,
            extra: Some(extra),
            enqueued: Some(m.enqueued),
        };
        let mut router = Router::new(now);
        let mut to = Vec::new();
        self.route_dead_letter(&mut router, six.slot(), seq, 0, &item, &mut to);
        let key = self.key(six)?;
        self.emit(Record::Moved { from: key, sequence: seq, to })?;
        self.count(six.slot(), |c| c.dead_lettered += 1);
        Ok(())
    }

    /// Removes or dead-letters an expired message.
    pub(super) fn expire(&mut self, now: Timestamp, six: StoreIx, seq: i64) -> Result<(), Error> {
        let Some(m) = self.meta(six, seq) else { return Ok(()) };
        let dc = m.delivery_count;
        self.count(six.slot(), |c| c.expired += 1);
        if self.ent(six.slot()).is_some_and(Entity::dead_letter_on_expiry) && !six.is_dlq() {
            return self.dead_letter_move(
                now,
                six,
                seq,
                dc,
                Some(dead_letter_reasons::TTL_EXPIRED_EXCEPTION.to_owned()),
                Some("The message expired and was dead lettered.".to_owned()),
                None,
            );
        }
        let key = self.key(six)?;
        self.emit(Record::Removed { store: key, sequences: vec![seq] })
    }

    pub(super) fn expire_if_due(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        seq: i64,
    ) -> Result<(), Error> {
        match self.meta(six, seq) {
            Some(m) if m.expires <= now && m.state == St::Available => self.expire(now, six, seq),
            _ => Ok(()),
        }
    }

    pub(super) fn lock_session(
        &mut self,
        now: Timestamp,
        six: StoreIx,
        sid: u32,
    ) -> Option<AcceptedSession> {
        let duration = self.ent(six.slot()).map_or(Duration::ZERO, Entity::lock_duration);
        let lock = SessionLock(self.next_u64());
        let until = now + duration;
        let Engine { entities, aux, .. } = self;
        let store = entities.get_mut(six.slot() as usize)?.as_mut()?.store_mut(six.is_dlq());
        let ss = store.sessions.as_mut()?;
        let s = Store::session_entry(ss, &mut aux.names, sid);
        s.holder = Some(lock);
        s.locked_until = until;
        if let Some(first) = s.avail.first() {
            ss.ready.remove(&(first, sid));
        }
        self.session_locks.insert(lock, (six, sid));
        self.session_timers.insert((until, lock));
        let session_id = self.aux.names.name(sid)?.clone();
        Some(AcceptedSession { lock, session_id, locked_until: until })
    }

    /// Frees a session lock: its locked messages are unlocked with their count raised, its
    /// parked receivers are served with nothing.
    /// Frees a held session. Its messages still locked become available again: with their
    /// delivery count raised when the session lock `expired`, unchanged when the receiver let
    /// the session go (as Service Bus does: only a lock that runs out counts a delivery).
    pub(super) fn free_session(
        &mut self,
        now: Timestamp,
        lock: SessionLock,
        expired: bool,
    ) -> Result<(), Error> {
        let Some((six, sid)) = self.session_locks.remove(&lock) else { return Ok(()) };
        let Some(s) = self.session_mut(six, sid) else { return Ok(()) };
        let until = s.locked_until;
        let tokens = std::mem::take(&mut s.locks);
        let waiters = std::mem::take(&mut s.waiters);
        s.holder = None;
        self.session_timers.remove(&(until, lock));
        for w in waiters {
            if self.waiters.remove(&w).is_some() {
                self.ready.push((w, Vec::new()));
            }
        }
        let mut seqs = Vec::with_capacity(tokens.len());
        for t in tokens {
            if let Some(l) = self.locks.remove(&t) {
                seqs.push(l.seq);
            }
        }
        // The session is unlocked before its messages are, so they go back to `ready`.
        {
            let Engine { entities, aux, .. } = self;
            if let Some(store) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut) {
                let store = store.store_mut(six.is_dlq());
                if let Some(ss) = store.sessions.as_mut()
                    && let Some(first) = ss.table.get(&sid).and_then(|s| s.avail.first())
                {
                    ss.ready.insert((first, sid));
                    aux.dirty.push((six, sid));
                }
            }
        }
        seqs.sort_unstable();
        for seq in seqs {
            if expired {
                self.unlock_counted(now, six, seq, None)?;
            } else {
                self.unlock_uncounted(now, six, seq)?;
            }
        }
        let Engine { entities, aux, .. } = self;
        if let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut) {
            e.store_mut(six.is_dlq()).drop_session_if_idle(&mut aux.names, sid);
        }
        Ok(())
    }

    pub(super) fn run_timers(&mut self, now: Timestamp) -> Result<(), Error> {
        while let Some(&(t, six, seq)) = self.aux.sched_timers.first() {
            if t > now {
                break;
            }
            self.aux.sched_timers.pop_first();
            self.activate(now, six, seq)?;
        }
        loop {
            let locks = &self.locks;
            let due =
                self.lock_timers.pop_due(now, |k, u| locks.get(k).is_some_and(|l| l.until == u));
            let Some((_, token)) = due else { break };
            if let Some(lock) = self.locks.remove(&token) {
                self.count(lock.six.slot(), |c| c.lock_lost += 1);
                self.unlock_counted(now, lock.six, lock.seq, None)?;
            }
        }
        while let Some(&(t, lock)) = self.session_timers.first() {
            if t > now {
                break;
            }
            self.session_timers.pop_first();
            if let Some(&(six, _)) = self.session_locks.get(&lock) {
                self.count(six.slot(), |c| c.lock_lost += 1);
            }
            self.free_session(now, lock, true)?;
        }
        while let Some(&(t, six, seq)) = self.aux.ttl_timers.first() {
            if t > now {
                break;
            }
            self.aux.ttl_timers.pop_first();
            self.expire(now, six, seq)?;
        }
        while let Some(&(t, slot)) = self.dedup_timers.first() {
            if t > now {
                break;
            }
            self.dedup_timers.pop_first();
            let Some(e) = self.ent_mut(slot) else { continue };
            while let Some((end, _)) = e.dedup.order.front() {
                if *end > now {
                    break;
                }
                if let Some((end, id)) = e.dedup.order.pop_front()
                    && e.dedup.ids.get(&id) == Some(&end)
                {
                    e.dedup.ids.remove(&id);
                }
            }
            if let Some(&(end, _)) = e.dedup.order.front() {
                self.dedup_timers.insert((end, slot));
            }
        }
        Ok(())
    }

    /// A scheduled message reached its time: it becomes available, or is routed (a topic's
    /// to its subscriptions, a forwarding queue's to its target). Either way it takes a new
    /// sequence number, as in Service Bus, so it queues behind every message sent before this
    /// moment rather than ahead of them.
    pub(super) fn activate(&mut self, now: Timestamp, six: StoreIx, seq: i64) -> Result<(), Error> {
        let Some(m) = self.meta(six, seq) else { return Ok(()) };
        if m.state != St::Scheduled {
            return Ok(());
        }
        let key = self.key(six)?;
        let Some(e) = self.ent(six.slot()) else { return Ok(()) };
        let routes = e.is_topic() || self.forward_target(e.forward_to()).is_some();
        let mut router = Router::new(now);
        let new_seq = router.alloc(self, six.slot());
        if !routes {
            let to = vec![Placement {
                store: key,
                sequence: new_seq,
                enqueued: m.enqueued,
                expires: (m.expires != Timestamp::MAX).then_some(m.expires),
                delivery_count: m.delivery_count,
                state: PlacedState::Active,
                extra: m.extra.as_deref().cloned().map(Box::new),
            }];
            self.emit(Record::Moved { from: key, sequence: seq, to })?;
            return self.expire_if_due(now, six, new_seq);
        }
        let message = self.aux.bodies.message(m.body);
        let item = Item {
            ttl: message.as_ref().and_then(|m| m.time_to_live),
            message,
            has_session: m.session != NO_SESSION,
            delivery_count: m.delivery_count,
            extra: m.extra.as_deref().cloned(),
            enqueued: None,
        };
        let mut to = Vec::new();
        self.land(&mut router, six.slot(), new_seq, 0, &item, &mut to);
        self.emit(Record::Moved { from: key, sequence: seq, to })
    }

    /// Serves parked waiters of the stores that got available messages, unless serving is
    /// deferred to [`Engine::serve_waiters`].
    pub(super) fn pump(&mut self, now: Timestamp) {
        if self.waiters.is_empty() {
            self.aux.dirty.clear();
            return;
        }
        if !self.opts.deferred_serving {
            self.serve_dirty(now);
        }
    }

    /// Serves parked waiters of every store that got available messages.
    pub(super) fn serve_dirty(&mut self, now: Timestamp) {
        while let Some((six, sid)) = self.aux.dirty.pop() {
            // Errors here are internal inconsistencies; a waiter left unserved times out.
            let _ = self.pump_one(now, six, sid);
        }
    }

    pub(super) fn pump_one(&mut self, now: Timestamp, six: StoreIx, sid: u32) -> Result<(), Error> {
        let Some(store) = self.store(six) else { return Ok(()) };
        match &store.sessions {
            None => loop {
                let Some(store) = self.store_mut(six) else { return Ok(()) };
                if store.avail.is_empty() {
                    return Ok(());
                }
                let Some(w) = store.waiters.pop_front() else { return Ok(()) };
                let Some(waiter) = self.waiters.remove(&w) else { continue };
                let got = self.take_from(now, six, NO_SESSION, waiter.mode, waiter.max, None)?;
                if got.is_empty() {
                    // Everything it found had expired: it keeps its place.
                    self.waiters.insert(w, waiter);
                    if let Some(s) = self.store_mut(six) {
                        s.waiters.push_front(w);
                    }
                    return Ok(());
                }
                self.ready.push((w, got));
            },
            Some(ss) => {
                let holder = ss.table.get(&sid).and_then(|s| s.holder);
                match holder {
                    Some(lock) => loop {
                        let Some(s) = self.session_mut(six, sid) else { return Ok(()) };
                        if s.avail.is_empty() {
                            return Ok(());
                        }
                        let Some(w) = s.waiters.pop_front() else { return Ok(()) };
                        let Some(waiter) = self.waiters.remove(&w) else { continue };
                        let got =
                            self.take_from(now, six, sid, waiter.mode, waiter.max, Some(lock))?;
                        if got.is_empty() {
                            self.waiters.insert(w, waiter);
                            if let Some(s) = self.session_mut(six, sid) {
                                s.waiters.push_front(w);
                            }
                            return Ok(());
                        }
                        self.ready.push((w, got));
                    },
                    None => loop {
                        let Some(store) = self.store_mut(six) else { return Ok(()) };
                        let next = store
                            .sessions
                            .as_ref()
                            .and_then(|ss| ss.ready.first().map(|&(_, s)| s));
                        let Some(next) = next else { return Ok(()) };
                        let Some(w) = store.accept_waiters.pop_front() else { return Ok(()) };
                        if self.waiters.remove(&w).is_none() {
                            continue;
                        }
                        let accepted = self.lock_session(now, six, next);
                        self.ready_sessions.push((w, accepted));
                    },
                }
            }
        }
    }
}

/// What a message's state becomes when its lock ends.
pub(super) fn unlocked_state(s: St) -> PlacedState {
    match s {
        St::DeferredLocked | St::Deferred => PlacedState::Deferred,
        _ => PlacedState::Active,
    }
}

pub(super) fn non_empty(p: Properties) -> Option<Properties> {
    (!p.is_empty()).then_some(p)
}

pub(super) fn check_max(max: usize) -> Result<(), Error> {
    if max == 0 {
        return Err(Error::InvalidArgument(
            "the maximum message count must be at least 1".to_owned(),
        ));
    }
    Ok(())
}

pub(super) fn check_id(what: &str, id: &str) -> Result<(), Error> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(Error::InvalidArgument(format!("a {what} has 1 to {MAX_ID_LEN} characters")));
    }
    Ok(())
}

/// The recorded form of a message's current state in a store.
pub(super) fn placement_of(store: StoreKey, seq: i64, m: &Meta) -> Placement {
    Placement {
        store,
        sequence: seq,
        enqueued: m.enqueued,
        expires: (m.expires != Timestamp::MAX).then_some(m.expires),
        delivery_count: m.delivery_count,
        state: m.state.into(),
        extra: m.extra.as_deref().cloned().map(Box::new),
    }
}
