//! A turn of the runtime: the replies of a batch of commands, held until their commit is
//! durable, and the long polls parked meanwhile.

use std::sync::Arc;

use twice::Timestamp;

use super::Runtime;
use super::reply::{Delivered, Done, MAX_FREED, Reply, plain};
use crate::engine::{AcceptedSession, Delivery, ReceiveMode, WaiterId};
use crate::error::Error;
use crate::storage::{Log, StorageError};

/// A parked long poll.
#[derive(Debug)]
pub(super) enum Parked {
    Receive { reply: Reply<Vec<Delivered>>, mode: ReceiveMode, deadline: Timestamp },
    Accept { reply: Reply<Option<AcceptedSession>>, deadline: Timestamp },
}

impl Parked {
    fn deadline(&self) -> Timestamp {
        match self {
            Parked::Receive { deadline, .. } | Parked::Accept { deadline, .. } => *deadline,
        }
    }
}

impl Runtime {
    pub(super) fn on_durable(&mut self, r: Result<(), StorageError>) {
        let durable_seq = match (r, self.durable.as_ref()) {
            (Ok(()), Some(d)) => d.current(),
            (Err(e), _) => Err(e),
            (Ok(()), None) => Ok(u64::MAX),
        };
        match durable_seq {
            Ok(seq) => {
                while self.inflight.front().is_some_and(|(s, _)| *s <= seq) {
                    if let Some((_, replies)) = self.inflight.pop_front() {
                        self.release_replies(replies);
                    }
                }
                // Undeliverable replies may have released locks: write that down too.
                let now = self.clock.now();
                self.end_turn(now);
            }
            Err(e) => self.fail(e),
        }
    }

    /// Stops the broker after a failed write: what reached the disk is unknown, so nothing
    /// waiting is acknowledged and nothing new is accepted.
    pub(super) fn fail(&mut self, e: StorageError) {
        let io = match e {
            StorageError::Failed(io) => io,
            other => Arc::new(std::io::Error::other(other.to_string())),
        };
        tracing::error!(error = %io, "the broker stops: a log write failed");
        self.failure.set(&io);
        self.failed = Some(io.clone());
        for (_, replies) in std::mem::take(&mut self.inflight) {
            for d in replies {
                let err = || Error::Io(std::io::Error::new(io.kind(), io.to_string()));
                match d {
                    Done::Plain(p) => p.fail(err()),
                    Done::Deliveries { reply, .. } => {
                        let _ = reply.send(Err(err()));
                    }
                    Done::Session { reply, .. } => {
                        let _ = reply.send(Err(err()));
                    }
                }
            }
        }
        self.rx.close();
    }

    /// Sends replies whose commit is durable; undoes what their callers can no longer see.
    fn release_replies(&mut self, replies: Vec<Done>) {
        let mut unlock = Vec::new();
        let mut sessions = Vec::new();
        for d in replies {
            match d {
                Done::Plain(p) => p.send(&mut self.freed),
                Done::Deliveries { reply, result, .. } => {
                    if let Err(Ok(msgs)) = reply.send_freeing(result, &mut self.freed) {
                        unlock.extend(msgs.iter().filter_map(Delivered::lock_token));
                    }
                }
                Done::Session { reply, result } => {
                    if let Err(Ok(Some(s))) = reply.send_freeing(result, &mut self.freed) {
                        sessions.push(s.lock);
                    }
                }
            }
        }
        if unlock.is_empty() && sessions.is_empty() {
            return;
        }
        let now = self.clock.now();
        for t in unlock {
            // The lock may have expired or been settled since: nothing to undo then.
            let _ = self.engine.release(now, &[t]);
        }
        for s in sessions {
            let _ = self.engine.release_session(now, s);
        }
    }

    /// After a batch of engine calls: serve woken waiters, persist, and queue the replies.
    pub(super) fn end_turn(&mut self, now: Timestamp) {
        self.engine.serve_waiters(now);
        self.serve_ready(now);
        let freed = self.engine.take_freed();
        if self.freed.is_empty() {
            self.freed = freed;
        } else if self.freed.len() < MAX_FREED {
            self.freed.extend(freed);
        }
        if let Err(e) = self.persist() {
            let storage = match e {
                Error::Io(io) => StorageError::Failed(Arc::new(io)),
                other => StorageError::Failed(Arc::new(std::io::Error::other(other.to_string()))),
            };
            let turn = self.take_turn();
            self.inflight.push_back((u64::MAX, turn));
            self.fail(storage);
            return;
        }
        let Some(seq) = self.log.as_ref().map(Log::last_commit) else {
            let turn = self.take_turn();
            self.release_replies(turn);
            return;
        };
        // What the next calls change goes to the next commit.
        self.engine.set_turn(seq + 1);
        let mut turn = self.take_turn();
        if turn.is_empty() {
            return;
        }
        let done = self.durable.as_ref().and_then(|d| d.current().ok()).unwrap_or(0);
        if self.relaxed {
            // Deliveries that wait only for what their messages need, not for their locks.
            let mut now_ready = Vec::new();
            let mut rest = Vec::with_capacity(turn.len());
            for d in turn {
                match d {
                    Done::Deliveries { after: Some(n), .. } if n <= done => now_ready.push(d),
                    Done::Deliveries { after: Some(n), .. } => self.wait_for(n, d),
                    d => rest.push(d),
                }
            }
            if !now_ready.is_empty() {
                self.release_replies(now_ready);
            }
            turn = rest;
            if turn.is_empty() {
                return;
            }
        }
        // A turn that wrote nothing still waits for the commits before it: its replies may
        // show what those commits carry.
        if seq <= done && self.inflight.is_empty() {
            self.release_replies(turn);
        } else {
            match self.inflight.back_mut() {
                Some((s, replies)) if *s == seq => replies.extend(turn),
                _ => self.inflight.push_back((seq, turn)),
            }
        }
    }

    /// The replies of the turn that ends, leaving room for as many in the next.
    fn take_turn(&mut self) -> Vec<Done> {
        let room = self.turn.len().min(self.max_commands_per_turn);
        std::mem::replace(&mut self.turn, Vec::with_capacity(room))
    }

    /// Holds a reply until commit `seq` is durable.
    fn wait_for(&mut self, seq: u64, d: Done) {
        let i = self.inflight.partition_point(|(s, _)| *s < seq);
        match self.inflight.get_mut(i) {
            Some((s, replies)) if *s == seq => replies.push(d),
            _ => self.inflight.insert(i, (seq, vec![d])),
        }
    }

    /// With relaxed delivery counts, the commit a peek-lock delivery of `deliveries` has to
    /// wait for: the newest one that changed one of its messages before it was locked. `None`
    /// when the reply waits for its turn's commit like any other (the default, and
    /// receive-and-delete, whose removal must be durable first).
    pub(super) fn relaxed_after(&self, mode: ReceiveMode, deliveries: &[Delivery]) -> Option<u64> {
        if !self.relaxed || mode != ReceiveMode::PeekLock {
            return None;
        }
        let next = self.log.as_ref()?.last_commit() + 1;
        // The stamp is the commit number modulo 2^16: the newest commit with that remainder
        // is the one, or (for a stamp older than 2^16 commits) a later one, which only waits
        // longer than needed.
        let commit = |stamp: u16| next - (next.wrapping_sub(u64::from(stamp)) & 0xffff);
        Some(deliveries.iter().map(|d| commit(d.changed)).max().unwrap_or(0))
    }

    /// Answers parked waiters the engine served, and long polls whose time is up.
    pub(super) fn serve_ready(&mut self, now: Timestamp) {
        for (w, deliveries) in self.engine.take_ready() {
            let Some(p) = self.parked.remove(&w) else { continue };
            self.parked_deadlines.remove(&(p.deadline(), w));
            if let Parked::Receive { reply, mode, .. } = p {
                let after = self.relaxed_after(mode, &deliveries);
                let result = self.materialize(deliveries);
                self.turn.push(Done::Deliveries { reply, result, after });
            }
        }
        for (w, accepted) in self.engine.take_ready_sessions() {
            let Some(p) = self.parked.remove(&w) else { continue };
            self.parked_deadlines.remove(&(p.deadline(), w));
            if let Parked::Accept { reply, .. } = p {
                self.turn.push(Done::Session { reply, result: Ok(accepted) });
            }
        }
        self.expire_parked(now);
    }

    fn expire_parked(&mut self, now: Timestamp) {
        while let Some(&(t, w)) = self.parked_deadlines.first() {
            if t > now {
                break;
            }
            self.parked_deadlines.pop_first();
            self.engine.cancel_waiter(w);
            match self.parked.remove(&w) {
                Some(Parked::Receive { reply, .. }) => {
                    self.turn.push(plain(reply, Ok(Vec::new())));
                }
                Some(Parked::Accept { reply, .. }) => {
                    self.turn.push(plain(reply, Ok(None)));
                }
                None => {}
            }
        }
    }

    pub(super) fn park(&mut self, w: WaiterId, p: Parked) {
        self.parked_deadlines.insert((p.deadline(), w));
        self.parked.insert(w, p);
    }

    pub(super) fn new_waiter(&mut self) -> WaiterId {
        let w = WaiterId(self.next_waiter);
        self.next_waiter += 1;
        w
    }
}
