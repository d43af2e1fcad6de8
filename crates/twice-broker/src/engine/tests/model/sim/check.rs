//! The invariants checked after every step: the engine's stores, counts, locks and session
//! locks against the model, and delivery counts that never go down.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Sim {
    /// Whether a body's message id is `id`.
    fn id_is(&self, body: u32, id: &str) -> bool {
        match self.engine.aux.bodies.location(body) {
            Some(loc) => self
                .segments
                .iter()
                .find(|s| s.id == loc.segment)
                .and_then(|s| s.records.get(usize::try_from(loc.offset).ok()?))
                .and_then(Record::message)
                .is_some_and(|m| m.message_id.as_ref().is_some_and(|i| i.as_str() == id)),
            None => self.id_of_body(body) == id,
        }
    }

    /// The message id of a stored body.
    fn id_of_body(&self, body: u32) -> String {
        let d = self.engine.aux.bodies.body(body);
        let m: &Message = match &d {
            Body::Memory(m) => m,
            Body::Stored(loc) => self
                .segments
                .iter()
                .find(|s| s.id == loc.segment)
                .and_then(|s| s.records.get(usize::try_from(loc.offset).ok()?))
                .and_then(Record::message)
                .map_or_else(|| self.fail(&format!("body at {loc:?} is gone")), |m| &**m),
        };
        m.message_id.as_ref().map_or_else(String::new, |i| i.as_str().to_owned())
    }

    pub(super) fn check(&mut self) {
        for (e, dlq) in [(Ent::Q, false), (Ent::Q, true), (Ent::S, false), (Ent::S, true)] {
            let target = self.ent_ref(e, dlq);
            // The store as the engine holds it (peek builds the same view; reading it
            // directly keeps the check cheap enough to run after every step).
            let store = self.engine.store(target.six()).unwrap_or_else(|| self.fail("store gone"));
            let peeked: Vec<(i64, &Meta)> =
                store.msgs.iter().filter(|(_, m)| m.expires > self.now).collect();
            let mut want: Vec<&MMsg> = self
                .model
                .msgs
                .iter()
                .filter(|m| {
                    m.ent == e && m.dlq == dlq && m.state != MState::Gone && !m.expired(self.now)
                })
                .collect();
            want.sort_by_key(|m| m.seq);
            let state_of = |m: &MMsg| match m.state {
                MState::Deferred | MState::DeferredLocked { .. } => MessageState::Deferred,
                MState::Scheduled => MessageState::Scheduled,
                _ => MessageState::Active,
            };
            let engine_state = |m: &Meta| match m.state {
                St::Deferred | St::DeferredLocked => MessageState::Deferred,
                St::Scheduled => MessageState::Scheduled,
                St::Available | St::Locked => MessageState::Active,
            };
            let same = peeked.len() == want.len()
                && peeked.iter().zip(&want).all(|((seq, d), m)| {
                    *seq == m.seq
                        && d.delivery_count == m.dc
                        && engine_state(d) == state_of(m)
                        && self.id_is(d.body, &m.id)
                });
            if !same {
                let got: Vec<_> = peeked
                    .iter()
                    .map(|(seq, d)| {
                        (self.id_of_body(d.body), *seq, d.delivery_count, engine_state(d))
                    })
                    .collect();
                let want: Vec<_> =
                    want.iter().map(|m| (m.id.clone(), m.seq, m.dc, state_of(m))).collect();
                let only_engine: Vec<_> = got.iter().filter(|g| !want.contains(g)).collect();
                let only_model: Vec<_> = want.iter().filter(|w| !got.contains(w)).collect();
                let related: Vec<_> = self
                    .model
                    .msgs
                    .iter()
                    .filter(|m| only_engine.iter().chain(&only_model).any(|x| x.0 == m.id))
                    .collect();
                self.fail(&format!(
                    "{e:?} dlq={dlq}: only in the engine {only_engine:?}, only in the model {only_model:?}\n\
                     model entries: {related:?}\n engine {got:?}\n model  {want:?}"
                ));
            }
            if !dlq {
                let c = self
                    .engine
                    .counts(target)
                    .unwrap_or_else(|err| self.fail(&format!("counts: {err}")));
                let (mut active, mut locked, mut deferred, mut scheduled, mut dead) =
                    (0, 0, 0, 0, 0);
                for m in self.model.msgs.iter().filter(|m| m.ent == e && m.state != MState::Gone) {
                    if m.dlq {
                        dead += 1;
                        continue;
                    }
                    match m.state {
                        MState::Active => active += 1,
                        MState::Locked { .. } => {
                            active += 1;
                            locked += 1;
                        }
                        MState::Deferred => deferred += 1,
                        MState::DeferredLocked { .. } => {
                            deferred += 1;
                            locked += 1;
                        }
                        MState::Scheduled => scheduled += 1,
                        MState::Gone => {}
                    }
                }
                let want = (active, locked, deferred, scheduled, dead);
                let got = (c.active, c.locked, c.deferred, c.scheduled, c.dead_letter);
                if got != want {
                    self.fail(&format!("{e:?} counts {got:?}, model {want:?}"));
                }
            }
        }
        // No message is held by two live locks, and every lock holds a locked message.
        let mut held = std::collections::HashSet::new();
        for lock in self.engine.locks.values() {
            if !held.insert((lock.six, lock.seq)) {
                self.fail(&format!("message {} has two live locks", lock.seq));
            }
            if !self.engine.meta(lock.six, lock.seq).is_some_and(Meta::is_locked) {
                self.fail(&format!("lock on message {} which is not locked", lock.seq));
            }
        }
        // No session is held twice: one lock per session, and the session names its holder.
        let mut sessions = std::collections::HashSet::new();
        for (lock, &(six, sid)) in &self.engine.session_locks {
            if !sessions.insert((six, sid)) {
                self.fail(&format!("session {sid} is held twice"));
            }
            let holder = self
                .engine
                .store(six)
                .and_then(|st| st.sessions.as_ref())
                .and_then(|ss| ss.table.get(&sid))
                .and_then(|x| x.holder);
            if holder != Some(*lock) {
                self.fail(&format!("session {sid} is held by {holder:?}, not by {lock:?}"));
            }
        }
        // Delivery counts never go down (a resubmitted message starts again at 1). The engine's
        // counts equal the model's (checked above), so this holds for both.
        if let Some(m) =
            self.model.msgs.iter().find(|m| m.state != MState::Gone && m.dc < m.seen_dc)
        {
            let msg = format!("delivery count of {} went from {} to {}", m.id, m.seen_dc, m.dc);
            self.fail(&msg);
        }
        for m in &mut self.model.msgs {
            m.seen_dc = m.dc;
        }
    }
}
