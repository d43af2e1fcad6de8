//! The conformance kit: one suite that every [`Transport`] runs, with each inbox store.
//!
//! A transport takes part through a [`Harness`], which makes a fresh entity for each scenario
//! (and cleans it up). [`run`] plays every scenario and returns a [`Report`]: one short cell
//! per capability, `yes` when the transport behaves as Service Bus does, or a sentence saying how
//! it differs. A test compares the report with the differences it expects for that transport,
//! so a difference is recorded, never hidden, and [`render_table`] turns the reports of all
//! transports into the capability table of the docs.
//!
//! Two kinds of scenario:
//! - transport scenarios talk to the transport directly: redelivery after abandon and after
//!   lock expiry with the count rising, dead-lettering at MaxDeliveryCount and by request with a
//!   reason, duplicate detection, defer, release, renewal, order, reconnection;
//! - the session scenario ([`sessions`]): two sessions interleaved on one entity, in order
//!   through the session receiver and the session processor, or, on a transport without
//!   sessions, what the plain processor does with them;
//! - processor scenarios run the [`Processor`] with an SQLite, a PostgreSQL and a MariaDB inbox:
//!   a poison body, a crash between commit and complete, two copies at the same instant, a lock
//!   lost while the handler runs. Each must end with the work committed once per message;
//! - the scenarios of [`scenarios`], of what users meet: a handler longer than the lock with
//!   renewal, a producer that is not twice (no message id), the entity deleted and made again, a
//!   transport told another lock than the broker's, a delivery in flight across a reconnect.
//!
//! The report holds what was measured, and only that: a scenario the harness cannot play (no
//! way to restart a server other tests share, no raw producer) is a cell that says `not run`
//! and why, and [`render_table`] shows `not run` for a transport that did not run at all.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{MySql, Postgres, Sqlite};
use twice::{
    CounterSnapshot, DeadLetterReason, Delivery, EntityInfo, HandlerError, Inbox, Message,
    MessageId, Outcome, Processor, ProcessorOptions, Properties, Receive, ReceivedMessage,
    Timestamp, Transport, TransportError, handler_fn,
};
use twice_sqlx::{InboxOptions, SqlxInbox};

use crate::db::{MariaDatabase, PgDatabase, SqliteDatabase};

pub mod scenarios;
pub mod sessions;

pub use scenarios::{FOREIGN_PRODUCER, IN_FLIGHT, LOCK_MISMATCH, LONG_HANDLER, RECREATED};
pub use sessions::{SESSION_ORDER, SessionEntity};

/// How long a scenario may wait for something that should happen within a few lock durations;
/// past it the scenario fails instead of hanging.
const BOUND: Duration = Duration::from_secs(30);
/// A short wait for something that should not come.
const QUIET: Duration = Duration::from_millis(700);

/// The settings of an entity a scenario asks for.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct EntitySettings {
    /// The lock duration.
    pub lock_duration: Duration,
    /// Deliveries before the message is dead-lettered.
    pub max_delivery_count: u32,
    /// Whether the broker should drop a re-sent message id (where it can).
    pub duplicate_detection: bool,
}

impl Default for EntitySettings {
    fn default() -> Self {
        Self {
            lock_duration: Duration::from_secs(30),
            max_delivery_count: 10,
            duplicate_detection: true,
        }
    }
}

/// One entity made for one scenario; cleaned up when dropped.
pub trait Entity: Send + Sync + 'static {
    /// The transport under test.
    type Transport: Transport;

    /// The transport on the entity (a new one after [`Interruption::Reopened`]).
    fn transport(&self) -> Arc<Self::Transport>;

    /// Sends a message to the entity with the broker's own client.
    fn send(&self, message: Message) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Takes everything in the entity's dead-letter queue (receiving and completing it).
    fn take_dead_letters(
        &self,
    ) -> impl Future<Output = Result<Vec<ReceivedMessage>, TransportError>> + Send;

    /// Takes the broker away from the transport and brings it back: a restart of the broker
    /// on the same address and data where the harness can do that without disturbing other
    /// tests, otherwise a cut of every connection. Returns once the broker serves again.
    fn interrupt(&self) -> impl Future<Output = Interruption> + Send;

    /// Sends `body` as a producer that is not twice would: with the broker's own client and no
    /// message id. `None` when the harness has no such producer (the cell says `not run`).
    fn send_without_id(
        &self,
        body: &'static [u8],
    ) -> impl Future<Output = Option<Result<(), TransportError>>> + Send {
        let _ = body;
        async { None }
    }

    /// Deletes the entity and makes it again, empty, under the same name, while the transport
    /// stays connected. `None` when the harness cannot.
    fn recreate(&self) -> impl Future<Output = Option<Result<(), TransportError>>> + Send {
        async { None }
    }
}

/// How [`Entity::interrupt`] took the broker away and brought it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Interruption {
    /// The broker was stopped and started again on the same address and data directory; the
    /// transport from before must connect again by itself.
    Restarted,
    /// Every connection of the transport was cut (a proxy) while the broker ran on; the
    /// transport must connect again by itself.
    Cut,
    /// The broker runs in the test's process: it was shut down and opened again on its data
    /// directory. The transport from before is closed for good; the entity hands out a new one.
    Reopened,
}

/// Makes entities of one transport.
pub trait Harness: Send + Sync {
    /// The entities it makes.
    type Entity: Entity;

    /// The transport's name, a column of the capability table.
    fn name(&self) -> &'static str;

    /// The shortest lock duration the broker takes, for the scenarios that wait for a lock to
    /// run out (default 1 s).
    fn short_lock(&self) -> Duration {
        Duration::from_secs(1)
    }

    /// A fresh entity; `None` when the broker is unreachable and the test skips
    /// ([`crate::require_service`]).
    fn create(&self, settings: EntitySettings)
    -> impl Future<Output = Option<Self::Entity>> + Send;

    /// A fresh entity whose broker holds each lock for `settings.lock_duration` while its
    /// transport was told (or would assume) `told`; `Err(why)` when the harness cannot make one
    /// (the cell says `not run` and why), `None` when the broker is unreachable.
    fn create_with_lock_told(
        &self,
        settings: EntitySettings,
        told: Duration,
    ) -> impl Future<Output = Option<Result<Self::Entity, String>>> + Send {
        let _ = (settings, told);
        async { Some(Err("the harness cannot tell the transport another lock".to_owned())) }
    }

    /// The cell of [`SESSION_ORDER`]: a transport with sessions plays
    /// [`sessions::with_sessions`] on a fresh session-enabled entity; one without plays
    /// [`sessions::without_sessions`], saying what a user does instead.
    fn sessions(&self) -> impl Future<Output = Option<String>> + Send;
}

/// What the kit observed: a cell per capability, in the order of [`CAPABILITIES`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The transport's name.
    pub transport: String,
    /// Capability → `yes` or how it differs.
    pub cells: BTreeMap<&'static str, String>,
}

/// The capabilities, in the order of the table.
pub const CAPABILITIES: [&str; 21] = [
    ABANDON,
    LOCK_EXPIRY,
    MAX_DELIVERY,
    DEAD_LETTER,
    DUPLICATES,
    DEFER,
    RELEASE,
    RENEW,
    ORDER,
    SESSION_ORDER,
    RECONNECT,
    RECONNECT_CUT,
    IN_FLIGHT,
    RECREATED,
    LOCK_MISMATCH,
    FOREIGN_PRODUCER,
    P_POISON,
    P_CRASH,
    P_TWO_COPIES,
    P_LOCK_LOST,
    LONG_HANDLER,
];

/// A row of the capability table.
pub const ABANDON: &str = "abandon: redelivered, count + 1";
/// A row of the capability table.
pub const LOCK_EXPIRY: &str = "lock expiry: redelivered, count + 1, old settlement refused";
/// A row of the capability table.
pub const MAX_DELIVERY: &str = "MaxDeliveryCount: dead-lettered with a reason";
/// A row of the capability table.
pub const DEAD_LETTER: &str = "dead-letter with reason and description";
/// A row of the capability table.
pub const DUPLICATES: &str = "duplicate detection of a re-sent message id";
/// A row of the capability table.
pub const DEFER: &str = "defer";
/// A row of the capability table.
pub const RELEASE: &str = "release without counting a delivery";
/// A row of the capability table.
pub const RENEW: &str = "lock renewal";
/// A row of the capability table.
pub const ORDER: &str = "FIFO order with one receiver";
/// A row of the capability table.
pub const RECONNECT: &str = "reconnect after a broker restart, nothing lost";
/// A row of the capability table.
pub const RECONNECT_CUT: &str = "reconnect after a cut connection, nothing lost";
/// A row of the capability table.
pub const P_POISON: &str = "processor: poison body dead-lettered, no work";
/// A row of the capability table.
pub const P_CRASH: &str = "processor: crash between commit and complete, work once";
/// A row of the capability table.
pub const P_TWO_COPIES: &str = "processor: two copies at the same instant, work once";
/// A row of the capability table.
pub const P_LOCK_LOST: &str = "processor: lock lost mid-handler, work once";

/// The cell of a capability that behaves as Service Bus's.
pub const YES: &str = "yes";

/// A scenario's failure: what was expected and what happened.
fn fail(scenario: &str, what: impl std::fmt::Display) -> ! {
    panic!("conformance: {scenario}: {what}")
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Receives one message, waiting up to the bound.
async fn receive_one<T: Transport>(t: &T, scenario: &str) -> T::Delivery {
    match t.receive(1, BOUND).await {
        Ok(mut got) if !got.is_empty() => got.remove(0),
        Ok(_) => fail(scenario, "no message came"),
        Err(e) => fail(scenario, format!("receive failed: {e}")),
    }
}

async fn nothing_comes<T: Transport>(t: &T) -> bool {
    t.receive(1, QUIET).await.map(|v| v.is_empty()).unwrap_or(false)
}

async fn create<H: Harness>(h: &H, settings: EntitySettings) -> Option<H::Entity> {
    h.create(settings).await
}

async fn send<E: Entity>(e: &E, m: Message, scenario: &str) {
    if let Err(err) = e.send(m).await {
        fail(scenario, format!("send failed: {err}"));
    }
}

/// Plays every scenario against `harness`; `None` when its broker is unreachable and `CI` is
/// not set.
///
/// # Panics
///
/// When a scenario breaks a rule that every transport must keep (lost work, work done twice,
/// a hang past the bound): those are failures, not differences.
pub async fn run<H: Harness>(harness: &H) -> Option<Report> {
    let mut cells = BTreeMap::new();
    cells.insert(ABANDON, abandon(harness).await?);
    cells.insert(LOCK_EXPIRY, lock_expiry(harness).await?);
    cells.insert(MAX_DELIVERY, max_delivery(harness).await?);
    cells.insert(DEAD_LETTER, dead_letter(harness).await?);
    cells.insert(DUPLICATES, duplicates(harness).await?);
    cells.insert(DEFER, defer(harness).await?);
    cells.insert(RELEASE, release(harness).await?);
    cells.insert(RENEW, renew(harness).await?);
    cells.insert(ORDER, order(harness).await?);
    cells.insert(SESSION_ORDER, harness.sessions().await?);
    let (how, cell) = reconnect_how(harness).await?;
    let (measured, other) = match how {
        Interruption::Cut => (RECONNECT_CUT, RECONNECT),
        Interruption::Restarted | Interruption::Reopened => (RECONNECT, RECONNECT_CUT),
    };
    cells.insert(measured, cell);
    cells.insert(
        other,
        not_run(match how {
            Interruption::Cut => SHARED_SERVER,
            Interruption::Restarted => RESTART_ONLY,
            Interruption::Reopened => IN_PROCESS,
        }),
    );
    cells.insert(IN_FLIGHT, scenarios::in_flight(harness).await?);
    cells.insert(RECREATED, scenarios::recreated(harness).await?);
    cells.insert(LOCK_MISMATCH, scenarios::lock_mismatch(harness).await?);
    cells.insert(FOREIGN_PRODUCER, scenarios::foreign_producer(harness).await?);
    let stores = processor_scenarios(harness).await?;
    for (capability, by_store) in stores {
        let cell = if by_store.values().all(|c| c == YES) {
            YES.to_owned()
        } else {
            by_store.iter().map(|(s, c)| format!("{s}: {c}")).collect::<Vec<_>>().join("; ")
        };
        cells.insert(capability, cell);
    }
    Some(Report { transport: harness.name().to_owned(), cells })
}

async fn abandon<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "abandon";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    assert_eq!(d.message().delivery_count, 1, "{S}: first delivery");
    t.abandon(&d, Properties::new()).await.unwrap_or_else(|e| fail(S, e));
    let d = receive_one(t.as_ref(), S).await;
    let count = d.message().delivery_count;
    t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
    Some(if count == 2 { YES.into() } else { format!("count {count} after one abandon") })
}

async fn lock_expiry<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "lock expiry";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let first = receive_one(t.as_ref(), S).await;
    let again = receive_one(t.as_ref(), S).await;
    let count = again.message().delivery_count;
    let old = t.complete(&first).await;
    t.complete(&again).await.unwrap_or_else(|e| fail(S, e));
    Some(match (count, old) {
        (2, Err(e)) if e.is_lock_lost() => YES.into(),
        (2, other) => format!("the expired delivery settled: {other:?}"),
        (n, _) => format!("count {n} after one expired lock"),
    })
}

async fn max_delivery<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "MaxDeliveryCount";
    let settings = EntitySettings { max_delivery_count: 2, ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let t = e.transport();
    let id = unique("m");
    send(&e, Message::new("a").with_message_id(id.as_str()), S).await;
    for _ in 0..2 {
        let d = receive_one(t.as_ref(), S).await;
        t.abandon(&d, Properties::new()).await.unwrap_or_else(|e| fail(S, e));
    }
    if !nothing_comes(t.as_ref()).await {
        return Some("delivered past MaxDeliveryCount".into());
    }
    let dead = take_dead_letters_until(&e, 1, S).await;
    let m = dead.iter().find(|m| m.message_id().as_str() == id);
    Some(match m.and_then(|m| m.dead_letter_reason.as_deref()) {
        Some(twice::dead_letter_reasons::MAX_DELIVERY_COUNT_EXCEEDED) => YES.into(),
        Some(other) => format!("dead-lettered with reason {other:?}"),
        None => fail(S, "the message is neither in the entity nor dead-lettered: lost"),
    })
}

/// Takes dead letters until `n` have come or the bound has passed.
async fn take_dead_letters_until<E: Entity>(e: &E, n: usize, s: &str) -> Vec<ReceivedMessage> {
    let mut all = Vec::new();
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    while all.len() < n && clock.now() < until {
        match e.take_dead_letters().await {
            Ok(got) => all.extend(got),
            Err(err) => fail(s, format!("reading dead letters: {err}")),
        }
        if all.len() < n {
            clock.sleep(Duration::from_millis(100)).await;
        }
    }
    all
}

async fn dead_letter<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "dead-letter";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    let id = unique("m");
    send(&e, Message::new("a").with_message_id(id.as_str()), S).await;
    let d = receive_one(t.as_ref(), S).await;
    t.dead_letter(&d, DeadLetterReason::new("Rejected", "the order is invalid"))
        .await
        .unwrap_or_else(|e| fail(S, e));
    let dead = take_dead_letters_until(&e, 1, S).await;
    let Some(m) = dead.iter().find(|m| m.message_id().as_str() == id) else {
        fail(S, "the dead-lettered message is not in the dead-letter queue")
    };
    Some(
        if m.dead_letter_reason.as_deref() == Some("Rejected")
            && m.dead_letter_error_description.as_deref() == Some("the order is invalid")
        {
            YES.into()
        } else {
            format!(
                "reason {:?}, description {:?}",
                m.dead_letter_reason, m.dead_letter_error_description
            )
        },
    )
}

async fn duplicates<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "duplicates";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    let id = unique("m");
    for _ in 0..2 {
        send(&e, Message::new("a").with_message_id(id.as_str()), S).await;
    }
    let mut copies = 0;
    loop {
        let got = t.receive(10, QUIET).await.unwrap_or_else(|e| fail(S, e));
        if got.is_empty() {
            break;
        }
        for d in &got {
            copies += 1;
            t.complete(d).await.unwrap_or_else(|e| fail(S, e));
        }
    }
    Some(match copies {
        1 => YES.into(),
        2 => "no: both copies are delivered; the inbox claim completes the second".into(),
        n => fail(S, format!("{n} copies of 2 sends")),
    })
}

async fn defer<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "defer";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    Some(match t.defer(&d).await {
        Ok(()) => {
            if nothing_comes(t.as_ref()).await {
                YES.into()
            } else {
                "a deferred message was delivered again".into()
            }
        }
        Err(TransportError::Unsupported(_)) => {
            t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
            "no: Unsupported".into()
        }
        Err(err) => fail(S, err),
    })
}

async fn release<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "release";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    match t.release(&d).await {
        Ok(()) => {}
        Err(TransportError::Unsupported(_)) => {
            t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
            return Some("no: Unsupported".into());
        }
        Err(err) => fail(S, err),
    }
    let d = receive_one(t.as_ref(), S).await;
    let count = d.message().delivery_count;
    t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
    Some(if count == 1 { YES.into() } else { "no: the release counts a delivery".into() })
}

async fn renew<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "renew";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    let before = d.message().locked_until.unwrap_or(Timestamp::UNIX_EPOCH);
    twice::SharedClock::system().sleep(Duration::from_millis(20)).await;
    let renewed = t.renew_lock(&d).await;
    t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
    Some(match renewed {
        Ok(until) if until > before => YES.into(),
        Ok(until) => format!("renewal did not extend the lock ({until} ≤ {before})"),
        Err(TransportError::Unsupported(_)) => "no: Unsupported".into(),
        Err(err) => fail(S, err),
    })
}

async fn order<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "order";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    let ids: Vec<String> = (0..5).map(|i| format!("{}-{i}", unique("m"))).collect();
    for id in &ids {
        send(&e, Message::new("a").with_message_id(id.as_str()), S).await;
    }
    let mut seen = Vec::new();
    while seen.len() < ids.len() {
        let d = receive_one(t.as_ref(), S).await;
        seen.push(d.message().message_id().as_str().to_owned());
        t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
    }
    Some(if seen == ids { YES.into() } else { format!("received in the order {seen:?}") })
}

/// The cell of a scenario the harness could not play: `not run: <why>`.
pub fn not_run(why: &str) -> String {
    format!("{NOT_RUN}: {why}")
}

/// How a cell of a scenario that did not run begins.
pub const NOT_RUN: &str = "not run";

/// Why a shared server's restart row is not run.
pub const SHARED_SERVER: &str =
    "a server other tests share is not restarted in `cargo test`; `.ci/run` restarts it for real";
/// Why the cut row of a harness that restarts its server is not run.
pub const RESTART_ONLY: &str = "this harness restarts the server and has no proxy to cut";
/// Why the connection rows of an in-process broker are not run.
pub const IN_PROCESS: &str = "the broker is in process: there is no connection to cut";

/// The cell of [`RECONNECT`] for a broker in the test's process, reopened on its data.
pub const REOPENED: &str = "n/a: in-process; reopened on its data, nothing lost";

/// The reconnect scenario alone: a message sent before the broker goes away must come after it
/// comes back, and a send and a receive must work again within the bound; the transport from
/// before must reconnect by itself (or, reopened in process, must fail rather than hang).
///
/// # Panics
///
/// When a message is lost or nothing works within the bound after the interruption.
pub async fn reconnect<H: Harness>(h: &H) -> Option<String> {
    reconnect_how(h).await.map(|(_, cell)| cell)
}

/// [`reconnect`], and how the harness interrupted.
async fn reconnect_how<H: Harness>(h: &H) -> Option<(Interruption, String)> {
    const S: &str = "reconnect";
    // A short lock: a copy the transport had taken before the interruption comes back soon
    // wherever the broker kept its lock.
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    t.complete(&d).await.unwrap_or_else(|e| fail(S, e));
    // Left in the entity across the interruption: it must survive it.
    let kept = unique("kept");
    send(&e, Message::new("b").with_message_id(kept.as_str()), S).await;
    let how = e.interrupt().await;
    if how == Interruption::Reopened {
        match t.receive(1, QUIET).await {
            Err(TransportError::Closed) => {}
            other => fail(S, format!("the transport of the closed broker answered {other:?}")),
        }
    }
    // After the interruption, calls may fail with transient errors until the transport has
    // connected again; within the bound the kept message and a new one must come.
    let t = e.transport();
    let fresh = unique("m");
    let mut waiting: Vec<String> = vec![kept, fresh.clone()];
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    let mut sent = false;
    while clock.now() < until {
        if !sent {
            sent = e.send(Message::new("c").with_message_id(fresh.as_str())).await.is_ok();
        }
        match t.receive(2, Duration::from_secs(1)).await {
            Ok(got) => {
                for d in &got {
                    let id = d.message().message_id().as_str().to_owned();
                    if t.complete(d).await.is_ok() {
                        waiting.retain(|w| *w != id);
                    }
                }
            }
            Err(err) if err.is_transient() => {}
            Err(err) => fail(S, format!("a permanent error after the interruption: {err}")),
        }
        if sent && waiting.is_empty() {
            let cell = match how {
                Interruption::Restarted | Interruption::Cut => YES,
                Interruption::Reopened => REOPENED,
            };
            return Some((how, cell.into()));
        }
        clock.sleep(Duration::from_millis(100)).await;
    }
    fail(S, format!("after the interruption ({how:?}), not received within the bound: {waiting:?}"))
}

/// A store, a column group of the processor scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Store {
    Sqlite,
    Postgres,
    MariaDb,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::Sqlite => "SQLite",
            Store::Postgres => "PostgreSQL",
            Store::MariaDb => "MariaDB",
        }
    }
}

type ByStore = BTreeMap<&'static str, BTreeMap<&'static str, String>>;

async fn processor_scenarios<H: Harness>(h: &H) -> Option<ByStore> {
    let mut out: ByStore = BTreeMap::new();
    for store in [Store::Sqlite, Store::Postgres, Store::MariaDb] {
        let cells = match store {
            Store::Sqlite => {
                let db = crate::require_service("SQLite", SqliteDatabase::create())?;
                let pool = crate::require_service("SQLite", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "SQLite",
                    SqlxInbox::<Sqlite>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox)).await?
            }
            Store::Postgres => {
                let db =
                    crate::require_service("PostgreSQL", PgDatabase::create("twice_kit").await)?;
                let pool = crate::require_service("PostgreSQL", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "PostgreSQL",
                    SqlxInbox::<Postgres>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox)).await?
            }
            Store::MariaDb => {
                let db =
                    crate::require_service("MariaDB", MariaDatabase::create("twice_kit").await)?;
                let pool = crate::require_service("MariaDB", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "MariaDB",
                    SqlxInbox::<MySql>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox)).await?
            }
        };
        for (capability, cell) in cells {
            out.entry(capability).or_default().insert(store.name(), cell);
        }
    }
    Some(out)
}

async fn processor_with<H: Harness, I: Inbox>(
    h: &H,
    inbox: Arc<I>,
) -> Option<Vec<(&'static str, String)>> {
    Some(vec![
        (P_POISON, poison(h, &inbox).await?),
        (P_CRASH, crash_after_commit(h, &inbox).await?),
        (P_TWO_COPIES, two_copies(h, &inbox).await?),
        (P_LOCK_LOST, lock_lost(h, &inbox).await?),
        (LONG_HANDLER, scenarios::long_handler(h, &inbox).await?),
    ])
}

/// What the test handler does, from the body: `{"sleep_first_ms": n}` sleeps on a first
/// delivery, `{"sleep_ms": n}` on every one; anything that is not JSON is poison.
#[derive(serde::Deserialize, Default)]
struct Script {
    #[serde(default)]
    sleep_ms: u64,
    #[serde(default)]
    sleep_first_ms: u64,
}

/// Commits per message id, from the processor's commit hook.
type Commits = Arc<Mutex<HashMap<MessageId, u32>>>;

/// A running processor and what it has committed.
struct Running {
    commits: Commits,
    counters: Arc<twice::Counters>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), twice::ProcessorError>>,
}

impl Running {
    fn commits_of(&self, id: &str) -> u32 {
        let commits = self.commits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        commits.get(&MessageId::new(id)).copied().unwrap_or(0)
    }

    fn snapshot(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// Waits until `done` holds, or fails the scenario at the bound.
    async fn wait(&self, s: &str, done: impl Fn(&Self) -> bool) {
        let clock = twice::SharedClock::system();
        let until = clock.now() + BOUND;
        while !done(self) {
            if clock.now() >= until {
                fail(s, format!("not done within the bound; counters {:?}", self.snapshot()));
            }
            clock.sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the processor and waits for its run to return, or fails the scenario at the
    /// bound: a run that never returns (a settlement that never ends) is a failure that names
    /// its scenario, not a hang of the whole suite.
    async fn stop(self, s: &str) {
        let _ = self.stop.send(true);
        let counters = Arc::clone(&self.counters);
        match tokio::time::timeout(BOUND, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => fail(s, format!("the processor stopped with {e}")),
            Ok(Err(e)) => fail(s, format!("the processor task failed: {e}")),
            Err(_) => fail(
                s,
                format!(
                    "the processor did not stop within the bound after its shutdown; counters {:?}",
                    counters.snapshot()
                ),
            ),
        }
    }
}

fn start<T: Transport, I: Inbox>(
    transport: Arc<T>,
    inbox: &Arc<I>,
    options: ProcessorOptions,
) -> Running {
    let commits: Commits = Arc::default();
    let handler = handler_fn::<I::Tx, _>(|ctx, _tx| {
        Box::pin(async move {
            let Ok(script) = ctx.json::<Script>() else {
                return Ok(Outcome::dead_letter(twice::DESERIALIZATION_FAILED, "not JSON"));
            };
            let sleep = if ctx.delivery_count() == 1 {
                script.sleep_ms.max(script.sleep_first_ms)
            } else {
                script.sleep_ms
            };
            if sleep > 0 {
                twice::SharedClock::system().sleep(Duration::from_millis(sleep)).await;
            }
            Ok::<_, HandlerError>(Outcome::Complete)
        })
    });
    let processor = Processor::from_arcs(transport, Arc::clone(inbox), Arc::new(handler), options)
        .on_error(|_| {});
    let seen = Arc::clone(&commits);
    let processor = processor.on_committed(move |m| {
        let mut c = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *c.entry(m.message_id().clone()).or_default() += 1;
    });
    let counters = processor.counters();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    Running { commits, counters, stop, task }
}

fn options(consumer: &str) -> ProcessorOptions {
    ProcessorOptions::new()
        .consumer(consumer)
        .max_concurrent_calls(4)
        .max_wait(Duration::from_millis(200))
}

async fn poison<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>) -> Option<String> {
    const S: &str = "processor: poison";
    let e = create(h, EntitySettings::default()).await?;
    let id = unique("poison");
    send(&e, Message::new("not json").with_message_id(id.as_str()), S).await;
    let p = start(e.transport(), inbox, options(&unique("kit")));
    p.wait(S, |p| p.snapshot().dead_lettered >= 1).await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    let dead = take_dead_letters_until(&e, 1, S).await;
    let reason = dead
        .iter()
        .find(|m| m.message_id().as_str() == id)
        .and_then(|m| m.dead_letter_reason.clone());
    Some(match (commits, reason.as_deref()) {
        (0, Some(twice::DESERIALIZATION_FAILED)) => YES.into(),
        (0, other) => format!("dead-lettered with reason {other:?}"),
        (n, _) => fail(S, format!("poison work committed {n} times")),
    })
}

/// A transport that loses the first completion of every message: the process "crashed" after
/// the commit, before the complete reached the broker, so the message comes back when its lock
/// runs out.
#[derive(Debug)]
struct LoseFirstCompletion<T> {
    inner: Arc<T>,
    // A std Mutex: a set lookup, never held across an await.
    lost: Mutex<std::collections::HashSet<MessageId>>,
}

impl<T: Transport> Receive for LoseFirstCompletion<T> {
    type Delivery = T::Delivery;

    async fn receive(&self, n: usize, wait: Duration) -> Result<Vec<T::Delivery>, TransportError> {
        self.inner.receive(n, wait).await
    }

    async fn complete(&self, d: &T::Delivery) -> Result<(), TransportError> {
        let first = self
            .lost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(d.message().message_id().clone());
        if first {
            return Err(TransportError::Other {
                message: "the process crashed before the completion".into(),
                transient: true,
                source: None,
            });
        }
        self.inner.complete(d).await
    }

    async fn abandon(&self, d: &T::Delivery, p: Properties) -> Result<(), TransportError> {
        self.inner.abandon(d, p).await
    }

    async fn dead_letter(
        &self,
        d: &T::Delivery,
        r: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.inner.dead_letter(d, r).await
    }

    async fn defer(&self, d: &T::Delivery) -> Result<(), TransportError> {
        self.inner.defer(d).await
    }
}

impl<T: Transport> Transport for LoseFirstCompletion<T> {
    fn entity(&self) -> &EntityInfo {
        self.inner.entity()
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    async fn release(&self, d: &T::Delivery) -> Result<(), TransportError> {
        self.inner.release(d).await
    }

    async fn renew_lock(&self, d: &T::Delivery) -> Result<Timestamp, TransportError> {
        self.inner.renew_lock(d).await
    }
}

async fn crash_after_commit<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>) -> Option<String> {
    const S: &str = "processor: crash after commit";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("crash");
    send(&e, Message::new("{}").with_message_id(id.as_str()), S).await;
    let crashy = Arc::new(LoseFirstCompletion { inner: e.transport(), lost: Mutex::default() });
    let p = start(crashy, inbox, options(&unique("kit")));
    p.wait(S, |p| p.snapshot().duplicates_already_processed >= 1 && p.snapshot().completed >= 1)
        .await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    if !nothing_comes(e.transport().as_ref()).await {
        fail(S, "the message is still there after its duplicate was completed");
    }
    Some(if commits == 1 { YES.into() } else { fail(S, format!("work committed {commits} times")) })
}

async fn two_copies<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>) -> Option<String> {
    const S: &str = "processor: two copies";
    let settings = EntitySettings { duplicate_detection: false, ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("twin");
    for _ in 0..2 {
        send(&e, Message::new(r#"{"sleep_ms":300}"#).with_message_id(id.as_str()), S).await;
        // Further apart than the shortest duplicate window a broker that cannot turn detection
        // off accepts (JetStream: 100 ms).
        twice::SharedClock::system().sleep(Duration::from_millis(250)).await;
    }
    let p = start(e.transport(), inbox, options(&unique("kit")));
    p.wait(S, |p| p.snapshot().completed >= 2).await;
    let commits = p.commits_of(&id);
    let s = p.snapshot();
    p.stop(S).await;
    if commits != 1 {
        fail(S, format!("work committed {commits} times"));
    }
    Some(if s.duplicates_concurrent_copy + s.duplicates_already_processed >= 1 {
        YES.into()
    } else {
        fail(S, format!("two completions without a duplicate: {s:?}"))
    })
}

async fn lock_lost<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>) -> Option<String> {
    const S: &str = "processor: lock lost";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("slow");
    let sleep = settings.lock_duration + Duration::from_millis(1500);
    let body = format!(r#"{{"sleep_first_ms":{}}}"#, sleep.as_millis());
    send(&e, Message::new(body).with_message_id(id.as_str()), S).await;
    // No renewal: the first handler outlives its lock and a second copy runs.
    let options = options(&unique("kit")).max_auto_lock_renewal_duration(Duration::ZERO);
    let p = start(e.transport(), inbox, options);
    p.wait(S, |p| p.snapshot().completed >= 1 && p.snapshot().lock_lost >= 1).await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    if !nothing_comes(e.transport().as_ref()).await {
        fail(S, "the message is still there after it was completed");
    }
    Some(if commits == 1 { YES.into() } else { fail(S, format!("work committed {commits} times")) })
}

/// The capability table of `reports` in Markdown: a row per capability, a column per transport.
pub fn render_table(reports: &[Report]) -> String {
    let mut s = String::from("| capability |");
    for r in reports {
        let _ = write!(s, " {} |", r.transport);
    }
    s.push_str("\n|---|");
    for _ in reports {
        s.push_str("---|");
    }
    s.push('\n');
    for capability in CAPABILITIES {
        let _ = write!(s, "| {capability} |");
        for r in reports {
            let cell = r.cells.get(capability).map_or("not run", String::as_str);
            let _ = write!(s, " {cell} |");
        }
        s.push('\n');
    }
    s
}

impl Report {
    /// The report of a transport that did not run at all: every cell `not run`.
    pub fn not_run(transport: &str) -> Self {
        Self { transport: transport.to_owned(), cells: BTreeMap::new() }
    }
}

/// A report with these cells, for the expectations a test states.
pub fn expected(transport: &str, differences: &[(&'static str, &str)]) -> Report {
    let mut cells: BTreeMap<&'static str, String> =
        CAPABILITIES.iter().map(|c| (*c, YES.to_owned())).collect();
    for (capability, cell) in differences {
        assert!(CAPABILITIES.contains(capability), "unknown capability {capability:?}");
        cells.insert(capability, (*cell).to_owned());
    }
    Report { transport: transport.to_owned(), cells }
}
