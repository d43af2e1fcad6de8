//! The processor over this client against `twice serve`, with the PostgreSQL inbox, at 1 and 16
//! concurrent calls, beside pgbench running the same SQL in the same run; and the raw client's
//! receive + complete rate beside the official Python SDK's against the same server.
//!
//! ```sh
//! cargo run --release -p twice-servicebus-client --example bench_processor -- 20000 [PYTHON]
//! ```
//!
//! `PYTHON` is an interpreter with `azure-servicebus` installed (e.g. a venv made with
//! `python3 -m venv v && v/bin/pip install azure-servicebus==7.15.0`); without it the Python
//! row is left out. Needs PostgreSQL on 127.0.0.1:5432 and, for its row, `pgbench`. Prints
//! numbers; nothing passes or fails.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use twice::{HandlerError, Message, Outcome, Processor, ProcessorOptions, Stopwatch, handler_fn};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Server, ServerOptions};
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;

/// The shipment the seed's handler writes, in the claim's transaction: the same SQL as
/// `crates/twice-sqlx/bench/claim.pgbench.sql`.
const SHIPMENT: &str = "INSERT INTO bench_shipments (order_id, message_id) VALUES ($1, $2)";

fn rate(n: usize, took: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)] // reason: a count far below 2^52
    let n = n as f64;
    n / took.as_secs_f64()
}

/// Sends `n` messages `m-0` … to `queue` in batches of 100.
async fn fill(client: &ServiceBusClient, queue: &str, n: usize) -> anyhow::Result<()> {
    let sender = client.sender(queue);
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let batch = chunk
            .iter()
            .map(|i| Message::new(vec![b'x'; 256]).with_message_id(format!("m-{i}")))
            .collect();
        sender.send_batch(batch).await?;
    }
    Ok(())
}

/// The processor on `queue` at `calls` concurrent calls until `n` messages are done.
async fn process(
    client: &ServiceBusClient,
    queue: &str,
    db: &PgDatabase,
    calls: usize,
    n: usize,
) -> anyhow::Result<f64> {
    let pool = db.pool(u32::try_from(calls)? + 4).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_shipments (order_id bigint NOT NULL, message_id text NOT NULL)")
        .execute(&pool)
        .await?;
    let inbox = SqlxInbox::<sqlx::Postgres>::new(pool, InboxOptions::new()).await?;
    let handler = handler_fn::<sqlx::Transaction<'static, sqlx::Postgres>, _>(|ctx, tx| {
        let id = ctx.message().message_id().as_str().to_owned();
        Box::pin(async move {
            let order: i64 = id.trim_start_matches("m-").parse().unwrap_or(0);
            sqlx::query(SHIPMENT)
                .bind(order)
                .bind(&id)
                .execute(&mut **tx)
                .await
                .map_err(HandlerError::transient)?;
            Ok::<_, HandlerError>(Outcome::Complete)
        })
    });
    let receiver = client.receiver(queue, ReceiverOptions::new().max_concurrent_calls(calls));
    let options = ProcessorOptions::new()
        .consumer(format!("bench-{calls}"))
        .max_concurrent_calls(calls)
        .max_wait(Duration::from_millis(200));
    let processor = Processor::new(receiver, inbox, handler, options);
    let counters = processor.counters();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let clock = Stopwatch::start();
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    while counters.snapshot().completed < n as u64 {
        anyhow::ensure!(!task.is_finished(), "the processor stopped early");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = rate(n, clock.elapsed());
    let _ = stop.send(true);
    task.await??;
    Ok(r)
}

/// pgbench with the processor's SQL at `clients` clients for 10 s; transactions per second.
fn pgbench(db: &PgDatabase, clients: usize) -> anyhow::Result<Option<f64>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../twice-sqlx/bench/claim.pgbench.sql");
    let psql = |sql: &str| {
        Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-qAt", "-d", db.name(), "-c", sql])
            .status()
    };
    for sql in [
        "DROP TABLE IF EXISTS pgb_inbox, pgb_shipments",
        "CREATE TABLE pgb_inbox (consumer text NOT NULL, message_id text NOT NULL, processed_at_ms bigint NOT NULL, PRIMARY KEY (consumer, message_id))",
        "CREATE INDEX pgb_inbox_processed_at ON pgb_inbox (processed_at_ms)",
        "CREATE TABLE pgb_shipments (order_id bigint NOT NULL, message_id text NOT NULL)",
    ] {
        if !psql(sql).is_ok_and(|s| s.success()) {
            return Ok(None);
        }
    }
    let Ok(out) = Command::new("pgbench")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-n", "-j", "2", "-T", "10"])
        .args(["-c", &clients.to_string(), "-f", script, db.name()])
        .output()
    else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .find(|l| l.starts_with("tps"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|t| t.parse().ok()))
}

/// The Python SDK's receive + complete rate on `queue` (sync API, 100 at a time, each message
/// completed in turn as its samples do).
fn python_rate(python: &str, cs: &str, queue: &str, n: usize) -> anyhow::Result<f64> {
    const SCRIPT: &str = r#"
import sys, time
from azure.servicebus import ServiceBusClient
cs, q, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with ServiceBusClient.from_connection_string(cs) as c:
    with c.get_queue_receiver(q, prefetch_count=100) as r:
        t = time.monotonic(); done = 0
        while done < n:
            ms = r.receive_messages(max_message_count=100, max_wait_time=5)
            if not ms:
                break
            for m in ms:
                r.complete_message(m)
            done += len(ms)
        print(done / (time.monotonic() - t))
"#;
    let out = Command::new(python).args(["-c", SCRIPT, cs, queue, &n.to_string()]).output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// The raw client's receive + complete rate on `queue`, credit 100, each batch settled at once.
async fn raw_rate(client: &ServiceBusClient, queue: &str, n: usize) -> anyhow::Result<f64> {
    let receiver = client.receiver(queue, ReceiverOptions::new().prefetch(100));
    let clock = Stopwatch::start();
    let mut done = 0;
    while done < n {
        let batch = receiver.receive_messages(100, Duration::from_secs(5)).await?;
        anyhow::ensure!(!batch.is_empty(), "the queue ran dry after {done} of {n}");
        for r in futures::future::join_all(batch.iter().map(|d| receiver.complete_message(d))).await
        {
            r?;
        }
        done += batch.len();
    }
    Ok(rate(n, clock.elapsed()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(20_000), |s| s.parse())?;
    let python = args.next();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("{n} messages of 256 bytes; load average at start: {}", load.trim());

    // `twice serve` in process on a durable broker, as it is deployed.
    let dir = tempfile::tempdir()?;
    let broker = Broker::open(BrokerOptions::durable(dir.path())).await?;
    for q in ["p1", "p16", "raw", "python"] {
        broker.create_queue(q, QueueProperties::default()).await?;
    }
    let options =
        ServerOptions::new().amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0))).http_addr(None);
    let server = Server::bind(options, broker.clone()).await?;
    let cs = server.connection_string();
    tokio::spawn(server.run(std::future::pending()));
    let client = ServiceBusClient::from_connection_string(&cs)?;

    let db = PgDatabase::create("twice_sbbench").await?;
    println!(
        "| concurrency | pgbench, same SQL (tps) | processor over the client (msgs/s) | ratio |"
    );
    println!("|---:|---:|---:|---:|");
    for (calls, queue) in [(16, "p16"), (1, "p1")] {
        // A thousand messages at 1 call: it is slow, and the rate is steady long before.
        let count = if calls == 1 { n.min(3000) } else { n };
        fill(&client, queue, count).await?;
        let processor = process(&client, queue, &db, calls, count).await?;
        let bench = pgbench(&db, calls)?;
        match bench {
            Some(tps) => println!(
                "| {calls} | {tps:.0} | {processor:.0} | {:.0} % |",
                100.0 * processor / tps
            ),
            None => println!("| {calls} | (no pgbench) | {processor:.0} | |"),
        }
    }

    println!();
    println!("| client | receive + complete (msgs/s) |");
    println!("|---|---:|");
    fill(&client, "raw", n).await?;
    println!("| twice-servicebus-client, credit 100 | {:.0} |", raw_rate(&client, "raw", n).await?);
    if let Some(python) = python {
        let count = n.min(5000);
        fill(&client, "python", count).await?;
        let r = tokio::task::spawn_blocking({
            let cs = cs.clone();
            move || python_rate(&python, &cs, "python", count)
        })
        .await??;
        println!("| azure-servicebus (Python), prefetch 100 | {r:.0} |");
    }
    client.close().await;
    broker.shutdown().await;
    Ok(())
}
