//! The demo's database: the shipments tables (one guarded by a unique index on the order id,
//! the business key; one without, for the naive handler) on SQLite, PostgreSQL or MariaDB.
//!
//! Table names carry a per-run suffix, so runs against a shared server database never meet.

use std::collections::HashMap;
use std::future::Future;

use anyhow::Context as _;
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use twice::BoxFuture;

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
}

impl Tables {
    /// Names for the run `run_id`.
    pub(crate) fn new(run_id: &str) -> Self {
        Self {
            shipments: format!("demo_{run_id}_shipments"),
            shipments_key: format!("demo_{run_id}_shipments_order_id"),
            naive_shipments: format!("demo_{run_id}_naive_shipments"),
            inbox: format!("demo_{run_id}_inbox"),
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
    /// Inserts a shipment on its own (autocommit), as the naive handler does.
    fn insert_shipment_naive<'a>(
        pool: &'a Pool<Self>,
        table: &'a str,
        order_id: i64,
        amount_cents: i64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Shipments by order id.
    fn count_by_order(
        pool: &Pool<Self>,
        table: &str,
    ) -> impl Future<Output = anyhow::Result<HashMap<u64, u64>>> + Send;
}

macro_rules! demo_db {
    ($db:ty, $p1:literal, $p2:literal, $create:literal, $create_naive:literal, $index:literal) => {
        impl DemoDb for $db {
            async fn create_tables(pool: &Pool<Self>, t: &Tables) -> anyhow::Result<()> {
                let create = format!($create, table = t.shipments);
                sqlx::query(&create).execute(pool).await.context("creating the shipments table")?;
                let index = format!($index, index = t.shipments_key, table = t.shipments);
                sqlx::query(&index).execute(pool).await.context("creating the business key")?;
                let naive = format!($create_naive, table = t.naive_shipments);
                sqlx::query(&naive).execute(pool).await.context("creating the naive table")?;
                Ok(())
            }

            async fn drop_tables(pool: &Pool<Self>, t: &Tables) -> anyhow::Result<()> {
                for table in [&t.shipments, &t.naive_shipments, &t.inbox] {
                    sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await?;
                }
                let migrations = format!("{}_migrations", t.inbox);
                sqlx::query(&format!("DROP TABLE IF EXISTS {migrations}")).execute(pool).await?;
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

            fn insert_shipment_naive<'a>(
                pool: &'a Pool<Self>,
                table: &'a str,
                order_id: i64,
                amount_cents: i64,
            ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO {table} (order_id, amount_cents) VALUES ({}, {})",
                        $p1, $p2
                    );
                    sqlx::query(&sql).bind(order_id).bind(amount_cents).execute(pool).await?;
                    Ok(())
                })
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
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)"
);
demo_db!(
    Postgres,
    "$1",
    "$2",
    "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)"
);
demo_db!(
    MySql,
    "?",
    "?",
    "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE=InnoDB",
    "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE=InnoDB",
    "CREATE UNIQUE INDEX {index} ON {table} (order_id)"
);
