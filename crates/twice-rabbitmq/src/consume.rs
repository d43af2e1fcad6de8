//! The consuming channel: a task takes each delivery the moment it reaches the client, starts
//! its lock there (the broker's `consumer_timeout` runs from then, whether or not a handler has
//! it yet), and hands it to `receive` through a queue.

use std::sync::Weak;

use futures::StreamExt as _;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Consumer};
use tokio::sync::mpsc;
use twice::TransportError;

use crate::{Inner, RabbitMqDelivery, RabbitMqTransport};

/// The consuming channel of one connection, and the deliveries that have reached the client.
pub(crate) struct Consuming {
    pub(crate) generation: u64,
    pub(crate) channel: Channel,
    pub(crate) arrivals: mpsc::UnboundedReceiver<RabbitMqDelivery>,
    task: tokio::task::AbortHandle,
}

impl Drop for Consuming {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Consuming {
    /// Whether this channel still serves `generation`'s connection.
    pub(crate) fn is_current(&self, generation: u64) -> bool {
        self.generation == generation
            && self.channel.status().connected()
            && !self.task.is_finished()
    }
}

/// Opens a consuming channel on `transport`'s connection `link` with its prefetch, starts
/// consuming, and starts the task that takes the deliveries.
pub(crate) async fn start(
    transport: &RabbitMqTransport,
    connection: &lapin::Connection,
    generation: u64,
) -> Result<Consuming, TransportError> {
    let inner = &transport.inner;
    let channel = connection.create_channel().await.map_err(|e| transport.err(e))?;
    channel
        .basic_qos(inner.options.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| transport.err(e))?;
    let mut arguments = FieldTable::default();
    let o = &inner.options;
    if o.consumer_timeout_stated
        && inner.version.is_some_and(crate::version::ServerVersion::has_consumer_timeout_argument)
    {
        let millis = i64::try_from(o.consumer_timeout.as_millis()).unwrap_or(i64::MAX);
        arguments.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(millis));
    }
    let consumer = channel
        .basic_consume(
            crate::declare::short(transport.queue())?,
            "".into(),
            BasicConsumeOptions::default(),
            arguments,
        )
        .await
        .map_err(|e| transport.err(e))?;
    let (tx, arrivals) = mpsc::unbounded_channel();
    let task = tokio::spawn(take(std::sync::Arc::downgrade(inner), consumer, tx));
    Ok(Consuming { generation, channel, arrivals, task: task.abort_handle() })
}

/// Takes each delivery as it arrives; ends with the consumer (its channel or connection
/// closed, or it was cancelled), which `receive` sees as the queue closing.
async fn take(
    inner: Weak<Inner>,
    mut consumer: Consumer,
    tx: mpsc::UnboundedSender<RabbitMqDelivery>,
) {
    while let Some(next) = consumer.next().await {
        let Some(inner) = inner.upgrade() else { return };
        let transport = RabbitMqTransport { inner };
        match next {
            Ok(delivery) => {
                if let Some(d) = transport.accept(delivery)
                    && tx.send(d).is_err()
                {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(queue = %transport.queue(), "the consumer ended: {e}");
                return;
            }
        }
    }
}
