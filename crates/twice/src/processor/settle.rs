//! How a message is settled with the broker once its verdict is known.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::shared::Core;
use crate::counters::Counter;
use crate::error::{ErrorSource, ProcessError};
use crate::message::Properties;
use crate::transport::{DeadLetterReason, Delivery, Transport, TransportError};

/// What became of the handler's work.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Complete; the counter says why (work done, or which kind of duplicate).
    Complete(Option<Counter>),
    Abandon,
    /// No handler ran (the infrastructure failed before it, every time): hand the message
    /// back without counting a delivery ([`Transport::release`]).
    Release,
    /// The handler failed and its immediate retries are used up: redeliver later if the
    /// policy says so, else abandon.
    Retry,
    DeadLetter(DeadLetterReason),
    Defer,
    /// The lock was lost: nothing to settle.
    LockLost,
}

impl Verdict {
    /// Whether the broker is to be told: all but a lost lock.
    pub(crate) fn settles(&self) -> bool {
        !matches!(self, Self::LockLost)
    }
}

/// How a message is settled.
#[derive(Debug)]
pub(crate) enum Settlement {
    Complete,
    Abandon,
    /// Unlock without counting a delivery; a transport that cannot abandons instead.
    Release,
    DeadLetter(DeadLetterReason),
    Defer,
    /// Bring the message back after `delay`, with `properties` merged in
    /// ([`Transport::redeliver_later`]).
    RedeliverLater {
        delay: Duration,
        properties: Properties,
    },
}

/// Settles deliveries: through the transport, or through a session.
pub(crate) trait Settler: Send + Sync {
    type Delivery: Delivery;

    fn settle<'a>(
        &'a self,
        delivery: &'a Self::Delivery,
        how: Settlement,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a;
}

/// Settles through a [`Transport`].
pub(crate) struct TransportSettler<T>(pub(crate) Arc<T>);

impl<T: Transport> Settler for TransportSettler<T> {
    type Delivery = T::Delivery;

    async fn settle<'a>(
        &'a self,
        delivery: &'a T::Delivery,
        how: Settlement,
    ) -> Result<(), TransportError> {
        match how {
            Settlement::Complete => self.0.complete(delivery).await,
            Settlement::Abandon => self.0.abandon(delivery, Properties::new()).await,
            Settlement::Release => self.0.release(delivery).await,
            Settlement::DeadLetter(reason) => self.0.dead_letter(delivery, reason).await,
            Settlement::Defer => self.0.defer(delivery).await,
            Settlement::RedeliverLater { delay, properties } => {
                self.0.redeliver_later(delivery, delay, properties).await
            }
        }
    }
}

impl<I, H> Core<I, H> {
    pub(super) async fn settle<S: Settler>(
        &self,
        settler: &S,
        delivery: &S::Delivery,
        verdict: Verdict,
    ) {
        let id = delivery.message().message_id();
        let mut duplicate = false;
        let (how, counter) = match verdict {
            Verdict::LockLost => {
                tracing::Span::current().record("twice.outcome", "lock_lost");
                self.counters.inc(Counter::LockLost);
                tracing::info!(message_id = %id, "lock lost while processing; rolled back");
                return;
            }
            Verdict::Complete(duplicate_of) => {
                if let Some(c) = duplicate_of {
                    duplicate = true;
                    self.counters.inc(c);
                }
                (Settlement::Complete, Counter::Completed)
            }
            Verdict::Abandon => (Settlement::Abandon, Counter::Abandoned),
            Verdict::Release => {
                tracing::info!(
                    message_id = %id,
                    "the inbox failed every attempt before the handler ran; released without \
                     counting a delivery"
                );
                (Settlement::Release, Counter::Released)
            }
            Verdict::Retry => match self.retry.next_redelivery(delivery.message()) {
                Some((delay, properties)) => {
                    (Settlement::RedeliverLater { delay, properties }, Counter::DelayedRedeliveries)
                }
                None => (Settlement::Abandon, Counter::Abandoned),
            },
            Verdict::DeadLetter(reason) => (Settlement::DeadLetter(reason), Counter::DeadLettered),
            Verdict::Defer => (Settlement::Defer, Counter::Deferred),
        };
        let completing = matches!(how, Settlement::Complete);
        let settled = match settler.settle(delivery, how).await {
            Err(TransportError::Unsupported(_))
                if matches!(counter, Counter::DelayedRedeliveries | Counter::Released) =>
            {
                // The transport cannot bring the message back later, or release it: the
                // broker's own redelivery (and MaxDeliveryCount) takes over.
                settler.settle(delivery, Settlement::Abandon).await.map(|()| Counter::Abandoned)
            }
            other => other.map(|()| counter),
        };
        match settled {
            Ok(counter) => {
                tracing::Span::current().record("twice.outcome", outcome(counter, duplicate));
                if counter == Counter::Completed {
                    self.activity.completed(self.clock.now());
                }
                self.counters.inc(counter);
            }
            Err(e) => {
                tracing::Span::current().record("twice.outcome", "settle_failed");
                self.counters.inc(Counter::SettleFailures);
                if completing && e.is_lock_lost() {
                    tracing::warn!(
                        message_id = %id,
                        "completion failed because the lock was lost; the redelivery will meet \
                         the claim and complete as a duplicate"
                    );
                }
                self.report(ProcessError::new(ErrorSource::Settle, Some(id), e));
            }
        }
    }
}

/// The `twice.outcome` recorded on a message's span once it is settled and counted as
/// `counter`.
fn outcome(counter: Counter, duplicate: bool) -> &'static str {
    match counter {
        Counter::Completed if duplicate => "duplicate",
        Counter::Completed => "completed",
        Counter::Abandoned => "abandoned",
        Counter::Released => "released",
        Counter::DeadLettered => "dead_lettered",
        Counter::Deferred => "deferred",
        Counter::DelayedRedeliveries => "redelivered_later",
        _ => "settled",
    }
}
