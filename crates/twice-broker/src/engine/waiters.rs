//! Parked receivers: a receive or accept-session request that finds nothing waits under its
//! [`WaiterId`] until messages arrive, its caller leaves or its entity goes away. Waiters are
//! served as messages arrive (or once per turn, with deferred serving), and the runtime takes
//! the served ones.

use twice::Timestamp;

use super::state::{NO_SESSION, StoreIx};
use super::{AcceptedSession, Delivery, Engine, WaitKind, Waiter, WaiterId};
use crate::error::Error;

impl Engine {
    /// Serves the parked waiters of every store that got available messages since they were
    /// last served. With [`EngineOptions::deferred_serving`], call it after each batch of
    /// calls, before [`Engine::take_ready`]; otherwise every call already did.
    ///
    /// [`EngineOptions::deferred_serving`]: super::EngineOptions::deferred_serving
    pub(crate) fn serve_waiters(&mut self, now: Timestamp) {
        if self.waiters.is_empty() {
            self.aux.dirty.clear();
        } else {
            self.serve_dirty(now);
        }
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

    pub(super) fn check_waiter(&self, waiter: Option<WaiterId>) -> Result<(), Error> {
        match waiter {
            Some(w) if self.waiters.contains_key(&w) => {
                Err(Error::InvalidArgument(format!("waiter {} is already parked", w.0)))
            }
            _ => Ok(()),
        }
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
