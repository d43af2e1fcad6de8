//! The wiring to `twice-broker`: [`Backend`] for [`twice_broker::Broker`], and [`serve`].

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::RwLock;
use twice::{LockToken, Message, ReceivedMessage, SequenceNumber, SessionId, Timestamp};
use twice_broker::config::EntityDefinition;
use twice_broker::{Broker, Error};

use crate::address::is_transfer_dead_letter;
use crate::backend::{
    Backend, BackendError, BackendSession, EntityKind, EntityStats, ReceiveMode, Rule, Settlement,
};
use crate::options::ServerOptions;
use crate::server::{Server, ServerError};

/// Serves `broker` over AMQP (and HTTP) until `shutdown` resolves.
///
/// # Cancel safety
///
/// As [`Server::run`].
pub async fn serve(
    options: ServerOptions,
    broker: Broker,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    Server::bind(options, broker).await?.run(shutdown).await
}

/// A broker refusal as the backend's error. A broker whose storage failed stops taking
/// commands: what then finds it closed is told the storage failure, not that it is closed.
fn refusal(broker: &Broker, e: Error) -> BackendError {
    match (e, broker.health()) {
        (Error::Closed, twice_broker::Health::StorageFailed(reason)) => {
            BackendError::StorageFailed(reason)
        }
        (e, _) => map_err(e),
    }
}

fn map_err(e: Error) -> BackendError {
    match e {
        Error::MessageLockLost => BackendError::LockLost,
        Error::SessionLockLost => BackendError::SessionLockLost,
        Error::SessionCannotBeLocked(s) => BackendError::SessionCannotBeLocked(s),
        Error::EntityNotFound(p) => BackendError::EntityNotFound(p),
        Error::EntityAlreadyExists(p) => BackendError::AlreadyExists(p),
        e @ (Error::QuotaExceeded { .. } | Error::LimitExceeded { .. }) => {
            BackendError::QuotaExceeded(e.to_string())
        }
        Error::MessageNotFound(n) => {
            BackendError::MessageNotFound(format!("no message with sequence number {n}"))
        }
        Error::MessageSizeExceeded { size, limit } => BackendError::MessageSizeExceeded(format!(
            "The message of {size} bytes exceeds the maximum message size of {limit} bytes."
        )),
        Error::NotSupported(what) => BackendError::Unsupported(what),
        Error::Closed => BackendError::Unavailable("the broker is closed".to_owned()),
        Error::Io(io) => BackendError::StorageFailed(io.to_string()),
        e @ (Error::Corrupt(_) | Error::CorruptLog { .. }) => {
            BackendError::Unavailable(e.to_string())
        }
        other => BackendError::Invalid(other.to_string()),
    }
}

/// Splits `topic/subscriptions/sub` into its topic and subscription names.
fn split_subscription(path: &str) -> Result<(&str, &str), BackendError> {
    let lower = path.to_ascii_lowercase();
    let at = lower
        .find("/subscriptions/")
        .ok_or_else(|| BackendError::Invalid(format!("'{path}' is not a subscription")))?;
    let topic = path.get(..at).unwrap_or("");
    let sub = path.get(at + "/subscriptions/".len()..).unwrap_or("");
    Ok((topic, sub))
}

/// Completes many locks in one broker command (one durable write); when that fails (it is all
/// or nothing), one by one, so each lock gets its own answer.
/// Completes locks taken from `entity`: a lock token of another entity settles nothing there
/// (a client holding a token of one queue cannot settle through another queue's link).
async fn complete_many(
    broker: &Broker,
    entity: &str,
    locks: Vec<LockToken>,
) -> Vec<Result<(), BackendError>> {
    if locks.len() > 1 && broker.complete_in(entity, &locks).await.is_ok() {
        return locks.iter().map(|_| Ok(())).collect();
    }
    let mut out = Vec::with_capacity(locks.len());
    for lock in locks {
        out.push(broker.complete_in(entity, &[lock]).await.map_err(|e| refusal(broker, e)));
    }
    out
}

/// Deferred messages in receive-and-delete mode: locked, then completed at once.
async fn take_deferred(
    broker: &Broker,
    mode: ReceiveMode,
    got: Vec<ReceivedMessage>,
) -> Result<Vec<ReceivedMessage>, BackendError> {
    if mode == ReceiveMode::PeekLock {
        return Ok(got);
    }
    let mut out = Vec::with_capacity(got.len());
    for mut m in got {
        if let Some(lock) = m.lock_token.take() {
            broker.complete(lock).await.map_err(|e| refusal(broker, e))?;
        }
        m.locked_until = None;
        out.push(m);
    }
    Ok(out)
}

/// Schedules messages that share one time; a message without a time is sent as it is.
async fn schedule_batch(
    broker: &Broker,
    entity: &str,
    messages: Vec<Message>,
    at: Option<Timestamp>,
) -> Result<Vec<SequenceNumber>, BackendError> {
    match at {
        Some(at) => {
            Broker::schedule(broker, entity, messages, at).await.map_err(|e| refusal(broker, e))
        }
        None => Backend::send(broker, entity, messages).await,
    }
}

impl Backend for Broker {
    type Session = BrokerSession;

    fn health(&self) -> Result<(), String> {
        match Broker::health(self) {
            twice_broker::Health::Healthy => Ok(()),
            twice_broker::Health::StorageFailed(e) => Err(format!("storage failed: {e}")),
            other => Err(format!("{other:?}")),
        }
    }

    async fn entity(&self, path: &str) -> Option<EntityKind> {
        if let Some(parent) = crate::address::dead_letter_parent(path) {
            return self.entity_info(parent).await.ok().map(|_| EntityKind::DeadLetter);
        }
        match self.get_entity(path).await.ok()? {
            EntityDefinition::Queue { properties, .. } => {
                Some(EntityKind::Queue { requires_session: properties.requires_session })
            }
            EntityDefinition::Topic { .. } => Some(EntityKind::Topic),
            EntityDefinition::Subscription { properties, .. } => {
                Some(EntityKind::Subscription { requires_session: properties.requires_session })
            }
            _ => None,
        }
    }

    async fn stats(&self) -> Vec<EntityStats> {
        let Ok(entities) = self.list_entities().await else { return Vec::new() };
        let mut out = Vec::with_capacity(entities.len());
        for def in entities {
            let path = def.path();
            let kind = match def {
                EntityDefinition::Queue { .. } => "queue",
                EntityDefinition::Topic { .. } => "topic",
                _ => "subscription",
            };
            let Ok(c) = self.counts(&path).await else { continue };
            out.push(EntityStats {
                path,
                kind: kind.to_owned(),
                active: c.active,
                scheduled: c.scheduled,
                deferred: c.deferred,
                dead_letter: c.dead_letter,
            });
        }
        out
    }

    async fn send(
        &self,
        entity: &str,
        messages: Vec<Message>,
    ) -> Result<Vec<SequenceNumber>, BackendError> {
        let outcomes = self.send_batch(entity, messages).await.map_err(|e| refusal(self, e))?;
        // A duplicate has no number of its own; it is reported as 0, which no message has.
        Ok(outcomes.iter().map(|o| o.sequence_number().unwrap_or(SequenceNumber::new(0))).collect())
    }

    async fn schedule(
        &self,
        entity: &str,
        messages: Vec<Message>,
    ) -> Result<Vec<SequenceNumber>, BackendError> {
        // The broker schedules a batch for one time: consecutive messages with the same time
        // go together, so the usual call (one time for all) is one command.
        let mut out = Vec::with_capacity(messages.len());
        let mut batch: Vec<Message> = Vec::new();
        let mut batch_at = None;
        for m in messages {
            if m.scheduled_enqueue_time != batch_at && !batch.is_empty() {
                out.extend(
                    schedule_batch(self, entity, std::mem::take(&mut batch), batch_at).await?,
                );
            }
            batch_at = m.scheduled_enqueue_time;
            batch.push(m);
        }
        if !batch.is_empty() {
            out.extend(schedule_batch(self, entity, batch, batch_at).await?);
        }
        Ok(out)
    }

    async fn cancel_scheduled(
        &self,
        entity: &str,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> Result<(), BackendError> {
        Broker::cancel_scheduled(self, entity, &sequence_numbers)
            .await
            .map_err(|e| refusal(self, e))
    }

    async fn receive(
        &self,
        entity: &str,
        mode: ReceiveMode,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        if is_transfer_dead_letter(entity) {
            // Nothing ever arrives: wait as a receive of an empty queue does.
            tokio::time::sleep(max_wait).await;
            return Ok(Vec::new());
        }
        self.receive_with(entity, mode, max, max_wait).await.map_err(|e| refusal(self, e))
    }

    async fn receive_deferred(
        &self,
        entity: &str,
        mode: ReceiveMode,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        if let (true, Some(s)) = (is_transfer_dead_letter(entity), sequence_numbers.first()) {
            return Err(BackendError::MessageNotFound(s.get().to_string()));
        }
        let got = Broker::receive_deferred(self, entity, &sequence_numbers)
            .await
            .map_err(|e| refusal(self, e))?;
        take_deferred(self, mode, got).await
    }

    async fn settle(
        &self,
        entity: &str,
        lock: LockToken,
        how: Settlement,
    ) -> Result<(), BackendError> {
        if is_transfer_dead_letter(entity) {
            return Err(BackendError::LockLost);
        }
        self.settle_in(entity, lock, how).await.map_err(|e| refusal(self, e))
    }

    async fn complete_many(
        &self,
        entity: &str,
        locks: Vec<LockToken>,
    ) -> Vec<Result<(), BackendError>> {
        if is_transfer_dead_letter(entity) {
            return locks.iter().map(|_| Err(BackendError::LockLost)).collect();
        }
        complete_many(self, entity, locks).await
    }

    async fn renew_lock(&self, entity: &str, lock: LockToken) -> Result<Timestamp, BackendError> {
        if is_transfer_dead_letter(entity) {
            return Err(BackendError::LockLost);
        }
        Broker::renew_lock_in(self, entity, lock).await.map_err(|e| refusal(self, e))
    }

    async fn peek(
        &self,
        entity: &str,
        session: Option<SessionId>,
        from: SequenceNumber,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        if is_transfer_dead_letter(entity) {
            return Ok(Vec::new());
        }
        match session {
            Some(s) => self.peek_session(entity, &s, from, max).await,
            None => Broker::peek(self, entity, from, max).await,
        }
        .map_err(|e| refusal(self, e))
    }

    async fn accept_session(
        &self,
        entity: &str,
        session: Option<SessionId>,
        max_wait: Duration,
    ) -> Result<Option<BrokerSession>, BackendError> {
        let accepted = match session {
            Some(id) => Some(
                Broker::accept_session(self, entity, &id).await.map_err(|e| refusal(self, e))?,
            ),
            None => {
                self.accept_next_session(entity, max_wait).await.map_err(|e| refusal(self, e))?
            }
        };
        Ok(accepted.map(|s| BrokerSession {
            broker: self.clone(),
            entity: entity.to_owned(),
            id: s.session_id().clone(),
            locked_until: std::sync::atomic::AtomicI64::new(s.locked_until().as_millis()),
            inner: RwLock::new(Some(s)),
        }))
    }

    async fn list_sessions(
        &self,
        entity: &str,
        skip: usize,
        top: usize,
    ) -> Result<Vec<SessionId>, BackendError> {
        let all = Broker::list_sessions(self, entity).await.map_err(|e| refusal(self, e))?;
        Ok(all.into_iter().skip(skip).take(top).collect())
    }

    async fn admin_get(&self, path: &str) -> Result<EntityDefinition, BackendError> {
        Broker::get_entity(self, path).await.map_err(|e| refusal(self, e))
    }

    async fn admin_list(&self) -> Result<Vec<EntityDefinition>, BackendError> {
        Broker::list_entities(self).await.map_err(|e| refusal(self, e))
    }

    async fn admin_create(&self, definition: EntityDefinition) -> Result<(), BackendError> {
        Broker::create_entity(self, definition).await.map_err(|e| refusal(self, e))
    }

    async fn admin_update(&self, definition: EntityDefinition) -> Result<(), BackendError> {
        match definition {
            // Updating a subscription's properties leaves its rules alone.
            EntityDefinition::Subscription { topic, name, properties, .. } => {
                Broker::update_subscription(self, &topic, &name, properties).await
            }
            other => Broker::update_entity(self, other).await,
        }
        .map_err(|e| refusal(self, e))
    }

    async fn admin_delete(&self, path: &str) -> Result<(), BackendError> {
        Broker::delete_entity(self, path).await.map_err(|e| refusal(self, e))
    }

    async fn admin_reset(&self) -> Result<usize, BackendError> {
        Broker::reset(self).await.map_err(map_err)
    }

    async fn admin_counts(&self, path: &str) -> Result<twice_broker::MessageCounts, BackendError> {
        Broker::counts(self, path).await.map_err(|e| refusal(self, e))
    }

    async fn admin_create_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> Result<(), BackendError> {
        Broker::create_rule(self, topic, subscription, rule).await.map_err(|e| refusal(self, e))
    }

    async fn admin_replace_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> Result<(), BackendError> {
        Broker::replace_rule(self, topic, subscription, rule).await.map_err(|e| refusal(self, e))
    }

    async fn admin_delete_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: &str,
    ) -> Result<(), BackendError> {
        Broker::delete_rule(self, topic, subscription, rule).await.map_err(|e| refusal(self, e))
    }

    async fn add_rule(&self, subscription: &str, rule: Rule) -> Result<(), BackendError> {
        let (topic, sub) = split_subscription(subscription)?;
        self.create_rule(topic, sub, rule).await.map_err(|e| refusal(self, e))
    }

    async fn remove_rule(&self, subscription: &str, name: &str) -> Result<(), BackendError> {
        let (topic, sub) = split_subscription(subscription)?;
        self.delete_rule(topic, sub, name).await.map_err(|e| refusal(self, e))
    }

    async fn rules(&self, subscription: &str) -> Result<Vec<Rule>, BackendError> {
        let (topic, sub) = split_subscription(subscription)?;
        self.get_rules(topic, sub).await.map_err(|e| refusal(self, e))
    }
}

/// A session of `twice-broker` held by a receiver link.
#[derive(Debug)]
pub struct BrokerSession {
    broker: Broker,
    /// The queue or subscription the session belongs to: its settlements are scoped to it.
    entity: String,
    id: SessionId,
    locked_until: std::sync::atomic::AtomicI64,
    // The broker's session is consumed by `close`; a lock lets `close(&self)` take it while
    // other calls borrow it across their awaits.
    inner: RwLock<Option<twice_broker::Session>>,
}

impl BackendSession for BrokerSession {
    fn session_id(&self) -> &SessionId {
        &self.id
    }

    fn locked_until(&self) -> Timestamp {
        Timestamp::from_millis(self.locked_until.load(std::sync::atomic::Ordering::Relaxed))
    }

    async fn receive(
        &self,
        mode: ReceiveMode,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        let guard = self.inner.read().await;
        let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
        s.receive_with(mode, max, max_wait).await.map_err(|e| refusal(&self.broker, e))
    }

    async fn receive_deferred(
        &self,
        mode: ReceiveMode,
        sequence_numbers: Vec<SequenceNumber>,
    ) -> Result<Vec<ReceivedMessage>, BackendError> {
        let got = {
            let guard = self.inner.read().await;
            let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
            s.receive_deferred(&sequence_numbers).await.map_err(|e| refusal(&self.broker, e))?
        };
        take_deferred(&self.broker, mode, got).await
    }

    async fn settle(&self, lock: LockToken, how: Settlement) -> Result<(), BackendError> {
        if self.inner.read().await.is_none() {
            return Err(BackendError::SessionLockLost);
        }
        self.broker.settle_in(&self.entity, lock, how).await.map_err(|e| refusal(&self.broker, e))
    }

    async fn complete_many(&self, locks: Vec<LockToken>) -> Vec<Result<(), BackendError>> {
        if self.inner.read().await.is_none() {
            return locks.iter().map(|_| Err(BackendError::SessionLockLost)).collect();
        }
        complete_many(&self.broker, &self.entity, locks).await
    }

    async fn check_lock(&self) -> Result<(), BackendError> {
        let guard = self.inner.read().await;
        let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
        // An empty receive by sequence number checks the lock on the broker's clock (expiring
        // it if its time has come) and takes nothing.
        s.receive_deferred(&[]).await.map(drop).map_err(|e| refusal(&self.broker, e))
    }

    async fn renew(&self) -> Result<Timestamp, BackendError> {
        let guard = self.inner.read().await;
        let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
        let until = s.renew_session_lock().await.map_err(|e| refusal(&self.broker, e))?;
        self.locked_until.store(until.as_millis(), std::sync::atomic::Ordering::Relaxed);
        Ok(until)
    }

    async fn get_state(&self) -> Result<Option<Bytes>, BackendError> {
        let guard = self.inner.read().await;
        let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
        s.get_state().await.map_err(|e| refusal(&self.broker, e))
    }

    async fn set_state(&self, state: Option<Bytes>) -> Result<(), BackendError> {
        let guard = self.inner.read().await;
        let s = guard.as_ref().ok_or(BackendError::SessionLockLost)?;
        s.set_state(state).await.map_err(|e| refusal(&self.broker, e))
    }

    async fn close(&self) {
        let taken = self.inner.write().await.take();
        if let Some(s) = taken {
            let _ = s.close().await;
        }
    }
}
