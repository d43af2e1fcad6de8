//! The SQLite inbox.
//!
//! Every inbox transaction starts with `BEGIN IMMEDIATE`, which takes the database's write lock
//! at once: writers are serialised, so a second copy of a message waits at `BEGIN IMMEDIATE`
//! (up to the connection's busy timeout) until the first copy's transaction ends, then finds the
//! claim (`INSERT .. ON CONFLICT (consumer, message_id) DO NOTHING` changes no row) or, if the
//! first rolled back, makes it. Taking the write lock at the start also avoids the deadlock a
//! deferred transaction meets when it upgrades from reading to writing. Use WAL, so readers are
//! not blocked by the writer; see [`connect_options`].

use std::path::Path;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{Sqlite, Transaction};
use twice::ErrorClass;

use crate::{BusinessKey, Purge, SqlxInbox, StoreError};

/// An inbox on SQLite.
pub type SqliteInbox = SqlxInbox<Sqlite>;

/// SQLite extended result codes the store looks at.
mod code {
    pub(super) const CONSTRAINT_UNIQUE: &str = "2067";
    pub(super) const CONSTRAINT_PRIMARYKEY: &str = "1555";
    pub(super) const CONSTRAINT_NOTNULL: &str = "1299";
    pub(super) const CONSTRAINT_CHECK: &str = "275";
}

const MIGRATIONS: &[(i64, &[&str])] = &[
    (
        1,
        &[
            "CREATE TABLE IF NOT EXISTS {t} (
            consumer TEXT NOT NULL,
            message_id TEXT NOT NULL,
            processed_at_ms INTEGER NOT NULL,
            PRIMARY KEY (consumer, message_id)
        ) WITHOUT ROWID",
            "CREATE INDEX IF NOT EXISTS {t}_processed_at ON {t} (processed_at_ms)",
        ],
    ),
    (
        // Dedup-only records: claimed (0) by an owner, or done (1). Claims and existing rows
        // are done.
        2,
        &[
            "ALTER TABLE {t} ADD COLUMN state INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE {t} ADD COLUMN owner TEXT",
        ],
    ),
    (
        // Each row's own end of retention, from the database's clock; existing rows get the
        // migrating instance's retention from their claim time ({r}: ms, or NULL).
        3,
        &[
            "ALTER TABLE {t} ADD COLUMN purge_after_ms INTEGER",
            "UPDATE {t} SET purge_after_ms = processed_at_ms + {r} WHERE purge_after_ms IS NULL",
            "CREATE INDEX IF NOT EXISTS {t}_purge_after ON {t} (purge_after_ms)",
        ],
    ),
];

/// The database's clock in ms since the Unix epoch.
const DB_NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// Connection options for an inbox database file: created if missing, WAL, `synchronous =
/// NORMAL` (durable across a crash of the process; a power loss may lose the last
/// transactions), and a 30 s busy timeout, the longest a copy waits for another copy's
/// transaction.
pub fn connect_options(path: impl AsRef<Path>) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30))
}

/// Begins a `BEGIN IMMEDIATE` transaction, safely against cancellation (see
/// [`begin_detached`](crate::begin_detached)).
pub(crate) async fn begin_immediate(
    pool: &sqlx::SqlitePool,
) -> Result<Transaction<'static, Sqlite>, StoreError> {
    crate::begin_detached(pool, Some("BEGIN IMMEDIATE".to_owned())).await
}

impl SqlxInbox<Sqlite> {
    /// `table.col1, table.col2` of the unique index `key` of `table`, as SQLite writes it in a
    /// constraint error.
    async fn index_columns(&self, key: &BusinessKey) -> Result<String, StoreError> {
        let not_found = || StoreError::BusinessKeyNotFound {
            table: key.table().to_owned(),
            key: key.key().to_owned(),
        };
        // SQLite names indexes once per database and compares names without case.
        let table: Option<String> = sqlx::query_scalar(
            "SELECT m.tbl_name FROM sqlite_master m \
             JOIN pragma_index_list(m.tbl_name) l ON l.name = m.name \
             WHERE m.type = 'index' AND m.name = ?1 AND m.tbl_name = ?2 COLLATE NOCASE \
             AND l.\"unique\" = 1",
        )
        .bind(key.key())
        .bind(key.table())
        .fetch_optional(&self.pool)
        .await?;
        let table = table.ok_or_else(not_found)?;
        let columns: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")
                .bind(key.key())
                .fetch_all(&self.pool)
                .await?;
        if columns.is_empty() {
            return Err(not_found());
        }
        Ok(columns.iter().map(|c| format!("{table}.{c}")).collect::<Vec<_>>().join(", "))
    }
}

impl crate::Backend for Sqlite {
    async fn prepare(inbox: &mut SqlxInbox<Sqlite>) -> Result<(), StoreError> {
        if inbox.options.migrate {
            inbox.migrate().await?;
        }
        // SQLite's error names the index's columns, not the index: resolve them now.
        let mut keys = Vec::new();
        for key in &inbox.options.business_keys {
            keys.push((key.clone(), inbox.index_columns(key).await?));
        }
        inbox.business_keys = keys;
        Ok(())
    }
}

impl crate::store::Dialect for Sqlite {
    const MIGRATIONS: &'static [(i64, &'static [&'static str])] = MIGRATIONS;
    // `BEGIN IMMEDIATE` takes the write lock: one instance migrates at a time.
    const MIGRATION_LOCK: Option<&'static str> = None;
    const MIGRATION_UNLOCK: Option<&'static str> = None;
    const DB_NOW_MS: &'static str = DB_NOW_MS;
    const INSERT: &'static str = "INSERT INTO";
    const ON_CONFLICT: &'static str = " ON CONFLICT (consumer, message_id) DO NOTHING";
    // Writers are serialised: the row found in place is committed.
    const READ_LATEST: &'static str = "";
    const STATE_AND_OWNER: &'static str = "CAST(state AS BIGINT), owner";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn param(n: usize) -> String {
        format!("?{n}")
    }

    /// `BEGIN IMMEDIATE`, whose wait for the write lock is bounded by the busy timeout; the
    /// processor gives the wait up when the message's lock is lost.
    fn begin_statement(_lock_wait: Option<Duration>) -> Option<String> {
        Some("BEGIN IMMEDIATE".to_owned())
    }

    /// Nothing to check: SQLite's COMMIT fails when the transaction is gone.
    async fn check_committable(
        _inbox: &SqlxInbox<Sqlite>,
        _tx: &mut Transaction<'static, Sqlite>,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    fn classify_database(
        inbox: &SqlxInbox<Sqlite>,
        db: &(dyn DatabaseError + 'static),
    ) -> ErrorClass {
        let Some(code) = db.code() else { return ErrorClass::Unknown };
        match &*code {
            code::CONSTRAINT_UNIQUE | code::CONSTRAINT_PRIMARYKEY => {
                // SQLite names the columns, not the index: "UNIQUE constraint failed: t.c".
                let failed = db.message().rsplit_once(": ").map_or("", |(_, cols)| cols.trim());
                match inbox.business_keys.iter().find(|(_, cols)| cols == failed) {
                    Some((key, _)) => {
                        ErrorClass::BusinessKeyDuplicate { constraint: key.key().to_owned() }
                    }
                    None => ErrorClass::Unknown,
                }
            }
            code::CONSTRAINT_NOTNULL | code::CONSTRAINT_CHECK => ErrorClass::Permanent,
            other => match other.parse::<i32>().map(|extended| extended & 0xff) {
                // The primary code of an extended one: busy, locked, read-only (the file, or
                // `query_only`), I/O error, disk full, the lock protocol.
                Ok(5 | 6 | 8 | 10 | 13 | 15) => ErrorClass::Transient,
                _ => ErrorClass::Unknown,
            },
        }
    }
}

impl Purge for SqlxInbox<Sqlite> {
    async fn purge(&self) -> Result<u64, StoreError> {
        let t = self.table();
        let mut total = 0;
        loop {
            // The write lock makes each batch exclusive; short batches let claims in between.
            let mut tx = begin_immediate(&self.pool).await?;
            let deleted = sqlx::query(&format!(
                "DELETE FROM {t} WHERE (consumer, message_id) IN (SELECT consumer, message_id \
                 FROM {t} WHERE purge_after_ms < {DB_NOW_MS} ORDER BY purge_after_ms LIMIT ?1)"
            ))
            .bind(self.options.purge_batch_size)
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
