//! The transactional outbox's cost and latency, with the PostgreSQL store.
//!
//! ```sh
//! cargo run --release -p twice-testkit --example bench_outbox -- 20000 3
//! ```
//!
//! 1. The processor at 16 concurrent calls on the durable embedded broker, its handler sending
//!    nothing, then one message through the outbox (with a relay running, sending those to a
//!    second queue), alternated `ROUNDS` times in one run: messages per second and the ratio.
//! 2. The relay's lag, from a row's write (just before its transaction commits) to the
//!    broker's acknowledgement of its send, with rows committed at 1,000 per second by their
//!    own transactions (a producer outside a handler): p50, p99 and the maximum, on the durable
//!    embedded broker and over AMQP to `twice serve` (the Service Bus client).
//!
//! With `TWICE_BENCH_BATCH=N` the processor of part 1 handles up to `N` messages per
//! transaction (`ProcessorOptions::batch_size`), with and without the outbox alike.
//!
//! With `TWICE_BENCH_ONLY=outbox` (or `plain`) only that side of part 1 runs, and not part 2:
//! to profile one side.
//!
//! With `TWICE_BENCH_NO_RELAY=1` no relay runs in part 1 (the rows stay in the table): what
//! the rows' writes alone cost. Needs PostgreSQL on its usual port. Prints numbers; nothing
//! passes or fails.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use twice::{
    HandlerError, Message, Outcome, Processor, ProcessorOptions, Publish, Relay, RelayOptions,
    SharedClock, Stopwatch, handler_fn,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, OutboxOptions, SqlxInbox, SqlxOutbox};
use twice_testkit::db::PgDatabase;

const CONCURRENCY: usize = 16;
const SENDERS: usize = 32;
type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

/// Fills `queue` with `n` messages of 256 bytes with distinct ids.
async fn fill(broker: &Broker, queue: &str, n: usize, round: usize) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..SENDERS {
        let (broker, queue) = (broker.clone(), queue.to_owned());
        tasks.spawn(async move {
            for i in (lane..n).step_by(SENDERS) {
                // Ids of their own per queue: the runs share one inbox.
                let id = format!("{queue}-r{round}-m-{i}");
                let m = Message::new(vec![b'x'; 256]).with_message_id(id);
                broker.send(&queue, m).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// CPU seconds used so far (user + system) by this process and by every `postgres` process.
fn cpu_seconds() -> (f64, f64) {
    fn ticks(stat: &str) -> Option<(String, u64)> {
        // pid (comm) state ppid … utime stime: fields 14 and 15, counted after the comm.
        let (head, rest) = stat.rsplit_once(')')?;
        let comm = head.split_once('(')?.1.to_owned();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((comm, utime + stime))
    }
    const HZ: f64 = 100.0; // USER_HZ on Linux
    let own = std::fs::read_to_string("/proc/self/stat").ok().and_then(|s| ticks(&s));
    let mut postgres = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if let Some((comm, t)) = ticks(&stat)
                && comm.starts_with("postgres")
            {
                postgres += t;
            }
        }
    }
    #[allow(clippy::cast_precision_loss)] // reason: tick counts far below 2^52
    (own.map_or(0.0, |(_, t)| t as f64 / HZ), postgres as f64 / HZ)
}

fn rate(n: usize, watch: &Stopwatch) -> f64 {
    #[allow(clippy::cast_precision_loss)] // reason: a count far below 2^52
    let n = n as f64;
    n / watch.elapsed().as_secs_f64()
}

/// The processor on `queue` until `n` messages are completed; with `outbox`, its handler
/// sends one message through it and a relay sends those to `events`. Messages per second.
async fn process(
    broker: &Broker,
    queue: &str,
    n: usize,
    pool: sqlx::PgPool,
    outbox: Option<SqlxOutbox<sqlx::Postgres>>,
) -> anyhow::Result<Run> {
    let inbox = SqlxInbox::<sqlx::Postgres>::new(pool, InboxOptions::new()).await?;
    let inbox = match &outbox {
        Some(o) => inbox.with_outbox(o.clone()),
        None => inbox,
    };
    let sends = outbox.is_some();
    let handler = handler_fn::<Tx, _>(move |ctx, _tx| {
        Box::pin(async move {
            if sends {
                ctx.send("events", Message::new(vec![b'y'; 256]))?;
            }
            Ok::<_, HandlerError>(Outcome::Complete)
        })
    });
    let options = ProcessorOptions::new()
        .consumer("bench")
        .max_concurrent_calls(CONCURRENCY)
        .batch_size(batch_size()?)
        .max_wait(Duration::from_millis(200));
    let processor = Processor::new(broker.receiver(queue).await?, inbox, handler, options);
    let counters = processor.counters();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let relay = outbox.filter(|_| std::env::var_os("TWICE_BENCH_NO_RELAY").is_none()).map(|o| {
        let relay = Relay::new(o, broker.clone(), RelayOptions::new());
        let counters = relay.counters();
        (tokio::spawn(relay.run(wait(stopped.clone()))), counters)
    });
    let cpu = cpu_seconds();
    let watch = Stopwatch::start();
    let task = tokio::spawn(processor.run(wait(stopped.clone())));
    while counters.snapshot().completed < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = rate(n, &watch);
    let after = cpu_seconds();
    #[allow(clippy::cast_precision_loss)] // reason: a count far below 2^52
    let per = |a: f64, b: f64| (b - a) * 1e6 / n as f64;
    let run = Run { rate: r, own_us: per(cpu.0, after.0), postgres_us: per(cpu.1, after.1) };
    let _ = stop.send(true);
    task.await??;
    if let Some((relay, counters)) = relay {
        relay.await?;
        let s = counters.snapshot();
        eprintln!(
            "  (the relay sent {} rows: {} hand-overs from this process's commits, {} leases)",
            s.sent, s.adopted, s.leases
        );
    }
    Ok(run)
}

/// One processor run: messages per second, and CPU µs per message of this process (the
/// processor, the broker, the relay) and of PostgreSQL.
struct Run {
    rate: f64,
    own_us: f64,
    postgres_us: f64,
}

/// The lags the relay saw, sorted.
type Lags = Arc<Mutex<Vec<Duration>>>;

/// Commits `n` rows at 1,000 per second, each in a transaction of its own, and relays them
/// with `publisher`; returns the sorted lags.
async fn relay_lag<P: Publish>(
    pool: sqlx::PgPool,
    table: &str,
    publisher: P,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let outbox = SqlxOutbox::new(pool.clone(), OutboxOptions::new().table(table)).await?;
    let lags: Lags = Arc::default();
    let relay = Relay::new(outbox.clone(), publisher, RelayOptions::new()).on_sent({
        let lags = Arc::clone(&lags);
        move |s| lags.lock().expect("lags").push(s.lag)
    });
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let clock = SharedClock::system();
    let start = clock.now();
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..n {
        let due = start.saturating_add(Duration::from_millis(u64::try_from(i).unwrap_or(0)));
        let now = clock.now();
        if due > now {
            clock.sleep(due.duration_since(now)).await;
        }
        let (pool, outbox) = (pool.clone(), outbox.clone());
        writes.spawn(async move {
            let mut tx = pool.begin().await?;
            outbox.send(&mut tx, "events", Message::new(vec![b'z'; 256])).await?;
            outbox.commit(tx).await?;
            anyhow::Ok(())
        });
        while let Some(done) = writes.try_join_next() {
            done??;
        }
    }
    while let Some(done) = writes.join_next().await {
        done??;
    }
    while lags.lock().expect("lags").len() < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(true);
    task.await?;
    let mut lags = lags.lock().expect("lags").clone();
    lags.sort();
    Ok(lags)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    // reason: an index within the slice's length
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1_000.0)
}

/// `TWICE_BENCH_ONLY`: `outbox` runs the side with the outbox alone, `plain` the other.
fn only() -> anyhow::Result<Option<bool>> {
    match std::env::var("TWICE_BENCH_ONLY").as_deref() {
        Err(_) => Ok(None),
        Ok("outbox") => Ok(Some(true)),
        Ok("plain") => Ok(Some(false)),
        Ok(other) => anyhow::bail!("TWICE_BENCH_ONLY is `outbox` or `plain`, not `{other}`"),
    }
}

/// `TWICE_BENCH_BATCH`, or 1.
fn batch_size() -> anyhow::Result<usize> {
    Ok(std::env::var("TWICE_BENCH_BATCH").map_or(Ok(1), |s| s.parse())?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(20_000), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(3), |s| s.parse())?;
    let only = only()?;

    let dir = tempfile::tempdir()?;
    let broker = Broker::open(BrokerOptions::durable(dir.path())).await?;
    broker.create_queue("events", QueueProperties::default()).await?;
    println!(
        "1. the processor, PostgreSQL inbox, {CONCURRENCY} concurrent calls, durable embedded broker, \
         {n} messages of 256 bytes per run, {rounds} rounds, which runs first alternating, \
         batches of {}",
        batch_size()?
    );
    println!(
        "| round | no outbox, msg/s | one message through the outbox, msg/s | ratio | CPU µs/msg without: twice / PostgreSQL | with: twice / PostgreSQL |"
    );
    println!("|---|---|---|---|---|---|");
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let db = PgDatabase::create("twice_bench").await?;
        let pool = db.pool(40).await?;
        let outbox = SqlxOutbox::new(pool.clone(), OutboxOptions::new()).await?;
        let (plain, sending) = (format!("plain-{round}"), format!("sending-{round}"));
        for q in [&plain, &sending] {
            broker.create_queue(q, QueueProperties::default()).await?;
            fill(&broker, q, n, round).await?;
        }
        // Which goes first alternates, so that neither always meets a busier machine.
        let (a, b) = if let Some(only) = only {
            // One side alone, to profile it: the other's numbers are zeros.
            let run = if only {
                process(&broker, &sending, n, pool.clone(), Some(outbox)).await?
            } else {
                process(&broker, &plain, n, pool.clone(), None).await?
            };
            let none = Run { rate: 0.0, own_us: 0.0, postgres_us: 0.0 };
            if only { (none, run) } else { (run, none) }
        } else if round % 2 == 0 {
            let a = process(&broker, &plain, n, pool.clone(), None).await?;
            (a, process(&broker, &sending, n, pool.clone(), Some(outbox)).await?)
        } else {
            let b = process(&broker, &sending, n, pool.clone(), Some(outbox)).await?;
            (process(&broker, &plain, n, pool.clone(), None).await?, b)
        };
        println!(
            "| {} | {:.0} | {:.0} | {:.0} % | {:.0} / {:.0} | {:.0} / {:.0} |",
            round + 1,
            a.rate,
            b.rate,
            100.0 * b.rate / a.rate,
            a.own_us,
            a.postgres_us,
            b.own_us,
            b.postgres_us
        );
        without.push(a.rate);
        with.push(b.rate);
    }
    #[allow(clippy::cast_precision_loss)] // reason: a handful of rounds
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "| mean | {:.0} | {:.0} | {:.0} % | | |\n",
        mean(&without),
        mean(&with),
        100.0 * mean(&with) / mean(&without)
    );

    if only.is_some() {
        broker.shutdown().await;
        return Ok(());
    }
    let lag_n = 10_000.min(n);
    println!(
        "2. relay lag, write → broker acknowledgement, {lag_n} rows committed at 1,000 per second \
         (PostgreSQL store)"
    );
    println!("| broker | p50, ms | p99, ms | max, ms |");
    println!("|---|---|---|---|");
    let db = PgDatabase::create("twice_bench").await?;
    let lags = relay_lag(db.pool(20).await?, "lag_embedded", broker.clone(), lag_n).await?;
    println!(
        "| embedded (durable) | {} | {} | {} |",
        ms(percentile(&lags, 0.5)),
        ms(percentile(&lags, 0.99)),
        ms(lags[lags.len() - 1])
    );
    let options = twice_servicebus::ServerOptions::new()
        .amqp_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(None);
    let server = twice_servicebus::Server::bind(options, broker.clone()).await?;
    let client = twice_servicebus_client::ServiceBusClient::from_connection_string(
        &server.connection_string(),
    )?;
    tokio::spawn(server.run(std::future::pending()));
    let lags = relay_lag(db.pool(20).await?, "lag_serve", client.publisher(), lag_n).await?;
    println!(
        "| Service Bus client → twice serve (durable) | {} | {} | {} |",
        ms(percentile(&lags, 0.5)),
        ms(percentile(&lags, 0.99)),
        ms(lags[lags.len() - 1])
    );
    client.close().await;
    broker.shutdown().await;
    Ok(())
}
