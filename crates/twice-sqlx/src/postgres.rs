//! The PostgreSQL inbox.
//!
//! Claim: `INSERT INTO <table> (consumer, message_id, processed_at_ms) VALUES ($1, $2, $3)
//! ON CONFLICT (consumer, message_id) DO NOTHING`, then the row count: 1 is a claim, 0 a
//! duplicate. A second transaction inserting the same key waits for the first to end (that is
//! how PostgreSQL checks a unique index against an uncommitted row): if the first commits, the
//! insert does nothing; if it rolls back, the insert goes through. No error is raised, so the
//! transaction stays usable. The table is keyed by `(consumer, message_id)`; rows are appended
//! to the heap in claim order and the purge walks the index on `purge_after_ms`.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::postgres::PgDatabaseError;
use sqlx::{Postgres, Transaction};
use twice::ErrorClass;

use crate::{Purge, SqlxInbox, StoreError};

/// An inbox on PostgreSQL.
pub type PgInbox = SqlxInbox<Postgres>;

/// The embedded migrations: (version, statements), `{t}` standing for the table name.
const MIGRATIONS: &[(i64, &[&str])] = &[
    (
        1,
        &[
            "CREATE TABLE IF NOT EXISTS {t} (
            consumer TEXT NOT NULL,
            message_id TEXT NOT NULL,
            processed_at_ms BIGINT NOT NULL,
            CONSTRAINT {t}_pkey PRIMARY KEY (consumer, message_id)
        )",
            "CREATE INDEX IF NOT EXISTS {t}_processed_at ON {t} (processed_at_ms)",
        ],
    ),
    (
        // Dedup-only records: claimed (0) by an owner, or done (1). Claims and existing rows
        // are done.
        2,
        &[
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS state SMALLINT NOT NULL DEFAULT 1",
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS owner TEXT",
        ],
    ),
    (
        // Each row's own end of retention, from the database's clock; existing rows get the
        // migrating instance's retention from their claim time ({r}: ms, or NULL).
        3,
        &[
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS purge_after_ms BIGINT",
            "UPDATE {t} SET purge_after_ms = processed_at_ms + {r} WHERE purge_after_ms IS NULL",
            "CREATE INDEX IF NOT EXISTS {t}_purge_after ON {t} (purge_after_ms)",
        ],
    ),
];

/// The database's clock in ms since the Unix epoch.
const DB_NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// Begins an inbox transaction at READ COMMITTED whatever the session's default
/// (`default_transaction_isolation`, `SET SESSION CHARACTERISTICS`), and bounds its lock waits
/// by `lock_wait` (`SET LOCAL lock_timeout`), in one round trip.
///
/// A claim that waited for a concurrent claim of the same key and found it committed must see
/// that row: at REPEATABLE READ and SERIALIZABLE the row is not in the transaction's snapshot
/// and `ON CONFLICT DO NOTHING` fails with a serialization failure (40001) instead.
fn begin_statement(lock_wait: Option<Duration>) -> String {
    let mut statement = "BEGIN ISOLATION LEVEL READ COMMITTED".to_owned();
    if let Some(wait) = lock_wait {
        statement.push_str(&format!("; SET LOCAL lock_timeout = {}", crate::wait_millis(wait)));
    }
    statement
}

/// A registered table's name without its schema, as PostgreSQL reports it in an error.
fn table_name(key: &crate::BusinessKey) -> &str {
    key.table().rsplit_once('.').map_or(key.table(), |(_, table)| table)
}

impl crate::Backend for Postgres {
    async fn prepare(inbox: &mut SqlxInbox<Postgres>) -> Result<(), StoreError> {
        if inbox.options.migrate {
            inbox.migrate().await?;
        }
        // The server names the violated constraint's schema, table and name: resolve the
        // registered table to its schema now.
        let mut keys = Vec::new();
        for key in &inbox.options.business_keys {
            let schema: Option<String> = sqlx::query_scalar(
                "SELECT n.nspname::text FROM pg_index i \
                 JOIN pg_class ic ON ic.oid = i.indexrelid \
                 JOIN pg_class tc ON tc.oid = i.indrelid \
                 JOIN pg_namespace n ON n.oid = tc.relnamespace \
                 WHERE i.indisunique AND ic.relname = $2 AND tc.oid = to_regclass($1)",
            )
            .bind(key.table())
            .bind(key.key())
            .fetch_optional(&inbox.pool)
            .await?;
            let Some(schema) = schema else {
                return Err(StoreError::BusinessKeyNotFound {
                    table: key.table().to_owned(),
                    key: key.key().to_owned(),
                });
            };
            keys.push((key.clone(), schema));
        }
        inbox.business_keys = keys;
        Ok(())
    }
}

impl crate::store::Dialect for Postgres {
    const MIGRATIONS: &'static [(i64, &'static [&'static str])] = MIGRATIONS;
    const MIGRATION_LOCK: Option<&'static str> =
        Some("SELECT pg_advisory_xact_lock(hashtext('twice-migrate:{t}'))");
    const MIGRATION_UNLOCK: Option<&'static str> = None;
    const DB_NOW_MS: &'static str = DB_NOW_MS;
    const INSERT: &'static str = "INSERT INTO";
    const ON_CONFLICT: &'static str = " ON CONFLICT (consumer, message_id) DO NOTHING";
    // The insert waited for the holder, if any, to commit; a new statement in READ COMMITTED
    // sees the committed row.
    const READ_LATEST: &'static str = "";
    const STATE_AND_OWNER: &'static str = "CAST(state AS BIGINT), owner";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn param(n: usize) -> String {
        format!("${n}")
    }

    /// `BEGIN ISOLATION LEVEL READ COMMITTED`, whatever the session's default, with `SET LOCAL
    /// lock_timeout` to the time left on the lock: see [`begin_statement`].
    fn begin_statement(lock_wait: Option<Duration>) -> Option<String> {
        Some(begin_statement(lock_wait))
    }

    /// One `SELECT 1` in the transaction: PostgreSQL refuses every statement of an aborted
    /// transaction with SQLSTATE 25P02. It is the cheapest check that is exact: one round trip
    /// with no table access, where running the handler in a savepoint costs two, and the
    /// COMMIT's command tag (`ROLLBACK` for an aborted transaction) is not visible through sqlx.
    async fn check_committable(
        _inbox: &SqlxInbox<Postgres>,
        tx: &mut Transaction<'static, Postgres>,
    ) -> Result<(), StoreError> {
        match sqlx::query("SELECT 1").execute(&mut **tx).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = StoreError::from(e);
                Err(if Self::aborted(&e) { StoreError::TransactionAborted } else { e })
            }
        }
    }

    /// Every statement in an aborted transaction fails with 25P02: the outbox's insert checks
    /// as well as `SELECT 1` does.
    const WRITE_PROVES_COMMITTABLE: bool = true;

    fn aborted(error: &StoreError) -> bool {
        matches!(error, StoreError::Database(sqlx::Error::Database(db))
            if db.code().as_deref() == Some("25P02"))
    }

    fn classify_database(
        inbox: &SqlxInbox<Postgres>,
        db: &(dyn DatabaseError + 'static),
    ) -> ErrorClass {
        let Some(code) = db.code() else { return ErrorClass::Unknown };
        match &*code {
            "23505" => {
                let pg = db.try_downcast_ref::<PgDatabaseError>();
                let violated = pg.map(|pg| (pg.schema(), pg.table(), pg.constraint()));
                let registered = inbox.business_keys.iter().find(|(key, schema)| {
                    violated
                        == Some((Some(schema.as_str()), Some(table_name(key)), Some(key.key())))
                });
                match registered {
                    Some((key, _)) => {
                        ErrorClass::BusinessKeyDuplicate { constraint: key.key().to_owned() }
                    }
                    // An unregistered unique key may be a race an upsert would win on retry.
                    None => ErrorClass::Unknown,
                }
            }
            // Serialization failure, deadlock, connection trouble, insufficient resources,
            // shutdown, lock not available, a read-only transaction (a primary demoted in a
            // failover, or a hot standby the connection reached), a session ended for idling
            // in its transaction, and system errors (I/O) of the server.
            c if c.starts_with("40")
                || c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("57P")
                || c.starts_with("58")
                || c == "55P03"
                || c == "25006"
                || c == "25P03" =>
            {
                ErrorClass::Transient
            }
            // A foreign-key violation may be an ordering race (the row it refers to comes with
            // a later message): retried, as on the other stores.
            "23503" => ErrorClass::Unknown,
            // Data exceptions and other integrity violations: this message will never pass.
            c if c.starts_with("22") || c.starts_with("23") => ErrorClass::Permanent,
            _ => ErrorClass::Unknown,
        }
    }
}

impl Purge for SqlxInbox<Postgres> {
    async fn purge(&self) -> Result<u64, StoreError> {
        let batch = i64::from(self.options.purge_batch_size);
        let t = self.table();
        let mut total = 0;
        loop {
            let mut tx = crate::begin_detached(&self.pool, Some(begin_statement(None))).await?;
            let ours: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1))")
                .bind(format!("twice-purge:{t}"))
                .fetch_one(&mut *tx)
                .await?;
            if !ours {
                // Another instance is purging this table.
                tx.rollback().await?;
                return Ok(total);
            }
            let deleted = sqlx::query(&format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} \
                 WHERE purge_after_ms < {DB_NOW_MS} ORDER BY purge_after_ms LIMIT $1))"
            ))
            .bind(batch)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            tx.commit().await?;
            total += deleted;
            if deleted < u64::from(self.options.purge_batch_size) {
                return Ok(total);
            }
        }
    }
}
