//! The per-message pipeline: claim, handler, commit, and the verdict on the message.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use futures::FutureExt as _;

use super::lock::LockState;
use super::settle::{Settler, Verdict};
use super::shared::Core;
use super::{HANDLER_FAILED, MISSING_MESSAGE_ID, Mode};
use crate::clock::{Stopwatch, Timestamp};
use crate::counters::{Counter, InFlight};
use crate::error::{ErrorClass, ErrorSource, HandlerError, HandlerErrorKind, ProcessError};
use crate::handler::{Context, Handler};
use crate::inbox::{Claim, Inbox};
use crate::message::ReceivedMessage;
use crate::outbox::{OutboxError, Outgoing, Staged};
use crate::outcome::Outcome;
use crate::retry::random_u64;
use crate::transport::{DeadLetterReason, Delivery};

/// What one attempt came to.
#[derive(Debug)]
pub(super) enum Attempt {
    Done(Verdict),
    /// Not the message's fault, and no handler ran: the transaction did not begin, or the
    /// claim (the processor's own insert) failed. Try again after a backoff; when the retries
    /// are used up the message is released, so that no delivery is spent on it.
    NotStarted,
    /// Not the message's fault, after the handler ran (a deadlock victim, a lost connection, a
    /// commit of unknown outcome): try again after a backoff.
    InfrastructureFailed,
    /// The handler failed in a way a retry may cure.
    HandlerFailed,
}

impl<I, H> Core<I, H>
where
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// Processes one delivery to the end: claim, handler, commit, then settle in line.
    ///
    /// `lock_lost` resolves when the lock protecting the message is lost; `lock` tells whether
    /// it still holds, checked just before the commit.
    pub(crate) async fn process<S: Settler>(
        &self,
        settler: &S,
        delivery: &S::Delivery,
        received_at: Timestamp,
        lock: &LockState,
        lock_lost: impl Future<Output = ()> + Send,
    ) {
        let _in_flight = InFlight::new(&self.counters);
        let mut lock_lost = std::pin::pin!(lock_lost);
        let verdict = self.verdict(delivery.message(), received_at, lock, lock_lost.as_mut()).await;
        self.settle(settler, delivery, verdict).await;
    }

    /// Processes one delivery up to its settlement: claim, handler, commit (or rollback), and
    /// what is to become of the message. The transaction has ended when this returns.
    ///
    /// `lock_lost` resolves when the lock protecting the message is lost; `lock` tells whether
    /// it still holds, checked just before the commit.
    pub(super) async fn verdict(
        &self,
        msg: &ReceivedMessage,
        received_at: Timestamp,
        lock: &LockState,
        lock_lost: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Verdict {
        self.counters.inc(Counter::Received);
        if msg.message.message_id.as_ref().is_none_or(|id| id.as_str().is_empty()) {
            return missing_message_id();
        }
        self.transactional(msg, received_at, lock, lock_lost).await
    }

    /// Claim (or not, in [`Mode::NaturallyIdempotent`]; or record first, in
    /// [`Mode::DedupOnly`]) and run the handler in one transaction; retry the attempt as the
    /// [`RetryPolicy`] says.
    pub(super) async fn transactional(
        &self,
        msg: &ReceivedMessage,
        received_at: Timestamp,
        lock: &LockState,
        mut lock_lost: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Verdict {
        let mut infrastructure_failures = 0;
        let mut handler_failures = 0;
        // Whether a handler ran in any attempt: until one has, the message is not at fault.
        let mut handler_ran = false;
        // Dedup-only: the owner of this processing's record, kept across its retries.
        let owner = (self.mode == Mode::DedupOnly)
            .then(|| format!("{:016x}{:016x}", random_u64(), random_u64()));
        loop {
            let attempt = match &owner {
                Some(owner) => {
                    self.dedup_attempt(msg, received_at, lock, lock_lost.as_mut(), owner).await
                }
                None => self.attempt(msg, received_at, lock, lock_lost.as_mut()).await,
            };
            match attempt {
                Attempt::Done(verdict) => return verdict,
                attempt @ (Attempt::NotStarted | Attempt::InfrastructureFailed) => {
                    handler_ran |= matches!(attempt, Attempt::InfrastructureFailed);
                    infrastructure_failures += 1;
                    if infrastructure_failures > self.retry.get_infrastructure_retries() {
                        // A message no handler has seen goes back without a delivery spent:
                        // the database's trouble must not dead-letter it unrun.
                        return if handler_ran { Verdict::Abandon } else { Verdict::Release };
                    }
                    self.counters.inc(Counter::InfrastructureRetries);
                    // The lock is renewed while the processor waits: the keeper is polled here.
                    let wait = self.retry.backoff_for(infrastructure_failures);
                    tokio::select! {
                        biased;
                        () = &mut lock_lost => return Verdict::LockLost,
                        () = self.clock.sleep(wait) => {}
                    }
                }
                Attempt::HandlerFailed => {
                    handler_ran = true;
                    infrastructure_failures = 0;
                    handler_failures += 1;
                    if handler_failures > self.retry.get_immediate_retries() {
                        return Verdict::Retry;
                    }
                    self.counters.inc(Counter::ImmediateRetries);
                }
            }
        }
    }

    /// One attempt: begin, claim, handler, commit.
    pub(super) async fn attempt(
        &self,
        msg: &ReceivedMessage,
        received_at: Timestamp,
        lock: &LockState,
        mut lock_lost: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Attempt {
        let id = msg.message_id();
        // Beginning may wait (for a pooled connection, or for SQLite's write lock), so it is
        // raced against the lock too.
        let begun = tokio::select! {
            biased;
            () = &mut lock_lost => return Attempt::Done(Verdict::LockLost),
            r = self.inbox.begin_within(self.lock_wait(lock)) => r,
        };
        let mut tx = match begun {
            Ok(tx) => tx,
            Err(e) => {
                // No connection, or none in time: never the message's fault.
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                return Attempt::NotStarted;
            }
        };
        let claim = self.mode == Mode::Claim;
        let outgoing = self.outgoing(msg);
        let raced = tokio::select! {
            biased;
            () = &mut lock_lost => None,
            r = self.claim_and_handle(msg, &mut tx, claim, outgoing.as_ref()) => Some(r),
        };
        let step = match raced {
            Some(step) => step,
            None => {
                // The handler's future is gone; its work is rolled back with the transaction.
                self.rollback(tx, id).await;
                return Attempt::Done(Verdict::LockLost);
            }
        };
        match step {
            Step::ClaimFailed(e) => {
                let attempt = self.claim_failed(&e);
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                self.rollback(tx, id).await;
                attempt
            }
            Step::Duplicate(claimed_at) => {
                self.rollback(tx, id).await;
                Attempt::Done(Verdict::Complete(Some(duplicate_counter(claimed_at, received_at))))
            }
            Step::InProgress => {
                // Only a dedup-only record answers so; wait for its outcome.
                self.rollback(tx, id).await;
                Attempt::NotStarted
            }
            Step::Handled(Ok(Outcome::Complete)) => {
                if !lock.held(self.clock.now()) {
                    self.rollback(tx, id).await;
                    return Attempt::Done(Verdict::LockLost);
                }
                let staged = match self.stage(&mut tx, outgoing.as_ref(), id).await {
                    Ok(staged) => staged,
                    Err(failed) => {
                        self.rollback(tx, id).await;
                        return failed;
                    }
                };
                // A stage that wrote rows checked that the transaction can commit.
                if !staged.wrote()
                    && let Err(failed) = self.check_committable(&mut tx, id).await
                {
                    self.rollback(tx, id).await;
                    return failed;
                }
                match self.inbox.commit(tx).await {
                    Ok(()) => {
                        staged.committed();
                        self.counters.inc(Counter::Committed);
                        if let Some(hook) = &self.hooks.on_committed {
                            hook(msg);
                        }
                        Attempt::Done(Verdict::Complete(None))
                    }
                    Err(e) => self.commit_failed(msg, e),
                }
            }
            Step::Handled(result) => {
                self.rollback(tx, id).await;
                self.attempt_of(msg, result)
            }
            Step::Panicked(what) => {
                self.rollback(tx, id).await;
                self.counters.inc(Counter::HandlerPanics);
                self.report(ProcessError::new(
                    ErrorSource::Handler,
                    Some(id),
                    format!("the handler panicked: {what}"),
                ));
                Attempt::HandlerFailed
            }
        }
    }

    /// What a failed claim (or dedup-only record) makes of the attempt. The claim is the
    /// processor's own insert, so its failure is the infrastructure's whatever the store
    /// calls it: transient (a deadlock, a lost connection), or unknown (a read-only
    /// transaction after a failover, a full disk, a missing table): retried in process
    /// without spending a delivery. Only an error the store calls permanent (a message id the
    /// inbox key cannot hold) is the message's: it is abandoned, and the broker's
    /// MaxDeliveryCount dead-letters it.
    pub(super) fn claim_failed(&self, e: &I::Error) -> Attempt {
        match self.inbox.classify(e) {
            ErrorClass::Permanent => Attempt::Done(Verdict::Abandon),
            _ => Attempt::NotStarted,
        }
    }

    /// How long the message's lock holds from now; `None` without a lock.
    pub(super) fn lock_wait(&self, lock: &LockState) -> Option<Duration> {
        let until = lock.locked_until();
        (until != Timestamp::MAX).then(|| until.duration_since(self.clock.now()))
    }

    pub(super) async fn claim_and_handle(
        &self,
        msg: &ReceivedMessage,
        tx: &mut I::Tx,
        claim: bool,
        outgoing: Option<&Outgoing>,
    ) -> Step<I::Error> {
        if claim {
            let watch = Stopwatch::start();
            let claimed =
                self.inbox.claim(tx, &self.consumer, msg.message_id(), self.clock.now()).await;
            self.counters.record_claim_latency(watch.elapsed());
            match claimed {
                Ok(Claim::Claimed) => {}
                Ok(Claim::Duplicate { claimed_at }) => return Step::Duplicate(claimed_at),
                Ok(Claim::InProgress { .. }) => return Step::InProgress,
                Err(e) => return Step::ClaimFailed(e),
            }
        }
        self.run_handler(msg, tx, outgoing).await
    }

    pub(super) async fn run_handler(
        &self,
        msg: &ReceivedMessage,
        tx: &mut I::Tx,
        outgoing: Option<&Outgoing>,
    ) -> Step<I::Error> {
        let ctx = match outgoing {
            Some(outgoing) => Context::with_outgoing(msg, &self.consumer, outgoing),
            None => Context::new(msg, &self.consumer),
        };
        // A panic must not take the task (and the permit, and the transaction) down with it.
        let watch = Stopwatch::start();
        let caught = AssertUnwindSafe(self.handler.handle(ctx, tx)).catch_unwind().await;
        self.counters.record_handler_duration(watch.elapsed());
        match caught {
            Ok(result) => Step::Handled(result),
            Err(payload) => Step::Panicked(panic_message(payload.as_ref())),
        }
    }

    /// One attempt in dedup-only mode: record the id (committed at once), then run the
    /// handler in a transaction of its own that also marks the record done, and commit.
    /// What a failed commit of the handler's work makes of the attempt. A constraint checked
    /// at COMMIT (deferred) is the handler's work failing, classified as if a statement had
    /// failed; any other failure may have committed anyway and is retried as the
    /// infrastructure's.
    pub(super) fn commit_failed(&self, msg: &ReceivedMessage, e: I::Error) -> Attempt {
        let id = msg.message_id();
        let class = self.inbox.classify(&e);
        self.report(ProcessError::new(ErrorSource::Commit, Some(id), e));
        match class {
            ErrorClass::BusinessKeyDuplicate { constraint } => {
                self.business_key_duplicate(id, &constraint, true);
                Attempt::Done(Verdict::Complete(Some(Counter::DuplicateBusinessKey)))
            }
            ErrorClass::Permanent => {
                self.counters.inc(Counter::HandlerErrors);
                Attempt::Done(Verdict::DeadLetter(DeadLetterReason::new(
                    HANDLER_FAILED,
                    "the commit of the handler's work was refused",
                )))
            }
            _ => Attempt::InfrastructureFailed,
        }
    }

    /// The verdict for a handler result other than `Ok(Complete)`, after the rollback.
    pub(super) fn verdict_of(
        &self,
        msg: &ReceivedMessage,
        result: Result<Outcome, HandlerError>,
    ) -> Verdict {
        let id = msg.message_id();
        match result {
            Ok(Outcome::Complete) => Verdict::Complete(None),
            Ok(Outcome::Abandon) => Verdict::Abandon,
            Ok(Outcome::Defer) => Verdict::Defer,
            Ok(outcome @ Outcome::DeadLetter { .. }) => match outcome.dead_letter_reason() {
                Some(reason) => Verdict::DeadLetter(reason),
                None => Verdict::Abandon,
            },
            Err(error) => {
                if let Some(outbox) = outbox_error(&error) {
                    // A handler that sends what the outbox cannot take fails the same way on
                    // every delivery.
                    self.counters.inc(Counter::HandlerErrors);
                    let reason = DeadLetterReason::new(outbox.dead_letter_reason(), error.chain());
                    self.report(ProcessError::new(
                        ErrorSource::Handler,
                        Some(id),
                        error.into_error(),
                    ));
                    return Verdict::DeadLetter(reason);
                }
                let class = match error.kind() {
                    HandlerErrorKind::Transient => ErrorClass::Transient,
                    HandlerErrorKind::Permanent { .. } => ErrorClass::Permanent,
                    _ => self.inbox.classify(error.error()),
                };
                if let ErrorClass::BusinessKeyDuplicate { constraint } = &class {
                    self.business_key_duplicate(id, constraint, false);
                    return Verdict::Complete(Some(Counter::DuplicateBusinessKey));
                }
                self.counters.inc(Counter::HandlerErrors);
                let description = error.chain();
                let verdict = match (&class, error.kind()) {
                    (_, HandlerErrorKind::Permanent { reason }) => {
                        Verdict::DeadLetter(DeadLetterReason::new(reason.clone(), description))
                    }
                    (ErrorClass::Permanent, _) => {
                        Verdict::DeadLetter(DeadLetterReason::new(HANDLER_FAILED, description))
                    }
                    _ => Verdict::Abandon,
                };
                self.report(ProcessError::new(ErrorSource::Handler, Some(id), error.into_error()));
                verdict
            }
        }
    }

    /// What this attempt's handler sends goes here, when the inbox has an outbox. Each
    /// message carries the trace of the message's processing (with OpenTelemetry), else the
    /// incoming message's own.
    pub(super) fn outgoing(&self, msg: &ReceivedMessage) -> Option<Outgoing> {
        if !self.inbox.has_outbox() {
            return None;
        }
        #[cfg(feature = "opentelemetry")]
        let parent = crate::trace_context::of_span(&tracing::Span::current())
            .or_else(|| crate::trace_context::extract(&msg.message));
        #[cfg(not(feature = "opentelemetry"))]
        let parent = crate::trace_context::extract(&msg.message);
        Some(Outgoing::for_message(&self.consumer, msg.message_id(), parent, self.clock.now()))
    }

    /// Writes what the handler sent into the outbox, in its transaction; returns what was
    /// written (see [`Staged::wrote`]). A failure is the infrastructure's when the store calls it
    /// transient, else the handler's (its retries, then the broker's MaxDeliveryCount).
    pub(super) async fn stage(
        &self,
        tx: &mut I::Tx,
        outgoing: Option<&Outgoing>,
        id: &crate::ids::MessageId,
    ) -> Result<Staged, Attempt> {
        let messages = match outgoing {
            Some(outgoing) if !outgoing.is_empty() => outgoing.take(),
            _ => return Ok(Staged::nothing()),
        };
        match self.inbox.stage(tx, &messages).await {
            Ok(staged) => Ok(staged),
            Err(e) => {
                let transient = self.inbox.classify(&e) == ErrorClass::Transient;
                if !transient {
                    self.counters.inc(Counter::HandlerErrors);
                }
                self.report(ProcessError::new(ErrorSource::Commit, Some(id), e));
                Err(if transient { Attempt::InfrastructureFailed } else { Attempt::HandlerFailed })
            }
        }
    }

    /// The handler said `Complete`; a transaction the database has already aborted or ended
    /// would commit nothing, so that is the handler's failure, not a completion (unless the
    /// check itself failed for the infrastructure, e.g. a lost connection).
    pub(super) async fn check_committable(
        &self,
        tx: &mut I::Tx,
        id: &crate::ids::MessageId,
    ) -> Result<(), Attempt> {
        match self.inbox.check_committable(tx).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let transient = self.inbox.classify(&e) == ErrorClass::Transient;
                if !transient {
                    self.counters.inc(Counter::HandlerErrors);
                }
                self.report(ProcessError::new(ErrorSource::Handler, Some(id), e));
                Err(if transient { Attempt::InfrastructureFailed } else { Attempt::HandlerFailed })
            }
        }
    }

    /// What a handler result other than `Ok(Complete)` makes of the attempt, after the
    /// rollback: an error the store calls transient (a deadlock, a lock wait timeout, a lost
    /// connection) is the infrastructure's; the other retryable errors are the handler's.
    pub(super) fn attempt_of(
        &self,
        msg: &ReceivedMessage,
        result: Result<Outcome, HandlerError>,
    ) -> Attempt {
        if let Err(error) = &result
            && *error.kind() == HandlerErrorKind::Unclassified
            && self.inbox.classify(error.error()) == ErrorClass::Transient
        {
            self.report(ProcessError::new(
                ErrorSource::Handler,
                Some(msg.message_id()),
                error.chain(),
            ));
            return Attempt::InfrastructureFailed;
        }
        let retryable = result.is_err();
        match self.verdict_of(msg, result) {
            Verdict::Abandon if retryable => Attempt::HandlerFailed,
            verdict => Attempt::Done(verdict),
        }
    }

    pub(super) async fn rollback(&self, tx: I::Tx, id: &crate::ids::MessageId) {
        if let Err(e) = self.inbox.rollback(tx).await {
            // The transaction is gone either way: a failed rollback leaves nothing committed.
            self.report(ProcessError::new(ErrorSource::Commit, Some(id), e));
        }
    }
}

/// The verdict on a message without a message id: without one every such message would share
/// one inbox key, and all but the first would be completed unprocessed as its duplicates.
pub(super) fn missing_message_id() -> Verdict {
    Verdict::DeadLetter(DeadLetterReason::new(
        MISSING_MESSAGE_ID,
        "the message has no message id, so twice cannot tell its copies from other messages; \
         senders must set a stable message id (or the transport derive one)",
    ))
}

/// What the transaction phase produced.
pub(super) enum Step<E> {
    ClaimFailed(E),
    Duplicate(Option<Timestamp>),
    InProgress,
    Handled(Result<Outcome, HandlerError>),
    Panicked(String),
}

/// Which kind of duplicate a copy is, from when the winner claimed the id: after this copy
/// arrived, both were in flight together.
pub(super) fn duplicate_counter(claimed_at: Option<Timestamp>, received_at: Timestamp) -> Counter {
    if claimed_at.is_some_and(|at| at >= received_at) {
        Counter::DuplicateConcurrentCopy
    } else {
        Counter::DuplicateAlreadyProcessed
    }
}

/// The outbox error a handler's error is, or is caused by, if any.
fn outbox_error(error: &HandlerError) -> Option<&OutboxError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error.error());
    while let Some(e) = next {
        if let Some(outbox) = e.downcast_ref::<OutboxError>() {
            return Some(outbox);
        }
        next = e.source();
    }
    None
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string payload".to_owned()
    }
}
