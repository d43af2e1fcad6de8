//! The results of each part, as the examples print them in their JSON line (`--json`), and the
//! machine they ran on.

use serde::{Deserialize, Serialize};

/// Finds the last line of `output` that is a JSON object naming `bench`, and parses it.
///
/// # Errors
/// When no such line is there, or it does not parse as `T`.
pub fn json_line<T: for<'de> Deserialize<'de>>(output: &str, bench: &str) -> anyhow::Result<T> {
    let needle = format!("\"bench\":\"{bench}\"");
    let line = output
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('{') && l.contains(&needle))
        .ok_or_else(|| anyhow::anyhow!("no JSON line of {bench} in its output"))?;
    serde_json::from_str(line).map_err(|e| anyhow::anyhow!("the JSON line of {bench}: {e}"))
}

/// The machine and the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    /// Cores the process may use.
    pub cores: usize,
    /// Memory in MiB (`MemTotal` of `/proc/meminfo`).
    pub memory_mib: u64,
    /// The date and time (UTC) the run started.
    pub date: String,
    /// The git commit of the checkout (`git rev-parse --short HEAD`), with `-dirty` if the work
    /// tree had changes.
    pub commit: String,
    /// `--quick`: smaller counts, numbers only to check that the suite works.
    pub quick: bool,
}

/// One row of `amqp_bench --json`: one phase of one system, the median of the runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AmqpRow {
    /// `publish` or `receive`.
    pub phase: String,
    /// `twice` or `rabbitmq`.
    pub system: String,
    /// Messages per second.
    pub rate: f64,
    /// Median latency in ms, when measured.
    pub p50_ms: Option<f64>,
    /// 99th percentile latency in ms, when measured.
    pub p99_ms: Option<f64>,
    /// The server's CPU time per message, µs.
    pub server_cpu_us: f64,
    /// The client's CPU time per message, µs.
    pub client_cpu_us: f64,
}

/// The JSON line of `amqp_bench --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AmqpBench {
    /// Messages per phase.
    pub messages: usize,
    /// Runs (the rows hold the median).
    pub runs: usize,
    /// One row per phase and system.
    pub rows: Vec<AmqpRow>,
}

/// One row of the brokers' part: a system, what it had made durable before acknowledging, its
/// publish and receive+ack rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BrokerRow {
    /// The system and its setting, e.g. "NATS JetStream (file, default sync)".
    pub system: String,
    /// What the broker had made durable before it acknowledged a publish.
    pub durability: String,
    /// Publish rate, msg/s; `None` when not run.
    pub publish: Option<f64>,
    /// Receive + acknowledge rate, msg/s; `None` when not run.
    pub receive: Option<f64>,
    /// Server CPU µs per published message, when measured.
    pub server_cpu_us: Option<f64>,
    /// Why the row was not run, or another remark.
    pub note: String,
}

/// One row of `bench_transports --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransportRow {
    /// The transport, e.g. "RabbitMQ (quorum queue)".
    pub transport: String,
    /// The transport's own consume+complete rate, msg/s.
    pub consume: f64,
    /// The processor, one message per transaction, msg/s.
    pub processor: f64,
    /// The processor with batches, msg/s (when a batch size was given).
    pub batches: Option<f64>,
}

/// The JSON line of `bench_transports --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransportsBench {
    /// Messages per measurement.
    pub messages: usize,
    /// Messages per transaction in the batches column.
    pub batch: usize,
    /// One row per transport.
    pub rows: Vec<TransportRow>,
    /// pgbench running the claim's SQL at the same concurrency, when pgbench is installed.
    pub pgbench_tps: Option<f64>,
}

/// One point of `bench_claim_latency --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClaimPoint {
    /// Claimed ids in the inbox before the samples.
    pub rows_before: i64,
    /// `random` or `time-ordered`.
    pub ids: String,
    /// Mean claim latency, µs.
    pub mean_us: u64,
    /// Median, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// WAL bytes written per claim.
    pub wal_bytes_per_claim: i64,
}

/// The JSON line of `bench_claim_latency --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClaimBench {
    /// Claims per point.
    pub samples: usize,
    /// One point per inbox size and kind of id.
    pub points: Vec<ClaimPoint>,
}

/// The JSON line of `broker_child fill|reopen DIR [N] --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BrokerChild {
    /// `fill` or `reopen`.
    pub mode: String,
    /// Active messages in the queue at the end.
    pub active: u64,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// Time taken, ms.
    pub elapsed_ms: u64,
}

/// The recovery part: fill a durable broker, then reopen it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    /// Messages of 1 KiB queued.
    pub messages: u64,
    /// The fill.
    pub fill: BrokerChild,
    /// The reopen: the recovery.
    pub reopen: BrokerChild,
}

impl Recovery {
    /// Seconds of recovery per million messages.
    pub fn reopen_s_per_million(&self) -> f64 {
        per_million(self.reopen.elapsed_ms, self.messages)
    }

    /// Seconds of filling per million messages.
    pub fn fill_s_per_million(&self) -> f64 {
        per_million(self.fill.elapsed_ms, self.messages)
    }
}

#[allow(clippy::cast_precision_loss)] // reason: milliseconds and counts far below 2^52
fn per_million(ms: u64, messages: u64) -> f64 {
    if messages == 0 { 0.0 } else { ms as f64 / 1e3 * 1e6 / messages as f64 }
}

/// What one part produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Outcome {
    /// Part a: the brokers side by side.
    Brokers(Vec<BrokerRow>),
    /// Part b: the processor per transport, beside pgbench.
    Transports(TransportsBench),
    /// Part c: claim latency as the inbox grows.
    Claim(ClaimBench),
    /// Part d: recovery time.
    Recovery(Recovery),
    /// The part failed; the error.
    Failed(String),
    /// The part was skipped (`--only`/`--skip`).
    Skipped,
}

/// One part of the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PartResult {
    /// Its letter and name, e.g. "a. brokers".
    pub title: String,
    /// `/proc/loadavg` (1, 5, 15 min) before the part.
    pub load_before: String,
    /// `/proc/loadavg` after the part.
    pub load_after: String,
    /// Wall time of the part, s.
    pub seconds: f64,
    /// What it produced.
    pub outcome: Outcome,
}

/// What a transport of part b had made durable when it took a completion, by the row's name
/// (`bench_transports`' labels); the processor's claim is committed (fsync'd) in PostgreSQL
/// before it completes on every transport.
#[must_use]
pub fn transport_durability(transport: &str) -> &'static str {
    if transport.starts_with("embedded") || transport.contains("twice serve") {
        "fsync'd (group commit)"
    } else if transport.starts_with("RabbitMQ") {
        "fsync'd (quorum queue's Raft log)"
    } else if transport.starts_with("NATS") {
        "written, not fsync'd (file store's default sync)"
    } else {
        "not known"
    }
}
