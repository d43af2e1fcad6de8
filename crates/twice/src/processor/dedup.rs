//! The dedup-only mode's attempt: the record committed first, then the handler's work.

use super::lock::LockState;
use super::pipeline::{Attempt, Step, duplicate_counter};
use super::settle::Verdict;
use super::shared::Core;
use crate::clock::Timestamp;
use crate::counters::Counter;
use crate::error::{ErrorClass, ErrorSource, ProcessError};
use crate::handler::Handler;
use crate::inbox::{Claim, Inbox};
use crate::message::ReceivedMessage;
use crate::outcome::Outcome;

impl<I, H> Core<I, H>
where
    I: Inbox,
    H: Handler<I::Tx>,
{
    pub(super) async fn dedup_attempt(
        &self,
        msg: &ReceivedMessage,
        received_at: Timestamp,
        lock: &LockState,
        lock_lost: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
        owner: &str,
    ) -> Attempt {
        let id = msg.message_id();
        // Not raced against the lock: a record given up midway may still commit after the
        // attempt has ended, and then stay. A record is one insert and its commit; its waits
        // are bounded by the pool's acquire timeout and the database's lock wait timeout. The
        // lock is checked right after it.
        let recorded = self.inbox.record(&self.consumer, id, owner, self.clock.now()).await;
        match recorded {
            Ok(Claim::Claimed) => {}
            Ok(Claim::Duplicate { claimed_at }) => {
                return Attempt::Done(Verdict::Complete(Some(duplicate_counter(
                    claimed_at,
                    received_at,
                ))));
            }
            Ok(Claim::InProgress { .. }) => {
                tracing::info!(
                    message_id = %id,
                    "another attempt recorded this id and has not finished; waiting for its outcome"
                );
                // Its work may be under way: after the retries the message is abandoned, so a
                // record left by a crash ends in the dead-letter queue, never run twice.
                return Attempt::InfrastructureFailed;
            }
            Err(e) => {
                let attempt = self.claim_failed(&e);
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                return attempt;
            }
        }
        let attempt = self.dedup_work(msg, lock, lock_lost, owner).await;
        if let Some(keep) = attempt.1
            && !keep
        {
            self.forget(id, owner).await;
        }
        attempt.0
    }

    /// The handler's part of a dedup-only attempt, after the record; also says whether the
    /// record is to be removed (`Some(false)`), kept (`Some(true)`: done, or in doubt).
    pub(super) async fn dedup_work(
        &self,
        msg: &ReceivedMessage,
        lock: &LockState,
        mut lock_lost: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
        owner: &str,
    ) -> (Attempt, Option<bool>) {
        const FORGET: Option<bool> = Some(false);
        const KEEP: Option<bool> = Some(true);
        let id = msg.message_id();
        if !lock.held(self.clock.now()) {
            return (Attempt::Done(Verdict::LockLost), FORGET);
        }
        let begun = tokio::select! {
            biased;
            () = &mut lock_lost => return (Attempt::Done(Verdict::LockLost), FORGET),
            r = self.inbox.begin_within(self.lock_wait(lock)) => r,
        };
        let mut tx = match begun {
            Ok(tx) => tx,
            Err(e) => {
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                return (Attempt::NotStarted, FORGET);
            }
        };
        let outgoing = self.outgoing(msg);
        let raced = tokio::select! {
            biased;
            () = &mut lock_lost => None,
            r = self.run_handler(msg, &mut tx, outgoing.as_ref()) => Some(r),
        };
        let Some(step) = raced else {
            // The handler was stopped; its work in the transaction is rolled back.
            self.rollback(tx, id).await;
            return (Attempt::Done(Verdict::LockLost), FORGET);
        };
        match step {
            Step::Handled(Ok(Outcome::Complete)) => {
                if !lock.held(self.clock.now()) {
                    self.rollback(tx, id).await;
                    return (Attempt::Done(Verdict::LockLost), FORGET);
                }
                match self.inbox.finish(&mut tx, &self.consumer, id, owner).await {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        message_id = %id,
                        "the dedup-only record was gone before the work committed (purged, or \
                         removed by hand); the work commits without it"
                    ),
                    Err(e) => {
                        let transient = self.inbox.classify(&e) == ErrorClass::Transient;
                        self.report(ProcessError::new(ErrorSource::Commit, Some(id), e));
                        self.rollback(tx, id).await;
                        let attempt = if transient {
                            Attempt::InfrastructureFailed
                        } else {
                            Attempt::HandlerFailed
                        };
                        return (attempt, FORGET);
                    }
                }
                let staged = match self.stage(&mut tx, outgoing.as_ref(), id).await {
                    Ok(staged) => staged,
                    Err(failed) => {
                        self.rollback(tx, id).await;
                        return (failed, FORGET);
                    }
                };
                // A stage that wrote rows checked that the transaction can commit.
                if !staged.wrote()
                    && let Err(failed) = self.check_committable(&mut tx, id).await
                {
                    self.rollback(tx, id).await;
                    return (failed, FORGET);
                }
                match self.inbox.commit(tx).await {
                    Ok(()) => {
                        staged.committed();
                        self.counters.inc(Counter::Committed);
                        if let Some(hook) = &self.hooks.on_committed {
                            hook(msg);
                        }
                        (Attempt::Done(Verdict::Complete(None)), KEEP)
                    }
                    Err(e) => match self.commit_failed(msg, e) {
                        // In doubt: the record stays, claimed by this owner. The retry's record
                        // finds it done (the commit happened: a duplicate) or still claimed by
                        // this owner (it did not: claimed again).
                        Attempt::InfrastructureFailed => (Attempt::InfrastructureFailed, KEEP),
                        attempt => (attempt, FORGET),
                    },
                }
            }
            Step::Handled(result) => {
                self.rollback(tx, id).await;
                (self.attempt_of(msg, result), FORGET)
            }
            Step::Panicked(what) => {
                self.rollback(tx, id).await;
                self.counters.inc(Counter::HandlerPanics);
                self.report(ProcessError::new(
                    ErrorSource::Handler,
                    Some(id),
                    format!("the handler panicked: {what}"),
                ));
                (Attempt::HandlerFailed, FORGET)
            }
            Step::ClaimFailed(_) | Step::Duplicate(_) | Step::InProgress => {
                // Not produced without a claim.
                self.rollback(tx, id).await;
                (Attempt::Done(Verdict::Abandon), FORGET)
            }
        }
    }

    /// Removes this attempt's dedup-only record; a failure leaves it claimed, which the next
    /// copy meets as in progress.
    pub(super) async fn forget(&self, id: &crate::ids::MessageId, owner: &str) {
        if let Err(e) = self.inbox.forget(&self.consumer, id, owner).await {
            self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
        }
    }
}
