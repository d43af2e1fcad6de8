//! The demo's own handlers under `twice_testkit::prove`: the twice handler passes every
//! scenario, the naive one fails with the invariant it breaks and a shrunk schedule.
//!
//! The kit's fake services stand in for the demo's payment and mail services, honouring
//! idempotency keys as the demo's do; a call's effect is counted by the order in its body
//! (the demo posts every charge to `/charges`). The handlers run as the demo runs them: the
//! twice one through [`handle_twice`], in the claim's transaction, with the run's shipments
//! table (its business key registered with the inbox) and outbox; the naive one through
//! [`Naive::work`], its own transaction on the pool and its event sent straight to a broker,
//! under a processor that claims nothing ([`Mode::NaturallyIdempotent`]), as the demo's naive
//! consumer does not. The naive one writes through the pool while the processor's transaction
//! is open, which SQLite's write lock does not allow: it is proved on PostgreSQL.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Pool, Postgres, Sqlite, Transaction};
use twice::{Context, Handler, HandlerError, Message, Mode, Outcome, SharedClock};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::InboxOptions;
use twice_testkit::db::{PgDatabase, SqliteDatabase};
use twice_testkit::prove::{Call, FakeService, Invariant, Keys, Prove, Report, Scenario, Seeded};
use twice_testkit::require_service;

use super::broker::DemoTransport;
use super::db::{DemoDb, Tables};
use super::faults::{FaultTable, FaultyReceiver};
use super::handlers::{Naive, NaiveCounters, OrderPlaced, Shop, handle_twice};
use super::services::Client;

/// The seed both handlers are proved with.
const SEED: u64 = 3;

/// The payment and mail services of one run.
struct Services {
    payments: Arc<FakeService>,
    mail: Arc<FakeService>,
}

impl Services {
    async fn start() -> Self {
        Self {
            payments: Arc::new(FakeService::start(Keys::Honour).await.expect("payments")),
            mail: Arc::new(FakeService::start(Keys::Honour).await.expect("mail")),
        }
    }

    /// The demo's shop on these services. A shop (and so a client) per message: the kit's
    /// services answer one request per connection, and the demo's client keeps a connection
    /// for the next call.
    fn shop(payments: SocketAddr, mail: SocketAddr) -> Shop {
        Shop {
            payments: Client::new(payments),
            mail: Client::new(mail),
            faults: Arc::new(FaultTable::default()),
            stall: Duration::ZERO,
            clock: SharedClock::system(),
        }
    }
}

/// An order per index, as the demo's plan makes them (no poison).
fn order(rng: &mut Seeded, i: usize) -> Message {
    let amount_cents = rng.between(100, 99_999);
    Message::new(format!(
        r#"{{"order_id":{i},"amount_cents":{amount_cents},"email":"customer-{i}@example.com"}}"#
    ))
    .with_message_id(format!("order-{i}-placed"))
    .with_content_type("application/json")
}

/// The order id of a message, as text.
fn order_key(m: &Message) -> Option<String> {
    let order: OrderPlaced = serde_json::from_slice(&m.body).ok()?;
    Some(order.order_id.to_string())
}

/// The order id a call to the payment or mail service acts on, from its body.
fn call_key(c: &Call) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(&c.body).ok()?;
    Some(body.get("order_id")?.as_u64()?.to_string())
}

/// The kit on `pool`, with the effects the demo counts: shipments in `shipments`, charges and
/// emails per order.
fn kit<DB, H>(
    factory: impl Fn() -> H + Send + Sync + 'static,
    pool: Pool<DB>,
    shipments: &str,
    services: &Services,
) -> Prove<DB, H>
where
    DB: twice_testkit::prove::Store,
    H: Handler<Transaction<'static, DB>>,
    twice_sqlx::SqlxInbox<DB>:
        twice::Inbox<Tx = Transaction<'static, DB>, Error = twice_sqlx::StoreError>,
{
    Prove::new(factory, pool)
        .messages(order)
        .effect_once(
            "shipments per order",
            &format!("SELECT order_id, COUNT(*) FROM {shipments} GROUP BY order_id"),
            order_key,
        )
        .service_calls_once(
            "charges per order",
            Arc::clone(&services.payments),
            order_key,
            call_key,
        )
        .service_calls_once("emails per order", Arc::clone(&services.mail), order_key, call_key)
}

/// The demo's twice handler, as the demo's processor runs it.
struct TwiceShipping {
    payments: SocketAddr,
    mail: SocketAddr,
    table: String,
}

impl<DB: DemoDb> Handler<Transaction<'static, DB>> for TwiceShipping {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        tx: &'a mut Transaction<'static, DB>,
    ) -> Result<Outcome, HandlerError> {
        let order: OrderPlaced = ctx.json()?;
        let shop = Services::shop(self.payments, self.mail);
        handle_twice::<DB>(&shop, &self.table, ctx, order, tx).await
    }
}

/// The twice handler proved on `pool` (its tables made for the run): every scenario.
async fn prove_twice<DB: DemoDb + twice_testkit::prove::Store>(pool: Pool<DB>) -> Report
where
    twice_sqlx::SqlxInbox<DB>:
        twice::Inbox<Tx = Transaction<'static, DB>, Error = twice_sqlx::StoreError>,
{
    let tables = Tables::new("prove");
    DB::create_tables(&pool, &tables).await.expect("the demo's tables");
    let outbox = DB::outbox(&pool, &tables.outbox).await.expect("the demo's outbox");
    let services = Services::start().await;
    let (payments, mail) = (services.payments.addr(), services.mail.addr());
    let table = tables.shipments.clone();
    let factory = move || TwiceShipping { payments, mail, table: table.clone() };
    kit(factory, pool, &tables.shipments, &services)
        .inbox(
            InboxOptions::new()
                .table(tables.inbox.clone())
                .business_key(tables.shipments.clone(), tables.shipments_key.clone()),
        )
        .outbox(outbox)
        .run(SEED)
        .await
}

/// The demo's naive consumer's work on one message, as a handler: it ignores the processor's
/// transaction and uses its own.
#[derive(Clone)]
struct NaiveShipping {
    receiver: Arc<FaultyReceiver>,
    pool: Pool<Postgres>,
    table: String,
    counters: Arc<NaiveCounters>,
    events: Arc<DemoTransport>,
    payments: SocketAddr,
    mail: SocketAddr,
}

impl Handler<Transaction<'static, Postgres>> for NaiveShipping {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        _tx: &'a mut Transaction<'static, Postgres>,
    ) -> Result<Outcome, HandlerError> {
        let naive = Naive {
            receiver: Arc::clone(&self.receiver),
            pool: self.pool.clone(),
            table: self.table.clone(),
            shop: Arc::new(Services::shop(self.payments, self.mail)),
            counters: Arc::clone(&self.counters),
            concurrency: 1,
            events: Arc::clone(&self.events),
        };
        // An error abandons the message in the demo; here the processor retries it.
        naive
            .work(ctx.message())
            .await
            .map_err(|e| HandlerError::transient(e.into_boxed_dyn_error()))?;
        Ok(Outcome::Complete)
    }
}

async fn postgres() -> Option<(PgDatabase, Pool<Postgres>)> {
    let db = require_service("PostgreSQL", PgDatabase::create("twice_prove_demo").await)?;
    let pool = db.pool(8).await.expect("pool");
    Some((db, pool))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demos_twice_handler_passes_every_scenario_on_sqlite() {
    let db = SqliteDatabase::create().expect("temp dir");
    let pool: Pool<Sqlite> = db.pool(8).await.expect("pool");
    let report = prove_twice(pool).await;
    assert!(report.passed(), "{report}");
    let skipped: Vec<_> = report.not_applicable().map(|(s, _)| s).collect();
    assert_eq!(skipped, [Scenario::CommitUnknown], "{report}");
    assert!(
        report.scenarios.iter().all(|s| s.exercised || s.not_applicable.is_some()),
        "{report:?}"
    );
    println!("{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demos_twice_handler_passes_every_scenario_on_postgres() {
    let Some((_db, pool)) = postgres().await else { return };
    let report = prove_twice(pool).await;
    assert!(report.passed(), "{report}");
    assert_eq!(report.scenarios.len(), Scenario::ALL.len());
    assert!(report.scenarios.iter().all(|s| s.exercised), "{report:?}");
    println!("{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demos_naive_handler_fails_with_a_shrunk_counter_example() {
    let Some((_db, pool)) = postgres().await else { return };
    let tables = Tables::new("prove_naive");
    Postgres::create_tables(&pool, &tables).await.expect("the demo's tables");
    // Its OrderShipped events go to a queue of a broker of their own.
    let broker = Broker::open(BrokerOptions::in_memory()).await.expect("broker");
    broker.create_queue("shipped", QueueProperties::default()).await.expect("queue");
    let receiver = broker.receiver("shipped").await.expect("receiver");
    let events = Arc::new(DemoTransport::Embedded { broker: broker.clone(), receiver });
    let services = Services::start().await;
    let naive = NaiveShipping {
        receiver: Arc::new(FaultyReceiver::new(Arc::clone(&events), Arc::default())),
        pool: pool.clone(),
        table: tables.naive_shipments.clone(),
        counters: Arc::new(NaiveCounters::default()),
        events,
        payments: services.payments.addr(),
        mail: services.mail.addr(),
    };
    let factory = move || naive.clone();
    let report = kit(factory, pool, &tables.naive_shipments, &services)
        .mode(Mode::NaturallyIdempotent)
        .run(SEED)
        .await;
    assert!(report.errors.is_empty(), "the run itself failed:\n{report}");
    assert!(report.broke(Invariant::DoubleEffect), "{report}");
    let (scenario, messages, invariant) = report.smallest.clone().expect("a shrunk schedule");
    assert_eq!(messages.len(), 1, "{report}");
    assert!(report.to_string().contains(&format!(
        "smallest failing schedule: scenario {scenario} over {messages:?} ({invariant})"
    )));
    println!("{report}");
    broker.shutdown().await;
}
