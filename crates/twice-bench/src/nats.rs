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

/// utime + stime of a process from its `/proc/PID/stat`.
fn process_cpu(stat: &str) -> Option<Duration> {
    // Fields after the command's closing parenthesis: utime and stime are 12th and 13th.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// utime + stime of the `nats-server` process `pid`, or of the first local `nats-server`
/// found when `pid` is `None`, if one runs and is readable.
fn server_cpu(pid: Option<u32>) -> Option<Duration> {
    if let Some(pid) = pid {
        return process_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?);
    }
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() == "nats-server" {
            return process_cpu(&std::fs::read_to_string(entry.path().join("stat")).ok()?);
        }
    }
    None
}

/// How a [`Server`] stores its streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// The file store's default: written, synced every two minutes.
    Default,
    /// `sync_interval: always`: every write fsync'd before it is acknowledged.
    Always,
}

/// A `nats-server` started by the suite on a free port, with JetStream storing in a
/// directory of its own; stopped (and its directory removed) when dropped.
#[derive(Debug)]
pub struct Server {
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// `nats://127.0.0.1:PORT`.
    pub url: String,
}

impl Server {
    /// Starts `binary` with JetStream and `sync`, and waits until it takes connections.
    ///
    /// # Errors
    /// When the binary cannot be started, exits, or takes no connection within 20 s.
    pub fn start(binary: &std::path::Path, sync: Sync) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir =
            std::env::temp_dir().join(format!("twice-bench-nats-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let sync_line = match sync {
            Sync::Default => "",
            Sync::Always => "sync_interval: always",
        };
        let config = dir.join("server.conf");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{\n  store_dir: {:?}\n  {sync_line}\n}}\n",
                dir.join("store").display().to_string()
            ),
        )?;
        let log = std::fs::File::create(dir.join("server.log"))?;
        let child = std::process::Command::new(binary)
            .arg("-c")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", binary.display()))?;
        let mut server = Self { child, dir, url: format!("nats://127.0.0.1:{port}") };
        let watch = Stopwatch::start();
        loop {
            if let Some(status) = server.child.try_wait()? {
                let log =
                    std::fs::read_to_string(server.dir.join("server.log")).unwrap_or_default();
                anyhow::bail!(
                    "{} exited at its start with {status}: {}",
                    binary.display(),
                    log.trim()
                );
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            anyhow::ensure!(
                watch.elapsed() < Duration::from_secs(20),
                "{} took no connection on port {port} within 20 s",
                binary.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[allow(clippy::cast_precision_loss)] // reason: counts far below 2^52
fn per_second(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64().max(1e-9)
}

/// Runs one publish phase and one receive phase of `n` messages against the JetStream server
/// at `url`, on a stream of its own (file storage) deleted at the end. `pid` is the server's
/// process when known (else the first local `nats-server` is measured).
///
/// # Errors
/// When the server is unreachable, refuses the stream, or does not take or deliver a message
/// within a minute.
pub async fn run(url: &str, n: usize, name: &str, pid: Option<u32>) -> anyhow::Result<NatsRates> {
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
    let result = phases(&js, &stream, &subject, n, pid).await;
    let _ = js.delete_stream(name).await;
    result.map(|rates| NatsRates { server_version, ..rates })
}

async fn phases(
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    subject: &str,
    n: usize,
    pid: Option<u32>,
) -> anyhow::Result<NatsRates> {
    let body = Bytes::from(vec![b'n'; BODY]);
    let cpu_before = server_cpu(pid);
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
    let server_cpu_us = match (cpu_before, server_cpu(pid)) {
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
