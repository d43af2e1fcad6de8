//! Throughput and latency of the AMQP front end on a durable broker: publish 1 KiB messages
//! with 256 in flight, then receive and complete them with 256 credits, from a Rust client on
//! the same machine. Prints msgs/s, p50/p99 latency and server CPU time per message.
//!
//! `cargo run --release -p twice-servicebus --example amqp_bench -- [messages]`

#![allow(clippy::disallowed_methods)] // reason: a benchmark measures elapsed time with a monotonic clock
#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)] // reason: report arithmetic on small counts

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
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

fn cpu_time() -> Duration {
    // utime + stime of this process, in clock ticks (100 per second on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Client {
    reader: FrameReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    out: Vec<u8>,
}

impl Client {
    async fn connect(port: u16) -> anyhow::Result<Self> {
        let s = TcpStream::connect(("127.0.0.1", port)).await?;
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

    async fn next(&mut self) -> anyhow::Result<(Performative, Bytes)> {
        loop {
            let f = self.reader.read_frame().await?;
            if f.body.is_empty() {
                continue;
            }
            let (p, payload) = Performative::decode(&f.body)?;
            return Ok((p, Bytes::copy_from_slice(payload)));
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

    async fn attach(
        &mut self,
        handle: u32,
        client_receives: bool,
        address: &str,
    ) -> anyhow::Result<()> {
        let t = |code, a: &str| described_list(code, vec![Value::string(a)]);
        let (source, target) = if client_receives {
            (t(0x28, address), t(0x29, "bench"))
        } else {
            (t(0x28, "bench"), t(0x29, address))
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
        if !client_receives {
            self.next().await?; // credit
        }
        Ok(())
    }
}

fn message(i: usize, body: &[u8]) -> Vec<u8> {
    let m = twice::Message::new(body.to_vec()).with_message_id(format!("m{i}"));
    twice_servicebus::mapping::encode_message(&m)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(50_000);
    let dir = tempfile::tempdir()?;
    let config = Config::from_json(
        r#"{"UserConfig":{"Namespaces":[{"Name":"sbemulatorns","Queues":[{"Name":"bench","Properties":{"LockDuration":"PT5M","MaxDeliveryCount":10}}],"Topics":[]}]}}"#,
    )?;
    let broker = Broker::open(BrokerOptions::durable(dir.path()).with_config(config)).await?;
    let options = ServerOptions::new().amqp_addr("127.0.0.1:0".parse()?).http_addr(None);
    let server = Server::bind(options, broker.clone()).await?;
    let port = server.amqp_addr().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));
    let body = vec![b'x'; 1024];

    // Publish, 256 unsettled transfers in flight.
    let mut c = Client::connect(port).await?;
    c.attach(0, false, "bench").await?;
    let mut sent_at: HashMap<u32, Instant> = HashMap::new();
    let mut latencies = Vec::with_capacity(n);
    let (cpu0, t0) = (cpu_time(), Instant::now());
    let mut next = 0usize;
    while latencies.len() < n {
        while next < n && sent_at.len() < IN_FLIGHT {
            let id = u32::try_from(next)?;
            let t = Transfer {
                handle: 0,
                delivery_id: Some(id),
                delivery_tag: Some(Bytes::copy_from_slice(&id.to_be_bytes())),
                message_format: Some(0),
                settled: Some(false),
                ..Transfer::default()
            };
            c.push(Performative::Transfer(t), &message(next, &body));
            sent_at.insert(id, Instant::now());
            next += 1;
        }
        c.flush().await?;
        if let (Performative::Disposition(d), _) = c.next().await? {
            for id in d.first..=d.last.unwrap_or(d.first) {
                if let Some(at) = sent_at.remove(&id) {
                    latencies.push(at.elapsed());
                }
            }
        }
    }
    let (publish_time, publish_cpu) = (t0.elapsed(), cpu_time().saturating_sub(cpu0));
    latencies.sort();
    println!(
        "publish          {:>8.0} msg/s  p50 {:>7.2} ms  p99 {:>7.2} ms  cpu {:>6.1} µs/msg",
        n as f64 / publish_time.as_secs_f64(),
        percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        publish_cpu.as_secs_f64() * 1e6 / n as f64,
    );

    // Receive and complete: 256 credits, each completion waits for the server's echo.
    let mut r = Client::connect(port).await?;
    r.attach(1, true, "bench").await?;
    let mut delivered: VecDeque<(u32, Instant)> = VecDeque::new();
    let mut pending: HashMap<u32, Instant> = HashMap::new();
    let mut completed = 0usize;
    let mut latencies = Vec::with_capacity(n);
    let mut delivery_count = 0u32;
    let mut granted_at = 0u32;
    let (cpu0, t0) = (cpu_time(), Instant::now());
    let flow = |dc: u32, credit: u32| {
        Performative::Flow(Flow {
            next_incoming_id: Some(0),
            incoming_window: u32::MAX / 2,
            next_outgoing_id: 0,
            outgoing_window: u32::MAX / 2,
            handle: Some(1),
            delivery_count: Some(dc),
            link_credit: Some(credit),
            ..Flow::default()
        })
    };
    r.push(flow(0, u32::try_from(IN_FLIGHT)?), &[]);
    r.flush().await?;
    while completed < n {
        match r.next().await? {
            (Performative::Transfer(t), _) => {
                if let Some(id) = t.delivery_id {
                    delivered.push_back((id, Instant::now()));
                    delivery_count += 1;
                }
            }
            (Performative::Disposition(d), _) => {
                if let Some(at) = pending.remove(&d.first) {
                    latencies.push(at.elapsed());
                    completed += 1;
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
        if delivery_count - granted_at >= u32::try_from(IN_FLIGHT / 2)? {
            granted_at = delivery_count;
            r.push(flow(delivery_count, u32::try_from(IN_FLIGHT)?), &[]);
        }
        r.flush().await?;
    }
    let (receive_time, receive_cpu) = (t0.elapsed(), cpu_time().saturating_sub(cpu0));
    latencies.sort();
    println!(
        "receive+complete {:>8.0} msg/s  p50 {:>7.2} ms  p99 {:>7.2} ms  cpu {:>6.1} µs/msg",
        n as f64 / receive_time.as_secs_f64(),
        percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        receive_cpu.as_secs_f64() * 1e6 / n as f64,
    );
    println!("(cpu is the whole process: broker, AMQP server and this client)");
    let _ = stop.send(());
    let _ = serving.await;
    broker.shutdown().await;
    Ok(())
}
