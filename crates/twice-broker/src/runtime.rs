//! The task that owns the engine and the log.
//!
//! Every [`crate::Broker`] handle sends [`Command`]s over one channel to this task, which
//! serves them in turns:
//!
//! 1. take up to `max_commands_per_turn` queued commands and apply each to the [`Engine`];
//! 2. serve the receivers parked in the engine, once for the whole turn (the engine runs with
//!    [`engine::EngineOptions::deferred_serving`]): a receiver woken under load takes a batch,
//!    not the first message that arrived;
//! 3. encode the engine's records, append them to the log, and commit once;
//! 4. hold the turn's replies until that commit is durable, then send them.
//!
//! While the writer thread syncs turn *k*, this task already applies turn *k + 1*; the replies
//! of *k + 1* wait for their own commit. Commits queued behind a busy writer share its next
//! fsync, so one fsync acknowledges every operation of several turns. With
//! [`crate::BrokerOptions::with_relaxed_delivery_counts`], a peek-lock delivery waits only for
//! the commit that last changed its messages (each message carries the number of that turn),
//! not for the commit of its own lock.
//!
//! This task is the broker's one serial thread, so it does as little per message as it can:
//! deliveries go out as shared messages (or the encoded records holding them) and each caller
//! builds its [`ReceivedMessage`]s; messages the engine lets go of ride back to callers with
//! their replies and are freed there ([`Freed`]), on the threads that allocated them; and the
//! arguments of the busiest commands hold nothing for this task to free.
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

use bytes::{BufMut, Bytes, BytesMut};
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

/// Messages handed to a caller to drop. The broker lets go of a message on its own task
/// (completed, expired, deleted), but the message was allocated by the caller that sent it:
/// freeing it there is cheaper, and takes the work off the broker's one thread.
pub(crate) type Freed = Vec<Arc<Message>>;

/// What the caller of a command gets back.
#[derive(Debug)]
pub(crate) struct Answer<T> {
    pub(crate) result: Result<T, Error>,
    /// Memory for the caller to free (see [`Freed`]).
    pub(crate) freed: Freed,
}

/// The reply channel of one command.
#[derive(Debug)]
pub(crate) struct Reply<T>(oneshot::Sender<Answer<T>>);

impl<T> Reply<T> {
    /// A reply channel and the receiver its caller waits on.
    pub(crate) fn channel() -> (Self, oneshot::Receiver<Answer<T>>) {
        let (tx, rx) = oneshot::channel();
        (Reply(tx), rx)
    }

    /// Sends the result; gives it back if the caller is gone.
    pub(crate) fn send(self, result: Result<T, Error>) -> Result<(), Result<T, Error>> {
        self.send_freeing(result, &mut Vec::new())
    }

    /// Sends the result with `freed` for the caller to drop; when the caller is gone, gives
    /// back the result and leaves `freed` for the next reply.
    fn send_freeing(
        self,
        result: Result<T, Error>,
        freed: &mut Freed,
    ) -> Result<(), Result<T, Error>> {
        let answer = Answer { result, freed: std::mem::take(freed) };
        self.0.send(answer).map_err(|a| {
            *freed = a.freed;
            a.result
        })
    }
}

/// The most freed messages the broker holds for its callers: past it (with no reply going out
/// for long) it drops them itself.
const MAX_FREED: usize = 1 << 16;

/// The entity path of a command. Short paths (nearly all) are held inline, so that the
/// command carries no allocation of the caller's for the broker's task to free: a free of
/// memory another thread allocated is much dearer than one of its own.
#[derive(Clone)]
pub(crate) enum PathArg {
    Inline { len: u8, bytes: [u8; INLINE_PATH] },
    Heap(String),
}

/// The longest path a command holds inline.
const INLINE_PATH: usize = 62;

impl PathArg {
    pub(crate) fn new(path: &str) -> Self {
        match u8::try_from(path.len()) {
            Ok(len) if path.len() <= INLINE_PATH => {
                let mut bytes = [0u8; INLINE_PATH];
                bytes[..path.len()].copy_from_slice(path.as_bytes());
                PathArg::Inline { len, bytes }
            }
            _ => PathArg::Heap(path.to_owned()),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            // The bytes are a prefix of a `str` cut at its end: always valid UTF-8.
            PathArg::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
            PathArg::Heap(s) => s,
        }
    }
}

impl std::fmt::Debug for PathArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

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
        path: PathArg,
        messages: Vec<Arc<Message>>,
        reply: Reply<Vec<SendOutcome>>,
    },
    /// A send of one message: the same as a batch of one, with nothing to allocate for the
    /// batch on the caller's side (where the broker's task would free it).
    SendOne {
        path: PathArg,
        message: Arc<Message>,
        reply: Reply<SendOutcome>,
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
        path: PathArg,
        mode: ReceiveMode,
        wait: Wait,
        session: Option<SessionLock>,
        reply: Reply<Vec<Delivered>>,
    },
    ReceiveDeferred {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
        mode: ReceiveMode,
        session: Option<SessionLock>,
        reply: Reply<Vec<Delivered>>,
    },
    Peek {
        path: String,
        from: SequenceNumber,
        max: usize,
        session: Option<SessionId>,
        reply: Reply<Vec<Delivered>>,
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

/// A delivered (or peeked) message on its way to the caller, who turns it into a
/// [`ReceivedMessage`] with [`Delivered::into_received`].
#[derive(Debug)]
pub(crate) struct Delivered {
    body: DeliveredBody,
    meta: engine::DeliveryMeta,
}

#[derive(Debug)]
enum DeliveredBody {
    /// The message, shared with the broker.
    Message(Arc<Message>),
    /// The encoded log record that carries the message.
    Record { record: Bytes, location: storage::Location },
}

impl Delivered {
    /// The lock of this delivery, if it has one.
    pub(crate) fn lock_token(&self) -> Option<LockToken> {
        self.meta.lock_token
    }

    /// The message as the `twice` vocabulary has it (see [`engine::received_message`]).
    pub(crate) fn into_received(self) -> Result<ReceivedMessage, Error> {
        match self.body {
            DeliveredBody::Message(m) => Ok(engine::received_message(&m, &self.meta)),
            DeliveredBody::Record { record, location } => {
                let m = decode(&record, location)?.into_message().ok_or_else(|| {
                    Error::Corrupt(format!(
                        "the log record at segment {} offset {} carries no message",
                        location.segment, location.offset
                    ))
                })?;
                Ok(engine::received_message_owned(m, &self.meta))
            }
        }
    }
}

/// Storage figures of a durable broker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StorageStats {
    pub(crate) commits: u64,
    pub(crate) fsyncs: u64,
    pub(crate) segments: u64,
    pub(crate) records: u64,
    pub(crate) bytes_written: u64,
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
    /// See [`crate::BrokerOptions::with_relaxed_delivery_counts`].
    pub(crate) relaxed_delivery_counts: bool,
    /// Where a storage failure is reported to the broker's handles.
    pub(crate) failure: storage::FailureCell,
}

/// A reply held until its turn's commit is durable.
#[derive(Debug)]
enum Done {
    /// A reply with nothing to undo if its caller is gone.
    Plain(Box<dyn PlainReply>),
    /// Messages locked for a caller: released if the caller is gone.
    Deliveries {
        reply: Reply<Vec<Delivered>>,
        result: Result<Vec<Delivered>, Error>,
        /// With relaxed delivery counts, the commit the reply waits for (instead of its
        /// turn's): the last one that changed the delivered messages before this delivery.
        after: Option<u64>,
    },
    /// A session locked for a caller: released if the caller is gone.
    Session {
        reply: Reply<Option<AcceptedSession>>,
        result: Result<Option<AcceptedSession>, Error>,
    },
}

/// A typed reply, boxed so that one queue holds the replies of every command.
trait PlainReply: Send + std::fmt::Debug {
    fn send(self: Box<Self>, freed: &mut Freed);
    fn fail(self: Box<Self>, e: Error);
}

#[derive(Debug)]
struct Pending<T>(Reply<T>, Result<T, Error>);

impl<T: Send + std::fmt::Debug + 'static> PlainReply for Pending<T> {
    fn send(self: Box<Self>, freed: &mut Freed) {
        // The caller may have gone; what it asked for is done either way.
        let _ = self.0.send_freeing(self.1, freed);
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
    /// Messages for the next reply to carry to its caller, who frees them.
    freed: Freed,
    /// The vector the engine's records of the next turn go to (kept for its memory).
    records: Vec<Record>,
    parked: HashMap<WaiterId, Parked>,
    parked_deadlines: BTreeSet<(Timestamp, WaiterId)>,
    next_waiter: u64,
    /// Whether a segment was started since the last look at compaction.
    rolled: bool,
    /// Whether peek-lock deliveries are answered before their lock records are durable.
    relaxed: bool,
    /// Set once a write failed: the broker then refuses everything.
    failed: Option<Arc<std::io::Error>>,
    failure: storage::FailureCell,
    stats: StorageStats,
    shutdown: Vec<oneshot::Sender<()>>,
}

/// The most records whose vector's memory is kept from one turn to the next.
const MAX_KEPT_RECORDS: usize = 1 << 16;

/// Compaction relocates the live messages of the oldest segment once at most this many remain
/// there, so that a few long-lived messages do not keep a whole segment on disk.
const COMPACT_MAX_LIVE: usize = 4096;

/// ... and only while their records hold at most this share of a segment (1/n): a move then
/// never fills the active segment by itself, and each segment's worth of writes carries at most
/// a quarter of a segment of moved records, whatever the backlog (write amplification ≤ 4/3
/// plus checkpoints).
const COMPACT_MAX_SHARE: u64 = 4;

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
                    if stats.records % 4096 == 0 {
                        // No caller to hand freed messages to while the log is replayed.
                        drop(engine.take_freed());
                    }
                }
                Some(log)
            }
        };
        let now = options.clock.now();
        engine.finish_recovery(now)?;
        drop(engine.take_freed());
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
            freed: Vec::new(),
            records: Vec::new(),
            parked: HashMap::new(),
            parked_deadlines: BTreeSet::new(),
            next_waiter: 1,
            relaxed: options.relaxed_delivery_counts,
            rolled: false,
            failed: None,
            failure: options.failure,
            stats,
            shutdown: Vec::new(),
        };
        // What recovery changed (locks that were held at the crash) is written before anything
        // else, and synchronously: the first turn then starts from a durable state.
        rt.persist()?;
        if let Some(log) = rt.log.as_mut() {
            log.flush_blocking().map_err(storage_error)?;
            rt.engine.set_turn(log.last_commit() + 1);
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
                    // Serves waiters first (a lock that expired may have freed a message for
                    // one), then ends the long polls whose time is up.
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
    fn end_turn(&mut self, now: Timestamp) {
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
    fn relaxed_after(&self, mode: ReceiveMode, deliveries: &[Delivery]) -> Option<u64> {
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

    /// Appends the engine's records, starts a new segment (with a checkpoint) when the active
    /// one is full, compacts, and commits once.
    fn persist(&mut self) -> Result<(), Error> {
        let Some(log) = self.log.as_mut() else { return Ok(()) };
        let mut records = std::mem::take(&mut self.records);
        self.engine.swap_records(&mut records);
        if records.is_empty() {
            self.records = records;
            return Ok(());
        }
        append_records(&mut self.engine, log, &records)?;
        self.stats.records += records.len() as u64;
        records.clear();
        // A burst should not keep its memory for good.
        if records.capacity() <= MAX_KEPT_RECORDS {
            self.records = records;
        }
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
            let live_bytes = self.engine.segment_live_bytes(seg);
            if !self.rolled
                || refs > COMPACT_MAX_LIVE
                || live_bytes > log.segment_size() / COMPACT_MAX_SHARE
            {
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

    fn park(&mut self, w: WaiterId, p: Parked) {
        self.parked_deadlines.insert((p.deadline(), w));
        self.parked.insert(w, p);
    }

    fn new_waiter(&mut self) -> WaiterId {
        let w = WaiterId(self.next_waiter);
        self.next_waiter += 1;
        w
    }

    /// Turns engine deliveries into replies. A body in memory goes as it is; a stored one as
    /// the bytes of the record holding it (from the read cache, or read from its segment),
    /// which the caller decodes: the broker's task does the least work per message.
    fn materialize(&self, deliveries: Vec<Delivery>) -> Result<Vec<Delivered>, Error> {
        let mut out = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            let body = match d.body {
                Body::Memory(m) => DeliveredBody::Message(m),
                Body::Stored(loc) => {
                    let log = self
                        .log
                        .as_ref()
                        .ok_or_else(|| Error::Corrupt("a stored body without a log".to_owned()))?;
                    let location = storage::Location {
                        segment: u64::from(loc.segment),
                        offset: loc.offset,
                        len: loc.len,
                    };
                    let record = log.read(location).map_err(storage_error)?;
                    DeliveredBody::Record { record, location }
                }
            };
            out.push(Delivered { body, meta: d.meta });
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
                    s.bytes_written = log.bytes_written();
                    s.segments = log.segments().count() as u64;
                }
                plain(reply, Ok(s))
            }
            Command::Send { path, messages, reply } => {
                let r = eng.resolve(path.as_str()).and_then(|e| eng.send_shared(now, e, messages));
                plain(reply, r)
            }
            Command::SendOne { path, message, reply } => {
                let r =
                    eng.resolve(path.as_str()).and_then(|e| eng.send_shared(now, e, vec![message]));
                let r = r.and_then(|mut out| {
                    out.pop().ok_or_else(|| Error::Corrupt("a send without an outcome".to_owned()))
                });
                plain(reply, r)
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
                    None => eng
                        .resolve(path.as_str())
                        .and_then(|e| eng.receive(now, e, mode, wait.max, w)),
                    Some(lock) => eng.receive_session(now, lock, mode, wait.max, w),
                };
                match r {
                    Ok(d) if d.is_empty() && parks => {
                        if let Some(w) = w {
                            let deadline = now + wait.max_wait;
                            self.park(w, Parked::Receive { reply, mode, deadline });
                        }
                        return;
                    }
                    Ok(d) => {
                        let after = self.relaxed_after(mode, &d);
                        Done::Deliveries { reply, result: self.materialize(d), after }
                    }
                    Err(e) => plain(reply, Err(e)),
                }
            }
            Command::ReceiveDeferred { path, sequence_numbers, mode, session, reply } => {
                let r = eng
                    .resolve(&path)
                    .and_then(|e| eng.receive_deferred(now, e, &sequence_numbers, mode, session));
                match r {
                    Ok(d) => {
                        let after = self.relaxed_after(mode, &d);
                        Done::Deliveries { reply, result: self.materialize(d), after }
                    }
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
                let r = eng.resolve(&path).and_then(|e| eng.sessions(now, e)).map(|sessions| {
                    sessions.into_iter().filter(|s| s.has_messages).map(|s| s.session_id).collect()
                });
                plain(reply, r)
            }
            Command::Shutdown { reply } => {
                self.shutdown.push(reply);
                return;
            }
        };
        self.turn.push(done);
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
        Command::SendOne { reply, .. } => fail!(reply),
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
            if rules.iter().any(|r| r.name.eq_ignore_ascii_case(&rule.name)) {
                return Err(Error::EntityAlreadyExists(rule_path(&rule.name)));
            }
            rules.push(rule);
        }
        SubscriptionChange::DeleteRule(rule) => {
            let before = rules.len();
            rules.retain(|r| !r.name.eq_ignore_ascii_case(&rule));
            if rules.len() == before {
                return Err(Error::EntityNotFound(rule_path(&rule)));
            }
            // Removing the last rule leaves a subscription that receives nothing, as in
            // Service Bus.
        }
    }
    Ok(EntityDefinition::subscription(topic, name, properties, rules))
}

/// Encodes records, appends them, and tells the engine where bodies landed.
fn append_records(engine: &mut Engine, log: &mut Log, records: &[Record]) -> Result<(), Error> {
    for r in records {
        let hint = r.message().map_or(64, |m| m.body.len() + 256);
        let loc = log
            .append_with(hint, |buf| {
                postcard::serialize_with_flavor(r, Encoder(buf)).map_err(|e| e.to_string())
            })
            .map_err(storage_error)?;
        if let Some(key) = r.body_key() {
            engine.set_location(key, engine_location(loc)?);
        }
    }
    Ok(())
}

/// Encodes a record straight into the log's buffer.
struct Encoder<'a>(&'a mut BytesMut);

impl postcard::ser_flavors::Flavor for Encoder<'_> {
    type Output = ();

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.put_u8(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
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
        StorageError::MissingSegment { segment, .. } => Error::MissingSegment { segment },
        StorageError::Failed(io) => Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        other => Error::Corrupt(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use twice::{ManualClock, Message};

    use super::*;
    use crate::Broker;
    use crate::config::QueueProperties;
    use crate::storage::WriterGate;

    /// A durable runtime on a thread of its own, and a gate that holds its log writer still.
    fn start(dir: &std::path::Path, relaxed: bool) -> (Broker, WriterGate) {
        let clock = SharedClock::from(ManualClock::default());
        let (tx, rx) = mpsc::channel(64);
        let options = RuntimeOptions {
            dir: Some(dir.to_owned()),
            log: LogOptions::default(),
            engine: engine::EngineOptions {
                deferred_serving: true,
                collect_freed: true,
                ..engine::EngineOptions::default()
            },
            clock: clock.clone(),
            max_commands_per_turn: 64,
            definitions: Vec::new(),
            relaxed_delivery_counts: relaxed,
            failure: storage::FailureCell::default(),
        };
        let runtime = Runtime::open(options, rx).expect("open the runtime");
        let gate = runtime.log.as_ref().expect("a durable log").writer_gate();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build();
            rt.expect("a runtime").block_on(runtime.run());
        });
        (Broker::from_channel(tx, clock), gate)
    }

    #[tokio::test]
    // reason: the guard is the point of the test: held across the calls, it keeps the log
    // writer (another thread) from making anything durable meanwhile.
    #[allow(clippy::await_holding_lock)]
    async fn relaxed_deliveries_do_not_wait_for_their_lock_records() {
        let dir = tempfile::tempdir().unwrap();
        let (broker, gate) = start(dir.path(), true);
        broker.create_queue("q", QueueProperties::default()).await.unwrap();
        broker.send("q", Message::new("a").with_message_id("a")).await.unwrap();
        // The writer is held: no commit from now on becomes durable, the lock record of the
        // receive neither. The message itself is durable, so the delivery is answered.
        let held = gate.hold();
        let got = broker.receive("q", 10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].message_id().as_str(), "a");
        // A message sent now is not durable: a delivery of it waits like its send.
        let sender = broker.clone();
        let send = tokio::spawn(async move { sender.send("q", Message::new("b")).await });
        let receiver = broker.clone();
        let receive =
            tokio::spawn(async move { receiver.receive("q", 10, Duration::from_secs(1)).await });
        drop(held);
        send.await.unwrap().unwrap();
        assert_eq!(receive.await.unwrap().unwrap().len(), 1);
        broker.complete(got[0].lock_token.unwrap()).await.unwrap();
        assert_eq!(broker.counts("q").await.unwrap().active, 1);
        broker.shutdown().await;
    }

    #[tokio::test]
    // reason: the guard is the point of the test: held across the calls, it keeps the log
    // writer (another thread) from making anything durable meanwhile.
    #[allow(clippy::await_holding_lock)]
    async fn by_default_deliveries_wait_for_their_lock_records() {
        let dir = tempfile::tempdir().unwrap();
        let (broker, gate) = start(dir.path(), false);
        broker.create_queue("q", QueueProperties::default()).await.unwrap();
        broker.send("q", Message::new("a")).await.unwrap();
        let held = gate.hold();
        let receiver = broker.clone();
        let receive = tokio::spawn(async move { receiver.receive("q", 10, Duration::ZERO).await });
        // The receive cannot be answered while its lock record cannot become durable.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!receive.is_finished());
        drop(held);
        assert_eq!(receive.await.unwrap().unwrap().len(), 1);
        broker.shutdown().await;
    }
}
