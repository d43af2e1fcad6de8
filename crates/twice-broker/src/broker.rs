//! The public handle of the broker: [`Broker`], opened with [`BrokerOptions`]; it hands out
//! [`Session`]s.
//!
//! A [`Broker`] is a cheap `Clone`: every method sends a command to the one task that owns the
//! broker's state and waits for its reply. A reply that changes state comes only after the
//! change is on disk (in durable mode).
//!
//! # Cancel safety
//!
//! Every async method is cancel safe in this sense: dropping its future never leaves the broker
//! inconsistent and never loses a message. A command already handed to the broker still runs
//! (a send may be enqueued although its caller did not see the result, as with any broker
//! whose acknowledgement is lost); a receive whose caller went away releases the messages it
//! locked without counting a delivery, and an accepted session whose caller went away is
//! released.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use twice::{
    DeadLetterReason, EntityInfo, LockToken, Message, Properties, ReceivedMessage, SequenceNumber,
    SessionId, SharedClock, Timestamp,
};

use crate::config::{
    Config, EntityDefinition, QueueProperties, Rule, SubscriptionProperties, TopicProperties,
};
use crate::engine::{self, EngineOptions, SessionLock};
use crate::error::Error;
use crate::options::BrokerOptions;
use crate::runtime::{
    Command, Delivered, PathArg, Reply, Runtime, RuntimeOptions, SubscriptionChange, Wait,
};
use crate::storage::{FailureCell, LogOptions};
use crate::vocabulary::{ReceiveMode, SendOutcome, Settlement};

/// The default largest message (and send batch), in bytes: 256 KiB, as Service Bus standard.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = engine::DEFAULT_MAX_MESSAGE_SIZE;

/// Runtime counts of an entity (Service Bus `CountDetails`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageCounts {
    /// Available plus locked messages (`ActiveMessageCount`).
    pub active: u64,
    /// Messages locked by a receiver.
    pub locked: u64,
    /// Deferred messages.
    pub deferred: u64,
    /// Scheduled messages.
    pub scheduled: u64,
    /// Messages in the dead-letter queue (`DeadLetterMessageCount`).
    pub dead_letter: u64,
}

/// Counters of an entity, or of the whole broker, since the broker opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Statistics {
    /// Messages accepted by a send.
    pub sent: u64,
    /// Sends dropped by duplicate detection.
    pub duplicates: u64,
    /// Deliveries to receivers.
    pub received: u64,
    /// Messages completed.
    pub completed: u64,
    /// Messages abandoned.
    pub abandoned: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Locks that expired before their message was settled.
    pub lock_lost: u64,
    /// Messages whose time to live ran out.
    pub expired: u64,
}

/// What the durable log did since the broker opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StorageStatistics {
    /// Batches handed to the writer (one per turn that changed something).
    pub commits: u64,
    /// `fdatasync` calls: fewer than commits when commits were grouped.
    pub fsyncs: u64,
    /// Segment files now.
    pub segments: u64,
    /// Records replayed at open plus records written since.
    pub records: u64,
    /// Bytes written to segment files since the broker opened (headers, records, records
    /// moved by compaction and checkpoints).
    pub bytes_written: u64,
}

/// A handle to the broker. Cheap to clone; every clone talks to the same broker.
///
/// Entity paths are queue or topic names, `<topic>/Subscriptions/<name>` for subscriptions,
/// and any of these with `/$DeadLetterQueue` for its dead-letter queue (case-insensitive).
///
/// # Cancel safety
///
/// Dropping the future of any method never leaves the broker inconsistent and never loses a
/// message. A command already handed to the broker still runs (a send may be enqueued although
/// its caller did not see the result, as with any broker whose acknowledgement is lost); a
/// receive whose caller went away releases the messages it locked without counting a delivery,
/// and an accepted session whose caller went away is released.
#[derive(Clone, Debug)]
pub struct Broker {
    tx: mpsc::Sender<Command>,
    clock: SharedClock,
    failure: FailureCell,
}

/// Whether the broker can serve, from [`Broker::health`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Health {
    /// The broker takes commands and its storage works.
    Healthy,
    /// A write or fsync of the log failed: the broker acknowledges nothing more and refuses
    /// every command until it is restarted (what it acknowledged before is safe on disk).
    StorageFailed(String),
    /// The broker was shut down.
    Closed,
}

impl Broker {
    /// Opens a broker: replays its data directory (in durable mode), applies the configured
    /// entities, and starts the task that owns the broker's state, on a thread of its own.
    ///
    /// Fails with [`Error::DirectoryInUse`] when another broker has the directory open, with
    /// [`Error::CorruptLog`] when acknowledged data is damaged, and with
    /// [`Error::MissingSegment`] when a segment file between others is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if dropped while the log is replayed, the replay finishes in the background
    /// and the broker closes again.
    pub async fn open(options: BrokerOptions) -> Result<Broker, Error> {
        let definitions = match &options.config {
            Some(c) => c.entities()?,
            None => Vec::new(),
        };
        let (tx, rx) = mpsc::channel(options.command_queue.max(1));
        let clock = options.clock.clone();
        let failure = FailureCell::default();
        let durable = options.dir.is_some();
        let runtime_options = RuntimeOptions {
            dir: options.dir,
            // Fresh messages are delivered from the engine's cache of bodies; the log's own
            // cache of encoded records mostly serves reads of records not yet written, so it
            // gets a quarter of the budget.
            log: LogOptions {
                segment_size: options.segment_size,
                cache_bytes: options.cache_size / 4,
                ..LogOptions::default()
            },
            engine: EngineOptions {
                durable,
                max_message_size: options.max_message_size,
                body_cache_bytes: options.cache_size,
                deferred_serving: true,
                collect_freed: true,
                limits: options.limits,
                ..EngineOptions::default()
            },
            clock: options.clock,
            max_commands_per_turn: options.max_commands_per_turn,
            definitions,
            relaxed_delivery_counts: options.relaxed_delivery_counts,
            failure: failure.clone(),
        };
        // The task that owns the broker runs on a thread of its own, with a single-threaded
        // Tokio runtime: it is the broker's one busy loop, and it would otherwise queue behind
        // every client task on the caller's runtime. Opening (the replay) runs there too.
        let (opened_tx, opened_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("twice-broker".to_owned())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_time().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = opened_tx.send(Err(Error::Io(e)));
                        return;
                    }
                };
                match Runtime::open(runtime_options, rx) {
                    Ok(runtime) => {
                        let _ = opened_tx.send(Ok(()));
                        rt.block_on(runtime.run());
                    }
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                    }
                }
            })
            .map_err(Error::Io)?;
        opened_rx.await.map_err(|_| Error::Closed)??;
        Ok(Broker { tx, clock, failure })
    }

    /// A handle on a runtime a test started itself.
    #[cfg(test)]
    pub(crate) fn from_channel(tx: mpsc::Sender<Command>, clock: SharedClock) -> Broker {
        Broker { tx, clock, failure: FailureCell::default() }
    }

    /// A handle on a runtime a test started itself, which reports storage failures to
    /// `failure`.
    #[cfg(test)]
    pub(crate) fn from_channel_with_failure(
        tx: mpsc::Sender<Command>,
        clock: SharedClock,
        failure: FailureCell,
    ) -> Broker {
        Broker { tx, clock, failure }
    }

    /// Whether the broker can serve: [`Health::StorageFailed`] once a write or fsync of its
    /// log failed (it then refuses everything until restarted), [`Health::Closed`] once shut
    /// down. Answers at once, without a turn of the broker's task.
    pub fn health(&self) -> Health {
        if let Some(e) = self.failure.get() {
            return Health::StorageFailed(e.to_owned());
        }
        if self.tx.is_closed() { Health::Closed } else { Health::Healthy }
    }

    /// The broker's clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    pub(crate) async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Error> {
        let (reply, rx) = Reply::channel();
        self.tx.send(make(reply)).await.map_err(|_| Error::Closed)?;
        let answer = rx.await.map_err(|_| Error::Closed)?;
        // Frees, on this thread, the messages the broker let go of.
        drop(answer.freed);
        answer.result
    }

    /// Makes everything acknowledged durable, stops the broker's task and closes its data
    /// directory. Every handle fails with [`Error::Closed`] afterwards.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
    }

    // ----- management -------------------------------------------------------------------------

    /// Creates an entity from its definition.
    pub async fn create_entity(&self, definition: EntityDefinition) -> Result<(), Error> {
        definition.validate()?;
        self.call(|reply| Command::CreateEntity { definition, reply }).await
    }

    /// Replaces the properties (and a subscription's rules: an empty list leaves it without
    /// rules, receiving nothing) of an entity. `RequiresDuplicateDetection` and
    /// `RequiresSession` cannot change.
    pub async fn update_entity(&self, definition: EntityDefinition) -> Result<(), Error> {
        definition.validate()?;
        self.call(|reply| Command::UpdateEntity { definition, reply }).await
    }

    /// Deletes an entity and its messages (a topic with its subscriptions).
    pub async fn delete_entity(&self, path: &str) -> Result<(), Error> {
        let path = path.to_owned();
        self.call(|reply| Command::DeleteEntity { path, reply }).await
    }

    /// The definition of an entity.
    pub async fn get_entity(&self, path: &str) -> Result<EntityDefinition, Error> {
        let path = path.to_owned();
        self.call(|reply| Command::GetEntity { path, reply }).await
    }

    /// Every entity, in creation order (topics before their subscriptions).
    pub async fn list_entities(&self) -> Result<Vec<EntityDefinition>, Error> {
        self.call(|reply| Command::ListEntities { reply }).await
    }

    /// Empties every entity at once, for test suites: each entity is deleted with everything
    /// it holds and made again with its definition (a topic with its subscriptions and their
    /// rules). Active, scheduled, deferred and dead-lettered messages, locks, session states,
    /// sequence numbers and the duplicate-detection history are gone; the entities, their
    /// properties and rules stay. One durable commit. Returns how many entities were reset.
    pub async fn reset(&self) -> Result<usize, Error> {
        self.call(|reply| Command::Reset { reply }).await
    }

    /// Creates the entities of a configuration that do not exist and updates those that do,
    /// all or nothing.
    pub async fn apply_config(&self, config: &Config) -> Result<(), Error> {
        let definitions = config.entities()?;
        self.call(|reply| Command::ApplyDefinitions { definitions, reply }).await
    }

    /// Creates a queue.
    pub async fn create_queue(&self, name: &str, properties: QueueProperties) -> Result<(), Error> {
        self.create_entity(EntityDefinition::queue(name, properties)).await
    }

    /// Changes a queue's properties.
    pub async fn update_queue(&self, name: &str, properties: QueueProperties) -> Result<(), Error> {
        self.update_entity(EntityDefinition::queue(name, properties)).await
    }

    /// Deletes a queue and its messages.
    pub async fn delete_queue(&self, name: &str) -> Result<(), Error> {
        self.delete_entity(name).await
    }

    /// A queue's properties.
    pub async fn get_queue(&self, name: &str) -> Result<QueueProperties, Error> {
        match self.get_entity(name).await? {
            EntityDefinition::Queue { properties, .. } => Ok(properties),
            _ => Err(Error::EntityNotFound(name.to_owned())),
        }
    }

    /// Creates a topic.
    pub async fn create_topic(&self, name: &str, properties: TopicProperties) -> Result<(), Error> {
        self.create_entity(EntityDefinition::topic(name, properties)).await
    }

    /// Changes a topic's properties.
    pub async fn update_topic(&self, name: &str, properties: TopicProperties) -> Result<(), Error> {
        self.update_entity(EntityDefinition::topic(name, properties)).await
    }

    /// Deletes a topic with its subscriptions and their messages.
    pub async fn delete_topic(&self, name: &str) -> Result<(), Error> {
        self.delete_entity(name).await
    }

    /// A topic's properties.
    pub async fn get_topic(&self, name: &str) -> Result<TopicProperties, Error> {
        match self.get_entity(name).await? {
            EntityDefinition::Topic { properties, .. } => Ok(properties),
            _ => Err(Error::EntityNotFound(name.to_owned())),
        }
    }

    /// Creates a subscription of a topic with the `$Default` rule (it receives every message).
    pub async fn create_subscription(
        &self,
        topic: &str,
        name: &str,
        properties: SubscriptionProperties,
    ) -> Result<(), Error> {
        self.create_entity(EntityDefinition::subscription(topic, name, properties, Vec::new()))
            .await
    }

    /// Creates a subscription with these rules (empty: the `$Default` rule).
    pub async fn create_subscription_with_rules(
        &self,
        topic: &str,
        name: &str,
        properties: SubscriptionProperties,
        rules: Vec<Rule>,
    ) -> Result<(), Error> {
        self.create_entity(EntityDefinition::subscription(topic, name, properties, rules)).await
    }

    /// Changes a subscription's properties; its rules stay.
    pub async fn update_subscription(
        &self,
        topic: &str,
        name: &str,
        properties: SubscriptionProperties,
    ) -> Result<(), Error> {
        EntityDefinition::subscription(topic, name, properties.clone(), Vec::new()).validate()?;
        let (topic, subscription) = (topic.to_owned(), name.to_owned());
        let change = SubscriptionChange::Properties(properties);
        self.call(|reply| Command::ChangeSubscription { topic, subscription, change, reply }).await
    }

    /// Deletes a subscription and its messages.
    pub async fn delete_subscription(&self, topic: &str, name: &str) -> Result<(), Error> {
        self.delete_entity(&subscription_path(topic, name)).await
    }

    /// A subscription's properties.
    pub async fn get_subscription(
        &self,
        topic: &str,
        name: &str,
    ) -> Result<SubscriptionProperties, Error> {
        let path = subscription_path(topic, name);
        match self.get_entity(&path).await? {
            EntityDefinition::Subscription { properties, .. } => Ok(properties),
            _ => Err(Error::EntityNotFound(path)),
        }
    }

    /// Adds a rule to a subscription. A message is copied to the subscription when any of its
    /// rules matches. SQL filters fail with [`Error::NotSupported`].
    pub async fn create_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> Result<(), Error> {
        let (topic, subscription) = (topic.to_owned(), subscription.to_owned());
        let change = SubscriptionChange::CreateRule(rule);
        self.call(|reply| Command::ChangeSubscription { topic, subscription, change, reply }).await
    }

    /// Replaces the rule of the same name (compared without case) of a subscription, in one
    /// turn of the broker: rules added or removed meanwhile stay as they are. A subscription
    /// without a rule of that name fails with [`Error::EntityNotFound`].
    pub async fn replace_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: Rule,
    ) -> Result<(), Error> {
        let (topic, subscription) = (topic.to_owned(), subscription.to_owned());
        let change = SubscriptionChange::ReplaceRule(rule);
        self.call(|reply| Command::ChangeSubscription { topic, subscription, change, reply }).await
    }

    /// Removes a rule from a subscription (a subscription without rules receives nothing).
    pub async fn delete_rule(
        &self,
        topic: &str,
        subscription: &str,
        rule: &str,
    ) -> Result<(), Error> {
        let (topic, subscription) = (topic.to_owned(), subscription.to_owned());
        let change = SubscriptionChange::DeleteRule(rule.to_owned());
        self.call(|reply| Command::ChangeSubscription { topic, subscription, change, reply }).await
    }

    /// A subscription's rules.
    pub async fn get_rules(&self, topic: &str, subscription: &str) -> Result<Vec<Rule>, Error> {
        let path = subscription_path(topic, subscription);
        match self.get_entity(&path).await? {
            EntityDefinition::Subscription { rules, .. } => Ok(rules),
            _ => Err(Error::EntityNotFound(path)),
        }
    }

    /// What a processor needs to know about an entity (lock duration, delivery limit,
    /// duplicate-detection window, sessions).
    pub async fn entity_info(&self, path: &str) -> Result<EntityInfo, Error> {
        let path = path.to_owned();
        self.call(|reply| Command::EntityInfo { path, reply }).await
    }

    /// Runtime counts of a queue or subscription (of a topic: its scheduled messages).
    pub async fn counts(&self, path: &str) -> Result<MessageCounts, Error> {
        let path = path.to_owned();
        let c = self.call(|reply| Command::Counts { path, reply }).await?;
        Ok(MessageCounts {
            active: c.active,
            locked: c.locked,
            deferred: c.deferred,
            scheduled: c.scheduled,
            dead_letter: c.dead_letter,
        })
    }

    /// Counters of an entity since the broker opened.
    pub async fn statistics(&self, path: &str) -> Result<Statistics, Error> {
        let path = Some(path.to_owned());
        self.call(|reply| Command::Counters { path, reply }).await.map(statistics)
    }

    /// Counters of the whole broker since it opened.
    pub async fn broker_statistics(&self) -> Result<Statistics, Error> {
        self.call(|reply| Command::Counters { path: None, reply }).await.map(statistics)
    }

    /// What the log did since the broker opened (all zero in memory mode).
    pub async fn storage_statistics(&self) -> Result<StorageStatistics, Error> {
        let s = self.call(|reply| Command::Storage { reply }).await?;
        Ok(StorageStatistics {
            commits: s.commits,
            fsyncs: s.fsyncs,
            segments: s.segments,
            records: s.records,
            bytes_written: s.bytes_written,
        })
    }

    // ----- send -------------------------------------------------------------------------------

    /// Sends one message to a queue or topic. Returns once it is on disk.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves does not undo the send: the message may be
    /// enqueued although the caller saw no acknowledgement (resend it with the same message id;
    /// duplicate detection, when enabled, drops the copy).
    pub async fn send(&self, path: &str, message: Message) -> Result<SendOutcome, Error> {
        let (path, message) = (PathArg::new(path), Arc::new(message));
        self.call(|reply| Command::SendOne { path, message, reply }).await
    }

    /// Sends a batch, all or nothing: at most 4500 messages whose total size is at most the
    /// maximum message size.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves does not undo the send: the message may be
    /// enqueued although the caller saw no acknowledgement (resend it with the same message id;
    /// duplicate detection, when enabled, drops the copy).
    pub async fn send_batch(
        &self,
        path: &str,
        messages: Vec<Message>,
    ) -> Result<Vec<SendOutcome>, Error> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let path = PathArg::new(path);
        // Shared here, off the broker's task.
        let messages = messages.into_iter().map(Arc::new).collect();
        self.call(|reply| Command::Send { path, messages, reply }).await
    }

    /// Schedules messages to appear at `at`; returns their sequence numbers, to cancel them.
    pub async fn schedule(
        &self,
        path: &str,
        messages: Vec<Message>,
        at: Timestamp,
    ) -> Result<Vec<SequenceNumber>, Error> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let path = path.to_owned();
        self.call(|reply| Command::Schedule { path, messages, at, reply }).await
    }

    /// Cancels scheduled messages, all or nothing.
    pub async fn cancel_scheduled(
        &self,
        path: &str,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<(), Error> {
        let (path, sequence_numbers) = (path.to_owned(), sequence_numbers.to_vec());
        self.call(|reply| Command::CancelScheduled { path, sequence_numbers, reply }).await
    }

    // ----- receive ----------------------------------------------------------------------------

    /// Receives up to `max_messages` messages in peek-lock mode, waiting up to `max_wait` (on
    /// the broker's clock) for the first one; an empty vector when none came. The wait is a
    /// long poll: it ends as soon as a message arrives.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: messages locked for a receive whose future was dropped are released
    /// without counting a delivery, so no message is lost or held.
    pub async fn receive(
        &self,
        path: &str,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.receive_with(path, ReceiveMode::PeekLock, max_messages, max_wait).await
    }

    /// Receives in receive-and-delete mode: the messages are removed as they are delivered.
    ///
    /// # Cancel safety
    ///
    /// A receive-and-delete whose future is dropped after the broker took the messages loses
    /// them: that is the at-most-once contract of this mode. Use peek-lock when it matters.
    pub async fn receive_and_delete(
        &self,
        path: &str,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.receive_with(path, ReceiveMode::ReceiveAndDelete, max_messages, max_wait).await
    }

    /// Receives in the given mode.
    pub async fn receive_with(
        &self,
        path: &str,
        mode: ReceiveMode,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let path = PathArg::new(path);
        let wait = Wait { max: max_messages, max_wait };
        received(
            self.call(|reply| Command::Receive { path, mode, wait, session: None, reply }).await,
        )
    }

    /// Receives deferred messages by sequence number (peek-lock), all or nothing.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: messages locked for a receive whose future was dropped are released
    /// without counting a delivery, so no message is lost or held.
    pub async fn receive_deferred(
        &self,
        path: &str,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.receive_deferred_with(path, sequence_numbers, None).await
    }

    pub(crate) async fn receive_deferred_with(
        &self,
        path: &str,
        sequence_numbers: &[SequenceNumber],
        session: Option<SessionLock>,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let (path, sequence_numbers) = (path.to_owned(), sequence_numbers.to_vec());
        let mode = ReceiveMode::PeekLock;
        received(
            self.call(|reply| Command::ReceiveDeferred {
                path,
                sequence_numbers,
                mode,
                session,
                reply,
            })
            .await,
        )
    }

    /// Browses up to `max` messages from sequence number `from` on, without locking them:
    /// active, locked, deferred and scheduled ones. Works on dead-letter queues too.
    pub async fn peek(
        &self,
        path: &str,
        from: SequenceNumber,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let path = path.to_owned();
        received(self.call(|reply| Command::Peek { path, from, max, session: None, reply }).await)
    }

    // ----- settle -----------------------------------------------------------------------------

    /// Completes a locked message: it is done and removed. Fails with
    /// [`Error::MessageLockLost`] when the lock expired or is unknown.
    pub async fn complete(&self, token: LockToken) -> Result<(), Error> {
        self.complete_many(&[token]).await
    }

    /// Completes several locked messages, all or nothing.
    pub async fn complete_many(&self, tokens: &[LockToken]) -> Result<(), Error> {
        self.settle(None, Settle::Complete(tokens.to_vec())).await.map(drop)
    }

    /// Abandons a locked message: it is available again with its delivery count raised (and
    /// dead-lettered when that exceeds `MaxDeliveryCount`), after merging `properties` into
    /// its application properties.
    pub async fn abandon(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.settle(None, Settle::One(token, Settlement::Abandon(properties))).await.map(drop)
    }

    /// Moves a locked message to its dead-letter queue with a reason and a description (empty
    /// strings are left unset), merging `properties`.
    pub async fn dead_letter(
        &self,
        token: LockToken,
        reason: DeadLetterReason,
        properties: Properties,
    ) -> Result<(), Error> {
        self.settle(None, Settle::One(token, Settlement::DeadLetter(reason, properties)))
            .await
            .map(drop)
    }

    /// Defers a locked message: it stays, receivable only by its sequence number.
    pub async fn defer(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.settle(None, Settle::One(token, Settlement::Defer(properties))).await.map(drop)
    }

    /// Unlocks a message without counting a delivery (it never reached a handler).
    pub async fn release(&self, token: LockToken) -> Result<(), Error> {
        self.settle(None, Settle::One(token, Settlement::Release)).await.map(drop)
    }

    /// Renews a lock for another `LockDuration`; returns the new locked-until time.
    pub async fn renew_lock(&self, token: LockToken) -> Result<Timestamp, Error> {
        let mut out = self.settle(None, Settle::RenewLock(token)).await?;
        out.pop().ok_or(Error::MessageLockLost)
    }

    /// [`Broker::complete_many`] by a receiver of entity `path`: a token of a message of any
    /// other entity (another queue or subscription, or the entity's dead-letter queue) fails
    /// the call with [`Error::MessageLockLost`], as an unknown token does, and changes nothing.
    /// A front end serving many clients settles this way, so that a token is worth nothing
    /// outside the entity it was given for.
    pub async fn complete_in(&self, path: &str, tokens: &[LockToken]) -> Result<(), Error> {
        self.settle(Some(path), Settle::Complete(tokens.to_vec())).await.map(drop)
    }

    /// [`Broker::abandon`] by a receiver of entity `path` (see [`Broker::complete_in`]).
    pub async fn abandon_in(
        &self,
        path: &str,
        token: LockToken,
        properties: Properties,
    ) -> Result<(), Error> {
        self.settle(Some(path), Settle::One(token, Settlement::Abandon(properties))).await.map(drop)
    }

    /// [`Broker::dead_letter`] by a receiver of entity `path` (see [`Broker::complete_in`]).
    pub async fn dead_letter_in(
        &self,
        path: &str,
        token: LockToken,
        reason: DeadLetterReason,
        properties: Properties,
    ) -> Result<(), Error> {
        self.settle(Some(path), Settle::One(token, Settlement::DeadLetter(reason, properties)))
            .await
            .map(drop)
    }

    /// [`Broker::defer`] by a receiver of entity `path` (see [`Broker::complete_in`]).
    pub async fn defer_in(
        &self,
        path: &str,
        token: LockToken,
        properties: Properties,
    ) -> Result<(), Error> {
        self.settle(Some(path), Settle::One(token, Settlement::Defer(properties))).await.map(drop)
    }

    /// [`Broker::release`] by a receiver of entity `path` (see [`Broker::complete_in`]).
    pub async fn release_in(&self, path: &str, token: LockToken) -> Result<(), Error> {
        self.settle(Some(path), Settle::One(token, Settlement::Release)).await.map(drop)
    }

    /// [`Broker::renew_lock`] by a receiver of entity `path` (see [`Broker::complete_in`]).
    pub async fn renew_lock_in(&self, path: &str, token: LockToken) -> Result<Timestamp, Error> {
        let mut out = self.settle(Some(path), Settle::RenewLock(token)).await?;
        out.pop().ok_or(Error::MessageLockLost)
    }

    /// Settles a locked message as `how` says, by a receiver of entity `path` (see
    /// [`Broker::complete_in`]): one call for the settlements a front end passes through.
    pub async fn settle_in(
        &self,
        path: &str,
        token: LockToken,
        how: Settlement,
    ) -> Result<(), Error> {
        self.settle(Some(path), Settle::One(token, how)).await.map(drop)
    }

    /// Sends a settlement, scoped to the entity `path` when one is given; returns the new
    /// locked-until times of a renewal (empty for the others).
    async fn settle(&self, path: Option<&str>, how: Settle) -> Result<Vec<Timestamp>, Error> {
        let entity = path.map(PathArg::new);
        match how {
            Settle::Complete(tokens) => {
                self.call(|reply| Command::Complete { entity, tokens, reply }).await?;
            }
            Settle::One(token, Settlement::Complete) => {
                let tokens = vec![token];
                self.call(|reply| Command::Complete { entity, tokens, reply }).await?;
            }
            Settle::One(token, Settlement::Abandon(properties)) => {
                self.call(|reply| Command::Abandon { entity, token, properties, reply }).await?;
            }
            Settle::One(token, Settlement::DeadLetter(why, properties)) => {
                let non_empty = |s: String| (!s.is_empty()).then_some(s);
                let (reason, description) = (non_empty(why.reason), non_empty(why.description));
                self.call(|reply| Command::DeadLetter {
                    entity,
                    token,
                    reason,
                    description,
                    properties,
                    reply,
                })
                .await?;
            }
            Settle::One(token, Settlement::Defer(properties)) => {
                self.call(|reply| Command::Defer { entity, token, properties, reply }).await?;
            }
            Settle::One(token, Settlement::Release) => {
                let tokens = vec![token];
                self.call(|reply| Command::Release { entity, tokens, reply }).await?;
            }
            Settle::RenewLock(token) => {
                let tokens = vec![token];
                return self.call(|reply| Command::RenewLock { entity, tokens, reply }).await;
            }
        }
        Ok(Vec::new())
    }

    /// Moves dead-lettered messages back to their queue or subscription, all or nothing; each
    /// gets a new sequence number (returned), cleared dead-letter fields and a fresh delivery
    /// count. `path` is the entity or its dead-letter queue.
    pub async fn resubmit(
        &self,
        path: &str,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<Vec<SequenceNumber>, Error> {
        let path = dead_letter_path(path);
        let sequence_numbers = sequence_numbers.to_vec();
        self.call(|reply| Command::Resubmit { path, sequence_numbers, reply }).await
    }

    // ----- sessions ---------------------------------------------------------------------------

    /// The sessions that have messages in a session-enabled entity, in order of their oldest
    /// message. Reads the broker's index of messages, not their bodies.
    pub async fn list_sessions(&self, path: &str) -> Result<Vec<SessionId>, Error> {
        let path = path.to_owned();
        self.call(|reply| Command::ListSessions { path, reply }).await
    }

    /// Peeks the messages of one session.
    pub async fn peek_session(
        &self,
        path: &str,
        session_id: &SessionId,
        from: SequenceNumber,
        max: usize,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let (path, session) = (path.to_owned(), Some(session_id.clone()));
        received(self.call(|reply| Command::Peek { path, from, max, session, reply }).await)
    }
}

/// A settlement on its way to [`Broker::settle`].
#[derive(Debug)]
enum Settle {
    /// Completes these, all or nothing.
    Complete(Vec<LockToken>),
    /// Settles one message.
    One(LockToken, Settlement),
    /// Renews a lock.
    RenewLock(LockToken),
}

/// Builds received messages from what the broker delivered, on the caller's side: the broker
/// shares the messages, and the copies each caller gets are made here, in parallel with the
/// broker's work.
pub(crate) fn received(
    delivered: Result<Vec<Delivered>, Error>,
) -> Result<Vec<ReceivedMessage>, Error> {
    delivered?.into_iter().map(Delivered::into_received).collect()
}

fn statistics(c: engine::Counters) -> Statistics {
    Statistics {
        sent: c.sent,
        duplicates: c.duplicates,
        received: c.received,
        completed: c.completed,
        abandoned: c.abandoned,
        dead_lettered: c.dead_lettered,
        lock_lost: c.lock_lost,
        expired: c.expired,
    }
}

fn subscription_path(topic: &str, name: &str) -> String {
    format!("{topic}/Subscriptions/{name}")
}

fn dead_letter_path(path: &str) -> String {
    let suffix = engine::DEAD_LETTER_SUFFIX;
    let is_dlq = path.len() >= suffix.len()
        && path.get(path.len() - suffix.len()..).is_some_and(|s| s.eq_ignore_ascii_case(suffix));
    if is_dlq { path.to_owned() } else { format!("{path}{suffix}") }
}
