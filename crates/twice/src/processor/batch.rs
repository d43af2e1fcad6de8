//! Batches: up to [`ProcessorOptions::batch_size`](super::ProcessorOptions::batch_size)
//! received messages in one transaction, each handler under a savepoint of its own (see
//! [batches](super#batches)).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::join_all;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tracing::Instrument as _;

use super::lock::{LockState, fixed_limit, keep_lock, keeping_locks, renewal_margin};
use super::pipeline::{Attempt, Step, duplicate_counter, missing_message_id};
use super::settle::{TransportSettler, Verdict};
use super::shared::Core;
use crate::clock::{Stopwatch, Timestamp};
use crate::counters::{Counter, InFlight};
use crate::error::{ErrorSource, ProcessError};
use crate::handler::Handler;
use crate::ids::MessageId;
use crate::inbox::{Claim, Inbox};
use crate::message::ReceivedMessage;
use crate::outbox::{OutgoingMessage, Staged};
use crate::outcome::Outcome;
use crate::transport::{Delivery, Transport};

/// One message of a batch, as the pipeline sees it.
struct Item<'a> {
    msg: &'a ReceivedMessage,
    received_at: Timestamp,
    lock: &'a LockState,
    /// Turns `true` when the lock is lost.
    lost: watch::Receiver<bool>,
    span: tracing::Span,
}

/// Resolves when the lock behind `lost` is lost.
async fn lock_lost(mut lost: watch::Receiver<bool>) {
    if lost.wait_for(|lost| *lost).await.is_err() {
        // The keeper is gone, so nothing will say the lock was lost.
        std::future::pending::<()>().await;
    }
}

/// The transaction of a batch failed as a whole: it was rolled back.
struct BatchFailed;

/// What became of one claimed message's handler in the batch's transaction.
enum Handled {
    /// Its work stays in the transaction; these messages go to the outbox with it.
    Complete(Vec<OutgoingMessage>),
    /// Its work and its claim were rolled back; this is its verdict.
    Settle(Verdict),
}

/// A batch of messages in one task: their processing in one transaction, each raced against
/// the loss of its own lock, then their settlements.
///
/// The call is held until the transaction has ended, as for a message alone; the settlements
/// then go on under one slot of `settlements`, and every lock is kept until its settlement is
/// done.
pub(super) async fn process_batch<T, I, H>(
    core: Arc<Core<I, H>>,
    transport: Arc<T>,
    deliveries: Vec<(T::Delivery, Timestamp)>,
    max_renewal: Duration,
    call: OwnedSemaphorePermit,
    settlements: Arc<Semaphore>,
) where
    T: Transport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    let _in_flight: Vec<InFlight<'_>> =
        deliveries.iter().map(|_| InFlight::new(&core.counters)).collect();
    let margin = renewal_margin(transport.entity().lock_duration);
    let locks: Vec<LockState> =
        deliveries.iter().map(|(d, _)| LockState::new(d.message().locked_until)).collect();
    let (senders, receivers): (Vec<_>, Vec<_>) =
        deliveries.iter().map(|_| watch::channel(false)).unzip();
    let keepers = join_all(deliveries.iter().zip(&locks).zip(senders).map(
        |(((delivery, received_at), lock), lost)| {
            let (core, transport) = (&core, &transport);
            async move {
                let id = delivery.message().message_id();
                let limit = fixed_limit(*received_at + max_renewal);
                keep_lock(core, lock, limit, margin, Some(id), || transport.renew_lock(delivery))
                    .await;
                let _ = lost.send(true);
            }
        },
    ));
    let items: Vec<Item<'_>> = deliveries
        .iter()
        .zip(&locks)
        .zip(receivers)
        .map(|(((delivery, received_at), lock), lost)| Item {
            msg: delivery.message(),
            received_at: *received_at,
            lock,
            lost,
            span: core.span(delivery.message()),
        })
        .collect();
    let work = async {
        let verdicts = core.batch_verdicts(&items).await;
        // As for a message alone: waiting for a settlement slot with the call still held
        // bounds the messages between their commit and their settlement.
        let slot = settlements.acquire().await;
        drop(call);
        let settler = TransportSettler(Arc::clone(&transport));
        let settled =
            deliveries.iter().zip(&items).zip(verdicts).map(|(((d, _), item), v)| {
                core.settle(&settler, d, v).instrument(item.span.clone())
            });
        join_all(settled).await;
        drop(slot);
    };
    // The keepers renew the locks until the settlements are done, as for a message alone.
    keeping_locks(work, keepers.map(|_| ())).await;
}

impl<I, H> Core<I, H>
where
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// The verdict of every message of a batch, in order; every transaction has ended when
    /// this returns.
    async fn batch_verdicts(&self, items: &[Item<'_>]) -> Vec<Verdict> {
        let mut verdicts: Vec<Option<Verdict>> = items.iter().map(|_| None).collect();
        let mut seen = HashSet::new();
        let mut active = Vec::new();
        let mut twins = Vec::new();
        for (i, item) in items.iter().enumerate() {
            self.counters.inc(Counter::Received);
            if item.msg.message.message_id.as_ref().is_none_or(|id| id.as_str().is_empty()) {
                verdicts[i] = Some(missing_message_id());
            } else if seen.insert(item.msg.message_id()) {
                active.push(i);
            } else {
                // A second copy in the same batch waits for its twin's transaction, as a
                // concurrent copy does, by being processed alone after it.
                twins.push(i);
            }
        }
        if !active.is_empty() {
            match self.batch_attempt(items, &active).await {
                Ok(decided) => {
                    for (i, verdict) in decided {
                        verdicts[i] = Some(verdict);
                    }
                }
                Err(BatchFailed) => {
                    self.counters.inc(Counter::BatchesSplit);
                    for &i in &active {
                        verdicts[i] = Some(self.alone(&items[i]).await);
                    }
                }
            }
        }
        for i in twins {
            verdicts[i] = Some(self.alone(&items[i]).await);
        }
        // Every message got a verdict above; abandoning is the safe answer were one missing.
        verdicts.into_iter().map(|v| v.unwrap_or(Verdict::Abandon)).collect()
    }

    /// One message of a batch processed alone, as without batches.
    async fn alone(&self, item: &Item<'_>) -> Verdict {
        let lost = std::pin::pin!(lock_lost(item.lost.clone()));
        self.transactional(item.msg, item.received_at, item.lock, lost)
            .instrument(item.span.clone())
            .await
    }

    /// One transaction for the `active` messages of a batch (distinct ids); the verdicts it
    /// decided, or [`BatchFailed`] when it failed as a whole and nothing of it was kept.
    async fn batch_attempt(
        &self,
        items: &[Item<'_>],
        active: &[usize],
    ) -> Result<Vec<(usize, Verdict)>, BatchFailed> {
        let mut decided = Vec::with_capacity(active.len());
        let now = self.clock.now();
        let mut live = Vec::with_capacity(active.len());
        for &i in active {
            if items[i].lock.held(now) {
                live.push(i);
            } else {
                decided.push((i, Verdict::LockLost));
            }
        }
        if live.is_empty() {
            return Ok(decided);
        }
        let lock_wait = live.iter().filter_map(|&i| self.lock_wait(items[i].lock)).min();
        let mut tx = match self.inbox.begin_within(lock_wait).await {
            Ok(tx) => tx,
            Err(e) => {
                self.report(ProcessError::new(ErrorSource::Claim, None, e));
                return Err(BatchFailed);
            }
        };
        // Sorted, so that two batches claiming some of the same ids take them in one order.
        let mut ids: Vec<MessageId> =
            live.iter().map(|&i| items[i].msg.message_id().clone()).collect();
        ids.sort_unstable();
        let watch = Stopwatch::start();
        let claimed = self.inbox.claim_batch(&mut tx, &self.consumer, &ids, self.clock.now()).await;
        let elapsed = watch.elapsed();
        let claims: HashMap<MessageId, Claim> = match claimed {
            Ok(claims) if claims.len() == ids.len() => ids.into_iter().zip(claims).collect(),
            Ok(claims) => {
                let e = format!("the inbox returned {} claims for {} ids", claims.len(), ids.len());
                return self.batch_failed(tx, e).await;
            }
            Err(e) => return self.batch_failed(tx, e).await,
        };
        let mut outgoing = Vec::new();
        let mut completed = Vec::new();
        for &i in &live {
            let item = &items[i];
            self.counters.record_claim_latency(elapsed);
            match claims.get(item.msg.message_id()) {
                Some(Claim::Claimed) => {}
                Some(Claim::Duplicate { claimed_at }) => {
                    let counter = duplicate_counter(*claimed_at, item.received_at);
                    decided.push((i, Verdict::Complete(Some(counter))));
                    continue;
                }
                // Only a dedup-only record answers `InProgress`; batches claim.
                Some(Claim::InProgress { .. }) | None => {
                    return self.batch_failed(tx, "the inbox did not claim a message").await;
                }
            }
            match self.handle_in_batch(&mut tx, item).await {
                Ok(Handled::Complete(messages)) => {
                    outgoing.extend(messages);
                    completed.push(i);
                }
                Ok(Handled::Settle(verdict)) => decided.push((i, verdict)),
                Err(BatchFailed) => {
                    self.rollback_batch(tx).await;
                    return Err(BatchFailed);
                }
            }
        }
        if completed.is_empty() {
            // Nothing to keep: every claim left was taken back.
            self.rollback_batch(tx).await;
            return Ok(decided);
        }
        let ready = if outgoing.is_empty() {
            self.inbox.check_committable(&mut tx).await.map(|()| Staged::nothing())
        } else {
            self.inbox.stage(&mut tx, &outgoing).await
        };
        let staged = match ready {
            Ok(staged) => staged,
            Err(e) => return self.batch_failed(tx, e).await,
        };
        if let Err(e) = self.inbox.commit(tx).await {
            // Committed or not, the messages alone find out: their claims are there or not.
            self.report(ProcessError::new(ErrorSource::Commit, None, e));
            return Err(BatchFailed);
        }
        staged.committed();
        for i in completed {
            self.counters.inc(Counter::Committed);
            if let Some(hook) = &self.hooks.on_committed {
                hook(items[i].msg);
            }
            decided.push((i, Verdict::Complete(None)));
        }
        Ok(decided)
    }

    /// Runs one claimed message's handler under a savepoint, with its immediate retries.
    async fn handle_in_batch(
        &self,
        tx: &mut I::Tx,
        item: &Item<'_>,
    ) -> Result<Handled, BatchFailed> {
        let id = item.msg.message_id();
        let mut handler_failures = 0;
        loop {
            if !item.lock.held(self.clock.now()) {
                self.unclaim(tx, id).await?;
                return Ok(Handled::Settle(Verdict::LockLost));
            }
            if let Err(e) = self.inbox.savepoint(tx).await {
                self.report(ProcessError::new(ErrorSource::Handler, Some(id), e));
                return Err(BatchFailed);
            }
            let outgoing = self.outgoing(item.msg);
            let raced = tokio::select! {
                biased;
                () = lock_lost(item.lost.clone()) => None,
                step = self.run_handler(item.msg, tx, outgoing.as_ref())
                    .instrument(item.span.clone()) => Some(step),
            };
            match raced {
                None => {
                    // The handler's future is gone; its work goes back to the savepoint.
                    self.rollback_to_savepoint(tx, id).await?;
                    self.unclaim(tx, id).await?;
                    return Ok(Handled::Settle(Verdict::LockLost));
                }
                Some(Step::Handled(Ok(Outcome::Complete))) => {
                    let messages = outgoing.map(|o| o.take()).unwrap_or_default();
                    return Ok(Handled::Complete(messages));
                }
                Some(Step::Handled(result)) => {
                    self.rollback_to_savepoint(tx, id).await?;
                    match self.attempt_of(item.msg, result) {
                        Attempt::Done(verdict) => {
                            self.unclaim(tx, id).await?;
                            return Ok(Handled::Settle(verdict));
                        }
                        Attempt::HandlerFailed => {}
                        // A transient error: the transaction itself may be what failed.
                        Attempt::InfrastructureFailed | Attempt::NotStarted => {
                            return Err(BatchFailed);
                        }
                    }
                }
                Some(Step::Panicked(what)) => {
                    self.rollback_to_savepoint(tx, id).await?;
                    self.counters.inc(Counter::HandlerPanics);
                    self.report(ProcessError::new(
                        ErrorSource::Handler,
                        Some(id),
                        format!("the handler panicked: {what}"),
                    ));
                }
                // The handler alone ran here: no claim was made.
                Some(Step::ClaimFailed(_) | Step::Duplicate(_) | Step::InProgress) => {
                    return Err(BatchFailed);
                }
            }
            handler_failures += 1;
            if handler_failures > self.retry.get_immediate_retries() {
                self.unclaim(tx, id).await?;
                return Ok(Handled::Settle(Verdict::Retry));
            }
            self.counters.inc(Counter::ImmediateRetries);
        }
    }

    async fn rollback_to_savepoint(
        &self,
        tx: &mut I::Tx,
        id: &MessageId,
    ) -> Result<(), BatchFailed> {
        self.inbox.rollback_to_savepoint(tx).await.map_err(|e| {
            self.report(ProcessError::new(ErrorSource::Handler, Some(id), e));
            BatchFailed
        })
    }

    async fn unclaim(&self, tx: &mut I::Tx, id: &MessageId) -> Result<(), BatchFailed> {
        self.inbox.unclaim(tx, &self.consumer, id).await.map_err(|e| {
            self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
            BatchFailed
        })
    }

    async fn batch_failed<T>(
        &self,
        tx: I::Tx,
        error: impl Into<crate::error::BoxError>,
    ) -> Result<T, BatchFailed> {
        self.report(ProcessError::new(ErrorSource::Commit, None, error));
        self.rollback_batch(tx).await;
        Err(BatchFailed)
    }

    async fn rollback_batch(&self, tx: I::Tx) {
        if let Err(e) = self.inbox.rollback(tx).await {
            // The transaction is gone either way: a failed rollback leaves nothing committed.
            self.report(ProcessError::new(ErrorSource::Commit, None, e));
        }
    }
}
