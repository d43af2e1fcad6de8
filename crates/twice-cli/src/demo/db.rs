//! The demo's database: the shipments tables (one guarded by a unique index on the order id,
//! the business key; one without, for the naive handler) on SQLite, PostgreSQL or MariaDB.
//!
//! Table names carry a per-run suffix, so runs against a shared server database never meet.

use std::collections::HashMap;
use std::future::Future;

use anyhow::Context as _;
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use twice::BoxFuture;
use twice_sqlx::{OutboxOptions, SqlxOutbox};

/// The table names of one run.
#[derive(Clone, Debug)]
pub(crate) struct Tables {
    /// Shipments made by the twice handler; unique on `order_id`.
    pub(crate) shipments: String,
    /// The name of that unique index: the business key registered with the inbox.
    pub(crate) shipments_key: String,
    /// Shipments made by the naive handler; no unique index.
    pub(crate) naive_shipments: String,
    /// The inbox table.
    pub(crate) inbox: String,
    /// The twice handler's outbox.
    pub(crate) outbox: String,
    /// Loyalty points awarded per `OrderShipped` event of the twice column, and of the naive
    /// one.
    pub(crate) points: String,
    pub(crate) naive_points: String,
    /// The inboxes of the two loyalty processors.
    pub(crate) loyalty_inbox: String,
    pub(crate) naive_loyalty_inbox: String,
}

impl Tables {
    /// Names for the run `run_id`.
    pub(crate) fn new(run_id: &str) -> Self {
        Self {
            shipments: format!("demo_{run_id}_shipments"),
            shipments_key: format!("demo_{run_id}_shipments_order_id"),
            naive_shipments: format!("demo_{run_id}_naive_shipments"),
            inbox: format!("demo_{run_id}_inbox"),
            outbox: format!("demo_{run_id}_outbox"),
            points: format!("demo_{run_id}_points"),
            naive_points: format!("demo_{run_id}_naive_points"),
            loyalty_inbox: format!("demo_{run_id}_loyalty_inbox"),
            naive_loyalty_inbox: format!("demo_{run_id}_naive_loyalty_inbox"),
        }
    }
}

/// What the demo needs from a database, written once per database for its SQL dialect.
pub(crate) trait DemoDb: twice_sqlx::Backend {
    /// Creates the run's tables.
    fn create_tables(
        pool: &Pool<Self>,
        t: &Tables,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
    /// Drops the run's tables.
    fn drop_tables(
        pool: &Pool<Self>,
        t: &Tables,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
    /// Inserts a shipment inside the handler's transaction.
    fn insert_shipment<'a>(
        tx: &'a mut Transaction<'static, Self>,
        table: &'a str,
        order_id: i64,
        amount_cents: i64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Awards loyalty points for the `OrderShipped` event `event_id`, inside the loyalty
    /// handler's transaction.
    fn insert_points<'a>(
        tx: &'a mut Transaction<'static, Self>,
        table: &'a str,
        order_id: i64,
        event_id: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// The outbox of the run.
    fn outbox(
        pool: &Pool<Self>,
        table: &str,
    ) -> impl Future<Output = anyhow::Result<SqlxOutbox<Self>>> + Send;
    /// The text values of `column` in `table` where `filter` holds (an inbox's message ids,
    /// the events a points table counted).
    fn texts(
        pool: &Pool<Self>,
        table: &str,
        column: &str,
        filter: &str,
    ) -> impl Future<Output = anyhow::Result<Vec<String>>> + Send;
    /// Shipments by order id.
    fn count_by_order(
        pool: &Pool<Self>,
        table: &str,
    ) -> impl Future<Output = anyhow::Result<HashMap<u64, u64>>> + Send;
}

macro_rules! demo_db {
    ($db:ty, $p1:literal, $p2:literal, $create:literal, $create_naive:literal, $index:literal,
     $create_points:literal, $text:literal) => {
        impl DemoDb for $db {
            async fn create_tables(pool: &Pool<Self>, t: &Tables) -> anyhow::Result<()> {
                let create = format!($create, table = t.shipments);
                sqlx::query(&create).execute(pool).await.context("creating the shipments table")?;
                let index = format!($index, index = t.shipments_key, table = t.shipments);
                sqlx::query(&index).execute(pool).await.context("creating the business key")?;
                let naive = format!($create_naive, table = t.naive_shipments);
                sqlx::query(&naive).execute(pool).await.context("creating the naive table")?;
                for table in [&t.points, &t.naive_points] {
                    let points = format!($create_points, table = table);
                    sqlx::query(&points).execute(pool).await.context("creating a points table")?;
                }
                Ok(())
            }

            async fn drop_tables(pool: &Pool<Self>, t: &Tables) -> anyhow::Result<()> {
                for table in [&t.shipments, &t.naive_shipments, &t.points, &t.naive_points] {
                    sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await?;
                }
                for table in [&t.inbox, &t.outbox, &t.loyalty_inbox, &t.naive_loyalty_inbox] {
                    sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await?;
                    let migrations = format!("{table}_migrations");
                    sqlx::query(&format!("DROP TABLE IF EXISTS {migrations}"))
                        .execute(pool)
                        .await?;
                }
                Ok(())
            }

            fn insert_shipment<'a>(
                tx: &'a mut Transaction<'static, Self>,
                table: &'a str,
                order_id: i64,
                amount_cents: i64,
            ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO {table} (order_id, amount_cents) VALUES ({}, {})",
                        $p1, $p2
                    );
                    sqlx::query(&sql).bind(order_id).bind(amount_cents).execute(&mut **tx).await?;
                    Ok(())
                })
            }

            fn insert_points<'a>(
                tx: &'a mut Transaction<'static, Self>,
                table: &'a str,
                order_id: i64,
                event_id: &'a str,
            ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO {table} (order_id, event_id) VALUES ({}, {})",
                        $p1, $p2
                    );
                    sqlx::query(&sql).bind(order_id).bind(event_id).execute(&mut **tx).await?;
                    Ok(())
                })
            }

            async fn outbox(pool: &Pool<Self>, table: &str) -> anyhow::Result<SqlxOutbox<Self>> {
                SqlxOutbox::new(pool.clone(), OutboxOptions::new().table(table))
                    .await
                    .context("creating the outbox")
            }

            async fn texts(
                pool: &Pool<Self>,
                table: &str,
                column: &str,
                filter: &str,
            ) -> anyhow::Result<Vec<String>> {
                let column = format!($text, c = column);
                let sql = format!("SELECT {column} FROM {table} WHERE {filter}");
                Ok(sqlx::query_scalar(&sql).fetch_all(pool).await?)
            }

            async fn count_by_order(
                pool: &Pool<Self>,
                table: &str,
            ) -> anyhow::Result<HashMap<u64, u64>> {
                let rows: Vec<(i64, i64)> = sqlx::query_as(&format!(
                    "SELECT order_id, COUNT(*) FROM {table} GROUP BY order_id"
                ))
                .fetch_all(pool)
                .await?;
                Ok(rows
                    .into_iter()
                    .map(|(order, n)| {
                        (u64::try_from(order).unwrap_or(0), u64::try_from(n).unwrap_or(0))
                    })
                    .collect())
            }
        }
    };
}

demo_db!(
    Sqlite,
    "?",
    "?",
    "CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL, amount_cents INTEGER NOT NULL)",
    "CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL, amount_cents INTEGER NOT NULL)",
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)",
    "CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL, event_id TEXT NOT NULL)",
    "{c}"
);
demo_db!(
    Postgres,
    "$1",
    "$2",
    "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)",
    "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, event_id TEXT NOT NULL)",
    "{c}"
);
demo_db!(
    MySql,
    "?",
    "?",
    "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE=InnoDB",
    "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE=InnoDB",
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)",
    "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, event_id VARCHAR(255) NOT NULL) ENGINE=InnoDB",
    "CAST({c} AS CHAR)"
);
