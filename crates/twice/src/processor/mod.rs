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
//! | the begin or the claim failed, whatever the error (unless the store calls it permanent) | roll back | retried in process; released when the retries are used up |
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
//! # Claim scope
//!
//! The inbox key is `(consumer, message id)`. The consumer is the name set with
//! [`ProcessorOptions::consumer`], or else the transport's
//! [`claim_scope`](crate::Transport::claim_scope): the entity, named so that every receiver of
//! the same entity claims in the same scope however the entity is spelled, and no two
//! entities whose messages may share an inbox table do. Message ids are the sender's, so two
//! entities can carry the same id for different messages (the subscriptions of one topic
//! always do), and one entity reached under two spellings must not have its messages handled
//! once per spelling. Each transport's rule:
//!
//! | transport | claim scope |
//! |---|---|
//! | Service Bus client | the path in lower case (entity names are case-insensitive): `orders`, `events/subscriptions/billing`; a dead-letter queue is its own scope, `orders/$deadletterqueue` |
//! | embedded broker (`twice-broker`) | the path as the entity was created, whatever spelling the receiver was asked for (the broker resolves every spelling to it); a dead-letter queue is its own scope, `Orders/$DeadLetterQueue` |
//! | RabbitMQ, NATS JetStream | what the transport's `claim_scope` says (its crate documents it); by default the entity path as given |
//! | any other | the entity path as given (the default) |
//!
//! A dead-letter queue is scoped apart from its entity: a message reaches it uncompleted, so
//! whatever its entity's processor claimed for it was rolled back, except a dedup-only record
//! left in progress by a crash, which must not hold up the dead-letter queue's processor.
//!
//! *Migration.* Before these rules the scope was the path exactly as configured. A processor
//! whose path has upper-case letters (`Orders`) now claims under `orders`, so a message
//! claimed before the upgrade and delivered again after it would be handled again. Either
//! keep the old scope with `.consumer("Orders")`, or move the rows once, while no processor
//! of that entity runs (PostgreSQL and SQLite; on MariaDB `INSERT IGNORE` for the first
//! statement):
//!
//! ```sql
//! INSERT INTO twice_inbox (consumer, message_id, processed_at_ms, purge_after_ms, state, owner)
//!   SELECT 'orders', message_id, processed_at_ms, purge_after_ms, state, owner
//!   FROM twice_inbox WHERE consumer = 'Orders'
//!   ON CONFLICT (consumer, message_id) DO NOTHING;
//! DELETE FROM twice_inbox WHERE consumer = 'Orders';
//! ```
//!
//! # Settlement off the call
//!
//! A call (one of [`max_concurrent_calls`](ProcessorOptions::max_concurrent_calls)) is held
//! while the message's transaction is open. Once the transaction has ended (committed or rolled
//! back), the settlement (complete, abandon, dead-letter, defer, delayed redelivery) goes on in
//! the background and frees the call, so the next message's handler does not wait for the
//! broker to acknowledge this one. Settlements pending at once are bounded apart from the calls,
//! by as many again as MaxConcurrentCalls: a message waits, still holding its call, for a free
//! settlement slot. The lock keeps being renewed until the settlement is done. The counters
//! and [`Processor::on_committed`] keep their meaning (a message is counted completed when the
//! broker has acknowledged it), and [`Processor::run`] returns only after every pending
//! settlement has finished. The [`SessionProcessor`](crate::SessionProcessor) settles in line,
//! because its next message must not overtake this one's settlement.
//!
//! # Batches
//!
//! With [`ProcessorOptions::batch_size`] above 1, one call processes up to that many messages
//! that are already received (it never waits to fill a batch) in one transaction:
//!
//! 1. Messages without an id are dead-lettered as above; a second copy of an id in the same
//!    batch is set aside and processed alone after the batch's transaction has ended, so it
//!    waits for its twin exactly as a concurrent copy does.
//! 2. Begin, and claim every id in one statement ([`Inbox::claim_batch`]), sorted so that two
//!    batches never wait on each other's claims in a cycle. Ids claimed and committed before
//!    are duplicates: completed, their handlers not run.
//! 3. For each claimed message in the order received: a savepoint ([`Inbox::savepoint`]),
//!    then its handler, raced against the loss of *its* lock. A handler that returns anything
//!    but `Complete`, fails, panics or loses its lock has its work rolled back to the savepoint
//!    ([`Inbox::rollback_to_savepoint`]) and its claim taken back ([`Inbox::unclaim`]); only
//!    that message is settled as the table above says. Immediate retries rerun it under the
//!    same savepoint.
//! 4. Write every outgoing message of the completed handlers into the outbox in one insert
//!    (or check that the transaction can commit), commit once, then settle each message.
//!
//! What stays as it is without batches: a message is completed only after the commit; its
//! lock is renewed until its settlement is done; a crash after the commit and before the
//! settlements leaves claims that the redeliveries meet. What differs: a message whose lock
//! runs out after its handler has finished and before the batch commits is committed with
//! the batch (its completion then fails as a lock lost, and its redelivery meets the claim),
//! where a message alone would be rolled back; and any failure of the transaction as a whole
//! (a deadlock, a lost connection, an error the store calls transient, a failed savepoint
//! rollback, a commit refused or of unknown outcome) rolls the batch back and processes its
//! messages again one at a time, each with the retries above. Batches need [`Mode::Claim`]
//! and are not available on the [`SessionProcessor`](crate::SessionProcessor).
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
//! The claim is the processor's own insert, so a claim that fails is never the message's
//! fault, whatever the store makes of the error: a read-only transaction after a failover, a
//! full disk, a dropped table are retried like a lost connection. When the retries are used up
//! and no handler has run in any attempt (the begin or the claim failed every time), the
//! message is released ([`Transport::release`]) rather than abandoned, so that it comes back
//! with its delivery count unchanged: a database down for longer than MaxDeliveryCount
//! attempts never dead-letters a message unrun. Only an error the store calls permanent (a
//! message id the inbox key cannot hold) abandons the message, which then reaches the
//! dead-letter queue by MaxDeliveryCount. A transport without release abandons instead.
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
//!   released if no handler ran (it comes back uncounted), abandoned if one did.
//! - *A failover: the database refuses writes for a while.* The claims fail (PostgreSQL 25006,
//!   MariaDB 1290/1792, SQLite 8); each is retried as above, so the messages wait out the
//!   window without spending deliveries, and each handler runs once afterwards.
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
//! # Dead-lettered messages resubmitted
//!
//! A message in the dead-letter queue can be sent again with its own message id (`twice dlq
//! resubmit`, the console, a resubmit of the application's own), and then meets the claim it
//! may have made: a message whose work committed can still reach the dead-letter queue (its
//! completion lost on its last delivery, a copy dead-lettered past MaxDeliveryCount). The
//! resubmitted copy is a duplicate only while the inbox still holds that claim, so the
//! retention must cover the age of the oldest message resubmitted, as well as the
//! [`redelivery_horizon`]. The processor counts it at start: the application's
//! [`ProcessorOptions::max_resubmit_age`] (the oldest message, from when it was first sent,
//! anyone resubmits), else the dead-letter queue's time to live after the redelivery horizon
//! where the transport reports it ([`EntityInfo::dead_letter_time_to_live`](crate::EntityInfo::dead_letter_time_to_live)),
//! and refuses a shorter retention with the numbers
//! ([`ProcessorError::RetentionTooShort`](crate::ProcessorError::RetentionTooShort)). When
//! neither bounds it (Service Bus and the embedded broker keep dead-lettered messages until
//! someone removes them) it starts, and logs a warning with the retention. The resubmit
//! tools cannot see the inbox: a message older than the retention is better resubmitted
//! after checking that its work was not done.
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
//!
//! # Spans and health
//!
//! Each message is processed in a `twice.process` span (claim, handler, commit, settlement)
//! with the OpenTelemetry messaging fields, its `twice.outcome` and the sender's
//! `trace_parent`; see the [crate docs](crate#observability). [`Processor::health_handle`],
//! taken before the run, reports whether the processor is receiving, when it last completed a
//! message, and whether its inbox answers.

mod base;
mod batch;
mod dedup;
mod lock;
mod options;
mod pipeline;
mod run;
mod settle;
mod shared;

use crate::ids::MessageId;
#[cfg(doc)]
use crate::{
    inbox::Claim, inbox::Inbox, outcome::Outcome, retry::RetryPolicy, transport::Transport,
};

pub(crate) use base::{Base, Hooks, Settings, processor_type, report_join};
pub(crate) use lock::{LockState, keep_lock, renewal_margin};
pub(crate) use options::shared_options;
pub use options::{ProcessorOptions, redelivery_horizon};
pub use run::Processor;
pub(crate) use settle::{Settlement, Settler};
pub(crate) use shared::Core;

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

pub use crate::dead_letter_reasons::{HANDLER_FAILED, MISSING_MESSAGE_ID};

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
