//! The tasks of a link and what they report: a receiver's pump and settler, a sender's sender
//! task, a `$management` link's request task, and a session receiver's lock timer.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use twice::{ReceivedMessage, SharedClock};

use crate::backend::{Backend, BackendError, BackendSession, ReceiveMode, Settlement};
use crate::conditions::{self as cond, backend_error};
use crate::metrics::{Counter, Metrics};
use crate::mgmt;
use crate::performative::{AmqpError, Outcome};
use crate::settle;

use super::delivery::release_all;
use super::state::{Event, Job, PendingSend, PumpCtl, Source};
use super::{PUMP_BATCH, PUMP_WAIT, SETTLE_BATCH};

/// Takes up to `max` messages, locked: receive-and-delete links complete theirs once written,
/// so a message that never reaches the client can always be released.
///
/// # Cancel safety
///
/// As [`Backend::receive`]. `twice-broker` keeps that promise only until it has answered: a
/// reply already on its way is lost with the future, its messages locked until their lock
/// expires. So the pump drops a receive only for a session whose lock it is about to release,
/// which unlocks them.
async fn take<B: Backend>(
    backend: &B,
    source: &Source<B::Session>,
    max: usize,
    wait: Duration,
) -> Result<Vec<ReceivedMessage>, BackendError> {
    match source {
        Source::Entity(e) => backend.receive(e, ReceiveMode::PeekLock, max, wait).await,
        Source::Session(s) => s.receive(ReceiveMode::PeekLock, max, wait).await,
    }
}

/// Reports what the pump took; false when the pump should stop (the receive failed, or the
/// connection is gone, in which case the messages are released).
fn report<B: Backend>(
    backend: &B,
    source: &Source<B::Session>,
    events: &mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
    drain: u64,
    result: Result<Vec<ReceivedMessage>, BackendError>,
) -> bool {
    let failed = result.is_err();
    let batch = Event::Batch { link, drain, source: source.clone(), result };
    match events.send(batch) {
        Ok(()) => !failed,
        Err(mpsc::error::SendError(Event::Batch { result: Ok(messages), .. })) => {
            release_all(backend, source, messages);
            false
        }
        Err(_) => false,
    }
}

/// A receiver link's pump: takes messages within the credit and reports them.
///
/// A receive is never dropped while the link lives: a broker reply already on its way would be
/// lost with it, and its messages would stay locked. A drain that comes during a long poll is
/// answered at once with nothing (the poll would have ended had anything come), and what the
/// poll brings later is released by the connection, which has no credit left for it.
pub(super) async fn pump<B: Backend>(
    backend: B,
    source: Source<B::Session>,
    mut ctl: watch::Receiver<PumpCtl>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    let mut handed = 0u64;
    let mut drained = 0u64;
    loop {
        let c = *ctl.borrow_and_update();
        let room = c.limit.saturating_sub(handed);
        let max = usize::try_from(room.min(PUMP_BATCH)).unwrap_or(1);
        if c.drain > drained {
            drained = c.drain;
            let result = if room == 0 {
                Ok(Vec::new())
            } else {
                take(&backend, &source, max, Duration::ZERO).await
            };
            handed += result.as_ref().map_or(0, |m| u64::try_from(m.len()).unwrap_or(u64::MAX));
            if !report(&backend, &source, &events, link, c.drain, result) {
                return;
            }
            continue;
        }
        if room == 0 {
            if ctl.changed().await.is_err() {
                return;
            }
            continue;
        }
        let receive = take(&backend, &source, max, PUMP_WAIT);
        tokio::pin!(receive);
        let result = loop {
            tokio::select! {
                biased;
                r = &mut receive => break r,
                changed = ctl.changed() => {
                    if changed.is_err() {
                        // The link is gone. A session's receive is dropped: releasing the
                        // session, which follows at once, unlocks anything it held. An entity's
                        // runs to its end and what it took goes back.
                        if let Source::Entity(_) = source
                            && let Ok(messages) = receive.await {
                                release_all(&backend, &source, messages);
                            }
                        return;
                    }
                    let d = ctl.borrow().drain;
                    if d > drained {
                        drained = d;
                        if !report(&backend, &source, &events, link, d, Ok(Vec::new())) {
                            return;
                        }
                    }
                }
            }
        };
        if matches!(&result, Ok(m) if m.is_empty()) {
            continue;
        }
        handed += result.as_ref().map_or(0, |m| u64::try_from(m.len()).unwrap_or(u64::MAX));
        if !report(&backend, &source, &events, link, 0, result) {
            return;
        }
    }
}

/// A receiver link's settler: applies the client's dispositions in order, completing each run
/// of completions in one broker call (one durable write), and reports the echoes. When the
/// link ends it finishes what is queued, then releases the link's session lock.
pub(super) async fn settler<B: Backend>(
    backend: B,
    entity: String,
    session: Option<Arc<B::Session>>,
    metrics: Arc<Metrics>,
    mut rx: mpsc::UnboundedReceiver<Job>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    let mut jobs = Vec::with_capacity(SETTLE_BATCH);
    while rx.recv_many(&mut jobs, SETTLE_BATCH).await > 0 {
        let mut echoes = Vec::with_capacity(jobs.len());
        let mut queue = jobs.drain(..).peekable();
        while let Some(job) = queue.next() {
            if job.completes().is_some() {
                let mut run = Vec::with_capacity(queue.len() + 1);
                run.push(job);
                while let Some(next) = queue.next_if(|j| j.completes().is_some()) {
                    run.push(next);
                }
                let locks = run.iter().filter_map(Job::completes).collect();
                let results = match &session {
                    Some(s) => s.complete_many(locks).await,
                    None => backend.complete_many(&entity, locks).await,
                };
                let mut results = results.into_iter();
                for job in run {
                    let r = results
                        .next()
                        .unwrap_or_else(|| Err(BackendError::Unavailable("no answer".into())));
                    if let Job::Settle { delivery_id, echo, reply, .. } = job {
                        let echo = echo_of(
                            &metrics,
                            &entity,
                            session.is_some(),
                            Some(Counter::Complete),
                            r,
                            echo,
                        );
                        echoes.push((delivery_id, echo, reply));
                    }
                }
                continue;
            }
            match job {
                Job::Release(lock) => {
                    let _ = settle::settle_one(
                        &backend,
                        &entity,
                        session.as_deref(),
                        lock,
                        Settlement::Release,
                    )
                    .await;
                }
                // Completions ran above.
                Job::Complete(_) => {}
                Job::Settle { delivery_id, how: None, echo, reply, .. } => {
                    echoes.push((delivery_id, echo, reply));
                }
                Job::Settle { delivery_id, lock, how: Some(how), echo, reply } => {
                    // Completions ran above; defer and release have no counter.
                    let counter = settle::counter_of(&how);
                    let r =
                        settle::settle_one(&backend, &entity, session.as_deref(), lock, how).await;
                    let echo = echo_of(&metrics, &entity, session.is_some(), counter, r, echo);
                    echoes.push((delivery_id, echo, reply));
                }
            }
        }
        drop(queue);
        // A connection that is gone gets no echoes; the work is done all the same.
        if !echoes.is_empty() {
            let _ = events.send(Event::Settled { link, results: echoes });
        }
    }
    if let Some(s) = session {
        s.close().await;
    }
}

/// The outcome to echo once the broker answered, counting it.
fn echo_of(
    metrics: &Metrics,
    entity: &str,
    in_session: bool,
    counter: Option<Counter>,
    result: Result<(), BackendError>,
    echo: Outcome,
) -> Outcome {
    settle::count(metrics, entity, counter, &result);
    let Err(e) = result else { return echo };
    let cond = if in_session && e == BackendError::SessionLockLost {
        cond::SESSION_LOCK_LOST
    } else if e == BackendError::LockLost || e == BackendError::SessionLockLost {
        cond::LOCK_LOST
    } else {
        return Outcome::Rejected(Some(backend_error(&e)));
    };
    Outcome::Rejected(Some(AmqpError::new(
        cond,
        "The lock supplied is invalid. Either the lock expired, or the message has already been removed from the queue.",
    )))
}

/// A `$management` link's request task: answers its requests in order.
pub(super) async fn request_task<B: Backend>(
    backend: B,
    metrics: Arc<Metrics>,
    entity: String,
    mut rx: mpsc::UnboundedReceiver<(mgmt::Request, Option<Arc<B::Session>>)>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    while let Some((req, held)) = rx.recv().await {
        let (reply, settled) = mgmt::handle(&backend, &metrics, held, &entity, req).await;
        if events.send(Event::Replied { link, reply, settled }).is_err() {
            return;
        }
    }
}

/// Watches the lock of a session receiver link on the server's clock, so a lock that expires
/// while the link idles (no credit, so no receive to fail) detaches it with
/// `com.microsoft:session-lock-lost`. Ends when `stop` is dropped.
pub(super) async fn watch_session_lock<S: BackendSession>(
    session: Arc<S>,
    clock: SharedClock,
    mut stop: oneshot::Receiver<()>,
    events: mpsc::UnboundedSender<Event<S>>,
    link: u64,
) {
    let mut deadline = session.locked_until();
    let period = deadline.duration_since(clock.now()).max(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = clock.sleep_until(deadline) => {}
            _ = &mut stop => return,
        }
        let renewed = session.locked_until();
        if renewed > deadline {
            deadline = renewed;
            continue;
        }
        let checked = tokio::select! {
            r = session.check_lock() => r,
            _ = &mut stop => return,
        };
        match checked {
            Err(BackendError::SessionLockLost) => {
                let _ = events.send(Event::SessionLockLost { link });
                return;
            }
            // Still held: renewed through one of its messages, which this handle does not see.
            // Look again a lock period from now.
            _ => deadline = clock.now() + period,
        }
    }
}

/// The sender task of one client sender link: stores its messages in order, grouping what has
/// queued up into batches within the size limit so one durable write serves many sends.
pub(super) async fn sender_task<B: Backend>(
    backend: B,
    entity: String,
    max_batch_bytes: usize,
    mut rx: mpsc::UnboundedReceiver<PendingSend>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    fn size(p: &PendingSend) -> usize {
        p.messages.iter().map(|m| m.body.len() + 256).sum()
    }
    let mut group = Vec::with_capacity(256);
    while rx.recv_many(&mut group, 256).await > 0 {
        let mut results = Vec::with_capacity(group.len());
        let mut start = 0;
        while start < group.len() {
            // The largest run from `start` that fits one batch (at least one send).
            let mut end = start + 1;
            let mut bytes = size(&group[start]);
            while end < group.len() && bytes + size(&group[end]) <= max_batch_bytes {
                bytes += size(&group[end]);
                end += 1;
            }
            let chunk = &group[start..end];
            let all: Vec<twice::Message> =
                chunk.iter().flat_map(|p| p.messages.iter().cloned()).collect();
            match backend.send(&entity, all).await {
                Ok(_) => results.extend(
                    chunk
                        .iter()
                        .map(|p| (p.delivery_id, p.settled, p.messages.len(), Outcome::Accepted)),
                ),
                // A batch is all or nothing: find out which sends were refused one by one.
                Err(e) if chunk.len() == 1 => {
                    let p = &chunk[0];
                    results.push((
                        p.delivery_id,
                        p.settled,
                        0,
                        Outcome::Rejected(Some(backend_error(&e))),
                    ));
                }
                Err(_) => {
                    for p in chunk {
                        let outcome = match backend.send(&entity, p.messages.clone()).await {
                            Ok(_) => Outcome::Accepted,
                            Err(e) => Outcome::Rejected(Some(backend_error(&e))),
                        };
                        results.push((p.delivery_id, p.settled, p.messages.len(), outcome));
                    }
                }
            }
            start = end;
        }
        let bytes = group.iter().map(|p| p.bytes).sum();
        group.clear();
        let entity = entity.clone();
        if events.send(Event::Sent { link, entity, results, bytes }).is_err() {
            return;
        }
    }
}
