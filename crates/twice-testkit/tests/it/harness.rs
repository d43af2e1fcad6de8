//! A harness per transport: how the kit makes a fresh entity on each broker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tempfile::TempDir;
use tokio::sync::oneshot;

use twice::{Message, ReceivedMessage, TransportError};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver};
use twice_nats::{NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_servicebus::{Server, ServerOptions};
use twice_servicebus_client::{
    ClientOptions, Receiver as SbReceiver, ReceiverOptions, Sender, ServiceBusClient, SessionClient,
};
use twice_testkit::conformance::sessions::{with_sessions, without_sessions};
use twice_testkit::conformance::{Entity, EntitySettings, Harness, Interruption, SessionEntity};
use twice_testkit::nats::TestStream;
use twice_testkit::process::ServerRestart;
use twice_testkit::proxy::Proxy;
use twice_testkit::rabbitmq::{TestQueue, publish_raw_to};
use twice_testkit::require_service;

/// Receives and completes everything `t` has now.
async fn drain<T: twice::Transport>(t: &T) -> Result<Vec<ReceivedMessage>, TransportError> {
    let mut out = Vec::new();
    loop {
        let got = t.receive(100, Duration::from_millis(300)).await?;
        if got.is_empty() {
            return Ok(out);
        }
        for d in &got {
            t.complete(d).await?;
            out.push(twice::Delivery::message(d).clone());
        }
    }
}

/// The embedded broker, durable in a temporary directory.
pub(crate) struct Embedded;

/// An open embedded broker and its receivers.
#[derive(Clone)]
struct Opened {
    broker: Broker,
    transport: Arc<Receiver>,
    dead_letters: Receiver,
}

impl Opened {
    async fn open(dir: &std::path::Path, queue: &str) -> Self {
        let broker = Broker::open(BrokerOptions::durable(dir)).await.expect("opening the broker");
        let transport = Arc::new(broker.receiver(queue).await.expect("a receiver"));
        let dead_letters =
            broker.receiver(&format!("{queue}/$DeadLetterQueue")).await.expect("a receiver");
        Self { broker, transport, dead_letters }
    }
}

pub(crate) struct EmbeddedEntity {
    queue: String,
    settings: EntitySettings,
    // A std Mutex: cloned out or swapped, never held across an await.
    opened: Mutex<Opened>,
    dir: TempDir,
}

impl EmbeddedEntity {
    fn opened(&self) -> Opened {
        self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl Entity for EmbeddedEntity {
    type Transport = Receiver;

    fn transport(&self) -> Arc<Receiver> {
        self.opened().transport
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.opened().broker.send(&self.queue, message).await?;
        Ok(())
    }

    async fn take_dead_letters(&self) -> Result<Vec<ReceivedMessage>, TransportError> {
        drain(&self.opened().dead_letters).await
    }

    /// Shuts the broker down and opens it again on its data directory.
    async fn interrupt(&self) -> Interruption {
        self.opened().broker.shutdown().await;
        let reopened = Opened::open(self.dir.path(), &self.queue).await;
        *self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = reopened;
        Interruption::Reopened
    }

    /// A send without an id: the broker names the message at enqueue.
    async fn send_without_id(&self, body: &'static [u8]) -> Option<Result<(), TransportError>> {
        Some(
            self.opened()
                .broker
                .send(&self.queue, Message::new(body))
                .await
                .map(|_| ())
                .map_err(Into::into),
        )
    }

    async fn recreate(&self) -> Option<Result<(), TransportError>> {
        let broker = self.opened().broker;
        let remade = async {
            broker.delete_queue(&self.queue).await?;
            broker.create_queue(&self.queue, queue_properties(self.settings)).await
        };
        Some(remade.await.map_err(Into::into))
    }
}

impl Harness for Embedded {
    type Entity = EmbeddedEntity;

    fn name(&self) -> &'static str {
        "embedded (twice-broker)"
    }

    /// Service Bus's shortest lock, which the broker enforces.
    fn short_lock(&self) -> Duration {
        Duration::from_secs(5)
    }

    async fn create(&self, s: EntitySettings) -> Option<EmbeddedEntity> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let broker =
            Broker::open(BrokerOptions::durable(dir.path())).await.expect("opening the broker");
        let queue = "kit".to_owned();
        broker.create_queue(&queue, queue_properties(s)).await.expect("creating the queue");
        broker.shutdown().await;
        let opened = Mutex::new(Opened::open(dir.path(), &queue).await);
        Some(EmbeddedEntity { queue, settings: s, opened, dir })
    }

    async fn create_with_lock_told(
        &self,
        _settings: EntitySettings,
        _told: Duration,
    ) -> Option<Result<EmbeddedEntity, String>> {
        Some(Err("the embedded receiver takes the lock from its entity: it cannot be told another"
            .into()))
    }

    async fn sessions(&self) -> Option<String> {
        let broker = Broker::open(BrokerOptions::in_memory()).await.expect("opening the broker");
        let properties = queue_properties(EntitySettings::default()).with_requires_session(true);
        broker.create_queue(SESSIONS, properties).await.expect("creating the queue");
        let transport = Arc::new(broker.receiver(SESSIONS).await.expect("a receiver"));
        with_sessions(EmbeddedSessions { broker, transport }).await
    }
}

/// The session-enabled queue of the session scenario.
const SESSIONS: &str = "kit-sessions";

/// A session-enabled queue of an in-memory embedded broker.
pub(crate) struct EmbeddedSessions {
    broker: Broker,
    transport: Arc<Receiver>,
}

impl SessionEntity for EmbeddedSessions {
    type Transport = Receiver;

    fn transport(&self) -> Arc<Receiver> {
        Arc::clone(&self.transport)
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.broker.send(SESSIONS, message).await?;
        Ok(())
    }
}

fn queue_properties(s: EntitySettings) -> QueueProperties {
    let properties = QueueProperties::default()
        .with_lock_duration(s.lock_duration)
        .with_max_delivery_count(s.max_delivery_count);
    if s.duplicate_detection {
        properties.with_duplicate_detection(Duration::from_secs(600))
    } else {
        properties
    }
}

/// `twice serve` in process on a free port, over a durable broker in a temporary directory,
/// reached with the Service Bus client.
pub(crate) struct ServiceBus;

/// A running server: its broker and the task that serves it.
struct Serving {
    broker: Broker,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Serving {
    /// Opens the broker in `dir` and serves it on `addr` (port 0: a free one).
    async fn start(dir: &std::path::Path, addr: SocketAddr) -> (Self, Server<Broker>) {
        let broker = Broker::open(BrokerOptions::durable(dir)).await.expect("opening the broker");
        let options = ServerOptions::new().amqp_addr(addr).http_addr(None);
        let server = Server::bind(options, broker.clone()).await.expect("binding twice serve");
        (Self { broker, stop: None, task: None }, server)
    }

    fn run(mut self, server: Server<Broker>) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.task = Some(tokio::spawn(async move {
            let _ = server
                .run(async move {
                    let _ = stopped.await;
                })
                .await;
        }));
        self
    }

    /// Stops serving (closing every connection) and shuts the broker down.
    async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.broker.shutdown().await;
    }
}

pub(crate) struct ServiceBusEntity {
    settings: EntitySettings,
    transport: Arc<SbReceiver>,
    dead_letters: SbReceiver,
    sender: Sender,
    addr: SocketAddr,
    serving: tokio::sync::Mutex<Serving>,
    dir: TempDir,
}

impl Entity for ServiceBusEntity {
    type Transport = SbReceiver;

    fn transport(&self) -> Arc<SbReceiver> {
        Arc::clone(&self.transport)
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        Ok(self.sender.send_message(message).await?)
    }

    async fn take_dead_letters(&self) -> Result<Vec<ReceivedMessage>, TransportError> {
        drain(&self.dead_letters).await
    }

    /// Stops the server and its broker, and starts both again on the same port and data
    /// directory: a restart of `twice serve`.
    async fn interrupt(&self) -> Interruption {
        let mut serving = self.serving.lock().await;
        serving.stop().await;
        let (restarted, server) = Serving::start(self.dir.path(), self.addr).await;
        *serving = restarted.run(server);
        Interruption::Restarted
    }

    /// A send without an id, straight to the broker behind `twice serve` (the Service Bus
    /// client always sets one): the broker names the message at enqueue.
    async fn send_without_id(&self, body: &'static [u8]) -> Option<Result<(), TransportError>> {
        let broker = self.serving.lock().await.broker.clone();
        Some(broker.send(SB_QUEUE, Message::new(body)).await.map(|_| ()).map_err(Into::into))
    }

    async fn recreate(&self) -> Option<Result<(), TransportError>> {
        let broker = self.serving.lock().await.broker.clone();
        let remade = async {
            broker.delete_queue(SB_QUEUE).await?;
            broker.create_queue(SB_QUEUE, queue_properties(self.settings)).await
        };
        Some(remade.await.map_err(Into::into))
    }
}

/// Why the embedded broker's lock row is not run.
pub(crate) const EMBEDDED_LOCK: &str =
    "the embedded receiver takes the lock from its entity: it cannot be told another";
/// Why RabbitMQ's lock row is not run.
pub(crate) const RABBITMQ_LOCK: &str =
    "RabbitMQ has no lock of its own: the transport's is the only one";

/// The queue of the Service Bus harness.
const SB_QUEUE: &str = "kit";

impl Drop for ServiceBusEntity {
    fn drop(&mut self) {
        if let Some(s) = self.serving.get_mut().stop.take() {
            let _ = s.send(());
        }
    }
}

impl Harness for ServiceBus {
    type Entity = ServiceBusEntity;

    fn name(&self) -> &'static str {
        "twice serve (twice-servicebus-client)"
    }

    /// Service Bus's shortest lock, which the broker enforces.
    fn short_lock(&self) -> Duration {
        Duration::from_secs(5)
    }

    async fn create(&self, s: EntitySettings) -> Option<ServiceBusEntity> {
        Some(self.create_told(s, None).await)
    }

    /// The receiver is told the entity's lock is `told` (its `entity_info`); the broker's
    /// deliveries carry their real lock.
    async fn create_with_lock_told(
        &self,
        s: EntitySettings,
        told: Duration,
    ) -> Option<Result<ServiceBusEntity, String>> {
        Some(Ok(self.create_told(s, Some(told)).await))
    }

    async fn sessions(&self) -> Option<String> {
        self.sessions_of().await
    }
}

impl ServiceBus {
    async fn create_told(&self, s: EntitySettings, told: Option<Duration>) -> ServiceBusEntity {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let queue = SB_QUEUE;
        let (serving, server) =
            Serving::start(dir.path(), SocketAddr::from(([127, 0, 0, 1], 0))).await;
        serving.broker.create_queue(queue, queue_properties(s)).await.expect("creating the queue");
        let mut info = serving.broker.entity_info(queue).await.expect("the queue");
        if let Some(told) = told {
            info.lock_duration = told;
        }
        let addr = server.amqp_addr();
        let options = ClientOptions::from_connection_string(&server.connection_string())
            .expect("the server's connection string")
            .operation_timeout(Duration::from_secs(10));
        let serving = tokio::sync::Mutex::new(serving.run(server));
        let client = ServiceBusClient::new(options);
        let transport = Arc::new(
            client
                .receiver(queue, ReceiverOptions::new().max_concurrent_calls(4).entity_info(info)),
        );
        let dead_letters =
            client.receiver(&format!("{queue}/$DeadLetterQueue"), ReceiverOptions::new());
        let sender = client.sender(queue);
        ServiceBusEntity { settings: s, transport, dead_letters, sender, addr, serving, dir }
    }

    async fn sessions_of(&self) -> Option<String> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (serving, server) =
            Serving::start(dir.path(), SocketAddr::from(([127, 0, 0, 1], 0))).await;
        let properties = queue_properties(EntitySettings::default()).with_requires_session(true);
        serving.broker.create_queue(SESSIONS, properties).await.expect("creating the queue");
        let info = serving.broker.entity_info(SESSIONS).await.expect("the queue");
        let options = ClientOptions::from_connection_string(&server.connection_string())
            .expect("the server's connection string")
            .operation_timeout(Duration::from_secs(10));
        let client = ServiceBusClient::new(options);
        let transport = Arc::new(client.session_receiver(
            SESSIONS,
            ReceiverOptions::new().max_concurrent_calls(4).entity_info(info),
        ));
        let sender = client.sender(SESSIONS);
        let serving = serving.run(server);
        with_sessions(ServiceBusSessions { transport, sender, serving, _dir: dir }).await
    }
}

/// A session-enabled queue on `twice serve`, reached with the Service Bus client.
pub(crate) struct ServiceBusSessions {
    transport: Arc<SessionClient>,
    sender: Sender,
    serving: Serving,
    _dir: TempDir,
}

impl SessionEntity for ServiceBusSessions {
    type Transport = SessionClient;

    fn transport(&self) -> Arc<SessionClient> {
        Arc::clone(&self.transport)
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        Ok(self.sender.send_message(message).await?)
    }
}

impl Drop for ServiceBusSessions {
    fn drop(&mut self) {
        if let Some(s) = self.serving.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A transport on a server, with its own client's send.
pub(crate) trait ServerTransport: twice::Transport {
    fn send_message(
        &self,
        message: Message,
    ) -> impl std::future::Future<Output = Result<(), TransportError>> + Send;
}

impl ServerTransport for RabbitMqTransport {
    async fn send_message(&self, message: Message) -> Result<(), TransportError> {
        self.send(message).await.map(|_| ())
    }
}

impl ServerTransport for NatsTransport {
    async fn send_message(&self, message: Message) -> Result<(), TransportError> {
        self.send(message).await.map(|_| ())
    }
}

/// What a server entity does through the broker's own client.
type Raw = Box<
    dyn Fn(&'static [u8]) -> futures::future::BoxFuture<'static, Result<(), TransportError>>
        + Send
        + Sync,
>;
/// Deletes the entity and makes it again.
type Remake =
    Box<dyn Fn() -> futures::future::BoxFuture<'static, Result<(), TransportError>> + Send + Sync>;

/// An entity on a server, reached through a proxy the kit can cut; `G` deletes it on drop.
pub(crate) struct ServerEntity<T, G> {
    transport: Arc<T>,
    dead_letters: T,
    proxy: Proxy,
    restart: Option<ServerRestart>,
    raw: Raw,
    remake: Remake,
    _guard: G,
}

impl<T: ServerTransport, G: Send + Sync + 'static> Entity for ServerEntity<T, G> {
    type Transport = T;

    fn transport(&self) -> Arc<T> {
        Arc::clone(&self.transport)
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.transport.send_message(message).await
    }

    async fn take_dead_letters(&self) -> Result<Vec<ReceivedMessage>, TransportError> {
        drain(&self.dead_letters).await
    }

    /// Restarts the server when the harness was given a restart, otherwise cuts the
    /// connections at the proxy (the server is shared with every other test).
    async fn interrupt(&self) -> Interruption {
        match &self.restart {
            Some(restart) => {
                restart.run().await.unwrap_or_else(|e| panic!("restarting the server: {e}"));
                Interruption::Restarted
            }
            None => {
                self.proxy.cut();
                Interruption::Cut
            }
        }
    }

    async fn send_without_id(&self, body: &'static [u8]) -> Option<Result<(), TransportError>> {
        Some((self.raw)(body).await)
    }

    async fn recreate(&self) -> Option<Result<(), TransportError>> {
        Some((self.remake)().await)
    }
}

fn other(e: impl std::fmt::Display) -> TransportError {
    TransportError::Other { message: e.to_string(), transient: false, source: None }
}

/// RabbitMQ (on 127.0.0.1:5672 unless given), through a proxy the kit can cut, or restarted
/// for real with `restart`.
#[derive(Default)]
pub(crate) struct RabbitMq {
    pub(crate) restart: Option<ServerRestart>,
}

impl Harness for RabbitMq {
    type Entity = ServerEntity<RabbitMqTransport, TestQueue>;

    fn name(&self) -> &'static str {
        "RabbitMQ (twice-rabbitmq)"
    }

    async fn create(&self, s: EntitySettings) -> Option<Self::Entity> {
        let target = self.restart.as_ref().map_or("127.0.0.1:5672", ServerRestart::addr);
        let proxy = require_service("RabbitMQ", Proxy::start(target).await)?;
        let queue = TestQueue::new("twice-kit");
        let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
        // RabbitMQ has no duplicate detection to turn on or off.
        let options = RabbitMqOptions::new(url, queue.name())
            .max_concurrent_calls(4)
            .lock_duration(s.lock_duration)
            .max_delivery_count(Some(s.max_delivery_count));
        // Reachable (the proxy connected): a refusal now is a failure, not a reason to skip.
        let transport =
            RabbitMqTransport::connect(options.clone()).await.expect("creating the queue");
        let dead_letters = transport.dead_letter_receiver().await.expect("the dead-letter queue");
        let name = queue.name().to_owned();
        let raw: Raw = Box::new(move |body| {
            let name = name.clone();
            Box::pin(async move { publish_raw_to(&name, body).await.map_err(other) })
        });
        let remake: Remake = Box::new(move || {
            let options = options.clone();
            Box::pin(async move {
                // Deleted and declared again by transports of their own.
                RabbitMqTransport::connect(options.clone()).await?.delete().await?;
                RabbitMqTransport::connect(options).await.map(|_| ())
            })
        });
        Some(ServerEntity {
            transport: Arc::new(transport),
            dead_letters,
            proxy,
            restart: self.restart.clone(),
            raw,
            remake,
            _guard: queue,
        })
    }

    async fn create_with_lock_told(
        &self,
        _settings: EntitySettings,
        _told: Duration,
    ) -> Option<Result<Self::Entity, String>> {
        Some(Err(RABBITMQ_LOCK.into()))
    }

    async fn sessions(&self) -> Option<String> {
        without_sessions(self, RABBITMQ_INSTEAD_OF_SESSIONS).await
    }
}

/// What a RabbitMQ user does for order within a key.
pub(crate) const RABBITMQ_INSTEAD_OF_SESSIONS: &str = "for order per key, route each key to \
    one of a fixed set of queues (a consistent-hash exchange, or one queue per partition) and \
    run each queue with one processor and `max_concurrent_calls(1)`";

/// NATS JetStream (on 127.0.0.1:4222 unless given), through a proxy the kit can cut, or
/// restarted for real with `restart`.
#[derive(Default)]
pub(crate) struct Nats {
    pub(crate) restart: Option<ServerRestart>,
}

impl Harness for Nats {
    type Entity = ServerEntity<NatsTransport, TestStream>;

    fn name(&self) -> &'static str {
        "NATS JetStream (twice-nats)"
    }

    async fn create(&self, s: EntitySettings) -> Option<Self::Entity> {
        self.create_told(s, None).await
    }

    /// The stream and its consumer made first, with the broker's lock as `AckWait`; the
    /// transport is told another.
    async fn create_with_lock_told(
        &self,
        s: EntitySettings,
        told: Duration,
    ) -> Option<Result<Self::Entity, String>> {
        self.create_told(s, Some(told)).await.map(Ok)
    }

    async fn sessions(&self) -> Option<String> {
        without_sessions(self, NATS_INSTEAD_OF_SESSIONS).await
    }
}

impl Nats {
    async fn create_told(
        &self,
        s: EntitySettings,
        told: Option<Duration>,
    ) -> Option<ServerEntity<NatsTransport, TestStream>> {
        let target = self.restart.as_ref().map_or("127.0.0.1:4222", ServerRestart::addr);
        let proxy = require_service("NATS", Proxy::start(target).await)?;
        let stream = TestStream::new("TWICE_KIT");
        let url = format!("nats://{}", proxy.addr());
        // JetStream always detects duplicates within its window: its shortest window (100 ms)
        // turns it off for sends further apart.
        let window = if s.duplicate_detection {
            Duration::from_secs(600)
        } else {
            Duration::from_millis(100)
        };
        let options = NatsOptions::new(url, stream.name())
            .lock_duration(s.lock_duration)
            .max_delivery_count(Some(s.max_delivery_count))
            .duplicate_window(window);
        if told.is_some() {
            // The broker's consumer first, with the broker's lock as AckWait.
            NatsTransport::connect(options.clone()).await.expect("creating the stream");
        }
        let options = match told {
            Some(told) => options.lock_duration(told),
            None => options,
        };
        // Reachable (the proxy connected): a refusal now is a failure, not a reason to skip.
        let transport = NatsTransport::connect(options.clone()).await.expect("creating the stream");
        let dead_letters = transport.dead_letter_receiver().await.expect("the dead-letter stream");
        let subject = stream.subject();
        let raw: Raw = Box::new(move |body| {
            let subject = subject.clone();
            Box::pin(async move {
                twice_testkit::nats::publish_raw_to(&subject, body).await.map_err(other)
            })
        });
        let remake: Remake = Box::new(move || {
            let options = options.clone();
            Box::pin(async move {
                // Deleted and made again by a transport of its own.
                NatsTransport::connect(options.clone()).await?.delete().await?;
                NatsTransport::connect(options).await.map(|_| ())
            })
        });
        Some(ServerEntity {
            transport: Arc::new(transport),
            dead_letters,
            proxy,
            restart: self.restart.clone(),
            raw,
            remake,
            _guard: stream,
        })
    }
}

/// What a NATS user does for order within a key.
pub(crate) const NATS_INSTEAD_OF_SESSIONS: &str = "for order per key, publish to a subject \
    per partition (`orders.<partition>`, a stream per partition or subject-mapped partitions) \
    and run each with its own consumer and `max_concurrent_calls(1)`";
