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
//! [`crate::BrokerOptions::relaxed_delivery_counts`], a peek-lock delivery waits only for
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
//!
//! The module is in four parts: [`command`] declares every operation once (the [`Command`]
//! the handles send, its dispatch, and the answer of a command that cannot be served);
//! [`reply`] holds what goes back to a caller; [`turn`] ends a turn and holds its replies until
//! they are durable; [`persistence`] appends, commits and compacts the log and reads bodies
//! back.

mod command;
mod persistence;
mod reply;
mod turn;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use twice::{SharedClock, Timestamp};

pub(crate) use self::command::{Command, PathArg, SubscriptionChange, Wait};
use self::persistence::engine_location;
pub(crate) use self::persistence::storage_error;
use self::reply::Done;
use self::reply::decode;
pub(crate) use self::reply::{Delivered, Freed, Reply};
use self::turn::Parked;
use crate::config::EntityDefinition;
use crate::engine::{self, Engine, Record, WaiterId};
use crate::error::Error;
use crate::storage::{DurableWatch, Log, LogOptions, StorageError};

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
    /// See [`crate::BrokerOptions::relaxed_delivery_counts`].
    pub(crate) relaxed_delivery_counts: bool,
    /// Where a storage failure is reported to the broker's handles.
    pub(crate) failure: crate::storage::FailureCell,
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
    failure: crate::storage::FailureCell,
    stats: StorageStats,
    shutdown: Vec<oneshot::Sender<()>>,
}

impl Runtime {
    /// Opens the log (replaying it into a new engine), applies the configured entities, and
    /// returns the runtime ready to [`Runtime::run`]. Blocking: call it off the async threads.
    pub(crate) fn open(
        options: RuntimeOptions,
        rx: mpsc::Receiver<Command>,
    ) -> Result<Runtime, Error> {
        let mut engine_options = options.engine;
        // Lock tokens must tell nothing about one another: their generator is seeded from the
        // operating system's, never from a guessable number.
        engine_options.entropy.get_or_insert_with(rand::random);
        let mut engine = Engine::new(engine_options);
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
            if let Some(deadline) = self.next_deadline()
                && timer.as_ref().is_none_or(|(armed, _)| deadline < *armed)
            {
                timer = Some((deadline, Box::pin(clock.sleep_until(deadline))));
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
            failure: crate::storage::FailureCell::default(),
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
