//! How a broker is opened: [`BrokerOptions`].

use std::path::{Path, PathBuf};

use twice::SharedClock;

use crate::config::Config;
use crate::engine::{DEFAULT_MAX_MESSAGE_SIZE, Limits};
use crate::storage::{DEFAULT_CACHE_BYTES, DEFAULT_SEGMENT_SIZE};

/// How a broker is opened: where it keeps its data, which clock it reads, which entities it
/// starts with, and its limits. Setters are named after what they set, getters `get_…`, as in
/// the other options of twice.
///
/// ```
/// use twice_broker::BrokerOptions;
///
/// let options = BrokerOptions::in_memory().max_message_size(1024 * 1024);
/// assert!(!options.is_durable());
/// assert_eq!(options.get_max_message_size(), 1024 * 1024);
/// ```
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) clock: SharedClock,
    pub(crate) config: Option<Config>,
    pub(crate) max_message_size: usize,
    pub(crate) segment_size: u64,
    pub(crate) cache_size: usize,
    pub(crate) max_commands_per_turn: usize,
    pub(crate) command_queue: usize,
    pub(crate) relaxed_delivery_counts: bool,
    pub(crate) limits: Limits,
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
            limits: Limits::default(),
        }
    }

    /// Reads time from `clock` (default: the system clock). Lock expiry, time to live,
    /// scheduled messages, session locks, duplicate-detection windows and receive timeouts all
    /// follow it, so a test can move a [`twice::ManualClock`] instead of sleeping.
    #[must_use]
    pub fn clock(mut self, clock: impl Into<SharedClock>) -> Self {
        self.clock = clock.into();
        self
    }

    /// Creates (or updates) the entities of an emulator `Config.json` when the broker opens
    /// (default: none).
    #[must_use]
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// The largest message, and the largest send batch, in bytes (default 256 KiB).
    #[must_use]
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// The size at which the log starts a new segment file (default 64 MiB). Segments whose
    /// messages are all gone are deleted.
    #[must_use]
    pub fn segment_size(mut self, bytes: u64) -> Self {
        self.segment_size = bytes.max(4096);
        self
    }

    /// The memory, in bytes, kept for recently sent messages once they are on disk, so that
    /// fresh messages are delivered without reading the disk (default 32 MiB; recently written
    /// log records get another quarter of it).
    #[must_use]
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_size = bytes;
        self
    }

    /// How many queued calls the broker applies before it writes and syncs them together
    /// (default 1024).
    #[must_use]
    pub fn max_commands_per_turn(mut self, n: usize) -> Self {
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
    pub fn relaxed_delivery_counts(mut self, relaxed: bool) -> Self {
        self.relaxed_delivery_counts = relaxed;
        self
    }

    /// The most queues and topics the namespace may hold (default 10,000, Service Bus
    /// Standard's quota; subscriptions do not count). Creating one more, through the API,
    /// the administration API or a configuration file, fails with
    /// [`Error::LimitExceeded`](crate::Error::LimitExceeded).
    #[must_use]
    pub fn max_entities(mut self, n: usize) -> Self {
        self.limits.max_entities = n;
        self
    }

    /// The most subscriptions one topic may have (default 2,000, Service Bus Standard's
    /// quota).
    #[must_use]
    pub fn max_subscriptions_per_topic(mut self, n: usize) -> Self {
        self.limits.max_subscriptions_per_topic = n;
        self
    }

    /// The most rules one subscription may have (default 2,000: Service Bus caps the SQL
    /// filters of a topic at 2,000). Over AMQP, `$management` `add-rule` past it is refused.
    #[must_use]
    pub fn max_rules_per_subscription(mut self, n: usize) -> Self {
        self.limits.max_rules_per_subscription = n;
        self
    }

    /// The cap on queues and topics (see [`BrokerOptions::max_entities`]).
    pub fn get_max_entities(&self) -> usize {
        self.limits.max_entities
    }

    /// The cap on subscriptions per topic.
    pub fn get_max_subscriptions_per_topic(&self) -> usize {
        self.limits.max_subscriptions_per_topic
    }

    /// The cap on rules per subscription.
    pub fn get_max_rules_per_subscription(&self) -> usize {
        self.limits.max_rules_per_subscription
    }

    /// Whether peek-lock receives are answered before their lock records are on disk (see
    /// [`BrokerOptions::relaxed_delivery_counts`]).
    pub fn get_relaxed_delivery_counts(&self) -> bool {
        self.relaxed_delivery_counts
    }

    /// The data directory, in durable mode.
    pub fn get_dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Whether the broker writes its data to disk.
    pub fn is_durable(&self) -> bool {
        self.dir.is_some()
    }

    /// The clock.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }

    /// The largest message in bytes.
    pub fn get_max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The segment size in bytes.
    pub fn get_segment_size(&self) -> u64 {
        self.segment_size
    }

    /// The record cache size in bytes.
    pub fn get_cache_size(&self) -> usize {
        self.cache_size
    }

    /// The most calls applied per write.
    pub fn get_max_commands_per_turn(&self) -> usize {
        self.max_commands_per_turn
    }
}
