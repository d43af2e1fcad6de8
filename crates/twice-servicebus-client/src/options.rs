//! Options of a receiver, and what it tells the processor about its entity.
//!
//! AMQP does not carry an entity's properties: Service Bus serves them only through its
//! administration API (ATOM over HTTPS; on `twice serve` and the emulator, a port of its own
//! that a connection string does not name, 5300 by default). A receiver reads them from there
//! when the processor starts ([`Receiver::entity_properties`](crate::Receiver::entity_properties)),
//! and the options override what they give: [`ReceiverOptions::entity_info`] all of it,
//! [`ReceiverOptions::message_time_to_live`] the time to live. When it cannot read them (a key
//! without the `Manage` claim, the API unreachable) it warns and assumes what the options say,
//! or the Service Bus defaults (lock 60 s, 10 deliveries, no duplicate detection, no time to
//! live).

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
///
/// # Credit
///
/// By default the link's credit follows the receive calls: a call for `n` messages opens
/// credit for `n` (less what is already open or buffered), and no more. A message is locked
/// for this receiver from the moment the service sends it, and its lock runs while it waits in
/// a buffer, unrenewed; so behind handlers that run long, a message received ahead of them
/// would see its lock run out unseen and spend one of its deliveries. With credit on demand a
/// processor holds no more locked messages than it has free calls to start them (it asks for
/// that many). [`prefetch`](Self::prefetch) keeps credit open ahead of the calls instead, for
/// throughput when handlers are short against the lock.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    pub(crate) mode: ReceiveMode,
    /// Credit kept open ahead of the calls; 0: credit on demand.
    pub(crate) prefetch: u32,
    /// With credit on demand, the most one call opens.
    pub(crate) max_credit: Option<u32>,
    entity: Option<EntityInfo>,
    message_time_to_live: Option<Duration>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        Self {
            mode: ReceiveMode::PeekLock,
            prefetch: 0,
            max_credit: None,
            entity: None,
            message_time_to_live: None,
        }
    }
}

impl ReceiverOptions {
    /// Peek-lock with credit on demand.
    pub fn new() -> Self {
        Self::default()
    }

    /// Peek-lock (default) or receive-and-delete.
    #[must_use]
    pub fn mode(mut self, mode: ReceiveMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sizes the receiver for a processor with this many concurrent calls: credit on demand
    /// (no prefetch), and never more than `calls` messages asked for at once, so that no
    /// message is locked before a call is free to start it.
    #[must_use]
    pub fn max_concurrent_calls(mut self, calls: usize) -> Self {
        self.prefetch = 0;
        self.max_credit = Some(u32::try_from(calls.max(1)).unwrap_or(u32::MAX));
        self
    }

    /// Keeps `n` credits open on the link ahead of the `receive` calls (0: credit on demand,
    /// the default). Prefetched messages are locked while they wait, and their locks are not
    /// renewed: choose `n` so that they are taken well within the lock duration. A prefetched
    /// message whose lock ran out is counted by the processor
    /// (`CounterSnapshot::expired_in_buffer`) and delivered again by the service.
    #[must_use]
    pub fn prefetch(mut self, n: u32) -> Self {
        self.prefetch = n;
        self
    }

    /// What the processor should know about the entity (lock duration, max delivery count,
    /// duplicate detection window, time to live), given rather than read from the namespace's
    /// administration API.
    #[must_use]
    pub fn entity_info(mut self, info: EntityInfo) -> Self {
        self.entity = Some(info);
        self
    }

    /// The entity's `DefaultMessageTimeToLive` (of a subscription: the shorter of its own and
    /// its topic's), overriding the one read from the administration API. It becomes
    /// [`EntityInfo::message_time_to_live`], and the processor then refuses an inbox that
    /// forgets a message id before a copy of the message can have expired.
    #[must_use]
    pub fn message_time_to_live(mut self, ttl: Duration) -> Self {
        self.message_time_to_live = Some(ttl);
        self
    }

    /// Peek-lock or receive-and-delete.
    pub fn get_mode(&self) -> ReceiveMode {
        self.mode
    }

    /// The credit kept open ahead of the calls (0: credit on demand).
    pub fn get_prefetch(&self) -> u32 {
        self.prefetch
    }

    /// With credit on demand, the most credit one call opens, as set by
    /// [`max_concurrent_calls`](Self::max_concurrent_calls).
    pub fn get_max_credit(&self) -> Option<u32> {
        self.max_credit
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
