//! A broker whose sends wait at a gate the test opens: the real `twice-broker` underneath, so a
//! test can hold sends "not yet durable" for as long as it needs, without timing.

use std::time::Duration;

use tokio::sync::watch;
use twice::{LockToken, Message, ReceivedMessage, SequenceNumber, SessionId, Timestamp};
use twice_broker::Broker;
use twice_servicebus::{
    Backend, BackendError, EntityKind, EntityStats, ReceiveMode, Rule, Settlement,
};

/// `twice-broker` with sends held until [`Gated::open`].
#[derive(Clone, Debug)]
pub struct Gated {
    pub inner: Broker,
    pub gate: watch::Receiver<bool>,
}

impl Gated {
    async fn wait(&self) {
        let mut gate = self.gate.clone();
        let _ = gate.wait_for(|open| *open).await;
    }
}

impl Backend for Gated {
    type Session = <Broker as Backend>::Session;

    async fn entity(&self, path: &str) -> Option<EntityKind> {
        self.inner.entity(path).await
    }
    async fn stats(&self) -> Vec<EntityStats> {
        Backend::stats(&self.inner).await
    }
    async fn send(
        &self,
        entity: &str,
        messages: Vec<Message>,
    ) -> Result<Vec<SequenceNumber>, BackendError> {
        self.wait().await;
        Backend::send(&self.inner, entity, messages).await
    }
    async fn cancel_scheduled(
        &self,
        entity: &str,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> Result<(), BackendError> {
        Backend::cancel_scheduled(&self.inner, entity, sequence_numbers).await
    }
    async fn receive(
        &self,
        entity: &str,
        mode: ReceiveMode,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        Backend::receive(&self.inner, entity, mode, max, max_wait).await
    }
    async fn receive_deferred(
        &self,
        entity: &str,
        mode: ReceiveMode,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        Backend::receive_deferred(&self.inner, entity, mode, sequence_numbers).await
    }
    async fn settle(
        &self,
        entity: &str,
        lock: LockToken,
        how: Settlement,
    ) -> Result<(), BackendError> {
        Backend::settle(&self.inner, entity, lock, how).await
    }
    async fn renew_lock(&self, entity: &str, lock: LockToken) -> Result<Timestamp, BackendError> {
        Backend::renew_lock(&self.inner, entity, lock).await
    }
    async fn peek(
        &self,
        entity: &str,
        session: Option<SessionId>,
        from: SequenceNumber,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        Backend::peek(&self.inner, entity, session, from, max).await
    }
    async fn accept_session(
        &self,
        entity: &str,
        session: Option<SessionId>,
        max_wait: Duration,
    ) -> Result<Option<Self::Session>, BackendError> {
        Backend::accept_session(&self.inner, entity, session, max_wait).await
    }
    async fn list_sessions(
        &self,
        entity: &str,
        skip: usize,
        top: usize,
    ) -> Result<Vec<SessionId>, BackendError> {
        Backend::list_sessions(&self.inner, entity, skip, top).await
    }
    async fn add_rule(&self, subscription: &str, rule: Rule) -> Result<(), BackendError> {
        Backend::add_rule(&self.inner, subscription, rule).await
    }
    async fn remove_rule(&self, subscription: &str, name: &str) -> Result<(), BackendError> {
        Backend::remove_rule(&self.inner, subscription, name).await
    }
    async fn rules(&self, subscription: &str) -> Result<Vec<Rule>, BackendError> {
        Backend::rules(&self.inner, subscription).await
    }
}
