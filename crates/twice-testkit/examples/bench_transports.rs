//! The processor's throughput with the PostgreSQL inbox at 16 concurrent calls on each
//! transport, beside the transport's own consume+complete rate without the processor.
//!
//! ```sh
//! cargo run --release -p twice-testkit --example bench_transports -- 10000
//! ```
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

fn rate(n: usize, clock: Stopwatch) -> f64 {
    #[allow(clippy::cast_precision_loss)] // reason: a count far below 2^52
    let n = n as f64;
    n / clock.elapsed().as_secs_f64()
}

/// Runs the processor with a PostgreSQL inbox and a handler that only completes, until `n`
/// messages are done; messages per second.
async fn process<T: Transport>(t: T, n: usize) -> anyhow::Result<f64> {
    let db = PgDatabase::create("twice_bench").await?;
    let inbox = SqlxInbox::<sqlx::Postgres>::new(db.pool(40).await?, InboxOptions::new()).await?;
    let handler = handler_fn::<sqlx::Transaction<'static, sqlx::Postgres>, _>(|_ctx, _tx| {
        Box::pin(async { Ok::<_, HandlerError>(Outcome::Complete) })
    });
    let options = ProcessorOptions::new()
        .consumer("bench")
        .max_concurrent_calls(CONCURRENCY)
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
    let n: usize = std::env::args().nth(1).map_or(Ok(10_000), |s| s.parse())?;
    println!(
        "{n} messages of 256 bytes; processor: PostgreSQL inbox, {CONCURRENCY} concurrent calls"
    );
    println!("| transport | consume+complete, msg/s | processor, msg/s |");
    println!("|---|---|---|");

    // The embedded broker, durable, in a temporary directory.
    let dir = tempfile::tempdir()?;
    let broker = Broker::open(BrokerOptions::durable(dir.path())).await?;
    let mut rates = Vec::new();
    for q in ["raw", "processor"] {
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
    rates.push(process(broker.receiver("processor").await?, n).await?);
    println!("| embedded (durable) | {:.0} | {:.0} |", rates[0], rates[1]);
    broker.shutdown().await;

    // RabbitMQ, quorum queues.
    let mut rates = Vec::new();
    let queues = [TestQueue::new("twice-bench"), TestQueue::new("twice-bench")];
    let mut transports = Vec::new();
    for q in &queues {
        let t =
            RabbitMqTransport::connect(RabbitMqOptions::new(RABBITMQ_URL, q.name()).prefetch(200))
                .await?;
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
    let processor_transport = transports.pop().expect("two transports");
    rates.push(consume(&transports[0], n).await?);
    rates.push(process(processor_transport, n).await?);
    println!("| RabbitMQ 3.10 (quorum queue) | {:.0} | {:.0} |", rates[0], rates[1]);

    // NATS JetStream, file storage.
    let mut rates = Vec::new();
    let streams = [TestStream::new("TWICE_BENCH"), TestStream::new("TWICE_BENCH")];
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
    let processor_transport = transports.pop().expect("two transports");
    rates.push(consume(&transports[0], n).await?);
    rates.push(process(processor_transport, n).await?);
    println!("| NATS 2.9 JetStream (file) | {:.0} | {:.0} |", rates[0], rates[1]);
    Ok(())
}
