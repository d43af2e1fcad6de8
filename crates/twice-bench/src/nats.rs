//! NATS JetStream beside `twice serve` and RabbitMQ: durable 1 KiB messages published to a
//! stream with file storage with 256 publishes awaiting their acknowledgement, then received
//! from a pull consumer (batches of 256) and acknowledged one by one, as `amqp_bench` does
//! for the others.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::AckPolicy, stream::StorageType};
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use twice::Stopwatch;

/// Publishes and acknowledgements awaited at once.
const IN_FLIGHT: usize = 256;
const BODY: usize = 1024;

/// The rates of one run.
#[derive(Clone, Debug)]
pub struct NatsRates {
    /// Publish, msg/s (each publish acknowledged by the stream).
    pub publish: f64,
    /// Receive + ack, msg/s (until the consumer has no acknowledgement pending).
    pub receive: f64,
    /// The server's CPU time per published message, µs (when `nats-server` runs here).
    pub server_cpu_us: Option<f64>,
    /// The server's version, as it announced it.
    pub server_version: String,
}

/// utime + stime of the local `nats-server` process, if one runs and is readable.
fn server_cpu() -> Option<Duration> {
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() == "nats-server" {
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // Fields after the command's closing parenthesis: utime and stime are 12th and 13th.
            let rest = stat.rsplit_once(')')?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            return Some(Duration::from_millis((utime + stime) * 10));
        }
    }
    None
}

#[allow(clippy::cast_precision_loss)] // reason: counts far below 2^52
fn per_second(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64().max(1e-9)
}

/// Runs one publish phase and one receive phase of `n` messages against the JetStream server
/// at `url`, on a stream of its own (file storage) deleted at the end.
///
/// # Errors
/// When the server is unreachable, refuses the stream, or does not take or deliver a message
/// within a minute.
pub async fn run(url: &str, n: usize, name: &str) -> anyhow::Result<NatsRates> {
    let client = async_nats::connect(url).await?;
    let server_version = client.server_info().version;
    let js = jetstream::new(client);
    let subject = name.to_lowercase();
    let _ = js.delete_stream(name).await;
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.clone()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await?;
    let result = phases(&js, &stream, &subject, n).await;
    let _ = js.delete_stream(name).await;
    result.map(|rates| NatsRates { server_version, ..rates })
}

async fn phases(
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    subject: &str,
    n: usize,
) -> anyhow::Result<NatsRates> {
    let body = Bytes::from(vec![b'n'; BODY]);
    let cpu_before = server_cpu();
    let watch = Stopwatch::start();
    let mut pending = FuturesUnordered::new();
    for _ in 0..n {
        if pending.len() >= IN_FLIGHT
            && let Some(ack) = pending.next().await
        {
            ack??;
        }
        let ack = js.publish(subject.to_owned(), body.clone()).await?;
        // The outer error is the timeout, the inner one the acknowledgement's.
        pending.push(tokio::time::timeout(Duration::from_secs(60), ack));
    }
    while let Some(ack) = pending.next().await {
        ack??;
    }
    let publish = per_second(n, watch.elapsed());
    let server_cpu_us = match (cpu_before, server_cpu()) {
        #[allow(clippy::cast_precision_loss)] // reason: counts far below 2^52
        (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64() * 1e6 / n.max(1) as f64),
        _ => None,
    };

    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("bench".to_owned()),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    let watch = Stopwatch::start();
    let mut messages = consumer.stream().max_messages_per_batch(IN_FLIGHT).messages().await?;
    let mut received = 0;
    while received < n {
        let next = tokio::time::timeout(Duration::from_secs(60), messages.next()).await?;
        let Some(message) = next else { anyhow::bail!("the consumer ended after {received}") };
        message
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .ack()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        received += 1;
    }
    drop(messages);
    // Acknowledgements are sent without a reply: the phase ends when the server has them all.
    let mut consumer = consumer;
    let deadline = Stopwatch::start();
    while consumer.info().await?.num_ack_pending > 0 {
        anyhow::ensure!(
            deadline.elapsed() < Duration::from_secs(60),
            "acknowledgements still pending after a minute"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let receive = per_second(n, watch.elapsed());
    Ok(NatsRates { publish, receive, server_cpu_us, server_version: String::new() })
}
