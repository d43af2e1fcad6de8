//! End-to-end throughput and latency of the in-process broker.
//!
//! Messages of 1 KiB go send → peek-lock receive → complete, with concurrent senders and 1 or
//! 16 concurrent receivers, in durable and in-memory mode. Prints a table: messages per second
//! and the p50 / p99 latency from the start of a send to the receipt of the message.
//!
//! Run: `cargo bench -p twice-broker --bench throughput` (set `TWICE_BENCH_MESSAGES` to change
//! the count per run, `TWICE_BENCH_ONLY` to `durable` or `memory` to run one mode, and
//! `TWICE_BENCH_SEND_BATCH` / `TWICE_BENCH_RECEIVE_BATCH` to send / receive that many messages
//! per call).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use twice::Message;
use twice::clock::Stopwatch;
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, StorageStatistics};

const BODY: usize = 1024;
const SENDERS: usize = 256;
/// The most messages sent but not yet completed: senders wait beyond it, so that the run
/// measures a steady state rather than the growth of a backlog.
const WINDOW: usize = 8192;
/// The default most messages per receive call (`TWICE_BENCH_RECEIVE_BATCH` changes it).
const RECEIVE_BATCH: usize = 32;

struct Outcome {
    rate: f64,
    p50: Duration,
    p99: Duration,
    storage: StorageStatistics,
}

struct Shape {
    receivers: usize,
    total: usize,
    send_batch: usize,
    receive_batch: usize,
}

async fn run(options: BrokerOptions, shape: &Shape) -> Outcome {
    let Shape { receivers, total, send_batch, receive_batch } = *shape;
    let broker = Broker::open(options).await.expect("open");
    broker.create_queue("bench", QueueProperties::default()).await.expect("queue");
    let clock = Stopwatch::start();
    let sent = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let window = Arc::new(Semaphore::new(WINDOW));

    let mut senders = Vec::new();
    for _ in 0..SENDERS {
        let (broker, sent, window) = (broker.clone(), sent.clone(), window.clone());
        senders.push(tokio::spawn(async move {
            loop {
                let start = sent.fetch_add(send_batch, Ordering::Relaxed);
                if start >= total {
                    return;
                }
                let n = send_batch.min(total - start);
                window
                    .acquire_many(u32::try_from(n).expect("batch"))
                    .await
                    .expect("window")
                    .forget();
                // The body starts with the send time, so the receiver can measure latency.
                let t = u64::try_from(clock.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let batch = (0..n)
                    .map(|_| {
                        let mut body = vec![0u8; BODY];
                        body[..8].copy_from_slice(&t.to_le_bytes());
                        Message::new(body)
                    })
                    .collect();
                broker.send_batch("bench", batch).await.expect("send");
            }
        }));
    }
    let mut tasks = Vec::new();
    for _ in 0..receivers {
        let (broker, done, window) = (broker.clone(), done.clone(), window.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while done.load(Ordering::Relaxed) < total {
                let got = broker
                    .receive("bench", receive_batch, Duration::from_millis(20))
                    .await
                    .expect("receive");
                let now = clock.elapsed();
                let mut tokens = Vec::with_capacity(got.len());
                for m in &got {
                    let mut t = [0u8; 8];
                    t.copy_from_slice(&m.body()[..8]);
                    latencies.push(now.saturating_sub(Duration::from_nanos(u64::from_le_bytes(t))));
                    tokens.extend(m.lock_token);
                }
                if !tokens.is_empty() {
                    // Settle in the background and receive the next batch meanwhile, as a
                    // receiver with prefetch does.
                    let (broker, done, window) = (broker.clone(), done.clone(), window.clone());
                    tokio::spawn(async move {
                        broker.complete_many(&tokens).await.expect("complete");
                        done.fetch_add(tokens.len(), Ordering::Relaxed);
                        window.add_permits(tokens.len());
                    });
                }
            }
            latencies
        }));
    }
    for s in senders {
        s.await.expect("sender");
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.expect("receiver"));
    }
    let elapsed = clock.elapsed();
    let storage = broker.storage_statistics().await.expect("stats");
    broker.shutdown().await;
    latencies.sort_unstable();
    let pct = |p: usize| latencies.get(latencies.len() * p / 100).copied().unwrap_or_default();
    Outcome {
        rate: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: pct(50),
        p99: pct(99),
        storage,
    }
}

fn main() {
    let total: usize =
        std::env::var("TWICE_BENCH_MESSAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    // Messages per send call: 1 is a send per message; more uses `send_batch`.
    let send_batch: usize = std::env::var("TWICE_BENCH_SEND_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .clamp(1, 200);
    let receive_batch: usize = std::env::var("TWICE_BENCH_RECEIVE_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(RECEIVE_BATCH)
        .max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{total} messages of {BODY} B per run, {SENDERS} concurrent senders (at most {WINDOW} \
         messages outstanding) sending {send_batch} message(s) per call, receive batch \
         {receive_batch}"
    );
    println!(
        "| mode | receivers | msgs/s | p50 latency | p99 latency | commits | fsyncs |\n\
         |---|---|---|---|---|---|---|"
    );
    // `TWICE_BENCH_ONLY=memory` or `=durable` runs one mode (for profiling).
    let only = std::env::var("TWICE_BENCH_ONLY").unwrap_or_default();
    for durable in [true, false] {
        if (only == "memory" && durable) || (only == "durable" && !durable) {
            continue;
        }
        for receivers in [1, 16] {
            let dir = tempfile::tempdir().expect("tempdir");
            let options = if durable {
                BrokerOptions::durable(dir.path())
            } else {
                BrokerOptions::in_memory()
            };
            let shape = Shape { receivers, total, send_batch, receive_batch };
            let o = rt.block_on(run(options, &shape));
            println!(
                "| {} | {receivers} | {:.0} | {:.2} ms | {:.2} ms | {} | {} |",
                if durable { "durable" } else { "in memory" },
                o.rate,
                o.p50.as_secs_f64() * 1e3,
                o.p99.as_secs_f64() * 1e3,
                o.storage.commits,
                o.storage.fsyncs,
            );
        }
    }
}
