//! A session locked by one receiver: [`Session`].

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use twice::{
    DeadLetterReason, LockToken, Properties, ReceivedMessage, SequenceNumber, SessionId, Timestamp,
};

use crate::broker::{Broker, received};
use crate::engine::{AcceptedSession, SessionLock};
use crate::error::Error;
use crate::runtime::{Command, PathArg, Wait};
use crate::vocabulary::ReceiveMode;

impl Broker {
    /// Locks a named session of a session-enabled queue or subscription. Fails with
    /// [`Error::SessionCannotBeLocked`] when another receiver holds it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a session locked for an accept whose future was dropped is released.
    pub async fn accept_session(
        &self,
        path: &str,
        session_id: &SessionId,
    ) -> Result<Session, Error> {
        let (p, session) = (path.to_owned(), Some(session_id.clone()));
        let accepted = self
            .call(|reply| Command::AcceptSession {
                path: p,
                session,
                max_wait: Duration::ZERO,
                reply,
            })
            .await?;
        let accepted =
            accepted.ok_or_else(|| Error::SessionCannotBeLocked(session_id.to_string()))?;
        Ok(Session::new(self.clone(), path, accepted))
    }

    /// Locks the next session that has an available message, waiting up to `max_wait` for one;
    /// `None` when none became available.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a session locked for an accept whose future was dropped is released.
    pub async fn accept_next_session(
        &self,
        path: &str,
        max_wait: Duration,
    ) -> Result<Option<Session>, Error> {
        let p = path.to_owned();
        let accepted = self
            .call(|reply| Command::AcceptSession { path: p, session: None, max_wait, reply })
            .await?;
        Ok(accepted.map(|a| Session::new(self.clone(), path, a)))
    }
}

/// A session locked by this receiver: its messages, in order, go only to it.
///
/// Dropping it without [`Session::close`] lets the session lock expire after `LockDuration`;
/// its unsettled messages then become available again with their delivery count raised.
#[derive(Debug)]
pub struct Session {
    broker: Broker,
    path: String,
    lock: SessionLock,
    session_id: SessionId,
    locked_until: Arc<AtomicI64>,
}

impl Session {
    pub(crate) fn new(broker: Broker, path: &str, accepted: AcceptedSession) -> Self {
        Self {
            broker,
            path: path.to_owned(),
            lock: accepted.lock,
            session_id: accepted.session_id,
            locked_until: Arc::new(AtomicI64::new(accepted.locked_until.as_millis())),
        }
    }

    /// The session id.
    pub fn session_id(&self) -> &SessionId {
        &self.session_id
    }

    /// The entity path.
    pub fn entity_path(&self) -> &str {
        &self.path
    }

    /// Until when the session lock holds, as of the accept or the last renewal.
    pub fn locked_until(&self) -> Timestamp {
        Timestamp::from_millis(self.locked_until.load(Ordering::Relaxed))
    }

    /// Receives up to `max_messages` of this session's messages in order (peek-lock), waiting
    /// up to `max_wait` for the first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: messages locked for a receive whose future was dropped are released
    /// without counting a delivery, so no message is lost or held.
    pub async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.receive_with(ReceiveMode::PeekLock, max_messages, max_wait).await
    }

    /// Receives in the given mode.
    pub async fn receive_with(
        &self,
        mode: ReceiveMode,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let path = PathArg::new(&self.path);
        let wait = Wait { max: max_messages, max_wait };
        let session = Some(self.lock);
        received(
            self.broker.call(|reply| Command::Receive { path, mode, wait, session, reply }).await,
        )
    }

    /// Receives deferred messages of this session by sequence number.
    pub async fn receive_deferred(
        &self,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.broker.receive_deferred_with(&self.path, sequence_numbers, Some(self.lock)).await
    }

    /// Completes a message of this session.
    pub async fn complete(&self, token: LockToken) -> Result<(), Error> {
        self.broker.complete_in(&self.path, &[token]).await
    }

    /// Abandons a message of this session.
    pub async fn abandon(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.broker.abandon_in(&self.path, token, properties).await
    }

    /// Dead-letters a message of this session.
    pub async fn dead_letter(
        &self,
        token: LockToken,
        reason: DeadLetterReason,
        properties: Properties,
    ) -> Result<(), Error> {
        self.broker.dead_letter_in(&self.path, token, reason, properties).await
    }

    /// Defers a message of this session.
    pub async fn defer(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.broker.defer_in(&self.path, token, properties).await
    }

    /// Renews the session lock (and the locks of its messages); returns the new locked-until.
    pub async fn renew_session_lock(&self) -> Result<Timestamp, Error> {
        let lock = self.lock;
        let until = self.broker.call(|reply| Command::RenewSessionLock { lock, reply }).await?;
        self.locked_until.store(until.as_millis(), Ordering::Relaxed);
        Ok(until)
    }

    /// The session state, if set.
    pub async fn get_state(&self) -> Result<Option<Bytes>, Error> {
        let lock = self.lock;
        self.broker.call(|reply| Command::GetSessionState { lock, reply }).await
    }

    /// Sets (or with `None` clears) the session state. It is durable.
    pub async fn set_state(&self, state: Option<Bytes>) -> Result<(), Error> {
        let lock = self.lock;
        self.broker.call(|reply| Command::SetSessionState { lock, state, reply }).await
    }

    /// Releases the session lock: the session is free for other receivers, and its messages
    /// still locked become available with their delivery count raised.
    pub async fn close(self) -> Result<(), Error> {
        let lock = self.lock;
        self.broker.call(|reply| Command::ReleaseSession { lock, reply }).await
    }
}
