//! The demo's broker, chosen with `--broker`: the embedded broker (the default), RabbitMQ,
//! NATS JetStream, `twice serve` started in process (`serve`), or a Service Bus namespace named
//! by its connection string (`twice serve`, the emulator, Azure).
//!
//! [`BrokerKind`] is what `--broker` names, and [`DemoBroker::queue`] is the one function that
//! makes a queue and returns the transport on it. Another broker is one more variant of each
//! enum and one more arm of each match.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use crate::dlq::admin::{AdminClient, AdminUrl, Ca};
use anyhow::Context as _;
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, Receive,
    ReceivedMessage, SequenceNumber, SharedClock, Timestamp, Transport, TransportError,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver, SendOutcome};
use twice_nats::{NatsDelivery, NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqDelivery, RabbitMqOptions, RabbitMqTransport};
use twice_servicebus::sas::Keys;
use twice_servicebus::{Server, ServerOptions};
use twice_servicebus_client::{ConnectionString, ServiceBusDelivery};

/// How long the broker drops a re-sent message id, where it can.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(600);

/// Which broker the demo runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BrokerKind {
    /// The embedded broker, in the run's temporary directory.
    Embedded,
    /// RabbitMQ at this `amqp://` URL.
    RabbitMq(String),
    /// NATS JetStream at this `nats://` URL.
    Nats(String),
    /// `twice serve` started in process on a free loopback port, durable in the run's
    /// temporary directory, with a key made for the run; the demo talks to it over AMQP with
    /// the Service Bus client.
    Serve,
    /// A Service Bus namespace at this connection string; its queues must exist.
    ServiceBus(String),
}

impl BrokerKind {
    /// Parses `--broker`: `embedded`, `serve`, `amqp://…` (or `amqps://…`), `nats://…`, or a
    /// Service Bus connection string (`Endpoint=sb://…;SharedAccessKeyName=…;…`).
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        if s == "embedded" {
            Ok(Self::Embedded)
        } else if s == "serve" {
            Ok(Self::Serve)
        } else if s.trim_start().to_ascii_lowercase().starts_with("endpoint=") {
            s.parse::<ConnectionString>()
                .map_err(|e| format!("not a usable Service Bus connection string: {e}"))?;
            Ok(Self::ServiceBus(s.to_owned()))
        } else if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Ok(Self::RabbitMq(s.to_owned()))
        } else if s.starts_with("nats://") {
            Ok(Self::Nats(s.to_owned()))
        } else {
            Err(format!(
                "unknown broker {s:?}: use embedded, serve, amqp://…, nats://… or a Service Bus connection string (Endpoint=sb://…)"
            ))
        }
    }

    /// The name the report shows.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::RabbitMq(_) => "rabbitmq",
            Self::Nats(_) => "nats",
            Self::Serve => "serve",
            Self::ServiceBus(_) => "servicebus",
        }
    }

    /// Whether a send says when the broker dropped a duplicate. Service Bus accepts a
    /// duplicate and drops it silently, so over AMQP the demo cannot count them.
    pub(crate) fn reports_duplicates(&self) -> bool {
        matches!(self, Self::Embedded | Self::Nats(_))
    }
}

/// The broker of one run.
#[derive(Debug)]
pub(crate) enum DemoBroker {
    Embedded(Broker),
    RabbitMq {
        url: String,
        run_id: String,
        /// The prefix of queues the user named (`--queues`), used as they are.
        named: Option<String>,
    },
    Nats {
        url: String,
        run_id: String,
        /// The prefix of streams the user named (`--queues`), used as they are.
        named: Option<String>,
    },
    /// `twice serve` in process: its broker (for the counts) and the server's connection
    /// string; the sender stops the server.
    Serve {
        broker: Broker,
        connection_string: String,
        stop: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    },
    ServiceBus {
        connection_string: String,
        /// Where its administration API is, when not where the connection string says.
        admin_url: Option<AdminUrl>,
        /// The CA of `--ca-file`, trusted instead of the public roots.
        ca: Option<Ca>,
    },
}

impl DemoBroker {
    /// Opens the broker of `kind`: the embedded one is created in `dir`.
    pub(crate) async fn open(
        kind: &BrokerKind,
        dir: &Path,
        clock: SharedClock,
        run_id: &str,
        admin_url: Option<AdminUrl>,
        ca: Option<Ca>,
        named: Option<String>,
    ) -> anyhow::Result<Self> {
        Ok(match kind {
            BrokerKind::Embedded => Self::Embedded(
                Broker::open(BrokerOptions::durable(dir).clock(clock))
                    .await
                    .context("opening the embedded broker")?,
            ),
            BrokerKind::RabbitMq(url) => {
                Self::RabbitMq { url: url.clone(), run_id: run_id.into(), named }
            }
            BrokerKind::Nats(url) => Self::Nats { url: url.clone(), run_id: run_id.into(), named },
            BrokerKind::Serve => {
                let broker = Broker::open(BrokerOptions::durable(dir).clock(clock))
                    .await
                    .context("opening the broker of twice serve")?;
                // A key made for this run: nothing else on the machine can use the server.
                let key = format!("{:032x}", rand::random::<u128>());
                let mut keys = Keys::new();
                keys.insert("twice-demo", &key);
                let options = ServerOptions::new()
                    .amqp_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
                    .http_addr(None)
                    .keys(keys);
                let server = Server::bind(options, broker.clone())
                    .await
                    .context("starting twice serve on a loopback port")?;
                let connection_string = server.connection_string();
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                tokio::spawn(async move {
                    if let Err(e) = server
                        .run(async move {
                            let _ = stopped.await;
                        })
                        .await
                    {
                        eprintln!("error: twice serve stopped: {e}");
                    }
                });
                Self::Serve { broker, connection_string, stop: std::sync::Mutex::new(Some(stop)) }
            }
            BrokerKind::ServiceBus(s) => {
                Self::ServiceBus { connection_string: s.clone(), admin_url, ca }
            }
        })
    }

    /// Creates the queue `name` (unique to this run on a shared server) with this lock
    /// duration, MaxDeliveryCount 10 and duplicate detection where the broker has it, and
    /// returns the transport on it, receiving ahead for `concurrency` handlers where the
    /// transport is told.
    pub(crate) async fn queue(
        &self,
        name: &str,
        lock: Duration,
        clock: &SharedClock,
        concurrency: usize,
    ) -> anyhow::Result<DemoTransport> {
        Ok(match self {
            Self::Embedded(broker) => {
                let properties = QueueProperties::default()
                    .with_lock_duration(lock)
                    .with_duplicate_detection(DUPLICATE_WINDOW);
                broker.create_queue(name, properties).await?;
                DemoTransport::Embedded {
                    broker: broker.clone(),
                    receiver: broker.receiver(name).await?,
                }
            }
            Self::RabbitMq { url, run_id, named } => {
                // Only the order queues are the user's; the event queues are the run's.
                let named = named.as_ref().filter(|_| name.starts_with("orders-"));
                let queue = match named {
                    Some(prefix) => format!("{prefix}-{}", name.rsplit('-').next().unwrap_or(name)),
                    None => format!("twice-demo-{run_id}-{name}"),
                };
                let options = RabbitMqOptions::new(url.as_str(), queue.as_str())
                    .lock_duration(lock)
                    .max_concurrent_calls(concurrency)
                    .clock(clock.clone());
                let t = RabbitMqTransport::connect(options)
                    .await
                    .with_context(|| format!("connecting to RabbitMQ at {url}"))?;
                if named.is_some() {
                    empty_named(&queue, t.notes(), t.purge().await?);
                }
                DemoTransport::RabbitMq(t)
            }
            Self::Nats { url, run_id, named } => {
                let named = named.as_ref().filter(|_| name.starts_with("orders-"));
                let stream = match named {
                    Some(prefix) => format!("{prefix}_{}", name.rsplit('-').next().unwrap_or(name)),
                    None => format!("TWICE_DEMO_{run_id}_{name}"),
                }
                .replace('-', "_")
                .to_uppercase();
                let options = NatsOptions::new(url.as_str(), stream.as_str())
                    .lock_duration(lock)
                    .duplicate_window(DUPLICATE_WINDOW)
                    .clock(clock.clone());
                let t = NatsTransport::connect(options)
                    .await
                    .with_context(|| format!("connecting to NATS at {url}"))?;
                if named.is_some() {
                    empty_named(&stream, t.notes(), t.purge().await?);
                }
                DemoTransport::Nats(t)
            }
            Self::Serve { broker, connection_string, .. } => {
                let properties = QueueProperties::default()
                    .with_lock_duration(lock)
                    .with_duplicate_detection(DUPLICATE_WINDOW);
                broker.create_queue(name, properties).await?;
                ServiceBusQueue::connect(connection_string, name, Some(broker.clone()), None)?
                    .into()
            }
            Self::ServiceBus { connection_string, admin_url, ca } => {
                let mut queue =
                    ServiceBusQueue::connect(connection_string, name, None, ca.clone())?;
                queue.check_and_empty(lock, admin_url.clone()).await?;
                queue.admin = queue.counting_admin(admin_url.clone()).await;
                queue.into()
            }
        })
    }

    /// Stops the embedded broker and `twice serve`; a server stays as it is.
    pub(crate) async fn shutdown(&self) {
        match self {
            Self::Embedded(broker) => broker.shutdown().await,
            Self::Serve { broker, stop, .. } => {
                let stop = stop.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
                if let Some(stop) = stop {
                    let _ = stop.send(());
                }
                broker.shutdown().await;
            }
            _ => {}
        }
    }
}

/// Says what a queue the user named lacks, and what emptying it removed.
fn empty_named(queue: &str, notes: &[String], purged: u64) {
    for note in notes {
        eprintln!("note: {note}");
    }
    if purged > 0 {
        eprintln!("note: {queue}: {purged} messages left from before were removed");
    }
}

/// A queue of the demo and the transport on it.
#[derive(Debug)]
pub(crate) enum DemoTransport {
    Embedded { broker: Broker, receiver: Receiver },
    RabbitMq(RabbitMqTransport),
    Nats(NatsTransport),
    ServiceBus(Box<ServiceBusQueue>),
}

impl From<ServiceBusQueue> for DemoTransport {
    fn from(q: ServiceBusQueue) -> Self {
        Self::ServiceBus(Box::new(q))
    }
}

/// A queue reached with the Service Bus client: its receiver and sender, and, when the demo
/// runs `twice serve` itself, the broker behind it (for the counts Service Bus gives only
/// through its management API).
#[derive(Debug)]
pub(crate) struct ServiceBusQueue {
    connection_string: String,
    name: String,
    receiver: twice_servicebus_client::Receiver,
    sender: twice_servicebus_client::Sender,
    broker: Option<Broker>,
    /// The namespace's administration API, for the counts, when the demo does not run the
    /// broker itself and the API answers.
    admin: Option<AdminClient>,
    /// The CA of `--ca-file`, trusted instead of the public roots.
    ca: Option<Ca>,
}

impl ServiceBusQueue {
    fn connect(
        connection_string: &str,
        name: &str,
        broker: Option<Broker>,
        ca: Option<Ca>,
    ) -> anyhow::Result<Self> {
        let (receiver, sender) = Self::link(connection_string, name, ca.as_ref())?;
        Ok(Self {
            connection_string: connection_string.to_owned(),
            name: name.to_owned(),
            receiver,
            sender,
            broker,
            admin: None,
            ca,
        })
    }

    /// A receiver and a sender on `entity`, with credit for many concurrent calls (the
    /// processor and the naive consumer receive in batches).
    fn link(
        connection_string: &str,
        entity: &str,
        ca: Option<&Ca>,
    ) -> anyhow::Result<(twice_servicebus_client::Receiver, twice_servicebus_client::Sender)> {
        let options = Ca::client_options(ca, connection_string)
            .context("reading the Service Bus connection string")?;
        let client = twice_servicebus_client::ServiceBusClient::new(options);
        let receiver = client.receiver(
            entity,
            twice_servicebus_client::ReceiverOptions::new().max_concurrent_calls(64),
        );
        Ok((receiver, client.sender(entity)))
    }

    /// The administration API, when it answers with this queue's counts: the run then ends
    /// when they reach zero. Otherwise `None`, and the run ends after a quiet period.
    async fn counting_admin(&self, admin_url: Option<AdminUrl>) -> Option<AdminClient> {
        let cs: twice_servicebus_client::ConnectionString = self.connection_string.parse().ok()?;
        let admin = AdminClient::for_connection_string(&cs, admin_url).ok()?;
        let admin = Ca::admin(self.ca.as_ref(), admin);
        match admin.counts(&self.name).await {
            Ok(_) => Some(admin),
            Err(e) => {
                eprintln!(
                    "note: no message counts from the administration API ({e}); the run ends \
                     once nothing has been delivered for twice the lock duration"
                );
                None
            }
        }
    }

    /// Checks that the queue exists, and empties it and its dead-letter queue of what an
    /// earlier run left, so that the counts at the end are this run's.
    async fn check_and_empty(
        &self,
        lock: Duration,
        admin_url: Option<AdminUrl>,
    ) -> anyhow::Result<()> {
        let mut left = 0_usize;
        let dlq = self.dead_letter_receiver()?;
        let mut created = false;
        for receiver in [&self.receiver, &dlq] {
            loop {
                let got = match receiver.receive_messages(500, Duration::from_secs(1)).await {
                    Ok(got) => got,
                    Err(e) if e.is_not_found() && !created => {
                        self.create(lock, admin_url.clone()).await?;
                        created = true;
                        continue;
                    }
                    Err(e) if e.is_not_found() => {
                        bail_missing_queue(
                            &self.name,
                            lock,
                            "it is still not found after creating it",
                        )?;
                        unreachable!()
                    }
                    Err(e) => {
                        let hint = Ca::hint(self.ca.as_ref(), &e);
                        return Err(e).with_context(|| {
                            format!("receiving from {} to check it{hint}", receiver.entity_path())
                        });
                    }
                };
                if got.is_empty() {
                    break;
                }
                left += got.len();
                for d in &got {
                    receiver.complete_message(d).await?;
                }
            }
        }
        if left > 0 {
            eprintln!(
                "note: removed {left} messages an earlier run left in {} and its dead-letter queue",
                self.name
            );
        }
        Ok(())
    }

    /// Creates the queue through the namespace's administration API (`twice serve --http`,
    /// the emulator's, Azure's), which needs the `Manage` claim; explains how else when that
    /// fails.
    async fn create(&self, lock: Duration, admin_url: Option<AdminUrl>) -> anyhow::Result<()> {
        let cs: twice_servicebus_client::ConnectionString =
            self.connection_string.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
        let admin = crate::dlq::admin::AdminClient::for_connection_string(&cs, admin_url)
            .map_err(|e| anyhow::anyhow!(e))?;
        let admin = Ca::admin(self.ca.as_ref(), admin);
        match admin.create_queue(&self.name, lock, 10, DUPLICATE_WINDOW).await {
            Ok(()) => {
                eprintln!("note: created the queue {} in the namespace {}", self.name, cs.host());
                Ok(())
            }
            Err(e) => bail_missing_queue(&self.name, lock, &e.to_string()),
        }
    }

    fn dead_letter_receiver(&self) -> anyhow::Result<twice_servicebus_client::Receiver> {
        let entity = format!("{}/$DeadLetterQueue", self.name);
        let (receiver, _) = Self::link(&self.connection_string, &entity, self.ca.as_ref())?;
        Ok(receiver)
    }
}

/// The queues a namespace must have for the demo, and how to make them.
fn bail_missing_queue(name: &str, lock: Duration, why: &str) -> anyhow::Result<()> {
    let secs = lock.as_secs();
    let queue = |name: &str| {
        format!(
            "{{\"Name\":\"{name}\",\"Properties\":{{\"LockDuration\":\"PT{secs}S\",\"MaxDeliveryCount\":10,\"RequiresDuplicateDetection\":true,\"DuplicateDetectionHistoryTimeWindow\":\"PT10M\"}}}}"
        )
    };
    let queues: Vec<String> =
        ["orders-naive", "orders-twice", "shipped-naive", "shipped-twice"].map(queue).to_vec();
    anyhow::bail!(
        "the queue {name:?} does not exist in the Service Bus namespace, and the demo could not \
         create it through the administration API ({why}). The demo needs four queues, \
         \"orders-naive\", \"orders-twice\", \"shipped-naive\" and \"shipped-twice\", with \
         LockDuration PT{secs}S (--lock-seconds), MaxDeliveryCount 10 and duplicate detection. \
         Create them with a key that has the Manage claim (twice serve serves the administration \
         API on --http, 127.0.0.1:5300 by default), or start twice serve with --config FILE \
         holding:\n\
         {{\"UserConfig\":{{\"Namespaces\":[{{\"Name\":\"sbemulatorns\",\"Queues\":[\n  {}]}}]}}}}\n\
         (the emulator takes the same Config.json; on Azure create them in the portal or with \
         `az servicebus queue create --lock-duration PT{secs}S --max-delivery-count 10 --enable-duplicate-detection true`)",
        queues.join(",\n  ")
    )
}

/// A delivery from a [`DemoTransport`].
#[derive(Debug)]
pub(crate) enum DemoDelivery {
    Embedded(ReceivedMessage),
    RabbitMq(RabbitMqDelivery),
    Nats(Box<NatsDelivery>),
    ServiceBus(ServiceBusDelivery),
}

impl Delivery for DemoDelivery {
    fn message(&self) -> &ReceivedMessage {
        match self {
            Self::Embedded(m) => m,
            Self::RabbitMq(d) => d.message(),
            Self::Nats(d) => d.message(),
            Self::ServiceBus(d) => d.message(),
        }
    }
}

/// A delivery of the wrong kind for the transport: a bug in the demo, never expected.
fn mismatch() -> TransportError {
    TransportError::Invalid("a delivery settled on another broker's transport".into())
}

impl DemoTransport {
    /// Sends a message; returns whether the broker dropped it as a duplicate.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a send cut off may or may not have been stored.
    pub(crate) async fn send(&self, message: Message) -> anyhow::Result<bool> {
        Ok(match self {
            Self::Embedded { broker, receiver } => matches!(
                broker.send(&receiver.entity().path, message).await?,
                SendOutcome::Duplicate
            ),
            Self::RabbitMq(t) => {
                t.send(message).await?;
                false
            }
            Self::Nats(t) => t.send_reporting_duplicate(message).await?,
            Self::ServiceBus(q) => {
                // Service Bus accepts a duplicate and drops it without saying so.
                q.sender.send_message(message).await?;
                false
            }
        })
    }

    /// How many messages are not yet settled: waiting, locked, or held by a receiver. On a
    /// Service Bus namespace reached by connection string the counts come from its
    /// administration API (`twice serve --http`, the emulator's, Azure's); `None` when that
    /// API does not answer.
    pub(crate) async fn unsettled(&self) -> anyhow::Result<Option<u64>> {
        let counts = |c: twice_broker::MessageCounts| c.active + c.scheduled + c.deferred;
        Ok(Some(match self {
            Self::Embedded { broker, receiver } => {
                counts(broker.counts(&receiver.entity().path).await?)
            }
            Self::RabbitMq(t) => t.ready_count().await? + t.unsettled(),
            Self::Nats(t) => t.message_count().await?,
            Self::ServiceBus(q) => match (&q.broker, &q.admin) {
                (Some(broker), _) => counts(broker.counts(&q.name).await?),
                (None, Some(admin)) => {
                    let c = admin.counts(&q.name).await?;
                    c.active + c.scheduled + c.deferred
                }
                (None, None) => return Ok(None),
            },
        }))
    }

    /// Receives whatever is left in the queue within `wait` and abandons it; returns how many
    /// messages that was. Used at the end of a run whose broker gives no counts.
    pub(crate) async fn left_over(&self, wait: Duration) -> anyhow::Result<u64> {
        let got = self.receive(500, wait).await?;
        for d in &got {
            self.abandon(d, Properties::default()).await?;
        }
        Ok(got.len() as u64)
    }

    /// The dead-letter queue: the reason by message id.
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<HashMap<MessageId, String>> {
        let mut out = HashMap::new();
        let mut note = |m: &ReceivedMessage| {
            out.insert(m.message_id().clone(), m.dead_letter_reason.clone().unwrap_or_default());
        };
        match self {
            Self::Embedded { broker, receiver } => {
                let path = format!("{}/$DeadLetterQueue", receiver.entity().path);
                let mut from = SequenceNumber::new(0);
                loop {
                    let page = broker.peek(&path, from, 500).await?;
                    let Some(last) = page.last() else { break };
                    from = last.sequence_number.next();
                    page.iter().for_each(&mut note);
                }
            }
            Self::RabbitMq(t) => drain(&t.dead_letter_receiver().await?, &mut note).await?,
            Self::Nats(t) => drain(&t.dead_letter_receiver().await?, &mut note).await?,
            Self::ServiceBus(q) => match &q.broker {
                Some(broker) => {
                    let path = format!("{}/$DeadLetterQueue", q.name);
                    let mut from = SequenceNumber::new(0);
                    loop {
                        let page = broker.peek(&path, from, 500).await?;
                        let Some(last) = page.last() else { break };
                        from = last.sequence_number.next();
                        page.iter().for_each(&mut note);
                    }
                }
                None => {
                    // Peeked, not received: the dead-lettered messages stay for `twice dlq`.
                    let dlq = q.dead_letter_receiver()?;
                    let mut from = None;
                    loop {
                        let page = dlq.peek_messages(from, 500).await?;
                        let Some(last) = page.last() else { break };
                        from = Some(last.sequence_number.next());
                        page.iter().for_each(&mut note);
                    }
                    dlq.close().await;
                }
            },
        }
        Ok(out)
    }

    /// Removes the queue from a shared server.
    pub(crate) async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Self::Embedded { .. } => {}
            Self::RabbitMq(t) => t.delete().await?,
            Self::Nats(t) => t.delete().await?,
            // The queues of a namespace are the user's; `twice serve` in process goes away
            // with the run's directory.
            Self::ServiceBus(_) => {}
        }
        Ok(())
    }
}

/// Receives and completes everything in a dead-letter queue (the run is over; the queue is
/// deleted next), noting each message.
pub(crate) async fn drain<T: Transport>(
    t: &T,
    note: &mut impl FnMut(&ReceivedMessage),
) -> anyhow::Result<()> {
    loop {
        let got = t.receive(500, Duration::from_millis(500)).await?;
        if got.is_empty() {
            return Ok(());
        }
        for d in &got {
            note(d.message());
            t.complete(d).await?;
        }
    }
}

impl Receive for DemoTransport {
    type Delivery = DemoDelivery;

    /// # Cancel safety
    ///
    /// As the transport inside.
    async fn receive(&self, n: usize, wait: Duration) -> Result<Vec<DemoDelivery>, TransportError> {
        Ok(match self {
            Self::Embedded { receiver, .. } => {
                receiver.receive(n, wait).await?.into_iter().map(DemoDelivery::Embedded).collect()
            }
            Self::RabbitMq(t) => {
                t.receive(n, wait).await?.into_iter().map(DemoDelivery::RabbitMq).collect()
            }
            Self::Nats(t) => t
                .receive(n, wait)
                .await?
                .into_iter()
                .map(|d| DemoDelivery::Nats(Box::new(d)))
                .collect(),
            Self::ServiceBus(q) => q
                .receiver
                .receive(n, wait)
                .await?
                .into_iter()
                .map(DemoDelivery::ServiceBus)
                .collect(),
        })
    }

    async fn complete(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.complete(d).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.complete(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.complete(d).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => q.receiver.complete(d).await,
            _ => Err(mismatch()),
        }
    }

    async fn abandon(&self, d: &DemoDelivery, p: Properties) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.abandon(d, p).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.abandon(d, p).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.abandon(d, p).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => q.receiver.abandon(d, p).await,
            _ => Err(mismatch()),
        }
    }

    async fn dead_letter(
        &self,
        d: &DemoDelivery,
        r: DeadLetterReason,
    ) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.dead_letter(d, r).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.dead_letter(d, r).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.dead_letter(d, r).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => {
                q.receiver.dead_letter(d, r).await
            }
            _ => Err(mismatch()),
        }
    }

    async fn defer(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => receiver.defer(d).await,
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.defer(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.defer(d).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => q.receiver.defer(d).await,
            _ => Err(mismatch()),
        }
    }
}

impl Transport for DemoTransport {
    fn entity(&self) -> &EntityInfo {
        match self {
            Self::Embedded { receiver, .. } => receiver.entity(),
            Self::RabbitMq(t) => t.entity(),
            Self::Nats(t) => t.entity(),
            Self::ServiceBus(q) => q.receiver.entity(),
        }
    }

    fn system(&self) -> &'static str {
        match self {
            Self::Embedded { receiver, .. } => receiver.system(),
            Self::RabbitMq(t) => t.system(),
            Self::Nats(t) => t.system(),
            Self::ServiceBus(q) => q.receiver.system(),
        }
    }

    async fn release(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.release(d).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.release(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.release(d).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => q.receiver.release(d).await,
            _ => Err(mismatch()),
        }
    }

    async fn renew_lock(&self, d: &DemoDelivery) -> Result<Timestamp, TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.renew_lock(d).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.renew_lock(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.renew_lock(d).await,
            (Self::ServiceBus(q), DemoDelivery::ServiceBus(d)) => q.receiver.renew_lock(d).await,
            _ => Err(mismatch()),
        }
    }
}
