//! Counters a processor keeps, for metrics.
//!
//! Every counter counts *this processor's* events. In particular the broker's delivery count is
//! not one of them: a message received once is counted once in `received`, whatever phases it
//! goes through.
//!
//! With the `metrics` cargo feature every count is also recorded through the
//! [`metrics`](https://docs.rs/metrics) facade, under names that start with `twice_processor_`
//! and the labels `entity` and `consumer`:
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `twice_processor_messages_handled_total` | counter | messages handed to the pipeline |
//! | `twice_processor_committed_total` | counter | transactions committed with the work |
//! | `twice_processor_completed_total` | counter | messages completed |
//! | `twice_processor_duplicates_total` | counter | duplicates, label `reason`: `already_processed`, `concurrent_copy`, `business_key` |
//! | `twice_processor_abandoned_total` | counter | messages abandoned |
//! | `twice_processor_dead_lettered_total` | counter | messages dead-lettered by the processor |
//! | `twice_processor_deferred_total` | counter | messages deferred |
//! | `twice_processor_released_total` | counter | messages released uncounted: prefetched ones at shutdown, and those whose begin or claim failed through every retry |
//! | `twice_processor_lock_lost_total` | counter | messages whose lock was lost while processed |
//! | `twice_processor_expired_in_buffer_total` | counter | received messages whose lock ran out before a handler took them |
//! | `twice_processor_batches_split_total` | counter | batches whose transaction failed as a whole, their messages then processed one at a time |
//! | `twice_processor_lock_renewals_total` | counter | lock renewals |
//! | `twice_processor_handler_errors_total` | counter | handler errors |
//! | `twice_processor_handler_panics_total` | counter | handler panics |
//! | `twice_processor_settle_failures_total` | counter | settlements the broker refused |
//! | `twice_processor_retries_total` | counter | retries, label `kind`: `infrastructure`, `immediate`, `delayed` |
//! | `twice_processor_claim_duration_seconds` | histogram | claim latency |
//! | `twice_processor_handler_duration_seconds` | histogram | handler run time |
//! | `twice_processor_in_flight` | gauge | messages between receipt and the end of their settlement |

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Live counters of a processor; read them with [`Counters::snapshot`].
#[derive(Debug, Default)]
pub struct Counters {
    received: AtomicU64,
    committed: AtomicU64,
    completed: AtomicU64,
    duplicates_already_processed: AtomicU64,
    duplicates_concurrent_copy: AtomicU64,
    duplicates_business_key: AtomicU64,
    abandoned: AtomicU64,
    dead_lettered: AtomicU64,
    deferred: AtomicU64,
    released: AtomicU64,
    lock_lost: AtomicU64,
    expired_in_buffer: AtomicU64,
    batches_split: AtomicU64,
    renewals: AtomicU64,
    handler_errors: AtomicU64,
    handler_panics: AtomicU64,
    settle_failures: AtomicU64,
    infrastructure_retries: AtomicU64,
    immediate_retries: AtomicU64,
    delayed_redeliveries: AtomicU64,
    claims: AtomicU64,
    claim_latency_total_us: AtomicU64,
    claim_latency_max_us: AtomicU64,
    /// The `entity` and `consumer` labels of the recorded metrics, set when a run starts.
    #[cfg(feature = "metrics")]
    labels: std::sync::OnceLock<[metrics::Label; 2]>,
}

/// Which counter to raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    Received,
    Committed,
    Completed,
    DuplicateAlreadyProcessed,
    DuplicateConcurrentCopy,
    DuplicateBusinessKey,
    Abandoned,
    DeadLettered,
    Deferred,
    Released,
    LockLost,
    ExpiredInBuffer,
    BatchesSplit,
    Renewals,
    HandlerErrors,
    HandlerPanics,
    SettleFailures,
    InfrastructureRetries,
    ImmediateRetries,
    DelayedRedeliveries,
}

impl Counters {
    pub(crate) fn inc(&self, counter: Counter) {
        let c = match counter {
            Counter::Received => &self.received,
            Counter::Committed => &self.committed,
            Counter::Completed => &self.completed,
            Counter::DuplicateAlreadyProcessed => &self.duplicates_already_processed,
            Counter::DuplicateConcurrentCopy => &self.duplicates_concurrent_copy,
            Counter::DuplicateBusinessKey => &self.duplicates_business_key,
            Counter::Abandoned => &self.abandoned,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::Deferred => &self.deferred,
            Counter::Released => &self.released,
            Counter::LockLost => &self.lock_lost,
            Counter::ExpiredInBuffer => &self.expired_in_buffer,
            Counter::BatchesSplit => &self.batches_split,
            Counter::Renewals => &self.renewals,
            Counter::HandlerErrors => &self.handler_errors,
            Counter::HandlerPanics => &self.handler_panics,
            Counter::SettleFailures => &self.settle_failures,
            Counter::InfrastructureRetries => &self.infrastructure_retries,
            Counter::ImmediateRetries => &self.immediate_retries,
            Counter::DelayedRedeliveries => &self.delayed_redeliveries,
        };
        c.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        self.record(counter);
    }

    /// Sets the labels of the recorded metrics (the first run's, if a processor runs twice).
    #[cfg(feature = "metrics")]
    pub(crate) fn label(&self, entity: &str, consumer: &str) {
        let _ = self.labels.set([
            metrics::Label::new("entity", entity.to_owned()),
            metrics::Label::new("consumer", consumer.to_owned()),
        ]);
    }

    #[cfg(feature = "metrics")]
    fn labels(&self) -> Vec<metrics::Label> {
        self.labels.get().map(|l| l.to_vec()).unwrap_or_default()
    }

    /// Records `counter` through the `metrics` facade.
    #[cfg(feature = "metrics")]
    fn record(&self, counter: Counter) {
        let (name, extra) = match counter {
            Counter::Received => ("twice_processor_messages_handled_total", None),
            Counter::Committed => ("twice_processor_committed_total", None),
            Counter::Completed => ("twice_processor_completed_total", None),
            Counter::DuplicateAlreadyProcessed => {
                ("twice_processor_duplicates_total", Some(("reason", "already_processed")))
            }
            Counter::DuplicateConcurrentCopy => {
                ("twice_processor_duplicates_total", Some(("reason", "concurrent_copy")))
            }
            Counter::DuplicateBusinessKey => {
                ("twice_processor_duplicates_total", Some(("reason", "business_key")))
            }
            Counter::Abandoned => ("twice_processor_abandoned_total", None),
            Counter::DeadLettered => ("twice_processor_dead_lettered_total", None),
            Counter::Deferred => ("twice_processor_deferred_total", None),
            Counter::Released => ("twice_processor_released_total", None),
            Counter::LockLost => ("twice_processor_lock_lost_total", None),
            Counter::ExpiredInBuffer => ("twice_processor_expired_in_buffer_total", None),
            Counter::BatchesSplit => ("twice_processor_batches_split_total", None),
            Counter::Renewals => ("twice_processor_lock_renewals_total", None),
            Counter::HandlerErrors => ("twice_processor_handler_errors_total", None),
            Counter::HandlerPanics => ("twice_processor_handler_panics_total", None),
            Counter::SettleFailures => ("twice_processor_settle_failures_total", None),
            Counter::InfrastructureRetries => {
                ("twice_processor_retries_total", Some(("kind", "infrastructure")))
            }
            Counter::ImmediateRetries => {
                ("twice_processor_retries_total", Some(("kind", "immediate")))
            }
            Counter::DelayedRedeliveries => {
                ("twice_processor_retries_total", Some(("kind", "delayed")))
            }
        };
        let mut labels = self.labels();
        if let Some((key, value)) = extra {
            labels.push(metrics::Label::new(key, value));
        }
        metrics::counter!(name, labels).increment(1);
    }

    /// Records how long a handler ran (with the `metrics` feature; otherwise nothing).
    pub(crate) fn record_handler_duration(&self, took: Duration) {
        #[cfg(feature = "metrics")]
        metrics::histogram!("twice_processor_handler_duration_seconds", self.labels())
            .record(took.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = took;
    }

    /// Moves the in-flight gauge by one (with the `metrics` feature; otherwise nothing).
    fn in_flight(&self, up: bool) {
        #[cfg(feature = "metrics")]
        {
            let gauge = metrics::gauge!("twice_processor_in_flight", self.labels());
            if up { gauge.increment(1.0) } else { gauge.decrement(1.0) }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = up;
    }

    pub(crate) fn record_claim_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.claims.fetch_add(1, Ordering::Relaxed);
        self.claim_latency_total_us.fetch_add(us, Ordering::Relaxed);
        self.claim_latency_max_us.fetch_max(us, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::histogram!("twice_processor_claim_duration_seconds", self.labels())
            .record(latency.as_secs_f64());
    }

    /// The counters now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            received: get(&self.received),
            committed: get(&self.committed),
            completed: get(&self.completed),
            duplicates_already_processed: get(&self.duplicates_already_processed),
            duplicates_concurrent_copy: get(&self.duplicates_concurrent_copy),
            duplicates_business_key: get(&self.duplicates_business_key),
            abandoned: get(&self.abandoned),
            dead_lettered: get(&self.dead_lettered),
            deferred: get(&self.deferred),
            released: get(&self.released),
            lock_lost: get(&self.lock_lost),
            expired_in_buffer: get(&self.expired_in_buffer),
            batches_split: get(&self.batches_split),
            renewals: get(&self.renewals),
            handler_errors: get(&self.handler_errors),
            handler_panics: get(&self.handler_panics),
            settle_failures: get(&self.settle_failures),
            infrastructure_retries: get(&self.infrastructure_retries),
            immediate_retries: get(&self.immediate_retries),
            delayed_redeliveries: get(&self.delayed_redeliveries),
            claims: get(&self.claims),
            claim_latency_total: Duration::from_micros(get(&self.claim_latency_total_us)),
            claim_latency_max: Duration::from_micros(get(&self.claim_latency_max_us)),
        }
    }
}

/// One message in flight, from receipt to the end of its settlement, for the in-flight gauge:
/// up when made, down when dropped (also when the processing is given up midway).
pub(crate) struct InFlight<'a>(&'a Counters);

impl<'a> InFlight<'a> {
    pub(crate) fn new(counters: &'a Counters) -> Self {
        counters.in_flight(true);
        Self(counters)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight(false);
    }
}

/// The counters of a processor at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CounterSnapshot {
    /// Messages handed to the processing pipeline (prefetched messages released unprocessed at
    /// shutdown are not counted).
    pub received: u64,
    /// Inbox transactions committed with the handler's work.
    pub committed: u64,
    /// Messages completed with the broker, after their work committed or as duplicates.
    pub completed: u64,
    /// Duplicates whose id had been claimed and committed before this copy arrived.
    pub duplicates_already_processed: u64,
    /// Duplicates whose id another copy claimed at or after the moment this copy was received:
    /// both were in flight together (typically this copy's claim waited for the winner's
    /// commit).
    pub duplicates_concurrent_copy: u64,
    /// Messages whose work violated a registered business-key constraint (the same event under
    /// another message id): rolled back and completed.
    pub duplicates_business_key: u64,
    /// Messages abandoned (transient errors, panics, failed commits, `Outcome::Abandon`).
    pub abandoned: u64,
    /// Messages dead-lettered by this processor (permanent errors, bad bodies,
    /// `Outcome::DeadLetter`). Messages the broker dead-letters after MaxDeliveryCount are the
    /// broker's count, not this one.
    pub dead_lettered: u64,
    /// Messages deferred.
    pub deferred: u64,
    /// Messages released without a delivery counted: prefetched messages no handler took at
    /// shutdown, and messages whose transaction could not begin or whose claim failed in every
    /// attempt until the infrastructure retries were used up.
    pub released: u64,
    /// Messages whose lock was lost while they were processed: the work was rolled back and the
    /// message left to the broker.
    pub lock_lost: u64,
    /// Messages received whose lock had run out before a handler took them (they waited in a
    /// prefetch buffer): skipped, since the broker delivers them again, with a delivery
    /// counted. A rising count means the prefetch is too deep for the handlers' pace.
    pub expired_in_buffer: u64,
    /// Batches ([`ProcessorOptions::batch_size`](crate::ProcessorOptions::batch_size))
    /// whose transaction failed as a whole, their messages then processed one at a time.
    pub batches_split: u64,
    /// Successful lock renewals (message or session).
    pub renewals: u64,
    /// Errors returned by handlers (business-key duplicates excluded).
    pub handler_errors: u64,
    /// Handler panics caught.
    pub handler_panics: u64,
    /// Settlements the broker refused (e.g. completion after the lock was lost).
    pub settle_failures: u64,
    /// Attempts retried in process after a failure that was not the message's fault (no
    /// connection, a lost connection, a busy database, a deadlock victim, an unknown commit
    /// outcome); no delivery was counted for them.
    pub infrastructure_retries: u64,
    /// Attempts retried at once, in process, after a handler error.
    pub immediate_retries: u64,
    /// Messages handed back to the broker to come again later after a handler error.
    pub delayed_redeliveries: u64,
    /// Claims made.
    pub claims: u64,
    /// Time spent in claims, summed (divide by `claims` for the mean).
    pub claim_latency_total: Duration,
    /// The longest claim.
    pub claim_latency_max: Duration,
}
