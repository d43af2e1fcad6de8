//! The embedded broker as a [`Publish`]: what an outbox relay sends on.

use twice::outbox::BatchError;
use twice::{Message, Publish, TransportError};

use crate::broker::Broker;
use crate::error::Error;

impl Publish for Broker {
    fn system(&self) -> &'static str {
        "twice"
    }

    /// The broker holds a message with a scheduled enqueue time until then.
    fn schedules(&self) -> bool {
        true
    }

    /// [`Broker::send`]: returns once the send is durable, or once the entity's duplicate
    /// detection dropped it as a re-sent id. A missing entity, a message over its size and a
    /// session-less message to a session-enabled entity are refused for good; a full entity and
    /// a storage failure are retried.
    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        transport_error(self.send(destination, message).await.map(|_| ()))
    }

    /// [`Broker::send_batch`]: one durable write for the whole batch, all or nothing.
    async fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> Result<(), BatchError> {
        transport_error(self.send_batch(destination, messages).await.map(|_| ()))
            .map_err(BatchError::none)
    }
}

/// The broker's error as the relay reads it.
fn transport_error(sent: Result<(), Error>) -> Result<(), TransportError> {
    match sent {
        Ok(()) => Ok(()),
        // The broker's storage failed: it refuses everything until it is restarted, which is
        // no fault of this message.
        Err(e @ Error::Io(_)) => Err(TransportError::Other {
            message: e.to_string(),
            transient: true,
            source: Some(Box::new(e)),
        }),
        Err(e) => Err(e.into()),
    }
}
