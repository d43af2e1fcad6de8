//! `twice demo`: the seed's shipping example under injected faults, a naive handler and the
//! twice processor side by side on the embedded broker, or with `--broker` on RabbitMQ, NATS
//! JetStream, `twice serve` or a Service Bus namespace.
//!
//! Both columns get the same schedule of faults (from one `--seed`), each on its own queue of
//! one durable broker, with its own payment and mail services. The twice column must end with
//! exactly one shipment, one charge and one email per valid order and every poison message in
//! the dead-letter queue; the exit status says whether it did.

pub(crate) mod broker;
pub(crate) mod db;
mod downstream;
mod faults;
mod handlers;
mod plan;
#[cfg(test)]
mod prove;
mod report;
pub(crate) mod services;

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sqlx::{MySql, Pool, Postgres, Sqlite};
use tokio::sync::watch;
use twice::{
    CounterSnapshot, Inbox, Message, MessageId, OutboxStore, Processor, ProcessorOptions, Relay,
    RelayOptions, SharedClock, Stopwatch, Transport as _, json_fn,
};
use twice_sqlx::{InboxOptions, SqlxInbox, SqlxOutbox};

use self::broker::{BrokerKind, DemoBroker, DemoTransport};
use self::db::{DemoDb, Tables};
use self::faults::{FaultTable, FaultyReceiver};
use self::handlers::{Naive, NaiveCounters, OrderPlaced, Shop};
use self::plan::{FaultRates, OrderKind, Plan};
use self::report::{Column, Duplicates, Injected, Report};
use self::services::{Client, Service};
use crate::dlq::admin::Ca;

const NAIVE_QUEUE: &str = "orders-naive";
const TWICE_QUEUE: &str = "orders-twice";
const NAIVE_SHIPPED: &str = "shipped-naive";
const TWICE_SHIPPED: &str = "shipped-twice";
/// How long a run may make no progress before the demo says so.
const STALL_REPORT: Duration = Duration::from_secs(60);

/// Options of `twice demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// How many orders to send.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    orders: u64,
    /// The seed of the fault schedule: the same seed gives the same faults.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The inbox database: `postgres://…`, `mysql://…`, or `sqlite:PATH`. Default: an SQLite
    /// file in the run's temporary directory.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// The broker: `embedded` (in the run's temporary directory), `serve` (`twice serve` in
    /// process on a loopback port, reached over AMQP with the Service Bus client),
    /// `amqp://user:pass@host:port/vhost` (RabbitMQ, quorum queues), `nats://host:port` (NATS
    /// JetStream), or a Service Bus connection string (`Endpoint=sb://…;SharedAccessKeyName=…;
    /// SharedAccessKey=…`) whose namespace has the queues orders-naive and orders-twice. On
    /// RabbitMQ and NATS the queues are named after the run and deleted at the end.
    #[arg(long, value_name = "URL", default_value = "embedded", value_parser = BrokerKind::parse)]
    broker: BrokerKind,
    /// With RabbitMQ or NATS: run on the queues PREFIX-naive and PREFIX-twice (on NATS the
    /// streams PREFIX_NAIVE and PREFIX_TWICE) as they are, for instance quorum queues you
    /// declared yourself with arguments of your own, instead of queues named after the run.
    /// Missing ones are created. They are emptied at the start and left, empty, at the end; what
    /// a queue lacks (a delivery limit, a dead-letter target) is printed as a note.
    #[arg(long, value_name = "PREFIX")]
    queues: Option<String>,
    /// With a connection string: the namespace's administration API, through which missing
    /// queues are created (default: the TWICE_ADMIN_URL variable, which `twice serve` prints,
    /// else `http://HOST:5300` for the emulator and `twice serve`, `https://HOST` for Azure).
    #[arg(
        long,
        env = crate::dlq::admin::ADMIN_URL_VAR,
        value_name = "URL",
        value_parser = crate::dlq::admin::AdminUrl::parse
    )]
    admin_url: Option<crate::dlq::admin::AdminUrl>,
    /// With a connection string: trust only the CA certificates in this PEM file for TLS
    /// (amqps and the administration API over https) instead of the public roots, for a
    /// `twice serve --tls-cert` whose certificate a CA of your own signed.
    #[arg(long, value_name = "FILE")]
    ca_file: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// MaxConcurrentCalls of each consumer.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=256))]
    concurrency: u64,
    /// How many received messages the twice processor handles in one transaction (1: one
    /// transaction per message); each handler runs under a savepoint of its own.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    batch: u64,
    /// The queues' LockDuration, in seconds (Service Bus allows 5 to 300).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(5..=300))]
    lock_seconds: u64,
    /// Print every error the twice processor meets (a line each) to stderr.
    #[arg(long)]
    verbose: bool,
    /// Keep the broker's data directory and the SQLite file, and print where they are.
    #[arg(long)]
    keep: bool,
    /// Share of orders whose send is retried with the same MessageId.
    #[arg(long, default_value_t = 0.05, value_parser = rate)]
    retry_rate: f64,
    /// Share of orders published a second time with another MessageId.
    #[arg(long, default_value_t = 0.03, value_parser = rate)]
    republish_rate: f64,
    /// Share of orders whose handler crashes after commit, before complete.
    #[arg(long, default_value_t = 0.03, value_parser = rate)]
    crash_rate: f64,
    /// How many handlers outlive their lock without renewing it (a pause). On SQLite each one
    /// holds the database's only write lock until its message lock expires.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(0..=1000))]
    slow: u64,
    /// Share of orders whose handler fails with transient errors (1 to 3 times).
    #[arg(long, default_value_t = 0.05, value_parser = rate)]
    transient_rate: f64,
    /// Share of messages whose body is not JSON.
    #[arg(long, default_value_t = 0.005, value_parser = rate)]
    bad_json_rate: f64,
    /// Share of orders the handler always rejects.
    #[arg(long, default_value_t = 0.005, value_parser = rate)]
    reject_rate: f64,
}

pub(crate) fn rate(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&r) { Ok(r) } else { Err(format!("{r} is not between 0 and 1")) }
}

/// Runs the demo; the exit code is success iff the invariants hold for twice.
pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    if args.ca_file.is_some() && !matches!(args.broker, BrokerKind::ServiceBus(_)) {
        bail!("--ca-file applies to a Service Bus connection string given with --broker");
    }
    if args.queues.is_some()
        && !matches!(args.broker, BrokerKind::RabbitMq(_) | BrokerKind::Nats(_))
    {
        bail!("--queues applies to RabbitMQ (--broker amqp://…) and NATS (--broker nats://…)");
    }
    let rates = FaultRates {
        sender_retry: args.retry_rate,
        republish: args.republish_rate,
        crash_after_commit: args.crash_rate,
        slow: args.slow,
        transient: args.transient_rate,
        poison_json: args.bad_json_rate,
        poison_rejected: args.reject_rate,
    };
    let plan = Plan::new(args.orders, args.seed, &rates);
    let workdir = tempfile::Builder::new()
        .prefix("twice-demo-")
        .tempdir()
        .context("creating a temporary directory")?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let tables = Tables::new(&run_id);
    let store = args
        .store
        .clone()
        .unwrap_or_else(|| format!("sqlite:{}", workdir.path().join("shop.db").display()));
    let report = if let Some(path) = store.strip_prefix("sqlite:") {
        let path = PathBuf::from(path.trim_start_matches("//"));
        let pool = sqlx::pool::PoolOptions::<Sqlite>::new()
            .max_connections(u32::try_from(args.concurrency).unwrap_or(16) * 2 + 4)
            .connect_with(twice_sqlx::sqlite::connect_options(&path))
            .await
            .with_context(|| format!("opening the SQLite database {}", path.display()))?;
        // The naive handler writes to a file of its own, so that the twice column's stalled
        // transactions (SQLite has one writer at a time) do not slow it down, nor it them.
        let naive_path = path.with_extension("naive.db");
        let naive_pool = sqlx::pool::PoolOptions::<Sqlite>::new()
            .max_connections(u32::try_from(args.concurrency).unwrap_or(16) + 2)
            .connect_with(twice_sqlx::sqlite::connect_options(&naive_path))
            .await
            .with_context(|| format!("opening the SQLite database {}", naive_path.display()))?;
        run_on::<Sqlite>(&args, &plan, &workdir, pool, naive_pool, tables, "sqlite").await?
    } else if store.starts_with("postgres://") || store.starts_with("postgresql://") {
        // Both handlers share the pool: the processor needs a connection per concurrent call
        // (it refuses to start with fewer), the naive handler as many again.
        let pool = sqlx::pool::PoolOptions::<Postgres>::new()
            .max_connections(u32::try_from(args.concurrency).unwrap_or(16) * 2 + 4)
            .connect(&store)
            .await
            .context("connecting to PostgreSQL")?;
        run_on::<Postgres>(&args, &plan, &workdir, pool.clone(), pool, tables, "postgres").await?
    } else if store.starts_with("mysql://") || store.starts_with("mariadb://") {
        let url = store.replacen("mariadb://", "mysql://", 1);
        let pool = sqlx::pool::PoolOptions::<MySql>::new()
            .max_connections(u32::try_from(args.concurrency).unwrap_or(16) * 2 + 4)
            .connect(&url)
            .await
            .context("connecting to MariaDB/MySQL")?;
        run_on::<MySql>(&args, &plan, &workdir, pool.clone(), pool, tables, "mysql").await?
    } else {
        bail!("unknown store {store:?}: use postgres://…, mysql://… or sqlite:PATH");
    };
    if args.keep {
        let kept = workdir.keep();
        eprintln!("kept the broker data and the SQLite file in {}", kept.display());
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(if report.invariants_hold { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The demo on one database type.
async fn run_on<DB>(
    args: &DemoArgs,
    plan: &Plan,
    workdir: &tempfile::TempDir,
    pool: Pool<DB>,
    naive_pool: Pool<DB>,
    tables: Tables,
    store_name: &str,
) -> anyhow::Result<Report>
where
    DB: DemoDb,
    SqlxInbox<DB>: Inbox<Tx = sqlx::Transaction<'static, DB>>,
    SqlxOutbox<DB>: OutboxStore,
{
    let stopwatch = Stopwatch::start();
    DB::create_tables(&pool, &tables).await?;
    if args.store.is_none() {
        DB::create_tables(&naive_pool, &tables).await?;
    }
    let pools = Pools { twice: pool.clone(), naive: naive_pool };
    let result =
        run_tables::<DB>(args, plan, workdir, &pools, &tables, store_name, stopwatch).await;
    if !args.keep || args.store.is_some() {
        // Leave nothing behind in a shared database, even when the run failed.
        let _ = DB::drop_tables(&pool, &tables).await;
    }
    result
}

/// Opens the broker and its two queues, runs, and removes the queues from a shared server.
async fn run_tables<DB>(
    args: &DemoArgs,
    plan: &Plan,
    workdir: &tempfile::TempDir,
    pools: &Pools<DB>,
    tables: &Tables,
    store_name: &str,
    stopwatch: Stopwatch,
) -> anyhow::Result<Report>
where
    DB: DemoDb,
    SqlxInbox<DB>: Inbox<Tx = sqlx::Transaction<'static, DB>>,
    SqlxOutbox<DB>: OutboxStore,
{
    let clock = SharedClock::system();
    let lock = Duration::from_secs(args.lock_seconds);
    let broker_run = format!("{:08x}", rand::random::<u32>());
    let ca = args.ca_file.as_deref().map(Ca::load).transpose().map_err(|e| anyhow::anyhow!(e))?;
    let broker = DemoBroker::open(
        &args.broker,
        &workdir.path().join("broker"),
        clock.clone(),
        &broker_run,
        args.admin_url.clone(),
        ca,
        args.queues.clone(),
    )
    .await?;
    // A batch takes that many messages per call: the transports' windows grow with it.
    let window = usize::try_from(args.concurrency * args.batch).unwrap_or(16);
    let queue = |name| broker.queue(name, lock, &clock, window);
    let queues = Queues {
        naive: Arc::new(queue(NAIVE_QUEUE).await?),
        twice: Arc::new(queue(TWICE_QUEUE).await?),
        naive_shipped: Arc::new(queue(NAIVE_SHIPPED).await?),
        twice_shipped: Arc::new(queue(TWICE_SHIPPED).await?),
    };
    let result = run_queues::<DB>(args, plan, pools, tables, store_name, stopwatch, &queues).await;
    if !args.keep {
        // Leave nothing behind on a shared server, even when the run failed; the order queues
        // named with --queues are the user's, the event queues are always the run's.
        let ours = if args.queues.is_some() { &queues.all()[2..] } else { &queues.all()[..] };
        for q in ours {
            let _ = q.delete().await;
        }
    }
    broker.shutdown().await;
    result
}

#[allow(clippy::too_many_lines)] // reason: one linear story: set up, send, consume, count
async fn run_queues<DB>(
    args: &DemoArgs,
    plan: &Plan,
    pools: &Pools<DB>,
    tables: &Tables,
    store_name: &str,
    stopwatch: Stopwatch,
    queues: &Queues,
) -> anyhow::Result<Report>
where
    DB: DemoDb,
    SqlxInbox<DB>: Inbox<Tx = sqlx::Transaction<'static, DB>>,
    SqlxOutbox<DB>: OutboxStore,
{
    let clock = SharedClock::system();
    let lock = Duration::from_secs(args.lock_seconds);
    let (naive_queue, twice_queue) = (&queues.naive, &queues.twice);

    let faults = Arc::new(FaultTable::new(plan));
    let services = [
        Service::start("payments").await?,
        Service::start("mail").await?,
        Service::start("payments").await?,
        Service::start("mail").await?,
    ];
    let [naive_payments, naive_mail, twice_payments, twice_mail] = &services;
    let shop = |p: &Service, m: &Service| {
        Arc::new(Shop {
            payments: Client::new(p.addr()),
            mail: Client::new(m.addr()),
            faults: Arc::clone(&faults),
            stall: lock + Duration::from_secs(2),
            clock: clock.clone(),
        })
    };
    let concurrency = usize::try_from(args.concurrency).unwrap_or(16);

    // The senders: every publication of every order to both queues.
    let (sent_tx, sent_rx) = watch::channel(false);
    let broker_duplicates = Arc::new(BrokerDuplicates::default());
    let sender = tokio::spawn(send_all(
        [Arc::clone(naive_queue), Arc::clone(twice_queue)],
        plan.clone(),
        Arc::clone(&broker_duplicates),
        sent_tx,
    ));

    // The naive consumer.
    let naive_counters = Arc::new(NaiveCounters::default());
    let naive = Arc::new(Naive::<DB> {
        receiver: Arc::new(FaultyReceiver::new(Arc::clone(naive_queue), Arc::clone(&faults))),
        pool: pools.naive.clone(),
        table: tables.naive_shipments.clone(),
        shop: shop(naive_payments, naive_mail),
        counters: Arc::clone(&naive_counters),
        concurrency,
        events: Arc::clone(&queues.naive_shipped),
    });

    // The twice processor, rebuilt after the restart.
    let twice_shop = shop(twice_payments, twice_mail);
    let twice_receiver =
        Arc::new(FaultyReceiver::new(Arc::clone(twice_queue), Arc::clone(&faults)));
    let outbox = DB::outbox(&pools.twice, &tables.outbox).await?;
    let inbox = Arc::new(
        SqlxInbox::<DB>::new(
            pools.twice.clone(),
            InboxOptions::new()
                .table(tables.inbox.clone())
                .business_key(tables.shipments.clone(), tables.shipments_key.clone()),
        )
        .await
        .context("creating the inbox")?
        .with_outbox(outbox.clone()),
    );
    // The relay of the twice column's outbox, made again after the restart; its leases last
    // a lock, so the rows a killed relay held go out again soon after.
    let relay_counters: Arc<std::sync::Mutex<Vec<Arc<twice::outbox::RelayCounters>>>> =
        Arc::default();
    let publisher = Arc::new(downstream::DemoPublisher {
        shipped: Arc::clone(&queues.twice_shipped),
        duplicates: std::sync::atomic::AtomicU64::new(0),
    });
    // Once the broker has acknowledged half the valid orders' events, the relay stops right
    // after an acknowledgement, before deleting its rows, as a crash there would; the demo
    // then starts another.
    let acknowledged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let relay_deaths = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let die_after = (plan.valid_orders() / 2).max(1);
    let new_relay = || {
        let (acknowledged, deaths) = (Arc::clone(&acknowledged), Arc::clone(&relay_deaths));
        let relay = Relay::from_arcs(
            Arc::new(outbox.clone()),
            Arc::clone(&publisher),
            RelayOptions::new().lease_duration(lock).clock(clock.clone()),
        )
        .on_acknowledged(move |seqs| {
            let before = acknowledged.fetch_add(seqs.len() as u64, Ordering::SeqCst);
            let crossed = before < die_after && before + seqs.len() as u64 >= die_after;
            if crossed && deaths.fetch_add(1, Ordering::SeqCst) == 0 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        });
        relay_counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(relay.counters());
        relay
    };
    // The loyalty services of both columns.
    let loyalty = [
        downstream::loyalty::<DB>(
            Arc::clone(&queues.naive_shipped),
            pools.naive.clone(),
            &tables.naive_loyalty_inbox,
            &tables.naive_points,
            concurrency,
            clock.clone(),
        )
        .await?,
        downstream::loyalty::<DB>(
            Arc::clone(&queues.twice_shipped),
            pools.twice.clone(),
            &tables.loyalty_inbox,
            &tables.points,
            concurrency,
            clock.clone(),
        )
        .await?,
    ];
    let handler = {
        let shop = Arc::clone(&twice_shop);
        let table: Arc<str> = tables.shipments.clone().into();
        Arc::new(json_fn(
            move |ctx, order: OrderPlaced, tx: &mut sqlx::Transaction<'static, DB>| {
                let shop = Arc::clone(&shop);
                let table = Arc::clone(&table);
                Box::pin(async move {
                    handlers::handle_twice::<DB>(&shop, &table, ctx, order, tx).await
                })
            },
        ))
    };
    let options = ProcessorOptions::new()
        .consumer("shipping")
        .max_concurrent_calls(concurrency)
        .batch_size(usize::try_from(args.batch).unwrap_or(1))
        .max_wait(Duration::from_millis(200))
        .clock(clock.clone());
    let errors: Arc<std::sync::Mutex<BTreeMap<String, u64>>> = Arc::default();
    let verbose = args.verbose;
    let new_processor = || {
        let errors = Arc::clone(&errors);
        Processor::from_arcs(
            Arc::clone(&twice_receiver),
            Arc::clone(&inbox),
            Arc::clone(&handler),
            options.clone(),
        )
        .on_error(move |e| {
            if verbose {
                eprintln!("{e}");
            }
            let mut errors = errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *errors.entry(e.error_source().to_string()).or_default() += 1;
        })
    };

    let progress = progress_bar(args, plan);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // First incarnations.
    let first = new_processor();
    let first_counters = first.counters();
    let mut twice_task = tokio::spawn(first.run(stopped(stop_rx.clone())));
    let mut relay_task = tokio::spawn(new_relay().run(stopped(stop_rx.clone())));
    let loyalty_counters: Vec<_> = loyalty.iter().map(Processor::counters).collect();
    let loyalty_tasks: Vec<_> =
        loyalty.into_iter().map(|p| tokio::spawn(p.run(stopped(stop_rx.clone())))).collect();
    let mut naive_task = tokio::spawn(Arc::clone(&naive).run(stopped(stop_rx.clone())));
    let mut restarted = false;
    let mut last_progress = ((0, 0), clock.now());
    let mut second_counters = None;
    let mut last_delivery = (0, clock.now());
    let total =
        plan.orders.len() as u64 + plan.orders.iter().filter(|o| o.republished).count() as u64;

    loop {
        clock.sleep(Duration::from_millis(100)).await;
        // The restart in the middle of the run: both consumers are killed (their handlers in
        // flight are dropped, their transactions roll back, their locks are left to expire)
        // and started again.
        if !restarted
            && first_counters.snapshot().received >= plan.restart_after
            && naive_counters.deliveries.load(Ordering::Relaxed) >= plan.restart_after
        {
            restarted = true;
            let say = |what: &str| {
                if verbose {
                    eprintln!("restart: {what}");
                }
            };
            say("aborting both consumers");
            twice_task.abort();
            naive_task.abort();
            let _ = (&mut twice_task).await;
            say("the twice processor has stopped");
            let _ = (&mut naive_task).await;
            say("the naive consumer has stopped");
            let second = new_processor();
            second_counters = Some(second.counters());
            twice_task = tokio::spawn(second.run(stopped(stop_rx.clone())));
            naive_task = tokio::spawn(Arc::clone(&naive).run(stopped(stop_rx.clone())));
        }
        let handled = first_counters.snapshot().received
            + second_counters.as_ref().map_or(0, |c| c.snapshot().received)
            + naive_counters.deliveries.load(Ordering::Relaxed)
            + loyalty_counters.iter().map(|c| c.snapshot().received).sum::<u64>();
        let (naive_left, twice_left) =
            (naive_queue.unsettled().await?, twice_queue.unsettled().await?);
        // The events too: the outbox's rows not yet sent, and both event queues.
        let events = events_left(queues, &outbox).await?;
        // Read after the counts: a sender that finished meanwhile has said so.
        let sent = *sent_rx.borrow();
        let position = match (naive_left, twice_left) {
            (Some(n), Some(t)) => total.saturating_sub(n) + total.saturating_sub(t),
            // Without counts, the deliveries handled stand in for progress.
            _ => handled.min(2 * total),
        };
        progress.set_position(position);
        // A watchdog: a run that stops making progress says where it stands instead of
        // waiting silently.
        if (position, handled) != last_progress.0 {
            last_progress = ((position, handled), clock.now());
        } else if clock.now().duration_since(last_progress.1) >= STALL_REPORT {
            last_progress.1 = clock.now();
            progress.suspend(|| {
                eprintln!(
                    "warning: no progress for {} s: naive queue {} unsettled, twice queue {} unsettled, \
                     {handled} deliveries handled, restarted: {restarted}",
                    STALL_REPORT.as_secs(),
                    shown(naive_left),
                    shown(twice_left),
                );
            });
        }
        let settled = restarted || plan.restart_after == 0;
        match (naive_left, twice_left) {
            (Some(n), Some(t)) if sent && settled && n + t == 0 && events == Some(0) => {
                // Read again after a pause: a message on its way from a server to a receiver
                // is in neither count for a moment.
                clock.sleep(Duration::from_millis(300)).await;
                let again = (naive_queue.unsettled().await?, twice_queue.unsettled().await?);
                if again == (Some(0), Some(0)) && events_left(queues, &outbox).await? == Some(0) {
                    break;
                }
            }
            (Some(_), Some(_)) => {}
            // Without counts: done once nothing was delivered for long enough that a locked
            // message (a crash, a stalled handler) would have come back.
            _ if sent
                && settled
                && clock.now().duration_since(last_delivery.1) >= quiet_after(lock) =>
            {
                break;
            }
            _ => {}
        }
        if handled != last_delivery.0 {
            last_delivery = (handled, clock.now());
        }
        if relay_task.is_finished() {
            // Stopped after an acknowledgement: another relay takes over, and sends what the
            // first one left leased once those leases end.
            relay_task = tokio::spawn(new_relay().run(stopped(stop_rx.clone())));
        }
        if twice_task.is_finished() {
            // The processor runs until the stop signal: ended before it, it failed (for
            // example a pool too small for its concurrency). Say why instead of waiting.
            match (&mut twice_task).await {
                Ok(Err(e)) => bail!("the twice processor stopped: {e}"),
                Err(e) if e.is_panic() => bail!("the twice processor panicked"),
                _ => bail!("the twice processor stopped before the run ended"),
            }
        }
        if sender.is_finished() && !sent {
            // The sender failed: surface its error.
            sender.await??;
            bail!("the sender stopped before sending everything");
        }
    }
    let _ = stop_tx.send(true);
    let _ = naive_task.await;
    let _ = relay_task.await;
    for t in loyalty_tasks {
        let _ = t.await;
    }
    let twice_result = twice_task.await;
    progress.finish_and_clear();
    match twice_result {
        Ok(Ok(())) | Err(_) => {}
        Ok(Err(e)) => return Err(e).context("the twice processor stopped"),
    }
    sender.await??;

    // Count what really happened.
    let mut counters = first_counters.snapshot();
    if let Some(c) = second_counters {
        add(&mut counters, &c.snapshot());
    }
    let naive_ship = DB::count_by_order(&pools.naive, &tables.naive_shipments).await?;
    let twice_ship = DB::count_by_order(&pools.twice, &tables.shipments).await?;
    let naive_dlq = naive_queue.dead_letters().await?;
    let twice_dlq = twice_queue.dead_letters().await?;
    // Without counts, what a last receive still finds was not handled: it counts as lost.
    let mut twice_left_over = 0;
    if twice_queue.unsettled().await?.is_none() {
        let _ = naive_queue.left_over(Duration::from_secs(1)).await?;
        twice_left_over = twice_queue.left_over(Duration::from_secs(1)).await?;
    }

    let mut naive_col = column(plan, &naive_ship, naive_payments, naive_mail, &naive_dlq);
    naive_col.deliveries = naive_counters.deliveries.load(Ordering::Relaxed);
    naive_col.abandoned = naive_counters.abandoned.load(Ordering::Relaxed);
    naive_col.duplicates.broker = broker_duplicates.naive.load(Ordering::Relaxed);

    let mut twice_col = column(plan, &twice_ship, twice_payments, twice_mail, &twice_dlq);
    twice_col.lost += twice_left_over;
    twice_col.deliveries = counters.received;
    twice_col.abandoned = counters.abandoned;
    twice_col.duplicates = Duplicates {
        broker: broker_duplicates.twice.load(Ordering::Relaxed),
        inbox: counters.duplicates_already_processed + counters.duplicates_concurrent_copy,
        business_key: counters.duplicates_business_key,
        idempotency_key: twice_payments.replays() + twice_mail.replays(),
    };
    twice_col.errors = errors.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();

    // The events, as the loyalty services saw them.
    let naive_points = DB::count_by_order(&pools.naive, &tables.naive_points).await?;
    let twice_points = DB::count_by_order(&pools.twice, &tables.points).await?;
    let naive_events = DB::texts(&pools.naive, &tables.naive_points, "event_id", "1 = 1").await?;
    let twice_events = DB::texts(&pools.twice, &tables.points, "event_id", "1 = 1").await?;
    let committed =
        DB::texts(&pools.twice, &tables.inbox, "message_id", "consumer = 'shipping'").await?;
    naive_col.events = downstream::events(plan, &naive_points, &naive_events, None);
    naive_col.events.published = naive_counters.published.load(Ordering::Relaxed);
    naive_col.events.for_rolled_back_work = naive_counters.ghosts.load(Ordering::Relaxed);
    twice_col.events = downstream::events(plan, &twice_points, &twice_events, Some(&committed));
    twice_col.events.published = relay_counters
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|c| c.snapshot().sent)
        .sum();
    for (column, c) in [&mut naive_col, &mut twice_col].into_iter().zip(&loyalty_counters) {
        let c = c.snapshot();
        column.events.duplicates_downstream =
            c.duplicates_already_processed + c.duplicates_concurrent_copy;
    }
    twice_col.events.duplicates_downstream += publisher.duplicates.load(Ordering::Relaxed);
    let valid = plan.valid_orders();
    let poison = plan.poison();
    let invariants_hold = Report::twice_holds(&twice_col, valid, poison);
    Ok(Report {
        orders: plan.orders.len() as u64,
        valid_orders: valid,
        poison,
        seed: args.seed,
        store: store_name.to_owned(),
        broker: args.broker.name().to_owned(),
        broker_reports_duplicates: args.broker.reports_duplicates(),
        elapsed_seconds: stopwatch.elapsed().as_secs_f64(),
        faults: Injected {
            completions_lost: twice_receiver.lost_completions(),
            relay_stopped_after_ack: relay_deaths.load(Ordering::SeqCst),
            ..injected(plan)
        },
        naive: naive_col,
        twice: twice_col,
        invariants_hold,
    })
}

/// The run's four queues: the orders of each column and the events each column sends.
struct Queues {
    naive: Arc<DemoTransport>,
    twice: Arc<DemoTransport>,
    naive_shipped: Arc<DemoTransport>,
    twice_shipped: Arc<DemoTransport>,
}

impl Queues {
    fn all(&self) -> [&Arc<DemoTransport>; 4] {
        [&self.naive, &self.twice, &self.naive_shipped, &self.twice_shipped]
    }
}

/// Events not yet handled by the loyalty services: the outbox's pending rows and what both
/// event queues hold; `None` where a broker gives no counts.
async fn events_left<S: OutboxStore>(queues: &Queues, outbox: &S) -> anyhow::Result<Option<u64>> {
    let pending = outbox.stats().await.map_err(|e| anyhow::anyhow!("reading the outbox: {e}"))?;
    let naive = queues.naive_shipped.unsettled().await?;
    let twice = queues.twice_shipped.unsettled().await?;
    Ok(naive.zip(twice).map(|(n, t)| n + t + pending.pending))
}

/// How long a run without message counts waits with no delivery before it ends: past a lock
/// and a stalled handler, so a message whose lock runs out has come back.
fn quiet_after(lock: Duration) -> Duration {
    2 * lock + Duration::from_secs(5)
}

fn shown(n: Option<u64>) -> String {
    n.map_or_else(|| "?".to_owned(), |n| n.to_string())
}

/// The connection pools of the two columns (one pool on a server database; two SQLite files).
struct Pools<DB: sqlx::Database> {
    twice: Pool<DB>,
    naive: Pool<DB>,
}

/// Re-sent message ids each queue's broker dropped.
#[derive(Debug, Default)]
struct BrokerDuplicates {
    naive: std::sync::atomic::AtomicU64,
    twice: std::sync::atomic::AtomicU64,
}

/// Sends every publication of every order to both queues, from a few concurrent senders.
async fn send_all(
    queues: [Arc<DemoTransport>; 2],
    plan: Plan,
    duplicates: Arc<BrokerDuplicates>,
    done: watch::Sender<bool>,
) -> anyhow::Result<()> {
    const SENDERS: usize = 8;
    let plan = Arc::new(plan);
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..SENDERS {
        let (queues, plan, duplicates) =
            (queues.clone(), Arc::clone(&plan), Arc::clone(&duplicates));
        tasks.spawn(async move {
            for order in plan.orders.iter().skip(lane).step_by(SENDERS) {
                let body = order.body();
                let mut publications = vec![order.message_id()];
                // A sender retry re-sends the same id (a send that timed out after the broker
                // stored it); a republication is the same order under a new id.
                for _ in 0..order.retries {
                    publications.push(order.message_id());
                }
                if order.republished {
                    publications.push(order.republished_message_id());
                }
                for id in publications {
                    for (queue, dropped) in
                        queues.iter().zip([&duplicates.naive, &duplicates.twice])
                    {
                        let message = Message::new(body.clone())
                            .with_message_id(id.as_str())
                            .with_content_type("application/json");
                        let duplicate = queue
                            .send(message)
                            .await
                            .with_context(|| format!("sending {id} to {}", queue.entity().path))?;
                        if duplicate {
                            dropped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let _ = done.send(true);
    Ok(())
}

/// One column from what the database, the services and the dead-letter queue say.
fn column(
    plan: &Plan,
    shipments: &HashMap<u64, u64>,
    payments: &Service,
    mail: &Service,
    dlq: &HashMap<MessageId, String>,
) -> Column {
    let mut c = Column {
        shipments: shipments.values().sum(),
        charges: payments.effects(),
        emails: mail.effects(),
        dead_lettered: dlq.len() as u64,
        ..Column::default()
    };
    for o in &plan.orders {
        let s = shipments.get(&o.order_id).copied().unwrap_or(0);
        let ch = u64::from(payments.effects_for(o.order_id));
        let em = u64::from(mail.effects_for(o.order_id));
        if ch > 1 {
            c.orders_charged_twice += 1;
        }
        match o.kind {
            OrderKind::Valid => {
                if s == 0 || ch == 0 || em == 0 {
                    c.lost += 1;
                }
                if s > 1 || ch > 1 || em > 1 {
                    c.repeated += 1;
                }
            }
            OrderKind::BadJson | OrderKind::Rejected => {
                let in_dlq =
                    dlq.get(&MessageId::new(o.message_id())).is_some_and(|r| !r.is_empty());
                if !in_dlq {
                    c.poison_missing_from_dlq += 1;
                }
            }
        }
    }
    c
}

fn injected(plan: &Plan) -> Injected {
    let count =
        |f: fn(&plan::PlannedOrder) -> bool| plan.orders.iter().filter(|o| f(o)).count() as u64;
    Injected {
        sender_retries: plan.orders.iter().map(|o| u64::from(o.retries)).sum(),
        republished: count(|o| o.republished),
        crashes_after_commit: count(|o| o.crash_after_commit),
        slow_handlers: count(|o| o.slow),
        transient_errors: plan.orders.iter().map(|o| u64::from(o.transient_failures)).sum(),
        bad_json: count(|o| o.kind == OrderKind::BadJson),
        rejected_orders: count(|o| o.kind == OrderKind::Rejected),
        restart_after_deliveries: plan.restart_after,
        completions_lost: 0,
        relay_stopped_after_ack: 0,
    }
}

fn add(total: &mut CounterSnapshot, c: &CounterSnapshot) {
    total.received += c.received;
    total.abandoned += c.abandoned;
    total.dead_lettered += c.dead_lettered;
    total.duplicates_already_processed += c.duplicates_already_processed;
    total.duplicates_concurrent_copy += c.duplicates_concurrent_copy;
    total.duplicates_business_key += c.duplicates_business_key;
}

fn progress_bar(args: &DemoArgs, plan: &Plan) -> ProgressBar {
    let total = 2
        * (plan.orders.len() as u64 + plan.orders.iter().filter(|o| o.republished).count() as u64);
    if args.json || !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {elapsed:>4} [{bar:40}] {pos}/{len} messages settled",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
