//! How the processor retries: failures that are not the message's fault, and handler errors.
//!
//! Two kinds of failure, two policies:
//!
//! - **Infrastructure** (not the message's fault): no connection in the pool in time, the
//!   connection lost before the claim, SQLite busy, a lock wait timeout, a deadlock victim, a
//!   serialization failure, a commit whose outcome is unknown. The processor retries the whole
//!   attempt (begin, claim, handler, commit) in process, after an exponential backoff with
//!   jitter, while it keeps renewing the message lock; no delivery is counted. A commit that
//!   did happen is then found by the claim, and the message completes as a duplicate. A claim
//!   that fails is always such a failure (the claim is the processor's own insert), unless the
//!   store calls its error permanent. Only after [`RetryPolicy::infrastructure_retries`]
//!   failed attempts in a row does the processor give the message up: it releases it (no
//!   delivery counted) when no handler ran in any attempt, and abandons it otherwise.
//! - **Handler errors** (transient or unclassified errors a handler returns, panics, a
//!   transaction the database aborted under the handler): first
//!   [`RetryPolicy::immediate_retries`] more attempts at once, in process; then, if
//!   [`RetryPolicy::delayed_redelivery`] is set, the message is handed back to the broker to
//!   come again after each delay in turn (MassTransit's `UseDelayedRedelivery`, NServiceBus's
//!   delayed retries), without raising its delivery count; once the delays are used up, or
//!   where the transport cannot redeliver later, it is abandoned and the broker's
//!   MaxDeliveryCount takes over.
//!
//! Which store errors are infrastructure is the store's call ([`Inbox::classify`] returns
//! [`ErrorClass::Transient`]); see the `twice-sqlx` crate docs for the codes.
//!
//! [`Inbox::classify`]: crate::Inbox::classify
//! [`ErrorClass::Transient`]: crate::ErrorClass::Transient

use std::hash::{BuildHasher as _, Hasher as _};
use std::time::Duration;

use crate::message::{Properties, ReceivedMessage, Value};

/// The application property that counts a message's delayed redeliveries.
pub const REDELIVERY_COUNT_PROPERTY: &str = "twice-redelivery-count";

/// How the processor retries a failed attempt; see the [module docs](self).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    infrastructure_retries: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    immediate_retries: u32,
    delayed_redelivery: Vec<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            infrastructure_retries: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            immediate_retries: 0,
            delayed_redelivery: Vec::new(),
        }
    }
}

impl RetryPolicy {
    /// The defaults: 10 infrastructure retries with a backoff from 100 ms doubling up to 10 s;
    /// no immediate retries and no delayed redelivery of handler errors (they abandon at once).
    pub fn new() -> Self {
        Self::default()
    }

    /// How many times in a row an attempt that failed for the infrastructure is retried in
    /// process before the message is given up (0 gives it up at once): released when no
    /// handler ran, abandoned otherwise.
    #[must_use]
    pub fn infrastructure_retries(mut self, n: u32) -> Self {
        self.infrastructure_retries = n;
        self
    }

    /// How many times in a row an infrastructure failure is retried.
    pub fn get_infrastructure_retries(&self) -> u32 {
        self.infrastructure_retries
    }

    /// The backoff before the first infrastructure retry, doubled for each further one up to
    /// `max`. Each wait is drawn at random between half the backoff and all of it, so that
    /// processors that failed together do not retry together.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// The first and the longest backoff.
    pub fn get_backoff(&self) -> (Duration, Duration) {
        (self.initial_backoff, self.max_backoff)
    }

    /// How many times a handler error is retried at once, in process, before the message is
    /// redelivered later or abandoned.
    #[must_use]
    pub fn immediate_retries(mut self, n: u32) -> Self {
        self.immediate_retries = n;
        self
    }

    /// How many times a handler error is retried at once.
    pub fn get_immediate_retries(&self) -> u32 {
        self.immediate_retries
    }

    /// The delays after which a message whose handler failed (after the immediate retries) is
    /// delivered again, one per redelivery; the count so far travels with the message in
    /// [`REDELIVERY_COUNT_PROPERTY`].
    #[must_use]
    pub fn delayed_redelivery(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.delayed_redelivery = delays.into_iter().collect();
        self
    }

    /// The delays of delayed redelivery.
    pub fn get_delayed_redelivery(&self) -> &[Duration] {
        &self.delayed_redelivery
    }

    /// The wait before infrastructure retry number `retry` (1 for the first), with jitter.
    pub(crate) fn backoff_for(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(30);
        let full = self.initial_backoff.saturating_mul(1 << doublings).min(self.max_backoff);
        full / 2 + full.mul_f64(random_fraction() / 2.0)
    }

    /// The delay of the next delayed redelivery of `message`, and the properties that count
    /// it, or `None` when the delays are used up.
    pub(crate) fn next_redelivery(
        &self,
        message: &ReceivedMessage,
    ) -> Option<(Duration, Properties)> {
        let done = redelivery_count(message);
        let delay = *self.delayed_redelivery.get(usize::try_from(done).ok()?)?;
        let mut properties = Properties::new();
        properties.insert(REDELIVERY_COUNT_PROPERTY.to_owned(), Value::Uint(done + 1));
        Some((delay, properties))
    }
}

/// How many delayed redeliveries `message` has had.
pub fn redelivery_count(message: &ReceivedMessage) -> u32 {
    match message.message.application_properties.get(REDELIVERY_COUNT_PROPERTY) {
        Some(Value::Uint(n)) => *n,
        Some(Value::Int(n)) => u32::try_from(*n).unwrap_or(0),
        Some(Value::Long(n)) => u32::try_from(*n).unwrap_or(0),
        Some(Value::Ulong(n)) => u32::try_from(*n).unwrap_or(u32::MAX),
        _ => 0,
    }
}

/// 64 random bits, different from call to call (the standard library seeds each
/// `RandomState` afresh).
pub(crate) fn random_u64() -> u64 {
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

/// A number in [0, 1) that differs from call to call: jitter needs no more than this, so no
/// random-number crate. The standard library seeds each `RandomState` afresh.
fn random_fraction() -> f64 {
    let bits = random_u64() >> 11;
    // 53 bits fit an f64 exactly.
    #[allow(clippy::cast_precision_loss)] // reason: 53-bit value, exact in an f64
    let fraction = bits as f64 / (1_u64 << 53) as f64;
    fraction
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Message, SequenceNumber, Timestamp};

    #[test]
    fn backoff_doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        let policy = RetryPolicy::new().backoff(Duration::from_millis(100), Duration::from_secs(1));
        for (retry, full) in [(1, 100), (2, 200), (3, 400), (4, 800), (5, 1000), (40, 1000)] {
            for _ in 0..50 {
                let d = policy.backoff_for(retry);
                let full = Duration::from_millis(full);
                assert!(d >= full / 2 && d <= full, "retry {retry}: {d:?} outside {full:?}/2..");
            }
        }
        let draws: std::collections::BTreeSet<_> = (0..20).map(|_| policy.backoff_for(3)).collect();
        assert!(draws.len() > 1, "jitter: twenty equal waits {draws:?}");
    }

    #[test]
    fn delayed_redeliveries_are_counted_on_the_message() {
        let policy = RetryPolicy::new()
            .delayed_redelivery([Duration::from_secs(5), Duration::from_secs(60)]);
        let mut m = ReceivedMessage::new(
            Message::new("x"),
            SequenceNumber::new(1),
            Timestamp::from_millis(0),
        );
        let (delay, props) = policy.next_redelivery(&m).expect("first");
        assert_eq!(delay, Duration::from_secs(5));
        m.message.application_properties.extend(props);
        assert_eq!(redelivery_count(&m), 1);
        let (delay, props) = policy.next_redelivery(&m).expect("second");
        assert_eq!(delay, Duration::from_secs(60));
        m.message.application_properties.extend(props);
        assert_eq!(policy.next_redelivery(&m), None, "the delays are used up");
    }
}
