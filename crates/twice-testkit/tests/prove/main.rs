//! The prove kit against handlers with planted bugs (each must be caught, naming the right
//! invariant), against a correct twice handler (which must pass), and against bad input
//! (which must give a clear report, never a pass).
//!
//! A test binary of its own, so that it does not load the machine while the conformance
//! kit's wall-clock scenarios run in `it`.

mod servers;

use std::sync::Arc;

use serde::Deserialize;
use sqlx::{Pool, Sqlite, Transaction};
use twice::{HandlerError, Message, Outcome, handler_fn};
use twice_sqlx::InboxOptions;
use twice_testkit::db::SqliteDatabase;
use twice_testkit::prove::{FakeService, Invariant, Keys, Prove, Report, Scenario, ServiceClient};

#[derive(Deserialize)]
struct Order {
    order_id: i64,
    quantity: i64,
}

type LiteTx = Transaction<'static, Sqlite>;

/// An order per index; every fourth is poison (a negative quantity), and the first of each
/// scenario is a free sample (quantity 0).
fn order(rng: &mut twice_testkit::prove::Seeded, i: usize) -> Message {
    let quantity =
        if i.is_multiple_of(1000) { 0 } else { i64::try_from(rng.between(1, 9)).unwrap_or(1) };
    let quantity = if i % 4 == 3 { -1 } else { quantity };
    Message::new(format!(r#"{{"order_id":{i},"quantity":{quantity}}}"#))
        .with_message_id(format!("order-{i}-placed"))
}

fn body(m: &Message) -> Order {
    serde_json::from_slice(&m.body).expect("an order")
}

fn is_poison(m: &Message) -> bool {
    body(m).quantity < 0
}

fn order_key(m: &Message) -> Option<String> {
    Some(body(m).order_id.to_string())
}

fn charge_path(m: &Message) -> Option<String> {
    Some(format!("/charges/order-{}", body(m).order_id))
}

const SHIPMENTS: &str = "SELECT order_id, COUNT(*) FROM shipments GROUP BY order_id";

/// A SQLite store with the shipments table (one shipment per order: a unique key) and a
/// payment service that honours idempotency keys.
struct Shop {
    _db: SqliteDatabase,
    pool: Pool<Sqlite>,
    payments: Arc<FakeService>,
}

async fn shop() -> Shop {
    let db = SqliteDatabase::create().expect("temp dir");
    let pool = db.pool(8).await.expect("pool");
    sqlx::query(
        "CREATE TABLE shipments (order_id INTEGER NOT NULL, quantity INTEGER NOT NULL \
         CHECK (quantity >= 0))",
    )
    .execute(&pool)
    .await
    .expect("shipments");
    sqlx::query("CREATE UNIQUE INDEX shipments_order_id ON shipments (order_id)")
        .execute(&pool)
        .await
        .expect("unique order");
    let payments = Arc::new(FakeService::start(Keys::Honour).await.expect("payments"));
    Shop { _db: db, pool, payments }
}

/// How a handler names its charge to the payment service.
#[derive(Clone, Copy)]
enum Key {
    /// The business key of the order: the same for every message of the order.
    Business,
    /// No key at all.
    None,
    /// A fresh random value on every call.
    Random,
}

/// The shop's handler: rejects poison, ships the order in `tx`, charges the order.
struct Shipping {
    payments: ServiceClient,
    key: Key,
}

impl twice::Handler<LiteTx> for Shipping {
    async fn handle<'a>(
        &'a self,
        ctx: twice::Context<'a>,
        tx: &'a mut LiteTx,
    ) -> Result<Outcome, HandlerError> {
        let order: Order = ctx.json()?;
        if order.quantity < 0 {
            return Ok(Outcome::dead_letter("InvalidQuantity", "a negative quantity"));
        }
        sqlx::query("INSERT INTO shipments (order_id, quantity) VALUES (?1, ?2)")
            .bind(order.order_id)
            .bind(order.quantity)
            .execute(&mut **tx)
            .await?;
        let key = match self.key {
            Key::Business => Some(
                ctx.business_idempotency_key(&format!("order-{}", order.order_id), "charge")
                    .to_string(),
            ),
            Key::None => None,
            Key::Random => Some(uuid::Uuid::new_v4().to_string()),
        };
        self.payments
            .post(&format!("/charges/order-{}", order.order_id), key.as_deref(), b"{}")
            .await
            .map_err(HandlerError::transient)?;
        Ok(Outcome::Complete)
    }
}

/// A factory of the shop's handler.
fn shipping(payments: ServiceClient, key: Key) -> impl Fn() -> Shipping + Send + Sync + 'static {
    move || Shipping { payments: payments.clone(), key }
}

fn shop_kit<H>(shop: &Shop, factory: impl Fn() -> H + Send + Sync + 'static) -> Prove<Sqlite, H>
where
    H: twice::Handler<LiteTx>,
{
    Prove::new(factory, shop.pool.clone())
        .inbox(InboxOptions::new().business_key("shipments", "shipments_order_id"))
        .messages(order)
        .poison(is_poison)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .service_once("charges per order", Arc::clone(&shop.payments), charge_path)
}

fn failure_of(report: &Report, invariant: Invariant) -> &twice_testkit::prove::Failure {
    assert!(report.errors.is_empty(), "the run itself failed:\n{report}");
    report
        .failures
        .iter()
        .find(|f| f.invariant == invariant)
        .unwrap_or_else(|| panic!("expected {invariant}, got:\n{report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_correct_twice_handler_passes_every_scenario() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Business)).run(11).await;
    assert!(report.passed(), "{report}");
    assert_eq!(report.scenarios.len(), Scenario::ALL.len());
    // SQLite has no connection to cut: commit-unknown did not run, and says so.
    let skipped: Vec<_> = report.not_applicable().map(|(s, _)| s).collect();
    assert_eq!(skipped, [Scenario::CommitUnknown], "{report}");
    assert!(report.to_string().contains("not applicable, not run: commit-unknown"), "{report}");
    assert!(
        report.scenarios.iter().all(|s| s.exercised || s.not_applicable.is_some()),
        "{report:?}"
    );
    println!("{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_external_call_without_an_idempotency_key_is_a_double_effect() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::None)).run(3).await;
    let f = failure_of(&report, Invariant::DoubleEffect);
    assert_eq!(f.effect.as_deref(), Some("charges per order"), "{report}");
    println!("{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idempotency_key_from_a_random_value_is_a_double_effect() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Random))
        .scenarios(&[Scenario::CrashBeforeCommit, Scenario::TransientError])
        .run(5)
        .await;
    let f = failure_of(&report, Invariant::DoubleEffect);
    assert_eq!(f.effect.as_deref(), Some("charges per order"), "{report}");
}

/// The twice handler's keys only help where the service honours them: against a service that
/// ignores them, its redeliveries charge again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_that_ignores_keys_defeats_even_the_twice_handler() {
    let mut shop = shop().await;
    shop.payments = Arc::new(FakeService::start(Keys::Ignore).await.expect("payments"));
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Business))
        .scenarios(&[Scenario::TransientError])
        .run(12)
        .await;
    let f = failure_of(&report, Invariant::DoubleEffect);
    assert_eq!(f.effect.as_deref(), Some("charges per order"), "{report}");
    let calls = shop.payments.calls();
    assert!(calls.iter().all(|c| c.idempotency_key.is_some()), "{calls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replaying_the_seed_reproduces_the_failure() {
    let mut firsts = Vec::new();
    for _ in 0..2 {
        let shop = shop().await;
        let report = shop_kit(&shop, shipping(shop.payments.client(), Key::None))
            .scenarios(&[Scenario::NewMessageId, Scenario::TransientError])
            .run(42)
            .await;
        let f = failure_of(&report, Invariant::DoubleEffect).clone();
        assert!(report.smallest.is_some(), "a shrunk schedule: {report}");
        assert!(report.to_string().contains("seed 42"), "{report}");
        firsts.push((f, report.smallest.clone()));
    }
    assert_eq!(firsts[0], firsts[1], "the same seed fails the same way");
}

/// The longer soak: several rounds on one store, each round's messages its own, so the
/// correct handler passes them all; a planted bug fails in some round, and replaying that
/// round's seed and round on a fresh store fails the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_soak_runs_rounds_on_one_store_and_a_failing_round_replays() {
    let one = shop().await;
    let kit = shop_kit(&one, shipping(one.payments.client(), Key::Business))
        .scenarios(&[Scenario::ConcurrentCopies, Scenario::NewMessageId]);
    let report = kit.soak(100, 4).await;
    assert!(report.passed(), "{report}");
    assert_eq!((report.seed, report.round), (103, 3), "the last round's report: {report}");

    // A planted bug fails at once, in the first round.
    let two = shop().await;
    let report = shop_kit(&two, shipping(two.payments.client(), Key::None))
        .scenarios(&[Scenario::TransientError])
        .soak(7, 3)
        .await;
    failure_of(&report, Invariant::DoubleEffect);
    assert_eq!((report.seed, report.round), (7, 0), "{report}");
    // A later round, replayed on fresh stores, fails the same way each time.
    let mut failures = Vec::new();
    for _ in 0..2 {
        let fresh = shop().await;
        let again = shop_kit(&fresh, shipping(fresh.payments.client(), Key::None))
            .scenarios(&[Scenario::TransientError])
            .replay(9, 2)
            .await;
        assert!(again.to_string().contains("replay it with .replay(9, 2)"), "{again}");
        failures.push(failure_of(&again, Invariant::DoubleEffect).clone());
    }
    assert_eq!(failures[0], failures[1]);
}

/// A handler that ignores a failed insert (the free sample's quantity 0 breaks no rule here,
/// but a quantity check written as `> 0` does) and completes: the message is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_swallowed_database_error_is_a_lost_message() {
    let db = SqliteDatabase::create().expect("temp dir");
    let pool = db.pool(8).await.expect("pool");
    sqlx::query(
        "CREATE TABLE shipments (order_id INTEGER NOT NULL, quantity INTEGER NOT NULL \
         CHECK (quantity > 0))",
    )
    .execute(&pool)
    .await
    .expect("shipments");
    let swallow = || {
        handler_fn(|ctx, tx: &mut LiteTx| {
            Box::pin(async move {
                let order: Order = ctx.json()?;
                if order.quantity < 0 {
                    return Ok(Outcome::dead_letter("InvalidQuantity", "a negative quantity"));
                }
                let inserted =
                    sqlx::query("INSERT INTO shipments (order_id, quantity) VALUES (?1, ?2)")
                        .bind(order.order_id)
                        .bind(order.quantity)
                        .execute(&mut **tx)
                        .await;
                if let Err(e) = inserted {
                    eprintln!("could not ship order {}: {e}", order.order_id); // and carries on
                }
                Ok(Outcome::Complete)
            })
        })
    };
    let report = Prove::new(swallow, pool.clone())
        .messages(order)
        .poison(is_poison)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::CrashAfterCommit])
        .run(1)
        .await;
    let f = failure_of(&report, Invariant::LostMessage);
    assert_eq!(f.effect.as_deref(), Some("shipments per order"), "{report}");
}

/// A handler that buffers its writes and flushes them in batches, after the message is
/// completed: the message is completed before its work commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completing_before_the_commit_is_a_lost_message() {
    let shop = shop().await;
    let buffer: Arc<std::sync::Mutex<Vec<(i64, i64)>>> = Arc::default();
    let write_behind = {
        let buffer = Arc::clone(&buffer);
        move || {
            let buffer = Arc::clone(&buffer);
            handler_fn(move |ctx, _tx: &mut LiteTx| {
                let buffer = Arc::clone(&buffer);
                Box::pin(async move {
                    let order: Order = ctx.json()?;
                    if order.quantity < 0 {
                        return Ok(Outcome::dead_letter("InvalidQuantity", "a negative quantity"));
                    }
                    // Flushed by a batch writer every 100 orders, in a transaction of its own.
                    buffer.lock().expect("buffer").push((order.order_id, order.quantity));
                    Ok(Outcome::Complete)
                })
            })
        }
    };
    let report = Prove::new(write_behind, shop.pool.clone())
        .messages(order)
        .poison(is_poison)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::ConcurrentCopies])
        .run(2)
        .await;
    let f = failure_of(&report, Invariant::LostMessage);
    assert!(f.detail.contains("before its work committed"), "{report}");
    assert!(!buffer.lock().expect("buffer").is_empty(), "the handler ran");
}

/// A handler that completes a poison message instead of dead-lettering it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_message_completed_is_named() {
    let shop = shop().await;
    let lenient = || {
        handler_fn(|ctx, tx: &mut LiteTx| {
            Box::pin(async move {
                let order: Order = ctx.json()?;
                if order.quantity >= 0 {
                    sqlx::query("INSERT INTO shipments (order_id, quantity) VALUES (?1, ?2)")
                        .bind(order.order_id)
                        .bind(order.quantity)
                        .execute(&mut **tx)
                        .await?;
                }
                Ok(Outcome::Complete)
            })
        })
    };
    let report = Prove::new(lenient, shop.pool.clone())
        .messages(order)
        .poison(is_poison)
        .messages_per_scenario(5, 5)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::CrashAfterCommit])
        .run(9)
        .await;
    failure_of(&report, Invariant::PoisonNotDeadLettered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_is_an_error_of_the_run() {
    let shop = shop().await;
    let panics = || {
        handler_fn(|_ctx, _tx: &mut LiteTx| {
            Box::pin(async move {
                if true {
                    panic!("a bug in the handler");
                }
                Ok(Outcome::Complete)
            })
        })
    };
    let report = Prove::new(panics, shop.pool.clone())
        .messages(order)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::CrashBeforeCommit])
        .run(4)
        .await;
    assert!(!report.passed());
    assert!(report.errors.iter().any(|e| e.contains("panicked")), "{report}");
    assert!(report.to_string().contains("a bug in the handler"), "{report}");
}

/// The store has no inbox table: the kit creates it. The effect's table is missing too: the
/// query fails, and the report says so before any scenario runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_without_tables_gets_its_inbox_and_a_failing_effect_query_is_reported() {
    let db = SqliteDatabase::create().expect("temp dir");
    let pool = db.pool(4).await.expect("pool");
    let payments = FakeService::start(Keys::Honour).await.expect("payments");
    let report = Prove::new(shipping(payments.client(), Key::Business), pool.clone())
        .messages(order)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .run(1)
        .await;
    assert!(!report.passed());
    assert!(report.scenarios.is_empty(), "nothing ran: {report}");
    let error = report.errors.join("\n");
    assert!(error.contains("shipments per order") && error.contains("no such table"), "{report}");

    // With the effect's table there, the kit runs, and creates the inbox table it needs.
    sqlx::query("CREATE TABLE shipments (order_id INTEGER NOT NULL, quantity INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .expect("shipments");
    let only_ship = || {
        handler_fn(|ctx, tx: &mut LiteTx| {
            Box::pin(async move {
                let order: Order = ctx.json()?;
                sqlx::query("INSERT INTO shipments (order_id, quantity) VALUES (?1, ?2)")
                    .bind(order.order_id)
                    .bind(order.quantity)
                    .execute(&mut **tx)
                    .await?;
                Ok(Outcome::Complete)
            })
        })
    };
    let report = Prove::new(only_ship, pool.clone())
        .messages(order)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::LockLoss])
        .run(1)
        .await;
    assert!(report.passed(), "{report}");
    let inbox: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM twice_inbox")
        .fetch_one(&pool)
        .await
        .expect("the kit created the inbox table");
    assert!(inbox >= 2, "{inbox} claims");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_effect_query_that_fails_a_bad_generator_and_no_scenario_are_reported() {
    let shop = shop().await;
    let handler = shipping(shop.payments.client(), Key::Business);
    let report = Prove::new(handler, shop.pool.clone())
        .messages(order)
        .effect_once("broken", "SELECT order_id, COUNT(*) FROM shipments GROUP BY nope", order_key)
        .run(1)
        .await;
    assert!(report.errors.iter().any(|e| e.contains("\"broken\"")), "{report}");
    assert!(report.to_string().contains("FAILED"), "{report}");

    let handler = shipping(shop.payments.client(), Key::Business);
    let report = Prove::new(handler, shop.pool.clone())
        .messages(|_, i| Message::new(i.to_string()))
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .run(1)
        .await;
    assert!(report.errors.iter().any(|e| e.contains("without a message id")), "{report}");

    let handler = shipping(shop.payments.client(), Key::Business);
    let report = Prove::new(handler, shop.pool.clone())
        .messages(|_, i| Message::new(i.to_string()).with_message_id("always-the-same"))
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .run(1)
        .await;
    assert!(report.errors.iter().any(|e| e.contains("the same message id")), "{report}");

    let handler = shipping(shop.payments.client(), Key::Business);
    let report = Prove::new(handler, shop.pool.clone())
        .messages(order)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[])
        .run(1)
        .await;
    assert!(!report.passed(), "an empty schedule proves nothing: {report}");
}

/// A fault that cannot happen (every message is poison, so nothing ever commits) makes the run
/// an error: it proves nothing about that fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fault_that_was_not_exercised_is_an_error_not_a_pass() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Business))
        .poison(|_| true)
        .scenarios(&[Scenario::CrashAfterCommit])
        .run(1)
        .await;
    assert!(!report.passed());
    assert!(report.errors.iter().any(|e| e.contains("not exercised")), "{report}");
    assert!(report.scenarios.iter().all(|s| !s.exercised), "{report:?}");
}

/// The processor dies after receiving a message and before its claim: nothing of the message
/// reached the store, and the redelivery after the lock's expiry claims it and runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_before_the_claim_leaves_nothing_and_the_redelivery_runs_once() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Business))
        .scenarios(&[Scenario::CrashBeforeClaim])
        .run(11)
        .await;
    assert!(report.passed(), "{report}");
    let run = &report.scenarios[0];
    assert!(run.exercised, "{report:?}");
    let target = run.target.as_deref().expect("a target");
    let history = run.history.join("\n");
    let died = format!("p0 fault on {target}: died before its claim");
    assert!(history.contains(&died), "{history}");
    assert!(!history.contains(&format!("p0 claim of {target}")), "{history}");
    assert!(!history.contains(&format!("p0 handler started on {target}")), "{history}");
    assert!(history.contains(&format!("p1 received {target} (delivery 2)")), "{history}");
    assert!(history.contains(&format!("p1 claim of {target}: claimed")), "{history}");
}

/// A handler that drops what it takes for an old message: an order whose id is below the last
/// one shipped. In one session, sent out of order, the earlier order is taken for old and is
/// completed with no shipment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_trusts_the_session_order_loses_a_message() {
    let shop = shop().await;
    let by_sequence = || {
        handler_fn(|ctx, tx: &mut LiteTx| {
            Box::pin(async move {
                let order: Order = ctx.json()?;
                if order.quantity < 0 {
                    return Ok(Outcome::dead_letter("InvalidQuantity", "a negative quantity"));
                }
                let last: Option<i64> = sqlx::query_scalar("SELECT MAX(order_id) FROM shipments")
                    .fetch_one(&mut **tx)
                    .await?;
                if last.is_some_and(|last| order.order_id <= last) {
                    return Ok(Outcome::Complete); // "seen already": the session is in order
                }
                sqlx::query("INSERT INTO shipments (order_id, quantity) VALUES (?1, ?2)")
                    .bind(order.order_id)
                    .bind(order.quantity)
                    .execute(&mut **tx)
                    .await?;
                Ok(Outcome::Complete)
            })
        })
    };
    let report = Prove::new(by_sequence, shop.pool.clone())
        .messages(order)
        .poison(is_poison)
        .effect_once("shipments per order", SHIPMENTS, order_key)
        .scenarios(&[Scenario::SessionOrder])
        .run(11)
        .await;
    let f = failure_of(&report, Invariant::LostMessage);
    assert_eq!(f.effect.as_deref(), Some("shipments per order"), "{report}");
    assert!(report.smallest.is_some(), "a shrunk schedule: {report}");
    println!("{report}");
}

/// SQLite has no connection to cut: the commit-unknown scenario is not applicable, and a run
/// of it alone proves nothing, which is no pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commit_unknown_on_sqlite_is_not_applicable_and_alone_is_no_pass() {
    let shop = shop().await;
    let report = shop_kit(&shop, shipping(shop.payments.client(), Key::Business))
        .scenarios(&[Scenario::CommitUnknown])
        .run(1)
        .await;
    assert!(!report.passed(), "{report}");
    let (scenario, why) = report.not_applicable().next().expect("not applicable");
    assert_eq!(scenario, Scenario::CommitUnknown);
    assert!(why.contains("SQLite"), "{why}");
    assert!(report.errors.iter().any(|e| e.contains("nothing was proved")), "{report}");
    assert!(report.to_string().contains("not applicable, not run: commit-unknown"), "{report}");
}
