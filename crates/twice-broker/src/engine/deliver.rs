//! Receiving: receive, receive deferred messages by sequence number, and peek; taking a
//! store's available messages, locking (or removing) them and building their [`Delivery`]s;
//! and the [`ReceivedMessage`] a delivery becomes.

use std::time::Duration;

use twice::{
    LockToken, Message, MessageState, ReceivedMessage, SequenceNumber, SessionId, Timestamp, Value,
};

use super::state::{Entity, Meta, NO_SESSION, St, StoreIx};
use super::{
    Delivery, DeliveryMeta, Engine, EntityRef, Lock, ReceiveMode, Record, SessionLock, WaitKind,
    Waiter, WaiterId, seqmap,
};
use crate::error::Error;

impl Engine {
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
}

pub(super) fn check_max(max: usize) -> Result<(), Error> {
    if max == 0 {
        return Err(Error::InvalidArgument(
            "the maximum message count must be at least 1".to_owned(),
        ));
    }
    Ok(())
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
