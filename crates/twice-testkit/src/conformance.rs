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
use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use twice::{
    DeadLetterReason, Delivery, Message, Properties, Receive, ReceivedMessage, Timestamp,
    Transport, TransportError,
};

mod processor;
pub mod scenarios;
pub mod sessions;

use processor::{Batch, options, processor_cells, start};
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
    cells.append(&mut processor_cells(harness, Batch(None)).await?);
    Some(Report { transport: harness.name().to_owned(), cells })
}

/// Plays the processor scenarios alone (the rows `processor: …` of the table) with the
/// processor taking batches of up to `batch` messages per transaction
/// ([`twice::ProcessorOptions::batch_size`]): each must end as it does one message at a time.
pub async fn run_batched<H: Harness>(harness: &H, batch: usize) -> Option<Report> {
    let cells = processor_cells(harness, Batch(Some(batch))).await?;
    Some(Report { transport: format!("{}, batches of {batch}", harness.name()), cells })
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
