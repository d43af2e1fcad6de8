//! The session steps of the simulation: accept a session (named or the next one), receive
//! from it, and release, renew, set or read its state.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Sim {
    fn held(&self, r: usize) -> Option<(String, SessionLock, bool)> {
        let (s, lock) = self.receivers[r].session.clone()?;
        let live = self.model.holders.get(&s).is_some_and(|h| h.lock == lock);
        Some((s, lock, live))
    }

    pub(super) fn accept(&mut self, r: usize) {
        if self.held(r).is_some_and(|h| h.2) {
            return;
        }
        let target = self.ent_ref(Ent::S, false);
        let named =
            self.rng.chance(50).then(|| SESSIONS[self.rng.below(SESSIONS.len())].to_owned());
        self.trace.push(format!("r{r} accept {named:?}"));
        let got =
            self.engine.accept_session(self.now, target, named.clone().map(SessionId::new), None);
        let expect = match &named {
            Some(s) if self.model.holders.contains_key(s) => {
                if !matches!(&got, Err(Error::SessionCannotBeLocked(x)) if x == s) {
                    self.fail(&format!("accept of a held session {s}: {got:?}"));
                }
                return;
            }
            Some(s) => Some(s.clone()),
            None => {
                // The free session whose oldest available message is oldest.
                let free =
                    self.model.available(Ent::S, false, None, self.now).into_iter().find(|&i| {
                        let s = self.model.msgs[i].session.clone().unwrap_or_default();
                        !self.model.holders.contains_key(&s)
                    });
                free.and_then(|i| self.model.msgs[i].session.clone())
            }
        };
        let got = got.unwrap_or_else(|err| self.fail(&format!("accept: {err}")));
        match (expect, got) {
            (None, None) => {}
            (Some(s), Some(acc)) if acc.session_id.as_str() == s => {
                let until = self.now + LOCK;
                if acc.locked_until != until {
                    self.fail("session locked-until");
                }
                self.model.holders.insert(s.clone(), Holder { lock: acc.lock, until });
                self.receivers[r].session = Some((s, acc.lock));
            }
            (want, got) => {
                let st = self.engine.store(self.ent_ref(Ent::S, false).six()).unwrap();
                let ss = st.sessions.as_ref().unwrap();
                let dump: Vec<_> = ss
                    .table
                    .iter()
                    .map(|(sid, x)| {
                        (
                            self.engine.aux.names.name(*sid).cloned(),
                            x.avail.iter().collect::<Vec<_>>(),
                            x.holder,
                            x.refs,
                        )
                    })
                    .collect();
                self.fail(&format!("accepted {got:?}, model {want:?}; ready {:?} sessions {dump:?} avail-model {:?}", ss.ready, self.model.available(Ent::S, false, None, self.now).iter().map(|&i| (&self.model.msgs[i].id, self.model.msgs[i].seq, &self.model.msgs[i].session)).collect::<Vec<_>>()))
            }
        }
    }

    pub(super) fn session_receive(&mut self, r: usize) {
        let Some((s, lock, live)) = self.held(r) else { return self.accept(r) };
        let n = 1 + self.rng.below(3);
        let mode =
            if self.rng.chance(10) { ReceiveMode::ReceiveAndDelete } else { ReceiveMode::PeekLock };
        self.trace.push(format!("r{r} session receive {s} n={n} {mode:?} live={live}"));
        let got = self.engine.receive_session(self.now, lock, mode, n, None);
        if !live {
            if !matches!(got, Err(Error::SessionLockLost)) {
                self.fail(&format!("receive on a lost session: {got:?}"));
            }
            self.receivers[r].session = None;
            return;
        }
        let got = got.unwrap_or_else(|err| self.fail(&format!("session receive: {err}")));
        let mut expect = self.model.available(Ent::S, false, Some(&s), self.now);
        expect.truncate(n);
        let until = self.model.holders.get(&s).map(|h| h.until);
        self.take(r, expect, &got, mode, until);
    }

    pub(super) fn session_other(&mut self, r: usize) {
        let Some((s, lock, live)) = self.held(r) else { return };
        let op = self.rng.below(4);
        self.trace.push(format!("r{r} session op={op} {s} live={live}"));
        let now = self.now;
        let result = match op {
            0 => self.engine.release_session(now, lock).map(|()| None),
            1 => self.engine.renew_session_lock(now, lock).map(Some),
            2 => {
                let state =
                    self.rng.chance(70).then(|| Bytes::from(format!("st{}", self.rng.below(100))));
                let r = self.engine.set_session_state(now, lock, state.clone());
                if r.is_ok() {
                    match state {
                        Some(b) => self.model.states.insert(s.clone(), b),
                        None => self.model.states.remove(&s),
                    };
                }
                r.map(|()| None)
            }
            _ => {
                let got = self.engine.session_state(lock);
                if let Ok(got) = &got
                    && got.as_ref() != self.model.states.get(&s)
                {
                    self.fail(&format!(
                        "session state {got:?}, model {:?}",
                        self.model.states.get(&s)
                    ));
                }
                got.map(|_| None)
            }
        };
        if !live {
            if !matches!(result, Err(Error::SessionLockLost)) {
                self.fail(&format!("session op on a lost session: {result:?}"));
            }
            self.receivers[r].session = None;
            return;
        }
        let result = result.unwrap_or_else(|err| self.fail(&format!("session op {op}: {err}")));
        match op {
            0 => {
                self.model.lose_session(&s, now, false);
                self.receivers[r].session = None;
            }
            1 => {
                if result != Some(now + LOCK) {
                    self.fail("renewed session until");
                }
                self.renew_session_in_model(&s, now + LOCK);
            }
            _ => {}
        }
    }
}
