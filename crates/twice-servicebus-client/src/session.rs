//! Session receivers: accepting a session (next or named), its messages in order, its state
//! and its lock, which belongs to the link (and connection) it came on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use twice::{
    DeadLetterReason, EntityInfo, Properties, SequenceNumber, SessionId, Timestamp, TransportError,
};
use twice_amqp::codec::Value;
use twice_amqp::servicebus::{
    LOCKED_UNTIL_UTC, ManagementReply, ManagementRequest, SESSION_FILTER,
};

use crate::client::ServiceBusClient;
use crate::error::Error;
use crate::options::ReceiverOptions;
use crate::receiver::{
    Receiver, RecvLink, ServiceBusDelivery, SessionHold, Settle, Shared, attach_receiver, lost,
};

impl ServiceBusClient {
    /// A receiver that locks sessions of a session-enabled `entity`.
    pub fn session_receiver(&self, entity: &str, options: ReceiverOptions) -> SessionClient {
        SessionClient { receiver: self.receiver(entity, options) }
    }
}

/// Accepts sessions of a session-enabled entity; implements [`twice::SessionTransport`].
#[derive(Debug)]
pub struct SessionClient {
    receiver: Receiver,
}

/// A locked session: its messages in order, its state and its lock. The lock belongs to the
/// link and the connection it came on; after a connection loss every call fails with
/// session-lock-lost and the session must be accepted again.
#[derive(Debug)]
pub struct SessionReceiver {
    shared: Arc<Shared>,
    hold: SessionHold,
    link: tokio::sync::Mutex<RecvLink>,
    locked_until: Mutex<Timestamp>,
}

/// `com.microsoft:locked-until-utc` is .NET ticks (100 ns since 0001-01-01).
fn ticks_to_timestamp(ticks: i64) -> Timestamp {
    Timestamp::from_millis(ticks.saturating_sub(621_355_968_000_000_000) / 10_000)
}

impl SessionClient {
    /// The entity path.
    pub fn entity_path(&self) -> &str {
        &self.receiver.shared.entity
    }

    async fn accept(
        &self,
        sid: Option<&SessionId>,
        wait: Option<Duration>,
    ) -> Result<Option<SessionReceiver>, Error> {
        let shared = &self.receiver.shared;
        let conn = shared.client.connection().await?;
        let (link, remote) = match attach_receiver(shared, &conn, Some(sid), wait).await {
            Ok(l) => l,
            Err(e) if sid.is_none() && e.is_timeout() => return Ok(None),
            Err(e) => return Err(e),
        };
        let filter =
            twice_amqp::performative::Terminus::parse(remote.remote.source.as_ref(), true).filter;
        let granted = filter
            .as_ref()
            .and_then(|f| f.get(SESSION_FILTER))
            .and_then(|v| v.undescribed().as_str().map(SessionId::new))
            .or_else(|| sid.cloned())
            .ok_or_else(|| Error::Invalid("the service named no session".into()))?;
        let locked_until = remote
            .remote
            .properties
            .as_ref()
            .and_then(|p| p.get(LOCKED_UNTIL_UTC))
            .and_then(|v| match v {
                Value::Timestamp(t) => Some(Timestamp::from_millis(*t)),
                other => other.as_i64().map(ticks_to_timestamp),
            })
            .unwrap_or_else(|| shared.client.options.clock.now());
        Ok(Some(SessionReceiver {
            shared: shared.clone(),
            hold: SessionHold { attached: Arc::clone(&link.attached), conn, session_id: granted },
            link: tokio::sync::Mutex::new(link),
            locked_until: Mutex::new(locked_until),
        }))
    }

    /// Locks the next session with messages, waiting up to `max_wait`; `None` if none came.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a session locked after the future is dropped stays locked until its
    /// lock expires.
    pub async fn accept_next_session(
        &self,
        max_wait: Duration,
    ) -> Result<Option<SessionReceiver>, Error> {
        self.accept(None, Some(max_wait)).await
    }

    /// Locks the named session; fails with `com.microsoft:session-cannot-be-locked` if another
    /// receiver holds it.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`SessionClient::accept_next_session`].
    pub async fn accept_session(&self, session_id: &SessionId) -> Result<SessionReceiver, Error> {
        self.accept(Some(session_id), None)
            .await?
            .ok_or_else(|| Error::Invalid("the session was not granted".into()))
    }
}

impl SessionReceiver {
    /// The session id.
    pub fn session_id(&self) -> &SessionId {
        &self.hold.session_id
    }

    /// Until when the session lock holds, as of the accept or the last renewal.
    pub fn session_locked_until(&self) -> Timestamp {
        *self.locked_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Receives up to `max_messages` of the session's messages, in order.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: messages not yet returned stay buffered.
    pub async fn receive_messages(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, Error> {
        let mut link = self.link.lock().await;
        match self.shared.read(&mut link, max_messages, max_wait).await {
            Ok(v) => Ok(v),
            Err(Some(e)) => Err(e),
            Err(None) => Err(lost(true)),
        }
    }

    async fn settle(&self, d: &ServiceBusDelivery, how: Settle) -> Result<(), Error> {
        self.shared.settle(d, how, Some(&self.hold)).await.map_err(|e| {
            // A message of a session whose link died has lost its session lock.
            if e.is_lock_lost() && self.hold.conn.engine.is_closed() { lost(true) } else { e }
        })
    }

    /// Renews the session lock; returns the new locked-until time.
    pub async fn renew_lock(&self) -> Result<Timestamp, Error> {
        let req = ManagementRequest::RenewSessionLock { session_id: self.hold.session_id.clone() };
        let ManagementReply::Expiration(until) =
            self.shared.management(Some(&self.hold), req).await?
        else {
            return Err(Error::Invalid("renew-session-lock reply without an expiration".into()));
        };
        *self.locked_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = until;
        Ok(until)
    }

    /// The session state.
    pub async fn session_state(&self) -> Result<Option<Bytes>, Error> {
        let req = ManagementRequest::GetSessionState { session_id: self.hold.session_id.clone() };
        match self.shared.management(Some(&self.hold), req).await? {
            ManagementReply::SessionState(state) => Ok(state),
            _ => Ok(None),
        }
    }

    /// Sets (or with `None` clears) the session state.
    pub async fn set_session_state(&self, state: Option<Bytes>) -> Result<(), Error> {
        let req =
            ManagementRequest::SetSessionState { session_id: self.hold.session_id.clone(), state };
        self.shared.management(Some(&self.hold), req).await.map(|_| ())
    }

    /// Receives deferred messages of this session by sequence number.
    pub async fn receive_deferred_messages(
        &self,
        seqs: &[SequenceNumber],
    ) -> Result<Vec<ServiceBusDelivery>, Error> {
        self.shared.receive_deferred(Some(&self.hold), seqs).await
    }

    /// Completes a message of this session.
    pub async fn complete_message(&self, d: &ServiceBusDelivery) -> Result<(), Error> {
        self.settle(d, Settle::Complete).await
    }

    /// Releases the session: detaches its link, so its lock ends and unsettled messages come
    /// back.
    pub async fn close_session(&self) {
        let l = self.link.lock().await;
        l.conn.engine.detach(l.handle, l.id);
    }
}

impl twice::SessionTransport for SessionClient {
    type Session = SessionReceiver;

    async fn accept_next_session(
        &self,
        max_wait: Duration,
    ) -> Result<Option<SessionReceiver>, TransportError> {
        Ok(SessionClient::accept_next_session(self, max_wait).await?)
    }

    async fn accept_session(
        &self,
        session_id: &SessionId,
    ) -> Result<SessionReceiver, TransportError> {
        Ok(SessionClient::accept_session(self, session_id).await?)
    }
}

impl twice::Receive for SessionClient {
    type Delivery = ServiceBusDelivery;

    async fn receive(
        &self,
        _max: usize,
        _wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, TransportError> {
        Err(TransportError::Unsupported("receive without a session on a session entity"))
    }

    // Settling through the entity (not the session) is what the receiver does; a message of a
    // session is settled through its `SessionReceiver`.
    async fn complete(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        twice::Receive::complete(&self.receiver, d).await
    }

    async fn abandon(&self, d: &ServiceBusDelivery, p: Properties) -> Result<(), TransportError> {
        twice::Receive::abandon(&self.receiver, d, p).await
    }

    async fn dead_letter(
        &self,
        d: &ServiceBusDelivery,
        r: DeadLetterReason,
    ) -> Result<(), TransportError> {
        twice::Receive::dead_letter(&self.receiver, d, r).await
    }

    async fn defer(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        twice::Receive::defer(&self.receiver, d).await
    }
}

impl twice::Transport for SessionClient {
    fn entity(&self) -> &EntityInfo {
        self.receiver.shared.info()
    }

    fn claim_scope(&self) -> &str {
        &self.receiver.shared.scope
    }

    async fn read_entity(&self) -> Result<EntityInfo, TransportError> {
        Ok(self.receiver.shared.read_entity_or_defaults().await)
    }

    fn system(&self) -> &'static str {
        "servicebus"
    }

    async fn release(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        twice::Transport::release(&self.receiver, d).await
    }

    async fn renew_lock(&self, _d: &ServiceBusDelivery) -> Result<Timestamp, TransportError> {
        Err(TransportError::Unsupported(
            "renew a message lock of a session (renew the session lock)",
        ))
    }
}

impl twice::Receive for SessionReceiver {
    type Delivery = ServiceBusDelivery;

    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, TransportError> {
        Ok(self.receive_messages(max_messages, max_wait).await?)
    }

    async fn complete(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.settle(d, Settle::Complete).await?)
    }

    async fn abandon(
        &self,
        d: &ServiceBusDelivery,
        properties: Properties,
    ) -> Result<(), TransportError> {
        Ok(self.settle(d, Settle::Abandon(properties)).await?)
    }

    async fn dead_letter(
        &self,
        d: &ServiceBusDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        Ok(self.settle(d, Settle::DeadLetter(reason, Properties::new())).await?)
    }

    async fn defer(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.settle(d, Settle::Defer(Properties::new())).await?)
    }
}

impl twice::SessionReceiver for SessionReceiver {
    fn session_id(&self) -> &SessionId {
        &self.hold.session_id
    }

    fn locked_until(&self) -> Timestamp {
        self.session_locked_until()
    }

    async fn renew_session_lock(&self) -> Result<Timestamp, TransportError> {
        Ok(self.renew_lock().await?)
    }

    async fn release(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.settle(d, Settle::Release).await?)
    }

    async fn get_state(&self) -> Result<Option<Bytes>, TransportError> {
        Ok(self.session_state().await?)
    }

    async fn set_state(&self, state: Option<Bytes>) -> Result<(), TransportError> {
        Ok(self.set_session_state(state).await?)
    }

    async fn close(self) -> Result<(), TransportError> {
        self.close_session().await;
        Ok(())
    }
}
