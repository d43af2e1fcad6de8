//! A [`Publish`] on a Service Bus namespace: what an outbox relay sends on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use twice::outbox::BatchError;
use twice::{Message, Publish, TransportError};

use crate::client::ServiceBusClient;
use crate::error::{Error, condition};
use crate::sender::Sender;

/// Sends to any queue or topic of a namespace, with one [`Sender`] per entity made on first
/// use: a relay's publisher. Made with [`ServiceBusClient::publisher`].
#[derive(Debug)]
pub struct Publisher {
    client: ServiceBusClient,
    senders: Mutex<HashMap<String, Arc<Sender>>>,
}

impl ServiceBusClient {
    /// A publisher to every entity of this namespace, for an outbox relay
    /// ([`twice::Relay`]).
    pub fn publisher(&self) -> Publisher {
        Publisher { client: self.clone(), senders: Mutex::default() }
    }
}

impl Publisher {
    fn sender(&self, entity: &str) -> Arc<Sender> {
        let mut senders = self.senders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        senders
            .entry(entity.to_owned())
            .or_insert_with(|| Arc::new(self.client.sender(entity)))
            .clone()
    }
}

impl Publish for Publisher {
    fn system(&self) -> &'static str {
        "servicebus"
    }

    /// Service Bus holds a message with a scheduled enqueue time until then.
    fn schedules(&self) -> bool {
        true
    }

    /// Sends and waits for the entity's acceptance. Only what no retry can change is
    /// permanent: an entity that does not exist, a message over its size, a message the
    /// client refuses. Every other failure, missing rights included (an operator fixes those
    /// and the rows then go out), is retried.
    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        self.sender(destination).send_message(message).await.map_err(classify)
    }

    /// One batch message (all or nothing), as the SDKs send a batch.
    async fn publish_batch(
        &self,
        destination: &str,
        messages: Vec<Message>,
    ) -> Result<(), BatchError> {
        let sent = self.sender(destination).send_batch(messages).await;
        sent.map_err(|e| BatchError::none(classify(e)))
    }
}

fn classify(e: Error) -> TransportError {
    let size = matches!(&e, Error::Amqp { condition: c, .. } if c == condition::MESSAGE_SIZE);
    match e {
        Error::Invalid(m) => TransportError::Invalid(m),
        e if size => TransportError::Invalid(e.to_string()),
        e if e.is_not_found() => TransportError::EntityNotFound(e.to_string()),
        e => TransportError::Other {
            message: e.to_string(),
            transient: true,
            source: Some(Box::new(e)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_no_retry_changes_is_permanent() {
        let amqp = |c: &str| Error::Amqp { condition: c.to_owned(), description: None };
        assert!(twice::outbox::is_permanent(&classify(amqp(condition::MESSAGE_SIZE))));
        assert!(twice::outbox::is_permanent(&classify(amqp("amqp:not-found"))));
        assert!(!twice::outbox::is_permanent(&classify(amqp("amqp:unauthorized-access"))));
        assert!(!twice::outbox::is_permanent(&classify(Error::ConnectionLost)));
        assert!(!twice::outbox::is_permanent(&classify(amqp(condition::SERVER_BUSY))));
    }
}
