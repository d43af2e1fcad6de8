//! The task that owns the engine and the log.
//!
//! Every [`crate::Broker`] handle sends [`Command`]s over one channel to this task, which
//! serves them in turns:
//!
//! 1. take up to `max_commands_per_turn` queued commands and apply each to the [`Engine`];
//! 2. encode the engine's records, append them to the log, and commit once;
//! 3. hold the turn's replies until that commit is durable, then send them.
//!
//! While the writer thread syncs turn *k*, this task already applies turn *k + 1*; the replies
//! of *k + 1* wait for their own commit. Commits queued behind a busy writer share its next
//! fsync, so one fsync acknowledges every operation of several turns.
//!
//! Time comes only from the broker's clock: the task sleeps until the engine's next deadline
//! (a lock, a scheduled message, a time to live, a duplicate-detection window) or the next
//! long-poll timeout, whichever is first, and re-computes it after every turn.
//!
//! A reply that cannot be delivered because its caller went away is not lost work: messages
//! it had locked are released without counting a delivery, and a session it had locked is
//! released.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use twice::{
    EntityInfo, LockToken, Message, Properties, ReceivedMessage, SequenceNumber, SessionId,
    SharedClock, Timestamp,
};

use crate::config::{EntityDefinition, Rule, SubscriptionProperties};
use crate::engine::{
    self, AcceptedSession, Body, Counters, Delivery, Engine, EntityCounts, ReceiveMode, Record,
    SendOutcome, SessionLock, WaiterId,
};
use crate::error::Error;
use crate::storage::{self, DurableWatch, Log, LogOptions, StorageError};

/// The reply channel of one command.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, Error>>;

/// How a receive waits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wait {
    pub(crate) max: usize,
    pub(crate) max_wait: Duration,
}

/// A change to a subscription that keeps the rest of its definition.
#[derive(Debug)]
pub(crate) enum SubscriptionChange {
    Properties(SubscriptionProperties),
    CreateRule(Rule),
    DeleteRule(String),
}

/// A request to the runtime task.
#[derive(Debug)]
pub(crate) enum Command {
    CreateEntity {
        definition: EntityDefinition,
        reply: Reply<()>,
    },
    UpdateEntity {
        definition: EntityDefinition,
        reply: Reply<()>,
    },
    DeleteEntity {
        path: String,
        reply: Reply<()>,
    },
    GetEntity {
        path: String,
        reply: Reply<EntityDefinition>,
    },
    ListEntities {
        reply: Reply<Vec<EntityDefinition>>,
    },
    ApplyDefinitions {
        definitions: Vec<EntityDefinition>,
        reply: Reply<()>,
    },
    ChangeSubscription {
        topic: String,
        subscription: String,
        change: SubscriptionChange,
        reply: Reply<()>,
    },
    EntityInfo {
        path: String,
        reply: Reply<EntityInfo>,
    },
    Counts {
        path: String,
        reply: Reply<EntityCounts>,
    },
    Counters {
        path: Option<String>,
        reply: Reply<Counters>,
    },
    Storage {
        reply: Reply<StorageStats>,
    },

    Send {
        path: String,
        messages: Vec<Message>,
        reply: Reply<Vec<SendOutcome>>,
    },
    Schedule {
        path: String,
        messages: Vec<Message>,
        at: Timestamp,
        reply: Reply<Vec<SequenceNumber>>,
    },
    CancelScheduled {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
        reply: Reply<()>,
    },
    Receive {
        path: String,
        mode: ReceiveMode,
        wait: Wait,
        session: Option<SessionLock>,
        reply: Reply<Vec<ReceivedMessage>>,
    },
    ReceiveDeferred {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
        mode: ReceiveMode,
        session: Option<SessionLock>,
        reply: Reply<Vec<ReceivedMessage>>,
    },
    Peek {
        path: String,
        from: SequenceNumber,
        max: usize,
        session: Option<SessionId>,
        reply: Reply<Vec<ReceivedMessage>>,
    },
    Complete {
        tokens: Vec<LockToken>,
        reply: Reply<()>,
    },
    Abandon {
        token: LockToken,
        properties: Properties,
        reply: Reply<()>,
    },
    DeadLetter {
        token: LockToken,
        reason: Option<String>,
        description: Option<String>,
        properties: Properties,
        reply: Reply<()>,
    },
    Defer {
        token: LockToken,
        properties: Properties,
        reply: Reply<()>,
    },
    Release {
        tokens: Vec<LockToken>,
        reply: Reply<()>,
    },
    RenewLock {
        tokens: Vec<LockToken>,
        reply: Reply<Vec<Timestamp>>,
    },
    Resubmit {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
        reply: Reply<Vec<SequenceNumber>>,
    },

    AcceptSession {
        path: String,
        session: Option<SessionId>,
        max_wait: Duration,
        reply: Reply<Option<AcceptedSession>>,
    },
    RenewSessionLock {
        lock: SessionLock,
        reply: Reply<Timestamp>,
    },
    ReleaseSession {
        lock: SessionLock,
        reply: Reply<()>,
    },
    GetSessionState {
        lock: SessionLock,
        reply: Reply<Option<Bytes>>,
    },
    SetSessionState {
        lock: SessionLock,
        state: Option<Bytes>,
        reply: Reply<()>,
    },
    ListSessions {
        path: String,
        reply: Reply<Vec<SessionId>>,
    },

    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// Storage figures of a durable broker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StorageStats {
    pub(crate) commits: u64,
    pub(crate) fsyncs: u64,
    pub(crate) segments: u64,
    pub(crate) records: u64,
}

/// How the runtime is set up.
#[derive(Debug)]
pub(crate) struct RuntimeOptions {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) log: LogOptions,
    pub(crate) engine: engine::EngineOptions,
    pub(crate) clock: SharedClock,
    pub(crate) max_commands_per_turn: usize,
    pub(crate) definitions: Vec<EntityDefinition>,
}

/// A reply held until its turn's commit is durable.
#[derive(Debug)]
enum Done {
    /// A reply with nothing to undo if its caller is gone.
    Plain(Box<dyn PlainReply>),
    /// Messages locked for a caller: released if the caller is gone.
    Deliveries { reply: Reply<Vec<ReceivedMessage>>, result: Result<Vec<ReceivedMessage>, Error> },
    /// A session locked for a caller: released if the caller is gone.
    Session {
        reply: Reply<Option<AcceptedSession>>,
        result: Result<Option<AcceptedSession>, Error>,
    },
}

/// A typed reply, boxed so that one queue holds the replies of every command.
trait PlainReply: Send + std::fmt::Debug {
    fn send(self: Box<Self>);
    fn fail(self: Box<Self>, e: Error);
}

#[derive(Debug)]
struct Pending<T>(Reply<T>, Result<T, Error>);

impl<T: Send + std::fmt::Debug + 'static> PlainReply for Pending<T> {
    fn send(self: Box<Self>) {
        // The caller may have gone; what it asked for is done either way.
        let _ = self.0.send(self.1);
    }

    fn fail(self: Box<Self>, e: Error) {
        let _ = self.0.send(Err(e));
    }
}

fn plain<T: Send + std::fmt::Debug + 'static>(reply: Reply<T>, result: Result<T, Error>) -> Done {
    Done::Plain(Box::new(Pending(reply, result)))
}

/// A parked long poll.
#[derive(Debug)]
enum Parked {
    Receive { reply: Reply<Vec<ReceivedMessage>>, deadline: Timestamp },
    Accept { reply: Reply<Option<AcceptedSession>>, deadline: Timestamp },
}

impl Parked {
    fn deadline(&self) -> Timestamp {
        match self {
            Parked::Receive { deadline, .. } | Parked::Accept { deadline, .. } => *deadline,
        }
    }
}

/// What woke the loop.
enum Event {
    Durable(Result<(), StorageError>),
    Commands(usize),
    Timer,
}

/// The state of the runtime task.
#[derive(Debug)]
pub(crate) struct Runtime {
    engine: Engine,
    log: Option<Log>,
    durable: Option<DurableWatch>,
    clock: SharedClock,
    rx: mpsc::Receiver<Command>,
    max_commands_per_turn: usize,
    /// Replies of the current turn.
    turn: Vec<Done>,
    /// Replies waiting for their commit, oldest first.
    inflight: VecDeque<(u64, Vec<Done>)>,
    parked: HashMap<WaiterId, Parked>,
    parked_deadlines: BTreeSet<(Timestamp, WaiterId)>,
    next_waiter: u64,
    /// Whether a segment was started since the last look at compaction.
    rolled: bool,
    /// Set once a write failed: the broker then refuses everything.
    failed: Option<Arc<std::io::Error>>,
    stats: StorageStats,
    shutdown: Vec<oneshot::Sender<()>>,
}

/// Compaction relocates the live messages of the oldest segment once at most this many remain
/// there, so that a few long-lived messages do not keep a whole segment on disk.
const COMPACT_MAX_LIVE: usize = 4096;

impl Runtime {
    /// Opens the log (replaying it into a new engine), applies the configured entities, and
    /// returns the runtime ready to [`Runtime::run`]. Blocking: call it off the async threads.
    pub(crate) fn open(
        options: RuntimeOptions,
        rx: mpsc::Receiver<Command>,
    ) -> Result<Runtime, Error> {
        let mut engine = Engine::new(options.engine);
        let mut stats = StorageStats::default();
        let log = match &options.dir {
            None => None,
            Some(dir) => {
                let (log, replay) = Log::open(dir, options.log).map_err(storage_error)?;
                for rec in replay {
                    let rec = rec.map_err(storage_error)?;
                    let loc = engine_location(rec.location)?;
                    let record: Record = decode(&rec.payload, rec.location)?;
                    engine.replay(record, loc)?;
                    stats.records += 1;
                }
                Some(log)
            }
        };
        let now = options.clock.now();
        engine.finish_recovery(now)?;
        if !options.definitions.is_empty() {
            engine.apply_definitions(now, &options.definitions)?;
        }
        let durable = log.as_ref().map(Log::durable);
        let mut rt = Runtime {
            engine,
            log,
            durable,
            clock: options.clock,
            rx,
            max_commands_per_turn: options.max_commands_per_turn.max(1),
            turn: Vec::new(),
            inflight: VecDeque::new(),
            parked: HashMap::new(),
            parked_deadlines: BTreeSet::new(),
            next_waiter: 1,
            rolled: false,
            failed: None,
            stats,
            shutdown: Vec::new(),
        };
        // What recovery changed (locks that were held at the crash) is written before anything
        // else, and synchronously: the first turn then starts from a durable state.
        rt.persist()?;
        if let Some(log) = rt.log.as_mut() {
            log.flush_blocking().map_err(storage_error)?;
        }
        rt.inflight.clear();
        Ok(rt)
    }

    /// Serves commands until every handle is dropped or a shutdown is asked for.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: it is spawned as its own task and runs to the end.
    pub(crate) async fn run(mut self) {
        let mut buf = Vec::with_capacity(self.max_commands_per_turn);
        let mut open = true;
        // The timer is re-armed only when the next deadline moves earlier: a timer that fires
        // early costs one empty tick, while re-arming on every turn would cost a timer
        // registration per turn.
        let clock = self.clock.clone();
        let mut timer: Option<Timer<'_>> = None;
        while open || !self.inflight.is_empty() {
            if let Some(deadline) = self.next_deadline() {
                if timer.as_ref().is_none_or(|(armed, _)| deadline < *armed) {
                    timer = Some((deadline, Box::pin(clock.sleep_until(deadline))));
                }
            }
            let durable_target = self.inflight.front().map(|(seq, _)| *seq);
            let event = tokio::select! {
                biased;
                r = wait_durable(self.durable.as_mut(), durable_target) => Event::Durable(r),
                n = self.rx.recv_many(&mut buf, self.max_commands_per_turn), if open => Event::Commands(n),
                () = fire(&mut timer), if timer.is_some() => Event::Timer,
            };
            match event {
                Event::Durable(r) => self.on_durable(r),
                Event::Commands(0) => open = false,
                Event::Commands(_) => {
                    let now = self.clock.now();
                    for cmd in buf.drain(..) {
                        if let Command::Shutdown { reply } = cmd {
                            self.shutdown.push(reply);
                            open = false;
                            continue;
                        }
                        self.handle(now, cmd);
                    }
                    self.end_turn(now);
                }
                Event::Timer => {
                    let now = self.clock.now();
                    self.engine.tick(now);
                    self.expire_parked(now);
                    self.end_turn(now);
                }
            }
        }
        // No more commands: fail parked polls, make everything durable, stop the writer.
        self.rx.close();
        for (_, p) in self.parked.drain() {
            match p {
                Parked::Receive { reply, .. } => {
                    let _ = reply.send(Err(Error::Closed));
                }
                Parked::Accept { reply, .. } => {
                    let _ = reply.send(Err(Error::Closed));
                }
            }
        }
        if let Some(log) = self.log.take() {
            // Blocking for one fsync at most: the last commit was already waited for above.
            if let Err(e) = log.close() {
                tracing::error!(error = %e, "closing the log failed");
            }
        }
        for s in self.shutdown.drain(..) {
            let _ = s.send(());
        }
    }

    /// The earliest engine deadline or long-poll timeout.
    fn next_deadline(&self) -> Option<Timestamp> {
        let parked = self.parked_deadlines.first().map(|(t, _)| *t);
        match (self.engine.next_deadline(), parked) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn on_durable(&mut self, r: Result<(), StorageError>) {
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
    fn fail(&mut self, e: StorageError) {
        let io = match e {
            StorageError::Failed(io) => io,
            other => Arc::new(std::io::Error::other(other.to_string())),
        };
        tracing::error!(error = %io, "the broker stops: a log write failed");
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
                Done::Plain(p) => p.send(),
                Done::Deliveries { reply, result } => {
                    if let Err(Ok(msgs)) = reply.send(result) {
                        unlock.extend(msgs.iter().filter_map(|m| m.lock_token));
                    }
                }
                Done::Session { reply, result } => {
                    if let Err(Ok(Some(s))) = reply.send(result) {
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
    fn end_turn(&mut self, now: Timestamp) {
        self.serve_ready(now);
        if let Err(e) = self.persist() {
            let storage = match e {
                Error::Io(io) => StorageError::Failed(Arc::new(io)),
                other => StorageError::Failed(Arc::new(std::io::Error::other(other.to_string()))),
            };
            let turn = std::mem::take(&mut self.turn);
            self.inflight.push_back((u64::MAX, turn));
            self.fail(storage);
            return;
        }
        let turn = std::mem::take(&mut self.turn);
        if turn.is_empty() {
            return;
        }
        match self.log.as_mut() {
            None => self.release_replies(turn),
            Some(log) => {
                // A turn that wrote nothing still waits for the commits before it: its replies
                // may show what those commits carry.
                let seq = log.last_commit();
                let done = self.durable.as_ref().and_then(|d| d.current().ok()).unwrap_or(0);
                if seq <= done && self.inflight.is_empty() {
                    self.release_replies(turn);
                } else {
                    match self.inflight.back_mut() {
                        Some((s, replies)) if *s == seq => replies.extend(turn),
                        _ => self.inflight.push_back((seq, turn)),
                    }
                }
            }
        }
    }

    /// Appends the engine's records, starts a new segment (with a checkpoint) when the active
    /// one is full, compacts, and commits once.
    fn persist(&mut self) -> Result<(), Error> {
        let records = self.engine.take_records();
        let Some(log) = self.log.as_mut() else { return Ok(()) };
        if records.is_empty() {
            return Ok(());
        }
        append_records(&mut self.engine, log, &records)?;
        self.stats.records += records.len() as u64;
        if log.should_roll() {
            // The checkpoint restates the state after every record so far, so replaying from
            // the new segment's start (once older ones are gone) rebuilds the same state.
            log.roll();
            let checkpoint = self.engine.checkpoint_records();
            append_records(&mut self.engine, log, &checkpoint)?;
            self.stats.records += checkpoint.len() as u64;
            self.rolled = true;
        }
        self.compact()?;
        if let Some(log) = self.log.as_mut() {
            let before = log.last_commit();
            let seq = log.commit().map_err(storage_error)?;
            if seq != before {
                self.stats.commits += 1;
            }
        }
        Ok(())
    }

    /// Deletes the oldest segments that hold no live message, and relocates the last few live
    /// messages of the oldest one so that it can go too.
    fn compact(&mut self) -> Result<(), Error> {
        let Some(log) = self.log.as_mut() else { return Ok(()) };
        loop {
            let Some(oldest) = log.segments().next() else { return Ok(()) };
            if oldest == log.active_segment() {
                return Ok(());
            }
            let seg = u32::try_from(oldest).map_err(|_| segment_overflow(oldest))?;
            let refs = self.engine.segment_refs(seg);
            if refs == 0 {
                log.remove_segment(oldest).map_err(storage_error)?;
                continue;
            }
            if !self.rolled || refs > COMPACT_MAX_LIVE {
                return Ok(());
            }
            self.rolled = false;
            for m in self.engine.live_in_segment(seg) {
                let message = load_message(log, m.location)?;
                self.engine.relocate(&m, message);
            }
            let records = self.engine.take_records();
            append_records(&mut self.engine, log, &records)?;
            self.stats.records += records.len() as u64;
            // The segment is removed on a later pass, once nothing points into it.
            if self.engine.segment_refs(seg) != 0 {
                return Ok(());
            }
        }
    }

    /// Answers parked waiters the engine served, and long polls whose time is up.
    fn serve_ready(&mut self, now: Timestamp) {
        for (w, deliveries) in self.engine.take_ready() {
            let Some(p) = self.parked.remove(&w) else { continue };
            self.parked_deadlines.remove(&(p.deadline(), w));
            if let Parked::Receive { reply, .. } = p {
                let result = self.materialize(deliveries);
                self.turn.push(Done::Deliveries { reply, result });
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

    fn park(&mut self, w: WaiterId, p: Parked) {
        self.parked_deadlines.insert((p.deadline(), w));
        self.parked.insert(w, p);
    }

    fn new_waiter(&mut self) -> WaiterId {
        let w = WaiterId(self.next_waiter);
        self.next_waiter += 1;
        w
    }

    /// Turns engine deliveries into received messages, reading stored bodies from the log.
    fn materialize(&self, deliveries: Vec<Delivery>) -> Result<Vec<ReceivedMessage>, Error> {
        let mut out = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            match &d.body {
                Body::Memory(m) => out.push(engine::received_message(m, &d.meta)),
                Body::Stored(loc) => {
                    let log = self
                        .log
                        .as_ref()
                        .ok_or_else(|| Error::Corrupt("a stored body without a log".to_owned()))?;
                    let m = load_message(log, *loc)?;
                    out.push(engine::received_message(&m, &d.meta));
                }
            }
        }
        Ok(out)
    }

    /// Applies one command to the engine and queues its reply for the end of the turn.
    fn handle(&mut self, now: Timestamp, cmd: Command) {
        if let Some(io) = &self.failed {
            let e = Error::Io(std::io::Error::new(io.kind(), io.to_string()));
            fail_command(cmd, e);
            return;
        }
        let eng = &mut self.engine;
        let done = match cmd {
            Command::CreateEntity { definition, reply } => {
                plain(reply, eng.create_entity(now, definition).map(|_| ()))
            }
            Command::UpdateEntity { definition, reply } => {
                plain(reply, eng.update_entity(now, definition))
            }
            Command::DeleteEntity { path, reply } => {
                let r = eng.resolve(&path).and_then(|e| {
                    if e.is_dead_letter() {
                        return Err(Error::InvalidOperation(
                            "a dead-letter queue is deleted with its entity".to_owned(),
                        ));
                    }
                    eng.delete_entity(now, e)
                });
                plain(reply, r)
            }
            Command::GetEntity { path, reply } => {
                plain(reply, eng.resolve(&path).and_then(|e| eng.definition(e)))
            }
            Command::ListEntities { reply } => {
                let defs = eng.entities().into_iter().filter_map(|(e, _)| eng.definition(e).ok());
                plain(reply, Ok(defs.collect()))
            }
            Command::ApplyDefinitions { definitions, reply } => {
                plain(reply, eng.apply_definitions(now, &definitions))
            }
            Command::ChangeSubscription { topic, subscription, change, reply } => {
                let path = format!("{topic}/Subscriptions/{subscription}");
                let r = eng.resolve(&path).and_then(|e| eng.definition(e)).and_then(|d| {
                    let d = change_subscription(d, change)?;
                    eng.update_entity(now, d)
                });
                plain(reply, r)
            }
            Command::EntityInfo { path, reply } => {
                plain(reply, eng.resolve(&path).and_then(|e| eng.entity_info(e)))
            }
            Command::Counts { path, reply } => {
                plain(reply, eng.resolve(&path).and_then(|e| eng.counts(e)))
            }
            Command::Counters { path, reply } => {
                let r = match path {
                    None => Ok(eng.total_counters()),
                    Some(p) => eng.resolve(&p).and_then(|e| eng.counters(e)),
                };
                plain(reply, r)
            }
            Command::Storage { reply } => {
                let mut s = self.stats;
                if let Some(log) = &self.log {
                    s.fsyncs = log.fsyncs();
                    s.segments = log.segments().count() as u64;
                }
                plain(reply, Ok(s))
            }
            Command::Send { path, messages, reply } => {
                plain(reply, eng.resolve(&path).and_then(|e| eng.send(now, e, messages)))
            }
            Command::Schedule { path, messages, at, reply } => {
                plain(reply, eng.resolve(&path).and_then(|e| eng.schedule(now, e, messages, at)))
            }
            Command::CancelScheduled { path, sequence_numbers, reply } => {
                let r = eng
                    .resolve(&path)
                    .and_then(|e| eng.cancel_scheduled(now, e, &sequence_numbers));
                plain(reply, r)
            }
            Command::Receive { path, mode, wait, session, reply } => {
                let parks = !wait.max_wait.is_zero();
                let w = if parks { Some(self.new_waiter()) } else { None };
                let eng = &mut self.engine;
                let r = match session {
                    None => eng.resolve(&path).and_then(|e| eng.receive(now, e, mode, wait.max, w)),
                    Some(lock) => eng.receive_session(now, lock, mode, wait.max, w),
                };
                match r {
                    Ok(d) if d.is_empty() && parks => {
                        if let Some(w) = w {
                            let deadline = now + wait.max_wait;
                            self.park(w, Parked::Receive { reply, deadline });
                        }
                        return;
                    }
                    Ok(d) => Done::Deliveries { reply, result: self.materialize(d) },
                    Err(e) => plain(reply, Err(e)),
                }
            }
            Command::ReceiveDeferred { path, sequence_numbers, mode, session, reply } => {
                let r = eng
                    .resolve(&path)
                    .and_then(|e| eng.receive_deferred(now, e, &sequence_numbers, mode, session));
                match r {
                    Ok(d) => Done::Deliveries { reply, result: self.materialize(d) },
                    Err(e) => plain(reply, Err(e)),
                }
            }
            Command::Peek { path, from, max, session, reply } => {
                let r =
                    eng.resolve(&path).and_then(|e| eng.peek(now, e, from, max, session.as_ref()));
                let r = r.and_then(|d| self.materialize(d));
                plain(reply, r)
            }
            Command::Complete { tokens, reply } => plain(reply, eng.complete(now, &tokens)),
            Command::Abandon { token, properties, reply } => {
                plain(reply, eng.abandon(now, token, properties))
            }
            Command::DeadLetter { token, reason, description, properties, reply } => {
                plain(reply, eng.dead_letter(now, token, reason, description, properties))
            }
            Command::Defer { token, properties, reply } => {
                plain(reply, eng.defer(now, token, properties))
            }
            Command::Release { tokens, reply } => plain(reply, eng.release(now, &tokens)),
            Command::RenewLock { tokens, reply } => plain(reply, eng.renew_lock(now, &tokens)),
            Command::Resubmit { path, sequence_numbers, reply } => {
                let r = eng.resolve(&path).and_then(|e| eng.resubmit(now, e, &sequence_numbers));
                plain(reply, r)
            }
            Command::AcceptSession { path, session, max_wait, reply } => {
                let parks = session.is_none() && !max_wait.is_zero();
                let w = if parks { Some(self.new_waiter()) } else { None };
                let eng = &mut self.engine;
                let r = eng.resolve(&path).and_then(|e| eng.accept_session(now, e, session, w));
                match r {
                    Ok(None) if parks => {
                        if let Some(w) = w {
                            let deadline = now + max_wait;
                            self.park(w, Parked::Accept { reply, deadline });
                        }
                        return;
                    }
                    result => Done::Session { reply, result },
                }
            }
            Command::RenewSessionLock { lock, reply } => {
                plain(reply, eng.renew_session_lock(now, lock))
            }
            Command::ReleaseSession { lock, reply } => plain(reply, eng.release_session(now, lock)),
            Command::GetSessionState { lock, reply } => plain(reply, eng.session_state(lock)),
            Command::SetSessionState { lock, state, reply } => {
                plain(reply, eng.set_session_state(now, lock, state))
            }
            Command::ListSessions { path, reply } => {
                let r = self.list_sessions(now, &path);
                plain(reply, r)
            }
            Command::Shutdown { reply } => {
                self.shutdown.push(reply);
                return;
            }
        };
        self.turn.push(done);
    }

    /// The sessions that have messages in an entity, in order of their oldest message.
    ///
    /// Scans the entity with peek, reading message bodies for their session ids.
    fn list_sessions(&self, now: Timestamp, path: &str) -> Result<Vec<SessionId>, Error> {
        let e = self.engine.resolve(path)?;
        let info = self.engine.entity_info(e)?;
        if !info.requires_session {
            return Err(Error::SessionsNotEnabled(info.path));
        }
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        let mut from = SequenceNumber::new(0);
        loop {
            let page = self.engine.peek(now, e, from, 1024, None)?;
            let Some(last) = page.last() else { break };
            from = last.meta.sequence_number.next();
            for m in self.materialize(page)? {
                if let Some(s) = m.message.session_id {
                    if seen.insert(s.clone()) {
                        out.push(s);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// An armed timer: its deadline and the sleep that ends there.
type Timer<'a> = (Timestamp, Pin<Box<dyn Future<Output = ()> + Send + 'a>>);

/// Waits for the armed timer, disarming it when it fires.
///
/// # Cancel safety
///
/// Cancel safe: the timer stays armed when the future is dropped.
async fn fire(timer: &mut Option<Timer<'_>>) {
    match timer {
        Some((_, sleep)) => {
            sleep.as_mut().await;
            *timer = None;
        }
        None => std::future::pending().await,
    }
}

/// Waits for the oldest in-flight commit; never resolves when there is none.
///
/// # Cancel safety
///
/// Cancel safe: it only observes the writer.
async fn wait_durable(d: Option<&mut DurableWatch>, seq: Option<u64>) -> Result<(), StorageError> {
    match (d, seq) {
        (Some(d), Some(seq)) => d.wait(seq).await,
        // In memory, in-flight replies never exist; without a target there is nothing to wait
        // for.
        (None, Some(_)) => Ok(()),
        _ => std::future::pending().await,
    }
}

fn fail_command(cmd: Command, e: Error) {
    macro_rules! fail {
        ($reply:expr) => {{
            let _ = $reply.send(Err(e));
        }};
    }
    match cmd {
        Command::CreateEntity { reply, .. }
        | Command::UpdateEntity { reply, .. }
        | Command::DeleteEntity { reply, .. }
        | Command::ApplyDefinitions { reply, .. }
        | Command::ChangeSubscription { reply, .. }
        | Command::CancelScheduled { reply, .. }
        | Command::Complete { reply, .. }
        | Command::Abandon { reply, .. }
        | Command::DeadLetter { reply, .. }
        | Command::Defer { reply, .. }
        | Command::Release { reply, .. }
        | Command::ReleaseSession { reply, .. }
        | Command::SetSessionState { reply, .. } => fail!(reply),
        Command::GetEntity { reply, .. } => fail!(reply),
        Command::ListEntities { reply } => fail!(reply),
        Command::EntityInfo { reply, .. } => fail!(reply),
        Command::Counts { reply, .. } => fail!(reply),
        Command::Counters { reply, .. } => fail!(reply),
        Command::Storage { reply } => fail!(reply),
        Command::Send { reply, .. } => fail!(reply),
        Command::Schedule { reply, .. } | Command::Resubmit { reply, .. } => fail!(reply),
        Command::Receive { reply, .. }
        | Command::ReceiveDeferred { reply, .. }
        | Command::Peek { reply, .. } => fail!(reply),
        Command::RenewLock { reply, .. } => fail!(reply),
        Command::AcceptSession { reply, .. } => fail!(reply),
        Command::RenewSessionLock { reply, .. } => fail!(reply),
        Command::GetSessionState { reply, .. } => fail!(reply),
        Command::ListSessions { reply, .. } => fail!(reply),
        Command::Shutdown { reply } => {
            let _ = reply.send(());
        }
    }
}

/// Applies a change to a subscription definition.
fn change_subscription(
    d: EntityDefinition,
    change: SubscriptionChange,
) -> Result<EntityDefinition, Error> {
    let EntityDefinition::Subscription { topic, name, mut properties, mut rules } = d else {
        return Err(Error::InvalidOperation("only subscriptions have rules".to_owned()));
    };
    let rule_path = |rule: &str| format!("{topic}/Subscriptions/{name}/Rules/{rule}");
    match change {
        SubscriptionChange::Properties(p) => properties = p,
        SubscriptionChange::CreateRule(rule) => {
            // An empty list stands for the implicit `$Default` rule.
            if rules.is_empty() {
                rules.push(Rule::default_rule());
            }
            if rules.iter().any(|r| r.name.eq_ignore_ascii_case(&rule.name)) {
                return Err(Error::EntityAlreadyExists(rule_path(&rule.name)));
            }
            rules.push(rule);
        }
        SubscriptionChange::DeleteRule(rule) => {
            if rules.is_empty() {
                rules.push(Rule::default_rule());
            }
            let before = rules.len();
            rules.retain(|r| !r.name.eq_ignore_ascii_case(&rule));
            if rules.len() == before {
                return Err(Error::EntityNotFound(rule_path(&rule)));
            }
            // A definition without rules stands for `$Default`, which matches everything: the
            // opposite of what removing the last rule means.
            if rules.is_empty() {
                return Err(Error::InvalidOperation(
                    "a subscription keeps at least one rule (add one with a False filter to \
                     receive nothing)"
                        .to_owned(),
                ));
            }
        }
    }
    Ok(EntityDefinition::subscription(topic, name, properties, rules))
}

/// Encodes records, appends them, and tells the engine where bodies landed.
fn append_records(engine: &mut Engine, log: &mut Log, records: &[Record]) -> Result<(), Error> {
    for r in records {
        let payload = postcard::to_allocvec(r)
            .map_err(|e| Error::Corrupt(format!("cannot encode a log record: {e}")))?;
        let loc = log.append(Bytes::from(payload)).map_err(storage_error)?;
        if let Some(key) = r.body_key() {
            engine.set_location(key, engine_location(loc)?);
        }
    }
    Ok(())
}

/// Reads the message stored in the record at `loc`.
fn load_message(log: &Log, loc: engine::Location) -> Result<Arc<Message>, Error> {
    let sloc =
        storage::Location { segment: u64::from(loc.segment), offset: loc.offset, len: loc.len };
    let bytes = log.read(sloc).map_err(storage_error)?;
    let record: Record = decode(&bytes, sloc)?;
    record.message().cloned().ok_or_else(|| {
        Error::Corrupt(format!(
            "the log record at segment {} offset {} carries no message",
            loc.segment, loc.offset
        ))
    })
}

fn decode(bytes: &[u8], loc: storage::Location) -> Result<Record, Error> {
    postcard::from_bytes(bytes).map_err(|e| {
        Error::Corrupt(format!(
            "the log record at segment {} offset {} cannot be decoded: {e}",
            loc.segment, loc.offset
        ))
    })
}

fn engine_location(loc: storage::Location) -> Result<engine::Location, Error> {
    let segment = u32::try_from(loc.segment).map_err(|_| segment_overflow(loc.segment))?;
    Ok(engine::Location { segment, offset: loc.offset, len: loc.len })
}

fn segment_overflow(segment: u64) -> Error {
    Error::Corrupt(format!("log segment id {segment} is out of range"))
}

/// Maps a storage error to the public error.
pub(crate) fn storage_error(e: StorageError) -> Error {
    match e {
        StorageError::Io { path, source } => {
            Error::Io(std::io::Error::new(source.kind(), format!("{}: {source}", path.display())))
        }
        StorageError::Corrupt { segment, offset } => Error::CorruptLog { segment, offset },
        StorageError::Locked(dir) => Error::DirectoryInUse(dir),
        StorageError::Failed(io) => Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        other => Error::Corrupt(other.to_string()),
    }
}
