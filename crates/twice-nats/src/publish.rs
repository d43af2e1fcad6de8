//! The NATS JetStream transport as a [`Publish`]: what an outbox relay sends on.

use async_nats::jetstream::context::PublishErrorKind;
use twice::outbox::BatchError;
use twice::{Message, Publish, TransportError};

use crate::{NatsTransport, convert, other};

impl Publish for NatsTransport {
    fn system(&self) -> &'static str {
        "nats"
    }

    /// Publishes `message` to the subject `destination` once, with its id as `Nats-Msg-Id`,
    /// and waits for the stream's acknowledgement (a duplicate within the stream's window is
    /// acknowledged too, and dropped). Scheduled messages are not held by JetStream: the relay
    /// keeps them until they are due. A subject no stream stores is refused for good.
    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        self.publish_batch(destination, vec![message]).await.map_err(|e| e.error)
    }

    /// Publishes every message, in order, then waits for the stream's acknowledgements.
    async fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> Result<(), BatchError> {
        let mut acks = Vec::with_capacity(messages.len());
        for message in &messages {
            let headers = convert::to_headers(message, &[]);
            let ack = self
                .inner
                .context
                .publish_with_headers(destination.to_owned(), headers, message.body.clone())
                .await
                .map_err(|e| BatchError::none(other("publishing", e)))?;
            acks.push(ack);
        }
        for (stored, ack) in acks.into_iter().enumerate() {
            let error = match ack.await {
                Ok(_) => continue,
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                    TransportError::EntityNotFound(format!(
                        "no stream stores the subject {destination:?}"
                    ))
                }
                Err(e) => other("waiting for the stream's acknowledgement", e),
            };
            return Err(BatchError { stored, error });
        }
        Ok(())
    }
}
