//! `twice chaos`: the whole system in separate processes under kills, and a checker of what
//! it recorded.
//!
//! The controller (this process) starts `twice serve` (durable, its own data directory), or
//! uses RabbitMQ or NATS JetStream (`--broker`), starts N processor processes (`twice
//! chaos-worker`, the same binary), sends orders, and meanwhile kills processors with
//! SIGKILL, restarts the broker for real (`twice serve` killed with SIGKILL; RabbitMQ and NATS
//! by a command), stops a processor with SIGSTOP past its lock and lets it go on, and, when
//! asked (`--db-restart`), restarts PostgreSQL once; the processors also abort themselves right after a commit, before the
//! completion, now and then. On `twice serve` every order has its stable message id; on
//! RabbitMQ and NATS a plain client of the broker sends them, every other one without an id
//! ([`broker`]). The payment and mail services run in this process, so they outlive every kill and
//! count each effect exactly where it happens. At the end the queue must drain, and
//! [`check::check`] reads the history.

pub(crate) mod broker;
pub(crate) mod check;
pub(crate) mod worker;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use rand::{Rng as _, SeedableRng as _};
use serde::Serialize;
use sqlx::Postgres;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use twice::outbox::outgoing_message_id;
use twice::{OutboxStore as _, SharedClock, Stopwatch};
use twice_sqlx::{InboxOptions, SqlxInbox};

use self::broker::{BrokerKind, ChaosBroker, Producer, WorkerBroker};
use self::check::{Event, EventsLeft, History, Observed, Sent, Verdict};
use crate::demo::db::{DemoDb as _, Tables};
use crate::demo::services::Service;

/// The queue's LockDuration: a stopped processor is held past it.
pub(crate) const LOCK: Duration = Duration::from_secs(5);
/// The counts of a drained run: no order left, no event unsent or unhandled.
const DRAINED: (Option<u64>, Option<EventsLeft>) =
    (Some(0), Some(EventsLeft { unsent: 0, queued: 0 }));
/// The default restart of PostgreSQL: Debian's `pg_ctlcluster` on the machine's first cluster.
const DB_RESTART: &str =
    "pg_ctlcluster --skip-systemctl-redirect \"$(ls /etc/postgresql | head -n1)\" main restart";
/// How long the end of a run may take to drain the queue.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of `twice chaos`.
#[derive(Debug, clap::Args)]
pub(crate) struct ChaosArgs {
    /// The broker: `serve` (`twice serve`, started by the run on free ports and a directory
    /// of its own), `amqp://user:pass@host:port/vhost` (RabbitMQ) or `nats://host:port`
    /// (NATS JetStream). The run makes queues or streams of its own there and removes them at
    /// the end; it restarts the broker with `--broker-restart-command`.
    #[arg(long, default_value = "serve", value_parser = BrokerKind::parse)]
    broker: BrokerKind,
    /// The command that restarts RabbitMQ or NATS, run with `sh -c` at each broker fault;
    /// default: `rabbitmqctl -q stop_app && rabbitmqctl -q start_app` for RabbitMQ, and for
    /// NATS the server killed with SIGKILL and started again on its JetStream directory as
    /// Debian's package runs it (`/usr/sbin/nats-server -a 127.0.0.1 -p 4222 -js -sd
    /// /var/lib/nats-server`). `twice serve` is killed with SIGKILL and started again.
    #[arg(long, value_name = "COMMAND")]
    broker_restart_command: Option<String>,
    /// How many faults the controller injects: SIGKILLs of processors, restarts of the broker,
    /// SIGSTOPs of a processor past its lock, and, with `--db-restart`, one PostgreSQL
    /// restart. The processors' own aborts after commit come on top.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    kills: u32,
    /// How many processor processes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(3..=32))]
    processors: u64,
    /// How many orders to send; sending is spread over the faults.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    orders: u64,
    /// The seed of the schedule of faults and of the poison orders.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The PostgreSQL database of the inbox and the shipments.
    #[arg(long, value_name = "URL", default_value = "postgres://postgres@127.0.0.1:5432/test")]
    store: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Restart PostgreSQL once, half-way through the faults, with `--db-restart-command`. It
    /// cuts every other client of that server, so it is only done when asked.
    #[arg(long)]
    db_restart: bool,
    /// The command that restarts PostgreSQL (implies `--db-restart`), run with `sh -c`;
    /// default: `pg_ctlcluster` on the machine's first cluster, as Debian's package runs it.
    #[arg(long, value_name = "COMMAND")]
    db_restart_command: Option<String>,
    /// The mean time between two faults, in milliseconds.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(50..=600_000))]
    interval_ms: u64,
    /// The chance that a processor aborts right after a commit, before the completion.
    #[arg(long, default_value_t = 0.005, value_parser = crate::demo::rate)]
    abort_rate: f64,
    /// The chance, per relay turn, that a processor aborts right after the broker
    /// acknowledged its relay's sends, before the relay deleted their rows.
    #[arg(long, default_value_t = 0.02, value_parser = crate::demo::rate)]
    relay_abort_rate: f64,
    /// How many received orders each processor handles in one transaction (1: one
    /// transaction per order); each handler runs under a savepoint of its own.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    batch: u64,
    /// Share of orders the handler rejects (they must end in the dead-letter queue).
    #[arg(long, default_value_t = 0.02, value_parser = crate::demo::rate)]
    poison_rate: f64,
    /// Keep the run's directory (the broker's data, the processes' logs) and, on RabbitMQ and
    /// NATS, the run's queues or streams, and print where.
    #[arg(long)]
    keep: bool,
}

/// The faults injected, by kind.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Faults {
    pub(crate) processor_sigkill: u64,
    /// `twice serve` killed with SIGKILL and started again.
    pub(crate) broker_sigkill: u64,
    /// RabbitMQ or NATS restarted by their command.
    pub(crate) broker_restart: u64,
    pub(crate) processor_sigstop_past_lock: u64,
    pub(crate) postgres_restart: u64,
    /// Processors that aborted right after a commit, before completing.
    pub(crate) processor_abort_after_commit: u64,
    /// Processors that aborted right after the broker acknowledged their relay's sends,
    /// before the relay deleted the rows.
    pub(crate) relay_abort_after_ack: u64,
}

/// The report.
#[derive(Debug, Serialize)]
struct Report {
    broker: &'static str,
    orders: u64,
    /// Orders the producer sent without a message id.
    orders_without_id: u64,
    /// Whether the broker's acknowledgement of a completion promises no redelivery.
    completions_confirmed: bool,
    /// Messages the broker still held at the end although the run had settled them (NATS
    /// killed with SIGKILL): not delivered again, not left undone.
    kept_after_settlement: u64,
    processors: u64,
    /// Orders per transaction in each processor.
    batch: u64,
    seed: u64,
    elapsed_seconds: f64,
    faults: Faults,
    #[serde(flatten)]
    verdict: Verdict,
    violation_count: u64,
}

/// A one-connection pool on the store.
async fn pool_of(store: &str) -> anyhow::Result<sqlx::Pool<Postgres>> {
    sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(1)
        .connect(store)
        .await
        .context("connecting to PostgreSQL")
}

/// The binary the children run: this one.
fn this_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("finding the twice binary")
}

/// The settings every processor child gets.
struct WorkerSpec {
    exe: PathBuf,
    dir: PathBuf,
    broker: WorkerBroker,
    store: String,
    run_id: String,
    payments: std::net::SocketAddr,
    mail: std::net::SocketAddr,
    abort_rate: f64,
    relay_abort_rate: f64,
    seed: u64,
    batch: u64,
}

/// One processor slot: its current process (restarted after each kill).
struct WorkerProc {
    child: Child,
    pid: u32,
    reader: tokio::task::JoinHandle<()>,
}

impl WorkerSpec {
    fn spawn(
        &self,
        index: usize,
        incarnation: u64,
        events: &Arc<Mutex<Vec<Observed>>>,
    ) -> anyhow::Result<WorkerProc> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("processor-{index}.log")))?;
        let mut child = Command::new(&self.exe)
            .arg("chaos-worker")
            .args(["--broker", &self.broker.broker])
            .args(["--queue", &self.broker.orders, "--shipped", &self.broker.shipped])
            .args(["--store", &self.store, "--run-id", &self.run_id])
            .args(["--payments", &self.payments.to_string(), "--mail", &self.mail.to_string()])
            .args(["--abort-after-commit", &self.abort_rate.to_string()])
            .args(["--relay-abort-after-ack", &self.relay_abort_rate.to_string()])
            .args(["--batch", &self.batch.to_string()])
            .args([
                "--seed",
                &(self.seed * 1_000_003 + index as u64 * 1_009 + incarnation).to_string(),
            ])
            .current_dir(&self.dir)
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting a processor")?;
        let pid = child.id().context("the processor's pid")?;
        let stdout = child.stdout.take().context("the processor's stdout")?;
        let events = Arc::clone(events);
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(o) = parse_event(index, &line) {
                    events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(o);
                }
            }
        });
        Ok(WorkerProc { child, pid, reader })
    }
}

/// Parses an `EV` line of a processor.
fn parse_event(processor: usize, line: &str) -> Option<Observed> {
    let mut parts = line.strip_prefix("EV ")?.split(' ');
    let at_millis = parts.next()?.parse().ok()?;
    let kind = parts.next()?;
    let message_id = parts.next()?.to_owned();
    let event = match kind {
        "D" => Event::Delivered {
            message_id,
            delivery_count: parts.next()?.parse().ok()?,
            // Milliseconds since the epoch; a negative value cannot be a live lock.
            locked_until: parts.next()?.parse::<i64>().ok()?.try_into().unwrap_or(0),
        },
        "H" => Event::Handled { message_id },
        "C" => Event::Completed { message_id },
        "F" => Event::CompletionFailed { message_id },
        "L" => Event::DeadLettered { message_id },
        "A" => Event::AbortAfterCommit { message_id },
        "R" => Event::AbortAfterRelayAck { message_id },
        _ => return None,
    };
    Some(Observed { processor, at_millis, event })
}

/// Sends a signal with `kill(1)`: SIGSTOP and SIGCONT have no std API. Returns false when
/// the process is gone: a processor may die on its own (an abort after its commit) and be
/// reaped between the choice of it and the signal, or while it is held.
async fn signal(pid: u32, sig: &str) -> anyhow::Result<bool> {
    let pid = pid.to_string();
    let kill = |args: [&str; 2]| {
        let mut command = Command::new("kill");
        command.args(args).stderr(std::process::Stdio::null());
        command
    };
    if kill([sig, &pid]).status().await?.success() {
        return Ok(true);
    }
    if !kill(["-0", &pid]).status().await?.success() {
        return Ok(false);
    }
    bail!("kill {sig} {pid} failed")
}

/// Sends every order, again and again until the broker acknowledges it, spread over `span`:
/// with its stable message id, or, where the producer leaves ids out, with none.
async fn send_all(
    producer: Producer,
    orders: Vec<(u64, bool)>,
    span: Duration,
    sent: Arc<Mutex<Vec<Sent>>>,
) -> anyhow::Result<()> {
    let mut link = producer.link()?;
    let gap = span / u32::try_from(orders.len().max(1)).unwrap_or(u32::MAX);
    let clock = SharedClock::system();
    for (order_id, poison) in orders {
        let message_id = format!("order-{order_id}");
        let without_id = producer.without_id(order_id);
        let amount =
            if poison { -100 } else { 1_000 + i64::try_from(order_id % 9_000).unwrap_or(0) };
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        let started = clock.now();
        let mut record =
            Sent { message_id, order_id, poison, without_id, invoked: 0, acknowledged: false };
        loop {
            record.invoked += 1;
            let id = (!without_id).then_some(record.message_id.as_str());
            match link.send(&body, id).await {
                Ok(()) => {
                    record.acknowledged = true;
                    break;
                }
                // The broker is down or restarting: send again (with the same id, if any).
                Err(_) if clock.now().duration_since(started) < Duration::from_secs(120) => {
                    clock.sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(record);
                    return Err(e).context("sending an order for two minutes");
                }
            }
        }
        sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(record);
        clock.sleep(gap).await;
    }
    link.close().await;
    Ok(())
}

/// Runs the chaos test; the exit code is success iff there is no violation.
pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    let stopwatch = Stopwatch::start();
    let clock = SharedClock::system();
    let workdir = tempfile::Builder::new().prefix("twice-chaos-").tempdir()?;
    let dir = workdir.path().to_path_buf();
    let run_id = format!("chaos{:08x}", rand::random::<u32>());
    let tables = Tables::new(&run_id);
    let pool = sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(4)
        .connect(&args.store)
        .await
        .context("connecting to PostgreSQL")?;
    Postgres::create_tables(&pool, &tables).await?;
    // The inbox and outbox tables, made once here rather than by the processors racing.
    SqlxInbox::<Postgres>::new(
        pool.clone(),
        InboxOptions::new()
            .table(tables.inbox.clone())
            .business_key(tables.shipments.clone(), tables.shipments_key.clone()),
    )
    .await
    .context("creating the inbox")?;
    SqlxInbox::<Postgres>::new(
        pool.clone(),
        InboxOptions::new().table(tables.loyalty_inbox.clone()),
    )
    .await
    .context("creating the loyalty inbox")?;
    Postgres::outbox(&pool, &tables.outbox).await?;
    let result = match ChaosBroker::open(
        &args.broker,
        args.broker_restart_command.as_deref(),
        &dir,
        &run_id,
    )
    .await
    {
        Ok(mut broker) => {
            let result =
                run_in(&args, &mut broker, &dir, &run_id, &tables, &clock, stopwatch).await;
            if args.keep {
                eprintln!("kept the run's entities: {}", broker.for_workers().entities());
            } else {
                broker.close().await;
            }
            result
        }
        Err(e) => Err(e),
    };
    // The restart may have closed the pool's connections; the pool opens new ones.
    let _ = Postgres::drop_tables(&pool, &tables).await;
    if args.keep {
        eprintln!("kept the run's directory: {}", workdir.keep().display());
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(if report.violation_count == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The processor slots, started again whenever one ended.
struct Workers {
    spec: WorkerSpec,
    events: Arc<Mutex<Vec<Observed>>>,
    procs: Vec<Option<WorkerProc>>,
    incarnation: u64,
}

impl Workers {
    /// Starts every slot that has no running process (one that aborted itself, or all after
    /// [`Workers::stop`]).
    fn start(&mut self) -> anyhow::Result<()> {
        for i in 0..self.procs.len() {
            let ended = match &mut self.procs[i] {
                Some(w) => matches!(w.child.try_wait(), Ok(Some(_))),
                None => true,
            };
            if ended {
                self.incarnation += 1;
                self.procs[i] = Some(self.spec.spawn(i, self.incarnation, &self.events)?);
            }
        }
        Ok(())
    }

    fn pid(&self, i: usize) -> Option<u32> {
        self.procs[i].as_ref().map(|w| w.pid)
    }

    /// Kills slot `i` with SIGKILL and starts it again.
    async fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(w) = &mut self.procs[i] {
            w.child.kill().await?;
        }
        self.procs[i] = None;
        self.start()
    }

    /// Stops every process (SIGTERM: the processors finish what they hold) and waits until
    /// each has ended and its events are read.
    async fn stop(&mut self) {
        for w in self.procs.iter().flatten() {
            let _ = signal(w.pid, "-TERM").await;
        }
        for slot in &mut self.procs {
            if let Some(mut w) = slot.take() {
                if tokio::time::timeout(Duration::from_secs(10), w.child.wait()).await.is_err() {
                    let _ = w.child.kill().await;
                }
                let _ = w.reader.await;
            }
        }
    }
}

#[allow(clippy::too_many_lines)] // reason: one linear story: start, send and kill, drain, check
async fn run_in(
    args: &ChaosArgs,
    broker: &mut ChaosBroker,
    dir: &Path,
    run_id: &str,
    tables: &Tables,
    clock: &SharedClock,
    stopwatch: Stopwatch,
) -> anyhow::Result<Report> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let payments = Service::start("payments").await?;
    let mail = Service::start("mail").await?;
    let n = usize::try_from(args.processors).unwrap_or(3);
    let mut workers = Workers {
        spec: WorkerSpec {
            exe: this_exe()?,
            dir: dir.to_path_buf(),
            broker: broker.for_workers(),
            store: args.store.clone(),
            run_id: run_id.to_owned(),
            payments: payments.addr(),
            mail: mail.addr(),
            abort_rate: args.abort_rate,
            relay_abort_rate: args.relay_abort_rate,
            batch: args.batch,
            seed: args.seed,
        },
        events: Arc::default(),
        procs: (0..n).map(|_| None).collect(),
        incarnation: 0,
    };
    workers.start()?;
    let mut faults = Faults::default();

    let orders: Vec<(u64, bool)> =
        (1..=args.orders).map(|o| (o, rng.random_bool(args.poison_rate))).collect();
    let interval = Duration::from_millis(args.interval_ms);
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let sender =
        tokio::spawn(send_all(broker.producer(), orders, interval * args.kills, Arc::clone(&sent)));

    // The faults.
    let paused: Arc<Mutex<HashSet<usize>>> = Arc::default();
    let mut resumes = tokio::task::JoinSet::new();
    let db_restart_command = args.db_restart_command.as_deref().unwrap_or(DB_RESTART);
    let db_restart = args.db_restart || args.db_restart_command.is_some();
    let db_restart_at = db_restart.then_some(args.kills / 2);
    for k in 0..args.kills {
        let gap = interval.mul_f64(rng.random_range(0.5..1.5));
        clock.sleep(gap).await;
        // A processor that ended on its own (an abort after commit) is started again.
        workers.start()?;
        if Some(k) == db_restart_at {
            let status = Command::new("sh")
                .args(["-c", db_restart_command])
                .status()
                .await
                .context("running the PostgreSQL restart command")?;
            if !status.success() {
                bail!("the PostgreSQL restart command failed ({status}): {db_restart_command}");
            }
            faults.postgres_restart += 1;
            continue;
        }
        let running: Vec<usize> = {
            let paused = paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (0..n).filter(|i| !paused.contains(i)).collect()
        };
        let roll = rng.random_range(0..100);
        if roll < 25 || running.len() < 2 {
            broker.restart(Duration::from_millis(rng.random_range(100..1_000))).await?;
            if matches!(args.broker, BrokerKind::Serve) {
                faults.broker_sigkill += 1;
            } else {
                faults.broker_restart += 1;
            }
        } else if roll < 80 {
            let i = running[rng.random_range(0..running.len())];
            workers.kill(i).await?;
            faults.processor_sigkill += 1;
        } else {
            // Hold a processor past its lock: another one receives its messages while it
            // still has them in hand, then it goes on and commits or fails.
            let i = running[rng.random_range(0..running.len())];
            let Some(pid) = workers.pid(i) else { continue };
            if !signal(pid, "-STOP").await? {
                continue;
            }
            paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(i);
            let (paused, hold) = (Arc::clone(&paused), LOCK + Duration::from_secs(3));
            let clock = clock.clone();
            resumes.spawn(async move {
                clock.sleep(hold).await;
                // Gone meanwhile (it died on its own and was reaped): nothing to resume.
                let r = signal(pid, "-CONT").await.map(drop);
                paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&i);
                r
            });
            faults.processor_sigstop_past_lock += 1;
        }
    }
    while let Some(r) = resumes.join_next().await {
        r??;
    }
    sender.await.context("the sender")??;

    // Drain: the queue must empty, and so must the outbox and the events' queue. The counts
    // are read again once the processors have stopped (RabbitMQ counts only the messages
    // waiting, not those a processor holds); a message one of them put back starts them again.
    let drain_pool = pool_of(&args.store).await?;
    let outbox = Postgres::outbox(&drain_pool, &tables.outbox).await?;
    let drain_start = clock.now();
    let recorded = Arc::clone(&workers.events);
    let counts = async |broker: &ChaosBroker| {
        // What the run settled so far: orders whose claim committed (any later copy is a
        // duplicate) or that were dead-lettered, and events handled downstream. A broker that
        // keeps settled messages is told them apart by these. (A completion's own line can be
        // lost with a processor killed right after it.)
        let mut settled_orders: HashSet<String> =
            Postgres::texts(&drain_pool, &tables.inbox, "message_id", "consumer = 'shipping'")
                .await
                .unwrap_or_default()
                .into_iter()
                .collect();
        settled_orders.extend(
            recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().filter_map(
                |o| match &o.event {
                    Event::Completed { message_id } | Event::DeadLettered { message_id } => {
                        Some(message_id.clone())
                    }
                    _ => None,
                },
            ),
        );
        let handled_events: HashSet<String> =
            Postgres::texts(&drain_pool, &tables.points, "event_id", "1 = 1")
                .await
                .unwrap_or_default()
                .into_iter()
                .collect();
        let orders = broker.unsettled(false, &settled_orders).await.ok();
        let events = broker.unsettled(true, &handled_events).await.ok();
        let events_left = match (events, outbox.stats().await) {
            (Some(queued), Ok(stats)) => {
                Some(EventsLeft { unsent: stats.pending, queued: queued.left })
            }
            _ => None,
        };
        let kept = orders.map_or(0, |o| o.kept) + events.map_or(0, |e| e.kept);
        ((orders.map(|o| o.left), events_left), kept)
    };
    let ((left, events_left), kept_after_settlement) = loop {
        let mut zero_reads = 0;
        while zero_reads < 3 && clock.now().duration_since(drain_start) < DRAIN_TIMEOUT {
            workers.start()?;
            clock.sleep(Duration::from_millis(500)).await;
            zero_reads = if counts(broker).await.0 == DRAINED { zero_reads + 1 } else { 0 };
        }
        workers.stop().await;
        let read = counts(broker).await;
        if read.0 == DRAINED || clock.now().duration_since(drain_start) >= DRAIN_TIMEOUT {
            break read;
        }
    };

    let dead_letters = broker.dead_letters().await?;
    let events = std::mem::take(
        &mut *workers.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    faults.processor_abort_after_commit =
        events.iter().filter(|o| matches!(o.event, Event::AbortAfterCommit { .. })).count() as u64;
    faults.relay_abort_after_ack =
        events.iter().filter(|o| matches!(o.event, Event::AbortAfterRelayAck { .. })).count()
            as u64;
    let sent = std::mem::take(&mut *sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    let pool = sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(1)
        .connect(&args.store)
        .await
        .context("connecting to PostgreSQL")?;
    let shipments = Postgres::count_by_order(&pool, &tables.shipments).await?;
    let points = Postgres::count_by_order(&pool, &tables.points).await?;
    let event_ids = Postgres::texts(&pool, &tables.points, "event_id", "1 = 1").await?;
    let committed_event_ids =
        Postgres::texts(&pool, &tables.inbox, "message_id", "consumer = 'shipping'")
            .await?
            .iter()
            .map(|id| outgoing_message_id("shipping", &twice::MessageId::new(id), 0).into_string())
            .collect();
    let mut history = History {
        shipments,
        dead_letters,
        left_in_queue: left,
        events,
        points,
        event_ids,
        committed_event_ids,
        events_left,
        completions_confirmed: broker.completions_confirmed(),
        ..History::default()
    };
    for s in &sent {
        for (service, effects) in [(&payments, &mut history.charges), (&mail, &mut history.emails)]
        {
            let n = service.effects_for(s.order_id);
            if n > 0 {
                effects.insert(s.order_id, n);
            }
        }
    }
    let orders_without_id = sent.iter().filter(|s| s.without_id).count() as u64;
    history.sent = sent;
    let mut verdict = check::check(&history);
    verdict.idempotency_key_replays = payments.replays() + mail.replays();
    let violation_count = verdict.violation_count();
    Ok(Report {
        broker: args.broker.name(),
        orders: args.orders,
        orders_without_id,
        completions_confirmed: broker.completions_confirmed(),
        kept_after_settlement,
        processors: args.processors,
        batch: args.batch,
        seed: args.seed,
        elapsed_seconds: stopwatch.elapsed().as_secs_f64(),
        faults,
        verdict,
        violation_count,
    })
}

/// The table.
fn render(r: &Report) -> String {
    use std::fmt::Write as _;
    let (f, v) = (&r.faults, &r.verdict);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "twice chaos on {}: {} orders ({} sent without a message id), {} processors, {}, seed {}, \
         {:.1} s",
        r.broker,
        r.orders,
        r.orders_without_id,
        r.processors,
        if r.batch > 1 { format!("batches of {}", r.batch) } else { "no batches".to_owned() },
        r.seed,
        r.elapsed_seconds
    );
    let lines: [(&str, u64); 24] = [
        ("kills: processor SIGKILL", f.processor_sigkill),
        ("kills: broker SIGKILL", f.broker_sigkill),
        ("broker restarts", f.broker_restart),
        ("kills: processor abort after commit", f.processor_abort_after_commit),
        ("kills: relay abort after the broker's ack", f.relay_abort_after_ack),
        ("processor SIGSTOP past its lock", f.processor_sigstop_past_lock),
        ("PostgreSQL restarts", f.postgres_restart),
        ("sends invoked", v.sends_invoked),
        ("sends acknowledged", v.sends_acknowledged),
        ("deliveries", v.deliveries),
        ("handler runs", v.handler_runs),
        ("completions acknowledged", v.completions_acknowledged),
        ("completions failed", v.completions_failed),
        ("shipments", v.shipments),
        ("charges", v.charges),
        ("emails", v.emails),
        ("dead-lettered", v.dead_lettered),
        ("OrderShipped handled downstream", v.points),
        ("duplicates: stopped by the inbox", v.duplicates_prevented),
        ("  of them redelivered after a completion", v.redelivered_after_completion),
        ("duplicates: stopped by keys", v.idempotency_key_replays),
        ("poison orders", r.verdict.poison_orders),
        ("kept by the broker after their settlement", r.kept_after_settlement),
        ("violations", r.violation_count),
    ];
    for (name, n) in lines {
        let _ = writeln!(out, "{name:<40}{n:>10}");
    }
    for e in &v.examples {
        let _ = writeln!(out, "  {e}");
    }
    let redelivered = if r.completions_confirmed {
        "no completed message delivered again"
    } else {
        "every completed message the broker delivered again turned away by the inbox"
    };
    let _ = if r.violation_count == 0 {
        writeln!(
            out,
            "PASS  every acknowledged order shipped, charged, emailed and announced downstream exactly once; no event of rolled-back work; {redelivered}; every poison message dead-lettered; the queues and the outbox drained."
        )
    } else {
        writeln!(out, "FAIL")
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A processor chosen for a pause may die on its own and be reaped first: signalling it
    /// is no failure of the run, while a live one is signalled.
    #[tokio::test]
    async fn a_signal_to_a_process_that_is_gone_is_no_error() {
        let mut gone = std::process::Command::new("true").spawn().expect("spawn");
        let pid = gone.id();
        gone.wait().expect("reaped");
        assert!(!signal(pid, "-CONT").await.expect("no error"));
        assert!(!signal(pid, "-STOP").await.expect("no error"));
        let mut live = std::process::Command::new("sleep").arg("30").spawn().expect("spawn");
        assert!(signal(live.id(), "-STOP").await.expect("stopped"));
        assert!(signal(live.id(), "-CONT").await.expect("resumed"));
        live.kill().expect("kill");
        live.wait().expect("reaped");
    }

    #[test]
    fn event_lines_parse_and_anything_else_is_ignored() {
        let o = parse_event(2, "EV 1700 D order-7 3 1705").unwrap();
        assert_eq!((o.processor, o.at_millis), (2, 1700));
        assert_eq!(
            o.event,
            Event::Delivered {
                message_id: "order-7".into(),
                delivery_count: 3,
                locked_until: 1705
            }
        );
        let o = parse_event(0, "EV 9 F order-1").unwrap();
        assert_eq!(o.event, Event::CompletionFailed { message_id: "order-1".into() });
        assert!(parse_event(0, "ready").is_none());
        assert!(parse_event(0, "EV 9 D order-1").is_none(), "a delivery without its count");
        assert!(parse_event(0, "EV x C order-1").is_none());
    }
}
