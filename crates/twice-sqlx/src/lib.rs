//! Inbox stores for twice on sqlx: SQLite, PostgreSQL and MariaDB/MySQL, each behind a feature
//! (`sqlite`, `postgres`, `mysql`).
//!
//! [`SqlxInbox<DB>`] implements [`twice::Inbox`] with `Tx = sqlx::Transaction<'static, DB>`:
//! the processor begins a transaction on a connection of its own from the pool, claims
//! `(consumer, message id)` in it as the first statement, and hands the handler
//! `&mut Transaction` so the handler's queries join the claim. Dropping the transaction (a
//! cancelled or panicking handler) rolls it back.
//!
//! # The inbox table
//!
//! One table per inbox (name set with [`InboxOptions::table`], default `twice_inbox`):
//!
//! | column            | meaning                                                        |
//! |-------------------|----------------------------------------------------------------|
//! | `consumer`        | the processor's consumer name, by default its transport's claim scope (topic subscriptions share ids) |
//! | `message_id`      | the message id                                                 |
//! | `processed_at_ms` | when the claim was made (the processor's clock), ms since the Unix epoch |
//! | `purge_after_ms`  | when the row may be purged (the database's clock), indexed; NULL: never |
//! | `state`           | dedup-only records: 0 claimed (work under way), 1 done; claims are 1 |
//! | `owner`           | dedup-only records: the token of the attempt that made the record |
//!
//! The primary key is `(consumer, message_id)`. Migrations are embedded and run by
//! `SqlxInbox::new` unless [`InboxOptions::migrate`] is off; applied versions are recorded in
//! `<table>_migrations`.
//!
//! # The claim, per store
//!
//! | store      | claim statement                                     | a concurrent copy ...                                   |
//! |------------|-----------------------------------------------------|---------------------------------------------------------|
//! | PostgreSQL | `INSERT .. ON CONFLICT (consumer, message_id) DO NOTHING`, row count | waits on the key until the holder ends; then 0 rows (it committed) or 1 (it rolled back) |
//! | MariaDB    | `INSERT IGNORE ..`, affected rows                   | waits on the key's record lock (any isolation level), same outcome |
//! | SQLite     | `BEGIN IMMEDIATE`, then `INSERT .. ON CONFLICT DO NOTHING` | waits for the write lock at `BEGIN IMMEDIATE` (writers are serialised), up to the busy timeout |
//!
//! No claim raises an error on a duplicate, so the transaction is never poisoned (PostgreSQL
//! aborts a transaction after a unique violation; catching 23505 and carrying on would make the
//! commit fail). On a duplicate the store reads the winner's `processed_at_ms` to tell a
//! concurrent copy from an old one.
//!
//! MariaDB notes. `INSERT IGNORE` turns more than duplicates into warnings (a value too long
//! would be truncated, not refused), so ids and consumer names are checked against their
//! length (255 characters) before the claim. The key columns are binary strings
//! (`VARBINARY(1020)`, migration 2): with the default case-insensitive collation `ABC` and
//! `abc` would be one id, and with `utf8mb4_bin`, a PAD SPACE collation, `m` and `m `. When
//! three or more copies wait on one key and the holder rolls back, InnoDB picks waiters as
//! deadlock victims (error 1213; see the edge cases below). `REPEATABLE READ` (the default)
//! and `READ COMMITTED` behave the same for the claim: the wait is on a record lock, not on a
//! snapshot, and the winner's time is read with a locking read.
//!
//! SQLite notes. Use WAL and a busy timeout (see [`sqlite::connect_options`]); every inbox
//! transaction is a write transaction, so one runs at a time and a second copy waits at
//! `BEGIN IMMEDIATE` until the first ends.
//!
//! # Rules at the edges, per store
//!
//! - **Aborted transactions.** Before committing a handler's `Complete`, the store checks
//!   that the transaction can still commit ([`twice::Inbox::check_committable`]): PostgreSQL
//!   runs `SELECT 1`, which fails with SQLSTATE 25P02 in an aborted transaction (one round
//!   trip without table access; a savepoint around the handler would cost two, and sqlx does
//!   not show the COMMIT's `ROLLBACK` tag); MariaDB reads `@@in_transaction` (MySQL: whether
//!   InnoDB lists a transaction for the connection), which is 0 after a deadlock victim's
//!   rollback. SQLite needs no check: its COMMIT fails when the transaction is gone. A failed
//!   check is [`StoreError::TransactionAborted`], a handler error.
//! - **Isolation level.** PostgreSQL inbox transactions begin with `BEGIN ISOLATION LEVEL READ
//!   COMMITTED`, whatever the session's default (`default_transaction_isolation`, `SET SESSION
//!   CHARACTERISTICS`): at REPEATABLE READ or SERIALIZABLE a claim that waited for a concurrent
//!   claim which then committed would fail with a serialization failure (40001) instead of
//!   finding a duplicate, because the committed row is outside its snapshot. The handler's work
//!   runs at READ COMMITTED too; a handler that needs more locks explicitly (`SELECT .. FOR
//!   UPDATE`). MariaDB's claim behaves the same at every level (a record lock and a locking
//!   read), so its transactions keep the session's level.
//! - **Lock waits bounded by the message lock.** The processor begins each message's
//!   transaction with [`twice::Inbox::begin_within`] and the time left on the message's lock:
//!   PostgreSQL sets `SET LOCAL lock_timeout` to it (milliseconds, in the `BEGIN`'s round trip),
//!   MariaDB `SET SESSION innodb_lock_wait_timeout` (whole seconds, rounded down, at least 1;
//!   the value stays on the pooled connection). A copy whose claim waits on another copy's
//!   uncommitted claim, or whose handler waits on a row lock, stops waiting when its lock runs
//!   out (PostgreSQL 55P03, MariaDB 1205, both transient), rolls back, and frees its connection
//!   and its concurrent call: without the bound the wait, and the connection, lasted until the
//!   other copy ended, whatever became of this copy's lock. With lock renewal on, a wait that
//!   outlasts the lock as it stood at the begin is retried in process with the renewed lock.
//!   SQLite waits at `BEGIN IMMEDIATE`, which is already given up when the lock is lost.
//! - **Cancelled begins.** `begin` runs in a task of its own on every store, so a caller that
//!   gives up midway never leaves a transaction open on a pooled connection.
//! - **Transient errors.** [`twice::Inbox::classify`] calls transient: PostgreSQL SQLSTATE
//!   classes 40 (serialization failure, deadlock), 08 (connection), 53 (resources), 57P
//!   (shutdown) and 58 (system, I/O), 55P03 (lock not available), 25006 (a read-only
//!   transaction: a primary demoted in a failover, a hot standby) and 25P03 (idle in
//!   transaction too long); MariaDB 1205 (lock wait timeout), 1213 (deadlock), 1317
//!   (interrupted), 1020 (a write conflict under `innodb_snapshot_isolation`), 1040 (too many
//!   connections), 1053 (shutdown), 1180 (error during commit), 1290 (`--read-only`), 1637
//!   (too many transactions), 1792 (a read-only transaction), 1836 (read-only mode), 1927
//!   (connection killed) and 4031 (idle timeout); SQLite by primary code 5 and 6 (busy,
//!   locked), 8 (read-only), 10 (I/O), 13 (full) and 15 (lock protocol); and on every store
//!   I/O errors, pool timeouts and lost connections. The processor retries those in process.
//!   It retries any failed claim in process whatever its class, since the claim is its own
//!   insert; the classification matters there only for an error the store calls permanent,
//!   [`StoreError::KeyTooLong`] (an id longer than the key), which abandons the message.
//! - **Dedup-only records.** `record` inserts `(consumer, message_id)` with state 0 and the
//!   attempt's owner token and commits at once; a conflicting row is read back: done → a
//!   duplicate, claimed by the same owner → claimed, by another → in progress. `finish` is an
//!   `UPDATE .. SET state = 1 WHERE .. AND owner = ? AND state = 0` inside the handler's
//!   transaction; `forget` a `DELETE .. WHERE .. AND owner = ? AND state = 0`. Tables made
//!   before these columns gain them by migration (PostgreSQL and SQLite 2, MariaDB 3), their
//!   rows done.
//! - **Foreign-key violations** (PostgreSQL 23503, MariaDB 1451/1452, SQLite 787) are
//!   unclassified on every store: the handler retry policy, then the broker's MaxDeliveryCount.
//!   The row a handler refers to often comes with a later message, so a retry may pass. Other
//!   integrity violations and data errors (PostgreSQL classes 22 and 23, MariaDB 1048, 1264,
//!   1292, 1406, 4025, SQLite NOT NULL and CHECK) are permanent: dead-lettered at once.
//! - **Pool size.** The processor refuses to start when the pool has fewer connections than
//!   MaxConcurrentCalls ([`twice::Inbox::max_connections`]).
//! - **Round trips per message.** A message handled alone costs PostgreSQL six round trips
//!   through a default sqlx pool: the pool's ping of the connection it hands out
//!   (`test_before_acquire`, on by default), `BEGIN` (with `SET LOCAL lock_timeout` in the same
//!   round trip), the claim, the check that the transaction can still commit (`SELECT 1`; an
//!   outbox insert takes its place), `COMMIT`, and the ping sqlx sends when the connection goes
//!   back to the pool. `PoolOptions::test_before_acquire(false)` saves the first: a connection
//!   that broke while idle then fails its `BEGIN` instead, which the processor retries without
//!   spending a delivery (the pool drops the broken connection). Batches
//!   ([`twice::ProcessorOptions::batch_size`]) pay these once per batch.
//! - **Three or more copies at once (MariaDB).** While the first copy holds its uncommitted
//!   claim, the others wait on the key's record lock. If the first commits, each waiter's
//!   `INSERT IGNORE` finds the row and completes as a concurrent duplicate. If it rolls back,
//!   every waiter holds a shared lock on the key and wants the exclusive one: InnoDB ends the
//!   deadlock by rolling back all waiters but one (error 1213, transient). The one left makes
//!   the claim and does the work; each victim is retried in process after the infrastructure
//!   backoff (on the processor's clock), with no delivery spent, and its new claim waits for
//!   the winner and completes as a duplicate. A waiter whose lock wait runs out first gets
//!   1205, also transient, with the same outcome. Nothing is dead-lettered and the work is done
//!   once. PostgreSQL queues the waiters on the holder's transaction and SQLite at `BEGIN
//!   IMMEDIATE`: neither deadlocks.
//! - **Business keys are a table and a key.** [`InboxOptions::business_key`] takes both; a
//!   violation is a business-key duplicate only when it is that key of that table, so a key of
//!   the same name on another table (PostgreSQL: the same table name in another schema) is an
//!   ordinary, unclassified error: retried, never completed without its work. A pair that is
//!   not a unique key of the table is refused at start ([`StoreError::BusinessKeyNotFound`]).
//! - **Ambiguous key names (MariaDB/MySQL).** MariaDB's duplicate-key error names the key but
//!   not its table, so `SqlxInbox::new` refuses, with [`StoreError::AmbiguousBusinessKey`] and
//!   the tables' names, a business key whose name unique keys of two or more tables in the
//!   current database share: the match would not be exact. Rename one key. See [Business
//!   keys](#business-keys) for what each store's error carries.
//!
//! # Key order
//!
//! The key is the sender's message id, so its order is the sender's choice. PostgreSQL and
//! MariaDB keep the key in a B-tree (MariaDB clusters the whole row by it): random ids (Service
//! Bus assigns random ones when the sender sets none) insert at random places, which on a table
//! larger than memory costs page reads and full-page WAL images. Senders that can should use
//! time-ordered ids ([`twice::MessageId::time_ordered`], a version 7 UUID) so that claims append
//! at the end of the index. SQLite's table is `WITHOUT ROWID`, one B-tree on the key, which avoids
//! a second tree for the rowid. The repository's `BENCHMARKS.md` has the measurements.
//!
//! # Business keys
//!
//! Register the unique constraint (or unique index) that guards a business key, with its
//! table, with [`InboxOptions::business_key`]. When a handler's `?` raises its violation, the
//! processor rolls back and completes the message, counted as a duplicate by business key.
//! Detection uses the error code (PostgreSQL SQLSTATE `23505`, MariaDB/MySQL error 1062,
//! SQLite extended code 2067 or 1555) and then which key of which table was violated, so a key
//! of the same name on another table is never taken for a registered one. `SqlxInbox::new`
//! resolves each key when the store is created and refuses, with
//! [`StoreError::BusinessKeyNotFound`], a table that has no unique key of that name:
//!
//! - PostgreSQL reports schema, table and constraint in fields of their own; the registered
//!   table (`schema.table`, or a name found on the `search_path`) is resolved to its schema at
//!   start, and all three must match.
//! - SQLite reports only the index's `table.column` list, inside the error's text; the list is
//!   read from the schema at start and matched against that text.
//! - MariaDB reports only the key's name, inside the error's text (`Duplicate entry '42' for
//!   key 'uq_order'`; MySQL 8 writes `'shipments.uq_order'`). So at start the key's name is
//!   looked up in `information_schema.STATISTICS` of the current database, and a name that
//!   another table's unique key shares is refused with [`StoreError::AmbiguousBusinessKey`]:
//!   rename one of the keys. A same-named key added to another table after the start, or one
//!   in another database written by the handler, is not seen.
//!
//! Such a message is completed without its work, so each one is logged at warn level with the
//! constraint, and `twice::Processor::on_business_key_duplicate` reports it to the
//! application (count them and alert: a handler bug that writes a constant key turns every
//! later message into one). A constraint checked at COMMIT (PostgreSQL `DEFERRABLE INITIALLY
//! DEFERRED`) is classified the same way, reported with `at_commit`.
//!
//! # Retention
//!
//! Every row carries its own end of retention, `purge_after_ms`: the database's clock when the
//! row is made plus the [`InboxOptions::retention`] (default 7 days; `None`: kept forever) of
//! the instance that made it. So consumers sharing a table each keep their own retention
//! whichever instance purges, and application clocks that drift change nothing. [`Purge::purge`]
//! or [`run_purger`] delete rows whose `purge_after_ms` is before the database's clock, in
//! bounded batches along its index; one purger at a time across instances (PostgreSQL: an
//! advisory lock; MariaDB: `GET_LOCK`; SQLite: the write lock). Rows made before the column
//! existed get the migrating instance's retention from their claim time.
//!
//! Choose a retention of at least `max(message time to live, duplicate-detection window,
//! LockDuration × MaxDeliveryCount + MaxAutoLockRenewalDuration)` for the entity
//! ([`twice::redelivery_horizon`]; the processor refuses to start with less): a copy that comes
//! back after its id was purged would be processed again. With an unlimited time to live, also
//! cover the longest backlog an abandoned message may wait in.
//!
//! # Example
//!
//! The seed's shipping handler, end to end: an `OrderPlaced` message sent twice (a sender-side
//! duplicate with the same message id) through the embedded broker, one shipment in SQLite.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use twice::{json_fn, Context, Message, Outcome, Processor, ProcessorOptions};
//! use twice_broker::{config::QueueProperties, Broker, BrokerOptions};
//! use twice_sqlx::{InboxOptions, SqlxInbox};
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced {
//!     order_id: i64,
//! }
//!
//! // The database: the shop's own table, and the inbox next to it.
//! let dir = tempfile::tempdir()?;
//! let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(
//!     dir.path().join("shop.db"),
//! ))
//! .await?;
//! sqlx::query("CREATE TABLE shipments (order_id INTEGER NOT NULL)").execute(&pool).await?;
//! sqlx::query("CREATE UNIQUE INDEX shipments_order_id ON shipments (order_id)")
//!     .execute(&pool)
//!     .await?;
//! let inbox = SqlxInbox::new(
//!     pool.clone(),
//!     InboxOptions::new().business_key("shipments", "shipments_order_id"),
//! )
//! .await?;
//!
//! // The handler: its insert joins the transaction that claimed the message.
//! let handler = json_fn(
//!     |ctx: Context<'_>, order: OrderPlaced, tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>| {
//!         Box::pin(async move {
//!             let _payment_key = ctx.idempotency_key("charge"); // for a payment API
//!             sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
//!                 .bind(order.order_id)
//!                 .execute(&mut **tx)
//!                 .await?;
//!             Ok(Outcome::Complete)
//!         })
//!     },
//! );
//!
//! // The broker: one queue, and the same message sent twice.
//! let broker = Broker::open(BrokerOptions::in_memory()).await?;
//! broker.create_queue("orders", QueueProperties::default()).await?;
//! for _ in 0..2 {
//!     let order = Message::new(r#"{"order_id":42}"#).with_message_id("order-42-placed");
//!     broker.send("orders", order).await?;
//! }
//!
//! // Run until both copies are settled.
//! let processor = Processor::new(
//!     broker.receiver("orders").await?,
//!     inbox,
//!     handler,
//!     ProcessorOptions::new().consumer("shipping").max_concurrent_calls(2),
//! );
//! let counters = processor.counters();
//! let settled = {
//!     let counters = counters.clone();
//!     async move {
//!         while counters.snapshot().completed < 2 {
//!             tokio::task::yield_now().await;
//!         }
//!     }
//! };
//! processor.run(settled).await?;
//!
//! let shipped: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM shipments").fetch_one(&pool).await?;
//! assert_eq!(shipped, 1);
//! let c = counters.snapshot();
//! assert_eq!(c.duplicates_already_processed + c.duplicates_concurrent_copy, 1);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```

// The SQLite module exists only with its feature; without it, the crate docs' link to its
// connection options goes to the published docs instead of an item that is not built.
#![cfg_attr(
    not(feature = "sqlite"),
    doc = "[`sqlite::connect_options`]: \
           https://docs.rs/twice-sqlx/latest/twice_sqlx/sqlite/fn.connect_options.html"
)]
// Without a store feature the shared helpers have no caller; the crate is useless then, but it
// must still build warning-free.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool};
use twice::{MessageId, SharedClock, Timestamp};

#[cfg(feature = "mysql")]
pub mod mysql;
pub mod outbox;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
mod store;

pub use outbox::{OutboxOptions, OutboxRow, RowState, SqlxOutbox};

/// The longest consumer name or message id the MariaDB/MySQL store accepts (its column length);
/// the other stores accept the same, so a consumer can move between stores.
pub const MAX_KEY_CHARS: usize = 255;

/// An error from an inbox store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The table name is not a plain identifier.
    #[error(
        "invalid inbox table name {0:?}: use 1 to 48 ASCII letters, digits and underscores, not \
         starting with a digit"
    )]
    InvalidTableName(String),
    /// A consumer name or message id is longer than [`MAX_KEY_CHARS`].
    #[error("{what} is {len} characters long; the inbox key allows at most {MAX_KEY_CHARS}")]
    KeyTooLong {
        /// `consumer` or `message id`.
        what: &'static str,
        /// Its length in characters.
        len: usize,
    },
    /// A registered business key names no unique key (or unique index) of its table.
    #[error("business key {key:?} is not a unique key of table {table:?}")]
    BusinessKeyNotFound {
        /// The registered table.
        table: String,
        /// The registered key name.
        key: String,
    },
    /// A registered business key's name is shared by unique keys of several tables in the
    /// database, and the store's errors name only the key (MariaDB), so a violation could not
    /// be matched to its table.
    #[error(
        "business key {key:?} is ambiguous: tables {tables:?} each have a unique key of that \
         name, and the database's errors name only the key; rename one"
    )]
    AmbiguousBusinessKey {
        /// The registered key name.
        key: String,
        /// The tables with a unique key of that name.
        tables: Vec<String>,
    },
    /// The database aborted or ended the transaction before its commit (on PostgreSQL after
    /// any failed statement; on MariaDB when it chose the transaction as a deadlock victim),
    /// so committing it would keep none of the handler's work.
    #[error(
        "the database aborted the transaction before its commit (a statement in it failed, or \
         it was a deadlock victim); none of the handler's work would be kept"
    )]
    TransactionAborted,
    /// The outbox table is not there, and migrations were off.
    #[error(
        "the outbox table {table:?} does not exist: run the outbox's migration 1 \
         (SqlxOutbox::new with OutboxOptions::migrate(true), the default, or SqlxOutbox::migrate), \
         which creates it and records version 1 in {table}_migrations"
    )]
    OutboxTableMissing {
        /// The table name.
        table: String,
    },
    /// An outbox row cannot be read or written as a message.
    #[error("an outbox row is not a valid message: {0}")]
    BadOutboxRow(String),
    /// An outgoing message was refused before it reached the table.
    #[error(transparent)]
    Outgoing(#[from] twice::OutboxError),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Options of an inbox store.
#[derive(Clone, Debug)]
pub struct InboxOptions {
    table: String,
    retention: Option<Duration>,
    migrate: bool,
    business_keys: Vec<BusinessKey>,
    purge_batch_size: u32,
}

/// A unique key (a unique constraint or unique index) of a table, registered as a business
/// key with [`InboxOptions::business_key`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusinessKey {
    table: String,
    key: String,
}

impl BusinessKey {
    /// The table, as the database resolves a name in a query (PostgreSQL: `schema.table`, or
    /// a table on the `search_path`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The unique constraint's or unique index's name.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Default for InboxOptions {
    fn default() -> Self {
        Self {
            table: "twice_inbox".to_owned(),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            migrate: true,
            business_keys: Vec::new(),
            purge_batch_size: 1000,
        }
    }
}

impl InboxOptions {
    /// The defaults: table `twice_inbox`, retention 7 days (the longest Service Bus
    /// duplicate-detection window), migrations on, no business keys, purge batches of 1000.
    pub fn new() -> Self {
        Self::default()
    }

    /// The inbox table name (a plain identifier).
    #[must_use]
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The inbox table name.
    pub fn get_table(&self) -> &str {
        &self.table
    }

    /// How long claimed ids are kept; `None` keeps them forever.
    #[must_use]
    pub fn retention(mut self, retention: Option<Duration>) -> Self {
        self.retention = retention;
        self
    }

    /// How long claimed ids are kept.
    pub fn get_retention(&self) -> Option<Duration> {
        self.retention
    }

    /// Whether `SqlxInbox::new` runs the embedded migrations (default on).
    #[must_use]
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether migrations run on start.
    pub fn get_migrate(&self) -> bool {
        self.migrate
    }

    /// Registers the unique constraint or unique index `key` of `table` as a business key:
    /// its violation means "already processed under another message id". A violation of a
    /// key of the same name on another table is not one. `SqlxInbox::new` checks that the
    /// table has a unique key of that name, and on MariaDB/MySQL that no other table of the
    /// database has one (its errors name only the key).
    #[must_use]
    pub fn business_key(mut self, table: impl Into<String>, key: impl Into<String>) -> Self {
        self.business_keys.push(BusinessKey { table: table.into(), key: key.into() });
        self
    }

    /// The registered business keys.
    pub fn get_business_keys(&self) -> &[BusinessKey] {
        &self.business_keys
    }

    /// How many rows one purge statement deletes at most (default 1000; at least 1).
    #[must_use]
    pub fn purge_batch_size(mut self, n: u32) -> Self {
        self.purge_batch_size = n.max(1);
        self
    }

    /// How many rows one purge statement deletes at most.
    pub fn get_purge_batch_size(&self) -> u32 {
        self.purge_batch_size
    }
}

/// An inbox on a sqlx pool; see the [crate docs](crate).
pub struct SqlxInbox<DB: Database> {
    pool: Pool<DB>,
    options: InboxOptions,
    /// Resolved business keys: (registered key, what the store's errors name besides the key:
    /// PostgreSQL the table's schema, SQLite the `table.column` list, MariaDB the table).
    business_keys: Vec<(BusinessKey, String)>,
    /// MySQL only: the server is MariaDB, which has `@@in_transaction`.
    mariadb: bool,
    /// Where a handler's `ctx.send` writes, if anywhere.
    outbox: Option<SqlxOutbox<DB>>,
}

impl<DB: Database> std::fmt::Debug for SqlxInbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxInbox")
            .field("database", &DB::NAME)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// A database twice has an inbox store for: `Postgres`, `MySql` or `Sqlite` (sealed: its
/// supertrait, the dialect, is private).
pub trait Backend: store::Dialect {
    /// Runs the migrations (unless turned off) and resolves the business keys.
    #[doc(hidden)]
    fn prepare(inbox: &mut SqlxInbox<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;
}

impl<DB: Backend> SqlxInbox<DB> {
    /// An inbox on `pool`; runs the embedded migrations unless [`InboxOptions::migrate`] is
    /// off.
    ///
    /// # Errors
    ///
    /// An invalid table name, a failed migration, a business key that is not a unique key of
    /// its table, or (MariaDB/MySQL) a business key whose name other tables' unique keys share.
    pub async fn new(pool: Pool<DB>, options: InboxOptions) -> Result<Self, StoreError> {
        validate_table(&options.table)?;
        let mut inbox =
            Self { pool, options, business_keys: Vec::new(), mariadb: false, outbox: None };
        DB::prepare(&mut inbox).await?;
        Ok(inbox)
    }
}

impl<DB: Database> SqlxInbox<DB> {
    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The options.
    pub fn options(&self) -> &InboxOptions {
        &self.options
    }

    /// This inbox with `outbox`: a handler's [`twice::Context::send`] (and `publish`,
    /// `schedule`) writes rows into it, in the transaction that claimed the message, and a
    /// relay of `outbox` in this process is woken when that transaction commits. The outbox
    /// should be on the same database as the inbox (its rows are written in the inbox's
    /// transactions): its pool is not used for them.
    #[must_use]
    pub fn with_outbox(mut self, outbox: SqlxOutbox<DB>) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// The outbox a handler's sends go to, if any.
    pub fn outbox(&self) -> Option<&SqlxOutbox<DB>> {
        self.outbox.as_ref()
    }

    fn table(&self) -> &str {
        &self.options.table
    }

    /// The retention in ms, added to the database's clock to stamp each row's `purge_after_ms`;
    /// `None` keeps rows forever.
    fn retention_ms(&self) -> Option<i64> {
        self.options.retention.map(|r| i64::try_from(r.as_millis()).unwrap_or(i64::MAX))
    }
}

/// Checks that a table name is a plain identifier, so it can be spliced into SQL.
fn validate_table(table: &str) -> Result<(), StoreError> {
    let ok = !table.is_empty()
        && table.len() <= 48
        && table.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !table.as_bytes()[0].is_ascii_digit();
    if ok { Ok(()) } else { Err(StoreError::InvalidTableName(table.to_owned())) }
}

/// Checks the key parts against [`MAX_KEY_CHARS`].
fn validate_key(consumer: &str, message_id: &MessageId) -> Result<(), StoreError> {
    for (what, s) in [("consumer", consumer), ("message id", message_id.as_str())] {
        let len = s.chars().count();
        if len > MAX_KEY_CHARS {
            return Err(StoreError::KeyTooLong { what, len });
        }
    }
    Ok(())
}

/// The first `sqlx::Error` in an error's chain (through [`StoreError`] too).
fn find_sqlx_error<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a sqlx::Error> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(s) = e.downcast_ref::<sqlx::Error>() {
            return Some(s);
        }
        if let Some(StoreError::Database(s)) = e.downcast_ref::<StoreError>() {
            return Some(s);
        }
        next = e.source();
    }
    None
}

/// Begins a transaction (with `statement`, or the default `BEGIN`), safely against
/// cancellation.
///
/// sqlx 0.8's begin is not cancel safe: it counts the transaction as open only after the
/// `BEGIN` round trip, so a caller that gives up while that round trip is in flight (the
/// processor does, when the message lock is lost while it waits for a connection or a write
/// lock, and at shutdown) returns the connection to the pool inside a transaction that nothing
/// will end: the next borrower, the application's own writes on a shared pool included, runs
/// in it. So the begin runs in a task of its own: a caller that goes away leaves the task to
/// finish, and the transaction it made is dropped there, which rolls it back before the
/// connection goes back to the pool. The task costs a spawn per begin, a few microseconds.
pub(crate) async fn begin_detached<DB: Database>(
    pool: &Pool<DB>,
    statement: Option<String>,
) -> Result<sqlx::Transaction<'static, DB>, StoreError> {
    let pool = pool.clone();
    let begun = tokio::spawn(async move {
        match statement {
            Some(statement) => pool.begin_with(statement).await,
            None => pool.begin().await,
        }
    })
    .await;
    match begun {
        Ok(begun) => Ok(begun?),
        Err(e) => Err(StoreError::Database(sqlx::Error::Protocol(format!(
            "beginning a transaction failed: {e}"
        )))),
    }
}

/// A lock wait in whole milliseconds, at least 1 (0 turns PostgreSQL's `lock_timeout` off).
fn wait_millis(wait: Duration) -> u128 {
    wait.as_millis().max(1)
}

/// Whether a non-database sqlx error is worth retrying.
fn is_transient_sqlx(error: &sqlx::Error) -> bool {
    matches!(
        error,
        sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed
    )
}

/// The `state` of a dedup-only record still being worked on; claims and finished records are
/// `1`, done.
const STATE_CLAIMED: i64 = 0;

/// What a dedup-only record found in place means to `owner`: its own claim (a commit of
/// unknown outcome, taken back), another attempt's claim in progress, or done.
fn claim_of_record(
    processed_at_ms: i64,
    state: i64,
    by: Option<&str>,
    owner: &str,
) -> twice::Claim {
    let claimed_at = Some(Timestamp::from_millis(processed_at_ms));
    match state {
        STATE_CLAIMED if by == Some(owner) => twice::Claim::Claimed,
        STATE_CLAIMED => twice::Claim::InProgress { claimed_at },
        _ => twice::Claim::Duplicate { claimed_at },
    }
}

fn millis(now: Timestamp) -> i64 {
    now.as_millis()
}

/// Purging claimed ids older than the retention.
pub trait Purge: Send + Sync {
    /// Deletes the rows whose retention is over, every consumer's by its own retention (each
    /// row carries `purge_after_ms`, stamped from the database's clock by the instance that made
    /// it), compared with the database's clock, in batches, unless another purger holds the
    /// purge lock; returns how many rows were deleted.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: each batch is its own transaction; a cancelled batch rolls back.
    fn purge(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Purges `store` every `interval` (measured on `clock`) until `shutdown` resolves. Errors are logged and the next
/// round tries again.
///
/// # Cancel safety
///
/// Cancel safe.
pub async fn run_purger<P: Purge>(
    store: &P,
    clock: &SharedClock,
    interval: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let purged = tokio::select! {
            biased;
            () = &mut shutdown => return,
            r = store.purge() => r,
        };
        match purged {
            Ok(0) => {}
            Ok(n) => tracing::debug!(rows = n, "purged processed message ids"),
            Err(e) => tracing::warn!("purging processed message ids failed: {e}"),
        }
        tokio::select! {
            biased;
            () = &mut shutdown => return,
            () = clock.sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        assert!(validate_table("twice_inbox").is_ok());
        assert!(validate_table("Inbox2").is_ok());
        for bad in ["", "1inbox", "inbox; DROP TABLE x", "a.b", "inbox-1", &"x".repeat(49)] {
            assert!(validate_table(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn long_keys_are_refused() {
        let long = MessageId::new("é".repeat(256));
        assert!(matches!(
            validate_key("c", &long),
            Err(StoreError::KeyTooLong { what: "message id", len: 256 })
        ));
        assert!(validate_key("c", &MessageId::new("é".repeat(255))).is_ok());
    }
}
