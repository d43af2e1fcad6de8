//! Settlement: complete, abandon, dead-letter, defer, release and renew locks, and resubmit
//! dead-lettered messages; and the ways a lock ends: unlocked with or without a delivery
//! counted, or moved to the dead-letter queue.

use std::time::Duration;

use twice::{LockToken, Properties, SequenceNumber, Timestamp};

use super::record::{PlacedState, Record};
use super::route::{Item, Router};
use super::state::{Entity, NO_SESSION, St, StoreIx};
use super::{Engine, EntityRef, Lock};
use crate::dead_letter_reasons;
use crate::error::Error;

impl Engine {
    /// Fails with [`Error::MessageLockLost`] when one of `tokens` locks a message of another
    /// entity than `entity` (a dead-letter queue is an entity of its own), as if the token were
    /// unknown: a token settles nothing outside the entity it was given for. Tokens that lock
    /// nothing are left to the settlement, which fails on them.
    pub(crate) fn check_lock_entity(
        &self,
        entity: EntityRef,
        tokens: &[LockToken],
    ) -> Result<(), Error> {
        let six = entity.six();
        if tokens.iter().any(|t| self.locks.get(t).is_some_and(|l| l.six != six)) {
            return Err(Error::MessageLockLost);
        }
        Ok(())
    }

    /// Completes locked messages, all or nothing: any unknown or expired token fails the call
    /// with [`Error::MessageLockLost`] and changes nothing.
    pub(crate) fn complete(&mut self, now: Timestamp, tokens: &[LockToken]) -> Result<(), Error> {
        self.tick(now);
        self.check_tokens(tokens)?;
        let mut groups: Vec<(StoreIx, Vec<i64>)> = Vec::new();
        for t in tokens {
            let Some(lock) = self.remove_lock(t) else { continue };
            match groups.iter_mut().find(|(six, _)| *six == lock.six) {
                Some((_, seqs)) => seqs.push(lock.seq),
                None => groups.push((lock.six, vec![lock.seq])),
            }
        }
        for (six, seqs) in groups {
            let n = seqs.len() as u64;
            let key = self.key(six)?;
            self.emit(Record::Removed { store: key, sequences: seqs })?;
            self.count(six.slot(), |c| c.completed += n);
        }
        self.pump(now);
        Ok(())
    }

    /// Abandons a locked message: it becomes available again with its delivery count raised
    /// (dead-lettered when that exceeds `MaxDeliveryCount`), after merging `properties` into
    /// its application properties.
    pub(crate) fn abandon(
        &mut self,
        now: Timestamp,
        token: LockToken,
        properties: Properties,
    ) -> Result<(), Error> {
        self.tick(now);
        self.check_tokens(&[token])?;
        let lock = self.remove_lock(&token).ok_or(Error::MessageLockLost)?;
        self.count(lock.six.slot(), |c| c.abandoned += 1);
        self.unlock_counted(now, lock.six, lock.seq, non_empty(properties))?;
        self.pump(now);
        Ok(())
    }

    /// Moves a locked message to its dead-letter queue (or its `ForwardDeadLetteredMessagesTo`
    /// entity) with a reason and description, merging `properties`. A message in a dead-letter
    /// queue cannot be dead-lettered again.
    pub(crate) fn dead_letter(
        &mut self,
        now: Timestamp,
        token: LockToken,
        reason: Option<String>,
        description: Option<String>,
        properties: Properties,
    ) -> Result<(), Error> {
        self.tick(now);
        self.check_tokens(&[token])?;
        let six = self.locks.get(&token).map(|l| l.six).ok_or(Error::MessageLockLost)?;
        if six.is_dlq() {
            return Err(Error::InvalidOperation(
                "a message in a dead-letter queue cannot be dead-lettered again".to_owned(),
            ));
        }
        let lock = self.remove_lock(&token).ok_or(Error::MessageLockLost)?;
        let dc = self.meta(six, lock.seq).map_or(1, |m| m.delivery_count);
        self.dead_letter_move(now, six, lock.seq, dc, reason, description, non_empty(properties))?;
        self.pump(now);
        Ok(())
    }

    /// Defers a locked message: it stays, receivable only by sequence number
    /// ([`Engine::receive_deferred`]). The delivery count does not change.
    pub(crate) fn defer(
        &mut self,
        now: Timestamp,
        token: LockToken,
        properties: Properties,
    ) -> Result<(), Error> {
        self.tick(now);
        self.check_tokens(&[token])?;
        let lock = self.remove_lock(&token).ok_or(Error::MessageLockLost)?;
        let Some(meta) = self.meta(lock.six, lock.seq) else { return Ok(()) };
        let dc = meta.delivery_count;
        let key = self.key(lock.six)?;
        self.emit(Record::Updated {
            store: key,
            sequence: lock.seq,
            delivery_count: dc,
            state: PlacedState::Deferred,
            properties: non_empty(properties),
        })?;
        self.expire_if_due(now, lock.six, lock.seq)?;
        self.pump(now);
        Ok(())
    }

    /// Unlocks messages without counting a delivery (they never reached a handler), all or
    /// nothing.
    pub(crate) fn release(&mut self, now: Timestamp, tokens: &[LockToken]) -> Result<(), Error> {
        self.tick(now);
        self.check_tokens(tokens)?;
        for t in tokens {
            let Some(lock) = self.remove_lock(t) else { continue };
            self.unlock_uncounted(now, lock.six, lock.seq)?;
        }
        self.pump(now);
        Ok(())
    }

    /// Renews locks, all or nothing; returns each new locked-until. A session message's lock
    /// is its session's: renewing it renews the session lock.
    pub(crate) fn renew_lock(
        &mut self,
        now: Timestamp,
        tokens: &[LockToken],
    ) -> Result<Vec<Timestamp>, Error> {
        self.tick(now);
        self.check_tokens(tokens)?;
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            let Some(lock) = self.locks.get(t).copied() else { continue };
            let until = match lock.session {
                Some(sl) => self.renew_session_lock(now, sl)?,
                None => {
                    let d = self.ent(lock.six.slot()).map_or(Duration::ZERO, Entity::lock_duration);
                    let until = now + d;
                    if let Some(l) = self.locks.get_mut(t) {
                        l.until = until;
                    }
                    if let Some(key) = lock.timer {
                        let locks = &self.locks;
                        self.lock_timers.remove(key, lock.until, *t, |k, u| {
                            locks.get(k).is_some_and(|l| l.until == u)
                        });
                    }
                    let key = self.lock_timers.insert(until, *t, d);
                    if let Some(l) = self.locks.get_mut(t) {
                        l.timer = Some(key);
                    }
                    until
                }
            };
            out.push(until);
        }
        Ok(out)
    }

    /// Moves dead-lettered messages back to their queue or subscription, all or nothing: each
    /// gets a new sequence number, its dead-letter fields cleared and its delivery count reset.
    pub(crate) fn resubmit(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<Vec<SequenceNumber>, Error> {
        self.tick(now);
        if !entity.dead_letter {
            return Err(Error::InvalidOperation(
                "only messages in a dead-letter queue can be resubmitted".to_owned(),
            ));
        }
        let six = self.receive_store(entity)?;
        let mut router = Router::new(now);
        let mut moves = Vec::with_capacity(sequence_numbers.len());
        for s in sequence_numbers {
            let seq = s.get();
            let meta = match self.meta(six, seq) {
                Some(m) if matches!(m.state, St::Available | St::Deferred) => m,
                _ => return Err(Error::MessageNotFound(seq)),
            };
            if moves.iter().any(|(q, _, _)| *q == seq) {
                return Err(Error::MessageNotFound(seq));
            }
            let mut extra = meta.extra.as_deref().cloned().unwrap_or_default();
            extra.dead_letter_reason = None;
            extra.dead_letter_description = None;
            extra.dead_letter_source = None;
            let message = self.aux.bodies.message(meta.body);
            let ttl =
                extra.time_to_live.take().or_else(|| message.as_ref().and_then(|m| m.time_to_live));
            let item = Item {
                ttl,
                message,
                has_session: meta.session != NO_SESSION,
                delivery_count: 1,
                extra: (!extra.is_empty()).then_some(extra),
                enqueued: None,
            };
            let mut to = Vec::new();
            let new_seq = self.route_resubmit(&mut router, six.slot(), &item, &mut to)?;
            moves.push((seq, new_seq, to));
        }
        let key = self.key(six)?;
        let mut out = Vec::with_capacity(moves.len());
        for (seq, new_seq, to) in moves {
            self.emit(Record::Moved { from: key, sequence: seq, to })?;
            out.push(SequenceNumber::new(new_seq));
        }
        self.pump(now);
        Ok(out)
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
