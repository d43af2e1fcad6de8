//! The session scenario ([`SESSION_ORDER`]): two sessions interleaved on one entity.
//!
//! On a transport with sessions ([`SessionTransport`]) the session receiver must get each
//! session's messages in send order, and the [`SessionProcessor`] must handle them in that
//! order, one at a time per session. A transport without sessions plays the same sends through
//! the plain [`Processor`] and reports what a user of it sees: messages of one session handled
//! at once, so that the order within a session is the application's to keep.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::Postgres;
use twice::{
    Delivery as _, HandlerError, Message, Outcome, Processor, Receive as _, SessionProcessor,
    SessionProcessorOptions, SessionReceiver as _, SessionTransport, TransportError, handler_fn,
};
use twice_sqlx::{InboxOptions, SqlxInbox};

use super::{BOUND, Entity, EntitySettings, Harness, YES, create, fail, options, unique};
use crate::db::PgDatabase;

/// A row of the capability table.
pub const SESSION_ORDER: &str = "order within a session";

/// Messages per session in each part of the scenario.
const PER_SESSION: usize = 3;
/// How long the handler waits for another message of its session to start beside it.
const SIBLING_WAIT: Duration = Duration::from_millis(400);

/// A session-enabled entity made for the session scenario; cleaned up when dropped.
pub trait SessionEntity: Send + Sync + 'static {
    /// The transport under test.
    type Transport: SessionTransport;

    /// The transport on the entity.
    fn transport(&self) -> Arc<Self::Transport>;

    /// Sends a message (with a session id) to the entity with the broker's own client.
    fn send(&self, message: Message) -> impl Future<Output = Result<(), TransportError>> + Send;
}

/// Messages of two sessions, sent interleaved (`a0 b0 a1 b1 …`): the ids of each session in
/// send order.
async fn send_interleaved<F, Fut>(send: F, s: &str) -> [(String, Vec<String>); 2]
where
    F: Fn(Message) -> Fut,
    Fut: Future<Output = Result<(), TransportError>>,
{
    let sessions = [unique("a"), unique("b")];
    let ids = sessions.clone().map(|session| {
        let ids = (0..PER_SESSION).map(|i| format!("{session}-{i}")).collect::<Vec<_>>();
        (session, ids)
    });
    for i in 0..PER_SESSION {
        for (session, ids) in &ids {
            let m = Message::new("{}")
                .with_message_id(ids[i].as_str())
                .with_session_id(session.as_str());
            if let Err(err) = send(m).await {
                fail(s, format!("send failed: {err}"));
            }
        }
    }
    ids
}

/// What the handler saw, per session.
#[derive(Default)]
struct Seen {
    /// Message ids in the order their handling started.
    started: Vec<String>,
    in_flight: u32,
    most_in_flight: u32,
}

/// Per-session records of a handler that lingers until another message of its session is
/// handled beside it (or [`SIBLING_WAIT`] passes): a transport that hands out two messages of
/// one session at once is caught doing it.
#[derive(Clone, Default)]
struct Tracker {
    // A std Mutex: short updates, never held across an await.
    sessions: Arc<Mutex<HashMap<String, Seen>>>,
}

impl Tracker {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, Seen>) -> R) -> R {
        f(&mut self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    fn handler<Tx: Send + 'static>(&self) -> impl twice::Handler<Tx> {
        let tracker = self.clone();
        handler_fn::<Tx, _>(move |ctx, _tx| {
            let tracker = tracker.clone();
            Box::pin(async move {
                let session =
                    ctx.message().message.session_id.as_ref().map_or("", |s| s.as_str()).to_owned();
                let id = ctx.message_id().as_str().to_owned();
                tracker.with(|all| {
                    let seen = all.entry(session.clone()).or_default();
                    if !seen.started.contains(&id) {
                        seen.started.push(id);
                    }
                    seen.in_flight += 1;
                    seen.most_in_flight = seen.most_in_flight.max(seen.in_flight);
                });
                let clock = twice::SharedClock::system();
                let until = clock.now() + SIBLING_WAIT;
                while clock.now() < until && tracker.with(|all| all[&session].in_flight) < 2 {
                    clock.sleep(Duration::from_millis(10)).await;
                }
                tracker.with(|all| all.entry(session).or_default().in_flight -= 1);
                Ok::<_, HandlerError>(Outcome::Complete)
            })
        })
    }

    fn started(&self, session: &str) -> Vec<String> {
        self.with(|all| all.get(session).map(|s| s.started.clone()).unwrap_or_default())
    }

    fn most_in_flight(&self) -> u32 {
        self.with(|all| all.values().map(|s| s.most_in_flight).max().unwrap_or(0))
    }

    fn handled(&self) -> usize {
        self.with(|all| all.values().map(|s| s.started.len()).sum())
    }

    /// Waits until `n` messages were handled and none is in flight, or fails at the bound.
    async fn wait_for(&self, n: usize, s: &str) {
        let clock = twice::SharedClock::system();
        let until = clock.now() + BOUND;
        while self.handled() < n || self.with(|all| all.values().any(|s| s.in_flight > 0)) {
            if clock.now() >= until {
                fail(s, format!("{} of {n} messages handled within the bound", self.handled()));
            }
            clock.sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A PostgreSQL inbox, and its database (dropped on drop). Not SQLite: its one writer at a
/// time would keep two handlers from overlapping whatever the transport does.
async fn inbox(s: &str) -> Option<(PgDatabase, Arc<SqlxInbox<Postgres>>)> {
    let db = crate::require_service("PostgreSQL", PgDatabase::create("twice_kit").await)?;
    let pool = crate::require_service("PostgreSQL", db.pool(8).await)?;
    let inbox = SqlxInbox::<Postgres>::new(pool, InboxOptions::new()).await;
    let inbox = inbox.unwrap_or_else(|e| fail(s, format!("the PostgreSQL inbox: {e}")));
    Some((db, Arc::new(inbox)))
}

/// The scenario on a transport with sessions: `entity` must be session-enabled.
///
/// # Panics
///
/// When a message is lost or nothing comes within the bound.
pub async fn with_sessions<E: SessionEntity>(entity: E) -> Option<String> {
    const S: &str = "order within a session";
    let t = entity.transport();
    // The session receiver: each session's messages in send order.
    let sent = send_interleaved(|m| entity.send(m), S).await;
    let mut differences = Vec::new();
    for _ in 0..sent.len() {
        let session = match t.accept_next_session(BOUND).await {
            Ok(Some(session)) => session,
            Ok(None) => fail(S, "no session came"),
            Err(e) => fail(S, format!("accepting a session: {e}")),
        };
        let Some((_, ids)) = sent.iter().find(|(id, _)| id == session.session_id().as_str()) else {
            fail(S, format!("a session that was not sent: {}", session.session_id()))
        };
        let mut got = Vec::new();
        while got.len() < ids.len() {
            let batch = session.receive(10, BOUND).await.unwrap_or_else(|e| fail(S, e));
            if batch.is_empty() {
                fail(S, format!("{} of {} messages of the session came", got.len(), ids.len()));
            }
            for d in &batch {
                got.push(d.message().message_id().as_str().to_owned());
                session.complete(d).await.unwrap_or_else(|e| fail(S, e));
            }
        }
        if got != *ids {
            differences.push(format!("the session receiver got {got:?}"));
        }
        session.close().await.unwrap_or_else(|e| fail(S, e));
    }
    // The session processor: in order, one message of a session at a time.
    let (_db, inbox) = inbox(S).await?;
    let sent = send_interleaved(|m| entity.send(m), S).await;
    let tracker = Tracker::default();
    let options = SessionProcessorOptions::new()
        .consumer(unique("kit"))
        .max_concurrent_sessions(2)
        .session_idle_timeout(Duration::from_millis(500))
        .max_wait(Duration::from_millis(200));
    let processor =
        SessionProcessor::from_arcs(t, Arc::clone(&inbox), Arc::new(tracker.handler()), options)
            .on_error(|_| {});
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    tracker.wait_for(sent.len() * PER_SESSION, S).await;
    let _ = stop.send(true);
    match task.await {
        Ok(Ok(())) => {}
        other => fail(S, format!("the session processor stopped with {other:?}")),
    }
    for (session, ids) in &sent {
        let started = tracker.started(session);
        if started != *ids {
            differences.push(format!("the session processor handled {started:?}"));
        }
    }
    let most = tracker.most_in_flight();
    if most > 1 {
        differences.push(format!("{most} messages of one session were handled at once"));
    }
    Some(if differences.is_empty() { YES.into() } else { differences.join("; ") })
}

/// The cell of [`SESSION_ORDER`] for a transport without sessions, which the kit observed
/// handling two messages of one session at once; `instead` says what a user does.
pub fn no_sessions(instead: &str) -> String {
    format!("no sessions: the processor handled two messages of one session at once; {instead}")
}

/// The scenario on a transport without sessions: the same interleaved sends through the plain
/// processor, which may handle messages of one session at once. `instead` says what a user of
/// the transport does to keep an order.
///
/// # Panics
///
/// When a message is lost or nothing comes within the bound.
pub async fn without_sessions<H: Harness>(h: &H, instead: &str) -> Option<String> {
    const S: &str = "order within a session (no sessions)";
    let e = create(h, EntitySettings::default()).await?;
    let (_db, inbox) = inbox(S).await?;
    let sent = send_interleaved(|m| e.send(m), S).await;
    let tracker = Tracker::default();
    let processor = Processor::from_arcs(
        e.transport(),
        Arc::clone(&inbox),
        Arc::new(tracker.handler()),
        options(&unique("kit"), super::Batch::one()),
    )
    .on_error(|_| {});
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    tracker.wait_for(sent.len() * PER_SESSION, S).await;
    let _ = stop.send(true);
    match task.await {
        Ok(Ok(())) => {}
        other => fail(S, format!("the processor stopped with {other:?}")),
    }
    Some(match tracker.most_in_flight() {
        0 | 1 => "no sessions, yet one message of a session at a time was handled".into(),
        _ => no_sessions(instead),
    })
}
