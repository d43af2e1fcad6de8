//! The store logic every database shares, and the dialect that states what differs.
//!
//! One implementation of [`twice::Inbox`] serves SQLite, PostgreSQL and MariaDB/MySQL. Each
//! database's module implements [`Dialect`]: how a transaction begins (isolation level, lock
//! wait bound, write lock), how parameters are written, how a row is inserted unless its key
//! is present, whether reading the row found in place needs a locking read, the migrations and
//! how they are serialised between instances, the committable check, and how database errors
//! are classified. Purging stays with each database: its batching and its lock differ.

use std::future::Future;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::{ColumnIndex, Connection as _, Database, Decode, Encode, Executor, IntoArguments, Type};
use twice::outbox::{LeasedMessage, OutboxStore as _, Staged};
use twice::{Claim, ErrorClass, Inbox, MessageId, OutgoingMessage, Timestamp};

use crate::outbox::OutboxDialect;
use crate::{
    SqlxInbox, StoreError, begin_detached, claim_of_record, find_sqlx_error, is_transient_sqlx,
    millis, validate_key,
};

/// What one database does differently; see the [module docs](self).
pub trait Dialect: Database {
    /// The embedded migrations: (version, statements); `{t}` stands for the table name and
    /// `{r}` for the migrating instance's retention in ms (or `NULL`).
    const MIGRATIONS: &'static [(i64, &'static [&'static str])];
    /// Run first in the migration transaction so that instances starting together do not
    /// race (`{t}`: the table name); `None` where beginning the transaction already does.
    const MIGRATION_LOCK: Option<&'static str>;
    /// Run on the connection after the migration transaction ended, to free a lock that
    /// outlives transactions.
    const MIGRATION_UNLOCK: Option<&'static str>;
    /// The database's clock in ms since the Unix epoch, as an SQL expression.
    const DB_NOW_MS: &'static str;
    /// The start of an insert that does nothing when the key is present.
    const INSERT: &'static str;
    /// The end of that insert (after its values).
    const ON_CONFLICT: &'static str;
    /// The end of a read of the row found in place, so that it sees the latest committed row.
    const READ_LATEST: &'static str;
    /// A dedup-only record's `state` and `owner`, as a BIGINT and a text.
    const STATE_AND_OWNER: &'static str;
    /// The `message_id` column as a text.
    const MESSAGE_ID_TEXT: &'static str = "message_id";

    /// How many rows a statement changed.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// The `n`th (from 1) bind parameter.
    fn param(n: usize) -> String;

    /// The statement that begins an inbox transaction whose lock waits end after `lock_wait`;
    /// `None`: the driver's `BEGIN`.
    fn begin_statement(lock_wait: Option<Duration>) -> Option<String>;

    /// Fails with [`StoreError::TransactionAborted`] when committing `tx` would keep none of
    /// its work.
    fn check_committable(
        inbox: &SqlxInbox<Self>,
        tx: &mut sqlx::Transaction<'static, Self>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether [`Inbox::claim_batch`] can claim many ids in one `INSERT .. RETURNING` on this
    /// server (MySQL has no `RETURNING`: it claims them one by one).
    fn returns_inserted(inbox: &SqlxInbox<Self>) -> bool {
        let _ = inbox;
        true
    }

    /// Sets the savepoint of one handler of a batch (`SAVEPOINT twice_item`), and fails with
    /// [`StoreError::TransactionAborted`] where the server may have ended the transaction
    /// under an earlier handler without refusing the statements after it (InnoDB's deadlock
    /// victims), so that no handler's work runs in autocommit.
    fn savepoint(
        inbox: &SqlxInbox<Self>,
        tx: &mut sqlx::Transaction<'static, Self>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send
    where
        for<'c> &'c mut Self::Connection: Executor<'c, Database = Self>,
    {
        let _ = inbox;
        async move {
            (&mut **tx).execute(SAVEPOINT).await?;
            Ok(())
        }
    }

    /// Whether a statement that succeeded inside `tx` proves that it can still commit, so that
    /// writing the outbox rows makes [`Dialect::check_committable`] needless (and a failed
    /// write is classified by [`Dialect::aborted`]).
    const WRITE_PROVES_COMMITTABLE: bool = false;

    /// Whether `error`, raised by a statement inside a transaction, says that the transaction
    /// was aborted before it.
    fn aborted(error: &StoreError) -> bool {
        let _ = error;
        false
    }

    /// Classifies an error the database raised, by its code.
    fn classify_database(
        inbox: &SqlxInbox<Self>,
        error: &(dyn DatabaseError + 'static),
    ) -> ErrorClass;
}

/// The savepoint each handler of a batch runs under. One name for all: a savepoint set again
/// under the same name hides (PostgreSQL, SQLite) or replaces (MariaDB) the one before, and
/// `ROLLBACK TO` goes to the latest, so none needs releasing.
pub(crate) const SAVEPOINT: &str = "SAVEPOINT twice_item";

/// An insert into `t` of `columns` with `values` that does nothing when the key is present.
fn insert<DB: Dialect>(t: &str, columns: &str, values: &[&str]) -> String {
    let values = values.join(", ");
    format!("{} {t} ({columns}) VALUES ({values}){}", DB::INSERT, DB::ON_CONFLICT)
}

/// `consumer = p1 AND message_id = p2`, then `AND owner = p3 AND state = 0` with `owned`.
fn key_is<DB: Dialect>(owned: bool) -> String {
    let mut sql = format!("consumer = {} AND message_id = {}", DB::param(1), DB::param(2));
    if owned {
        sql.push_str(&format!(" AND owner = {} AND state = 0", DB::param(3)));
    }
    sql
}

/// A migration statement with the table name and the retention (ms, or `NULL`) filled in.
fn migration_sql(statement: &str, table: &str, retention_ms: Option<i64>) -> String {
    let retention = retention_ms.map_or_else(|| "NULL".to_owned(), |r| r.to_string());
    statement.replace("{t}", table).replace("{r}", &retention)
}

/// Runs the `migrations` of `table` not yet applied, one instance at a time; the applied
/// versions are recorded in `<table>_migrations`.
pub(crate) async fn migrate_table<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
    t: &str,
    migrations: &[(i64, &[&str])],
    retention_ms: Option<i64>,
) -> Result<(), StoreError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    let mut conn = pool.acquire().await?;
    let result = async {
        let mut tx = match DB::begin_statement(None) {
            Some(statement) => conn.begin_with(statement).await?,
            None => conn.begin().await?,
        };
        if let Some(lock) = DB::MIGRATION_LOCK {
            sqlx::query(&lock.replace("{t}", t)).execute(&mut *tx).await?;
        }
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {t}_migrations \
             (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)"
        ))
        .execute(&mut *tx)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(&format!("SELECT version FROM {t}_migrations"))
            .fetch_all(&mut *tx)
            .await?;
        for (version, statements) in migrations {
            if applied.contains(version) {
                continue;
            }
            for statement in *statements {
                let sql = migration_sql(statement, t, retention_ms);
                sqlx::query(&sql).execute(&mut *tx).await?;
            }
            sqlx::query(&format!(
                "INSERT INTO {t}_migrations (version, applied_at_ms) VALUES ({}, {})",
                DB::param(1),
                DB::DB_NOW_MS
            ))
            .bind(version)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }
    .await;
    if let Some(unlock) = DB::MIGRATION_UNLOCK {
        sqlx::query(&unlock.replace("{t}", t)).execute(&mut *conn).await?;
    }
    Ok(result?)
}

impl<DB: Dialect> SqlxInbox<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    Option<i64>: for<'q> Encode<'q, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    /// Runs the embedded migrations not yet applied, one instance at a time.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate_table(&self.pool, self.table(), DB::MIGRATIONS, self.retention_ms()).await
    }

    /// Inserts the claim in `conn`'s transaction; on a duplicate, reads the winner's time.
    async fn claim_in(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        message_id: &MessageId,
        now: Timestamp,
    ) -> Result<Claim, StoreError> {
        // MariaDB's INSERT IGNORE would truncate an over-long value instead of failing.
        validate_key(consumer, message_id)?;
        let t = self.table();
        let purge_after = format!("{} + {}", DB::DB_NOW_MS, DB::param(4));
        let columns = "consumer, message_id, processed_at_ms, purge_after_ms";
        let values = [&*DB::param(1), &DB::param(2), &DB::param(3), &purge_after];
        let inserted = DB::rows_affected(
            &sqlx::query(&insert::<DB>(t, columns, &values))
                .bind(consumer.to_owned())
                .bind(message_id.as_str().to_owned())
                .bind(millis(now))
                .bind(self.retention_ms())
                .execute(&mut *conn)
                .await?,
        );
        if inserted == 1 {
            return Ok(Claim::Claimed);
        }
        // The insert waited for the holder, if any, to end; this read sees its committed row.
        let at: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT processed_at_ms FROM {t} WHERE {}{}",
            key_is::<DB>(false),
            DB::READ_LATEST
        ))
        .bind(consumer.to_owned())
        .bind(message_id.as_str().to_owned())
        .fetch_optional(&mut *conn)
        .await?;
        Ok(Claim::Duplicate { claimed_at: at.map(Timestamp::from_millis) })
    }

    /// Claims `ids` (distinct) in `conn`'s transaction with one `INSERT .. RETURNING` (per
    /// [`CLAIM_CHUNK`] ids), then reads the winners' times of those not inserted.
    async fn claim_batch_in(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        ids: &[MessageId],
        now: Timestamp,
    ) -> Result<Vec<Claim>, StoreError> {
        for id in ids {
            validate_key(consumer, id)?;
        }
        let t = self.table();
        let mut inserted = std::collections::HashSet::new();
        for chunk in ids.chunks(CLAIM_CHUNK) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|k| {
                    let p = |n: usize| DB::param(4 * k + n);
                    format!("({}, {}, {}, {} + {})", p(1), p(2), p(3), DB::DB_NOW_MS, p(4))
                })
                .collect();
            let sql = format!(
                "{} {t} (consumer, message_id, processed_at_ms, purge_after_ms) VALUES {}{} \
                 RETURNING {}",
                DB::INSERT,
                rows.join(", "),
                DB::ON_CONFLICT,
                DB::MESSAGE_ID_TEXT
            );
            let mut query = sqlx::query_scalar::<_, String>(&sql);
            for id in chunk {
                query = query
                    .bind(consumer.to_owned())
                    .bind(id.as_str().to_owned())
                    .bind(millis(now))
                    .bind(self.retention_ms());
            }
            inserted.extend(query.fetch_all(&mut *conn).await?);
        }
        let taken: Vec<&MessageId> =
            ids.iter().filter(|id| !inserted.contains(id.as_str())).collect();
        let mut claimed_at = std::collections::HashMap::new();
        for chunk in taken.chunks(CLAIM_CHUNK) {
            // The insert waited for the holders, if any, to end; this read sees their rows.
            let list: Vec<String> = (0..chunk.len()).map(|k| DB::param(k + 2)).collect();
            let sql = format!(
                "SELECT {}, processed_at_ms FROM {t} WHERE consumer = {} \
                 AND message_id IN ({}){}",
                DB::MESSAGE_ID_TEXT,
                DB::param(1),
                list.join(", "),
                DB::READ_LATEST
            );
            let mut query = sqlx::query_as::<_, (String, i64)>(&sql).bind(consumer.to_owned());
            for id in chunk {
                query = query.bind(id.as_str().to_owned());
            }
            claimed_at.extend(query.fetch_all(&mut *conn).await?);
        }
        Ok(ids
            .iter()
            .map(|id| {
                if inserted.contains(id.as_str()) {
                    Claim::Claimed
                } else {
                    let at = claimed_at.get(id.as_str()).copied();
                    Claim::Duplicate { claimed_at: at.map(Timestamp::from_millis) }
                }
            })
            .collect())
    }
}

/// The most ids one claim statement of a batch inserts.
const CLAIM_CHUNK: usize = 500;

impl<DB: OutboxDialect> Inbox for SqlxInbox<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    Option<i64>: for<'q> Encode<'q, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    Vec<u8>: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    type Tx = sqlx::Transaction<'static, DB>;
    type Error = StoreError;

    fn retention(&self) -> Option<Duration> {
        self.options.retention
    }

    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    /// Begins with the dialect's statement: PostgreSQL `BEGIN ISOLATION LEVEL READ
    /// COMMITTED` whatever the session's default, SQLite `BEGIN IMMEDIATE`, MariaDB `BEGIN`.
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        begin_detached(&self.pool, DB::begin_statement(None)).await
    }

    /// As [`Inbox::begin`], bounding lock waits by `lock_wait` in the same round trip
    /// (PostgreSQL `SET LOCAL lock_timeout`; MariaDB `SET SESSION innodb_lock_wait_timeout`
    /// in whole seconds, which stays on the pooled connection; SQLite waits at its `BEGIN
    /// IMMEDIATE`).
    async fn begin_within(&self, lock_wait: Option<Duration>) -> Result<Self::Tx, StoreError> {
        begin_detached(&self.pool, DB::begin_statement(lock_wait)).await
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

    async fn check_committable<'a>(&'a self, tx: &'a mut Self::Tx) -> Result<(), StoreError> {
        DB::check_committable(self, tx).await
    }

    fn supports_batches(&self) -> bool {
        true
    }

    /// One `INSERT .. ON CONFLICT DO NOTHING RETURNING message_id` (MariaDB: `INSERT IGNORE ..
    /// RETURNING`) for up to 500 ids, then one read of the winners' times for the ids it did
    /// not insert; MySQL, without `RETURNING`, claims one by one.
    async fn claim_batch<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_ids: &'a [MessageId],
        now: Timestamp,
    ) -> Result<Vec<Claim>, StoreError> {
        if DB::returns_inserted(self) {
            return self.claim_batch_in(tx, consumer, message_ids, now).await;
        }
        let mut claims = Vec::with_capacity(message_ids.len());
        for id in message_ids {
            claims.push(self.claim_in(tx, consumer, id, now).await?);
        }
        Ok(claims)
    }

    async fn savepoint<'a>(&'a self, tx: &'a mut Self::Tx) -> Result<(), StoreError> {
        DB::savepoint(self, tx).await
    }

    async fn rollback_to_savepoint<'a>(&'a self, tx: &'a mut Self::Tx) -> Result<(), StoreError> {
        (&mut **tx).execute("ROLLBACK TO SAVEPOINT twice_item").await?;
        Ok(())
    }

    async fn unclaim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
    ) -> Result<(), StoreError> {
        let sql = format!("DELETE FROM {} WHERE {}", self.table(), key_is::<DB>(false));
        sqlx::query(&sql)
            .bind(consumer.to_owned())
            .bind(message_id.as_str().to_owned())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    fn has_outbox(&self) -> bool {
        self.outbox.is_some()
    }

    /// One multi-row `INSERT` into the outbox table (per 100 messages), in the handler's
    /// transaction; then the check that the transaction can commit, unless the database
    /// refuses every statement of an aborted transaction (PostgreSQL), where the insert was
    /// that check.
    async fn stage<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        messages: &'a [OutgoingMessage],
    ) -> Result<Staged, StoreError> {
        let Some(outbox) = &self.outbox else {
            return Err(StoreError::Outgoing(twice::OutboxError::NotConfigured));
        };
        let wake = outbox.waker().clone();
        // Rows leased at once to this process's relay, if one runs: handed to it after the
        // commit, it sends them without leasing them from the table.
        let relay = if DB::INSERT_RETURNING || self.mariadb { wake.local_relay() } else { None };
        let lease = relay.as_ref().map(|(owner, duration)| (owner.as_str(), *duration));
        let table = outbox.options().get_table();
        let seqs = match crate::outbox::write_rows::<DB>(tx, table, messages, lease).await {
            Err(e) if DB::aborted(&e) => return Err(StoreError::TransactionAborted),
            Err(e) => return Err(e),
            Ok(seqs) => seqs,
        };
        if !DB::WRITE_PROVES_COMMITTABLE {
            DB::check_committable(self, tx).await?;
        }
        Ok(match relay {
            Some((owner, _)) if seqs.len() == messages.len() => {
                let rows = seqs
                    .into_iter()
                    .zip(messages)
                    .map(|(seq, m)| {
                        LeasedMessage::new(
                            seq,
                            m.destination.clone(),
                            m.message.clone(),
                            m.ordering_key.clone(),
                            m.created_at,
                            0,
                        )
                    })
                    .collect();
                Staged::handed_to(wake, owner, rows)
            }
            _ => Staged::wake(wake),
        })
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
        let purge_after = format!("{} + {}", DB::DB_NOW_MS, DB::param(5));
        let columns = "consumer, message_id, processed_at_ms, state, owner, purge_after_ms";
        let (p1, p2, p3, p4) = (DB::param(1), DB::param(2), DB::param(3), DB::param(4));
        let insert = insert::<DB>(t, columns, &[&p1, &p2, &p3, "0", &p4, &purge_after]);
        let read = format!(
            "SELECT processed_at_ms, {} FROM {t} WHERE {}{}",
            DB::STATE_AND_OWNER,
            key_is::<DB>(false),
            DB::READ_LATEST
        );
        // A record removed between the insert and the read is inserted again.
        for _ in 0..3 {
            let mut tx = begin_detached(&self.pool, DB::begin_statement(None)).await?;
            let inserted = DB::rows_affected(
                &sqlx::query(&insert)
                    .bind(consumer.to_owned())
                    .bind(message_id.as_str().to_owned())
                    .bind(millis(now))
                    .bind(owner.to_owned())
                    .bind(self.retention_ms())
                    .execute(&mut *tx)
                    .await?,
            );
            if inserted == 1 {
                tx.commit().await?;
                return Ok(Claim::Claimed);
            }
            let row: Option<(i64, i64, Option<String>)> = sqlx::query_as(&read)
                .bind(consumer.to_owned())
                .bind(message_id.as_str().to_owned())
                .fetch_optional(&mut *tx)
                .await?;
            tx.commit().await?;
            let Some((at, state, by)) = row else { continue };
            return Ok(claim_of_record(at, state, by.as_deref(), owner));
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
        let sql = format!("UPDATE {} SET state = 1 WHERE {}", self.table(), key_is::<DB>(true));
        let updated = DB::rows_affected(
            &sqlx::query(&sql)
                .bind(consumer.to_owned())
                .bind(message_id.as_str().to_owned())
                .bind(owner.to_owned())
                .execute(&mut **tx)
                .await?,
        );
        Ok(updated == 1)
    }

    async fn forget<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, StoreError> {
        let sql = format!("DELETE FROM {} WHERE {}", self.table(), key_is::<DB>(true));
        let mut conn = self.pool.acquire().await?;
        let deleted = DB::rows_affected(
            &sqlx::query(&sql)
                .bind(consumer.to_owned())
                .bind(message_id.as_str().to_owned())
                .bind(owner.to_owned())
                .execute(&mut *conn)
                .await?,
        );
        Ok(deleted == 1)
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        if let Some(StoreError::KeyTooLong { .. }) = error.downcast_ref::<StoreError>() {
            // The message id can never be claimed: the message's fault, not the store's.
            return ErrorClass::Permanent;
        }
        let Some(e) = find_sqlx_error(error) else { return ErrorClass::Unknown };
        match e {
            sqlx::Error::Database(db) => DB::classify_database(self, db.as_ref()),
            e if is_transient_sqlx(e) => ErrorClass::Transient,
            _ => ErrorClass::Unknown,
        }
    }
}

#[cfg(all(test, feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod tests {
    use sqlx::{MySql, Postgres, Sqlite};

    use super::{insert, key_is};

    #[test]
    fn each_dialect_writes_the_claim_in_its_own_sql() {
        let cols = "consumer, message_id";
        assert_eq!(
            insert::<Postgres>("t", cols, &["$1", "$2"]),
            "INSERT INTO t (consumer, message_id) VALUES ($1, $2) \
             ON CONFLICT (consumer, message_id) DO NOTHING"
        );
        assert_eq!(
            insert::<MySql>("t", cols, &["?", "?"]),
            "INSERT IGNORE INTO t (consumer, message_id) VALUES (?, ?)"
        );
        assert_eq!(
            insert::<Sqlite>("t", cols, &["?1", "?2"]),
            "INSERT INTO t (consumer, message_id) VALUES (?1, ?2) \
             ON CONFLICT (consumer, message_id) DO NOTHING"
        );
        assert_eq!(key_is::<Postgres>(false), "consumer = $1 AND message_id = $2");
        assert_eq!(
            key_is::<MySql>(true),
            "consumer = ? AND message_id = ? AND owner = ? AND state = 0"
        );
        assert_eq!(
            key_is::<Sqlite>(true),
            "consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state = 0"
        );
    }
}
