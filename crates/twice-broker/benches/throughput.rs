//! End-to-end throughput, latency and CPU cost of the in-process broker.
//!
//! Messages of 1 KiB go send → peek-lock receive → complete, with 256 concurrent senders and
//! 1 or 16 concurrent receivers, sending one message per call and batches of 16, in three
//! modes: durable, durable with relaxed delivery counts
//! (`BrokerOptions::relaxed_delivery_counts`), and in memory. Prints one markdown table,
//! every configuration side by side:
//!
//! - msgs/s: messages completed per second of the run;
//! - p50 / p99: from the start of the send to the receipt of the message;
//! - CPU µs/msg: CPU time of the whole process (senders, receivers and broker) per message;
//! - broker µs/msg: CPU time of the broker's own threads (the task that owns the state and the
//!   log writer) per message. The broker task is one thread, so 1,000,000 / this is a ceiling
//!   on its throughput when it is the bottleneck;
//! - commits, fsyncs and messages per fsync (durable mode);
//! - the fsync latency of the disk under the data directory, measured right before the run
//!   (p50 of `fdatasync` after a 4 KiB append): durable throughput and latency follow it.
//!
//! Run: `cargo bench -p twice-broker --bench throughput`. Environment:
//! `TWICE_BENCH_MESSAGES` (messages per run, default 200000), `TWICE_BENCH_ONLY` (modes to
//! run, comma-separated: `durable`, `relaxed`, `memory`), `TWICE_BENCH_RECEIVERS`
//! (comma-separated, default `1,16`),
//! `TWICE_BENCH_SEND_BATCH` (comma-separated messages per send call, default `1,16`),
//! `TWICE_BENCH_RECEIVE_BATCH` (most messages per receive call, default 32).

use std::io::Write;
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
/// Threads whose CPU time counts as the broker's.
const BROKER_THREADS: [&str; 2] = ["twice-broker", "twice-log-writer"];

struct Outcome {
    rate: f64,
    p50: Duration,
    p99: Duration,
    cpu_per_msg: Duration,
    broker_per_msg: Duration,
    storage: StorageStatistics,
}

#[derive(Clone, Copy)]
struct Shape {
    receivers: usize,
    total: usize,
    send_batch: usize,
    receive_batch: usize,
}

/// CPU time consumed so far by every live thread of this process, and by the broker's
/// threads, from `/proc/self/task/*/schedstat` (nanoseconds on CPU, user and system).
fn cpu_times() -> (Duration, Duration) {
    let (mut all, mut broker) = (0u64, 0u64);
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Default::default() };
    for task in tasks.flatten() {
        let path = task.path();
        let ns = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        all += ns;
        if BROKER_THREADS.contains(&comm.trim()) {
            broker += ns;
        }
    }
    (Duration::from_nanos(all), Duration::from_nanos(broker))
}

/// The median latency of `fdatasync` after appending 4 KiB, in `dir`.
fn fsync_latency(dir: &std::path::Path) -> Duration {
    let path = dir.join("fsync-probe");
    let mut f = std::fs::File::create(&path).expect("probe file");
    let block = vec![7u8; 4096];
    let mut samples = Vec::new();
    let total = Stopwatch::start();
    // At least 50 samples and at most about half a second of them.
    while samples.len() < 50
        || (samples.len() < 2000 && total.elapsed() < Duration::from_millis(500))
    {
        f.write_all(&block).expect("probe write");
        let t = Stopwatch::start();
        f.sync_data().expect("probe fdatasync");
        samples.push(t.elapsed());
    }
    drop(f);
    let _ = std::fs::remove_file(&path);
    samples.sort_unstable();
    samples[samples.len() / 2]
}

async fn run(options: BrokerOptions, shape: Shape) -> Outcome {
    let Shape { receivers, total, send_batch, receive_batch } = shape;
    let broker = Broker::open(options).await.expect("open");
    broker.create_queue("bench", QueueProperties::default()).await.expect("queue");
    let storage_before = broker.storage_statistics().await.expect("stats");
    let (cpu_before, broker_before) = cpu_times();
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
                let batch: Vec<Message> = (0..n)
                    .map(|_| {
                        let mut body = vec![0u8; BODY];
                        body[..8].copy_from_slice(&t.to_le_bytes());
                        Message::new(body)
                    })
                    .collect();
                if n == 1 {
                    let m = batch.into_iter().next().expect("one message");
                    broker.send("bench", m).await.expect("send");
                } else {
                    broker.send_batch("bench", batch).await.expect("send");
                }
            }
        }));
    }
    let mut tasks = Vec::new();
    for _ in 0..receivers {
        let (broker, done, window) = (broker.clone(), done.clone(), window.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(total / receivers + 1024);
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
                drop(got);
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
    let mut per_receiver = Vec::new();
    for t in tasks {
        per_receiver.push(t.await.expect("receiver"));
    }
    let elapsed = clock.elapsed();
    let (cpu_after, broker_after) = cpu_times();
    let mut latencies: Vec<Duration> = per_receiver.into_iter().flatten().collect();
    let mut storage = broker.storage_statistics().await.expect("stats");
    storage.commits -= storage_before.commits;
    storage.fsyncs -= storage_before.fsyncs;
    broker.shutdown().await;
    latencies.sort_unstable();
    let pct = |p: usize| latencies.get(latencies.len() * p / 100).copied().unwrap_or_default();
    let n = u32::try_from(latencies.len().max(1)).unwrap_or(u32::MAX);
    Outcome {
        rate: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: pct(50),
        p99: pct(99),
        cpu_per_msg: cpu_after.saturating_sub(cpu_before) / n,
        broker_per_msg: broker_after.saturating_sub(broker_before) / n,
        storage,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Durable, with the default guarantees.
    Durable,
    /// Durable, with `relaxed_delivery_counts(true)`.
    Relaxed,
    /// In memory.
    Memory,
}

impl Mode {
    fn key(self) -> &'static str {
        match self {
            Mode::Durable => "durable",
            Mode::Relaxed => "relaxed",
            Mode::Memory => "memory",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Durable => "durable",
            Mode::Relaxed => "durable, relaxed counts",
            Mode::Memory => "in memory",
        }
    }
}

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(v) => v.split(',').filter_map(|x| x.trim().parse().ok()).filter(|&x| x > 0).collect(),
        Err(_) => default.to_vec(),
    }
}

fn main() {
    let total: usize =
        std::env::var("TWICE_BENCH_MESSAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let send_batches: Vec<usize> =
        env_list("TWICE_BENCH_SEND_BATCH", &[1, 16]).into_iter().map(|b| b.min(200)).collect();
    let receivers_list = env_list("TWICE_BENCH_RECEIVERS", &[1, 16]);
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
    let probe_dir = tempfile::tempdir().expect("tempdir");
    let fsync_at_start = fsync_latency(probe_dir.path());
    println!(
        "{total} messages of {BODY} B per run, {SENDERS} concurrent senders (at most {WINDOW} \
         messages outstanding), receive batch {receive_batch}; fsync p50 at start: {:.0} µs",
        fsync_at_start.as_secs_f64() * 1e6
    );
    println!(
        "| mode | receivers | send batch | msgs/s | p50 latency | p99 latency | CPU µs/msg | \
         broker µs/msg | commits | fsyncs | msgs/fsync | fsync p50 |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    // `TWICE_BENCH_ONLY=memory` (or `durable`, `relaxed`, comma-separated) runs those modes.
    let only = std::env::var("TWICE_BENCH_ONLY").unwrap_or_default();
    for mode in [Mode::Durable, Mode::Relaxed, Mode::Memory] {
        if !only.is_empty() && !only.split(',').any(|m| m.trim() == mode.key()) {
            continue;
        }
        for &send_batch in &send_batches {
            for &receivers in &receivers_list {
                let dir = tempfile::tempdir().expect("tempdir");
                let (options, fsync) = match mode {
                    Mode::Memory => (BrokerOptions::in_memory(), "–".to_owned()),
                    Mode::Durable | Mode::Relaxed => {
                        let fsync = fsync_latency(dir.path());
                        let options = BrokerOptions::durable(dir.path())
                            .relaxed_delivery_counts(mode == Mode::Relaxed);
                        (options, format!("{:.0} µs", fsync.as_secs_f64() * 1e6))
                    }
                };
                let shape = Shape { receivers, total, send_batch, receive_batch };
                let o = rt.block_on(run(options, shape));
                let per_fsync = if o.storage.fsyncs == 0 {
                    "–".to_owned()
                } else {
                    format!("{:.0}", total as f64 / o.storage.fsyncs as f64)
                };
                println!(
                    "| {} | {receivers} | {send_batch} | {:.0} | {:.2} ms | {:.2} ms | {:.1} | \
                     {:.1} | {} | {} | {per_fsync} | {fsync} |",
                    mode.name(),
                    o.rate,
                    o.p50.as_secs_f64() * 1e3,
                    o.p99.as_secs_f64() * 1e3,
                    o.cpu_per_msg.as_secs_f64() * 1e6,
                    o.broker_per_msg.as_secs_f64() * 1e6,
                    o.storage.commits,
                    o.storage.fsyncs,
                );
            }
        }
    }
}
