//! What the kit puts around the processor to see and steer it: the history of a scenario, a
//! transport that records deliveries and settlements (and loses them once "crashed"), of an
//! entity or of its sessions, and a handler wrapper that records runs and injects the
//! scenario's fault after the handler's own work.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use twice::{
    BoxFuture, Context, DeadLetterReason, Handler, HandlerError, Outcome, Properties, Receive,
    ReceivedMessage, SessionId, SessionReceiver, SessionTransport, Timestamp, Transport,
    TransportError,
};
use twice_broker::{Receiver, Session};

use super::cut::CommitCut;

/// One thing that happened in a scenario; `p` is the simulated processor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Event {
    Sent {
        id: String,
    },
    /// A copy of a message of the session sent again with its id, after later ones.
    SentAgain {
        id: String,
    },
    Delivered {
        p: usize,
        id: String,
        delivery: u32,
    },
    HandlerStarted {
        p: usize,
        id: String,
        delivery: u32,
    },
    HandlerReturned {
        p: usize,
        id: String,
        result: String,
    },
    HandlerPanicked {
        p: usize,
        id: String,
    },
    HandlerCancelled {
        p: usize,
        id: String,
    },
    Fault {
        p: usize,
        id: String,
        what: &'static str,
    },
    Committed {
        p: usize,
        id: String,
    },
    /// The outcome of a claim (or of a dedup-only record).
    Claim {
        p: usize,
        id: String,
        outcome: &'static str,
    },
    /// A COMMIT whose connection was cut: the processor does not know whether it committed.
    CommitUnknown {
        p: usize,
        id: String,
        reached_server: bool,
        error: String,
    },
    Crashed {
        p: usize,
        id: String,
    },
    Completed {
        p: usize,
        id: String,
    },
    CompletedWithoutEffect {
        p: usize,
        id: String,
        effect: String,
        key: String,
    },
    Abandoned {
        p: usize,
        id: String,
    },
    DeadLettered {
        p: usize,
        id: String,
        reason: String,
    },
    Deferred {
        p: usize,
        id: String,
    },
    Released {
        p: usize,
        id: String,
    },
    SettlementLost {
        p: usize,
        id: String,
    },
    Resubmitted {
        id: String,
    },
    ClockAdvanced {
        by: Duration,
    },
    ProcessorStarted {
        p: usize,
        renewal: bool,
    },
    ProcessorStopped {
        p: usize,
        how: &'static str,
    },
    Error {
        p: usize,
        text: String,
    },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Sent { id } => write!(f, "sent {id}"),
            Event::SentAgain { id } => {
                write!(f, "sent {id} again with its id, after a later message of its session")
            }
            Event::Delivered { p, id, delivery } => {
                write!(f, "p{p} received {id} (delivery {delivery})")
            }
            Event::HandlerStarted { p, id, delivery } => {
                write!(f, "p{p} handler started on {id} (delivery {delivery})")
            }
            Event::HandlerReturned { p, id, result } => {
                write!(f, "p{p} handler returned {result} for {id}")
            }
            Event::HandlerPanicked { p, id } => write!(f, "p{p} handler PANICKED on {id}"),
            Event::HandlerCancelled { p, id } => {
                write!(f, "p{p} handler on {id} was stopped (dropped)")
            }
            Event::Fault { p, id, what } => write!(f, "p{p} fault on {id}: {what}"),
            Event::Committed { p, id } => write!(f, "p{p} committed {id}"),
            Event::Claim { p, id, outcome } => write!(f, "p{p} claim of {id}: {outcome}"),
            Event::CommitUnknown { p, id, reached_server, error } => write!(
                f,
                "p{p} does not know whether {id} committed ({error}); the server {}",
                if *reached_server {
                    "got the COMMIT: committed"
                } else {
                    "never got the COMMIT: rolled back"
                }
            ),
            Event::Crashed { p, id } => write!(f, "p{p} crashed after committing {id}"),
            Event::Completed { p, id } => write!(f, "p{p} completed {id}"),
            Event::CompletedWithoutEffect { p, id, effect, key } => {
                write!(f, "p{p} completed {id} while effect {effect:?} had nothing for key {key:?}")
            }
            Event::Abandoned { p, id } => write!(f, "p{p} abandoned {id}"),
            Event::DeadLettered { p, id, reason } => {
                write!(f, "p{p} dead-lettered {id} ({reason})")
            }
            Event::Deferred { p, id } => write!(f, "p{p} deferred {id}"),
            Event::Released { p, id } => write!(f, "p{p} released {id}"),
            Event::SettlementLost { p, id } => {
                write!(f, "p{p} lost the settlement of {id} in its crash")
            }
            Event::Resubmitted { id } => write!(f, "resubmitted {id} from the dead-letter queue"),
            Event::ClockAdvanced { by } => write!(f, "clock advanced {by:?}"),
            Event::ProcessorStarted { p, renewal } => {
                write!(f, "p{p} started (lock renewal {})", if *renewal { "on" } else { "off" })
            }
            Event::ProcessorStopped { p, how } => write!(f, "p{p} {how}"),
            Event::Error { p, text } => write!(f, "p{p} error: {text}"),
        }
    }
}

/// What the handler wrapper does after the handler returned `Complete` on a message's first
/// run under a fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    /// Wait there (before the commit) until released, or dropped.
    Hold,
    /// Fail the attempt with a transient error.
    Fail,
    /// Dead-letter the message instead (its work rolls back).
    DeadLetter,
}

/// Checks, as a message is about to be completed, that each of its effects is already there;
/// returns the `(effect, key)` pairs that are not.
pub(super) type CompletionCheck =
    Arc<dyn Fn(ReceivedMessage) -> BoxFuture<'static, Vec<(String, String)>> + Send + Sync>;

/// The shared state of one scenario.
pub(super) struct Probe {
    events: Mutex<Vec<Event>>,
    actions: Mutex<HashMap<String, Action>>,
    crash_on_commit: Mutex<HashSet<String>>,
    crash_before_claim: Mutex<HashSet<String>>,
    /// Messages whose COMMIT meets a cut connection, and whether it is cut before the server
    /// gets it.
    commit_cuts: Mutex<HashMap<String, bool>>,
    /// The proxy's cut, in the scenario whose pool goes through one.
    cut: Mutex<Option<CommitCut>>,
    held: Mutex<Option<(String, usize)>>,
    released: AtomicBool,
    wake: Notify,
    completion: CompletionCheck,
    /// Settlements under way: the broker may have settled while their events are not yet
    /// recorded.
    settling: AtomicUsize,
}

impl fmt::Debug for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probe").field("events", &self.lock_events().len()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Probe {
    pub(super) fn new(completion: CompletionCheck) -> Self {
        Self {
            events: Mutex::default(),
            actions: Mutex::default(),
            crash_on_commit: Mutex::default(),
            crash_before_claim: Mutex::default(),
            commit_cuts: Mutex::default(),
            cut: Mutex::default(),
            held: Mutex::default(),
            released: AtomicBool::new(false),
            wake: Notify::new(),
            completion,
            settling: AtomicUsize::new(0),
        }
    }

    fn lock_events(&self) -> MutexGuard<'_, Vec<Event>> {
        lock(&self.events)
    }

    pub(super) fn push(&self, event: Event) {
        self.lock_events().push(event);
    }

    pub(super) fn events(&self) -> Vec<Event> {
        self.lock_events().clone()
    }

    /// Whether no settlement is under way: every settlement the broker made is recorded.
    pub(super) fn quiet(&self) -> bool {
        self.settling.load(Ordering::SeqCst) == 0
    }

    /// Counts a settlement under way until the guard is dropped.
    fn settling(&self) -> Settling<'_> {
        self.settling.fetch_add(1, Ordering::SeqCst);
        Settling(self)
    }

    /// Whether some event matches.
    pub(super) fn saw(&self, f: impl Fn(&Event) -> bool) -> bool {
        self.lock_events().iter().any(f)
    }

    /// How many events match.
    pub(super) fn count(&self, f: impl Fn(&Event) -> bool) -> usize {
        self.lock_events().iter().filter(|e| f(e)).count()
    }

    /// Arms `action` for `id`'s next run that returns `Complete`.
    pub(super) fn arm(&self, id: &str, action: Action) {
        lock(&self.actions).insert(id.to_owned(), action);
    }

    /// Arms a crash of the processor that commits `id` next.
    pub(super) fn arm_crash_on_commit(&self, id: &str) {
        lock(&self.crash_on_commit).insert(id.to_owned());
    }

    /// Arms a crash of the processor that receives `id` next, before its claim.
    pub(super) fn arm_crash_before_claim(&self, id: &str) {
        lock(&self.crash_before_claim).insert(id.to_owned());
    }

    /// The message processor `p` received last, if it is armed to die before its claim
    /// (disarmed).
    pub(super) fn take_crash_before_claim(&self, p: usize) -> Option<String> {
        let last = self.lock_events().iter().rev().find_map(|e| match e {
            Event::Delivered { p: q, id, .. } if *q == p => Some(id.clone()),
            _ => None,
        })?;
        lock(&self.crash_before_claim).remove(&last).then_some(last)
    }

    /// Sets the proxy cut that the COMMIT of armed messages meets.
    pub(super) fn set_cut(&self, cut: CommitCut) {
        *lock(&self.cut) = Some(cut);
    }

    /// Arms a cut connection for the COMMIT of `id`: before the server gets it, or after.
    pub(super) fn arm_commit_cut(&self, id: &str, before: bool) {
        lock(&self.commit_cuts).insert(id.to_owned(), before);
    }

    /// The message whose handler processor `p` ran last, with whether its COMMIT is cut before
    /// the server gets it, if it is armed for a cut (disarmed): the proxy's cut is armed.
    pub(super) fn take_commit_cut(&self, p: usize) -> Option<(String, bool)> {
        let cut = lock(&self.cut).clone()?;
        let last = self.lock_events().iter().rev().find_map(|e| match e {
            Event::HandlerStarted { p: q, id, .. } if *q == p => Some(id.clone()),
            _ => None,
        })?;
        let before = lock(&self.commit_cuts).remove(&last)?;
        cut.arm(before);
        Some((last, before))
    }

    /// Whether the proxy cut the connection since it was last armed.
    pub(super) fn commit_cut_fired(&self) -> bool {
        lock(&self.cut).as_ref().is_some_and(CommitCut::fired)
    }

    /// The message held at the end of its handler, and by which processor.
    pub(super) fn held(&self) -> Option<(String, usize)> {
        lock(&self.held).clone()
    }

    /// Lets the held handler return.
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
    }

    async fn hold(&self, id: &str, p: usize) {
        self.released.store(false, Ordering::SeqCst);
        *lock(&self.held) = Some((id.to_owned(), p));
        loop {
            let notified = self.wake.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.released.load(Ordering::SeqCst) {
                break;
            }
            notified.await;
        }
        *lock(&self.held) = None;
    }
}

/// A settlement under way, from its call to its event.
struct Settling<'a>(&'a Probe);

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        self.0.settling.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Records how a handler run ended when it did not return: a panic or a drop.
struct RunGuard<'a> {
    probe: &'a Probe,
    p: usize,
    id: &'a str,
    done: bool,
}

impl Drop for RunGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            let (p, id) = (self.p, self.id.to_owned());
            self.probe.push(if std::thread::panicking() {
                Event::HandlerPanicked { p, id }
            } else {
                Event::HandlerCancelled { p, id }
            });
        }
    }
}

/// The user's handler, recorded and faulted.
pub(super) struct Recorded<H> {
    pub(super) inner: H,
    pub(super) probe: Arc<Probe>,
    pub(super) p: usize,
}

impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Recorded<H> {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        tx: &'a mut Tx,
    ) -> Result<Outcome, HandlerError> {
        let id = ctx.message_id().as_str().to_owned();
        let p = self.p;
        self.probe.push(Event::HandlerStarted {
            p,
            id: id.clone(),
            delivery: ctx.delivery_count(),
        });
        let mut guard = RunGuard { probe: &self.probe, p, id: &id, done: false };
        let result = self.inner.handle(ctx, tx).await;
        let described = match &result {
            Ok(outcome) => format!("{outcome:?}"),
            Err(e) => format!("error ({e})"),
        };
        self.probe.push(Event::HandlerReturned { p, id: id.clone(), result: described });
        let action = match result {
            Ok(Outcome::Complete) => lock(&self.probe.actions).remove(&id),
            _ => None,
        };
        let result = match action {
            None => result,
            Some(Action::Hold) => {
                self.probe.push(Event::Fault { p, id: id.clone(), what: "held before the commit" });
                self.probe.hold(&id, p).await;
                result
            }
            Some(Action::Fail) => {
                self.probe.push(Event::Fault {
                    p,
                    id: id.clone(),
                    what: "transient error after the work",
                });
                Err(HandlerError::transient(std::io::Error::other(
                    "a transient error injected by the kit",
                )))
            }
            Some(Action::DeadLetter) => {
                self.probe.push(Event::Fault {
                    p,
                    id: id.clone(),
                    what: "dead-lettered after the work",
                });
                Ok(Outcome::dead_letter(
                    "ProveDeadLetter",
                    "dead-lettered by the kit, to be resubmitted",
                ))
            }
        };
        guard.done = true;
        result
    }
}

/// The processor's side of a crash after the commit: set by the commit hook, after which the
/// transport loses every settlement (and receives nothing), as a dead process would.
pub(super) fn commit_hook(
    probe: Arc<Probe>,
    p: usize,
    crashed: Arc<AtomicBool>,
) -> impl Fn(&ReceivedMessage) + Send + Sync + 'static {
    move |m| {
        let id = m.message_id().as_str().to_owned();
        probe.push(Event::Committed { p, id: id.clone() });
        if lock(&probe.crash_on_commit).remove(&id) {
            crashed.store(true, Ordering::SeqCst);
            probe.push(Event::Crashed { p, id });
        }
    }
}

/// The broker's receiver (of an entity, or of one of its sessions), recorded, and dead once
/// crashed.
pub(super) struct Watched<R = Receiver> {
    pub(super) inner: R,
    pub(super) probe: Arc<Probe>,
    pub(super) p: usize,
    pub(super) crashed: Arc<AtomicBool>,
}

impl<R: fmt::Debug> fmt::Debug for Watched<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched")
            .field("inner", &self.inner)
            .field("p", &self.p)
            .finish_non_exhaustive()
    }
}

impl<R> Watched<R> {
    /// After a crash nothing reaches the broker: the settlement is recorded as lost.
    fn dead(&self, d: &ReceivedMessage) -> Option<TransportError> {
        if !self.crashed.load(Ordering::SeqCst) {
            return None;
        }
        self.probe.push(Event::SettlementLost { p: self.p, id: id(d) });
        Some(TransportError::Other {
            message: "the process crashed".to_owned(),
            transient: false,
            source: None,
        })
    }

    fn after(&self, done: &Result<(), TransportError>, event: Event) {
        if done.is_ok() {
            self.probe.push(event);
        }
    }

    /// The same receiver of processor `p`, around `inner`.
    fn around<S>(&self, inner: S) -> Watched<S> {
        Watched {
            inner,
            probe: Arc::clone(&self.probe),
            p: self.p,
            crashed: Arc::clone(&self.crashed),
        }
    }
}

fn id(d: &ReceivedMessage) -> String {
    d.message_id().as_str().to_owned()
}

impl<R: Receive<Delivery = ReceivedMessage>> Receive for Watched<R> {
    type Delivery = ReceivedMessage;

    /// # Cancel safety
    ///
    /// As the broker's receive: messages locked for a dropped receive are released.
    async fn receive(
        &self,
        n: usize,
        wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        if self.crashed.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let got = self.inner.receive(n, wait).await?;
        for m in &got {
            self.probe.push(Event::Delivered { p: self.p, id: id(m), delivery: m.delivery_count });
        }
        Ok(got)
    }

    async fn complete(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        for (effect, key) in (self.probe.completion)(d.clone()).await {
            self.probe.push(Event::CompletedWithoutEffect { p: self.p, id: id(d), effect, key });
        }
        let done = self.inner.complete(d).await;
        self.after(&done, Event::Completed { p: self.p, id: id(d) });
        done
    }

    async fn abandon(&self, d: &ReceivedMessage, props: Properties) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        let done = self.inner.abandon(d, props).await;
        self.after(&done, Event::Abandoned { p: self.p, id: id(d) });
        done
    }

    async fn dead_letter(
        &self,
        d: &ReceivedMessage,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        let why = reason.reason.clone();
        let done = self.inner.dead_letter(d, reason).await;
        self.after(&done, Event::DeadLettered { p: self.p, id: id(d), reason: why });
        done
    }

    async fn defer(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        let done = self.inner.defer(d).await;
        self.after(&done, Event::Deferred { p: self.p, id: id(d) });
        done
    }
}

impl Transport for Watched {
    fn entity(&self) -> &twice::EntityInfo {
        self.inner.entity()
    }

    fn claim_scope(&self) -> &str {
        self.inner.claim_scope()
    }

    async fn read_entity(&self) -> Result<twice::EntityInfo, TransportError> {
        self.inner.read_entity().await
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    async fn release(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        let done = self.inner.release(d).await;
        self.after(&done, Event::Released { p: self.p, id: id(d) });
        done
    }

    async fn renew_lock(&self, d: &ReceivedMessage) -> Result<Timestamp, TransportError> {
        if self.crashed.load(Ordering::SeqCst) {
            return Err(TransportError::LockLost);
        }
        self.inner.renew_lock(d).await
    }

    async fn redeliver_later(
        &self,
        d: &ReceivedMessage,
        delay: Duration,
        props: Properties,
    ) -> Result<(), TransportError> {
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        self.inner.redeliver_later(d, delay, props).await
    }
}

impl SessionTransport for Watched {
    type Session = Watched<Session>;

    /// # Cancel safety
    ///
    /// As the broker's: a session locked for a dropped accept is released.
    async fn accept_next_session(
        &self,
        max_wait: Duration,
    ) -> Result<Option<Watched<Session>>, TransportError> {
        if self.crashed.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(self.inner.accept_next_session(max_wait).await?.map(|s| self.around(s)))
    }

    async fn accept_session(
        &self,
        session_id: &SessionId,
    ) -> Result<Watched<Session>, TransportError> {
        Ok(self.around(self.inner.accept_session(session_id).await?))
    }
}

impl SessionReceiver for Watched<Session> {
    fn session_id(&self) -> &SessionId {
        SessionReceiver::session_id(&self.inner)
    }

    fn locked_until(&self) -> Timestamp {
        SessionReceiver::locked_until(&self.inner)
    }

    async fn renew_session_lock(&self) -> Result<Timestamp, TransportError> {
        if self.crashed.load(Ordering::SeqCst) {
            return Err(TransportError::LockLost);
        }
        SessionReceiver::renew_session_lock(&self.inner).await
    }

    async fn release(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        let _settling = self.probe.settling();
        if let Some(e) = self.dead(d) {
            return Err(e);
        }
        let done = SessionReceiver::release(&self.inner, d).await;
        self.after(&done, Event::Released { p: self.p, id: id(d) });
        done
    }

    async fn get_state(&self) -> Result<Option<Bytes>, TransportError> {
        SessionReceiver::get_state(&self.inner).await
    }

    async fn set_state(&self, state: Option<Bytes>) -> Result<(), TransportError> {
        SessionReceiver::set_state(&self.inner, state).await
    }

    async fn close(self) -> Result<(), TransportError> {
        SessionReceiver::close(self.inner).await
    }
}
