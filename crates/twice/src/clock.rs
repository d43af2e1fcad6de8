//! Time, read in one place.
//!
//! Lock expiry, time to live, the duplicate-detection window, scheduled messages, session locks
//! and lock renewal all read time through a [`Clock`]. Production code uses [`SystemClock`];
//! tests use [`ManualClock`] and move time forward instead of sleeping. This module is the only
//! place in twice allowed to read the system clock (`clippy.toml` bans it elsewhere).

use std::fmt;
use std::future::Future;
use std::ops::{Add, Sub};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// A point in time, in whole milliseconds since the Unix epoch (UTC), the precision of an AMQP
/// timestamp.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The Unix epoch.
    pub const UNIX_EPOCH: Timestamp = Timestamp(0);
    /// The latest representable time; used for "never".
    pub const MAX: Timestamp = Timestamp(i64::MAX);

    /// A timestamp from milliseconds since the Unix epoch.
    pub const fn from_millis(ms: i64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// A timestamp from a [`SystemTime`], saturating outside the representable range.
    pub fn from_system_time(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Self(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            Err(e) => Self(i64::try_from(e.duration().as_millis()).map_or(i64::MIN, |ms| -ms)),
        }
    }

    /// This timestamp as a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        if self.0 >= 0 {
            UNIX_EPOCH + Duration::from_millis(self.0.unsigned_abs())
        } else {
            UNIX_EPOCH - Duration::from_millis(self.0.unsigned_abs())
        }
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// `self - d`, saturating.
    #[must_use]
    pub fn saturating_sub(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_sub(ms))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        self.saturating_sub(d)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // RFC 3339 in UTC without pulling in a date crate.
        let ms = self.0.rem_euclid(1000);
        let secs = self.0.div_euclid(1000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            sod / 3600,
            sod % 3600 / 60,
            sod % 60
        )
    }
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// A source of time that can also wait for a deadline.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;

    /// Resolves once [`Clock::now`] has reached `deadline`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future has no effect.
    fn sleep_until(&self, deadline: Timestamp) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// A cheap, cloneable handle to a [`Clock`].
#[derive(Clone, Debug)]
pub struct SharedClock(Arc<dyn Clock>);

impl SharedClock {
    /// Wraps a clock.
    pub fn new(clock: impl Clock) -> Self {
        Self(Arc::new(clock))
    }

    /// The system clock.
    pub fn system() -> Self {
        Self::new(SystemClock)
    }

    /// The current time.
    pub fn now(&self) -> Timestamp {
        self.0.now()
    }

    /// Resolves once the clock has reached `deadline`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn sleep_until(&self, deadline: Timestamp) {
        self.0.sleep_until(deadline).await;
    }

    /// Resolves once `d` has passed on this clock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn sleep(&self, d: Duration) {
        let deadline = self.now() + d;
        self.sleep_until(deadline).await;
    }
}

impl Default for SharedClock {
    fn default() -> Self {
        Self::system()
    }
}

impl From<ManualClock> for SharedClock {
    fn from(c: ManualClock) -> Self {
        Self::new(c)
    }
}

/// The wall clock of the machine.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // reason: this is the one place that reads the clock
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }

    fn sleep_until(&self, deadline: Timestamp) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            // Sleep in slices so that a wall-clock jump cannot make us oversleep for long.
            loop {
                let now = self.now();
                if now >= deadline {
                    return;
                }
                let left = deadline.duration_since(now).min(Duration::from_secs(1));
                tokio::time::sleep(left).await;
            }
        })
    }
}

/// A clock that only moves when told to: tests advance it instead of sleeping.
///
/// Clones share the same time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    inner: Arc<ManualInner>,
}

#[derive(Debug)]
struct ManualInner {
    now: AtomicI64,
    changed: watch::Sender<i64>,
}

impl ManualClock {
    /// A clock that starts at `start`.
    pub fn new(start: Timestamp) -> Self {
        let (changed, _) = watch::channel(start.as_millis());
        Self { inner: Arc::new(ManualInner { now: AtomicI64::new(start.as_millis()), changed }) }
    }

    /// Moves time forward by `d`, waking every sleeper whose deadline has passed.
    pub fn advance(&self, d: Duration) {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let now = self.inner.now.fetch_add(ms, Ordering::SeqCst).saturating_add(ms);
        self.inner.changed.send_replace(now);
    }

    /// Sets the time. Moving it backwards is allowed (to test clock jumps) but wakes no one.
    pub fn set(&self, t: Timestamp) {
        self.inner.now.store(t.as_millis(), Ordering::SeqCst);
        self.inner.changed.send_replace(t.as_millis());
    }
}

impl Default for ManualClock {
    /// Starts at 2030-01-01T00:00:00Z, a fixed point so test output is stable.
    fn default() -> Self {
        Self::new(Timestamp::from_millis(1_893_456_000_000))
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.inner.now.load(Ordering::SeqCst))
    }

    fn sleep_until(&self, deadline: Timestamp) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        let mut rx = self.inner.changed.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, so an advance between `subscribe` and
            // here is not missed.
            let _ = rx.wait_for(|&now| now >= deadline.as_millis()).await;
        })
    }
}

/// Measures elapsed real time, for metrics only (claim latency, benchmarks).
///
/// Decisions (lock expiry, renewal, retention) never use it: they read a [`Clock`], which tests
/// move by hand. A stopwatch keeps running in real time under a [`ManualClock`], which is what a
/// latency measurement needs.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch(std::time::Instant);

impl Stopwatch {
    /// Starts measuring.
    #[allow(clippy::disallowed_methods)] // reason: a monotonic clock for metrics, never for decisions
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// The real time since [`Stopwatch::start`].
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_rfc3339() {
        assert_eq!(Timestamp::from_millis(0).to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Timestamp::from_millis(1_893_456_000_123).to_string(),
            "2030-01-01T00:00:00.123Z"
        );
        assert_eq!(Timestamp::from_millis(951_782_400_000).to_string(), "2000-02-29T00:00:00.000Z");
    }

    #[tokio::test]
    async fn manual_clock_wakes_sleepers_on_advance() {
        let clock = ManualClock::default();
        let shared = SharedClock::from(clock.clone());
        let deadline = shared.now() + Duration::from_secs(60);
        let sleeper = tokio::spawn({
            let shared = shared.clone();
            async move { shared.sleep_until(deadline).await }
        });
        clock.advance(Duration::from_secs(59));
        tokio::task::yield_now().await;
        assert!(!sleeper.is_finished());
        clock.advance(Duration::from_secs(1));
        sleeper.await.unwrap();
        assert_eq!(shared.now(), deadline);
    }
}
