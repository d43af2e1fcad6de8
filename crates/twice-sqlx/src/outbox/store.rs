//! The outbox's statements, one implementation for the three databases, and its
//! [`OutboxStore`](twice::OutboxStore).

use std::collections::HashSet;
use std::time::Duration;

use sqlx::{ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Type};
use twice::outbox::{LeasedMessage, OutboxStats, OutboxStore, Outgoing, OutgoingMessage, Wake};
use twice::{Message, MessageId, Timestamp};

use super::{
    INSERT_CHUNK, OutboxDialect, OutboxOptions, OutboxRow, RowState, SqlxOutbox, headers_of,
    insert_sql, message_of, params,
};
use crate::{StoreError, begin_detached};

/// The longest `last_error` kept, in characters.
const MAX_ERROR_CHARS: usize = 1000;

fn clip(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The most rows one deletion of sent rows names (a power of two, see
/// [`OutboxStore::sent`]).
const MARK_CHUNK: usize = 512;

/// A leased row as read: seq, ordering key, destination, message id, headers, body, created
/// at, attempts.
type Candidate = (i64, String, String, String, String, Vec<u8>, i64, i64);

/// A row as listed: seq, state, destination, message id, ordering key, created at, attempts,
/// last error, headers, body.
type Listed = (i64, i64, String, String, String, i64, i64, Option<String>, String, Vec<u8>);

impl<DB: OutboxDialect> SqlxOutbox<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    Vec<u8>: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    /// An outbox on `pool`: runs its migration (unless [`OutboxOptions::migrate`] is off, and
    /// then checks that the table is there).
    ///
    /// # Errors
    ///
    /// An invalid table name, a failed migration, or [`StoreError::OutboxTableMissing`], which
    /// names the migration to run.
    pub async fn new(pool: Pool<DB>, options: OutboxOptions) -> Result<Self, StoreError> {
        let outbox = Self::from_parts(pool, options)?;
        if outbox.options().get_migrate() {
            outbox.migrate().await?;
        } else {
            outbox.check_table().await?;
        }
        Ok(outbox)
    }

    /// Runs the outbox's embedded migrations not yet applied.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        crate::store::migrate_table(self.pool(), self.table(), DB::OUTBOX_MIGRATIONS, None).await
    }

    /// Fails with [`StoreError::OutboxTableMissing`] unless the table is there.
    async fn check_table(&self) -> Result<(), StoreError> {
        let t = self.table();
        let probe =
            sqlx::query(&format!("SELECT seq, ordering_key, not_before_ms FROM {t} WHERE 1 = 0"))
                .execute(self.pool())
                .await;
        match probe {
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(_)) => {
                Err(StoreError::OutboxTableMissing { table: t.to_owned() })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes `message` to `destination` as a row of `tx`, the caller's own transaction:
    /// it is sent once `tx` commits, and never if it rolls back. Returns its id (its own, or
    /// a new random one, kept in the row). Call [`SqlxOutbox::commit`], or
    /// [`SqlxOutbox::wake`] after your commit, to have a relay in this process send it at
    /// once.
    ///
    /// Each call's message has an ordering key of its own; to send several in order, or with
    /// ids derived from a key of yours, use [`SqlxOutbox::write`].
    ///
    /// # Errors
    ///
    /// [`StoreError::Outgoing`] for a destination or field out of range; a database error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: cut off, `tx` is in an unknown state; dropping it rolls back.
    pub async fn send(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        destination: &str,
        message: Message,
    ) -> Result<MessageId, StoreError> {
        let writer = self.writer();
        let id = writer.push(destination, message)?;
        self.write(tx, &writer).await?;
        Ok(id)
    }

    /// Writes the messages `outgoing` holds ([`SqlxOutbox::writer`],
    /// [`SqlxOutbox::writer_for`]) as rows of `tx`, in order; `outgoing` is left empty.
    ///
    /// # Errors
    ///
    /// A database error.
    ///
    /// # Cancel safety
    ///
    /// As [`SqlxOutbox::send`].
    pub async fn write(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        outgoing: &Outgoing,
    ) -> Result<usize, StoreError> {
        let rows = outgoing.take();
        write_rows::<DB>(&mut **tx, self.table(), &rows, None).await?;
        Ok(rows.len())
    }

    /// Commits `tx` and wakes a relay of this outbox in this process.
    ///
    /// # Errors
    ///
    /// The commit's error.
    pub async fn commit(&self, tx: sqlx::Transaction<'_, DB>) -> Result<(), StoreError> {
        tx.commit().await?;
        self.wake();
        Ok(())
    }

    /// The rows in `state` (every row with `None`), oldest first, at most `limit`.
    ///
    /// # Errors
    ///
    /// A database error, or [`StoreError::BadOutboxRow`] for a row whose headers do not parse.
    pub async fn list(
        &self,
        state: Option<RowState>,
        limit: u32,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let t = self.table();
        let filter = state.map_or(String::new(), |s| format!("WHERE state = {}", s.code()));
        let rows: Vec<Listed> = sqlx::query_as(&format!(
            "SELECT seq, state, destination, message_id, ordering_key, created_at_ms, attempts, \
             last_error, headers, body FROM {t} {filter} ORDER BY seq LIMIT {limit}"
        ))
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|(seq, state, destination, id, key, created, attempts, error, headers, body)| {
                Ok(OutboxRow {
                    seq,
                    state: RowState::from_code(state),
                    destination,
                    message_id: MessageId::new(id.clone()),
                    ordering_key: key,
                    created_at: Timestamp::from_millis(created),
                    attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
                    last_error: error,
                    message: message_of(&id, &headers, body)?,
                })
            })
            .collect()
    }

    /// Makes parked rows (those in `seqs`, or all with `None`) pending again, their attempts
    /// reset, and wakes a relay; returns how many.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn retry_parked(&self, seqs: Option<&[i64]>) -> Result<u64, StoreError> {
        let (filter, binds) = seq_filter::<DB>(seqs, 1);
        let sql = format!(
            "UPDATE {} SET state = 0, attempts = 0, not_before_ms = 0, lease_owner = NULL, \
             lease_until_ms = NULL, done_at_ms = NULL WHERE state = 2{filter}",
            self.table()
        );
        let n = execute::<DB>(self.pool(), &sql, &binds).await?;
        if n > 0 {
            self.wake();
        }
        Ok(n)
    }

    /// Deletes parked rows (those in `seqs`, or all with `None`); returns how many.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn discard_parked(&self, seqs: Option<&[i64]>) -> Result<u64, StoreError> {
        let (filter, binds) = seq_filter::<DB>(seqs, 1);
        let sql = format!("DELETE FROM {} WHERE state = 2{filter}", self.table());
        execute::<DB>(self.pool(), &sql, &binds).await
    }

    /// Leases rows for a relay; see the [module docs](super).
    async fn lease_rows(
        &self,
        owner: &str,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<LeasedMessage>, StoreError> {
        let t = self.table();
        let now = DB::DB_NOW_MS;
        let mut tx = begin_detached(self.pool(), Some(DB::LEASE_BEGIN.to_owned())).await?;
        let candidates: Vec<Candidate> = sqlx::query_as(&format!(
            "SELECT seq, ordering_key, destination, message_id, headers, body, created_at_ms, attempts \
             FROM {t} WHERE state = 0 AND not_before_ms <= {now} \
             AND (lease_until_ms IS NULL OR lease_until_ms < {now}) \
             ORDER BY seq LIMIT {max}{}",
            DB::SKIP_LOCKED
        ))
        .fetch_all(&mut *tx)
        .await?;
        let Some(last) = candidates.last().map(|c| c.0) else {
            tx.commit().await?;
            return Ok(Vec::new());
        };
        // A candidate goes out only if no pending row of its key comes before it outside the
        // batch: one leased by another relay, locked by another lease under way, or waiting
        // out a backoff.
        let (sql, keys) = pending_of_keys::<DB>(t, candidates.iter().map(|c| c.1.as_str()));
        let mut query = sqlx::query_as::<_, Pending>(&sql).bind(last);
        for key in keys {
            query = query.bind(key);
        }
        let pending = query.fetch_all(&mut *tx).await?;
        let offered: HashSet<i64> = candidates.iter().map(|c| c.0).collect();
        let taken = in_order(pending.into_iter().map(|(seq, key, _)| {
            let goes = offered.contains(&seq);
            (seq, key, goes)
        }));
        let mut leased = Vec::new();
        let mut unreadable = Vec::new();
        for (seq, key, destination, id, headers, body, created, attempts) in candidates {
            if !taken.contains(&seq) {
                continue;
            }
            match message_of(&id, &headers, body) {
                Ok(message) => leased.push(LeasedMessage::new(
                    seq,
                    destination,
                    message,
                    key,
                    Timestamp::from_millis(created),
                    u32::try_from(attempts).unwrap_or(u32::MAX),
                )),
                Err(e) => unreadable.push((seq, e.to_string())),
            }
        }
        if !leased.is_empty() {
            let sql = format!(
                "UPDATE {t} SET lease_owner = {}, lease_until_ms = {now} + {} WHERE seq IN ({})",
                DB::param(1),
                DB::param(2),
                params::<DB>(3, leased.len())
            );
            let mut query = sqlx::query(&sql).bind(owner.to_owned()).bind(millis(lease));
            for row in &leased {
                query = query.bind(row.seq);
            }
            query.execute(&mut *tx).await?;
        }
        for (seq, error) in unreadable {
            // A row whose headers do not parse can never be sent.
            tracing::warn!(seq, "an outbox row's headers do not parse; it is parked: {error}");
            let sql = format!(
                "UPDATE {t} SET state = 2, last_error = {}, done_at_ms = {now} WHERE seq = {}",
                DB::param(1),
                DB::param(2)
            );
            sqlx::query(&sql).bind(clip(&error)).bind(seq).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(leased)
    }
}

/// An unsent row of an ordering key: seq, ordering key, lease owner.
type Pending = (i64, String, Option<String>);

/// The read of the unsent rows of `keys` up to a `seq` (parameter 1, then the keys), in order
/// of `seq`, and the distinct keys to bind.
fn pending_of_keys<'k, DB: OutboxDialect>(
    table: &str,
    keys: impl Iterator<Item = &'k str>,
) -> (String, Vec<String>) {
    let mut keys: Vec<String> = keys.map(str::to_owned).collect();
    keys.sort_unstable();
    keys.dedup();
    let sql = format!(
        "SELECT seq, ordering_key, lease_owner FROM {table} WHERE state = 0 AND seq <= {} \
         AND ordering_key IN ({}) ORDER BY seq",
        DB::param(1),
        params::<DB>(2, keys.len())
    );
    (sql, keys)
}

/// The rows that may go out, in order per key: walking the unsent rows by `seq`, each
/// `(seq, key, goes)`, a key's rows are taken until the first that does not go, which holds
/// back the rest of its key.
fn in_order(pending: impl IntoIterator<Item = (i64, String, bool)>) -> HashSet<i64> {
    let mut blocked: HashSet<String> = HashSet::new();
    let mut taken: HashSet<i64> = HashSet::new();
    for (seq, key, goes) in pending {
        if blocked.contains(&key) {
            continue;
        }
        if goes {
            taken.insert(seq);
        } else {
            blocked.insert(key);
        }
    }
    taken
}

/// ` AND seq IN (...)` for `seqs` from parameter `from`, and the values to bind.
fn seq_filter<DB: OutboxDialect>(seqs: Option<&[i64]>, from: usize) -> (String, Vec<i64>) {
    match seqs {
        None => (String::new(), Vec::new()),
        Some([]) => (" AND 1 = 0".to_owned(), Vec::new()),
        Some(seqs) => (format!(" AND seq IN ({})", params::<DB>(from, seqs.len())), seqs.to_vec()),
    }
}

/// Runs `sql` with `binds` on the pool; returns the rows it changed.
async fn execute<DB: OutboxDialect>(
    pool: &Pool<DB>,
    sql: &str,
    binds: &[i64],
) -> Result<u64, StoreError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB>,
{
    let mut query = sqlx::query(sql);
    for b in binds {
        query = query.bind(*b);
    }
    let mut conn = pool.acquire().await?;
    Ok(DB::rows_affected(&query.execute(&mut *conn).await?))
}

/// Inserts `rows` into `table` on `conn` (inside the caller's transaction), in order; with
/// `lease` (a relay's owner name and lease duration), leased to that relay, and returns the
/// rows' `seq`s (empty without).
pub(crate) async fn write_rows<DB: OutboxDialect>(
    conn: &mut DB::Connection,
    table: &str,
    rows: &[OutgoingMessage],
    lease: Option<(&str, Duration)>,
) -> Result<Vec<i64>, StoreError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB>,
    Vec<u8>: Type<DB> + for<'q> Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
{
    let mut seqs = Vec::new();
    for chunk in rows.chunks(INSERT_CHUNK) {
        let sql = insert_sql::<DB>(table, chunk.len(), lease.is_some());
        let mut query = sqlx::query(&sql);
        for row in chunk {
            let id = row.message.message_id.as_ref().map(|id| id.as_str().to_owned());
            query = query
                .bind(row.ordering_key.clone())
                .bind(row.destination.clone())
                .bind(id.unwrap_or_default())
                .bind(headers_of(&row.message)?)
                .bind(row.message.body.to_vec())
                .bind(row.created_at.as_millis());
            if let Some((owner, duration)) = lease {
                query = query.bind(owner.to_owned()).bind(millis(duration));
            }
        }
        if lease.is_some() {
            let returned = query.fetch_all(&mut *conn).await?;
            let mut chunk_seqs = returned
                .iter()
                .map(|row| sqlx::Row::try_get::<i64, _>(row, 0usize))
                .collect::<Result<Vec<_>, _>>()?;
            // Numbered in the order of the VALUES; RETURNING may list them in any order.
            chunk_seqs.sort_unstable();
            seqs.extend(chunk_seqs);
        } else {
            query.execute(&mut *conn).await?;
        }
    }
    Ok(seqs)
}

impl<DB: OutboxDialect> OutboxStore for SqlxOutbox<DB>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    i64: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    Vec<u8>: Type<DB> + for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    type Error = StoreError;

    fn waker(&self) -> &Wake {
        &self.inner.wake
    }

    async fn lease<'a>(
        &'a self,
        owner: &'a str,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<LeasedMessage>, StoreError> {
        self.lease_rows(owner, max, lease).await
    }

    async fn adopt<'a>(
        &'a self,
        owner: &'a str,
        mut rows: Vec<LeasedMessage>,
    ) -> Result<Vec<LeasedMessage>, StoreError> {
        let Some(last) = rows.iter().map(|r| r.seq).max() else {
            return Ok(rows);
        };
        rows.sort_unstable_by_key(|r| r.seq);
        // As a lease does: a row goes out only if every unsent row of its key before it is
        // among these and still leased to `owner`.
        let (sql, keys) =
            pending_of_keys::<DB>(self.table(), rows.iter().map(|r| r.ordering_key.as_str()));
        let mut query = sqlx::query_as::<_, Pending>(&sql).bind(last);
        for key in keys {
            query = query.bind(key);
        }
        let pending = query.fetch_all(self.pool()).await?;
        let offered: HashSet<i64> = rows.iter().map(|r| r.seq).collect();
        let taken = in_order(pending.into_iter().map(|(seq, key, lease_owner)| {
            let goes = offered.contains(&seq) && lease_owner.as_deref() == Some(owner);
            (seq, key, goes)
        }));
        let (ready, held): (Vec<LeasedMessage>, Vec<LeasedMessage>) =
            rows.into_iter().partition(|r| taken.contains(&r.seq));
        if !held.is_empty() {
            let seqs: Vec<i64> = held.iter().map(|r| r.seq).collect();
            self.release(owner, &seqs).await?;
        }
        Ok(ready)
    }

    async fn sent<'a>(&'a self, owner: &'a str, seqs: &'a [i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let t = self.table();
        let mut conn = self.pool().acquire().await?;
        let mut done = 0;
        for chunk in seqs.chunks(MARK_CHUNK) {
            // Lists padded to a power of two (the last seq repeated), so that a connection
            // prepares a few statements rather than one per length.
            let len = chunk.len().next_power_of_two();
            let list = params::<DB>(2, len);
            let sql = match self.options().get_sent_retention() {
                None => format!(
                    "DELETE FROM {t} WHERE lease_owner = {} AND state = 0 AND seq IN ({list})",
                    DB::param(1)
                ),
                Some(_) => format!(
                    "UPDATE {t} SET state = 1, done_at_ms = {}, lease_owner = NULL, \
                     lease_until_ms = NULL WHERE lease_owner = {} AND state = 0 AND seq IN ({list})",
                    DB::DB_NOW_MS,
                    DB::param(1)
                ),
            };
            let mut query = sqlx::query(&sql).bind(owner.to_owned());
            for i in 0..len {
                query = query.bind(chunk[i.min(chunk.len() - 1)]);
            }
            done += DB::rows_affected(&query.execute(&mut *conn).await?);
        }
        Ok(done)
    }

    async fn retry_later<'a>(
        &'a self,
        owner: &'a str,
        seq: i64,
        delay: Duration,
        error: &'a str,
        counted: bool,
    ) -> Result<(), StoreError> {
        let t = self.table();
        // Parameters are numbered in the order they appear: MariaDB's are positional.
        let (counting, next) = if counted {
            (format!(", attempts = attempts + 1, last_error = {}", DB::param(2)), 3)
        } else {
            (String::new(), 2)
        };
        let sql = format!(
            "UPDATE {t} SET lease_owner = NULL, lease_until_ms = NULL, \
             not_before_ms = {} + {}{counting} WHERE seq = {} AND lease_owner = {} AND state = 0",
            DB::DB_NOW_MS,
            DB::param(1),
            DB::param(next),
            DB::param(next + 1)
        );
        let mut query = sqlx::query(&sql).bind(millis(delay));
        if counted {
            query = query.bind(clip(error));
        }
        let query = query.bind(seq).bind(owner.to_owned());
        let mut conn = self.pool().acquire().await?;
        query.execute(&mut *conn).await?;
        Ok(())
    }

    async fn release<'a>(&'a self, owner: &'a str, seqs: &'a [i64]) -> Result<(), StoreError> {
        if seqs.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "UPDATE {} SET lease_owner = NULL, lease_until_ms = NULL \
             WHERE lease_owner = {} AND state = 0 AND seq IN ({})",
            self.table(),
            DB::param(1),
            params::<DB>(2, seqs.len())
        );
        let mut query = sqlx::query(&sql).bind(owner.to_owned());
        for seq in seqs {
            query = query.bind(*seq);
        }
        let mut conn = self.pool().acquire().await?;
        query.execute(&mut *conn).await?;
        Ok(())
    }

    async fn park<'a>(
        &'a self,
        owner: &'a str,
        seq: i64,
        reason: &'a str,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE {} SET state = 2, last_error = {}, attempts = attempts + 1, done_at_ms = {}, \
             lease_owner = NULL, lease_until_ms = NULL \
             WHERE seq = {} AND lease_owner = {} AND state = 0",
            self.table(),
            DB::param(1),
            DB::DB_NOW_MS,
            DB::param(2),
            DB::param(3)
        );
        let mut conn = self.pool().acquire().await?;
        sqlx::query(&sql)
            .bind(clip(reason))
            .bind(seq)
            .bind(owner.to_owned())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let rows: Vec<(i64, i64, Option<i64>)> = sqlx::query_as(&format!(
            "SELECT state, COUNT(*), MIN(created_at_ms) FROM {} GROUP BY state",
            self.table()
        ))
        .fetch_all(self.pool())
        .await?;
        let mut stats = OutboxStats::default();
        for (state, count, oldest) in rows {
            let count = u64::try_from(count).unwrap_or(0);
            match RowState::from_code(state) {
                RowState::Pending => {
                    stats.pending = count;
                    stats.oldest_pending = oldest.map(Timestamp::from_millis);
                }
                RowState::Sent => stats.sent = count,
                RowState::Parked => stats.parked = count,
            }
        }
        Ok(stats)
    }

    async fn purge_sent(&self) -> Result<u64, StoreError> {
        let Some(retention) = self.options().get_sent_retention() else { return Ok(0) };
        let n = self.options().get_purge_batch_size();
        let before = format!("{} - {}", DB::DB_NOW_MS, millis(retention));
        let sql = DB::PURGE_SENT
            .replace("{t}", self.table())
            .replace("{before}", &before)
            .replace("{n}", &n.to_string());
        let mut total = 0;
        loop {
            let deleted = execute::<DB>(self.pool(), &sql, &[]).await?;
            total += deleted;
            if deleted < u64::from(n) {
                return Ok(total);
            }
        }
    }
}
