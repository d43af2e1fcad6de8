//! Keeping the lock of the message (or session) being processed.

use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use super::shared::Core;
use crate::clock::Timestamp;
use crate::counters::Counter;
use crate::error::{ErrorSource, ProcessError};
use crate::transport::TransportError;

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
