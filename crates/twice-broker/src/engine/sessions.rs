//! Sessions: accept, renew and release session locks, list sessions, and their state; locking a
//! session and freeing it again.

use std::time::Duration;

use bytes::Bytes;
use twice::{SessionId, Timestamp};

use super::deliver::check_max;
use super::fasthash::FastMap;
use super::record::Record;
use super::send::check_id;
use super::state::{Entity, Store, StoreIx};
use super::{
    AcceptedSession, Delivery, Engine, EntityRef, ReceiveMode, SessionLock, SessionSummary,
    WaitKind, Waiter, WaiterId,
};
use crate::error::Error;

impl Engine {
    /// Locks a session of a session-enabled queue or subscription: the named one (failing with
    /// [`Error::SessionCannotBeLocked`] if another receiver holds it), or the next one with an
    /// available message. When there is none and `waiter` is given, the waiter is parked and
    /// served through [`Engine::take_ready_sessions`].
    pub(crate) fn accept_session(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        session: Option<SessionId>,
        waiter: Option<WaiterId>,
    ) -> Result<Option<AcceptedSession>, Error> {
        self.tick(now);
        self.serve_waiters(now);
        let six = self.receive_store(entity)?;
        self.check_waiter(waiter)?;
        let e = self.entity(entity)?;
        if entity.dead_letter || !e.requires_session() {
            return Err(Error::SessionsNotEnabled(e.path.clone()));
        }
        let out = match session {
            Some(id) => {
                check_id("session id", id.as_str())?;
                let sid = self.aux.names.intern(&id);
                let held = self
                    .store(six)
                    .and_then(|s| s.sessions.as_ref())
                    .and_then(|ss| ss.table.get(&sid))
                    .is_some_and(|s| s.holder.is_some());
                if held {
                    return Err(Error::SessionCannotBeLocked(id.to_string()));
                }
                let accepted = self.lock_session(now, six, sid);
                self.aux.names.release_unused(sid);
                accepted
            }
            None => {
                let next = self
                    .store(six)
                    .and_then(|s| s.sessions.as_ref())
                    .and_then(|ss| ss.ready.first().map(|&(_, sid)| sid));
                match next {
                    Some(sid) => self.lock_session(now, six, sid),
                    None => {
                        if let Some(w) = waiter {
                            self.park(
                                w,
                                Waiter {
                                    kind: WaitKind::Accept,
                                    six,
                                    mode: ReceiveMode::PeekLock,
                                    max: 1,
                                },
                            );
                        }
                        None
                    }
                }
            }
        };
        self.pump(now);
        Ok(out)
    }

    /// Receives up to `max` messages of a held session, in order; parks `waiter` when there
    /// are none.
    pub(crate) fn receive_session(
        &mut self,
        now: Timestamp,
        lock: SessionLock,
        mode: ReceiveMode,
        max: usize,
        waiter: Option<WaiterId>,
    ) -> Result<Vec<Delivery>, Error> {
        self.tick(now);
        self.serve_waiters(now);
        let (six, sid) = *self.session_locks.get(&lock).ok_or(Error::SessionLockLost)?;
        check_max(max)?;
        self.check_waiter(waiter)?;
        let out = self.take_from(now, six, sid, mode, max, Some(lock))?;
        if out.is_empty()
            && let Some(w) = waiter
        {
            self.park(w, Waiter { kind: WaitKind::Session(lock), six, mode, max });
        }
        self.pump(now);
        Ok(out)
    }

    /// Renews a session lock for another `LockDuration`; returns the new locked-until.
    pub(crate) fn renew_session_lock(
        &mut self,
        now: Timestamp,
        lock: SessionLock,
    ) -> Result<Timestamp, Error> {
        self.tick(now);
        let (six, sid) = *self.session_locks.get(&lock).ok_or(Error::SessionLockLost)?;
        let until = now + self.ent(six.slot()).map_or(Duration::ZERO, Entity::lock_duration);
        let Some(s) = self.session_mut(six, sid) else { return Err(Error::SessionLockLost) };
        let old = std::mem::replace(&mut s.locked_until, until);
        let tokens = s.locks.clone();
        self.session_timers.remove(&(old, lock));
        self.session_timers.insert((until, lock));
        for t in tokens {
            if let Some(l) = self.locks.get_mut(&t) {
                l.until = until;
            }
        }
        Ok(until)
    }

    /// Releases a held session: it is free for other receivers, and its messages still locked
    /// become available with their delivery count unchanged (only an expired session lock
    /// counts a delivery, as in Service Bus).
    pub(crate) fn release_session(
        &mut self,
        now: Timestamp,
        lock: SessionLock,
    ) -> Result<(), Error> {
        self.tick(now);
        if !self.session_locks.contains_key(&lock) {
            return Err(Error::SessionLockLost);
        }
        self.free_session(now, lock, false)?;
        self.pump(now);
        Ok(())
    }

    /// The sessions of a session-enabled queue or subscription that hold messages or state:
    /// first those with a message that has not expired, in order of their oldest such
    /// message, then those with state only, by id. Reads message metadata, never a body, and
    /// stops once every session with messages was seen.
    pub(crate) fn sessions(
        &self,
        now: Timestamp,
        entity: EntityRef,
    ) -> Result<Vec<SessionSummary>, Error> {
        let six = self.receive_store(entity)?;
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let Some(ss) = &store.sessions else {
            return Err(Error::SessionsNotEnabled(self.entity_info(entity)?.path));
        };
        let with_messages = ss.table.values().filter(|s| s.refs > 0).count();
        let mut seen: FastMap<u32, ()> = FastMap::default();
        let mut out = Vec::new();
        for (_, m) in store.msgs.iter() {
            if seen.len() == with_messages {
                break;
            }
            if m.expires > now
                && seen.insert(m.session, ()).is_none()
                && let Some(id) = self.aux.names.name(m.session)
            {
                let state = ss.table.get(&m.session).and_then(|s| s.state.clone());
                out.push(SessionSummary { session_id: id.clone(), has_messages: true, state });
            }
        }
        let mut state_only: Vec<SessionSummary> = ss
            .table
            .iter()
            .filter(|(sid, s)| s.state.is_some() && !seen.contains_key(*sid))
            .filter_map(|(sid, s)| {
                Some(SessionSummary {
                    session_id: self.aux.names.name(*sid)?.clone(),
                    has_messages: false,
                    state: s.state.clone(),
                })
            })
            .collect();
        state_only.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        out.extend(state_only);
        Ok(out)
    }

    /// The state of a held session.
    pub(crate) fn session_state(&self, lock: SessionLock) -> Result<Option<Bytes>, Error> {
        let &(six, sid) = self.session_locks.get(&lock).ok_or(Error::SessionLockLost)?;
        Ok(self
            .store(six)
            .and_then(|s| s.sessions.as_ref())
            .and_then(|ss| ss.table.get(&sid))
            .and_then(|s| s.state.clone()))
    }

    /// Sets (or with `None` clears) the state of a held session; it is persisted.
    pub(crate) fn set_session_state(
        &mut self,
        now: Timestamp,
        lock: SessionLock,
        state: Option<Bytes>,
    ) -> Result<(), Error> {
        self.tick(now);
        let &(six, sid) = self.session_locks.get(&lock).ok_or(Error::SessionLockLost)?;
        if let Some(s) = &state
            && s.len() > self.opts.max_message_size
        {
            return Err(Error::MessageSizeExceeded {
                size: s.len(),
                limit: self.opts.max_message_size,
            });
        }
        let session = self.aux.names.name(sid).cloned().ok_or(Error::SessionLockLost)?;
        let entity = self.key(six)?.entity;
        self.emit(Record::SessionState { entity, session, state })
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

    /// Frees a held session. Its messages still locked become available again: with their
    /// delivery count raised when the session lock `expired`, unchanged when the receiver let
    /// the session go (as Service Bus does: only a lock that runs out counts a delivery). Its
    /// parked receivers are served with nothing.
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
}
