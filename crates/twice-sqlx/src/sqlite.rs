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

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{Sqlite, Transaction};
use twice::{Claim, ErrorClass, Inbox, MessageId, Timestamp};

use crate::{
    BusinessKey, Purge, SqlxInbox, StoreError, find_sqlx_error, is_transient_sqlx, millis,
    validate_key,
};

/// An inbox on SQLite.
pub type SqliteInbox = SqlxInbox<Sqlite>;

/// SQLite extended result codes the store looks at.
mod code {
    pub(super) const BUSY: &str = "5";
    pub(super) const LOCKED: &str = "6";
    pub(super) const BUSY_SNAPSHOT: &str = "517";
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

    /// Runs the embedded migrations not yet applied, inside `BEGIN IMMEDIATE`.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let t = self.table();
        let mut tx = begin_immediate(&self.pool).await?;
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {t}_migrations (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)"
        ))
        .execute(&mut *tx)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(&format!("SELECT version FROM {t}_migrations"))
            .fetch_all(&mut *tx)
            .await?;
        for (version, statements) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            for statement in *statements {
                sqlx::query(&self.migration_sql(statement)).execute(&mut *tx).await?;
            }
            sqlx::query(&format!(
                "INSERT INTO {t}_migrations (version, applied_at_ms) VALUES (?1, CAST(unixepoch('subsec') * 1000 AS INTEGER))"
            ))
            .bind(version)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn claim_in(
        &self,
        conn: &mut sqlx::SqliteConnection,
        consumer: &str,
        message_id: &MessageId,
        now: Timestamp,
    ) -> Result<Claim, StoreError> {
        validate_key(consumer, message_id)?;
        let t = self.table();
        let inserted = sqlx::query(&format!(
            "INSERT INTO {t} (consumer, message_id, processed_at_ms, purge_after_ms) \
             VALUES (?1, ?2, ?3, {DB_NOW_MS} + ?4) ON CONFLICT (consumer, message_id) DO NOTHING"
        ))
        .bind(consumer)
        .bind(message_id.as_str())
        .bind(millis(now))
        .bind(self.retention_ms())
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(Claim::Claimed);
        }
        let at: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT processed_at_ms FROM {t} WHERE consumer = ?1 AND message_id = ?2"
        ))
        .bind(consumer)
        .bind(message_id.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        Ok(Claim::Duplicate { claimed_at: at.map(Timestamp::from_millis) })
    }
}

impl crate::sealed::Sealed for Sqlite {}

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

impl Inbox for SqlxInbox<Sqlite> {
    type Tx = Transaction<'static, Sqlite>;
    type Error = StoreError;

    fn retention(&self) -> Option<Duration> {
        self.options.retention
    }

    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        begin_immediate(&self.pool).await
    }

    async fn claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        now: Timestamp,
    ) -> Result<Claim, StoreError> {
        self.claim_in(tx, consumer, message_id, now).await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        Ok(tx.commit().await?)
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        Ok(tx.rollback().await?)
    }

    async fn record<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
        now: Timestamp,
    ) -> Result<Claim, StoreError> {
        validate_key(consumer, message_id)?;
        let t = self.table();
        // A record removed between the insert and the read is inserted again.
        for _ in 0..3 {
            let mut tx = begin_immediate(&self.pool).await?;
            let inserted = sqlx::query(&format!(
                "INSERT INTO {t} (consumer, message_id, processed_at_ms, state, owner, \
                 purge_after_ms) VALUES (?1, ?2, ?3, 0, ?4, {DB_NOW_MS} + ?5) \
                 ON CONFLICT (consumer, message_id) DO NOTHING"
            ))
            .bind(consumer)
            .bind(message_id.as_str())
            .bind(millis(now))
            .bind(owner)
            .bind(self.retention_ms())
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if inserted == 1 {
                tx.commit().await?;
                return Ok(Claim::Claimed);
            }
            let row: Option<(i64, i64, Option<String>)> = sqlx::query_as(&format!(
                "SELECT processed_at_ms, CAST(state AS BIGINT), owner FROM {t} \
                 WHERE consumer = ?1 AND message_id = ?2"
            ))
            .bind(consumer)
            .bind(message_id.as_str())
            .fetch_optional(&mut *tx)
            .await?;
            tx.commit().await?;
            let Some((at, state, by)) = row else { continue };
            return Ok(crate::claim_of_record(at, state, by.as_deref(), owner));
        }
        Ok(Claim::InProgress { claimed_at: None })
    }

    async fn finish<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, StoreError> {
        let t = self.table();
        let updated = sqlx::query(&format!(
            "UPDATE {t} SET state = 1 WHERE consumer = ?1 AND message_id = ?2 \
             AND owner = ?3 AND state = 0"
        ))
        .bind(consumer)
        .bind(message_id.as_str())
        .bind(owner)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        Ok(updated == 1)
    }

    async fn forget<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, StoreError> {
        let t = self.table();
        let deleted = sqlx::query(&format!(
            "DELETE FROM {t} WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 \
             AND state = 0"
        ))
        .bind(consumer)
        .bind(message_id.as_str())
        .bind(owner)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(deleted == 1)
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        let Some(e) = find_sqlx_error(error) else { return ErrorClass::Unknown };
        let sqlx::Error::Database(db) = e else {
            return if is_transient_sqlx(e) { ErrorClass::Transient } else { ErrorClass::Unknown };
        };
        let Some(code) = db.code() else { return ErrorClass::Unknown };
        match &*code {
            code::CONSTRAINT_UNIQUE | code::CONSTRAINT_PRIMARYKEY => {
                // SQLite names the columns, not the index: "UNIQUE constraint failed: t.c".
                let failed = db.message().rsplit_once(": ").map_or("", |(_, cols)| cols.trim());
                match self.business_keys.iter().find(|(_, cols)| cols == failed) {
                    Some((key, _)) => {
                        ErrorClass::BusinessKeyDuplicate { constraint: key.key().to_owned() }
                    }
                    None => ErrorClass::Unknown,
                }
            }
            code::BUSY | code::LOCKED | code::BUSY_SNAPSHOT => ErrorClass::Transient,
            code::CONSTRAINT_NOTNULL | code::CONSTRAINT_CHECK => ErrorClass::Permanent,
            _ => ErrorClass::Unknown,
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
