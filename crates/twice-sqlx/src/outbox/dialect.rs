//! What the outbox does differently on each database: its table, how a relay's lease
//! transaction begins and skips rows another relay is leasing, and the batched purge.

use crate::store::Dialect;

/// The outbox's part of a database's dialect.
pub trait OutboxDialect: Dialect {
    /// The outbox table's migrations: (version, statements), `{t}` standing for its name.
    const OUTBOX_MIGRATIONS: &'static [(i64, &'static [&'static str])];
    /// The statement that begins a relay's lease transaction.
    const LEASE_BEGIN: &'static str;
    /// The end of the lease's read of candidate rows, so that two relays leasing at once
    /// take different rows (empty where the begin already serialises leases).
    const SKIP_LOCKED: &'static str;
    /// Deletes at most `{n}` sent rows done before `{before}` (both SQL literals).
    const PURGE_SENT: &'static str;
    /// Whether a multi-row `INSERT` can return the rows' `seq` (`RETURNING`), so that rows
    /// can be written leased to the local relay and handed to it (MariaDB can, MySQL cannot:
    /// the inbox asks the server).
    const INSERT_RETURNING: bool;
}

#[cfg(feature = "postgres")]
impl OutboxDialect for sqlx::Postgres {
    const OUTBOX_MIGRATIONS: &'static [(i64, &'static [&'static str])] = &[(
        1,
        &[
            "CREATE TABLE IF NOT EXISTS {t} (
                seq BIGSERIAL PRIMARY KEY,
                ordering_key TEXT NOT NULL,
                destination TEXT NOT NULL,
                message_id TEXT NOT NULL,
                headers TEXT NOT NULL,
                body BYTEA NOT NULL,
                created_at_ms BIGINT NOT NULL,
                state BIGINT NOT NULL DEFAULT 0,
                not_before_ms BIGINT NOT NULL DEFAULT 0,
                lease_owner TEXT,
                lease_until_ms BIGINT,
                attempts BIGINT NOT NULL DEFAULT 0,
                last_error TEXT,
                done_at_ms BIGINT
            )",
            "CREATE INDEX IF NOT EXISTS {t}_state_seq ON {t} (state, seq)",
            "CREATE INDEX IF NOT EXISTS {t}_key_seq ON {t} (ordering_key, state, seq)",
        ],
    )];
    // READ COMMITTED whatever the session's default: each statement sees what committed
    // before it, rows being leased by another relay included.
    const LEASE_BEGIN: &'static str = "BEGIN ISOLATION LEVEL READ COMMITTED";
    const SKIP_LOCKED: &'static str = " FOR UPDATE SKIP LOCKED";
    const PURGE_SENT: &'static str = "DELETE FROM {t} WHERE seq = ANY(ARRAY(SELECT seq FROM {t} \
                                      WHERE state = 1 AND done_at_ms < {before} ORDER BY seq LIMIT {n}))";
    const INSERT_RETURNING: bool = true;
}

#[cfg(feature = "mysql")]
impl OutboxDialect for sqlx::MySql {
    const OUTBOX_MIGRATIONS: &'static [(i64, &'static [&'static str])] = &[(
        1,
        &["CREATE TABLE IF NOT EXISTS {t} (
                seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                ordering_key VARCHAR(100) CHARACTER SET ascii COLLATE ascii_general_ci NOT NULL,
                destination TEXT CHARACTER SET utf8mb4 NOT NULL,
                message_id TEXT CHARACTER SET utf8mb4 NOT NULL,
                headers LONGTEXT CHARACTER SET utf8mb4 NOT NULL,
                body LONGBLOB NOT NULL,
                created_at_ms BIGINT NOT NULL,
                state BIGINT NOT NULL DEFAULT 0,
                not_before_ms BIGINT NOT NULL DEFAULT 0,
                lease_owner VARCHAR(100) CHARACTER SET utf8mb4 NULL,
                lease_until_ms BIGINT NULL,
                attempts BIGINT NOT NULL DEFAULT 0,
                last_error TEXT CHARACTER SET utf8mb4 NULL,
                done_at_ms BIGINT NULL,
                KEY {t}_state_seq (state, seq),
                KEY {t}_key_seq (ordering_key, state, seq)
            ) ENGINE = InnoDB"],
    )];
    // READ COMMITTED: InnoDB then locks only the rows the lease returns (at REPEATABLE READ
    // it would lock every row its scan passed), and reads what committed before each
    // statement.
    const LEASE_BEGIN: &'static str =
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";
    const SKIP_LOCKED: &'static str = " FOR UPDATE SKIP LOCKED";
    // MariaDB takes no LIMIT in an IN subquery, but its DELETE takes ORDER BY and LIMIT.
    const PURGE_SENT: &'static str =
        "DELETE FROM {t} WHERE state = 1 AND done_at_ms < {before} ORDER BY seq LIMIT {n}";
    const INSERT_RETURNING: bool = false;
}

#[cfg(feature = "sqlite")]
impl OutboxDialect for sqlx::Sqlite {
    const OUTBOX_MIGRATIONS: &'static [(i64, &'static [&'static str])] = &[(
        1,
        &[
            "CREATE TABLE IF NOT EXISTS {t} (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                ordering_key TEXT NOT NULL,
                destination TEXT NOT NULL,
                message_id TEXT NOT NULL,
                headers TEXT NOT NULL,
                body BLOB NOT NULL,
                created_at_ms INTEGER NOT NULL,
                state INTEGER NOT NULL DEFAULT 0,
                not_before_ms INTEGER NOT NULL DEFAULT 0,
                lease_owner TEXT,
                lease_until_ms INTEGER,
                attempts INTEGER NOT NULL DEFAULT 0,
                last_error TEXT,
                done_at_ms INTEGER
            )",
            "CREATE INDEX IF NOT EXISTS {t}_state_seq ON {t} (state, seq)",
            "CREATE INDEX IF NOT EXISTS {t}_key_seq ON {t} (ordering_key, state, seq)",
        ],
    )];
    // The write lock at once: one lease at a time, and none while a writer holds the
    // database, so no row can be taken twice.
    const LEASE_BEGIN: &'static str = "BEGIN IMMEDIATE";
    const SKIP_LOCKED: &'static str = "";
    const PURGE_SENT: &'static str = "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} \
                                      WHERE state = 1 AND done_at_ms < {before} ORDER BY seq LIMIT {n})";
    const INSERT_RETURNING: bool = true;
}
