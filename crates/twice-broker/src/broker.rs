//! The public handle of the broker: [`Broker`], its [`BrokerOptions`], and [`Session`].
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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use twice::{
    DeadLetterReason, EntityInfo, LockToken, Message, Properties, ReceivedMessage, SequenceNumber,
    SessionId, SharedClock, Timestamp,
};

use crate::config::{
    Config, EntityDefinition, QueueProperties, Rule, SubscriptionProperties, TopicProperties,
};
use crate::engine::{self, AcceptedSession, EngineOptions, SessionLock};
use crate::error::Error;
use crate::runtime::{
    Command, Delivered, PathArg, Reply, Runtime, RuntimeOptions, SubscriptionChange, Wait,
};
use crate::storage::{DEFAULT_CACHE_BYTES, DEFAULT_SEGMENT_SIZE, FailureCell, LogOptions};
use crate::transport::Receiver;

/// The default largest message (and send batch), in bytes: 256 KiB, as Service Bus standard.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = engine::DEFAULT_MAX_MESSAGE_SIZE;

/// How a broker is opened: where it keeps its data, which clock it reads, which entities it
/// starts with, and its limits.
///
/// ```
/// use twice_broker::BrokerOptions;
///
/// let options = BrokerOptions::in_memory().with_max_message_size(1024 * 1024);
/// assert!(!options.is_durable());
/// assert_eq!(options.max_message_size(), 1024 * 1024);
/// ```
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    dir: Option<PathBuf>,
    clock: SharedClock,
    config: Option<Config>,
    max_message_size: usize,
    segment_size: u64,
    cache_size: usize,
    max_commands_per_turn: usize,
    command_queue: usize,
    relaxed_delivery_counts: bool,
}

impl BrokerOptions {
    /// A broker that keeps its data in `dir` (created if missing): an acknowledged change
    /// survives a crash of the process or the machine.
    pub fn durable(dir: impl Into<PathBuf>) -> Self {
        Self { dir: Some(dir.into()), ..Self::in_memory() }
    }

    /// A broker that keeps everything in memory and writes nothing: for tests and demos. Its
    /// state is gone when it stops.
    pub fn in_memory() -> Self {
        Self {
            dir: None,
            clock: SharedClock::system(),
            config: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            segment_size: DEFAULT_SEGMENT_SIZE,
            cache_size: DEFAULT_CACHE_BYTES,
            max_commands_per_turn: 1024,
            command_queue: 4096,
            relaxed_delivery_counts: false,
        }
    }

    /// Reads time from `clock` (default: the system clock). Lock expiry, time to live,
    /// scheduled messages, session locks, duplicate-detection windows and receive timeouts all
    /// follow it, so a test can move a [`twice::ManualClock`] instead of sleeping.
    #[must_use]
    pub fn with_clock(mut self, clock: impl Into<SharedClock>) -> Self {
        self.clock = clock.into();
        self
    }

    /// Creates (or updates) the entities of an emulator `Config.json` when the broker opens
    /// (default: none).
    #[must_use]
    pub fn with_config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// The largest message, and the largest send batch, in bytes (default 256 KiB).
    #[must_use]
    pub fn with_max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// The size at which the log starts a new segment file (default 64 MiB). Segments whose
    /// messages are all gone are deleted.
    #[must_use]
    pub fn with_segment_size(mut self, bytes: u64) -> Self {
        self.segment_size = bytes.max(4096);
        self
    }

    /// The memory, in bytes, kept for recently sent messages once they are on disk, so that
    /// fresh messages are delivered without reading the disk (default 32 MiB; recently written
    /// log records get another quarter of it).
    #[must_use]
    pub fn with_cache_size(mut self, bytes: usize) -> Self {
        self.cache_size = bytes;
        self
    }

    /// How many queued calls the broker applies before it writes and syncs them together
    /// (default 1024).
    #[must_use]
    pub fn with_max_commands_per_turn(mut self, n: usize) -> Self {
        self.max_commands_per_turn = n.max(1);
        self
    }

    /// Answers peek-lock receives before the record of their lock is on disk (default: off).
    ///
    /// By default every reply waits until what its call changed is durable, and a receive
    /// changes the state of the messages it locks: the lock is recorded so that, after a
    /// crash, each of those messages comes back with its delivery count raised. With this
    /// option a peek-lock receive waits only until the messages it delivers are durable as
    /// delivered (sent, moved, abandoned), which saves it an fsync of latency: a receiver that
    /// waits for each receive (one at a time, or few in parallel) gets several times more
    /// messages per second from a durable broker.
    ///
    /// The cost: if the broker crashes after such a reply and before the lock record reaches
    /// the disk, that delivery is not counted. After the restart the message comes back with
    /// the delivery count it was delivered with, not one higher, so a message that keeps
    /// crashing the broker is retried without reaching `MaxDeliveryCount`. Sends, settlements,
    /// receive-and-delete and everything else still wait for their records. No effect in
    /// memory mode.
    #[must_use]
    pub fn with_relaxed_delivery_counts(mut self, relaxed: bool) -> Self {
        self.relaxed_delivery_counts = relaxed;
        self
    }

    /// Whether peek-lock receives are answered before their lock records are on disk (see
    /// [`BrokerOptions::with_relaxed_delivery_counts`]).
    pub fn relaxed_delivery_counts(&self) -> bool {
        self.relaxed_delivery_counts
    }

    /// The data directory, in durable mode.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Whether the broker writes its data to disk.
    pub fn is_durable(&self) -> bool {
        self.dir.is_some()
    }

    /// The clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// The largest message in bytes.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The segment size in bytes.
    pub fn segment_size(&self) -> u64 {
        self.segment_size
    }

    /// The record cache size in bytes.
    pub fn cache_size(&self) -> usize {
        self.cache_size
    }

    /// The most calls applied per write.
    pub fn max_commands_per_turn(&self) -> usize {
        self.max_commands_per_turn
    }
}

/// How a receive takes messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiveMode {
    /// Lock each message for the receiver until it is settled or the lock expires (at least
    /// once).
    #[default]
    PeekLock,
    /// Remove each message as it is delivered (at most once).
    ReceiveAndDelete,
}

impl From<ReceiveMode> for engine::ReceiveMode {
    fn from(m: ReceiveMode) -> Self {
        match m {
            ReceiveMode::PeekLock => engine::ReceiveMode::PeekLock,
            ReceiveMode::ReceiveAndDelete => engine::ReceiveMode::ReceiveAndDelete,
        }
    }
}

/// What happened to one sent message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOutcome {
    /// Enqueued with this sequence number (of the queue or topic it was sent to).
    Enqueued(SequenceNumber),
    /// Its message id was accepted within the duplicate-detection window: acknowledged as a
    /// success and dropped.
    Duplicate,
}

impl SendOutcome {
    /// The sequence number, unless the message was a duplicate.
    pub fn sequence_number(&self) -> Option<SequenceNumber> {
        match self {
            SendOutcome::Enqueued(s) => Some(*s),
            SendOutcome::Duplicate => None,
        }
    }
}

impl From<engine::SendOutcome> for SendOutcome {
    fn from(o: engine::SendOutcome) -> Self {
        match o {
            engine::SendOutcome::Enqueued(s) => SendOutcome::Enqueued(s),
            engine::SendOutcome::Duplicate => SendOutcome::Duplicate,
        }
    }
}

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

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Error> {
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
        let out = self.call(|reply| Command::SendOne { path, message, reply }).await?;
        Ok(out.into())
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
        let out = self.call(|reply| Command::Send { path, messages, reply }).await?;
        Ok(out.into_iter().map(SendOutcome::from).collect())
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
        let mode = mode.into();
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

    async fn receive_deferred_with(
        &self,
        path: &str,
        sequence_numbers: &[SequenceNumber],
        session: Option<SessionLock>,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let (path, sequence_numbers) = (path.to_owned(), sequence_numbers.to_vec());
        let mode = engine::ReceiveMode::PeekLock;
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
        let tokens = tokens.to_vec();
        self.call(|reply| Command::Complete { tokens, reply }).await
    }

    /// Abandons a locked message: it is available again with its delivery count raised (and
    /// dead-lettered when that exceeds `MaxDeliveryCount`), after merging `properties` into
    /// its application properties.
    pub async fn abandon(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.call(|reply| Command::Abandon { token, properties, reply }).await
    }

    /// Moves a locked message to its dead-letter queue with a reason and a description (empty
    /// strings are left unset), merging `properties`.
    pub async fn dead_letter(
        &self,
        token: LockToken,
        reason: DeadLetterReason,
        properties: Properties,
    ) -> Result<(), Error> {
        let non_empty = |s: String| (!s.is_empty()).then_some(s);
        let (reason, description) = (non_empty(reason.reason), non_empty(reason.description));
        self.call(|reply| Command::DeadLetter { token, reason, description, properties, reply })
            .await
    }

    /// Defers a locked message: it stays, receivable only by its sequence number.
    pub async fn defer(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.call(|reply| Command::Defer { token, properties, reply }).await
    }

    /// Unlocks a message without counting a delivery (it never reached a handler).
    pub async fn release(&self, token: LockToken) -> Result<(), Error> {
        let tokens = vec![token];
        self.call(|reply| Command::Release { tokens, reply }).await
    }

    /// Renews a lock for another `LockDuration`; returns the new locked-until time.
    pub async fn renew_lock(&self, token: LockToken) -> Result<Timestamp, Error> {
        let tokens = vec![token];
        let mut out = self.call(|reply| Command::RenewLock { tokens, reply }).await?;
        out.pop().ok_or(Error::MessageLockLost)
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

    // ----- transport --------------------------------------------------------------------------

    /// A receiver on one entity implementing [`twice::Transport`] (and
    /// [`twice::SessionTransport`] on a session-enabled entity), for the idempotent processor.
    pub async fn receiver(&self, path: &str) -> Result<Receiver, Error> {
        let info = self.entity_info(path).await?;
        Ok(Receiver::new(self.clone(), info))
    }
}

/// Builds received messages from what the broker delivered, on the caller's side: the broker
/// shares the messages, and the copies each caller gets are made here, in parallel with the
/// broker's work.
fn received(delivered: Result<Vec<Delivered>, Error>) -> Result<Vec<ReceivedMessage>, Error> {
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
    fn new(broker: Broker, path: &str, accepted: AcceptedSession) -> Self {
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
        let (mode, session) = (mode.into(), Some(self.lock));
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
        self.broker.complete(token).await
    }

    /// Abandons a message of this session.
    pub async fn abandon(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.broker.abandon(token, properties).await
    }

    /// Dead-letters a message of this session.
    pub async fn dead_letter(
        &self,
        token: LockToken,
        reason: DeadLetterReason,
        properties: Properties,
    ) -> Result<(), Error> {
        self.broker.dead_letter(token, reason, properties).await
    }

    /// Defers a message of this session.
    pub async fn defer(&self, token: LockToken, properties: Properties) -> Result<(), Error> {
        self.broker.defer(token, properties).await
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
