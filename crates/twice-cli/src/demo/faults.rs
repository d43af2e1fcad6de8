//! Faults injected between the consumers and the broker: a completion that never arrives (the
//! process died after its commit) and lock renewals that fail (the process was paused).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use twice::{
    DeadLetterReason, Delivery as _, EntityInfo, MessageId, Properties, Receive, ReceivedMessage,
    Timestamp, Transport, TransportError,
};

use super::broker::{DemoDelivery, DemoTransport};
use super::plan::Plan;

/// The faults planned for one message id.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MessageFaults {
    /// The first delivery's completion is lost.
    pub(crate) crash_after_commit: bool,
    /// The first delivery outlasts its lock and cannot renew it.
    pub(crate) slow: bool,
    /// Deliveries 1..=n fail with a transient error.
    pub(crate) transient_failures: u32,
}

/// Faults by message id.
#[derive(Debug, Default)]
pub(crate) struct FaultTable(HashMap<MessageId, MessageFaults>);

impl FaultTable {
    /// The faults of every order's first publication.
    pub(crate) fn new(plan: &Plan) -> Self {
        Self(
            plan.orders
                .iter()
                .map(|o| {
                    let f = MessageFaults {
                        crash_after_commit: o.crash_after_commit,
                        slow: o.slow,
                        transient_failures: o.transient_failures,
                    };
                    (MessageId::new(o.message_id()), f)
                })
                .collect(),
        )
    }

    /// The faults of `id` (none if unplanned).
    pub(crate) fn get(&self, id: &MessageId) -> MessageFaults {
        self.0.get(id).copied().unwrap_or_default()
    }
}

/// A [`DemoTransport`] whose completions and renewals fail as planned.
#[derive(Debug)]
pub(crate) struct FaultyReceiver {
    inner: Arc<DemoTransport>,
    faults: Arc<FaultTable>,
    lost_completions: AtomicU64,
    failed_renewals: AtomicU64,
}

impl FaultyReceiver {
    pub(crate) fn new(inner: Arc<DemoTransport>, faults: Arc<FaultTable>) -> Self {
        Self {
            inner,
            faults,
            lost_completions: AtomicU64::new(0),
            failed_renewals: AtomicU64::new(0),
        }
    }

    /// Completions dropped as if the process had died.
    pub(crate) fn lost_completions(&self) -> u64 {
        self.lost_completions.load(Ordering::Relaxed)
    }

    fn first_delivery_with(&self, d: &ReceivedMessage, f: impl Fn(MessageFaults) -> bool) -> bool {
        d.delivery_count == 1 && f(self.faults.get(d.message_id()))
    }
}

impl Receive for FaultyReceiver {
    type Delivery = DemoDelivery;

    async fn receive(
        &self,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<DemoDelivery>, TransportError> {
        self.inner.receive(max, max_wait).await
    }

    async fn complete(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        if self.first_delivery_with(d.message(), |f| f.crash_after_commit) {
            // The process "dies" here: the work is committed, the broker never hears of it.
            self.lost_completions.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.inner.complete(d).await
    }

    async fn abandon(
        &self,
        d: &DemoDelivery,
        properties: Properties,
    ) -> Result<(), TransportError> {
        self.inner.abandon(d, properties).await
    }

    async fn dead_letter(
        &self,
        d: &DemoDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.inner.dead_letter(d, reason).await
    }

    async fn defer(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        self.inner.defer(d).await
    }
}

impl Transport for FaultyReceiver {
    fn entity(&self) -> &EntityInfo {
        self.inner.entity()
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    async fn release(&self, d: &DemoDelivery) -> Result<(), TransportError> {
        self.inner.release(d).await
    }

    async fn renew_lock(&self, d: &DemoDelivery) -> Result<Timestamp, TransportError> {
        if self.first_delivery_with(d.message(), |f| f.slow) {
            // The process is paused: its renewals never reach the broker.
            self.failed_renewals.fetch_add(1, Ordering::Relaxed);
            return Err(TransportError::Other {
                message: "lock renewal did not reach the broker (process paused)".into(),
                transient: true,
                source: None,
            });
        }
        self.inner.renew_lock(d).await
    }
}
