//! The NATS JetStream transport as a [`Publish`]: what an outbox relay sends on.

use async_nats::jetstream::context::PublishErrorKind;
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
        let headers = convert::to_headers(&message, &[]);
        let ack = self
            .inner
            .context
            .publish_with_headers(destination.to_owned(), headers, message.body.clone())
            .await
            .map_err(|e| other("publishing", e))?
            .await;
        match ack {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                Err(TransportError::EntityNotFound(format!(
                    "no stream stores the subject {destination:?}"
                )))
            }
            Err(e) => Err(other("waiting for the stream's acknowledgement", e)),
        }
    }
}
