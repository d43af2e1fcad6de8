//! Health checks: whether a processor is receiving, when it last completed a message, and
//! whether its inbox store answers.
//!
//! A processor is consumed by its `run`, so its health is read through a [`HealthHandle`]
//! taken before: [`Processor::health_handle`](crate::Processor::health_handle) or
//! [`SessionProcessor::health_handle`](crate::SessionProcessor::health_handle). The handle is
//! cheap to clone and stays valid after the run has ended.
//!
//! ```no_run
//! # async fn serve<T: twice::Transport, I: twice::Inbox, H: twice::Handler<I::Tx>>(
//! #     processor: twice::Processor<T, I, H>,
//! #     shutdown: impl std::future::Future<Output = ()> + Send,
//! # ) -> Result<(), twice::ProcessorError> {
//! let health = processor.health_handle();
//! // What a readiness endpoint answers, on every request.
//! let ready = async move {
//!     let report = health.check().await;
//!     if report.is_healthy() { 200 } else { 503 }
//! };
//! # let _ = ready;
//! processor.run(shutdown).await
//! # }
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use crate::clock::{SharedClock, Timestamp};
use crate::handler::BoxFuture;
use crate::inbox::Inbox;

/// How many receive waits (`max_wait`) may pass without a receive returning before the
/// processor counts as not receiving.
pub const RECEIVE_WAITS_TOLERATED: u32 = 3;

/// How long the inbox probe of [`HealthHandle::check`] waits by default.
pub const DEFAULT_INBOX_TIMEOUT: Duration = Duration::from_secs(5);

/// No time recorded.
const NONE: i64 = i64::MIN;

/// What a processor's run loop records for its health: shared by the processor, its run and
/// every [`HealthHandle`].
#[derive(Debug)]
pub(crate) struct Activity {
    /// Between the start of the run loop and its end.
    running: AtomicBool,
    /// When a receive (or session accept) last returned without an error.
    last_receive: AtomicI64,
    /// Since when the loop has waited for a receive that returns without an error; [`NONE`]
    /// while it does not wait for one.
    waiting_since: AtomicI64,
    /// When a message was last completed.
    last_completed: AtomicI64,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            running: AtomicBool::new(false),
            last_receive: AtomicI64::new(NONE),
            waiting_since: AtomicI64::new(NONE),
            last_completed: AtomicI64::new(NONE),
        }
    }
}

fn load(cell: &AtomicI64) -> Option<Timestamp> {
    let ms = cell.load(Ordering::SeqCst);
    (ms != NONE).then(|| Timestamp::from_millis(ms))
}

impl Activity {
    /// Marks the run loop as running until the returned guard is dropped.
    pub(crate) fn start(self: &Arc<Self>) -> Running {
        self.waiting_since.store(NONE, Ordering::SeqCst);
        self.running.store(true, Ordering::SeqCst);
        Running(Arc::clone(self))
    }

    /// A receive is about to be called at `now`; the wait counts from the first call since
    /// the last one that returned without an error.
    pub(crate) fn receive_started(&self, now: Timestamp) {
        let _ = self.waiting_since.compare_exchange(
            NONE,
            now.as_millis(),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// A receive returned without an error at `now` (with messages or none).
    pub(crate) fn received(&self, now: Timestamp) {
        self.last_receive.store(now.as_millis(), Ordering::SeqCst);
        self.waiting_since.store(NONE, Ordering::SeqCst);
    }

    /// A message was completed at `now`.
    pub(crate) fn completed(&self, now: Timestamp) {
        self.last_completed.store(now.as_millis(), Ordering::SeqCst);
    }
}

/// Marks the run loop as stopped when dropped, however the run ends.
#[derive(Debug)]
pub(crate) struct Running(Arc<Activity>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.store(false, Ordering::SeqCst);
    }
}

/// A processor's health, as [`HealthHandle::check`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// Whether the processor is receiving: its run loop is running, and it has not waited
    /// longer than [`RECEIVE_WAITS_TOLERATED`] × `max_wait` for a receive that returns without
    /// an error. A processor whose calls are all busy, and which therefore does not call
    /// receive, is receiving. False before the run and after it.
    pub receiving: bool,
    /// When a receive (or, for sessions, an accept) last returned without an error.
    pub last_receive_at: Option<Timestamp>,
    /// When a message was last completed (settled as complete, after its commit).
    pub last_completed_at: Option<Timestamp>,
    /// Whether a transaction could be begun and rolled back in the inbox store within the
    /// probe's timeout; the error says why not.
    pub inbox_reachable: Result<(), String>,
}

impl Health {
    /// Whether the processor is receiving and its inbox is reachable.
    pub fn is_healthy(&self) -> bool {
        self.receiving && self.inbox_reachable.is_ok()
    }
}

type Probe = Arc<dyn Fn(Duration) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A cloneable handle that checks a processor's health, before, during and after its run.
#[derive(Clone)]
pub struct HealthHandle {
    activity: Arc<Activity>,
    clock: SharedClock,
    max_wait: Duration,
    inbox_timeout: Duration,
    probe: Probe,
}

impl fmt::Debug for HealthHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthHandle")
            .field("activity", &self.activity)
            .field("max_wait", &self.max_wait)
            .field("inbox_timeout", &self.inbox_timeout)
            .finish_non_exhaustive()
    }
}

impl HealthHandle {
    pub(crate) fn new<I: Inbox>(
        activity: Arc<Activity>,
        inbox: Arc<I>,
        clock: SharedClock,
        max_wait: Duration,
    ) -> Self {
        let probe: Probe = Arc::new(move |timeout| {
            let inbox = Arc::clone(&inbox);
            Box::pin(async move { probe_inbox(inbox.as_ref(), timeout).await })
        });
        Self { activity, clock, max_wait, inbox_timeout: DEFAULT_INBOX_TIMEOUT, probe }
    }

    /// How long the inbox probe waits for a transaction to begin and roll back (default
    /// [`DEFAULT_INBOX_TIMEOUT`]).
    #[must_use]
    pub fn inbox_timeout(mut self, timeout: Duration) -> Self {
        self.inbox_timeout = timeout;
        self
    }

    /// Checks the processor's health now: reads what its run loop recorded and probes the
    /// inbox store by beginning a transaction and rolling it back.
    pub async fn check(&self) -> Health {
        let inbox_reachable = (self.probe)(self.inbox_timeout).await;
        Health {
            receiving: self.receiving(),
            last_receive_at: load(&self.activity.last_receive),
            last_completed_at: load(&self.activity.last_completed),
            inbox_reachable,
        }
    }

    /// Whether the processor is receiving; see [`Health::receiving`]. Does not probe the inbox.
    pub fn receiving(&self) -> bool {
        if !self.activity.running.load(Ordering::SeqCst) {
            return false;
        }
        load(&self.activity.waiting_since).is_none_or(|since| {
            self.clock.now().duration_since(since) <= self.max_wait * RECEIVE_WAITS_TOLERATED
        })
    }
}

/// Begins a transaction (bounded by `timeout`) and rolls it back.
async fn probe_inbox<I: Inbox>(inbox: &I, timeout: Duration) -> Result<(), String> {
    let probe = async {
        let tx = inbox.begin_within(Some(timeout)).await.map_err(|e| format!("begin: {e}"))?;
        inbox.rollback(tx).await.map_err(|e| format!("rollback: {e}"))
    };
    match tokio::time::timeout(timeout, probe).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
