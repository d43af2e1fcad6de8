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

/// How far a lock may be renewed: a moment that can move, as a session's limit moves with
/// each of its messages. A processor's limit for one message never moves.
pub(crate) type RenewLimit = tokio::sync::watch::Receiver<Timestamp>;

/// A limit that never moves.
pub(crate) fn fixed_limit(until: Timestamp) -> RenewLimit {
    // The receiver keeps the value after the sender is gone; `limit_moved` then never fires.
    tokio::sync::watch::channel(until).1
}

/// Resolves when the limit moves; never, once it cannot move any more.
///
/// # Cancel safety
///
/// Cancel safe.
async fn limit_moved(limit: &mut RenewLimit) {
    if limit.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Renews a lock until the renewal limit; resolves when the lock is lost (a renewal is refused,
/// or the lock runs out).
///
/// A renewal is due `margin` before the lock runs out, but never sooner than half the time the
/// lock has left, so that a renewal which extends the lock by less than the margin (a lock
/// shorter than the entity's properties said) is not followed at once by the next. A renewal
/// that does not extend the lock at all (the broker's own limit is reached, as RabbitMQ's
/// `consumer_timeout`) ends the renewing: the keeper then waits for the lock to run out
/// instead of asking again in a loop.
///
/// # Cancel safety
///
/// Cancel safe: dropped, it stops renewing; a renewal in flight may still be applied by the
/// broker.
pub(crate) async fn keep_lock<I, H, F, Fut>(
    core: &Core<I, H>,
    lock: &LockState,
    mut limit: RenewLimit,
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
    // Whether a renewal can still extend the lock.
    let mut extendable = true;
    loop {
        let until = lock.locked_until();
        let now = clock.now();
        if until <= now {
            lock.set_lost();
            return;
        }
        let renew_at = (until - margin).max(now + until.duration_since(now) / 2);
        if !extendable || renew_at >= *limit.borrow_and_update() {
            // Nothing more to renew: wait for the lock to run out, unless the limit moves.
            tokio::select! {
                biased;
                () = clock.sleep_until(until) => {
                    lock.set_lost();
                    return;
                }
                () = limit_moved(&mut limit), if extendable => continue,
            }
        }
        clock.sleep_until(renew_at).await;
        match renew().await {
            Ok(new_until) => {
                core.counters.inc(Counter::Renewals);
                if new_until <= until {
                    tracing::debug!(
                        message_id = ?id,
                        locked_until = %new_until,
                        "the renewal did not extend the lock; no more renewals"
                    );
                    extendable = false;
                }
                lock.set(new_until);
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

/// Runs `work` to its end while `keeper` keeps the lock (or locks) it needs. A keeper that
/// returns (the lock is lost) has nothing more to do; `work` goes on alone.
pub(crate) async fn keeping_locks(
    work: impl Future<Output = ()>,
    keeper: impl Future<Output = ()>,
) {
    let keep = async {
        keeper.await;
        std::future::pending::<()>().await;
    };
    tokio::select! {
        biased;
        () = work => {}
        () = keep => {}
    }
}
