//! Handlers that run for three times the lock duration, one call at a time, over the client
//! against `twice serve` in process: each message is handled once, on its first delivery, and
//! none is dead-lettered. The messages waiting behind a long handler must not be locked (and
//! their locks left to run out) while it runs: a lock that runs out in a buffer burns one of
//! the message's deliveries unseen.
//!
//! Time is the server's manual clock, which the processor uses too. The test moves it one
//! second at a time, and before each step waits until the processor has renewed the lock of
//! the message in flight as often as the time gone by requires, so no lock runs out for want
//! of a round trip.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use twice::{
    Clock as _, Context, EntityInfo, Handler, ManualClock, Message, Outcome, Processor,
    ProcessorOptions, SessionProcessor, SessionProcessorOptions, SharedClock, Timestamp,
};
use twice_broker::config::QueueProperties;
use twice_servicebus_client::ReceiverOptions;
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::require_service;

use crate::harness::Serve;

const LOCK: Duration = Duration::from_secs(10);
/// When the processor renews: half the lock before it runs out (`renewal_margin`).
const RENEW_EVERY: Duration = Duration::from_secs(5);
const HANDLER_RUNS: Duration = Duration::from_secs(30);
const MESSAGES: usize = 3;

/// What the handler saw: the message id, its delivery count, when it started, and the
/// processor's renewals count at that moment.
#[derive(Clone, Debug)]
struct Call {
    id: String,
    delivery_count: u32,
    started: Timestamp,
    renewals_before: u64,
}

type Calls = Arc<Mutex<Vec<Call>>>;

fn lock(calls: &Calls) -> std::sync::MutexGuard<'_, Vec<Call>> {
    calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A handler that records its call and runs until the clock has moved `HANDLER_RUNS` on.
struct LongHandler {
    clock: ManualClock,
    calls: Calls,
    /// The processor's counters, set once it is made.
    counters: Arc<Mutex<Option<Arc<twice::Counters>>>>,
}

impl Handler<sqlx::Transaction<'static, sqlx::Postgres>> for LongHandler {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        _tx: &'a mut sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> Result<Outcome, twice::HandlerError> {
        let started = self.clock.now();
        let renewals_before = self
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, |c| c.snapshot().renewals);
        lock(&self.calls).push(Call {
            id: ctx.message_id().to_string(),
            delivery_count: ctx.message().delivery_count,
            started,
            renewals_before,
        });
        self.clock.sleep_until(started + HANDLER_RUNS).await;
        Ok(Outcome::Complete)
    }
}

fn long_handler(
    clock: ManualClock,
    calls: Calls,
    counters: Arc<Mutex<Option<Arc<twice::Counters>>>>,
) -> LongHandler {
    LongHandler { clock, calls, counters }
}

/// Moves the clock a second at a time until `done`, waiting before each step for the renewals
/// the call in flight is due.
async fn drive(
    s: &Serve,
    calls: &Calls,
    counters: &twice::Counters,
    mut done: impl FnMut() -> bool,
) {
    for _ in 0..2_000 {
        if done() {
            return;
        }
        let current = lock(calls).last().cloned();
        if let Some(call) = current {
            let elapsed = s.clock.now().duration_since(call.started);
            if elapsed < HANDLER_RUNS {
                let due = u64::try_from(elapsed.as_millis() / RENEW_EVERY.as_millis()).unwrap_or(0);
                for _ in 0..10_000 {
                    if counters.snapshot().renewals - call.renewals_before >= due {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        // Let the processor take its next message, or settle the last one, at this time.
        tokio::time::sleep(Duration::from_millis(5)).await;
        s.clock.advance(Duration::from_secs(1));
    }
    panic!("gave up: {:?}; {:?}", lock(calls), counters.snapshot());
}

async fn inbox(db: &PgDatabase) -> SqlxInbox<sqlx::Postgres> {
    let pool = db.pool(4).await.expect("pool");
    SqlxInbox::new(pool, InboxOptions::new()).await.expect("inbox")
}

fn queue(session: bool) -> QueueProperties {
    QueueProperties::default()
        .with_lock_duration(LOCK)
        .with_max_delivery_count(2)
        .with_requires_session(session)
}

fn assert_each_once_on_its_first_delivery(calls: &Calls, dead_letters: u64) {
    let calls = lock(calls).clone();
    let seen: Vec<(String, u32)> = calls.iter().map(|c| (c.id.clone(), c.delivery_count)).collect();
    let expected: Vec<(String, u32)> = (0..MESSAGES).map(|i| (format!("m-{i}"), 1)).collect();
    assert_eq!(seen, expected, "each message once, on its first delivery");
    assert_eq!(dead_letters, 0, "nothing dead-lettered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_three_locks_long_on_a_queue_burns_no_delivery() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let s = Serve::start().await;
    s.broker.create_queue("long", queue(false)).await.expect("queue");
    let info: EntityInfo = s.broker.entity_info("long").await.expect("info");
    let client = s.client();
    let sender = client.sender("long");
    for i in 0..MESSAGES {
        sender.send_message(Message::new("{}").with_message_id(format!("m-{i}"))).await.unwrap();
    }
    let calls = Calls::default();
    let counters_slot = Arc::default();
    let handler = long_handler(s.clock.clone(), calls.clone(), Arc::clone(&counters_slot));
    let receiver =
        client.receiver("long", ReceiverOptions::new().max_concurrent_calls(1).entity_info(info));
    let p = Processor::new(
        receiver,
        inbox(&db).await,
        handler,
        ProcessorOptions::new()
            .max_concurrent_calls(1)
            .max_wait(Duration::from_secs(2))
            .clock(SharedClock::from(s.clock.clone())),
    )
    .on_error(|e| eprintln!("processor: {e}"));
    let counters = p.counters();
    *counters_slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
        Some(Arc::clone(&counters));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(p.run(async move {
        let _ = stopped.await;
    }));
    let total = u64::try_from(MESSAGES).unwrap();
    drive(&s, &calls, &counters, || counters.snapshot().completed >= total).await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();

    let c = counters.snapshot();
    let dead = s.broker.counts("long").await.unwrap().dead_letter;
    eprintln!("{c:?}");
    assert_each_once_on_its_first_delivery(&calls, dead);
    assert_eq!((c.completed, c.lock_lost, c.expired_in_buffer), (total, 0, 0), "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_three_locks_long_in_a_session_burns_no_delivery() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let s = Serve::start().await;
    s.broker.create_queue("long", queue(true)).await.expect("queue");
    let info: EntityInfo = s.broker.entity_info("long").await.expect("info");
    let client = s.client();
    let sender = client.sender("long");
    for i in 0..MESSAGES {
        let m = Message::new("{}").with_message_id(format!("m-{i}")).with_session_id("s-1");
        sender.send_message(m).await.unwrap();
    }
    let calls = Calls::default();
    let counters_slot = Arc::default();
    let handler = long_handler(s.clock.clone(), calls.clone(), Arc::clone(&counters_slot));
    let sessions = client.session_receiver("long", ReceiverOptions::new().entity_info(info));
    let p = SessionProcessor::new(
        sessions,
        inbox(&db).await,
        handler,
        SessionProcessorOptions::new()
            .max_concurrent_sessions(1)
            .max_wait(Duration::from_secs(2))
            .clock(SharedClock::from(s.clock.clone())),
    )
    .on_error(|e| eprintln!("processor: {e}"));
    let counters = p.counters();
    *counters_slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
        Some(Arc::clone(&counters));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(p.run(async move {
        let _ = stopped.await;
    }));
    let total = u64::try_from(MESSAGES).unwrap();
    drive(&s, &calls, &counters, || counters.snapshot().completed >= total).await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();

    let c = counters.snapshot();
    let dead = s.broker.counts("long").await.unwrap().dead_letter;
    eprintln!("{c:?}");
    assert_each_once_on_its_first_delivery(&calls, dead);
    assert_eq!((c.completed, c.lock_lost), (total, 0), "{c:?}");
}

/// The receiver's link is detached while a handler runs (here by the receiver itself; the
/// service detaches links too): the message's lock belonged to that link, and its delivery
/// can no longer be settled. The next renewal fails at once as lock-lost, without asking the
/// service (which would keep the message locked, unsettleable, for as long as the renewals
/// go on), and the handler is stopped with its work rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_link_stops_the_renewal_at_once() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let s = Serve::start().await;
    s.broker.create_queue("long", queue(false)).await.expect("queue");
    let info: EntityInfo = s.broker.entity_info("long").await.expect("info");
    let client = s.client();
    client.sender("long").send_message(Message::new("{}").with_message_id("m-0")).await.unwrap();
    let calls = Calls::default();
    let handler = long_handler(s.clock.clone(), calls.clone(), Arc::default());
    let receiver = Arc::new(
        client.receiver("long", ReceiverOptions::new().max_concurrent_calls(1).entity_info(info)),
    );
    let p = Processor::from_arcs(
        Arc::clone(&receiver),
        Arc::new(inbox(&db).await),
        Arc::new(handler),
        ProcessorOptions::new()
            .max_concurrent_calls(1)
            .max_wait(Duration::from_secs(2))
            .clock(SharedClock::from(s.clock.clone())),
    )
    .on_error(|e| eprintln!("processor: {e}"));
    let counters = p.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(p.run(async move {
        let _ = stopped.await;
    }));
    for _ in 0..10_000 {
        if !lock(&calls).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(lock(&calls).len(), 1, "the handler runs");
    receiver.close().await;
    // Past the first renewal (5 s in), short of the lock's end (10 s).
    for _ in 0..8 {
        s.clock.advance(Duration::from_secs(1));
        for _ in 0..200 {
            let c = counters.snapshot();
            if c.lock_lost > 0 || c.renewals > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let c = counters.snapshot();
    // Before the shutdown, which waits for a handler still running.
    assert_eq!((c.lock_lost, c.renewals, c.committed), (1, 0, 0), "{c:?}");
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

/// A processor stops (its shutdown resolves) while its receive call waits, its client living
/// on: the credit that call opened is taken back, so a message sent afterwards is not locked
/// to a link nobody reads (where it would stay until its lock ran out, spending a delivery),
/// and another receiver gets it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_processor_leaves_no_credit_behind() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let s = Serve::start().await;
    s.broker.create_queue("long", queue(false)).await.expect("queue");
    let info: EntityInfo = s.broker.entity_info("long").await.expect("info");
    let client = s.client();
    let handler = long_handler(s.clock.clone(), Calls::default(), Arc::default());
    let p = Processor::new(
        client.receiver("long", ReceiverOptions::new().max_concurrent_calls(4).entity_info(info)),
        inbox(&db).await,
        handler,
        ProcessorOptions::new()
            .max_concurrent_calls(4)
            .max_wait(Duration::from_millis(200))
            .clock(SharedClock::from(s.clock.clone())),
    );
    let health = p.health_handle();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(p.run(async move {
        let _ = stopped.await;
    }));
    // Stop it once it has received (nothing) and asks again.
    for _ in 0..10_000 {
        if health.check().await.last_receive_at.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = stop.send(());
    task.await.unwrap().unwrap();

    client.sender("long").send_message(Message::new("{}").with_message_id("m-9")).await.unwrap();
    let other = client.receiver("long", ReceiverOptions::new());
    let got = other.receive_messages(1, Duration::from_secs(5)).await.unwrap();
    let counts = s.broker.counts("long").await.unwrap();
    assert_eq!(got.len(), 1, "the message went to the stopped processor's link: {counts:?}");
    assert_eq!(got[0].message().delivery_count, 1);
}
