//! The options of a [`Processor`](super::Processor) and the checks of them against the entity
//! and the inbox.

use std::time::Duration;

use super::Mode;
use crate::clock::SharedClock;
use crate::error::{ProcessorError, format_duration};
use crate::inbox::Inbox;
use crate::retry::RetryPolicy;
use crate::transport::EntityInfo;

/// The options [`ProcessorOptions`](ProcessorOptions) and
/// [`SessionProcessorOptions`](crate::SessionProcessorOptions) share, with a setter and a
/// getter each, written once; the docs of the setters that differ are passed in.
macro_rules! shared_options {
    (
        $concurrency:ident / $get_concurrency:ident ($option:literal): $concurrency_doc:literal,
        max_auto_lock_renewal_duration: $renewal:literal,
        max_wait: $max_wait:literal,
        retry: $retry:literal,
        clock: $clock:literal $(,)?
    ) => {
        #[doc = $concurrency_doc]
        #[must_use]
        pub fn $concurrency(mut self, n: usize) -> Self {
            self.$concurrency = n.max(1);
            self
        }

        #[doc = concat!("As set by [`Self::", stringify!($concurrency), "`].")]
        pub fn $get_concurrency(&self) -> usize {
            self.$concurrency
        }

        /// The consumer name, the scope of the inbox key (default: the transport's
        /// [`claim_scope`](crate::Transport::claim_scope), the entity's path normalised as its
        /// broker names entities; it differs between the subscriptions of a topic, which
        /// share message ids). See [Claim scope](crate::processor#claim-scope).
        #[must_use]
        pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
            self.consumer = Some(consumer.into());
            self
        }

        /// The consumer name set, if any.
        pub fn get_consumer(&self) -> Option<&str> {
            self.consumer.as_deref()
        }

        #[doc = $renewal]
        #[must_use]
        pub fn max_auto_lock_renewal_duration(mut self, d: std::time::Duration) -> Self {
            self.max_auto_lock_renewal_duration = d;
            self
        }

        /// How long a lock is renewed; see [`Self::max_auto_lock_renewal_duration`].
        pub fn get_max_auto_lock_renewal_duration(&self) -> std::time::Duration {
            self.max_auto_lock_renewal_duration
        }

        #[doc = $max_wait]
        #[must_use]
        pub fn max_wait(mut self, d: std::time::Duration) -> Self {
            self.max_wait = d;
            self
        }

        /// How long one receive call waits; see [`Self::max_wait`].
        pub fn get_max_wait(&self) -> std::time::Duration {
            self.max_wait
        }

        /// How the handler's work is protected (default [`Mode::Claim`](crate::Mode::Claim)).
        #[must_use]
        pub fn mode(mut self, mode: $crate::Mode) -> Self {
            self.mode = mode;
            self
        }

        /// How the handler's work is protected.
        pub fn get_mode(&self) -> $crate::Mode {
            self.mode
        }

        #[doc = $retry]
        #[must_use]
        pub fn retry(mut self, retry: $crate::RetryPolicy) -> Self {
            self.retry = retry;
            self
        }

        /// How failed attempts are retried.
        pub fn get_retry(&self) -> &$crate::RetryPolicy {
            &self.retry
        }

        #[doc = $clock]
        #[must_use]
        pub fn clock(mut self, clock: $crate::SharedClock) -> Self {
            self.clock = clock;
            self
        }

        /// The clock.
        pub fn get_clock(&self) -> &$crate::SharedClock {
            &self.clock
        }

        /// The age of the oldest dead-lettered message anyone resubmits to the entity with its
        /// own message id, counted from when it was first sent (default `None`: what the
        /// transport reports of the dead-letter queue,
        /// [`EntityInfo::dead_letter_time_to_live`](crate::EntityInfo::dead_letter_time_to_live),
        /// if anything). A resubmitted message is redelivered with the id the inbox claimed, so
        /// the inbox retention must cover it too: the processor refuses to start with a
        /// retention shorter than this age, and warns, with the numbers, when neither this
        /// option nor the transport bounds it. See
        /// [Dead-lettered messages resubmitted](crate::processor#dead-lettered-messages-resubmitted).
        #[must_use]
        pub fn max_resubmit_age(mut self, age: Option<std::time::Duration>) -> Self {
            self.max_resubmit_age = age;
            self
        }

        /// The age of the oldest dead-lettered message resubmitted, if set; see
        /// [`Self::max_resubmit_age`].
        pub fn get_max_resubmit_age(&self) -> Option<std::time::Duration> {
            self.max_resubmit_age
        }

        pub(crate) fn settings(&self) -> $crate::processor::Settings<'_> {
            $crate::processor::Settings {
                consumer: self.consumer.as_deref(),
                concurrency: (self.$concurrency, $option),
                mode: self.mode,
                max_auto_lock_renewal_duration: self.max_auto_lock_renewal_duration,
                max_wait: self.max_wait,
                retry: &self.retry,
                clock: &self.clock,
                max_resubmit_age: self.max_resubmit_age,
            }
        }
    };
}
pub(crate) use shared_options;

/// Options of a [`Processor`](super::Processor), with Service Bus names and defaults.
#[derive(Clone, Debug)]
pub struct ProcessorOptions {
    consumer: Option<String>,
    max_concurrent_calls: usize,
    prefetch_count: usize,
    batch_size: usize,
    max_auto_lock_renewal_duration: Duration,
    max_wait: Duration,
    mode: Mode,
    retry: RetryPolicy,
    clock: SharedClock,
    max_resubmit_age: Option<Duration>,
}

impl Default for ProcessorOptions {
    fn default() -> Self {
        Self {
            consumer: None,
            max_concurrent_calls: 1,
            prefetch_count: 0,
            batch_size: 1,
            max_auto_lock_renewal_duration: Duration::from_secs(300),
            max_wait: Duration::from_secs(60),
            mode: Mode::Claim,
            retry: RetryPolicy::default(),
            clock: SharedClock::system(),
            max_resubmit_age: None,
        }
    }
}

impl ProcessorOptions {
    /// The defaults: consumer = entity path, MaxConcurrentCalls 1, PrefetchCount 0, lock renewal
    /// for up to 5 minutes, [`Mode::Claim`], the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    shared_options! {
        max_concurrent_calls / get_max_concurrent_calls ("MaxConcurrentCalls"):
            "How many messages are handled at once (default 1; at least 1): a message holds \
            a call while its transaction is open. As many settlements again may be pending \
            with the broker after their transactions have ended.",
        max_auto_lock_renewal_duration: "How long after receipt the lock of a message is \
            renewed (default 5 minutes; zero turns renewal off).",
        max_wait: "How long one receive call waits for messages before asking again (default \
            60 s).",
        retry: "How failed attempts are retried (default [`RetryPolicy::new`]).",
        clock: "The clock for lock expiry and renewal and for claim times (default: the \
            system clock).",
    }

    /// How many messages to receive ahead of the handlers (default 0). Prefetched messages are
    /// locked; their locks are not renewed until a handler takes them, and those still waiting
    /// at shutdown are released. One whose lock runs out while it waits is skipped (the broker
    /// delivers it again, with a delivery counted) and counted in
    /// [`CounterSnapshot::expired_in_buffer`](crate::CounterSnapshot::expired_in_buffer):
    /// keep the prefetch small enough for the handlers to take each message within its lock.
    #[must_use]
    pub fn prefetch_count(mut self, n: usize) -> Self {
        self.prefetch_count = n;
        self
    }

    /// How many messages to receive ahead of the handlers.
    pub fn get_prefetch_count(&self) -> usize {
        self.prefetch_count
    }

    /// How many received messages one transaction may process (default 1: a transaction per
    /// message). Above 1, a call takes up to `n` messages that are already received, claims
    /// them in one statement, runs each handler under a savepoint of its own, commits once and
    /// then settles each message as its handler said; see [batches](crate::processor#batches).
    /// It needs [`Mode::Claim`] and an inbox that
    /// [supports batches](crate::Inbox::supports_batches); [`Processor::run`](super::Processor::run)
    /// refuses to start otherwise. MaxConcurrentCalls then counts transactions: up to
    /// MaxConcurrentCalls × `n` messages are in flight.
    #[must_use]
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How many received messages one transaction may process.
    pub fn get_batch_size(&self) -> usize {
        self.batch_size
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

/// How long after its claim a message can come back resubmitted from the dead-letter queue with
/// its id, and how that was found: the application's `max_resubmit_age`, else the redelivery
/// horizon (how late it can be dead-lettered) plus the dead-letter queue's time to live, as the
/// transport reports it. `None` when neither bounds it.
fn resubmit_horizon(
    entity: &EntityInfo,
    redelivery: Option<Duration>,
    max_resubmit_age: Option<Duration>,
) -> Option<(Duration, String)> {
    match (max_resubmit_age, entity.dead_letter_time_to_live) {
        (Some(age), _) => Some((
            age,
            format!(
                "dead-lettered messages resubmitted from the dead-letter queue up to {} old \
                 (max_resubmit_age)",
                format_duration(age)
            ),
        )),
        (None, Some(ttl)) => redelivery.map(|h| {
            (
                h.saturating_add(ttl),
                format!(
                    "dead-lettered messages kept {} in the dead-letter queue after the {} a \
                     message can take to be dead-lettered",
                    format_duration(ttl),
                    format_duration(h)
                ),
            )
        }),
        (None, None) => None,
    }
}

/// Refuses a retention shorter than the redelivery horizon, or than the age at which a
/// dead-lettered message can still be resubmitted, with the numbers in the error. When nothing
/// bounds that age (the dead-letter queue keeps messages until someone removes them, and no
/// `max_resubmit_age` is set) the retention is not refused for it, and the warning to log is
/// returned, with the numbers.
pub(crate) fn check_retention(
    entity: &EntityInfo,
    retention: Option<Duration>,
    max_auto_lock_renewal: Duration,
    max_resubmit_age: Option<Duration>,
) -> Result<Option<String>, ProcessorError> {
    let Some(retention) = retention else { return Ok(None) };
    let redelivery = redelivery_horizon(entity, max_auto_lock_renewal);
    let resubmit = resubmit_horizon(entity, redelivery, max_resubmit_age);
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
        if let Some((_, why)) = &resubmit {
            s.push_str(&format!("; {why}"));
        }
        s
    };
    let horizon = match (redelivery, &resubmit) {
        (Some(h), Some((age, _))) => Some(h.max(*age)),
        (h, _) => h,
    };
    match horizon {
        Some(horizon) if retention >= horizon => Ok(resubmit.is_none().then(|| {
            format!(
                "the inbox keeps processed message ids for {retention}, but nothing bounds how \
                 long {entity}'s dead-letter queue keeps a message: one resubmitted from it \
                 with its own id more than {retention} after it was processed would be \
                 processed again; set the processor's max_resubmit_age to the age of the oldest \
                 message you resubmit (it then refuses a shorter retention), or keep the inbox \
                 retention at least that long",
                retention = format_duration(retention),
                entity = entity.path,
            )
        })),
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
        let refused =
            check_retention(&entity, week, renewal, None).expect_err("a week is too short");
        assert!(refused.to_string().contains("time to live"), "{refused}");
    }

    #[test]
    fn the_horizon_covers_resubmits_from_the_dead_letter_queue() {
        let mut entity = EntityInfo::new("orders");
        let renewal = Duration::from_secs(300);
        let hour = Duration::from_secs(3600);
        // 10 deliveries × 60 s + 5 min = 15 min; a resubmit can come a day later.
        let warned = check_retention(&entity, Some(hour), renewal, None)
            .expect("nothing bounds the resubmits: a warning, not a refusal")
            .expect("a warning");
        assert!(warned.contains("for 1 h") && warned.contains("max_resubmit_age"), "{warned}");
        let refused = check_retention(&entity, Some(hour), renewal, Some(24 * hour))
            .expect_err("an hour does not cover resubmits of a day")
            .to_string();
        assert!(refused.contains("for 1 d") && refused.contains("up to 1 d old"), "{refused}");
        assert_eq!(
            check_retention(&entity, Some(24 * hour), renewal, Some(24 * hour)).ok(),
            Some(None)
        );

        // Where the transport knows how long the dead-letter queue keeps a message, that
        // counts after the time a message can take to be dead-lettered: 15 min + 2 h.
        entity.dead_letter_time_to_live = Some(2 * hour);
        let refused = check_retention(&entity, Some(2 * hour), renewal, None)
            .expect_err("2 h do not cover 2 h 15 min")
            .to_string();
        assert!(refused.contains("for 135 min"), "{refused}");
        assert!(
            refused.contains("kept 2 h in the dead-letter queue after the 15 min"),
            "{refused}"
        );
        assert_eq!(check_retention(&entity, Some(3 * hour), renewal, None).ok(), Some(None));
        // The application's bound replaces the transport's.
        assert_eq!(check_retention(&entity, Some(hour), renewal, Some(hour)).ok(), Some(None));
    }
}
