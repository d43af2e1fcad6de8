//! The processor's throughput with the PostgreSQL inbox at 16 concurrent calls on each
//! transport, beside the transport's own consume+complete rate without the processor.
//!
//! ```sh
//! cargo run --release -p twice-testkit --example bench_transports -- 10000
//! cargo run --release -p twice-testkit --example bench_transports -- 10000 32
//! ```
//!
//! With a second argument `b`, each transport's processor also runs with batches of up to `b`
//! messages per transaction (`ProcessorOptions::batch_size`), in a column of its own. With
//! `--json` (anywhere among the arguments) it also prints, last, one line of JSON with every
//! rate (for `twice-bench`).
//!
//! Needs PostgreSQL, RabbitMQ and NATS on their usual ports. Prints numbers; nothing passes or
//! fails.

use std::time::Duration;

use futures::future::join_all;
use twice::{
    HandlerError, Message, Outcome, Processor, ProcessorOptions, Stopwatch, Transport, handler_fn,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_nats::{NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::nats::{NATS_URL, TestStream};
use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};

const CONCURRENCY: usize = 16;
const SENDERS: usize = 32;

/// Sends `n` messages with distinct ids from a few concurrent senders.
async fn fill<F, Fut>(n: usize, send: F) -> anyhow::Result<()>
where
    F: Fn(Message) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..SENDERS {
        let send = send.clone();
        tasks.spawn(async move {
            for i in (lane..n).step_by(SENDERS) {
                send(Message::new(vec![b'x'; 256]).with_message_id(format!("m-{i}"))).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// Receives and completes `n` messages, each batch's completions at once; messages per second.
async fn consume<T: Transport>(t: &T, n: usize) -> anyhow::Result<f64> {
    let clock = Stopwatch::start();
    let mut done = 0;
    while done < n {
        let got = t.receive(100, Duration::from_secs(5)).await?;
        anyhow::ensure!(!got.is_empty(), "the queue ran dry after {done} of {n}");
        for r in join_all(got.iter().map(|d| t.complete(d))).await {
            r?;
        }
        done += got.len();
    }
    Ok(rate(n, clock))
}

/// The rates as the cells of a markdown row.
fn row(rates: &[f64]) -> String {
    rates.iter().map(|r| format!(" {r:.0} |")).collect()
}

/// Prints a transport's markdown row and keeps its rates for the JSON line.
fn emit(json: &mut Vec<serde_json::Value>, transport: &str, rates: &[f64]) {
    println!("| {transport} |{}", row(rates));
    json.push(serde_json::json!({
        "transport": transport,
        "consume": rates.first(),
        "processor": rates.get(1),
        "batches": rates.get(2),
    }));
}

fn rate(n: usize, clock: Stopwatch) -> f64 {
    #[allow(clippy::cast_precision_loss)] // reason: a count far below 2^52
    let n = n as f64;
    n / clock.elapsed().as_secs_f64()
}

/// Runs the processor with a PostgreSQL inbox and a handler that only completes, until `n`
/// messages are done; messages per second.
async fn process<T: Transport>(t: T, n: usize, batch: usize) -> anyhow::Result<f64> {
    let db = PgDatabase::create("twice_bench").await?;
    let pool = if std::env::var_os("TWICE_BENCH_NO_PING").is_some() {
        db.pool_without_ping(40).await?
    } else {
        db.pool(40).await?
    };
    let inbox = SqlxInbox::<sqlx::Postgres>::new(pool, InboxOptions::new()).await?;
    let handler = handler_fn::<sqlx::Transaction<'static, sqlx::Postgres>, _>(|_ctx, _tx| {
        Box::pin(async { Ok::<_, HandlerError>(Outcome::Complete) })
    });
    let options = ProcessorOptions::new()
        .consumer("bench")
        .max_concurrent_calls(CONCURRENCY)
        .batch_size(batch)
        .max_wait(Duration::from_millis(200));
    let processor = Processor::new(t, inbox, handler, options);
    let counters = processor.counters();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let clock = Stopwatch::start();
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    while counters.snapshot().completed < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = rate(n, clock);
    let _ = stop.send(true);
    task.await??;
    Ok(r)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    args.retain(|a| a != "--json");
    let n: usize = args.first().map_or(Ok(10_000), |s| s.parse())?;
    let batch: usize = args.get(1).map_or(Ok(1), |s| s.parse())?;
    let mut json_rows = Vec::new();
    println!(
        "{n} messages of 256 bytes; processor: PostgreSQL inbox, {CONCURRENCY} concurrent calls"
    );
    if batch > 1 {
        println!(
            "| transport | consume+complete, msg/s | processor, msg/s | processor, batches of {batch}, msg/s |"
        );
        println!("|---|---|---|---|");
    } else {
        println!("| transport | consume+complete, msg/s | processor, msg/s |");
        println!("|---|---|---|");
    }

    // The embedded broker, durable, in a temporary directory.
    let dir = tempfile::tempdir()?;
    let broker = Broker::open(BrokerOptions::durable(dir.path())).await?;
    let mut rates = Vec::new();
    for q in ["raw", "processor", "batches"] {
        if q == "batches" && batch == 1 {
            continue;
        }
        broker.create_queue(q, QueueProperties::default()).await?;
        let b = broker.clone();
        fill(n, move |m| {
            let b = b.clone();
            async move {
                b.send(q, m).await?;
                Ok(())
            }
        })
        .await?;
    }
    rates.push(consume(&broker.receiver("raw").await?, n).await?);
    rates.push(process(broker.receiver("processor").await?, n, 1).await?);
    if batch > 1 {
        rates.push(process(broker.receiver("batches").await?, n, batch).await?);
    }
    emit(&mut json_rows, "embedded (durable)", &rates);

    // The Service Bus client against `twice serve` on the same durable broker.
    let mut rates = Vec::new();
    for q in ["sb-raw", "sb-processor", "sb-batches"] {
        broker.create_queue(q, QueueProperties::default()).await?;
    }
    let options = twice_servicebus::ServerOptions::new()
        .amqp_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(None);
    let server = twice_servicebus::Server::bind(options, broker.clone()).await?;
    let client = twice_servicebus_client::ServiceBusClient::from_connection_string(
        &server.connection_string(),
    )?;
    tokio::spawn(server.run(std::future::pending()));
    for q in ["sb-raw", "sb-processor", "sb-batches"] {
        if q == "sb-batches" && batch == 1 {
            continue;
        }
        let sender = std::sync::Arc::new(client.sender(q));
        fill(n, move |m| {
            let s = std::sync::Arc::clone(&sender);
            async move {
                s.send_message(m).await?;
                Ok(())
            }
        })
        .await?;
    }
    let receiver_options =
        || twice_servicebus_client::ReceiverOptions::new().max_concurrent_calls(CONCURRENCY);
    rates.push(consume(&client.receiver("sb-raw", receiver_options().prefetch(200)), n).await?);
    rates.push(process(client.receiver("sb-processor", receiver_options()), n, 1).await?);
    if batch > 1 {
        let options = receiver_options().max_concurrent_calls(CONCURRENCY * batch);
        rates.push(process(client.receiver("sb-batches", options), n, batch).await?);
    }
    emit(&mut json_rows, "Service Bus client → twice serve (durable)", &rates);
    client.close().await;
    broker.shutdown().await;

    // RabbitMQ, quorum queues.
    let mut rates = Vec::new();
    let queues: Vec<TestQueue> =
        (0..2 + usize::from(batch > 1)).map(|_| TestQueue::new("twice-bench")).collect();
    let mut transports = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        // The batches' processor takes up to 16 batches at once: its window grows with them.
        let prefetch = if i == 2 { (CONCURRENCY * batch).clamp(200, 65_535) } else { 200 };
        let prefetch = u16::try_from(prefetch).unwrap_or(u16::MAX);
        let options = RabbitMqOptions::new(RABBITMQ_URL, q.name()).prefetch(prefetch);
        let t = RabbitMqTransport::connect(options).await?;
        let sender = t.clone();
        fill(n, move |m| {
            let s = sender.clone();
            async move {
                s.send(m).await?;
                Ok(())
            }
        })
        .await?;
        transports.push(t);
    }
    let mut transports = transports.into_iter();
    rates.push(consume(&transports.next().expect("raw"), n).await?);
    rates.push(process(transports.next().expect("processor"), n, 1).await?);
    if let Some(t) = transports.next() {
        rates.push(process(t, n, batch).await?);
    }
    emit(&mut json_rows, "RabbitMQ (quorum queue)", &rates);

    // NATS JetStream, file storage.
    let mut rates = Vec::new();
    let streams: Vec<TestStream> =
        (0..2 + usize::from(batch > 1)).map(|_| TestStream::new("TWICE_BENCH")).collect();
    let mut transports = Vec::new();
    for s in &streams {
        let t = NatsTransport::connect(NatsOptions::new(NATS_URL, s.name())).await?;
        let sender = t.clone();
        fill(n, move |m| {
            let s = sender.clone();
            async move {
                s.send(m).await?;
                Ok(())
            }
        })
        .await?;
        transports.push(t);
    }
    let mut transports = transports.into_iter();
    rates.push(consume(&transports.next().expect("raw"), n).await?);
    rates.push(process(transports.next().expect("processor"), n, 1).await?);
    if let Some(t) = transports.next() {
        rates.push(process(t, n, batch).await?);
    }
    emit(&mut json_rows, "NATS JetStream (file)", &rates);

    // pgbench with the processor's transaction (the claim alone: the handler only completes),
    // at the same concurrency, in the same run.
    let pgbench = pgbench_claim()?;
    match pgbench {
        Some(tps) => {
            println!("| pgbench, the claim's SQL, {CONCURRENCY} clients | | {tps:.0} tps |")
        }
        None => println!("| pgbench | | (not installed) |"),
    }
    if json {
        let line = serde_json::json!({
            "bench": "bench_transports",
            "messages": n,
            "batch": batch,
            "rows": json_rows,
            "pgbench_tps": pgbench,
        });
        println!("{line}");
    }
    Ok(())
}

/// pgbench running the claim transaction at [`CONCURRENCY`] clients for 10 s, in a fresh
/// database; transactions per second, or `None` without pgbench.
fn pgbench_claim() -> anyhow::Result<Option<f64>> {
    let db = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(PgDatabase::create("twice_pgbench"))
    })?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../twice-sqlx/bench/claim_only.pgbench.sql");
    let setup = "CREATE TABLE pgb_inbox (consumer text NOT NULL, message_id text NOT NULL, \
        processed_at_ms bigint NOT NULL, PRIMARY KEY (consumer, message_id)); \
        CREATE INDEX pgb_inbox_processed_at ON pgb_inbox (processed_at_ms)";
    let created = std::process::Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-qAt", "-d", db.name(), "-c", setup])
        .status();
    if !created.is_ok_and(|s| s.success()) {
        return Ok(None);
    }
    let Ok(out) = std::process::Command::new("pgbench")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-n", "-j", "2", "-T", "10"])
        .args(["-c", &CONCURRENCY.to_string(), "-f", script, db.name()])
        .output()
    else {
        return Ok(None);
    };
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("tps"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|t| t.parse().ok()))
}
