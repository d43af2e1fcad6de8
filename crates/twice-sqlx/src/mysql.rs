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

use sqlx::error::DatabaseError;
use sqlx::mysql::MySqlDatabaseError;
use sqlx::{MySql, Transaction};
use twice::ErrorClass;

use crate::{Purge, SqlxInbox, StoreError};

/// An inbox on MariaDB or MySQL.
pub type MySqlInbox = SqlxInbox<MySql>;

/// MariaDB/MySQL error numbers the store looks at.
mod errno {
    pub(super) const DUP_ENTRY: u16 = 1062;
    pub(super) const DUP_ENTRY_WITH_KEY_NAME: u16 = 1586;
    pub(super) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    pub(super) const LOCK_DEADLOCK: u16 = 1213;
    pub(super) const QUERY_INTERRUPTED: u16 = 1317;
    /// "Record has changed since last read": a write conflict under
    /// `innodb_snapshot_isolation`; the retry reads afresh.
    pub(super) const CHECKREAD: u16 = 1020;
    pub(super) const TOO_MANY_CONNECTIONS: u16 = 1040;
    pub(super) const SERVER_SHUTDOWN: u16 = 1053;
    pub(super) const ERROR_DURING_COMMIT: u16 = 1180;
    /// The server runs with `--read-only` (a replica, or a primary demoted in a failover).
    pub(super) const OPTION_PREVENTS_STATEMENT: u16 = 1290;
    pub(super) const TOO_MANY_CONCURRENT_TRANSACTIONS: u16 = 1637;
    /// A write in a `READ ONLY` transaction.
    pub(super) const READ_ONLY_TRANSACTION: u16 = 1792;
    /// MySQL's read-only mode.
    pub(super) const READ_ONLY_MODE: u16 = 1836;
    pub(super) const CONNECTION_KILLED: u16 = 1927;
    /// MySQL 8: the server closed a connection that was idle too long.
    pub(super) const CLIENT_INTERACTION_TIMEOUT: u16 = 4031;
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

/// Whether a 1062/1586 error names `key` as the violated key. The server puts the key name
/// only in the text, last and quoted: `... for key 'name'` (MariaDB, which does not name the
/// table: the key's name was checked at start to belong to one table) or `'table.name'`
/// (MySQL 8).
fn names_key(message: &str, key: &crate::BusinessKey) -> bool {
    let m = message.trim_end();
    let (table, key) = (key.table(), key.key());
    m.ends_with(&format!(" '{key}'")) || m.ends_with(&format!(" '{table}.{key}'"))
}

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

impl crate::store::Dialect for MySql {
    const MIGRATIONS: &'static [(i64, &'static [&'static str])] = MIGRATIONS;
    // DDL is not transactional in MariaDB: a named lock held by the session serialises
    // instances starting together.
    const MIGRATION_LOCK: Option<&'static str> = Some("SELECT GET_LOCK('twice-migrate:{t}', 60)");
    const MIGRATION_UNLOCK: Option<&'static str> = Some("SELECT RELEASE_LOCK('twice-migrate:{t}')");
    const DB_NOW_MS: &'static str = DB_NOW_MS;
    const INSERT: &'static str = "INSERT IGNORE INTO";
    const ON_CONFLICT: &'static str = "";
    // A locking read sees the latest committed row whatever the snapshot of the transaction.
    const READ_LATEST: &'static str = " LOCK IN SHARE MODE";
    const STATE_AND_OWNER: &'static str = "CAST(state AS SIGNED), CAST(owner AS CHAR)";
    const MESSAGE_ID_TEXT: &'static str = "CAST(message_id AS CHAR)";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }

    fn param(_n: usize) -> String {
        "?".to_owned()
    }

    /// `BEGIN`; with a lock wait, after `SET SESSION innodb_lock_wait_timeout` to the time
    /// left on the lock in whole seconds (rounded down, at least 1; the variable has no finer
    /// unit), in the same round trip. The value stays on the pooled connection after the
    /// transaction.
    fn begin_statement(lock_wait: Option<Duration>) -> Option<String> {
        let seconds = lock_wait?.as_secs().clamp(1, 1 << 30);
        Some(format!("SET SESSION innodb_lock_wait_timeout = {seconds}; START TRANSACTION"))
    }

    /// MariaDB has `INSERT .. RETURNING`; MySQL has not.
    fn returns_inserted(inbox: &SqlxInbox<MySql>) -> bool {
        inbox.mariadb
    }

    /// The savepoint and, in the same round trip on MariaDB, `@@in_transaction`: a handler
    /// before it that swallowed a deadlock error left the transaction rolled back and the
    /// connection in autocommit, where the next handler's work would commit alone.
    async fn savepoint(
        inbox: &SqlxInbox<MySql>,
        tx: &mut Transaction<'static, MySql>,
    ) -> Result<(), StoreError> {
        if !inbox.mariadb {
            Self::check_committable(inbox, tx).await?;
            sqlx::Executor::execute(&mut **tx, crate::store::SAVEPOINT).await?;
            return Ok(());
        }
        let sql = format!("{}; SELECT CAST(@@in_transaction AS SIGNED)", crate::store::SAVEPOINT);
        let open: Option<i64> = sqlx::Executor::fetch_all(&mut **tx, sql.as_str())
            .await?
            .last()
            .map(|row| sqlx::Row::try_get(row, 0))
            .transpose()?;
        if open == Some(1) { Ok(()) } else { Err(StoreError::TransactionAborted) }
    }

    /// Asks the server whether the transaction is still open: InnoDB rolls back a deadlock
    /// victim's whole transaction (error 1213), after which the handler's later statements run
    /// one by one in autocommit and the COMMIT is a no-op. MariaDB answers with
    /// `@@in_transaction` (one round trip, no table access); MySQL, which lacks it, is asked
    /// whether InnoDB lists a transaction for this connection.
    async fn check_committable(
        inbox: &SqlxInbox<MySql>,
        tx: &mut Transaction<'static, MySql>,
    ) -> Result<(), StoreError> {
        let open: i64 = if inbox.mariadb {
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

    fn classify_database(
        inbox: &SqlxInbox<MySql>,
        db: &(dyn DatabaseError + 'static),
    ) -> ErrorClass {
        let Some(my) = db.try_downcast_ref::<MySqlDatabaseError>() else {
            return ErrorClass::Unknown;
        };
        match my.number() {
            errno::DUP_ENTRY | errno::DUP_ENTRY_WITH_KEY_NAME => {
                let message = my.message();
                match inbox.business_keys.iter().find(|(key, _)| names_key(message, key)) {
                    Some((key, _)) => {
                        ErrorClass::BusinessKeyDuplicate { constraint: key.key().to_owned() }
                    }
                    None => ErrorClass::Unknown,
                }
            }
            errno::LOCK_WAIT_TIMEOUT
            | errno::LOCK_DEADLOCK
            | errno::QUERY_INTERRUPTED
            | errno::CHECKREAD
            | errno::TOO_MANY_CONNECTIONS
            | errno::SERVER_SHUTDOWN
            | errno::ERROR_DURING_COMMIT
            | errno::OPTION_PREVENTS_STATEMENT
            | errno::TOO_MANY_CONCURRENT_TRANSACTIONS
            | errno::READ_ONLY_TRANSACTION
            | errno::READ_ONLY_MODE
            | errno::CONNECTION_KILLED
            | errno::CLIENT_INTERACTION_TIMEOUT => ErrorClass::Transient,
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
