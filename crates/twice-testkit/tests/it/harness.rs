//! A harness per transport: how the kit makes a fresh entity on each broker.

use std::sync::Arc;
use std::time::Duration;

use twice::{Message, ReceivedMessage, TransportError};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver};
use twice_nats::{NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::conformance::{Entity, EntitySettings, Harness};
use twice_testkit::nats::TestStream;
use twice_testkit::proxy::Proxy;
use twice_testkit::rabbitmq::TestQueue;
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

/// The embedded broker, in memory.
pub(crate) struct Embedded;

pub(crate) struct EmbeddedEntity {
    broker: Broker,
    queue: String,
    transport: Arc<Receiver>,
    dead_letters: Receiver,
}

impl Entity for EmbeddedEntity {
    type Transport = Receiver;

    fn transport(&self) -> &Arc<Receiver> {
        &self.transport
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.broker.send(&self.queue, message).await?;
        Ok(())
    }

    async fn take_dead_letters(&self) -> Result<Vec<ReceivedMessage>, TransportError> {
        drain(&self.dead_letters).await
    }

    fn interrupt(&self) -> bool {
        false
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
        let broker = Broker::open(BrokerOptions::in_memory()).await.expect("opening the broker");
        let mut properties = QueueProperties::default()
            .with_lock_duration(s.lock_duration)
            .with_max_delivery_count(s.max_delivery_count);
        if s.duplicate_detection {
            properties = properties.with_duplicate_detection(Duration::from_secs(600));
        }
        let queue = "kit".to_owned();
        broker.create_queue(&queue, properties).await.expect("creating the queue");
        let transport = Arc::new(broker.receiver(&queue).await.expect("a receiver"));
        let dead_letters =
            broker.receiver(&format!("{queue}/$DeadLetterQueue")).await.expect("a receiver");
        Some(EmbeddedEntity { broker, queue, transport, dead_letters })
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

/// An entity on a server, reached through a proxy the kit can cut; `G` deletes it on drop.
pub(crate) struct ServerEntity<T, G> {
    transport: Arc<T>,
    dead_letters: T,
    proxy: Proxy,
    _guard: G,
}

impl<T: ServerTransport, G: Send + Sync + 'static> Entity for ServerEntity<T, G> {
    type Transport = T;

    fn transport(&self) -> &Arc<T> {
        &self.transport
    }

    async fn send(&self, message: Message) -> Result<(), TransportError> {
        self.transport.send_message(message).await
    }

    async fn take_dead_letters(&self) -> Result<Vec<ReceivedMessage>, TransportError> {
        drain(&self.dead_letters).await
    }

    fn interrupt(&self) -> bool {
        self.proxy.cut();
        true
    }
}

/// RabbitMQ on 127.0.0.1:5672, through a proxy the kit can cut.
pub(crate) struct RabbitMq;

impl Harness for RabbitMq {
    type Entity = ServerEntity<RabbitMqTransport, TestQueue>;

    fn name(&self) -> &'static str {
        "RabbitMQ (twice-rabbitmq)"
    }

    async fn create(&self, s: EntitySettings) -> Option<Self::Entity> {
        let proxy = require_service("RabbitMQ", Proxy::start("127.0.0.1:5672").await)?;
        let queue = TestQueue::new("twice-kit");
        let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
        // RabbitMQ has no duplicate detection to turn on or off.
        let options = RabbitMqOptions::new(url, queue.name())
            .lock_duration(s.lock_duration)
            .max_delivery_count(Some(s.max_delivery_count));
        // Reachable (the proxy connected): a refusal now is a failure, not a reason to skip.
        let transport = RabbitMqTransport::connect(options).await.expect("creating the queue");
        let dead_letters = transport.dead_letter_receiver().await.expect("the dead-letter queue");
        Some(ServerEntity { transport: Arc::new(transport), dead_letters, proxy, _guard: queue })
    }
}

/// NATS JetStream on 127.0.0.1:4222, through a proxy the kit can cut.
pub(crate) struct Nats;

impl Harness for Nats {
    type Entity = ServerEntity<NatsTransport, TestStream>;

    fn name(&self) -> &'static str {
        "NATS JetStream (twice-nats)"
    }

    async fn create(&self, s: EntitySettings) -> Option<Self::Entity> {
        let proxy = require_service("NATS", Proxy::start("127.0.0.1:4222").await)?;
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
        // Reachable (the proxy connected): a refusal now is a failure, not a reason to skip.
        let transport = NatsTransport::connect(options).await.expect("creating the stream");
        let dead_letters = transport.dead_letter_receiver().await.expect("the dead-letter stream");
        Some(ServerEntity { transport: Arc::new(transport), dead_letters, proxy, _guard: stream })
    }
}
