//! The MariaDB/MySQL inbox.
//!
//! Claim: `INSERT IGNORE INTO <table> (consumer, message_id, processed_at_ms) VALUES (?, ?, ?)`,
//! then the affected rows: 1 is a claim, 0 a duplicate. InnoDB checks the primary key with a
//! record lock, so a second transaction inserting the same key waits for the first to end, at
//! any isolation level: the first commits, the insert is ignored; it rolls back, the insert
//! goes through. (`ON DUPLICATE KEY UPDATE` cannot be used to tell the two apart: sqlx sets the
//! `CLIENT_FOUND_ROWS` flag, under which a no-op update also reports one row.) See the crate
//! docs for the key length check and the deadlock-victim case.

use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{MySql, Transaction};
use twice::{Claim, ErrorClass, Inbox, MessageId, Timestamp};

use crate::{
    Purge, SqlxInbox, StoreError, find_sqlx_error, is_transient_sqlx, millis, validate_key,
};

/// An inbox on MariaDB or MySQL.
pub type MySqlInbox = SqlxInbox<MySql>;

/// MariaDB/MySQL error numbers the store looks at.
mod errno {
    pub(super) const DUP_ENTRY: u16 = 1062;
    pub(super) const DUP_ENTRY_WITH_KEY_NAME: u16 = 1586;
    pub(super) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    pub(super) const LOCK_DEADLOCK: u16 = 1213;
    pub(super) const QUERY_INTERRUPTED: u16 = 1317;
    pub(super) const DATA_TOO_LONG: u16 = 1406;
    pub(super) const TRUNCATED_WRONG_VALUE: u16 = 1292;
    pub(super) const BAD_NULL: u16 = 1048;
    pub(super) const OUT_OF_RANGE: u16 = 1264;
    pub(super) const CHECK_CONSTRAINT: u16 = 4025;
}

const MIGRATIONS: &[(i64, &[&str])] = &[
    (
        1,
        &["CREATE TABLE IF NOT EXISTS {t} (
            consumer VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            processed_at_ms BIGINT NOT NULL,
            PRIMARY KEY (consumer, message_id),
            KEY {t}_processed_at (processed_at_ms)
        ) ENGINE = InnoDB"],
    ),
    // `utf8mb4_bin` is a PAD SPACE collation: `m` and `m ` were one key. Binary strings
    // compare byte for byte, trailing spaces included, on MariaDB and MySQL alike; 1020 bytes
    // hold 255 characters of UTF-8. On an existing table this rebuilds it.
    (
        2,
        &["ALTER TABLE {t} MODIFY consumer VARBINARY(1020) NOT NULL, \
           MODIFY message_id VARBINARY(1020) NOT NULL"],
    ),
    // Dedup-only records: claimed (0) by an owner, or done (1). Claims and existing rows
    // are done.
    (
        3,
        &["ALTER TABLE {t} ADD COLUMN state TINYINT NOT NULL DEFAULT 1, \
           ADD COLUMN owner VARBINARY(64) NULL"],
    ),
    // Each row's own end of retention, from the database's clock; existing rows get the
    // migrating instance's retention from their claim time ({r}: ms, or NULL).
    (
        4,
        &[
            "ALTER TABLE {t} ADD COLUMN purge_after_ms BIGINT NULL, \
             ADD KEY {t}_purge_after (purge_after_ms)",
            "UPDATE {t} SET purge_after_ms = processed_at_ms + {r} WHERE purge_after_ms IS NULL",
        ],
    ),
];

/// The database's clock in ms since the Unix epoch.
const DB_NOW_MS: &str = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";

impl SqlxInbox<MySql> {
    /// Runs the embedded migrations not yet applied, under `GET_LOCK` so that instances starting
    /// together do not race (DDL is not transactional in MariaDB).
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let t = self.table();
        let mut conn = self.pool.acquire().await?;
        let lock = format!("twice-migrate:{t}");
        sqlx::query("SELECT GET_LOCK(?, 60)").bind(&lock).execute(&mut *conn).await?;
        let result = async {
            sqlx::query(&format!(
                "CREATE TABLE IF NOT EXISTS {t}_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL) ENGINE = InnoDB"
            ))
            .execute(&mut *conn)
            .await?;
            let applied: Vec<i64> =
                sqlx::query_scalar(&format!("SELECT version FROM {t}_migrations"))
                    .fetch_all(&mut *conn)
                    .await?;
            for (version, statements) in MIGRATIONS {
                if applied.contains(version) {
                    continue;
                }
                for statement in *statements {
                    sqlx::query(&self.migration_sql(statement)).execute(&mut *conn).await?;
                }
                sqlx::query(&format!(
                    "INSERT INTO {t}_migrations (version, applied_at_ms) VALUES (?, UNIX_TIMESTAMP(NOW(3)) * 1000)"
                ))
                .bind(version)
                .execute(&mut *conn)
                .await?;
            }
            Ok::<_, sqlx::Error>(())
        }
        .await;
        sqlx::query("SELECT RELEASE_LOCK(?)").bind(&lock).execute(&mut *conn).await?;
        Ok(result?)
    }

    async fn claim_in(
        &self,
        conn: &mut sqlx::MySqlConnection,
        consumer: &str,
        message_id: &MessageId,
        now: Timestamp,
    ) -> Result<Claim, StoreError> {
        // INSERT IGNORE would truncate an over-long value instead of failing.
        validate_key(consumer, message_id)?;
        let t = self.table();
        let inserted = sqlx::query(&format!(
            "INSERT IGNORE INTO {t} (consumer, message_id, processed_at_ms, purge_after_ms) \
             VALUES (?, ?, ?, {DB_NOW_MS} + ?)"
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
        // A locking read sees the latest committed row whatever the snapshot of the
        // transaction.
        let at: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT processed_at_ms FROM {t} WHERE consumer = ? AND message_id = ? LOCK IN SHARE MODE"
        ))
        .bind(consumer)
        .bind(message_id.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        Ok(Claim::Duplicate { claimed_at: at.map(Timestamp::from_millis) })
    }
}

/// Whether a 1062/1586 error names `key` as the violated key. The server puts the key name
/// only in the text, last and quoted: `... for key 'name'` (MariaDB, which does not name the
/// table: the key's name was checked at start to belong to one table) or `'table.name'`
/// (MySQL 8).
fn names_key(message: &str, key: &crate::BusinessKey) -> bool {
    let m = message.trim_end();
    let (table, key) = (key.table(), key.key());
    m.ends_with(&format!(" '{key}'")) || m.ends_with(&format!(" '{table}.{key}'"))
}

impl crate::sealed::Sealed for MySql {}

impl crate::Backend for MySql {
    async fn prepare(inbox: &mut SqlxInbox<MySql>) -> Result<(), StoreError> {
        if inbox.options.migrate {
            inbox.migrate().await?;
        }
        // MariaDB's error names only the key: the key's name must belong to one table of the
        // database, or a violation on another table would be taken for it.
        let mut keys = Vec::new();
        for key in &inbox.options.business_keys {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT CAST(TABLE_NAME AS CHAR) FROM information_schema.STATISTICS \
                 WHERE TABLE_SCHEMA = DATABASE() AND INDEX_NAME = ? AND NON_UNIQUE = 0 \
                 ORDER BY 1",
            )
            .bind(key.key())
            .fetch_all(&inbox.pool)
            .await?;
            if !tables.iter().any(|t| t == key.table()) {
                return Err(StoreError::BusinessKeyNotFound {
                    table: key.table().to_owned(),
                    key: key.key().to_owned(),
                });
            }
            if tables.len() > 1 {
                return Err(StoreError::AmbiguousBusinessKey { key: key.key().to_owned(), tables });
            }
            keys.push((key.clone(), key.table().to_owned()));
        }
        inbox.business_keys = keys;
        let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(&inbox.pool).await?;
        inbox.mariadb = version.contains("MariaDB");
        Ok(())
    }
}

impl Inbox for SqlxInbox<MySql> {
    type Tx = Transaction<'static, MySql>;
    type Error = StoreError;

    fn retention(&self) -> Option<Duration> {
        self.options.retention
    }

    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        crate::begin_detached(&self.pool, None).await
    }

    /// As [`Inbox::begin`], after `SET SESSION innodb_lock_wait_timeout` to the time left on
    /// the lock in whole seconds (rounded down, at least 1; the variable has no finer unit), in
    /// the same round trip. The value stays on the pooled connection after the transaction.
    async fn begin_within(&self, lock_wait: Option<Duration>) -> Result<Self::Tx, StoreError> {
        let Some(wait) = lock_wait else { return crate::begin_detached(&self.pool, None).await };
        let seconds = wait.as_secs().clamp(1, 1 << 30);
        let statement =
            format!("SET SESSION innodb_lock_wait_timeout = {seconds}; START TRANSACTION");
        crate::begin_detached(&self.pool, Some(statement)).await
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

    /// Asks the server whether the transaction is still open: InnoDB rolls back a deadlock
    /// victim's whole transaction (error 1213), after which the handler's later statements run
    /// one by one in autocommit and the COMMIT is a no-op. MariaDB answers with
    /// `@@in_transaction` (one round trip, no table access); MySQL, which lacks it, is asked
    /// whether InnoDB lists a transaction for this connection.
    async fn check_committable<'a>(&'a self, tx: &'a mut Self::Tx) -> Result<(), StoreError> {
        let open: i64 = if self.mariadb {
            sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
                .fetch_one(&mut **tx)
                .await?
        } else {
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.innodb_trx \
                 WHERE trx_mysql_thread_id = CONNECTION_ID()",
            )
            .fetch_one(&mut **tx)
            .await?
        };
        if open == 0 { Err(StoreError::TransactionAborted) } else { Ok(()) }
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
            let mut tx = crate::begin_detached(&self.pool, None).await?;
            let inserted = sqlx::query(&format!(
                "INSERT IGNORE INTO {t} (consumer, message_id, processed_at_ms, state, owner, \
                 purge_after_ms) VALUES (?, ?, ?, 0, ?, {DB_NOW_MS} + ?)"
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
                "SELECT processed_at_ms, CAST(state AS SIGNED), CAST(owner AS CHAR) FROM {t} \
                 WHERE consumer = ? AND message_id = ? LOCK IN SHARE MODE"
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
            "UPDATE {t} SET state = 1 WHERE consumer = ? AND message_id = ? \
             AND owner = ? AND state = 0"
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
            "DELETE FROM {t} WHERE consumer = ? AND message_id = ? AND owner = ? \
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
        let Some(my) = db.try_downcast_ref::<MySqlDatabaseError>() else {
            return ErrorClass::Unknown;
        };
        match my.number() {
            errno::DUP_ENTRY | errno::DUP_ENTRY_WITH_KEY_NAME => {
                let message = my.message();
                match self.business_keys.iter().find(|(key, _)| names_key(message, key)) {
                    Some((key, _)) => {
                        ErrorClass::BusinessKeyDuplicate { constraint: key.key().to_owned() }
                    }
                    None => ErrorClass::Unknown,
                }
            }
            errno::LOCK_WAIT_TIMEOUT | errno::LOCK_DEADLOCK | errno::QUERY_INTERRUPTED => {
                ErrorClass::Transient
            }
            errno::DATA_TOO_LONG
            | errno::TRUNCATED_WRONG_VALUE
            | errno::BAD_NULL
            | errno::OUT_OF_RANGE
            | errno::CHECK_CONSTRAINT => ErrorClass::Permanent,
            _ => ErrorClass::Unknown,
        }
    }
}

impl Purge for SqlxInbox<MySql> {
    async fn purge(&self) -> Result<u64, StoreError> {
        let t = self.table();
        let mut conn = self.pool.acquire().await?;
        let lock = format!("twice-purge:{t}");
        let ours: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK(?, 0)").bind(&lock).fetch_one(&mut *conn).await?;
        if ours != Some(1) {
            // Another instance is purging this table.
            return Ok(0);
        }
        let result = async {
            let mut total = 0;
            loop {
                // Each bounded DELETE commits on its own (autocommit), so locks stay short.
                let deleted = sqlx::query(&format!(
                    "DELETE FROM {t} WHERE purge_after_ms < {DB_NOW_MS} \
                     ORDER BY purge_after_ms LIMIT ?"
                ))
                .bind(self.options.purge_batch_size)
                .execute(&mut *conn)
                .await?
                .rows_affected();
                total += deleted;
                if deleted < u64::from(self.options.purge_batch_size) {
                    return Ok::<_, sqlx::Error>(total);
                }
            }
        }
        .await;
        sqlx::query("SELECT RELEASE_LOCK(?)").bind(&lock).execute(&mut *conn).await?;
        Ok(result?)
    }
}

#[cfg(test)]
mod tests {
    use super::names_key;

    #[test]
    fn key_names_are_read_from_the_end_of_the_message() {
        let key = |table: &str, key: &str| crate::InboxOptions::new().business_key(table, key);
        let shipments = key("shipments", "shipments_order_id");
        let shipments = &shipments.get_business_keys()[0];
        let maria = "Duplicate entry '42' for key 'shipments_order_id'";
        let mysql8 = "Duplicate entry '42' for key 'shipments.shipments_order_id'";
        assert!(names_key(maria, shipments));
        assert!(names_key(mysql8, shipments));
        let returns = key("returns", "shipments_order_id");
        assert!(!names_key(mysql8, &returns.get_business_keys()[0]), "MySQL 8 names the table");
        let suffix = key("shipments", "order_id");
        assert!(!names_key(maria, &suffix.get_business_keys()[0]));
        // A value that looks like a key name does not fool it.
        let x = key("shipments", "x");
        assert!(!names_key("Duplicate entry 'x' for key 'PRIMARY'", &x.get_business_keys()[0]));
    }
}
