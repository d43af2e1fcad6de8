//! The seeded model test: random operations by several receivers against the engine and a
//! reference model written from the rules (not from the engine), compared after every step.
//!
//! Steps: send (batches, duplicates, time to live, scheduled), receive (peek-lock and
//! receive-and-delete, main and dead-letter queues), complete, abandon, dead-letter, defer,
//! release, renew, receive deferred, cancel scheduled, resubmit, session accept (named and
//! next) / receive / renew / release / state, time advance (lock, session lock and TTL
//! expiry), log rotation with checkpoints, compaction of the oldest segment, and restart
//! (replay of the remaining log into a fresh engine, then recovery).
//!
//! After every step: every store's content (peeked) equals the model's, message by message
//! with delivery count and state; the runtime counts match; delivery counts never go down.
//! Deliveries are checked against the model's prediction, which is how "no message held by two
//! live locks", "a session is never held twice" and "FIFO within a session" are checked: the
//! engine may only deliver what the model says is available, in sequence order.
//!
//! Even seeds run the engine with the options of the broker's runtime (a body cache, deferred
//! serving of waiters, freed messages collected), odd seeds with the defaults.
//!
//! `TWICE_MODEL_SEEDS=n` runs n seeds (default 200), `TWICE_MODEL_STEPS=n` makes each seed
//! run n steps (default 1000, which keeps the default run near 10 s in a debug build on two
//! cores), and `TWICE_MODEL_SEED=s` runs one seed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use twice::{LockToken, Message, MessageState, Properties, SequenceNumber, SessionId, Timestamp};

use super::super::state::{Meta, St};
use crate::config::{EntityDefinition, QueueProperties};
use crate::engine::{
    Body, Delivery, Engine, EngineOptions, EntityRef, Location, ReceiveMode, Record, SendOutcome,
    SessionLock,
};
use crate::error::Error;

mod sim;

use sim::Sim;

const LOCK: Duration = Duration::from_secs(10);
const MAX_DC: u32 = 3;
const DEDUP: Duration = Duration::from_secs(30);
const S_TTL: Duration = Duration::from_secs(40);
const RECEIVERS: usize = 3;
const SESSIONS: [&str; 3] = ["a", "b", "c"];
/// Steps per seed by default; `TWICE_MODEL_STEPS` changes it.
const STEPS: usize = 1000;

/// Half the seeds run with the options the broker's runtime uses: a small cache of stored
/// bodies (so that bodies are often evicted), deferred serving of waiters, and freed messages
/// collected.
fn engine_options(seed: u64, engine_seed: u64) -> EngineOptions {
    let runtime = seed.is_multiple_of(2);
    EngineOptions {
        seed: engine_seed,
        body_cache_bytes: if runtime { 2048 } else { 0 },
        deferred_serving: runtime,
        collect_freed: runtime,
        ..EngineOptions::default()
    }
}

#[test]
fn model() {
    let seeds: Vec<u64> = match std::env::var("TWICE_MODEL_SEED") {
        Ok(s) => vec![s.parse().expect("TWICE_MODEL_SEED is a number")],
        Err(_) => {
            let n =
                std::env::var("TWICE_MODEL_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
            (1..=n).collect()
        }
    };
    let steps =
        std::env::var("TWICE_MODEL_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(STEPS);
    // Seeds are independent: spread them over the cores.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 4);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (seeds, failed) = (&seeds, &failed);
            scope.spawn(move || {
                for &seed in seeds.iter().skip(t).step_by(threads) {
                    if failed.lock().is_ok_and(|f| f.is_some()) {
                        return;
                    }
                    if let Err(panic) = std::panic::catch_unwind(|| Sim::new(seed).run(steps)) {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert((seed, panic));
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some((seed, panic)) = failed.into_inner().ok().flatten() {
        eprintln!("model test failed with seed {seed}: rerun with TWICE_MODEL_SEED={seed}");
        std::panic::resume_unwind(panic);
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() { None } else { items.get(self.below(items.len())) }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ent {
    Q,
    S,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Active,
    Locked { token: LockToken, until: Timestamp },
    Deferred,
    DeferredLocked { token: LockToken, until: Timestamp },
    Scheduled,
    Gone,
}

#[derive(Clone, Debug)]
struct MMsg {
    id: String,
    ent: Ent,
    dlq: bool,
    seq: i64,
    session: Option<String>,
    state: MState,
    dc: u32,
    ttl: Option<Duration>,
    expires: Option<Timestamp>,
    /// When a scheduled message becomes active.
    at: Option<Timestamp>,
    /// The highest delivery count the engine showed for it.
    seen_dc: u32,
}

impl MMsg {
    fn token(&self) -> Option<LockToken> {
        match self.state {
            MState::Locked { token, .. } | MState::DeferredLocked { token, .. } => Some(token),
            _ => None,
        }
    }

    fn expired(&self, now: Timestamp) -> bool {
        self.expires.is_some_and(|e| e <= now)
    }
}

#[derive(Clone, Copy, Debug)]
struct Holder {
    lock: SessionLock,
    until: Timestamp,
}

/// The reference model.
#[derive(Default)]
struct Model {
    msgs: Vec<MMsg>,
    next_seq: [i64; 2],
    dedup: HashMap<String, Timestamp>,
    holders: HashMap<String, Holder>,
    states: HashMap<String, Bytes>,
}

impl Model {
    fn idx(e: Ent) -> usize {
        match e {
            Ent::Q => 0,
            Ent::S => 1,
        }
    }

    fn alloc(&mut self, e: Ent) -> i64 {
        let n = &mut self.next_seq[Self::idx(e)];
        *n += 1;
        *n
    }

    fn find(&self, e: Ent, dlq: bool, seq: i64) -> Option<usize> {
        self.msgs
            .iter()
            .position(|m| m.ent == e && m.dlq == dlq && m.seq == seq && m.state != MState::Gone)
    }

    fn by_token(&self, t: LockToken) -> Option<usize> {
        self.msgs.iter().position(|m| m.token() == Some(t))
    }

    /// The message ends a delivery without settling: count, dead-letter past the maximum,
    /// expire if its time passed.
    fn unlock_counted(&mut self, i: usize, now: Timestamp) {
        let m = &mut self.msgs[i];
        m.dc += 1;
        let deferred = matches!(m.state, MState::DeferredLocked { .. });
        if !m.dlq && m.dc > MAX_DC {
            m.state = MState::Active;
            self.dead_letter(i);
            return;
        }
        m.state = if deferred { MState::Deferred } else { MState::Active };
        self.expire_if_due(i, now);
    }

    /// A dead-lettered message is active in its dead-letter queue, which applies no TTL.
    fn dead_letter(&mut self, i: usize) {
        let m = &mut self.msgs[i];
        m.dlq = true;
        m.expires = None;
        m.state = MState::Active;
    }

    /// An available message past its time to live expires; a deferred one waits for a
    /// receive to try it ([`Model::expire`]).
    fn expire_if_due(&mut self, i: usize, now: Timestamp) {
        let m = &self.msgs[i];
        if m.dlq || !m.expired(now) || m.state != MState::Active {
            return;
        }
        self.expire(i);
    }

    fn expire(&mut self, i: usize) {
        let m = &mut self.msgs[i];
        match m.ent {
            // Queue q dead-letters expired messages; queue s drops them.
            Ent::Q => self.dead_letter(i),
            Ent::S => m.state = MState::Gone,
        }
    }

    /// A session lock that expired (`counted`) or a session its receiver let go: its locked
    /// messages are available again, with a delivery counted only for an expiry.
    fn lose_session(&mut self, session: &str, now: Timestamp, counted: bool) {
        self.holders.remove(session);
        let locked: Vec<usize> = (0..self.msgs.len())
            .filter(|&i| {
                let m = &self.msgs[i];
                m.ent == Ent::S
                    && !m.dlq
                    && m.session.as_deref() == Some(session)
                    && m.token().is_some()
            })
            .collect();
        for i in locked {
            if counted {
                self.unlock_counted(i, now);
            } else {
                let m = &mut self.msgs[i];
                let deferred = matches!(m.state, MState::DeferredLocked { .. });
                m.state = if deferred { MState::Deferred } else { MState::Active };
                self.expire_if_due(i, now);
            }
        }
    }

    fn advance(&mut self, now: Timestamp) {
        // Scheduled messages whose time came become active first, as in the engine, in the
        // order of their time, each with a new sequence number.
        let mut due: Vec<usize> = (0..self.msgs.len())
            .filter(|&i| {
                let m = &self.msgs[i];
                m.state == MState::Scheduled && m.at.is_some_and(|at| at <= now)
            })
            .collect();
        due.sort_by_key(|&i| (self.msgs[i].at, self.msgs[i].seq));
        for i in due {
            let seq = self.alloc(self.msgs[i].ent);
            let m = &mut self.msgs[i];
            m.state = MState::Active;
            m.seq = seq;
        }
        for i in 0..self.msgs.len() {
            if let MState::Locked { until, .. } | MState::DeferredLocked { until, .. } =
                self.msgs[i].state
            {
                let session_msg = self.msgs[i].ent == Ent::S && !self.msgs[i].dlq;
                if !session_msg && until <= now {
                    self.unlock_counted(i, now);
                }
            }
        }
        let lost: Vec<String> =
            self.holders.iter().filter(|(_, h)| h.until <= now).map(|(s, _)| s.clone()).collect();
        for s in lost {
            self.lose_session(&s, now, true);
        }
        for i in 0..self.msgs.len() {
            self.expire_if_due(i, now);
        }
        self.dedup.retain(|_, end| *end > now);
    }

    fn restart(&mut self, now: Timestamp) {
        self.holders.clear();
        for i in 0..self.msgs.len() {
            if self.msgs[i].token().is_some() {
                self.unlock_counted(i, now);
            }
        }
    }

    /// Available messages of a store (of a session), in order.
    fn available(&self, e: Ent, dlq: bool, session: Option<&str>, now: Timestamp) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.msgs.len())
            .filter(|&i| {
                let m = &self.msgs[i];
                m.ent == e
                    && m.dlq == dlq
                    && m.state == MState::Active
                    && !m.expired(now)
                    && (session.is_none() || m.session.as_deref() == session)
            })
            .collect();
        v.sort_by_key(|&i| self.msgs[i].seq);
        v
    }
}
