//! The processor: receives messages and runs a handler on each so that its effects happen once.
//!
//! # Per message
//!
//! 0. A message without a message id (or with an empty one) is dead-lettered at once with
//!    reason [`MISSING_MESSAGE_ID`]: it would share one inbox key with every other id-less
//!    message, and all but the first would be completed unprocessed.
//! 1. Begin a transaction on a connection of its own ([`Inbox::begin`]).
//! 2. Claim `(consumer, message id)` as the first statement ([`Inbox::claim`]). A copy whose id
//!    was claimed and committed is a duplicate: roll back and complete. A copy whose id is held
//!    by another, uncommitted transaction waits for it, as the database does: the other commits,
//!    this copy is a duplicate; the other rolls back, this copy does the work.
//! 3. Run the handler with `&mut Tx`, so its work joins the claim's transaction.
//! 4. On [`Outcome::Complete`]: check that the database has not aborted the transaction under
//!    the handler ([`Inbox::check_committable`]), commit, then complete. The message is never
//!    completed before the commit has succeeded. A commit whose outcome is unknown is retried
//!    as an infrastructure failure: the retry's claim finds the commit if it happened, and the
//!    message completes as a duplicate. A completion that fails because the lock was lost is
//!    logged: the redelivery meets the claim.
//! 5. Otherwise roll back, then settle:
//!
//! | handler result                                  | transaction | settlement                 |
//! |-------------------------------------------------|-------------|----------------------------|
//! | `Ok(Complete)`                                  | commit      | complete                   |
//! | `Ok(Complete)`, but the database aborted the transaction | roll back | as a handler error |
//! | error the store calls transient (deadlock, lock wait timeout, serialization failure, lost connection) | roll back | retried in process (see below) |
//! | transient or unclassified error, panic          | roll back   | handler retry policy, then abandon |
//! | `Ok(Abandon)`                                   | roll back   | abandon                    |
//! | violation of a registered business key          | roll back   | complete (duplicate)       |
//! | `Ok(DeadLetter)`, permanent error, bad JSON     | roll back   | dead-letter with reason    |
//! | `Ok(Defer)`                                     | roll back   | defer                      |
//! | lock lost while running                         | roll back   | none (the broker has it)   |
//!
//! The lock is renewed in the background until
//! [`max_auto_lock_renewal_duration`](ProcessorOptions::max_auto_lock_renewal_duration). The
//! transaction and the handler are raced against the loss of the lock: when it is lost (a
//! renewal fails, or the lock runs out) the handler's future is dropped and the transaction
//! rolled back, instead of committing work whose message another receiver may already hold.
//!
//! # Retries
//!
//! See [`RetryPolicy`]. Failures that are not the message's fault (no pooled connection in
//! time, the connection lost, SQLite busy, a lock wait timeout, a deadlock victim, a
//! serialization failure, a commit of unknown outcome) are retried in process, the whole
//! attempt again, after an exponential backoff with jitter, while the lock is renewed: no
//! delivery is counted, so a database blip does not burn a message's MaxDeliveryCount. Handler
//! errors get the configurable policy: immediate retries, then delayed redelivery
//! ([`Transport::redeliver_later`]), then abandon.
//!
//! # The seeds' rules at the edges
//!
//! What twice does where a handler, a database or a sender misbehaves:
//!
//! - *The handler ignores a failed statement and returns `Complete`.* On PostgreSQL the
//!   transaction is aborted and its COMMIT would be a silent rollback; on MariaDB a deadlock
//!   victim's transaction is already rolled back and its COMMIT a no-op. The check before the
//!   commit finds it; the attempt is a handler error and the message is not completed.
//! - *The lock is lost while the processor waits for a connection or begins.* The begin is
//!   given up; the store's begin is cancel safe, so no transaction stays open on a pooled
//!   connection.
//! - *The database is briefly unavailable.* In-process retries with backoff; no delivery is
//!   spent. After [`RetryPolicy::infrastructure_retries`] failures in a row the message is
//!   abandoned.
//! - *Fewer pooled connections than concurrent calls.* Refused at start
//!   ([`Processor::check`]): the surplus calls would only wait for a connection and time out.
//! - *A message without an id.* Dead-lettered with [`MISSING_MESSAGE_ID`]; never merged with
//!   another. Transports that can derive a stable id document it and set it.
//! - *Two copies at once.* The second claim waits for the first transaction; first commits →
//!   second completes as a duplicate; first rolls back → second does the work.
//! - *A crash between commit and complete.* The redelivery meets the claim and completes.
//! - *The session's isolation level is REPEATABLE READ or SERIALIZABLE.* The PostgreSQL store
//!   begins every inbox transaction at READ COMMITTED, so a copy that waited on a committed
//!   claim completes as a duplicate instead of failing with a serialization failure.
//! - *The lock runs out while the claim waits on another copy's claim.* The transaction is
//!   begun with [`Inbox::begin_within`] and the time left on the lock; the store bounds its lock
//!   waits by it (PostgreSQL `lock_timeout`, MariaDB `innodb_lock_wait_timeout`), so the copy
//!   rolls back and frees its connection and its concurrent call when the lock runs out,
//!   instead of holding them until the other copy ends.
//! - *A registered business key is a deferred constraint.* Its violation surfaces at COMMIT;
//!   the commit's error is classified like a handler's, and the message completes as a
//!   duplicate by business key.
//! - *Consumers share an inbox table with different retention.* Each row is purged by its own
//!   consumer's retention, against the database's clock; choose a retention of at least
//!   [`redelivery_horizon`] (time to live, duplicate-detection window, lock × deliveries).
//!
//! # Modes
//!
//! [`Mode::Claim`] (the default) does the above. [`Mode::NaturallyIdempotent`] skips the claim,
//! for handlers whose work is an upsert that can run twice with the effect of once (seed
//! strategy 1). [`Mode::DedupOnly`] records the id in a transaction of its own, commits it, and
//! only then runs the handler (seed strategy 2), for work that cannot join a transaction.
//!
//! ## Dedup-only records, interleaving by interleaving
//!
//! A record is *claimed* by an owner (a token unique to one processing of one delivery, kept
//! across its in-process retries) or *done*. It is marked done inside the handler's
//! transaction ([`Inbox::finish`]), so the mark commits with the handler's database work or not
//! at all, and it is removed only by its owner and only while claimed ([`Inbox::forget`]).
//!
//! - *Two copies at once.* The second meets the first one's claimed record
//!   ([`Claim::InProgress`]) and waits for its outcome in process, with the infrastructure
//!   backoff and no delivery spent: done → the second completes as a duplicate; removed → the
//!   second records the id and does the work. A copy never completes on a record in progress.
//!   After [`RetryPolicy::infrastructure_retries`] waits it is abandoned and comes back.
//!   (SQLite: the second copy's record already waits for the first copy's write lock.)
//! - *The lock is lost while the record commits.* The record is not raced against the lock,
//!   so it ends one way or the other; then the lock is checked, and a lost one removes the
//!   record. The redelivery does the work.
//! - *The handler fails, panics, or returns anything but `Complete`; the lock is lost while it
//!   runs (the handler is stopped).* The transaction rolls back and the owner's record is
//!   removed: the redelivery runs the handler again. For the handler's work outside the
//!   database this is **at least once**: a handler stopped at an await after a call it cannot
//!   take back is run again.
//! - *The commit of the handler's work has an unknown outcome.* The record stays claimed by
//!   the same owner, and the attempt is retried in process: its record finds the mark (the
//!   commit happened: a duplicate) or its own claim (it did not: the work runs again).
//! - *A crash after the record and before the commit* (or retries used up after an unknown
//!   commit). The record stays claimed by an owner that is gone: every redelivery finds it in
//!   progress, waits, and is abandoned, until the broker dead-letters the message at
//!   MaxDeliveryCount. **At most once**: the work is never run twice, and the message is never
//!   completed without it; an operator decides from the dead-letter queue (and removes the
//!   record to have it processed again).
//!
//! The record's id shares the inbox key with claims: one consumer must not run both modes.
//!
//! # Counters and errors
//!
//! [`Processor::counters`] is live while the processor runs. Errors that do not stop the
//! processor (receive, claim, handler, commit, settle, renewal) go to the callback set with
//! [`Processor::on_error`] (by default they are logged with `tracing`).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use futures::FutureExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::clock::{SharedClock, Stopwatch, Timestamp};
use crate::counters::{Counter, Counters};
use crate::error::{
    ErrorClass, ErrorSource, HandlerError, HandlerErrorKind, ProcessError, ProcessorError,
    format_duration,
};
use crate::handler::{Context, Handler};
use crate::ids::MessageId;
use crate::inbox::{Claim, Inbox};
use crate::message::{Properties, ReceivedMessage};
use crate::outcome::Outcome;
use crate::retry::{RetryPolicy, random_u64};
use crate::transport::{DeadLetterReason, Delivery, EntityInfo, Transport, TransportError};

/// How the processor protects a handler's work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Claim the message id in the handler's transaction (exactly-once effects for work in the
    /// database).
    #[default]
    Claim,
    /// No claim: the handler's work is naturally idempotent (an upsert keyed on the business
    /// identity), so running it twice has the effect of running it once. The handler still runs
    /// in a transaction that is committed before the message is completed.
    NaturallyIdempotent,
    /// Record the id in a transaction of its own and commit it before the handler runs, for
    /// work that cannot join a transaction. A copy that meets a record still in progress waits
    /// for its outcome; a failed attempt removes its own record. A crash after the record
    /// leaves it in progress, and the message ends in the dead-letter queue, never run twice
    /// and never completed without its work. See the [module docs](self) for each interleaving.
    DedupOnly,
}

/// The dead-letter reason used for a permanent error that names no reason of its own.
pub const HANDLER_FAILED: &str = "HandlerFailed";

/// The dead-letter reason of a message that arrived without a message id (or with an empty
/// one): it is never processed, because it cannot be told apart from other id-less messages.
pub const MISSING_MESSAGE_ID: &str = "MissingMessageId";

/// Options of a [`Processor`], with Service Bus names and defaults.
#[derive(Clone, Debug)]
pub struct ProcessorOptions {
    consumer: Option<String>,
    max_concurrent_calls: usize,
    prefetch_count: usize,
    max_auto_lock_renewal_duration: Duration,
    max_wait: Duration,
    mode: Mode,
    retry: RetryPolicy,
    clock: SharedClock,
}

impl Default for ProcessorOptions {
    fn default() -> Self {
        Self {
            consumer: None,
            max_concurrent_calls: 1,
            prefetch_count: 0,
            max_auto_lock_renewal_duration: Duration::from_secs(300),
            max_wait: Duration::from_secs(60),
            mode: Mode::Claim,
            retry: RetryPolicy::default(),
            clock: SharedClock::system(),
        }
    }
}

impl ProcessorOptions {
    /// The defaults: consumer = entity path, MaxConcurrentCalls 1, PrefetchCount 0, lock renewal
    /// for up to 5 minutes, [`Mode::Claim`], the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// The consumer name, the scope of the inbox key (default: the entity path, which differs
    /// between the subscriptions of a topic, which share message ids).
    #[must_use]
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = Some(consumer.into());
        self
    }

    /// The consumer name set, if any.
    pub fn get_consumer(&self) -> Option<&str> {
        self.consumer.as_deref()
    }

    /// How many messages are handled at once (default 1; at least 1).
    #[must_use]
    pub fn max_concurrent_calls(mut self, n: usize) -> Self {
        self.max_concurrent_calls = n.max(1);
        self
    }

    /// How many messages are handled at once.
    pub fn get_max_concurrent_calls(&self) -> usize {
        self.max_concurrent_calls
    }

    /// How many messages to receive ahead of the handlers (default 0). Prefetched messages are
    /// locked; their locks are not renewed until a handler takes them, and those still waiting
    /// at shutdown are released.
    #[must_use]
    pub fn prefetch_count(mut self, n: usize) -> Self {
        self.prefetch_count = n;
        self
    }

    /// How many messages to receive ahead of the handlers.
    pub fn get_prefetch_count(&self) -> usize {
        self.prefetch_count
    }

    /// How long after receipt the lock of a message is renewed (default 5 minutes; zero turns
    /// renewal off).
    #[must_use]
    pub fn max_auto_lock_renewal_duration(mut self, d: Duration) -> Self {
        self.max_auto_lock_renewal_duration = d;
        self
    }

    /// How long after receipt the lock of a message is renewed.
    pub fn get_max_auto_lock_renewal_duration(&self) -> Duration {
        self.max_auto_lock_renewal_duration
    }

    /// How long one receive call waits for messages before asking again (default 60 s).
    #[must_use]
    pub fn max_wait(mut self, d: Duration) -> Self {
        self.max_wait = d;
        self
    }

    /// How long one receive call waits.
    pub fn get_max_wait(&self) -> Duration {
        self.max_wait
    }

    /// How the handler's work is protected (default [`Mode::Claim`]).
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// How the handler's work is protected.
    pub fn get_mode(&self) -> Mode {
        self.mode
    }

    /// How failed attempts are retried (default [`RetryPolicy::new`]).
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How failed attempts are retried.
    pub fn get_retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The clock for lock expiry and renewal and for claim times (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The clock.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// The longest time after which `entity` may still deliver a message again, by the rule
/// `max(message time to live, duplicate-detection window, MaxDeliveryCount × LockDuration +
/// MaxAutoLockRenewalDuration)`; `None` when deliveries are unlimited (forever).
///
/// Choose the inbox retention at least this long. A message abandoned into a backlog comes
/// back when its turn comes, up to its time to live; when the transport does not report a
/// finite time to live ([`EntityInfo::message_time_to_live`]) the horizon is a floor, not a
/// bound, and the retention should also cover the longest backlog the entity may hold.
pub fn redelivery_horizon(
    entity: &EntityInfo,
    max_auto_lock_renewal: Duration,
) -> Option<Duration> {
    let deliveries = entity.max_delivery_count?;
    let redelivery =
        entity.lock_duration.saturating_mul(deliveries).saturating_add(max_auto_lock_renewal);
    Some(
        redelivery
            .max(entity.duplicate_detection_window.unwrap_or_default())
            .max(entity.message_time_to_live.unwrap_or_default()),
    )
}

/// Refuses a retention shorter than the redelivery horizon, with the numbers in the error.
pub(crate) fn check_retention(
    entity: &EntityInfo,
    retention: Option<Duration>,
    max_auto_lock_renewal: Duration,
) -> Result<(), ProcessorError> {
    let Some(retention) = retention else { return Ok(()) };
    let explain = || {
        let mut s = match entity.max_delivery_count {
            Some(n) => format!(
                "MaxDeliveryCount {n} × LockDuration {} + MaxAutoLockRenewalDuration {}",
                format_duration(entity.lock_duration),
                format_duration(max_auto_lock_renewal)
            ),
            None => "MaxDeliveryCount is unlimited".to_owned(),
        };
        if let Some(w) = entity.duplicate_detection_window {
            s.push_str(&format!("; duplicate-detection window {}", format_duration(w)));
        }
        if let Some(ttl) = entity.message_time_to_live {
            s.push_str(&format!("; message time to live {}", format_duration(ttl)));
        }
        s
    };
    match redelivery_horizon(entity, max_auto_lock_renewal) {
        Some(horizon) if retention >= horizon => Ok(()),
        horizon => Err(ProcessorError::RetentionTooShort {
            entity: entity.path.clone(),
            retention: format_duration(retention),
            horizon: horizon.map_or_else(|| "forever".to_owned(), format_duration),
            explanation: explain(),
        }),
    }
}

/// Refuses a store with fewer connections than messages processed at once.
pub(crate) fn check_connections<I: Inbox>(
    inbox: &I,
    concurrent: usize,
    option: &str,
) -> Result<(), ProcessorError> {
    match inbox.max_connections() {
        Some(n) if usize::try_from(n).unwrap_or(usize::MAX) < concurrent => {
            Err(ProcessorError::InvalidOptions(format!(
                "the inbox pool has {n} connections, fewer than {option} {concurrent}: every \
                 message in flight holds a connection for its transaction; give the pool at \
                 least {concurrent}"
            )))
        }
        _ => Ok(()),
    }
}

type ErrorCallback = Arc<dyn Fn(&ProcessError) + Send + Sync>;
type CommitHook = Arc<dyn Fn(&ReceivedMessage) + Send + Sync>;
pub(crate) type BusinessKeyHook = Arc<dyn Fn(&BusinessKeyDuplicate) + Send + Sync>;

/// A message completed as a duplicate because its work broke a unique business key: what
/// [`Processor::on_business_key_duplicate`] reports. Each one is also logged at warn level.
///
/// Count them: a handler bug that writes a constant key makes every later message such a
/// duplicate, silently completed without its work.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BusinessKeyDuplicate {
    /// The message completed without its work.
    pub message_id: MessageId,
    /// The unique constraint (or index) that refused the work, as the inbox classified it.
    pub constraint: String,
    /// Whether the constraint fired at COMMIT (a deferred constraint) rather than at a
    /// statement.
    pub at_commit: bool,
}

/// What every message's processing shares, whatever the transport.
pub(crate) struct Core<I, H> {
    pub(crate) inbox: Arc<I>,
    pub(crate) handler: Arc<H>,
    pub(crate) consumer: String,
    pub(crate) mode: Mode,
    pub(crate) retry: RetryPolicy,
    pub(crate) clock: SharedClock,
    pub(crate) counters: Arc<Counters>,
    pub(crate) on_error: Option<ErrorCallback>,
    pub(crate) on_committed: Option<CommitHook>,
    pub(crate) on_business_key: Option<BusinessKeyHook>,
}

impl<I, H> Core<I, H> {
    pub(crate) fn report(&self, error: ProcessError) {
        match &self.on_error {
            Some(f) => f(&error),
            None => tracing::warn!(consumer = %self.consumer, "{error}"),
        }
    }

    /// Logs a completion by business key at warn level and tells the hook.
    fn business_key_duplicate(&self, id: &MessageId, constraint: &str, at_commit: bool) {
        tracing::warn!(
            consumer = %self.consumer,
            message_id = %id,
            %constraint,
            at_commit,
            "completed as a duplicate by business key, without its work"
        );
        if let Some(f) = &self.on_business_key {
            f(&BusinessKeyDuplicate {
                message_id: id.clone(),
                constraint: constraint.to_owned(),
                at_commit,
            });
        }
    }
}

/// How a message is settled.
#[derive(Debug)]
pub(crate) enum Settlement {
    Complete,
    Abandon,
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
            Settlement::DeadLetter(reason) => self.0.dead_letter(delivery, reason).await,
            Settlement::Defer => self.0.defer(delivery).await,
            Settlement::RedeliverLater { delay, properties } => {
                self.0.redeliver_later(delivery, delay, properties).await
            }
        }
    }
}

/// What became of the handler's work.
#[derive(Debug)]
enum Verdict {
    /// Complete; the counter says why (work done, or which kind of duplicate).
    Complete(Option<Counter>),
    Abandon,
    /// The handler failed and its immediate retries are used up: redeliver later if the
    /// policy says so, else abandon.
    Retry,
    DeadLetter(DeadLetterReason),
    Defer,
    /// The lock was lost: nothing to settle.
    LockLost,
}

/// What one attempt came to.
#[derive(Debug)]
enum Attempt {
    Done(Verdict),
    /// Not the message's fault: try again after a backoff.
    InfrastructureFailed,
    /// The handler failed in a way a retry may cure.
    HandlerFailed,
}

/// The state of the lock that protects the message being processed.
pub(crate) struct LockState {
    /// Until when the lock holds, in ms since the epoch; `i64::MAX` when there is no lock.
    locked_until: AtomicI64,
}

impl LockState {
    pub(crate) fn new(locked_until: Option<Timestamp>) -> Self {
        Self { locked_until: AtomicI64::new(locked_until.unwrap_or(Timestamp::MAX).as_millis()) }
    }

    pub(crate) fn locked_until(&self) -> Timestamp {
        Timestamp::from_millis(self.locked_until.load(Ordering::SeqCst))
    }

    pub(crate) fn set(&self, until: Timestamp) {
        self.locked_until.store(until.as_millis(), Ordering::SeqCst);
    }

    pub(crate) fn set_lost(&self) {
        self.locked_until.store(i64::MIN, Ordering::SeqCst);
    }

    pub(crate) fn held(&self, now: Timestamp) -> bool {
        self.locked_until() > now
    }
}

/// How long before the lock runs out to renew it: 10 s, or half the lock for short locks.
pub(crate) fn renewal_margin(lock_duration: Duration) -> Duration {
    (lock_duration / 2).min(Duration::from_secs(10))
}

impl<I, H> Core<I, H>
where
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// Processes one delivery to the end: claim, handler, commit, settle.
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
        self.counters.inc(Counter::Received);
        let msg = delivery.message();
        if msg.message.message_id.as_ref().is_none_or(|id| id.as_str().is_empty()) {
            // Without an id every such message would share one inbox key, and all but the
            // first would be completed unprocessed as its duplicates.
            let reason = DeadLetterReason::new(
                MISSING_MESSAGE_ID,
                "the message has no message id, so twice cannot tell its copies from other \
                 messages; senders must set a stable message id (or the transport derive one)",
            );
            self.settle(settler, delivery, Verdict::DeadLetter(reason)).await;
            return;
        }
        let verdict = {
            let mut lock_lost = std::pin::pin!(lock_lost);
            self.transactional(msg, received_at, lock, lock_lost.as_mut()).await
        };
        self.settle(settler, delivery, verdict).await;
    }

    /// Claim (or not, in [`Mode::NaturallyIdempotent`]; or record first, in
    /// [`Mode::DedupOnly`]) and run the handler in one transaction; retry the attempt as the
    /// [`RetryPolicy`] says.
    async fn transactional(
        &self,
        msg: &ReceivedMessage,
        received_at: Timestamp,
        lock: &LockState,
        mut lock_lost: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Verdict {
        let mut infrastructure_failures = 0;
        let mut handler_failures = 0;
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
                Attempt::InfrastructureFailed => {
                    infrastructure_failures += 1;
                    if infrastructure_failures > self.retry.get_infrastructure_retries() {
                        return Verdict::Abandon;
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
    async fn attempt(
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
                return Attempt::InfrastructureFailed;
            }
        };
        let claim = self.mode == Mode::Claim;
        let raced = tokio::select! {
            biased;
            () = &mut lock_lost => None,
            r = self.claim_and_handle(msg, &mut tx, claim) => Some(r),
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
                let transient = self.inbox.classify(&e) == ErrorClass::Transient;
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                self.rollback(tx, id).await;
                if transient {
                    Attempt::InfrastructureFailed
                } else {
                    Attempt::Done(Verdict::Abandon)
                }
            }
            Step::Duplicate(claimed_at) => {
                self.rollback(tx, id).await;
                Attempt::Done(Verdict::Complete(Some(duplicate_counter(claimed_at, received_at))))
            }
            Step::InProgress => {
                // Only a dedup-only record answers so; wait for its outcome.
                self.rollback(tx, id).await;
                Attempt::InfrastructureFailed
            }
            Step::Handled(Ok(Outcome::Complete)) => {
                if !lock.held(self.clock.now()) {
                    self.rollback(tx, id).await;
                    return Attempt::Done(Verdict::LockLost);
                }
                if let Err(failed) = self.check_committable(&mut tx, id).await {
                    self.rollback(tx, id).await;
                    return failed;
                }
                match self.inbox.commit(tx).await {
                    Ok(()) => {
                        self.counters.inc(Counter::Committed);
                        if let Some(hook) = &self.on_committed {
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

    /// How long the message's lock holds from now; `None` without a lock.
    fn lock_wait(&self, lock: &LockState) -> Option<Duration> {
        let until = lock.locked_until();
        (until != Timestamp::MAX).then(|| until.duration_since(self.clock.now()))
    }

    async fn claim_and_handle(
        &self,
        msg: &ReceivedMessage,
        tx: &mut I::Tx,
        claim: bool,
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
        self.run_handler(msg, tx).await
    }

    async fn run_handler(&self, msg: &ReceivedMessage, tx: &mut I::Tx) -> Step<I::Error> {
        let ctx = Context::new(msg, &self.consumer);
        // A panic must not take the task (and the permit, and the transaction) down with it.
        match AssertUnwindSafe(self.handler.handle(ctx, tx)).catch_unwind().await {
            Ok(result) => Step::Handled(result),
            Err(payload) => Step::Panicked(panic_message(payload.as_ref())),
        }
    }

    /// One attempt in dedup-only mode: record the id (committed at once), then run the
    /// handler in a transaction of its own that also marks the record done, and commit.
    async fn dedup_attempt(
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
                return Attempt::InfrastructureFailed;
            }
            Err(e) => {
                let transient = self.inbox.classify(&e) == ErrorClass::Transient;
                self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
                return if transient {
                    Attempt::InfrastructureFailed
                } else {
                    Attempt::Done(Verdict::Abandon)
                };
            }
        }
        let attempt = self.dedup_work(msg, lock, lock_lost, owner).await;
        if let Some(keep) = attempt.1 {
            if !keep {
                self.forget(id, owner).await;
            }
        }
        attempt.0
    }

    /// The handler's part of a dedup-only attempt, after the record; also says whether the
    /// record is to be removed (`Some(false)`), kept (`Some(true)`: done, or in doubt).
    async fn dedup_work(
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
                return (Attempt::InfrastructureFailed, FORGET);
            }
        };
        let raced = tokio::select! {
            biased;
            () = &mut lock_lost => None,
            r = self.run_handler(msg, &mut tx) => Some(r),
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
                if let Err(failed) = self.check_committable(&mut tx, id).await {
                    self.rollback(tx, id).await;
                    return (failed, FORGET);
                }
                match self.inbox.commit(tx).await {
                    Ok(()) => {
                        self.counters.inc(Counter::Committed);
                        if let Some(hook) = &self.on_committed {
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
    async fn forget(&self, id: &crate::ids::MessageId, owner: &str) {
        if let Err(e) = self.inbox.forget(&self.consumer, id, owner).await {
            self.report(ProcessError::new(ErrorSource::Claim, Some(id), e));
        }
    }

    /// What a failed commit of the handler's work makes of the attempt. A constraint checked
    /// at COMMIT (deferred) is the handler's work failing, classified as if a statement had
    /// failed; any other failure may have committed anyway and is retried as the
    /// infrastructure's.
    fn commit_failed(&self, msg: &ReceivedMessage, e: I::Error) -> Attempt {
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
    fn verdict_of(&self, msg: &ReceivedMessage, result: Result<Outcome, HandlerError>) -> Verdict {
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

    /// The handler said `Complete`; a transaction the database has already aborted or ended
    /// would commit nothing, so that is the handler's failure, not a completion (unless the
    /// check itself failed for the infrastructure, e.g. a lost connection).
    async fn check_committable(
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
    fn attempt_of(&self, msg: &ReceivedMessage, result: Result<Outcome, HandlerError>) -> Attempt {
        if let Err(error) = &result {
            if *error.kind() == HandlerErrorKind::Unclassified
                && self.inbox.classify(error.error()) == ErrorClass::Transient
            {
                self.report(ProcessError::new(
                    ErrorSource::Handler,
                    Some(msg.message_id()),
                    error.chain(),
                ));
                return Attempt::InfrastructureFailed;
            }
        }
        let retryable = result.is_err();
        match self.verdict_of(msg, result) {
            Verdict::Abandon if retryable => Attempt::HandlerFailed,
            verdict => Attempt::Done(verdict),
        }
    }

    async fn rollback(&self, tx: I::Tx, id: &crate::ids::MessageId) {
        if let Err(e) = self.inbox.rollback(tx).await {
            // The transaction is gone either way: a failed rollback leaves nothing committed.
            self.report(ProcessError::new(ErrorSource::Commit, Some(id), e));
        }
    }

    async fn settle<S: Settler>(&self, settler: &S, delivery: &S::Delivery, verdict: Verdict) {
        let id = delivery.message().message_id();
        let (how, counter) = match verdict {
            Verdict::LockLost => {
                self.counters.inc(Counter::LockLost);
                tracing::info!(message_id = %id, "lock lost while processing; rolled back");
                return;
            }
            Verdict::Complete(duplicate) => {
                if let Some(c) = duplicate {
                    self.counters.inc(c);
                }
                (Settlement::Complete, Counter::Completed)
            }
            Verdict::Abandon => (Settlement::Abandon, Counter::Abandoned),
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
            Err(TransportError::Unsupported(_)) if counter == Counter::DelayedRedeliveries => {
                // The transport cannot bring the message back later: the broker's own
                // redelivery (and MaxDeliveryCount) takes over.
                settler.settle(delivery, Settlement::Abandon).await.map(|()| Counter::Abandoned)
            }
            other => other.map(|()| counter),
        };
        match settled {
            Ok(counter) => self.counters.inc(counter),
            Err(e) => {
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

/// What the transaction phase produced.
enum Step<E> {
    ClaimFailed(E),
    Duplicate(Option<Timestamp>),
    InProgress,
    Handled(Result<Outcome, HandlerError>),
    Panicked(String),
}

/// Which kind of duplicate a copy is, from when the winner claimed the id: after this copy
/// arrived, both were in flight together.
fn duplicate_counter(claimed_at: Option<Timestamp>, received_at: Timestamp) -> Counter {
    if claimed_at.is_some_and(|at| at >= received_at) {
        Counter::DuplicateConcurrentCopy
    } else {
        Counter::DuplicateAlreadyProcessed
    }
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

/// Receives messages from a [`Transport`] and runs a [`Handler`] on each, in the inbox
/// transaction of an [`Inbox`]; see the [module docs](self).
pub struct Processor<T: Transport, I: Inbox, H> {
    transport: Arc<T>,
    inbox: Arc<I>,
    handler: Arc<H>,
    options: ProcessorOptions,
    counters: Arc<Counters>,
    on_error: Option<ErrorCallback>,
    on_committed: Option<CommitHook>,
    on_business_key: Option<BusinessKeyHook>,
}

impl<T: Transport, I: Inbox, H> fmt::Debug for Processor<T, I, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Processor")
            .field("transport", &self.transport)
            .field("inbox", &self.inbox)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<T, I, H> Processor<T, I, H>
where
    T: Transport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// A processor of `transport`'s messages with `handler`, claiming in `inbox`.
    pub fn new(transport: T, inbox: I, handler: H, options: ProcessorOptions) -> Self {
        Self::from_arcs(Arc::new(transport), Arc::new(inbox), Arc::new(handler), options)
    }

    /// As [`Processor::new`], sharing a transport, inbox or handler with other processors.
    pub fn from_arcs(
        transport: Arc<T>,
        inbox: Arc<I>,
        handler: Arc<H>,
        options: ProcessorOptions,
    ) -> Self {
        Self {
            transport,
            inbox,
            handler,
            options,
            counters: Arc::default(),
            on_error: None,
            on_committed: None,
            on_business_key: None,
        }
    }

    /// Calls `f` with every error that does not stop the processor (receive, claim, handler,
    /// commit, settle, lock renewal), with its source. Without it errors are logged.
    #[must_use]
    pub fn on_error(mut self, f: impl Fn(&ProcessError) + Send + Sync + 'static) -> Self {
        self.on_error = Some(Arc::new(f));
        self
    }

    /// Calls `f` after a message's transaction has committed and before the message is
    /// completed: the window in which a crash leaves committed work and an unsettled message.
    /// For fault injection (the demo, tests) and tracing.
    #[must_use]
    pub fn on_committed(mut self, f: impl Fn(&ReceivedMessage) + Send + Sync + 'static) -> Self {
        self.on_committed = Some(Arc::new(f));
        self
    }

    /// Calls `f` for every message completed as a duplicate by business key (besides the
    /// warn-level log line each gets), so the application can count them and alert.
    #[must_use]
    pub fn on_business_key_duplicate(
        mut self,
        f: impl Fn(&BusinessKeyDuplicate) + Send + Sync + 'static,
    ) -> Self {
        self.on_business_key = Some(Arc::new(f));
        self
    }

    /// The processor's counters, live while it runs.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// The consumer name the inbox keys are scoped to.
    pub fn consumer(&self) -> &str {
        self.options.consumer.as_deref().unwrap_or(&self.transport.entity().path)
    }

    /// Checks the options against the entity and the inbox: the inbox retention must cover
    /// the redelivery horizon ([`redelivery_horizon`]), and the inbox must have a connection
    /// for every concurrent call (a message in flight holds one for its whole transaction, so
    /// with fewer the surplus calls only wait for a connection, and time out).
    ///
    /// # Errors
    ///
    /// [`ProcessorError::RetentionTooShort`] or [`ProcessorError::InvalidOptions`], naming
    /// the numbers.
    pub fn check(&self) -> Result<(), ProcessorError> {
        check_connections(
            self.inbox.as_ref(),
            self.options.max_concurrent_calls,
            "MaxConcurrentCalls",
        )?;
        if self.options.mode == Mode::NaturallyIdempotent {
            return Ok(());
        }
        check_retention(
            self.transport.entity(),
            self.inbox.retention(),
            self.options.max_auto_lock_renewal_duration,
        )
    }

    /// Runs until `shutdown` resolves: receives messages and processes up to
    /// MaxConcurrentCalls of them at once, each in a task that owns a semaphore permit. On
    /// shutdown it stops receiving, releases prefetched messages no handler has taken, and
    /// waits for the messages in flight to finish (or roll back when their lock is lost).
    ///
    /// # Errors
    ///
    /// Refuses to start when [`Processor::check`] fails; stops with
    /// [`ProcessorError::Transport`] when the transport closes.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ProcessorError> {
        self.check()?;
        let options = self.options.clone();
        let core = Arc::new(Core {
            inbox: self.inbox.clone(),
            handler: self.handler.clone(),
            consumer: self.consumer().to_owned(),
            mode: options.mode,
            retry: options.retry.clone(),
            clock: options.clock.clone(),
            counters: self.counters.clone(),
            on_error: self.on_error.clone(),
            on_committed: self.on_committed.clone(),
            on_business_key: self.on_business_key.clone(),
        });
        let transport = self.transport;
        let clock = options.clock.clone();
        let semaphore = Arc::new(Semaphore::new(options.max_concurrent_calls));
        let mut tasks = JoinSet::new();
        let mut buffer: VecDeque<(T::Delivery, Timestamp)> = VecDeque::new();
        let mut shutdown = std::pin::pin!(shutdown);

        let result = loop {
            while let Some(joined) = tasks.try_join_next() {
                report_join(&core, joined);
            }
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                p = Arc::clone(&semaphore).acquire_owned() => match p {
                    Ok(p) => p,
                    // The semaphore is never closed; stop rather than spin if it were.
                    Err(_) => break Ok(()),
                },
            };
            if buffer.is_empty() {
                let want = (semaphore.available_permits() + 1).max(options.prefetch_count);
                let received = tokio::select! {
                    biased;
                    () = &mut shutdown => break Ok(()),
                    r = transport.receive(want, options.max_wait) => r,
                };
                match received {
                    Ok(deliveries) => {
                        let now = clock.now();
                        buffer.extend(deliveries.into_iter().map(|d| (d, now)));
                    }
                    Err(TransportError::Closed) => {
                        break Err(ProcessorError::Transport(TransportError::Closed));
                    }
                    Err(e) => {
                        core.report(ProcessError::new(ErrorSource::Receive, None, e));
                        // Back off a little so a broken connection does not spin the loop.
                        tokio::select! {
                            biased;
                            () = &mut shutdown => break Ok(()),
                            () = clock.sleep(Duration::from_secs(1)) => {}
                        }
                    }
                }
            }
            let Some((delivery, received_at)) = buffer.pop_front() else { continue };
            if delivery.message().locked_until.is_some_and(|until| until <= clock.now()) {
                // Its lock ran out while it waited in the prefetch buffer: the broker delivers
                // it again, so it must not be processed here.
                continue;
            }
            tasks.spawn(process_one(
                Arc::clone(&core),
                Arc::clone(&transport),
                delivery,
                received_at,
                options.max_auto_lock_renewal_duration,
                permit,
            ));
        };

        for (delivery, _) in buffer.drain(..) {
            match transport.release(&delivery).await {
                Ok(()) => core.counters.inc(Counter::Released),
                // Without release the lock simply runs out; nothing is lost.
                Err(TransportError::Unsupported(_)) => {}
                Err(e) => core.report(ProcessError::new(
                    ErrorSource::Settle,
                    Some(delivery.message().message_id()),
                    e,
                )),
            }
        }
        while let Some(joined) = tasks.join_next().await {
            report_join(&core, joined);
        }
        result
    }
}

fn report_join<I, H>(core: &Core<I, H>, joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        // Handler panics are caught inside the task; this is a panic in twice itself.
        core.report(ProcessError::new(ErrorSource::Handler, None, e));
    }
}

/// One message in its own task: processing raced against the loss of its lock.
async fn process_one<T, I, H>(
    core: Arc<Core<I, H>>,
    transport: Arc<T>,
    delivery: T::Delivery,
    received_at: Timestamp,
    max_renewal: Duration,
    permit: OwnedSemaphorePermit,
) where
    T: Transport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    let lock = LockState::new(delivery.message().locked_until);
    let id = delivery.message().message_id().clone();
    let margin = renewal_margin(transport.entity().lock_duration);
    let renew_until = received_at + max_renewal;
    let settler = TransportSettler(Arc::clone(&transport));
    let keeper =
        keep_lock(&core, &lock, renew_until, margin, Some(&id), || transport.renew_lock(&delivery));
    core.process(&settler, &delivery, received_at, &lock, keeper).await;
    drop(permit);
}

/// Renews a lock until the renewal limit; resolves when the lock is lost (a renewal is refused,
/// or the lock runs out).
pub(crate) async fn keep_lock<I, H, F, Fut>(
    core: &Core<I, H>,
    lock: &LockState,
    renew_until: Timestamp,
    margin: Duration,
    id: Option<&crate::ids::MessageId>,
    mut renew: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Timestamp, TransportError>>,
{
    if lock.locked_until() == Timestamp::MAX {
        // No lock to keep (a transport without lock expiry).
        return std::future::pending().await;
    }
    let clock = &core.clock;
    loop {
        let until = lock.locked_until();
        let renew_at = until - margin;
        if renew_at >= renew_until {
            clock.sleep_until(until).await;
            lock.set_lost();
            return;
        }
        clock.sleep_until(renew_at).await;
        match renew().await {
            Ok(new_until) => {
                lock.set(new_until);
                core.counters.inc(Counter::Renewals);
            }
            Err(e) if e.is_lock_lost() => {
                lock.set_lost();
                return;
            }
            Err(e) => {
                core.report(ProcessError::new(ErrorSource::RenewLock, id, e));
                let now = clock.now();
                if now >= until {
                    lock.set_lost();
                    return;
                }
                // Try again shortly, but never past the lock's end.
                clock.sleep_until((now + Duration::from_secs(1)).min(until)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redelivery_horizon_covers_the_message_time_to_live() {
        let mut entity = EntityInfo::new("orders");
        let renewal = Duration::from_secs(300);
        // 10 deliveries × 60 s + 5 min.
        assert_eq!(redelivery_horizon(&entity, renewal), Some(Duration::from_secs(900)));
        entity.message_time_to_live = Some(Duration::from_secs(14 * 24 * 3600));
        assert_eq!(redelivery_horizon(&entity, renewal), Some(Duration::from_secs(14 * 24 * 3600)));
        let week = Some(Duration::from_secs(7 * 24 * 3600));
        let refused = check_retention(&entity, week, renewal).expect_err("a week is too short");
        assert!(refused.to_string().contains("time to live"), "{refused}");
    }
}
