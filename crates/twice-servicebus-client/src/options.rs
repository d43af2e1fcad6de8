//! Options of a receiver, and what it tells the processor about its entity.
//!
//! AMQP does not carry an entity's properties: Service Bus serves them only through its
//! administration API (ATOM over HTTPS; on `twice serve` and the emulator, a port of its own
//! that a connection string does not name). This client speaks AMQP alone, so a receiver
//! assumes the Service Bus defaults (lock 60 s, 10 deliveries, no duplicate detection) and no
//! time to live unless the options say otherwise.

use std::time::Duration;

use twice::EntityInfo;

/// How messages are taken from the entity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiveMode {
    /// Each message is locked for this receiver until it is settled or the lock expires.
    #[default]
    PeekLock,
    /// Each message is removed as it is sent: at most once, no settlement.
    ReceiveAndDelete,
}

/// Options of a receiver.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    pub(crate) mode: ReceiveMode,
    pub(crate) prefetch: u32,
    entity: Option<EntityInfo>,
    message_time_to_live: Option<Duration>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        Self { mode: ReceiveMode::PeekLock, prefetch: 2, entity: None, message_time_to_live: None }
    }
}

impl ReceiverOptions {
    /// Peek-lock with the credit of one concurrent call.
    pub fn new() -> Self {
        Self::default()
    }

    /// Peek-lock (default) or receive-and-delete.
    #[must_use]
    pub fn mode(mut self, mode: ReceiveMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sizes the link credit for a processor with this many concurrent calls: twice as many
    /// messages as calls are in flight or buffered, so a finished call finds the next message
    /// waiting without locking many more than can be worked on.
    #[must_use]
    pub fn max_concurrent_calls(mut self, calls: usize) -> Self {
        self.prefetch = u32::try_from(calls.max(1).saturating_mul(2)).unwrap_or(u32::MAX);
        self
    }

    /// The link credit directly: how many messages may be delivered ahead of `receive` calls
    /// (at least 1).
    #[must_use]
    pub fn prefetch(mut self, n: u32) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// What the processor should know about the entity (lock duration, max delivery count,
    /// duplicate detection window, time to live). AMQP does not carry these; without this the
    /// Service Bus defaults are assumed.
    #[must_use]
    pub fn entity_info(mut self, info: EntityInfo) -> Self {
        self.entity = Some(info);
        self
    }

    /// The entity's `DefaultMessageTimeToLive` (of a subscription: the shorter of its own and
    /// its topic's), which the receiver cannot read over AMQP. It becomes
    /// [`EntityInfo::message_time_to_live`], and the processor then refuses an inbox that
    /// forgets a message id before a copy of the message can have expired. Without it (and
    /// without [`entity_info`](Self::entity_info) carrying one) the receiver reports `None`
    /// and the processor checks the inbox against the lock and delivery count alone.
    #[must_use]
    pub fn message_time_to_live(mut self, ttl: Duration) -> Self {
        self.message_time_to_live = Some(ttl);
        self
    }

    /// Peek-lock or receive-and-delete.
    pub fn get_mode(&self) -> ReceiveMode {
        self.mode
    }

    /// The credit.
    pub fn get_prefetch(&self) -> u32 {
        self.prefetch
    }

    /// The entity info given with [`entity_info`](Self::entity_info), if any.
    pub fn get_entity_info(&self) -> Option<&EntityInfo> {
        self.entity.as_ref()
    }

    /// The entity's time to live given with
    /// [`message_time_to_live`](Self::message_time_to_live), if any.
    pub fn get_message_time_to_live(&self) -> Option<Duration> {
        self.message_time_to_live
    }

    /// The entity info a receiver on `entity` reports.
    pub(crate) fn entity_info_for(&self, entity: &str) -> EntityInfo {
        let mut info = self.entity.clone().unwrap_or_else(|| EntityInfo::new(entity));
        if let Some(ttl) = self.message_time_to_live {
            info.message_time_to_live = Some(ttl);
        }
        info
    }
}
