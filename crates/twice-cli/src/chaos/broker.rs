//! The broker of a chaos run, chosen with `--broker`: `twice serve` as a child of the
//! controller (the default), or RabbitMQ or NATS JetStream at a URL.
//!
//! [`ChaosBroker`] is everything the controller does with it: make the run's two entities
//! (the orders and the `OrderShipped` events), restart the broker as a fault (`twice serve`
//! killed with SIGKILL and started again on its data directory; RabbitMQ and NATS restarted
//! by a command), count what is left, read the dead-letter queue, and remove what the run
//! made. [`Producer`] sends the orders: on RabbitMQ and NATS it is a plain client of the
//! broker (lapin, async-nats), not twice, and every other order carries no message id at all,
//! as a producer that is not twice sends them; its retries of those are new messages to the
//! broker, and only the processors' identity policy (the order id in the body) makes them one.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use twice::{Message, MessageIdentity};
use twice_nats::{NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_servicebus_client::http;
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};

use super::{LOCK, this_exe};
use crate::demo::broker::drain;

/// The queue of the orders on `twice serve`.
const QUEUE: &str = "orders";
/// The queue of the `OrderShipped` events on `twice serve`.
const SHIPPED: &str = "shipped";
/// MaxDeliveryCount of both entities: high, so that no valid order is dead-lettered by the
/// faults alone.
const MAX_DELIVERY_COUNT: u32 = 100;
/// How long NATS drops a re-sent message id.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(30 * 60);

/// The default restart of RabbitMQ: the application stopped and started on its node.
pub(crate) const RABBITMQ_RESTART: &str = "rabbitmqctl -q stop_app && rabbitmqctl -q start_app";
/// The default restart of NATS: the server killed with SIGKILL and started again on its
/// JetStream directory, as Debian's package runs it.
pub(crate) const NATS_RESTART: &str = "start-stop-daemon --stop --oknodo --signal KILL --retry 10 \
     --exec /usr/sbin/nats-server && start-stop-daemon --start --oknodo --background --exec \
     /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
     -l /var/log/nats-server.log";

/// What `--broker` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BrokerKind {
    /// `twice serve`, started by the controller.
    Serve,
    /// RabbitMQ at this `amqp://` URI.
    RabbitMq(String),
    /// NATS at this `nats://` URL.
    Nats(String),
}

impl BrokerKind {
    /// Parses `--broker`: `serve`, `amqp://…` or `nats://…`.
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        if s == "serve" {
            Ok(Self::Serve)
        } else if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Ok(Self::RabbitMq(s.to_owned()))
        } else if s.starts_with("nats://") {
            Ok(Self::Nats(s.to_owned()))
        } else {
            Err(format!("unknown broker {s:?}: use serve, amqp://… or nats://…"))
        }
    }

    /// The name the report shows.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Serve => "twice serve",
            Self::RabbitMq(_) => "RabbitMQ",
            Self::Nats(_) => "NATS JetStream",
        }
    }

    /// The command that restarts the broker when `--broker-restart-command` is not given.
    fn default_restart(&self) -> Option<&'static str> {
        match self {
            Self::Serve => None,
            Self::RabbitMq(_) => Some(RABBITMQ_RESTART),
            Self::Nats(_) => Some(NATS_RESTART),
        }
    }
}

/// The identity the processors claim an order by: its message id, or, when the producer set
/// none, `order-<order id>` from the body (the business key).
pub(crate) fn order_identity() -> MessageIdentity {
    MessageIdentity::function(|m: &Message| {
        if let Some(id) = &m.message_id {
            return Some(id.as_str().to_owned());
        }
        order_key(&m.body)
    })
}

/// `order-<order id>` of an order's (or an event's) body.
pub(crate) fn order_key(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(format!("order-{}", v.get("order_id")?.as_u64()?))
}

/// `twice serve` as a child on fixed ports and a data directory, restartable.
pub(crate) struct ServeProc {
    dir: PathBuf,
    amqp: u16,
    http: u16,
    key: String,
    child: Option<Child>,
}

impl ServeProc {
    fn connection_string(&self) -> String {
        format!(
            "Endpoint=sb://localhost:{};SharedAccessKeyName=chaos;SharedAccessKey={};UseDevelopmentEmulator=true",
            self.amqp, self.key
        )
    }

    async fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("serve.log"))?;
        let mut child = Command::new(this_exe()?)
            .arg("serve")
            .args(["--amqp", &format!("127.0.0.1:{}", self.amqp)])
            .args(["--http", &format!("127.0.0.1:{}", self.http)])
            .arg("--data-dir")
            .arg(self.dir.join("broker"))
            .arg("--config")
            .arg(self.dir.join("Config.json"))
            .args(["--sas-key", &format!("chaos={}", self.key)])
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting twice serve")?;
        let stdout = child.stdout.take().context("the broker's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                if line.starts_with("ready in") {
                    return Ok(true);
                }
            }
            anyhow::Ok(false)
        })
        .await;
        if !matches!(ready, Ok(Ok(true))) {
            bail!("twice serve did not start; see {}", self.dir.join("serve.log").display());
        }
        // Keep reading, so the broker never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
        Ok(())
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Messages not yet settled in `path` (active, locked, scheduled or deferred), from the
    /// broker's `/entities`.
    async fn unsettled(&self, path: &str) -> anyhow::Result<u64> {
        let target = http::Target::http("127.0.0.1", self.http);
        let answer = http::request(&target, http::Request::get("/entities").max_body(16 << 20))
            .await
            .context("reading /entities")?;
        if !answer.status().is_success() {
            bail!("/entities answered {}: {}", answer.status(), answer.text());
        }
        let list: serde_json::Value =
            serde_json::from_slice(answer.body()).context("reading /entities")?;
        let entity = list
            .as_array()
            .and_then(|l| l.iter().find(|e| e["path"] == path))
            .with_context(|| format!("{path} is not in /entities"))?;
        Ok(["active", "scheduled", "deferred"]
            .iter()
            .map(|k| entity[*k].as_u64().unwrap_or(0))
            .sum())
    }
}

/// What a broker still holds of an entity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Unsettled {
    /// Messages not settled.
    pub(crate) left: u64,
    /// Messages the run settled that the broker still holds (NATS after a SIGKILL).
    pub(crate) kept: u64,
}

/// The broker of one run, with the run's two entities on it.
pub(crate) enum ChaosBroker {
    Serve(ServeProc),
    RabbitMq {
        url: String,
        restart: String,
        orders: RabbitMqTransport,
        shipped: RabbitMqTransport,
    },
    Nats {
        url: String,
        restart: String,
        orders: NatsTransport,
        shipped: NatsTransport,
        /// The orders' dead-letter stream.
        dead: NatsTransport,
    },
}

/// What the processors need to reach the broker: `--broker`, `--queue` and `--shipped` of
/// `twice chaos-worker`.
#[derive(Clone, Debug)]
pub(crate) struct WorkerBroker {
    /// A Service Bus connection string, an `amqp://` URI or a `nats://` URL.
    pub(crate) broker: String,
    /// The orders' queue or stream.
    pub(crate) orders: String,
    /// The events' queue or stream.
    pub(crate) shipped: String,
}

impl WorkerBroker {
    /// The two entities, for a message.
    pub(crate) fn entities(&self) -> String {
        format!("{} and {}", self.orders, self.shipped)
    }
}

impl ChaosBroker {
    /// Starts `twice serve` in `dir`, or makes the run's queues or streams on the broker.
    pub(crate) async fn open(
        kind: &BrokerKind,
        restart: Option<&str>,
        dir: &Path,
        run_id: &str,
    ) -> anyhow::Result<Self> {
        let restart = restart.or(kind.default_restart()).unwrap_or_default().to_owned();
        Ok(match kind {
            BrokerKind::Serve => {
                write_serve_config(dir)?;
                let mut serve = ServeProc {
                    dir: dir.to_path_buf(),
                    amqp: free_port()?,
                    http: free_port()?,
                    key: format!("{:032x}", rand::random::<u128>()),
                    child: None,
                };
                serve.start().await?;
                Self::Serve(serve)
            }
            BrokerKind::RabbitMq(url) => {
                let open = |name: &str| {
                    let options = rabbitmq_options(url, &format!("twice-chaos-{run_id}-{name}"));
                    async move {
                        RabbitMqTransport::connect(options)
                            .await
                            .with_context(|| format!("connecting to RabbitMQ at {url}"))
                    }
                };
                let (orders, shipped) = (open(QUEUE).await?, open(SHIPPED).await?);
                Self::RabbitMq { url: url.clone(), restart, orders, shipped }
            }
            BrokerKind::Nats(url) => {
                let open = |name: &str| {
                    let stream = format!("TWICE_CHAOS_{run_id}_{name}").to_uppercase();
                    let options = nats_options(url, &stream);
                    async move {
                        NatsTransport::connect(options)
                            .await
                            .with_context(|| format!("connecting to NATS at {url}"))
                    }
                };
                let (orders, shipped) = (open(QUEUE).await?, open(SHIPPED).await?);
                let dead = orders.dead_letter_receiver().await?;
                Self::Nats { url: url.clone(), restart, orders, shipped, dead }
            }
        })
    }

    /// What the processors are given.
    pub(crate) fn for_workers(&self) -> WorkerBroker {
        match self {
            Self::Serve(s) => WorkerBroker {
                broker: s.connection_string(),
                orders: QUEUE.into(),
                shipped: SHIPPED.into(),
            },
            Self::RabbitMq { url, orders, shipped, .. } => WorkerBroker {
                broker: url.clone(),
                orders: orders.queue().into(),
                shipped: shipped.queue().into(),
            },
            Self::Nats { url, orders, shipped, .. } => WorkerBroker {
                broker: url.clone(),
                orders: orders.stream().into(),
                shipped: shipped.stream().into(),
            },
        }
    }

    /// The producer of the orders.
    pub(crate) fn producer(&self) -> Producer {
        match self {
            Self::Serve(s) => Producer::ServiceBus { connection_string: s.connection_string() },
            Self::RabbitMq { url, orders, .. } => {
                Producer::RabbitMq { url: url.clone(), queue: orders.queue().into() }
            }
            // The stream's subject is its name in lower case (NatsOptions's default).
            Self::Nats { url, orders, .. } => {
                Producer::Nats { url: url.clone(), subject: orders.stream().to_lowercase() }
            }
        }
    }

    /// Whether an acknowledged completion is the broker's word that the message is gone:
    /// `twice serve` answers a settlement once it is durable. RabbitMQ's `basic.ack` has no
    /// reply, and one lost with its connection comes back. NATS answers a double ack before
    /// the consumer's state reaches its files, so a server killed with SIGKILL delivers again
    /// (as a first delivery) messages whose completion it had acknowledged.
    pub(crate) fn completions_confirmed(&self) -> bool {
        matches!(self, Self::Serve(_))
    }

    /// Restarts the broker for real: `twice serve` killed with SIGKILL and started again after
    /// `down`; RabbitMQ and NATS by their restart command (the time it takes is the downtime).
    pub(crate) async fn restart(&mut self, down: Duration) -> anyhow::Result<()> {
        match self {
            Self::Serve(s) => {
                s.kill().await;
                tokio::time::sleep(down).await;
                s.start().await
            }
            Self::RabbitMq { restart, .. } | Self::Nats { restart, .. } => {
                let status = Command::new("sh")
                    .args(["-c", restart.as_str()])
                    .stdout(Stdio::null())
                    .status()
                    .await
                    .context("running the broker's restart command")?;
                if !status.success() {
                    bail!("the broker's restart command failed ({status}): {restart}");
                }
                Ok(())
            }
        }
    }

    /// Messages of the orders (`events == false`) or of the events not yet settled. On
    /// RabbitMQ only the messages waiting are counted (not those a processor holds): read it
    /// with no processor running.
    ///
    /// On NATS neither the stream's count nor its consumer's can be taken as they are once the
    /// server was killed with SIGKILL: the stream was seen to keep messages its consumer had
    /// acknowledged, and the consumer to count as pending messages it never delivered again.
    /// So the stream is read through, and each message it holds is either one the run has not
    /// settled or one kept after its settlement: `settled` holds the ids of the orders whose
    /// claim committed or that were dead-lettered (or of the events handled downstream), and
    /// what the orders' dead-letter stream holds is settled too.
    pub(crate) async fn unsettled(
        &self,
        events: bool,
        settled: &HashSet<String>,
    ) -> anyhow::Result<Unsettled> {
        let left = match self {
            Self::Serve(s) => s.unsettled(if events { SHIPPED } else { QUEUE }).await?,
            Self::RabbitMq { orders, shipped, .. } => {
                if events { shipped } else { orders }.ready_count().await?
            }
            Self::Nats { orders, shipped, dead, .. } => {
                let key = |m: &twice::ReceivedMessage| {
                    let key = if events { None } else { order_key(m.body()) };
                    key.unwrap_or_else(|| m.message_id().as_str().to_owned())
                };
                let mut settled = settled.clone();
                if !events {
                    // What sits in the dead-letter stream is settled too (its line may have
                    // been lost with a processor killed right after the move).
                    settled.extend(peek_all(dead).await?.iter().map(key));
                }
                let stream = if events { shipped } else { orders };
                let mut counted = Unsettled::default();
                for m in peek_all(stream).await? {
                    if settled.contains(&key(&m)) {
                        counted.kept += 1;
                    } else {
                        counted.left += 1;
                    }
                }
                return Ok(counted);
            }
        };
        Ok(Unsettled { left, kept: 0 })
    }

    /// Takes everything in the orders' dead-letter queue: the reason by `order-<order id>`.
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<HashMap<String, String>> {
        let mut out = HashMap::new();
        let mut note = |m: &twice::ReceivedMessage| {
            let key = order_key(m.body()).unwrap_or_else(|| m.message_id().as_str().to_owned());
            out.insert(key, m.dead_letter_reason.clone().unwrap_or_default());
        };
        match self {
            Self::Serve(s) => {
                let client = ServiceBusClient::from_connection_string(&s.connection_string())?;
                let dlq = client.receiver(
                    &format!("{QUEUE}/$DeadLetterQueue"),
                    ReceiverOptions::new().max_concurrent_calls(64),
                );
                loop {
                    let got = dlq.receive_messages(500, Duration::from_secs(2)).await?;
                    if got.is_empty() {
                        break;
                    }
                    for d in &got {
                        note(d.message());
                        dlq.complete_message(d).await?;
                    }
                }
                client.close().await;
            }
            Self::RabbitMq { orders, .. } => {
                drain(&orders.dead_letter_receiver().await?, &mut note).await?;
            }
            Self::Nats { dead, .. } => drain(dead, &mut note).await?,
        }
        Ok(out)
    }

    /// Stops `twice serve`, or removes the run's queues or streams from the broker.
    pub(crate) async fn close(&mut self) {
        match self {
            Self::Serve(s) => s.kill().await,
            Self::RabbitMq { orders, shipped, .. } => {
                for t in [orders, shipped] {
                    if let Err(e) = t.delete().await {
                        eprintln!("warning: removing {}: {e}", t.queue());
                    }
                    t.close().await;
                }
            }
            Self::Nats { orders, shipped, .. } => {
                for t in [orders, shipped] {
                    if let Err(e) = t.delete().await {
                        eprintln!("warning: removing {}: {e}", t.stream());
                    }
                }
            }
        }
    }
}

/// Every message a stream holds, without taking any.
async fn peek_all(stream: &NatsTransport) -> anyhow::Result<Vec<twice::ReceivedMessage>> {
    let mut out = Vec::new();
    let mut from = None;
    loop {
        let page = stream.peek(from, 500).await?;
        let Some(last) = page.last() else { break };
        from = Some(u64::try_from(last.sequence_number.get())?.saturating_add(1));
        out.extend(page);
    }
    Ok(out)
}

/// The RabbitMQ options of the controller and of the processors: the same queue arguments.
pub(crate) fn rabbitmq_options(url: &str, queue: &str) -> RabbitMqOptions {
    RabbitMqOptions::new(url, queue)
        .lock_duration(LOCK)
        .max_delivery_count(Some(MAX_DELIVERY_COUNT))
        .identity(order_identity())
}

/// The NATS options of the controller and of the processors: the same stream settings.
pub(crate) fn nats_options(url: &str, stream: &str) -> NatsOptions {
    NatsOptions::new(url, stream)
        .lock_duration(LOCK)
        .max_delivery_count(Some(MAX_DELIVERY_COUNT))
        .duplicate_window(DUPLICATE_WINDOW)
        .identity(order_identity())
}

/// The `twice serve` configuration of the run: the two queues, duplicate detection on.
fn write_serve_config(dir: &Path) -> anyhow::Result<()> {
    std::fs::write(
        dir.join("Config.json"),
        format!(
            r#"{{"UserConfig":{{"Namespaces":[{{"Name":"sbemulatorns","Queues":[{{"Name":"{QUEUE}","Properties":{{
              "LockDuration":"PT{lock}S","MaxDeliveryCount":{MAX_DELIVERY_COUNT},
              "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT30M"}}}},
              {{"Name":"{SHIPPED}","Properties":{{
              "LockDuration":"PT{lock}S","MaxDeliveryCount":{MAX_DELIVERY_COUNT},
              "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT30M"}}}}]}}]}}}}"#,
            lock = LOCK.as_secs()
        ),
    )?;
    Ok(())
}

/// A free loopback port (bound and released; the broker binds it with SO_REUSEADDR).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Where the orders are sent, and how.
#[derive(Clone, Debug)]
pub(crate) enum Producer {
    /// The twice Service Bus client, every order with its stable id.
    ServiceBus { connection_string: String },
    /// A plain lapin publisher with confirms, through the default exchange.
    RabbitMq { url: String, queue: String },
    /// A plain async-nats JetStream publisher.
    Nats { url: String, subject: String },
}

/// A producer's connection, opened again after a failure.
pub(crate) enum Link {
    ServiceBus(ServiceBusClient, twice_servicebus_client::Sender),
    RabbitMq { url: String, queue: String, channel: Option<(lapin::Connection, lapin::Channel)> },
    Nats { url: String, subject: String, context: Option<async_nats::jetstream::Context> },
}

impl Producer {
    /// Whether this producer leaves the message id out of `order_id` (every other order on
    /// RabbitMQ and NATS: a producer that is not twice).
    pub(crate) fn without_id(&self, order_id: u64) -> bool {
        !matches!(self, Self::ServiceBus { .. }) && order_id.is_multiple_of(2)
    }

    /// The connection; nothing is opened before the first send.
    pub(crate) fn link(&self) -> anyhow::Result<Link> {
        Ok(match self {
            Self::ServiceBus { connection_string } => {
                let client = ServiceBusClient::from_connection_string(connection_string)?;
                let sender = client.sender(QUEUE);
                Link::ServiceBus(client, sender)
            }
            Self::RabbitMq { url, queue } => {
                Link::RabbitMq { url: url.clone(), queue: queue.clone(), channel: None }
            }
            Self::Nats { url, subject } => {
                Link::Nats { url: url.clone(), subject: subject.clone(), context: None }
            }
        })
    }
}

impl Link {
    /// Sends one order once; `Ok` when the broker acknowledged it. After an error the next
    /// call connects again.
    pub(crate) async fn send(&mut self, body: &str, id: Option<&str>) -> anyhow::Result<()> {
        match self {
            Self::ServiceBus(_, sender) => {
                let mut message =
                    Message::new(body.to_owned()).with_content_type("application/json");
                if let Some(id) = id {
                    message = message.with_message_id(id);
                }
                sender.send_message(message).await?;
                Ok(())
            }
            Self::RabbitMq { url, queue, channel } => {
                let r = rabbitmq_send(url, queue, channel, body, id).await;
                if r.is_err() {
                    *channel = None;
                }
                r
            }
            Self::Nats { url, subject, context } => {
                let r = nats_send(url, subject, context, body, id).await;
                if r.is_err() {
                    *context = None;
                }
                r
            }
        }
    }

    pub(crate) async fn close(self) {
        match self {
            Self::ServiceBus(client, _) => client.close().await,
            Self::RabbitMq { channel: Some((connection, _)), .. } => {
                let _ = connection.close(200, "done".into()).await;
            }
            Self::RabbitMq { .. } | Self::Nats { .. } => {}
        }
    }
}

/// One publish with a publisher confirm, through the default exchange, mandatory.
async fn rabbitmq_send(
    url: &str,
    queue: &str,
    channel: &mut Option<(lapin::Connection, lapin::Channel)>,
    body: &str,
    id: Option<&str>,
) -> anyhow::Result<()> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::ShortString;
    let (_, ch) = match channel {
        Some(c) => c,
        None => {
            let connection =
                lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
            let ch = connection.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            channel.insert((connection, ch))
        }
    };
    let mut properties = lapin::BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::try_new("application/json")?);
    if let Some(id) = id {
        properties = properties.with_message_id(ShortString::try_new(id)?);
    }
    let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
    let confirm = ch
        .basic_publish(
            "".into(),
            ShortString::try_new(queue)?,
            options,
            body.as_bytes(),
            properties,
        )
        .await?
        .await?;
    match confirm {
        lapin::Confirmation::Ack(None) => Ok(()),
        lapin::Confirmation::Ack(Some(_)) => bail!("no queue {queue} took the order"),
        other => bail!("RabbitMQ did not confirm the order: {other:?}"),
    }
}

/// One JetStream publish, waiting for the stream's acknowledgement.
async fn nats_send(
    url: &str,
    subject: &str,
    context: &mut Option<async_nats::jetstream::Context>,
    body: &str,
    id: Option<&str>,
) -> anyhow::Result<()> {
    let js = match context {
        Some(js) => js,
        None => {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(url)
                .await?;
            context.insert(async_nats::jetstream::new(client))
        }
    };
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = id {
        headers.insert("Nats-Msg-Id", id);
    }
    headers.insert("Content-Type", "application/json");
    let ack = js.publish_with_headers(subject.to_owned(), headers, body.to_owned().into()).await?;
    tokio::time::timeout(Duration::from_secs(5), ack)
        .await
        .context("no acknowledgement from the stream within 5 s")??;
    Ok(())
}
