//! The demo's broker, chosen with `--broker`: the embedded broker (the default), RabbitMQ or
//! NATS JetStream.
//!
//! [`BrokerKind`] is what `--broker` names, and [`DemoBroker::queue`] is the one function that
//! makes a queue and returns the transport on it. Another broker is one more variant of each
//! enum and one more arm of each match.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use twice::{
    DeadLetterReason, Delivery, EntityInfo, Message, MessageId, Properties, ReceivedMessage,
    SequenceNumber, SharedClock, Timestamp, Transport, TransportError,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver, SendOutcome};
use twice_nats::{NatsDelivery, NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqDelivery, RabbitMqOptions, RabbitMqTransport};

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
}

impl BrokerKind {
    /// Parses `--broker`: `embedded`, `amqp://…` (or `amqps://…`), `nats://…`.
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        if s == "embedded" {
            Ok(Self::Embedded)
        } else if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Ok(Self::RabbitMq(s.to_owned()))
        } else if s.starts_with("nats://") {
            Ok(Self::Nats(s.to_owned()))
        } else {
            Err(format!("unknown broker {s:?}: use embedded, amqp://… or nats://…"))
        }
    }

    /// The name the report shows.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::RabbitMq(_) => "rabbitmq",
            Self::Nats(_) => "nats",
        }
    }
}

/// The broker of one run.
#[derive(Debug)]
pub(crate) enum DemoBroker {
    Embedded(Broker),
    RabbitMq { url: String, run_id: String },
    Nats { url: String, run_id: String },
}

impl DemoBroker {
    /// Opens the broker of `kind`: the embedded one is created in `dir`.
    pub(crate) async fn open(
        kind: &BrokerKind,
        dir: &Path,
        clock: SharedClock,
        run_id: &str,
    ) -> anyhow::Result<Self> {
        Ok(match kind {
            BrokerKind::Embedded => Self::Embedded(
                Broker::open(BrokerOptions::durable(dir).with_clock(clock))
                    .await
                    .context("opening the embedded broker")?,
            ),
            BrokerKind::RabbitMq(url) => Self::RabbitMq { url: url.clone(), run_id: run_id.into() },
            BrokerKind::Nats(url) => Self::Nats { url: url.clone(), run_id: run_id.into() },
        })
    }

    /// Creates the queue `name` (unique to this run on a shared server) with this lock
    /// duration, MaxDeliveryCount 10 and duplicate detection where the broker has it, and
    /// returns the transport on it.
    pub(crate) async fn queue(
        &self,
        name: &str,
        lock: Duration,
        clock: &SharedClock,
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
            Self::RabbitMq { url, run_id } => {
                let options =
                    RabbitMqOptions::new(url.as_str(), format!("twice-demo-{run_id}-{name}"))
                        .lock_duration(lock)
                        .clock(clock.clone());
                DemoTransport::RabbitMq(
                    RabbitMqTransport::connect(options)
                        .await
                        .with_context(|| format!("connecting to RabbitMQ at {url}"))?,
                )
            }
            Self::Nats { url, run_id } => {
                let stream =
                    format!("TWICE_DEMO_{run_id}_{}", name.replace('-', "_")).to_uppercase();
                let options = NatsOptions::new(url.as_str(), stream)
                    .lock_duration(lock)
                    .duplicate_window(DUPLICATE_WINDOW)
                    .clock(clock.clone());
                DemoTransport::Nats(
                    NatsTransport::connect(options)
                        .await
                        .with_context(|| format!("connecting to NATS at {url}"))?,
                )
            }
        })
    }

    /// Stops the embedded broker; a server stays as it is.
    pub(crate) async fn shutdown(&self) {
        if let Self::Embedded(broker) = self {
            broker.shutdown().await;
        }
    }
}

/// A queue of the demo and the transport on it.
#[derive(Debug)]
pub(crate) enum DemoTransport {
    Embedded { broker: Broker, receiver: Receiver },
    RabbitMq(RabbitMqTransport),
    Nats(NatsTransport),
}

/// A delivery from a [`DemoTransport`].
#[derive(Debug)]
pub(crate) enum DemoDelivery {
    Embedded(ReceivedMessage),
    RabbitMq(RabbitMqDelivery),
    Nats(Box<NatsDelivery>),
}

impl Delivery for DemoDelivery {
    fn message(&self) -> &ReceivedMessage {
        match self {
            Self::Embedded(m) => m,
            Self::RabbitMq(d) => d.message(),
            Self::Nats(d) => d.message(),
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
        })
    }

    /// How many messages are not yet settled: waiting, locked, or held by a receiver.
    pub(crate) async fn unsettled(&self) -> anyhow::Result<u64> {
        Ok(match self {
            Self::Embedded { broker, receiver } => {
                let c = broker.counts(&receiver.entity().path).await?;
                c.active + c.scheduled + c.deferred
            }
            Self::RabbitMq(t) => t.ready_count().await? + t.unsettled(),
            Self::Nats(t) => t.message_count().await?,
        })
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
        }
        Ok(out)
    }

    /// Removes the queue from a shared server.
    pub(crate) async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Self::Embedded { .. } => {}
            Self::RabbitMq(t) => t.delete().await?,
            Self::Nats(t) => t.delete().await?,
        }
        Ok(())
    }
}

/// Receives and completes everything in a dead-letter queue (the run is over; the queue is
/// deleted next), noting each message.
async fn drain<T: Transport>(t: &T, note: &mut impl FnMut(&ReceivedMessage)) -> anyhow::Result<()> {
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

impl Transport for DemoTransport {
    type Delivery = DemoDelivery;

    fn entity(&self) -> &EntityInfo {
        match self {
            Self::Embedded { receiver, .. } => receiver.entity(),
            Self::RabbitMq(t) => t.entity(),
            Self::Nats(t) => t.entity(),
        }
    }

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
        })
    }

    async fn complete(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.complete(d).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.complete(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.complete(d).await,
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
            _ => Err(mismatch()),
        }
    }

    async fn defer(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => receiver.defer(d).await,
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.defer(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.defer(d).await,
            _ => Err(mismatch()),
        }
    }

    async fn release(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        match (self, d) {
            (Self::Embedded { receiver, .. }, DemoDelivery::Embedded(d)) => {
                receiver.release(d).await
            }
            (Self::RabbitMq(t), DemoDelivery::RabbitMq(d)) => t.release(d).await,
            (Self::Nats(t), DemoDelivery::Nats(d)) => t.release(d).await,
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
            _ => Err(mismatch()),
        }
    }
}
