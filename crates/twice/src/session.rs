//! The session processor: one receiver per session, a session's messages one at a time and in
//! order, each through the same inbox claim as [`Processor`](crate::Processor).
//!
//! Sessions remove the race between messages of one entity (say, one order) but do not replace
//! the claim: a redelivered message still comes back through the same session.
//!
//! The session lock is renewed in the background for as long as the session is held: while the
//! session waits for its next message, and while a message is processed, for up to
//! [`max_auto_lock_renewal_duration`](SessionProcessorOptions::max_auto_lock_renewal_duration)
//! from that message's receipt (so a handler that hangs still loses the lock in the end); when
//! it is lost, the message in flight is rolled back and the session given up. A session that
//! brings no message for
//! [`session_idle_timeout`](SessionProcessorOptions::session_idle_timeout) is closed so another
//! can be accepted, and one held for
//! [`max_session_hold_duration`](SessionProcessorOptions::max_session_hold_duration) (if set)
//! is closed after its message in flight, so that a busy session does not keep its receiver
//! from the others.
//!
//! A message is settled in line, before the session's next message is received: unlike the
//! [`Processor`](crate::Processor), which settles in the background once the transaction has
//! ended, a session must not let its next message overtake this one's settlement (an abandoned
//! message comes back first, in order).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use crate::clock::{SharedClock, Timestamp};
use crate::error::{ErrorSource, ProcessError, ProcessorError};
use crate::handler::Handler;
use crate::inbox::Inbox;
use crate::message::Properties;
use crate::processor::{
    Core, LockState, Mode, Settlement, Settler, keep_lock, processor_type, renewal_margin,
    report_join, shared_options,
};
use crate::retry::RetryPolicy;
use crate::transport::{
    Delivery as _, Receive as _, SessionReceiver, SessionTransport, TransportError,
};

/// Options of a [`SessionProcessor`], with Service Bus names and defaults.
#[derive(Clone, Debug)]
pub struct SessionProcessorOptions {
    consumer: Option<String>,
    max_concurrent_sessions: usize,
    max_auto_lock_renewal_duration: Duration,
    session_idle_timeout: Duration,
    max_session_hold_duration: Option<Duration>,
    max_wait: Duration,
    mode: Mode,
    retry: RetryPolicy,
    clock: SharedClock,
    max_resubmit_age: Option<Duration>,
}

impl Default for SessionProcessorOptions {
    fn default() -> Self {
        Self {
            consumer: None,
            max_concurrent_sessions: 8,
            max_auto_lock_renewal_duration: Duration::from_secs(300),
            session_idle_timeout: Duration::from_secs(60),
            max_session_hold_duration: None,
            max_wait: Duration::from_secs(60),
            mode: Mode::Claim,
            retry: RetryPolicy::default(),
            clock: SharedClock::system(),
            max_resubmit_age: None,
        }
    }
}

impl SessionProcessorOptions {
    /// The defaults: consumer = entity path, MaxConcurrentSessions 8, the session lock renewed
    /// for as long as the session is held (up to 5 minutes from the receipt of the message in
    /// flight), session idle timeout 60 s, no limit on how long a session is held,
    /// [`Mode::Claim`], the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    shared_options! {
        max_concurrent_sessions / get_max_concurrent_sessions ("MaxConcurrentSessions"):
            "How many sessions are processed at once (default 8; at least 1).",
        max_auto_lock_renewal_duration: "How long after the receipt of a message the session's \
            lock is renewed while that message is processed (default 5 minutes; zero: not \
            while a message is processed). Between messages the lock is renewed while the \
            session waits for its next one, so a session whose messages keep coming is held \
            as long as they do; see [`Self::max_session_hold_duration`] to bound that.",
        max_wait: "How long one accept call waits for a session (default 60 s).",
        retry: "How failed attempts are retried (default [`RetryPolicy::new`]). Delayed \
            redelivery does not apply to sessions, whose messages keep their order: a handler \
            error whose immediate retries are used up abandons the message.",
        clock: "The clock (default: the system clock).",
    }

    /// How long to wait for a session's next message before closing it (default 60 s).
    #[must_use]
    pub fn session_idle_timeout(mut self, d: Duration) -> Self {
        self.session_idle_timeout = d;
        self
    }

    /// How long to wait for a session's next message before closing it.
    pub fn get_session_idle_timeout(&self) -> Duration {
        self.session_idle_timeout
    }

    /// The longest a session is held (default `None`: as long as its messages keep coming):
    /// once it has been held this long, it is closed after the message in flight, and its
    /// remaining messages wait for the next accept (by this receiver or another).
    #[must_use]
    pub fn max_session_hold_duration(mut self, d: Option<Duration>) -> Self {
        self.max_session_hold_duration = d;
        self
    }

    /// The longest a session is held, if bounded.
    pub fn get_max_session_hold_duration(&self) -> Option<Duration> {
        self.max_session_hold_duration
    }
}

/// Settles through a session receiver.
struct SessionSettler<'s, R>(&'s R);

impl<R: SessionReceiver> Settler for SessionSettler<'_, R> {
    type Delivery = R::Delivery;

    async fn settle<'a>(
        &'a self,
        delivery: &'a R::Delivery,
        how: Settlement,
    ) -> Result<(), TransportError> {
        match how {
            Settlement::Complete => self.0.complete(delivery).await,
            Settlement::Abandon => self.0.abandon(delivery, Properties::new()).await,
            Settlement::Release => self.0.release(delivery).await,
            Settlement::DeadLetter(reason) => self.0.dead_letter(delivery, reason).await,
            Settlement::Defer => self.0.defer(delivery).await,
            // A session's messages keep their order: one cannot come back later than the next.
            Settlement::RedeliverLater { .. } => {
                Err(TransportError::Unsupported("delayed redelivery in a session"))
            }
        }
    }
}

processor_type! {
    /// Accepts sessions from a [`SessionTransport`] and processes each session's messages one
    /// at a time, in order, through the inbox claim; see the [module docs](crate::session).
    pub struct SessionProcessor<T: SessionTransport> { options: SessionProcessorOptions }

    /// A session processor of `transport`'s sessions with `handler`, claiming in `inbox`.
    fn new;

    /// Runs until `shutdown` resolves: accepts up to MaxConcurrentSessions sessions at once,
    /// each in a task that owns a semaphore permit. On shutdown it stops accepting, lets each
    /// session finish the message in flight, and closes the sessions.
    ///
    /// # Errors
    ///
    /// Refuses to start when [`SessionProcessor::check`] fails; stops with
    /// [`ProcessorError::Transport`] when the transport closes.
    ///
    /// # Cancel safety
    ///
    /// Resolve `shutdown` to stop: `run` then lets each session finish its message in flight
    /// (and settle it) and closes the sessions before it returns. Dropping the future instead
    /// stops everything where it is: the handlers in flight are dropped and their
    /// transactions roll back, a settlement not yet handed to the transport is never sent, and
    /// the sessions are not closed, so their locks run out (counting a delivery for a message
    /// still locked). As with [`Processor::run`](crate::Processor::run), nothing is done
    /// twice: a committed message whose completion did not go out meets its claim when it
    /// comes back.
    fn run;
}

impl<T, I, H> SessionProcessor<T, I, H>
where
    T: SessionTransport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// The accept loop of [`SessionProcessor::run`], after the check.
    async fn serve(
        transport: Arc<T>,
        options: SessionProcessorOptions,
        core: Arc<Core<I, H>>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ProcessorError> {
        let semaphore = Arc::new(Semaphore::new(options.max_concurrent_sessions));
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
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
                    Err(_) => break Ok(()),
                },
            };
            core.activity.receive_started(options.clock.now());
            let accepted = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                r = transport.accept_next_session(options.max_wait) => r,
            };
            if accepted.is_ok() {
                core.activity.received(options.clock.now());
            }
            match accepted {
                Ok(Some(session)) => {
                    tasks.spawn(run_session(
                        Arc::clone(&core),
                        session,
                        options.clone(),
                        Arc::clone(&transport),
                        stop_rx.clone(),
                        permit,
                    ));
                }
                Ok(None) => {}
                Err(TransportError::Closed) => {
                    break Err(ProcessorError::Transport(TransportError::Closed));
                }
                Err(e) => {
                    core.report(ProcessError::new(ErrorSource::Receive, None, e));
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break Ok(()),
                        () = options.clock.sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        };
        let _ = stop_tx.send(true);
        while let Some(joined) = tasks.join_next().await {
            report_join(&core, joined);
        }
        result
    }
}

/// Waits until the flag in `rx` is set; never resolves if its sender is gone unset.
///
/// # Cancel safety
///
/// Cancel safe.
async fn flag_set(mut rx: watch::Receiver<bool>) {
    if rx.wait_for(|set| *set).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One session in its own task: its messages one at a time, while its lock is kept.
async fn run_session<T, I, H>(
    core: Arc<Core<I, H>>,
    session: T::Session,
    options: SessionProcessorOptions,
    transport: Arc<T>,
    stop: watch::Receiver<bool>,
    permit: OwnedSemaphorePermit,
) where
    T: SessionTransport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    let clock = core.clock.clone();
    let accepted_at = clock.now();
    let lock = LockState::new(Some(session.locked_until()));
    let (lost_tx, lost_rx) = watch::channel(false);
    let margin = renewal_margin(transport.entity().lock_duration);
    // The session lock is renewed for as long as the session is held: without a limit while
    // the session waits for its next message (a wait `session_idle_timeout` bounds), and for
    // `max_auto_lock_renewal_duration` from the receipt of each message while it is processed.
    let (limit_tx, limit) = watch::channel(Timestamp::MAX);
    let keeper = async {
        keep_lock(&core, &lock, limit, margin, None, || session.renew_session_lock()).await;
        let _ = lost_tx.send(true);
        std::future::pending::<()>().await;
    };
    let settler = SessionSettler(&session);
    let held_until = options.max_session_hold_duration.map(|d| accepted_at + d);
    let work = async {
        loop {
            if *stop.borrow() || !lock.held(clock.now()) {
                return;
            }
            if held_until.is_some_and(|end| clock.now() >= end) {
                // Held long enough: let it go, so that other sessions get their turn.
                return;
            }
            let received = tokio::select! {
                biased;
                () = flag_set(stop.clone()) => return,
                () = flag_set(lost_rx.clone()) => return,
                r = session.receive(1, options.session_idle_timeout) => r,
            };
            match received {
                Ok(deliveries) if deliveries.is_empty() => return,
                Ok(deliveries) => {
                    for delivery in deliveries {
                        let received_at: Timestamp = clock.now();
                        limit_tx.send_replace(received_at + options.max_auto_lock_renewal_duration);
                        let span = core.span(delivery.message());
                        core.process(
                            &settler,
                            &delivery,
                            received_at,
                            &lock,
                            flag_set(lost_rx.clone()),
                        )
                        .instrument(span)
                        .await;
                        limit_tx.send_replace(Timestamp::MAX);
                    }
                }
                Err(e) if e.is_lock_lost() => return,
                Err(e) => {
                    core.report(ProcessError::new(ErrorSource::Receive, None, e));
                    return;
                }
            }
        }
    };
    tokio::select! {
        () = work => {}
        () = keeper => {}
    }
    let session_id = session.session_id().clone();
    match session.close().await {
        Ok(()) => {}
        Err(e) if e.is_lock_lost() => {}
        Err(e) => core.report(ProcessError::new(
            ErrorSource::Settle,
            None,
            format!("closing session {session_id}: {e}"),
        )),
    }
    drop(permit);
}
