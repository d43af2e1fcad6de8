//! A failover window, on every store: the database refuses writes for a while (a primary
//! demoted under the processor, its clients reconnected to a read-only node), then takes them
//! again. The claim is the processor's own insert, so its refusal is never the message's
//! fault: no message may spend its deliveries, and none may reach the dead-letter queue
//! without its handler having run.
//!
//! - PostgreSQL: the test's own database is made read-only with `ALTER DATABASE .. SET
//!   default_transaction_read_only` and its backends are terminated, so every connection the
//!   pool makes again refuses writes (SQLSTATE 25006); then the same, back.
//! - MariaDB: while the window lasts, every connection the inbox's pool hands out is made
//!   read-only (`SET SESSION TRANSACTION READ ONLY`: error 1792 at the claim).
//! - SQLite: the same with `PRAGMA query_only` (result code 8, `SQLITE_READONLY`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use twice::{ErrorSource, Inbox, ProcessorOptions, RetryPolicy, SharedClock};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};
use twice_testkit::db::Server as _;

use crate::on_all_stores;
use crate::processor::{Ship, order, processor};
use crate::support::{
    Fixture, Lite, Maria, Pg, Shutdown, create_shipments, shipments, until_async,
};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

/// A store whose database can be made to refuse writes for a while.
pub trait Failover: Fixture {
    /// A pool on the fixture's database whose connections refuse writes while `read_only` is
    /// set (where the store needs the pool's help for that).
    fn failover_pool(
        &self,
        read_only: &Arc<AtomicBool>,
    ) -> impl Future<Output = Pool<Self::DB>> + Send;

    /// Starts (`true`) or ends the window.
    fn set_read_only(
        &self,
        read_only: &Arc<AtomicBool>,
        on: bool,
    ) -> impl Future<Output = ()> + Send;
}

/// The database's name, the last segment of the fixture's URL.
fn database_name(url: &str) -> String {
    url.rsplit('/').next().unwrap_or_default().to_owned()
}

impl Failover for Pg {
    async fn failover_pool(&self, _read_only: &Arc<AtomicBool>) -> Pool<Postgres> {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .connect(&self.url())
            .await
            .expect("pool")
    }

    async fn set_read_only(&self, read_only: &Arc<AtomicBool>, on: bool) {
        read_only.store(on, Ordering::SeqCst);
        let name = database_name(&self.url());
        // From the server's `test` database: a read-only session cannot alter the database.
        Postgres::run(format!(
            "ALTER DATABASE {name} SET default_transaction_read_only = {}",
            if on { "on" } else { "off" }
        ))
        .await
        .expect("ALTER DATABASE");
        // The sessions open now keep the default they started with: end them, as a failover
        // ends the clients' connections to the old primary.
        Postgres::run(format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}' \
             AND pid <> pg_backend_pid()"
        ))
        .await
        .expect("pg_terminate_backend");
    }
}

impl Failover for Maria {
    async fn failover_pool(&self, read_only: &Arc<AtomicBool>) -> Pool<MySql> {
        let mode = {
            let read_only = Arc::clone(read_only);
            move || {
                let on = read_only.load(Ordering::SeqCst);
                if on {
                    "SET SESSION TRANSACTION READ ONLY"
                } else {
                    "SET SESSION TRANSACTION READ WRITE"
                }
            }
        };
        let on_connect = mode.clone();
        // A new connection and one taken from the idle ones both follow the window.
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(10)
            .after_connect(move |conn, _| {
                let sql = on_connect();
                Box::pin(async move { sqlx::query(sql).execute(conn).await.map(drop) })
            })
            .before_acquire(move |conn, _| {
                let sql = mode();
                Box::pin(async move { sqlx::query(sql).execute(conn).await.map(|_| true) })
            })
            .connect(&self.url())
            .await
            .expect("pool")
    }

    async fn set_read_only(&self, read_only: &Arc<AtomicBool>, on: bool) {
        read_only.store(on, Ordering::SeqCst);
    }
}

impl Failover for Lite {
    async fn failover_pool(&self, read_only: &Arc<AtomicBool>) -> Pool<Sqlite> {
        let pragma = {
            let read_only = Arc::clone(read_only);
            move || {
                let on = read_only.load(Ordering::SeqCst);
                if on { "PRAGMA query_only = ON" } else { "PRAGMA query_only = OFF" }
            }
        };
        let on_connect = pragma.clone();
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(60))
            .after_connect(move |conn, _| {
                let sql = on_connect();
                Box::pin(async move { sqlx::query(sql).execute(conn).await.map(drop) })
            })
            .before_acquire(move |conn, _| {
                let sql = pragma();
                Box::pin(async move { sqlx::query(sql).execute(conn).await.map(|_| true) })
            })
            .connect_with(twice_sqlx::sqlite::connect_options(std::path::Path::new(&self.url())))
            .await
            .expect("pool")
    }

    async fn set_read_only(&self, read_only: &Arc<AtomicBool>, on: bool) {
        read_only.store(on, Ordering::SeqCst);
    }
}

const MESSAGES: u32 = 5;
/// The broker's MaxDeliveryCount for the scenarios' queue.
const MAX_DELIVERY_COUNT: u32 = 10;

/// Five messages arrive while the database refuses writes. Each claim fails, over and over,
/// for longer than MaxDeliveryCount failures per message; then the database takes writes
/// again. No message is dead-lettered, and each handler runs once, after the window.
async fn a_failover_window_dead_letters_no_message_unrun<F: Failover>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    F::DB: twice_sqlx::Backend,
{
    create_shipments(&f, false).await;
    let read_only = Arc::new(AtomicBool::new(false));
    let pool = f.failover_pool(&read_only).await;
    let inbox = SqlxInbox::new(pool, InboxOptions::new().table("inbox_failover"));
    let inbox = Arc::new(inbox.await.expect("inbox"));
    let (queue, clock) = crate::support::queue("orders").await;
    let shutdown = Shutdown::default();
    let handler = Ship::<F>::new();
    let calls = handler.calls.clone();
    let retry = RetryPolicy::new().backoff(Duration::from_millis(100), Duration::from_secs(1));
    let options = ProcessorOptions::new()
        .consumer("shipping")
        .clock(SharedClock::from(clock.clone()))
        .max_concurrent_calls(MESSAGES as usize)
        .retry(retry);
    let claim_errors = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&claim_errors);
    let p = processor::<F>(&queue, inbox, handler, options).await.on_error(move |e| {
        if e.error_source() == ErrorSource::Claim {
            seen.fetch_add(1, Ordering::SeqCst);
        }
        eprintln!("{} processor: {e}", F::NAME);
    });
    let counters = p.counters();

    f.set_read_only(&read_only, true).await;
    let task = tokio::spawn(p.run(shutdown.wait()));
    for id in 0..i64::from(MESSAGES) {
        queue.send(order(&format!("order-{id}-placed"), id)).await;
    }
    until_async("claims refused more often than the messages have deliveries", || async {
        clock.advance(Duration::from_millis(50)); // the backoff runs on the processor's clock
        claim_errors.load(Ordering::SeqCst) >= (MESSAGES * MAX_DELIVERY_COUNT) as usize
    })
    .await;
    let during = calls.load(Ordering::SeqCst);
    f.set_read_only(&read_only, false).await;
    until_async("every message completed or dead-lettered", || async {
        clock.advance(Duration::from_millis(50));
        let dead = u64::try_from(queue.dead_letters().await.len()).expect("small");
        queue.completed().await + dead >= u64::from(MESSAGES)
    })
    .await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    let dead: Vec<_> = queue.dead_letters().await.iter().map(|m| m.message_id().clone()).collect();
    assert!(
        dead.is_empty(),
        "{}: dead-lettered without their handler running: {dead:?}; {s:?}",
        F::NAME
    );
    assert_eq!(during, 0, "{}: no handler ran while the database refused the claim", F::NAME);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        MESSAGES as usize,
        "{}: each handler once: {s:?}",
        F::NAME
    );
    assert_eq!(shipments(&f).await, i64::from(MESSAGES), "{}", F::NAME);
    assert_eq!((s.committed, s.abandoned), (u64::from(MESSAGES), 0), "{}: {s:?}", F::NAME);
    assert_eq!(queue.active_count().await, 0, "{}", F::NAME);
}
on_all_stores!(a_failover_window_dead_letters_no_message_unrun);
