//! Applying a [`Record`]: the one place where messages and entities change. Calls build a
//! record and apply it; recovery applies the records of the log; so the state after a restart
//! is the state before it.

use std::sync::Arc;

use twice::Timestamp;

use super::bodies::BodyData;
use super::record::{BodyKey, EntityId, PlacedState, Placement, Record, StoreKey, live_rules};
use super::state::{
    Dedup, Entity, Kind, Meta, NO_SESSION, St, Store, StoreIx, attach, detach, place, unplace,
};
use super::{Counters, Engine, Location, Lock, WaitKind, message_size};
use crate::config::{EntityDefinition, Rule};
use crate::error::Error;

impl Engine {
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

    /// Applies a record. `loc` is where it is stored during replay, `None` for a record a call
    /// just made (its body stays in memory until [`Engine::set_location`]).
    pub(super) fn apply(&mut self, rec: &mut Record, loc: Option<Location>) -> Result<(), Error> {
        match rec {
            Record::Entity { id, definition, next_sequence } => {
                self.apply_entity(*id, definition, *next_sequence)
            }
            Record::EntityLimits { id, max_size_in_megabytes } => {
                let slot = self.slot_of(*id)?;
                let e = self.ent_mut(slot).ok_or_else(|| corrupt("limits of a deleted entity"))?;
                match &mut e.kind {
                    Kind::Queue(p) => p.max_size_in_megabytes = *max_size_in_megabytes,
                    Kind::Topic { props, .. } => {
                        props.max_size_in_megabytes = *max_size_in_megabytes
                    }
                    Kind::Subscription { .. } => return Err(corrupt("limits of a subscription")),
                }
                Ok(())
            }
            Record::RuleAdded { subscription, rule } => {
                let rules = self.rules_mut(*subscription)?;
                if rules.iter().any(|r| r.name.eq_ignore_ascii_case(&rule.name)) {
                    return Err(corrupt("a rule added twice"));
                }
                rules.push(Rule::clone(rule));
                Ok(())
            }
            Record::RuleRemoved { subscription, name } => {
                self.rules_mut(*subscription)?.retain(|r| !r.name.eq_ignore_ascii_case(name));
                Ok(())
            }
            Record::EntityDeleted { id } => {
                if let Some(&slot) = self.by_id.get(id) {
                    self.delete_slot(slot);
                }
                Ok(())
            }
            Record::Sent { target, sequence, at, message, placements, body, .. } => {
                let slot = self.slot_of(*target)?;
                let e = self.ent_mut(slot).ok_or_else(|| corrupt("sent to a deleted entity"))?;
                e.next_seq = e.next_seq.max(*sequence + 1);
                if let (Some(window), Some(id)) = (e.dedup_window(), &message.0.message_id) {
                    let end = *at + window;
                    e.dedup.ids.insert(id.clone(), end);
                    e.dedup.order.push_back((end, id.clone()));
                    if e.dedup.order.len() == 1 {
                        self.dedup_timers.insert((end, slot));
                    }
                }
                *body = self.place_all(placements, &message.0, loc)?;
                Ok(())
            }
            Record::Snapshot { message, placements, body } => {
                // A live relocation changes nothing but where the body is, which
                // `set_location` does once the snapshot is written.
                if loc.is_none() {
                    return Ok(());
                }
                for p in placements.iter() {
                    let six = self.six_of(p.store)?;
                    let Engine { entities, aux, .. } = self;
                    if let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut)
                    {
                        unplace(e.store_mut(six.is_dlq()), aux, six, p.sequence, false);
                    }
                }
                *body = self.place_all(placements, &message.0, loc)?;
                Ok(())
            }
            Record::Locked { store, sequences } => {
                let six = self.six_of(*store)?;
                let Engine { entities, aux, .. } = self;
                let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut) else {
                    return Ok(());
                };
                let pins = e.store_pins(six.is_dlq());
                let st = e.store_mut(six.is_dlq());
                for &seq in sequences.iter() {
                    let Some(mut m) = st.msgs.remove(seq) else { continue };
                    let to = match m.state {
                        St::Available => St::Locked,
                        St::Deferred => St::DeferredLocked,
                        _ => {
                            st.msgs.insert(seq, m);
                            return Err(corrupt("a lock on a message that is not available"));
                        }
                    };
                    detach(st, aux, six, seq, &mut m);
                    m.state = to;
                    attach(st, aux, six, seq, &mut m, pins);
                    st.msgs.insert(seq, m);
                }
                Ok(())
            }
            Record::Removed { store, sequences } => {
                let six = self.six_of(*store)?;
                let Engine { entities, aux, .. } = self;
                if let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut) {
                    let st = e.store_mut(six.is_dlq());
                    for &seq in sequences.iter() {
                        unplace(st, aux, six, seq, false);
                    }
                }
                Ok(())
            }
            Record::Updated { store, sequence, delivery_count, state, properties } => {
                let six = self.six_of(*store)?;
                let to = match state {
                    PlacedState::Active => St::Available,
                    PlacedState::Deferred => St::Deferred,
                    _ => return Err(corrupt("an update to a state other than active or deferred")),
                };
                let Engine { entities, aux, .. } = self;
                let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut) else {
                    return Ok(());
                };
                let pins = e.store_pins(six.is_dlq());
                let st = e.store_mut(six.is_dlq());
                let Some(mut m) = st.msgs.remove(*sequence) else { return Ok(()) };
                detach(st, aux, six, *sequence, &mut m);
                m.delivery_count = *delivery_count;
                m.state = to;
                if let Some(p) = properties {
                    let mut extra = m.extra.as_deref().cloned().unwrap_or_default();
                    extra.properties.extend(p.iter().map(|(k, v)| (k.clone(), v.clone())));
                    m.extra = Some(Arc::new(extra));
                }
                attach(st, aux, six, *sequence, &mut m, pins);
                st.msgs.insert(*sequence, m);
                Ok(())
            }
            Record::Moved { from, sequence, to } => {
                let six = self.six_of(*from)?;
                // Sequence numbers handed out stay handed out, even when the move itself is
                // skipped because its message was compacted away (it was settled later).
                for p in to.iter() {
                    self.bump_sequence(p)?;
                }
                let Some(m) = self.meta(six, *sequence) else { return Ok(()) };
                let (body, session) = (m.body, m.session);
                // Hold the body and session name while the message is between stores.
                self.aux.bodies.incref(body);
                if session != NO_SESSION {
                    self.aux.names.incref(session);
                }
                {
                    let Engine { entities, aux, .. } = self;
                    if let Some(e) = entities.get_mut(six.slot() as usize).and_then(Option::as_mut)
                    {
                        unplace(e.store_mut(six.is_dlq()), aux, six, *sequence, false);
                    }
                }
                let mut result = Ok(());
                for p in to.iter() {
                    result = self.place_one(p, body, session);
                    if result.is_err() {
                        break;
                    }
                }
                self.aux.bodies.decref(body);
                if session != NO_SESSION {
                    self.aux.names.decref(session);
                }
                result
            }
            Record::SessionState { entity, session, state } => {
                let slot = self.slot_of(*entity)?;
                let sid = self.aux.names.intern(session);
                let Engine { entities, aux, .. } = self;
                let st = entities
                    .get_mut(slot as usize)
                    .and_then(Option::as_mut)
                    .map(|e| &mut e.main)
                    .ok_or_else(|| corrupt("session state of a deleted entity"))?;
                let Some(ss) = st.sessions.as_mut() else {
                    aux.names.release_unused(sid);
                    return Err(corrupt("session state on an entity without sessions"));
                };
                Store::session_entry(ss, &mut aux.names, sid).state = state.clone();
                st.drop_session_if_idle(&mut aux.names, sid);
                aux.names.release_unused(sid);
                Ok(())
            }
            Record::DuplicateIds { entity, ids } => {
                let slot = self.slot_of(*entity)?;
                let e = self.ent_mut(slot).ok_or_else(|| corrupt("ids of a deleted entity"))?;
                let was_empty = e.dedup.order.is_empty();
                for (id, end) in ids.iter() {
                    if e.dedup.ids.get(id) != Some(end) {
                        e.dedup.ids.insert(id.clone(), *end);
                        e.dedup.order.push_back((*end, id.clone()));
                    }
                }
                // Restated windows can end earlier than ones already queued: keep the purge
                // order by sorting the (small, checkpoint-time) queue.
                e.dedup.order.make_contiguous().sort();
                if let Some(&(end, _)) = e.dedup.order.front() {
                    if !was_empty {
                        self.dedup_timers.retain(|&(_, s)| s != slot);
                    }
                    self.dedup_timers.insert((end, slot));
                }
                Ok(())
            }
        }
    }

    fn slot_of(&self, id: EntityId) -> Result<u32, Error> {
        self.by_id.get(&id).copied().ok_or_else(|| corrupt("a record names an unknown entity"))
    }

    pub(super) fn six_of(&self, key: StoreKey) -> Result<StoreIx, Error> {
        Ok(StoreIx::new(self.slot_of(key.entity)?, key.dead_letter))
    }

    /// Places every placement of a message carried by a `Sent` or `Snapshot` record.
    fn place_all(
        &mut self,
        placements: &[Placement],
        message: &Arc<twice::Message>,
        loc: Option<Location>,
    ) -> Result<BodyKey, Error> {
        if placements.is_empty() {
            return Ok(BodyKey::NONE);
        }
        let data = match loc {
            Some(l) => BodyData::Stored(l),
            None => BodyData::Memory(Arc::clone(message)),
        };
        let size = u32::try_from(message_size(message)).unwrap_or(u32::MAX);
        let index = self.aux.bodies.alloc(data, size);
        let session = message.session_id.as_ref().map_or(NO_SESSION, |s| self.aux.names.intern(s));
        // Hold the slot while placing, so a failure part-way frees it.
        self.aux.bodies.incref(index);
        let mut result = Ok(());
        for p in placements {
            result = self.place_one(p, index, session);
            if result.is_err() {
                break;
            }
        }
        if session != NO_SESSION {
            self.aux.names.release_unused(session);
        }
        if loc.is_some() {
            self.aux.bodies.keep_if_pinned(index, message);
        }
        let key = BodyKey { index, generation: self.aux.bodies.generation(index) };
        self.aux.bodies.decref(index);
        result.map(|()| key)
    }

    /// Raises the next sequence number of the queue or topic that numbered a placement.
    fn bump_sequence(&mut self, p: &Placement) -> Result<StoreIx, Error> {
        let six = self.six_of(p.store)?;
        let owner = match self.ent(six.slot()).map(|e| &e.kind) {
            Some(Kind::Subscription { topic, .. }) => *topic,
            _ => six.slot(),
        };
        if let Some(o) = self.ent_mut(owner) {
            o.next_seq = o.next_seq.max(p.sequence + 1);
        }
        Ok(six)
    }

    fn place_one(&mut self, p: &Placement, body: u32, session: u32) -> Result<(), Error> {
        let six = self.bump_sequence(p)?;
        let meta = Meta {
            enqueued: p.enqueued,
            expires: p.expires.unwrap_or(Timestamp::MAX),
            extra: p.extra.as_deref().filter(|x| !x.is_empty()).cloned().map(Arc::new),
            body,
            delivery_count: p.delivery_count,
            session,
            state: p.state.into(),
            pinned: false,
            changed: 0,
        };
        let Engine { entities, aux, .. } = self;
        let e = entities
            .get_mut(six.slot() as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| corrupt("a message placed in a deleted entity"))?;
        let pins = e.store_pins(six.is_dlq());
        place(e.store_mut(six.is_dlq()), aux, six, p.sequence, meta, pins)
    }

    /// The rules of a subscription, to change.
    fn rules_mut(&mut self, id: EntityId) -> Result<&mut Vec<Rule>, Error> {
        let slot = self.slot_of(id)?;
        match self.ent_mut(slot).map(|e| &mut e.kind) {
            Some(Kind::Subscription { rules, .. }) => Ok(rules),
            Some(_) => Err(corrupt("a rule change of an entity that is not a subscription")),
            None => Err(corrupt("a rule change of a deleted subscription")),
        }
    }

    fn apply_entity(
        &mut self,
        id: EntityId,
        def: &EntityDefinition,
        next_sequence: i64,
    ) -> Result<(), Error> {
        if let Some(&slot) = self.by_id.get(&id) {
            let e = self.ent_mut(slot).ok_or_else(|| corrupt("an update of a deleted entity"))?;
            match (&mut e.kind, def) {
                (Kind::Queue(p), EntityDefinition::Queue { properties, .. }) => {
                    if p.requires_session != properties.requires_session {
                        return Err(corrupt("RequiresSession changed"));
                    }
                    *p = properties.clone();
                }
                (Kind::Topic { props, .. }, EntityDefinition::Topic { properties, .. }) => {
                    *props = properties.clone();
                }
                (
                    Kind::Subscription { props, rules, .. },
                    EntityDefinition::Subscription { properties, rules: new_rules, .. },
                ) => {
                    if props.requires_session != properties.requires_session {
                        return Err(corrupt("RequiresSession changed"));
                    }
                    *props = properties.clone();
                    *rules = live_rules(new_rules);
                }
                _ => return Err(corrupt("an entity changed kind")),
            }
            e.next_seq = e.next_seq.max(next_sequence);
            return Ok(());
        }
        let path = def.path();
        let key = path.to_ascii_lowercase();
        if self.by_path.contains_key(&key) {
            return Err(corrupt("two entities with one path"));
        }
        let slot = u32::try_from(self.entities.len())
            .ok()
            .filter(|&s| s < u32::MAX >> 1)
            .ok_or_else(|| Error::InvalidOperation("too many entities created".to_owned()))?;
        let (kind, sessions) = match def {
            EntityDefinition::Queue { properties, .. } => {
                (Kind::Queue(properties.clone()), properties.requires_session)
            }
            EntityDefinition::Topic { properties, .. } => {
                (Kind::Topic { props: properties.clone(), subs: Vec::new() }, false)
            }
            EntityDefinition::Subscription { topic, name, properties, rules } => {
                let t = self
                    .by_path
                    .get(&topic.to_ascii_lowercase())
                    .copied()
                    .filter(|&t| self.ent(t).is_some_and(Entity::is_topic))
                    .ok_or_else(|| corrupt("a subscription of an unknown topic"))?;
                (
                    Kind::Subscription {
                        topic: t,
                        name: name.clone(),
                        props: properties.clone(),
                        rules: live_rules(rules),
                    },
                    properties.requires_session,
                )
            }
        };
        if let Kind::Subscription { topic, .. } = &kind
            && let Some(Kind::Topic { subs, .. }) = self.ent_mut(*topic).map(|t| &mut t.kind)
        {
            subs.push(slot);
        }
        self.entities.push(Some(Entity {
            id,
            path,
            kind,
            next_seq: next_sequence.max(1),
            main: Store::new(sessions),
            dlq: Store::new(false),
            dedup: Dedup::default(),
            counters: Counters::default(),
        }));
        self.by_path.insert(key, slot);
        self.by_id.insert(id, slot);
        self.next_entity_id = self.next_entity_id.max(id.0 + 1);
        Ok(())
    }

    /// Removes an entity and everything that refers to it.
    fn delete_slot(&mut self, slot: u32) {
        if let Some(Kind::Topic { subs, .. }) = self.ent(slot).map(|e| &e.kind) {
            for sub in subs.clone() {
                self.delete_slot(sub);
            }
        }
        let tokens: Vec<_> =
            self.locks.iter().filter(|(_, l)| l.six.slot() == slot).map(|(t, _)| *t).collect();
        for t in tokens {
            if let Some(Lock { until, timer: Some(key), .. }) = self.locks.remove(&t) {
                let locks = &self.locks;
                self.lock_timers
                    .remove(key, until, t, |k, u| locks.get(k).is_some_and(|l| l.until == u));
            }
        }
        let sessions: Vec<_> = self
            .session_locks
            .iter()
            .filter(|(_, (six, _))| six.slot() == slot)
            .map(|(l, _)| *l)
            .collect();
        for l in sessions {
            self.session_locks.remove(&l);
            self.session_timers.retain(|&(_, x)| x != l);
        }
        let waiters: Vec<_> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.six.slot() == slot)
            .map(|(id, w)| (*id, w.kind))
            .collect();
        for (id, kind) in waiters {
            self.waiters.remove(&id);
            match kind {
                WaitKind::Accept => self.ready_sessions.push((id, None)),
                WaitKind::Receive | WaitKind::Session(_) => self.ready.push((id, Vec::new())),
            }
        }
        self.dedup_timers.retain(|&(_, s)| s != slot);
        let Engine { entities, aux, .. } = self;
        let Some(mut e) = entities.get_mut(slot as usize).and_then(Option::take) else { return };
        for dead_letter in [false, true] {
            let six = StoreIx::new(slot, dead_letter);
            let st = e.store_mut(dead_letter);
            let seqs: Vec<i64> = st.msgs.keys().collect();
            for seq in seqs {
                unplace(st, aux, six, seq, false);
            }
            if let Some(ss) = st.sessions.take() {
                for sid in ss.table.keys() {
                    aux.names.decref(*sid);
                }
            }
        }
        self.by_path.remove(&e.path.to_ascii_lowercase());
        self.by_id.remove(&e.id);
        if let Kind::Subscription { topic, .. } = e.kind
            && let Some(Kind::Topic { subs, .. }) = self.ent_mut(topic).map(|t| &mut t.kind)
        {
            subs.retain(|&s| s != slot);
        }
    }
}

fn corrupt(what: &str) -> Error {
    Error::Corrupt(what.to_owned())
}
