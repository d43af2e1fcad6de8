//! The session processor: one receiver per session, a session's messages one at a time and in
//! order, each through the same inbox claim as [`Processor`](crate::Processor).
//!
//! Sessions remove the race between messages of one entity (say, one order) but do not replace
//! the claim: a redelivered message still comes back through the same session.
//!
//! The session lock is renewed in the background until
//! [`max_auto_lock_renewal_duration`](SessionProcessorOptions::max_auto_lock_renewal_duration);
//! when it is lost, the message in flight is rolled back and the session given up. A session
//! that brings no message for [`session_idle_timeout`](SessionProcessorOptions::session_idle_timeout)
//! is closed so another can be accepted.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

use crate::clock::{SharedClock, Timestamp};
use crate::counters::Counters;
use crate::error::{ErrorSource, ProcessError, ProcessorError};
use crate::handler::Handler;
use crate::inbox::Inbox;
use crate::message::{Properties, ReceivedMessage};
use crate::processor::{
    Core, LockState, Mode, Settlement, Settler, check_connections, check_retention, keep_lock,
    renewal_margin,
};
use crate::retry::RetryPolicy;
use crate::transport::{SessionReceiver, SessionTransport, TransportError};

/// Options of a [`SessionProcessor`], with Service Bus names and defaults.
#[derive(Clone, Debug)]
pub struct SessionProcessorOptions {
    consumer: Option<String>,
    max_concurrent_sessions: usize,
    max_auto_lock_renewal_duration: Duration,
    session_idle_timeout: Duration,
    max_wait: Duration,
    mode: Mode,
    retry: RetryPolicy,
    clock: SharedClock,
}

impl Default for SessionProcessorOptions {
    fn default() -> Self {
        Self {
            consumer: None,
            max_concurrent_sessions: 8,
            max_auto_lock_renewal_duration: Duration::from_secs(300),
            session_idle_timeout: Duration::from_secs(60),
            max_wait: Duration::from_secs(60),
            mode: Mode::Claim,
            retry: RetryPolicy::default(),
            clock: SharedClock::system(),
        }
    }
}

impl SessionProcessorOptions {
    /// The defaults: consumer = entity path, MaxConcurrentSessions 8, session lock renewal for
    /// up to 5 minutes, session idle timeout 60 s, [`Mode::Claim`], the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// The consumer name, the scope of the inbox key (default: the entity path).
    #[must_use]
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = Some(consumer.into());
        self
    }

    /// How many sessions are processed at once (default 8; at least 1).
    #[must_use]
    pub fn max_concurrent_sessions(mut self, n: usize) -> Self {
        self.max_concurrent_sessions = n.max(1);
        self
    }

    /// How many sessions are processed at once.
    pub fn get_max_concurrent_sessions(&self) -> usize {
        self.max_concurrent_sessions
    }

    /// How long after it is accepted a session's lock is renewed (default 5 minutes).
    #[must_use]
    pub fn max_auto_lock_renewal_duration(mut self, d: Duration) -> Self {
        self.max_auto_lock_renewal_duration = d;
        self
    }

    /// How long after it is accepted a session's lock is renewed.
    pub fn get_max_auto_lock_renewal_duration(&self) -> Duration {
        self.max_auto_lock_renewal_duration
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

    /// How long one accept call waits for a session (default 60 s).
    #[must_use]
    pub fn max_wait(mut self, d: Duration) -> Self {
        self.max_wait = d;
        self
    }

    /// How the handler's work is protected (default [`Mode::Claim`]).
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// How failed attempts are retried (default [`RetryPolicy::new`]). Delayed redelivery does
    /// not apply to sessions, whose messages keep their order: a handler error whose immediate
    /// retries are used up abandons the message.
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How failed attempts are retried.
    pub fn get_retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The clock (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
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
            Settlement::DeadLetter(reason) => self.0.dead_letter(delivery, reason).await,
            Settlement::Defer => self.0.defer(delivery).await,
            // A session's messages keep their order: one cannot come back later than the next.
            Settlement::RedeliverLater { .. } => {
                Err(TransportError::Unsupported("delayed redelivery in a session"))
            }
        }
    }
}

type ErrorCallback = Arc<dyn Fn(&ProcessError) + Send + Sync>;
type CommitHook = Arc<dyn Fn(&ReceivedMessage) + Send + Sync>;

/// Accepts sessions from a [`SessionTransport`] and processes each session's messages one at a
/// time, in order, through the inbox claim; see the [module docs](self).
pub struct SessionProcessor<T: SessionTransport, I: Inbox, H> {
    transport: Arc<T>,
    inbox: Arc<I>,
    handler: Arc<H>,
    options: SessionProcessorOptions,
    counters: Arc<Counters>,
    on_error: Option<ErrorCallback>,
    on_committed: Option<CommitHook>,
    on_business_key: Option<crate::processor::BusinessKeyHook>,
}

impl<T: SessionTransport, I: Inbox, H> fmt::Debug for SessionProcessor<T, I, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionProcessor")
            .field("transport", &self.transport)
            .field("inbox", &self.inbox)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<T, I, H> SessionProcessor<T, I, H>
where
    T: SessionTransport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// A session processor of `transport`'s sessions with `handler`, claiming in `inbox`.
    pub fn new(transport: T, inbox: I, handler: H, options: SessionProcessorOptions) -> Self {
        Self::from_arcs(Arc::new(transport), Arc::new(inbox), Arc::new(handler), options)
    }

    /// As [`SessionProcessor::new`], sharing a transport, inbox or handler.
    pub fn from_arcs(
        transport: Arc<T>,
        inbox: Arc<I>,
        handler: Arc<H>,
        options: SessionProcessorOptions,
    ) -> Self {
        Self {
            transport,
            inbox,
            handler,
            options,
            counters: Arc::default(),
            on_error: None,
            on_committed: None,
            on_business_key: None,
        }
    }

    /// Calls `f` with every error that does not stop the processor; see
    /// [`Processor::on_error`](crate::Processor::on_error).
    #[must_use]
    pub fn on_error(mut self, f: impl Fn(&ProcessError) + Send + Sync + 'static) -> Self {
        self.on_error = Some(Arc::new(f));
        self
    }

    /// Calls `f` after a commit and before the completion; see
    /// [`Processor::on_committed`](crate::Processor::on_committed).
    #[must_use]
    pub fn on_committed(mut self, f: impl Fn(&ReceivedMessage) + Send + Sync + 'static) -> Self {
        self.on_committed = Some(Arc::new(f));
        self
    }

    /// As [`Processor::on_business_key_duplicate`](crate::Processor::on_business_key_duplicate).
    #[must_use]
    pub fn on_business_key_duplicate(
        mut self,
        f: impl Fn(&crate::BusinessKeyDuplicate) + Send + Sync + 'static,
    ) -> Self {
        self.on_business_key = Some(Arc::new(f));
        self
    }

    /// The processor's counters, live while it runs.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// The consumer name the inbox keys are scoped to.
    pub fn consumer(&self) -> &str {
        self.options.consumer.as_deref().unwrap_or(&self.transport.entity().path)
    }

    /// Checks the inbox retention against the redelivery horizon; see
    /// [`Processor::check`](crate::Processor::check).
    ///
    /// # Errors
    ///
    /// [`ProcessorError::RetentionTooShort`], or [`ProcessorError::InvalidOptions`] when the
    /// inbox has fewer connections than MaxConcurrentSessions, naming the numbers.
    pub fn check(&self) -> Result<(), ProcessorError> {
        check_connections(
            self.inbox.as_ref(),
            self.options.max_concurrent_sessions,
            "MaxConcurrentSessions",
        )?;
        if self.options.mode == Mode::NaturallyIdempotent {
            return Ok(());
        }
        check_retention(
            self.transport.entity(),
            self.inbox.retention(),
            self.options.max_auto_lock_renewal_duration,
        )
    }

    /// Runs until `shutdown` resolves: accepts up to MaxConcurrentSessions sessions at once,
    /// each in a task that owns a semaphore permit. On shutdown it stops accepting, lets each
    /// session finish the message in flight, and closes the sessions.
    ///
    /// # Errors
    ///
    /// Refuses to start when [`SessionProcessor::check`] fails; stops with
    /// [`ProcessorError::Transport`] when the transport closes.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ProcessorError> {
        self.check()?;
        let options = self.options.clone();
        let core = Arc::new(Core {
            inbox: self.inbox.clone(),
            handler: self.handler.clone(),
            consumer: self.consumer().to_owned(),
            mode: options.mode,
            retry: options.retry.clone(),
            clock: options.clock.clone(),
            counters: self.counters.clone(),
            on_error: self.on_error.clone(),
            on_committed: self.on_committed.clone(),
            on_business_key: self.on_business_key.clone(),
        });
        let transport = self.transport;
        let semaphore = Arc::new(Semaphore::new(options.max_concurrent_sessions));
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut shutdown = std::pin::pin!(shutdown);

        let result = loop {
            while let Some(joined) = tasks.try_join_next() {
                if let Err(e) = joined {
                    core.report(ProcessError::new(ErrorSource::Handler, None, e));
                }
            }
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                p = Arc::clone(&semaphore).acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break Ok(()),
                },
            };
            let accepted = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                r = transport.accept_next_session(options.max_wait) => r,
            };
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
            if let Err(e) = joined {
                core.report(ProcessError::new(ErrorSource::Handler, None, e));
            }
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
    let renew_until = accepted_at + options.max_auto_lock_renewal_duration;
    let keeper = async {
        keep_lock(&core, &lock, renew_until, margin, None, || session.renew_session_lock()).await;
        let _ = lost_tx.send(true);
        std::future::pending::<()>().await;
    };
    let settler = SessionSettler(&session);
    let work = async {
        loop {
            if *stop.borrow() || !lock.held(clock.now()) {
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
                        core.process(
                            &settler,
                            &delivery,
                            received_at,
                            &lock,
                            flag_set(lost_rx.clone()),
                        )
                        .await;
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
