//! `twice serve` next to RabbitMQ, measured in one run on this machine: durable 1 KiB messages
//! published with 256 in flight (each acknowledged once on disk), then received and settled one
//! by one with 256 credits (RabbitMQ: prefetch 256), from Rust clients on the same machine.
//!
//! twice is driven over AMQP 1.0 by a minimal client (peek-lock, settle mode second: each
//! completion waits for the server's echo); RabbitMQ by lapin on a quorum queue with publisher
//! confirms, persistent messages and one manual ack per message. Prints msgs/s, latency
//! percentiles, and the server's and the client's CPU time per message (from `/proc`), the
//! median of the runs, side by side; then how fast the `twice` binary starts and how much
//! memory it holds idle.
//!
//! ```text
//! cargo build --release -p twice-cli
//! cargo run --release -p twice-servicebus --example amqp_bench -- \
//!     [--messages 50000] [--runs 3] [--twice target/release/twice | --in-process] \
//!     [--rabbitmq amqp://guest:guest@127.0.0.1:5672/%2f | --no-rabbitmq] [--json]
//! ```
//!
//! With `--json` it also prints, last, the table's rows as one line of JSON (for `twice-bench`).
//!
//! With `--in-process` (or when the binary is missing) the server runs inside this process on a
//! runtime of its own, and its CPU time is that of its threads.

#![allow(clippy::disallowed_methods)] // reason: a benchmark measures elapsed real time with a monotonic clock
#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)] // reason: report arithmetic on counts far below 2^52
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: a benchmark stops loudly on setup errors

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use twice_broker::config::Config;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::codec::Value;
use twice_servicebus::frame::{self, FrameReader};
use twice_servicebus::performative::{
    Attach, Begin, Disposition, Flow, Open, Outcome, Performative, SaslInit, Transfer,
    described_list,
};
use twice_servicebus::{Server, ServerOptions};

const IN_FLIGHT: usize = 256;
const BODY: usize = 1024;
const QUEUE: &str = "bench";
const CONFIG: &str = r#"{"UserConfig":{"Namespaces":[{"Name":"sbemulatorns","Queues":[{"Name":"bench","Properties":{"LockDuration":"PT5M","MaxDeliveryCount":10}}],"Topics":[]}]}}"#;

/// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`, 100 on Linux).
const TICKS: u64 = 100;

/// One phase of one run.
#[derive(Clone, Copy, Debug)]
struct Phase {
    rate: f64,
    p50: Option<Duration>,
    p99: Option<Duration>,
    server_cpu: Duration,
    client_cpu: Duration,
    messages: usize,
}

impl Phase {
    fn server_us(&self) -> f64 {
        self.server_cpu.as_secs_f64() * 1e6 / self.messages as f64
    }

    fn client_us(&self) -> f64 {
        self.client_cpu.as_secs_f64() * 1e6 / self.messages as f64
    }
}

/// What a phase measures its server's CPU time from.
#[derive(Clone, Debug)]
enum Cpu {
    /// Another process.
    Process(u32),
    /// The threads of this process whose names start with `twice-`.
    Threads,
}

impl Cpu {
    fn read(&self) -> Duration {
        match self {
            Cpu::Process(pid) => stat_cpu(&format!("/proc/{pid}/stat")),
            Cpu::Threads => server_threads_cpu(),
        }
    }
}

/// utime + stime of a `/proc/.../stat` file.
fn stat_cpu(path: &str) -> Duration {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 1000 / TICKS)
}

/// The CPU time of this process's server threads (`twice-server`, `twice-broker`,
/// `twice-log-writer`).
fn server_threads_cpu() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Duration::ZERO };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("twice-"))
        })
        .map(|t| stat_cpu(&t.path().join("stat").to_string_lossy()))
        .sum()
}

fn own_cpu() -> Duration {
    stat_cpu("/proc/self/stat")
}

/// The pid of the RabbitMQ server (its Erlang VM).
fn rabbitmq_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == "beam.smp").then_some(pid)
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A phase from its wall time, latencies and CPU readings.
fn phase(
    messages: usize,
    elapsed: Duration,
    mut latencies: Vec<Duration>,
    server_cpu: Duration,
    client_cpu: Duration,
) -> Phase {
    latencies.sort();
    let (p50, p99) = if latencies.is_empty() {
        (None, None)
    } else {
        (Some(percentile(&latencies, 0.5)), Some(percentile(&latencies, 0.99)))
    };
    Phase {
        rate: messages as f64 / elapsed.as_secs_f64(),
        p50,
        p99,
        server_cpu,
        client_cpu,
        messages,
    }
}

// ----- twice: a minimal AMQP 1.0 client --------------------------------------------------------

struct Client {
    reader: FrameReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    out: Vec<u8>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        let mut c = Self { reader: FrameReader::new(r, 1 << 20), writer: w, out: Vec::new() };
        let mut out = frame::SASL_HEADER.to_vec();
        let init = SaslInit {
            mechanism: "PLAIN".into(),
            initial_response: Some(Bytes::from_static(
                b"\0RootManageSharedAccessKey\0SAS_KEY_VALUE",
            )),
            hostname: None,
        };
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
        out.extend_from_slice(&frame::AMQP_HEADER);
        let open = Open {
            container_id: "bench".into(),
            max_frame_size: 1 << 20,
            channel_max: 1,
            ..Open::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
        let begin = Begin {
            next_outgoing_id: 0,
            incoming_window: u32::MAX / 2,
            outgoing_window: u32::MAX / 2,
            ..Begin::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Begin(begin), &[]);
        c.writer.write_all(&out).await?;
        c.reader.read_protocol_header().await?;
        c.next().await?; // mechanisms
        c.next().await?; // outcome
        c.reader.read_protocol_header().await?;
        c.next().await?; // open
        c.next().await?; // begin
        Ok(c)
    }

    async fn next(&mut self) -> anyhow::Result<Performative> {
        loop {
            let f = self.reader.read_frame().await?;
            if f.body.is_empty() {
                continue;
            }
            return Ok(Performative::decode(&f.body)?.0);
        }
    }

    fn push(&mut self, p: Performative, payload: &[u8]) {
        frame::write_frame(&mut self.out, frame::TYPE_AMQP, 0, &p, payload);
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        self.writer.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    /// Attaches a link; for a sender, returns how many transfers the server's credit allows.
    async fn attach(&mut self, handle: u32, client_receives: bool) -> anyhow::Result<u32> {
        let t = |code, a: &str| described_list(code, vec![Value::string(a)]);
        let (source, target) = if client_receives {
            (t(0x28, QUEUE), t(0x29, "bench"))
        } else {
            (t(0x28, "bench"), t(0x29, QUEUE))
        };
        self.push(
            Performative::Attach(Attach {
                name: format!("link-{handle}"),
                handle,
                role: client_receives,
                snd_settle_mode: Some(0),
                rcv_settle_mode: Some(u8::from(client_receives)),
                source: Some(source),
                target: Some(target),
                initial_delivery_count: (!client_receives).then_some(0),
                ..Attach::default()
            }),
            &[],
        );
        self.flush().await?;
        self.next().await?;
        if client_receives {
            return Ok(0);
        }
        match self.next().await? {
            Performative::Flow(f) => Ok(f.delivery_count.unwrap_or(0) + f.link_credit.unwrap_or(0)),
            other => anyhow::bail!("expected credit, got {other:?}"),
        }
    }
}

fn flow(handle: u32, delivery_count: u32, credit: u32) -> Performative {
    Performative::Flow(Flow {
        next_incoming_id: Some(0),
        incoming_window: u32::MAX / 2,
        next_outgoing_id: 0,
        outgoing_window: u32::MAX / 2,
        handle: Some(handle),
        delivery_count: Some(delivery_count),
        link_credit: Some(credit),
        ..Flow::default()
    })
}

/// Publishes `n` messages, 256 unsettled transfers in flight; latency is send to `accepted`.
async fn twice_publish(addr: SocketAddr, n: usize, cpu: &Cpu) -> anyhow::Result<Phase> {
    let body = vec![b'x'; BODY];
    let mut c = Client::connect(addr).await?;
    let mut credit = c.attach(0, false).await?;
    let mut sent_at: HashMap<u32, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(n);
    let (server0, client0, t0) = (cpu.read(), own_cpu(), Instant::now());
    let mut next = 0usize;
    while latencies.len() < n {
        while next < n && sent_at.len() < IN_FLIGHT && credit > 0 {
            let id = u32::try_from(next)?;
            let t = Transfer {
                handle: 0,
                delivery_id: Some(id),
                delivery_tag: Some(Bytes::copy_from_slice(&id.to_be_bytes())),
                message_format: Some(0),
                settled: Some(false),
                ..Transfer::default()
            };
            let m = twice::Message::new(body.clone()).with_message_id(format!("m{next}"));
            c.push(Performative::Transfer(t), &twice_servicebus::mapping::encode_message(&m));
            sent_at.insert(id, Instant::now());
            credit -= 1;
            next += 1;
        }
        c.flush().await?;
        match c.next().await? {
            Performative::Disposition(d) => {
                for id in d.first..=d.last.unwrap_or(d.first) {
                    if let Some(at) = sent_at.remove(&id) {
                        latencies.push(at.elapsed());
                    }
                }
            }
            // The server's credit: delivery-count plus link-credit is where sending may go. A
            // flow without a handle only reopens the session window.
            Performative::Flow(f) if f.handle.is_some() => {
                let limit = f.delivery_count.unwrap_or(0) + f.link_credit.unwrap_or(0);
                credit = limit.saturating_sub(u32::try_from(next)?);
            }
            _ => {}
        }
    }
    let elapsed = t0.elapsed();
    let (server, client) = (cpu.read() - server0, own_cpu() - client0);
    Ok(phase(n, elapsed, latencies, server, client.saturating_sub(own_share(cpu, server))))
}

/// This process's CPU time that is the server's (when it runs in this process).
fn own_share(cpu: &Cpu, server: Duration) -> Duration {
    match cpu {
        Cpu::Threads => server,
        Cpu::Process(_) => Duration::ZERO,
    }
}

/// Receives and completes `n` messages with 256 credits, refilled at half; latency is from a
/// delivery's arrival to the echo of its completion.
async fn twice_receive(addr: SocketAddr, n: usize, cpu: &Cpu) -> anyhow::Result<Phase> {
    let mut r = Client::connect(addr).await?;
    r.attach(1, true).await?;
    let mut delivered: VecDeque<(u32, Instant)> = VecDeque::new();
    let mut pending: HashMap<u32, Instant> = HashMap::new();
    let mut completed = 0usize;
    let mut latencies = Vec::with_capacity(n);
    let mut delivery_count = 0u32;
    let mut granted_at = 0u32;
    let in_flight = u32::try_from(IN_FLIGHT)?;
    let (server0, client0, t0) = (cpu.read(), own_cpu(), Instant::now());
    r.push(flow(1, 0, in_flight), &[]);
    r.flush().await?;
    while completed < n {
        match r.next().await? {
            Performative::Transfer(t) => {
                if let Some(id) = t.delivery_id {
                    delivered.push_back((id, Instant::now()));
                    delivery_count += 1;
                }
            }
            Performative::Disposition(d) => {
                for id in d.first..=d.last.unwrap_or(d.first) {
                    if let Some(at) = pending.remove(&id) {
                        latencies.push(at.elapsed());
                        completed += 1;
                    }
                }
            }
            _ => {}
        }
        while let Some((id, at)) = delivered.pop_front() {
            let done = Disposition {
                role: true,
                first: id,
                last: None,
                settled: false,
                state: Some(Outcome::Accepted.to_value()),
            };
            r.push(Performative::Disposition(done), &[]);
            pending.insert(id, at);
        }
        if delivery_count - granted_at >= in_flight / 2 {
            granted_at = delivery_count;
            r.push(flow(1, delivery_count, in_flight), &[]);
        }
        r.flush().await?;
    }
    let elapsed = t0.elapsed();
    let (server, client) = (cpu.read() - server0, own_cpu() - client0);
    Ok(phase(n, elapsed, latencies, server, client.saturating_sub(own_share(cpu, server))))
}

// ----- RabbitMQ with lapin ----------------------------------------------------------------------

async fn rabbitmq_run(uri: &str, n: usize, run: usize) -> anyhow::Result<(Phase, Phase)> {
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    let cpu = Cpu::Process(rabbitmq_pid().context("no beam.smp process: is RabbitMQ running?")?);
    let queue = format!("twice-bench-{}-{run}", std::process::id());
    let conn = Connection::connect(uri, ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to RabbitMQ at {uri}"))?;
    let ch = conn.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    ch.queue_declare(queue.as_str().into(), durable, args).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;

    let body = vec![b'x'; BODY];
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let mut in_flight = FuturesUnordered::new();
    let mut latencies = Vec::with_capacity(n);
    let (server0, client0, t0) = (cpu.read(), own_cpu(), Instant::now());
    for _ in 0..n {
        if in_flight.len() >= IN_FLIGHT
            && let Some(r) = in_flight.next().await
        {
            latencies.push(r?);
        }
        let at = Instant::now();
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                persistent.clone(),
            )
            .await?;
        in_flight.push(async move {
            let c = confirm.await?;
            anyhow::ensure!(c.is_ack(), "RabbitMQ did not confirm a publish");
            Ok::<_, anyhow::Error>(at.elapsed())
        });
    }
    while let Some(r) = in_flight.next().await {
        latencies.push(r?);
    }
    let elapsed = t0.elapsed();
    let publish = phase(n, elapsed, latencies, cpu.read() - server0, own_cpu() - client0);

    let consumer_ch = conn.create_channel().await?;
    consumer_ch.basic_qos(u16::try_from(IN_FLIGHT)?, BasicQosOptions::default()).await?;
    let (server0, client0, t0) = (cpu.read(), own_cpu(), Instant::now());
    let mut consumer = consumer_ch
        .basic_consume(
            queue.as_str().into(),
            "twice-bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut acked = 0;
    while acked < n {
        let delivery = consumer.next().await.context("the consumer ended")??;
        delivery.ack(BasicAckOptions::default()).await?;
        acked += 1;
    }
    let elapsed = t0.elapsed();
    // An ack has no confirmation in AMQP 0-9-1: there is no settlement latency to report.
    let consume = phase(n, elapsed, Vec::new(), cpu.read() - server0, own_cpu() - client0);
    consumer_ch.close(200, "done".into()).await?;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
    conn.close(200, "done".into()).await?;
    Ok((publish, consume))
}

// ----- the twice server under test --------------------------------------------------------------

/// A `twice serve` child process; killed when dropped.
struct Serve {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `twice serve` on a fresh data directory; returns it and how long it took to accept a
/// TCP connection after the spawn.
fn spawn_serve(binary: &Path) -> anyhow::Result<(Serve, Duration)> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let t0 = Instant::now();
    let child = Command::new(binary)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--amqp")
        .arg(addr.to_string())
        .arg("--no-http")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // The server's warnings and errors belong in the benchmark's output.
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let mut serve = Serve { child, addr, _dir: dir };
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok((serve, t0.elapsed()));
        }
        if let Some(status) = serve.child.try_wait()? {
            anyhow::bail!("{} exited with {status}", binary.display());
        }
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(10), "twice serve did not start");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A server for one run: the binary, or one inside this process.
enum Target {
    Binary(Serve),
    InProcess {
        addr: SocketAddr,
        stop: tokio::sync::oneshot::Sender<()>,
        rt: tokio::runtime::Runtime,
    },
}

impl Target {
    fn addr(&self) -> SocketAddr {
        match self {
            Target::Binary(s) => s.addr,
            Target::InProcess { addr, .. } => *addr,
        }
    }

    fn cpu(&self) -> Cpu {
        match self {
            Target::Binary(s) => Cpu::Process(s.child.id()),
            Target::InProcess { .. } => Cpu::Threads,
        }
    }

    fn stop(self) {
        if let Target::InProcess { stop, rt, .. } = self {
            let _ = stop.send(());
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

fn in_process() -> anyhow::Result<Target> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("twice-server")
        .enable_all()
        .build()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let addr = rt.block_on(async {
        let dir = tempfile::tempdir()?;
        let options = BrokerOptions::durable(dir.path()).config(Config::from_json(CONFIG)?);
        let broker = Broker::open(options).await?;
        let options = ServerOptions::new().amqp_addr("127.0.0.1:0".parse()?).http_addr(None);
        let server = Server::bind(options, broker.clone()).await?;
        let addr = server.amqp_addr();
        tokio::spawn(async move {
            let _ = server.run(async move { drop(stopped.await) }).await;
            broker.shutdown().await;
            drop(dir);
        });
        Ok::<_, anyhow::Error>(addr)
    })?;
    Ok(Target::InProcess { addr, stop, rt })
}

// ----- report ------------------------------------------------------------------------------------

struct Args {
    messages: usize,
    runs: usize,
    twice: Option<PathBuf>,
    rabbitmq: Option<String>,
    json: bool,
}

fn args() -> anyhow::Result<Args> {
    let default_binary = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/release/twice");
    let mut a = Args {
        messages: 50_000,
        runs: 3,
        twice: default_binary.exists().then_some(default_binary),
        rabbitmq: Some("amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()),
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--messages" => a.messages = it.next().context("--messages N")?.parse()?,
            "--runs" => a.runs = it.next().context("--runs N")?.parse::<usize>()?.max(1),
            "--twice" => a.twice = Some(it.next().context("--twice PATH")?.into()),
            "--in-process" => a.twice = None,
            "--rabbitmq" => a.rabbitmq = Some(it.next().context("--rabbitmq URI")?),
            "--no-rabbitmq" => a.rabbitmq = None,
            "--json" => a.json = true,
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

/// The run with the median rate.
fn median(mut phases: Vec<Phase>) -> Phase {
    phases.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    phases[phases.len() / 2]
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "—".to_owned(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
}

fn row(what: &str, system: &str, p: &Phase) {
    println!(
        "| {what} | {system} | {:.0} | {} | {} | {:.1} | {:.1} |",
        p.rate,
        ms(p.p50),
        ms(p.p99),
        p.server_us(),
        p.client_us()
    );
}

/// A row of the JSON line.
fn json_row(phase: &str, system: &str, p: &Phase) -> serde_json::Value {
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
    serde_json::json!({
        "phase": phase,
        "system": system,
        "rate": p.rate,
        "p50_ms": ms(p.p50),
        "p99_ms": ms(p.p99),
        "server_cpu_us": p.server_us(),
        "client_cpu_us": p.client_us(),
    })
}

fn main() -> anyhow::Result<()> {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args = args()?;
    let n = args.messages;
    let client = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    // `twice serve`: start-up time and idle memory, over a few starts.
    let mut startup = Vec::new();
    let mut idle_rss = Vec::new();
    if let Some(binary) = &args.twice {
        for _ in 0..5 {
            let (serve, took) = spawn_serve(binary)?;
            startup.push(took);
            std::thread::sleep(Duration::from_secs(1));
            idle_rss.push(rss(serve.child.id()));
        }
    }

    let (mut tw_pub, mut tw_recv, mut rb_pub, mut rb_recv) = (vec![], vec![], vec![], vec![]);
    for run in 0..args.runs {
        let target = match &args.twice {
            Some(binary) => Target::Binary(spawn_serve(binary)?.0),
            None => in_process()?,
        };
        let (addr, cpu) = (target.addr(), target.cpu());
        let p = client.block_on(twice_publish(addr, n, &cpu))?;
        let r = client.block_on(twice_receive(addr, n, &cpu))?;
        eprintln!("run {run}: twice publish {:.0}/s, receive+complete {:.0}/s", p.rate, r.rate);
        tw_pub.push(p);
        tw_recv.push(r);
        target.stop();
        if let Some(uri) = &args.rabbitmq {
            let (p, r) = client.block_on(rabbitmq_run(uri, n, run))?;
            eprintln!("run {run}: RabbitMQ publish {:.0}/s, consume+ack {:.0}/s", p.rate, r.rate);
            rb_pub.push(p);
            rb_recv.push(r);
        }
    }

    let server = match &args.twice {
        Some(b) => format!("`{}` (child process)", b.canonicalize().unwrap_or(b.clone()).display()),
        None => "in-process server (its threads)".to_owned(),
    };
    println!();
    println!("{n} durable 1 KiB messages per phase, median of {} runs; twice: {server}", args.runs);
    println!();
    println!(
        "| phase | system | msg/s | p50 ms | p99 ms | server CPU µs/msg | client CPU µs/msg |"
    );
    println!("|---|---|---|---|---|---|---|");
    let (tp, tr) = (median(tw_pub), median(tw_recv));
    let mut json_rows = vec![json_row("publish", "twice", &tp), json_row("receive", "twice", &tr)];
    row("publish, 256 in flight", "twice", &tp);
    if !rb_pub.is_empty() {
        let (rp, rr) = (median(rb_pub), median(rb_recv));
        json_rows.push(json_row("publish", "rabbitmq", &rp));
        json_rows.push(json_row("receive", "rabbitmq", &rr));
        row("publish, 256 in flight", "RabbitMQ quorum", &rp);
        row("receive + settle, 256 credit", "twice", &tr);
        row("receive + settle, 256 credit", "RabbitMQ quorum", &rr);
        println!();
        println!(
            "twice / RabbitMQ: publish {:.2}× the rate at {:.2}× the server CPU per message; \
             receive+settle {:.2}× the rate at {:.2}× the server CPU per message",
            tp.rate / rp.rate,
            tp.server_us() / rp.server_us(),
            tr.rate / rr.rate,
            tr.server_us() / rr.server_us(),
        );
    } else {
        row("receive + settle, 256 credit", "twice", &tr);
    }
    if !startup.is_empty() {
        startup.sort();
        idle_rss.sort_unstable();
        println!();
        println!(
            "twice serve: spawn to accepting TCP {:.1} ms median ({:.1}–{:.1} over {} starts); \
             idle RSS {:.1} MiB median ({:.1}–{:.1})",
            startup[startup.len() / 2].as_secs_f64() * 1e3,
            startup[0].as_secs_f64() * 1e3,
            startup[startup.len() - 1].as_secs_f64() * 1e3,
            startup.len(),
            idle_rss[idle_rss.len() / 2] as f64 / 1048576.0,
            idle_rss[0] as f64 / 1048576.0,
            idle_rss[idle_rss.len() - 1] as f64 / 1048576.0,
        );
    }
    if args.json {
        let line = serde_json::json!({
            "bench": "amqp_bench",
            "messages": n,
            "runs": args.runs,
            "rows": json_rows,
        });
        println!("{line}");
    }
    Ok(())
}
