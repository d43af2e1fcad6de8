//! The lock this transport keeps for RabbitMQ, which has none with a duration.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use twice::{SharedClock, Timestamp};

/// The lock of one delivery: until when it holds, and whether a settlement (or the expiry) has
/// taken the delivery. Both count from the moment the delivery reached the client.
pub(crate) struct Lock {
    settled: AtomicBool,
    locked_until: AtomicI64,
    /// No renewal goes past this: the broker's `consumer_timeout` after the delivery.
    limit: Timestamp,
    /// The transport's count of locks held, which this lock is part of until it ends.
    held: Arc<AtomicU64>,
    // A std Mutex: set once and taken once, never held across an await.
    expiry: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Lock {
    pub(crate) fn new(until: Timestamp, limit: Timestamp, held: Arc<AtomicU64>) -> Self {
        held.fetch_add(1, Ordering::SeqCst);
        Self {
            settled: AtomicBool::new(false),
            locked_until: AtomicI64::new(until.min(limit).as_millis()),
            limit,
            held,
            expiry: Mutex::new(None),
        }
    }

    pub(crate) fn locked_until(&self) -> Timestamp {
        Timestamp::from_millis(self.locked_until.load(Ordering::SeqCst))
    }

    /// Whether the lock still holds at `now` (neither settled nor run out).
    pub(crate) fn holds(&self, now: Timestamp) -> bool {
        !self.settled.load(Ordering::SeqCst) && now < self.locked_until()
    }

    /// Takes the delivery for a settlement: true once, and only while the lock holds.
    pub(crate) fn take(&self, now: Timestamp) -> bool {
        if now >= self.locked_until() {
            // The expiry task returns it (or already has).
            return false;
        }
        self.take_now()
    }

    /// Takes the delivery whatever the time (the transport moves it instead of handing it
    /// out): true once.
    pub(crate) fn take_now(&self) -> bool {
        let taken = self.settled.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst);
        if taken.is_ok() {
            self.held.fetch_sub(1, Ordering::SeqCst);
            if let Some(task) =
                self.expiry.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
            {
                task.abort();
            }
        }
        taken.is_ok()
    }

    /// Extends the lock by `d` from `now`, never past the limit; `None` when the lock is lost.
    pub(crate) fn renew(&self, now: Timestamp, d: std::time::Duration) -> Option<Timestamp> {
        if self.settled.load(Ordering::SeqCst) || now >= self.locked_until() {
            return None;
        }
        let until = (now + d).min(self.limit);
        if until <= now {
            return None;
        }
        self.locked_until.store(until.as_millis(), Ordering::SeqCst);
        Some(until)
    }

    /// Runs `on_expiry` (which returns the delivery to the queue, counting a delivery) when the
    /// lock runs out unsettled.
    pub(crate) fn expire_later(
        lock: &Arc<Self>,
        clock: SharedClock,
        on_expiry: impl FnOnce() -> BoxFuture<'static, ()> + Send + 'static,
    ) {
        let this = Arc::clone(lock);
        let task = tokio::spawn(async move {
            loop {
                let until = this.locked_until();
                clock.sleep_until(until).await;
                if clock.now() < this.locked_until() {
                    continue; // renewed meanwhile
                }
                let expired =
                    this.settled.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst);
                if expired.is_ok() {
                    this.held.fetch_sub(1, Ordering::SeqCst);
                    on_expiry().await;
                }
                return;
            }
        });
        *lock.expiry.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(task.abort_handle());
    }
}
