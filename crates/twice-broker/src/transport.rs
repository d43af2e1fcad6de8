//! The in-process [`twice::Transport`]: how the idempotent processor receives from this
//! broker without a network in between.

use std::time::Duration;

use bytes::Bytes;
use twice::{
    DeadLetterReason, EntityInfo, LockToken, Properties, Receive, ReceivedMessage, SessionId,
    SessionReceiver, SessionTransport, Timestamp, Transport, TransportError,
};

use crate::broker::Broker;
use crate::config::EntityDefinition;
use crate::engine::DEAD_LETTER_SUFFIX;
use crate::error::Error;
use crate::session::Session;

/// A receiver on one entity of a [`Broker`], with peek-lock settlement. Cheap to clone.
///
/// Get one with [`Broker::receiver`]. On a session-enabled entity, receive through
/// [`SessionTransport::accept_next_session`] or [`SessionTransport::accept_session`].
#[derive(Clone, Debug)]
pub struct Receiver {
    broker: Broker,
    info: EntityInfo,
}

impl Broker {
    /// A receiver on one entity implementing [`twice::Transport`] (and
    /// [`twice::SessionTransport`] on a session-enabled entity), for the idempotent processor.
    ///
    /// Its [`EntityInfo::message_time_to_live`] is the entity's `DefaultMessageTimeToLive`
    /// (`None`: forever); of a subscription, the shorter of its own and its topic's, since a
    /// message takes the topic's on its way in. A dead-letter queue keeps its messages
    /// forever.
    pub async fn receiver(&self, path: &str) -> Result<Receiver, Error> {
        let mut info = self.entity_info(path).await?;
        info.message_time_to_live = self.time_to_live(&info.path).await?;
        Ok(Receiver::new(self.clone(), info))
    }

    /// The longest a message lives on the entity at `path` (a path as
    /// [`Broker::entity_info`] spells it).
    async fn time_to_live(&self, path: &str) -> Result<Option<Duration>, Error> {
        if path.ends_with(DEAD_LETTER_SUFFIX) {
            return Ok(None);
        }
        Ok(match self.get_entity(path).await? {
            EntityDefinition::Queue { properties, .. } => properties.default_message_time_to_live,
            EntityDefinition::Topic { properties, .. } => properties.default_message_time_to_live,
            EntityDefinition::Subscription { topic, properties, .. } => {
                let topic = self.get_topic(&topic).await?.default_message_time_to_live;
                shorter(topic, properties.default_message_time_to_live)
            }
        })
    }
}

/// The shorter of two times to live, `None` being forever.
fn shorter(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Receiver {
    pub(crate) fn new(broker: Broker, info: EntityInfo) -> Self {
        Self { broker, info }
    }

    /// The broker this receiver talks to.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }
}

fn token(d: &ReceivedMessage) -> Result<LockToken, TransportError> {
    // A message received without a lock cannot be settled: there is nothing to hold.
    d.lock_token.ok_or(TransportError::LockLost)
}

impl Receive for Receiver {
    type Delivery = ReceivedMessage;

    /// # Cancel safety
    ///
    /// Cancel safe: messages locked for a receive whose future was dropped are released
    /// without counting a delivery.
    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        Ok(self.broker.receive(&self.info.path, max_messages, max_wait).await?)
    }

    async fn complete(&self, delivery: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(self.broker.complete_in(&self.info.path, &[token(delivery)?]).await?)
    }

    async fn abandon(
        &self,
        delivery: &ReceivedMessage,
        properties: Properties,
    ) -> Result<(), TransportError> {
        Ok(self.broker.abandon_in(&self.info.path, token(delivery)?, properties).await?)
    }

    async fn dead_letter(
        &self,
        delivery: &ReceivedMessage,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        Ok(self
            .broker
            .dead_letter_in(&self.info.path, token(delivery)?, reason, Properties::new())
            .await?)
    }

    async fn defer(&self, delivery: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(self.broker.defer_in(&self.info.path, token(delivery)?, Properties::new()).await?)
    }
}

impl Transport for Receiver {
    fn entity(&self) -> &EntityInfo {
        &self.info
    }

    fn system(&self) -> &'static str {
        "twice"
    }

    async fn release(&self, delivery: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(self.broker.release_in(&self.info.path, token(delivery)?).await?)
    }

    async fn renew_lock(&self, delivery: &ReceivedMessage) -> Result<Timestamp, TransportError> {
        Ok(self.broker.renew_lock_in(&self.info.path, token(delivery)?).await?)
    }

    /// Schedules a copy of the message (same id, body and properties, plus `properties`) on a
    /// queue, then completes the original. Unsupported on subscriptions (a copy cannot be sent
    /// to one subscription alone) and on entities with duplicate detection (which would drop
    /// the copy). A completion that fails after the copy was scheduled leaves two copies: the
    /// claim makes the second a duplicate.
    async fn redeliver_later(
        &self,
        delivery: &ReceivedMessage,
        delay: Duration,
        properties: Properties,
    ) -> Result<(), TransportError> {
        if self.info.duplicate_detection_window.is_some() || self.info.path.contains('/') {
            return Err(TransportError::Unsupported("delayed redelivery"));
        }
        let token = token(delivery)?;
        let mut copy = delivery.message.clone();
        copy.application_properties.extend(properties);
        copy.scheduled_enqueue_time = Some(self.broker.clock().now() + delay);
        self.broker.send(&self.info.path, copy).await?;
        Ok(self.broker.complete(token).await?)
    }
}

impl SessionTransport for Receiver {
    type Session = Session;

    /// # Cancel safety
    ///
    /// Cancel safe: a session locked for an accept whose future was dropped is released.
    async fn accept_next_session(
        &self,
        max_wait: Duration,
    ) -> Result<Option<Session>, TransportError> {
        Ok(self.broker.accept_next_session(&self.info.path, max_wait).await?)
    }

    async fn accept_session(&self, session_id: &SessionId) -> Result<Session, TransportError> {
        Ok(self.broker.accept_session(&self.info.path, session_id).await?)
    }
}

impl Receive for Session {
    type Delivery = ReceivedMessage;

    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        Ok(Session::receive(self, max_messages, max_wait).await?)
    }

    async fn complete(&self, delivery: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(Session::complete(self, token(delivery)?).await?)
    }

    async fn abandon(
        &self,
        delivery: &ReceivedMessage,
        properties: Properties,
    ) -> Result<(), TransportError> {
        Ok(Session::abandon(self, token(delivery)?, properties).await?)
    }

    async fn dead_letter(
        &self,
        delivery: &ReceivedMessage,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        Ok(Session::dead_letter(self, token(delivery)?, reason, Properties::new()).await?)
    }

    async fn defer(&self, delivery: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(Session::defer(self, token(delivery)?, Properties::new()).await?)
    }
}

impl SessionReceiver for Session {
    fn session_id(&self) -> &SessionId {
        Session::session_id(self)
    }

    fn locked_until(&self) -> Timestamp {
        Session::locked_until(self)
    }

    async fn renew_session_lock(&self) -> Result<Timestamp, TransportError> {
        Ok(Session::renew_session_lock(self).await?)
    }

    async fn get_state(&self) -> Result<Option<Bytes>, TransportError> {
        Ok(Session::get_state(self).await?)
    }

    async fn set_state(&self, state: Option<Bytes>) -> Result<(), TransportError> {
        Ok(Session::set_state(self, state).await?)
    }

    async fn close(self) -> Result<(), TransportError> {
        Ok(Session::close(self).await?)
    }
}
