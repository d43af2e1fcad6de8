//! Time: the engine's next deadline and the tick that processes what is due (scheduled
//! messages activated, expired locks and session locks, expired messages, the purge of
//! duplicate-detection history), and the deadlines of peek-locks.
//!
//! Every peek-lock delivery adds a deadline and nearly every one is settled long before it, so
//! adding and removing must be cheap. Locks of one lock duration are taken in time order, so
//! their deadlines arrive in order too: each duration gets a FIFO queue, where adding is a push
//! at the back and removing only marks the entry stale (the lock table says which entries are
//! live). Stale entries leave from the front as soon as they reach it, and a queue holding many
//! more stale entries than live ones is compacted, so memory stays proportional to the live
//! locks. A deadline that would break a queue's order (the clock moved back) goes to an ordered
//! set instead.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use twice::{LockToken, Timestamp};

use super::route::{Item, Router};
use super::state::{Entity, NO_SESSION, St, StoreIx};
use super::{Engine, PlacedState, Placement, Record};
use crate::dead_letter_reasons;
use crate::error::Error;

/// Where a deadline was filed, to remove it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TimerKey(u32);

/// The key of a deadline filed in the ordered set.
const UNORDERED: TimerKey = TimerKey(u32::MAX);

/// Compaction runs when a queue holds more than twice its live entries plus this many.
const COMPACT_SLACK: usize = 1024;

#[derive(Debug)]
struct Queue {
    duration: Duration,
    entries: VecDeque<(Timestamp, LockToken)>,
    live: usize,
}

/// Lock deadlines. See the module documentation.
#[derive(Debug, Default)]
pub(super) struct LockTimers {
    queues: Vec<Queue>,
    unordered: BTreeSet<(Timestamp, LockToken)>,
}

impl LockTimers {
    /// Files the deadline `until` of the lock `token`, taken for `duration`.
    pub(super) fn insert(
        &mut self,
        until: Timestamp,
        token: LockToken,
        duration: Duration,
    ) -> TimerKey {
        let i = match self.queues.iter().position(|q| q.duration == duration) {
            Some(i) => i,
            None => {
                self.queues.push(Queue { duration, entries: VecDeque::new(), live: 0 });
                self.queues.len() - 1
            }
        };
        match (self.queues.get_mut(i), u32::try_from(i)) {
            (Some(q), Ok(key)) if q.entries.back().is_none_or(|&(last, _)| last <= until) => {
                q.entries.push_back((until, token));
                q.live += 1;
                TimerKey(key)
            }
            _ => {
                self.unordered.insert((until, token));
                UNORDERED
            }
        }
    }

    /// Removes the deadline filed under `key`. `is_live(token, until)` tells whether an entry
    /// still belongs to a lock; the caller has already made it false for this one (removed
    /// the lock, or moved its deadline).
    pub(super) fn remove(
        &mut self,
        key: TimerKey,
        until: Timestamp,
        token: LockToken,
        is_live: impl Fn(&LockToken, Timestamp) -> bool,
    ) {
        if key == UNORDERED {
            self.unordered.remove(&(until, token));
            return;
        }
        let Some(q) = self.queues.get_mut(key.0 as usize) else { return };
        q.live = q.live.saturating_sub(1);
        while let Some(&(t, k)) = q.entries.front() {
            if is_live(&k, t) {
                break;
            }
            q.entries.pop_front();
        }
        if q.entries.len() > 2 * q.live + COMPACT_SLACK {
            q.entries.retain(|&(t, k)| is_live(&k, t));
            q.entries.shrink_to(2 * q.entries.len() + COMPACT_SLACK);
        }
    }

    /// The earliest deadline filed (possibly of an entry that is no longer live).
    pub(super) fn first(&self) -> Option<Timestamp> {
        let queued = self.queues.iter().filter_map(|q| q.entries.front().map(|e| e.0)).min();
        let unordered = self.unordered.first().map(|e| e.0);
        match (queued, unordered) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes the earliest live deadline at or before `now`, dropping stale entries on the way.
    /// The lock it names is no longer filed here.
    pub(super) fn pop_due(
        &mut self,
        now: Timestamp,
        is_live: impl Fn(&LockToken, Timestamp) -> bool,
    ) -> Option<(Timestamp, LockToken)> {
        loop {
            let queued = self
                .queues
                .iter()
                .enumerate()
                .filter_map(|(i, q)| q.entries.front().map(|e| (e.0, i)))
                .min();
            let unordered = self.unordered.first().map(|e| e.0);
            match (queued, unordered) {
                (Some((t, i)), u) if t <= now && u.is_none_or(|u| t <= u) => {
                    let q = self.queues.get_mut(i)?;
                    let (t, token) = q.entries.pop_front()?;
                    if is_live(&token, t) {
                        q.live = q.live.saturating_sub(1);
                        return Some((t, token));
                    }
                }
                (_, Some(u)) if u <= now => return self.unordered.pop_first(),
                _ => return None,
            }
        }
    }
}

impl Engine {
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
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn token(n: u128) -> LockToken {
        LockToken::from_uuid(uuid::Uuid::from_u128(n))
    }

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn deadlines_pop_in_order_across_durations_and_skip_removed_locks() {
        let mut timers = LockTimers::default();
        let mut live: HashMap<LockToken, (Timestamp, TimerKey)> = HashMap::new();
        let d = |s| Duration::from_secs(s);
        for (n, until, dur) in [(1, 60, 60), (2, 30, 30), (3, 61, 60), (4, 31, 30), (5, 10, 60)] {
            let key = timers.insert(at(until), token(n), d(dur));
            live.insert(token(n), (at(until), key));
        }
        // Token 5 broke the 60 s queue's order: it is filed apart, and still comes first.
        assert_eq!(live[&token(5)].1, UNORDERED);
        assert_eq!(timers.first(), Some(at(10)));
        let (until, key) = live.remove(&token(2)).unwrap();
        timers.remove(key, until, token(2), |k, t| live.get(k).is_some_and(|l| l.0 == t));
        let mut order = Vec::new();
        while let Some((t, k)) =
            timers.pop_due(at(100), |k, t| live.get(k).is_some_and(|l| l.0 == t))
        {
            live.remove(&k);
            order.push((t.as_millis(), k));
        }
        assert_eq!(order, vec![(10, token(5)), (31, token(4)), (60, token(1)), (61, token(3))]);
        assert_eq!(timers.first(), None);
    }

    #[test]
    fn removed_deadlines_do_not_pile_up() {
        let mut timers = LockTimers::default();
        let mut live: HashMap<LockToken, (Timestamp, TimerKey)> = HashMap::new();
        // One long-lived lock at the front, then many short-lived ones behind it.
        let key = timers.insert(at(0), token(0), Duration::from_secs(60));
        live.insert(token(0), (at(0), key));
        for n in 1..100_000u128 {
            let until = at(i64::try_from(n).unwrap());
            let key = timers.insert(until, token(n), Duration::from_secs(60));
            timers.remove(key, until, token(n), |k, t| live.get(k).is_some_and(|l| l.0 == t));
        }
        let held: usize = timers.queues.iter().map(|q| q.entries.len()).sum();
        assert!(held <= 2 + COMPACT_SLACK, "{held} entries held for one live lock");
        assert_eq!(
            timers.pop_due(at(1_000_000), |k, t| live.get(k).is_some_and(|l| l.0 == t)),
            Some((at(0), token(0)))
        );
    }
}
