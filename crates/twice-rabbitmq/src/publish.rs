//! The RabbitMQ transport as a [`Publish`]: what an outbox relay sends on.

use twice::outbox::BatchError;
use twice::{Message, Publish, TransportError};

use crate::{RabbitMqTransport, convert};

impl Publish for RabbitMqTransport {
    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    /// Publishes `message` once to the queue `destination` (through the default exchange,
    /// mandatory, with a publisher confirm) on this transport's connection, whatever queue
    /// the transport receives from. RabbitMQ has no duplicate detection: a message the relay
    /// sends again after dying between the confirm and the deletion of its row arrives twice,
    /// with the same id, and the receiver's inbox drops the copy. Scheduled messages are not
    /// held by RabbitMQ: the relay keeps them until they are due. A queue that does not exist
    /// is refused for good.
    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        let properties = convert::to_amqp(&message, self.inner.options.clock.now(), &[])?;
        self.publish_to(destination, &message.body, properties).await
    }

    /// Publishes every message in order, then waits for the confirms.
    async fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> Result<(), BatchError> {
        let now = self.inner.options.clock.now();
        let mut framed = Vec::with_capacity(messages.len());
        for m in &messages {
            framed.push((&m.body[..], convert::to_amqp(m, now, &[]).map_err(BatchError::none)?));
        }
        self.publish_all(destination, framed).await
    }
}
