//! The transactional outbox on sqlx: outgoing messages as rows of a table, written in the
//! transaction of the work they announce, and relayed to the broker after it commits.
//!
//! ```text
//! handler ── ctx.send ──▶ rows in the claim's transaction ── commit ──▶ Relay ──▶ broker
//! HTTP handler ── SqlxOutbox::send(&mut tx) ──▶ rows in the caller's transaction ──┘
//! ```
//!
//! - [`SqlxOutbox`] is the table. Give it to the inbox ([`SqlxInbox::with_outbox`](crate::SqlxInbox::with_outbox)) so that a
//!   handler's [`twice::Context::send`] writes rows in the transaction that claimed the
//!   message; use [`SqlxOutbox::send`] or [`SqlxOutbox::write`] on your own transaction
//!   elsewhere.
//! - [`twice::Relay`] sends the rows: `Relay::new(outbox, publisher, RelayOptions::new())
//!   .run(shutdown)`, with any [`twice::Publish`] (the embedded broker, the Service Bus client,
//!   RabbitMQ, NATS). A commit in this process wakes it at once; it polls for rows written
//!   elsewhere.
//!
//! # Example
//!
//! A shipping handler that announces `OrderShipped` through the outbox, and a relay that sends
//! it to the queue `shipped` of an embedded broker once the handler's transaction committed.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use twice::{json_fn, Context, Message, Outcome, Processor, ProcessorOptions, Relay, RelayOptions};
//! use twice_broker::{config::QueueProperties, Broker, BrokerOptions};
//! use twice_sqlx::{InboxOptions, OutboxOptions, SqlxInbox, SqlxOutbox};
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced {
//!     order_id: i64,
//! }
//!
//! let dir = tempfile::tempdir()?;
//! let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(
//!     dir.path().join("shop.db"),
//! ))
//! .await?;
//! sqlx::query("CREATE TABLE shipments (order_id INTEGER NOT NULL UNIQUE)").execute(&pool).await?;
//! let outbox = SqlxOutbox::new(pool.clone(), OutboxOptions::new()).await?;
//! let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new()).await?.with_outbox(outbox.clone());
//!
//! let handler = json_fn(
//!     |ctx: Context<'_>, order: OrderPlaced, tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>| {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
//!                 .bind(order.order_id)
//!                 .execute(&mut **tx)
//!                 .await?;
//!             // A row in this transaction: sent only if the shipment commits, with an id
//!             // derived from this message's, the same on every redelivery.
//!             let event = format!(r#"{{"order_id":{}}}"#, order.order_id);
//!             ctx.send("shipped", Message::new(event))?;
//!             Ok(Outcome::Complete)
//!         })
//!     },
//! );
//!
//! let broker = Broker::open(BrokerOptions::in_memory()).await?;
//! broker.create_queue("orders", QueueProperties::default()).await?;
//! broker.create_queue("shipped", QueueProperties::default()).await?;
//! broker.send("orders", Message::new(r#"{"order_id":42}"#).with_message_id("order-42")).await?;
//!
//! let processor = Processor::new(
//!     broker.receiver("orders").await?,
//!     inbox,
//!     handler,
//!     ProcessorOptions::new().consumer("shipping"),
//! );
//! let relay = Relay::new(outbox, broker.clone(), RelayOptions::new());
//! let sent = relay.counters();
//! let until_sent = {
//!     let sent = sent.clone();
//!     async move {
//!         while sent.snapshot().sent < 1 {
//!             tokio::task::yield_now().await;
//!         }
//!     }
//! };
//! // The processor runs until the relay has sent the event; the relay stops with it.
//! let (done, stop) = tokio::sync::oneshot::channel::<()>();
//! let relay = tokio::spawn(relay.run(async move {
//!     let _ = stop.await;
//! }));
//! processor.run(until_sent).await?;
//! let _ = done.send(());
//! relay.await?;
//!
//! let shipped = broker.receive("shipped", 1, std::time::Duration::from_secs(5)).await?;
//! assert_eq!(&shipped[0].body()[..], br#"{"order_id":42}"#);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # The table
//!
//! One table per outbox (name set with [`OutboxOptions::table`], default `twice_outbox`),
//! created by migration 1 of `<table>_migrations` (run by [`SqlxOutbox::new`] unless
//! [`OutboxOptions::migrate`] is off):
//!
//! | column | meaning |
//! |---|---|
//! | `seq` | the row's number (auto-increment): the order within an ordering key |
//! | `ordering_key` | rows of one key are sent in order (a handler run, a writer, a session) |
//! | `destination` | the entity, queue or subject |
//! | `message_id` | the message id, fixed when the row is written |
//! | `headers`, `body` | the message: its fields as JSON, its body as bytes |
//! | `created_at_ms` | when the row was written (the writer's clock) |
//! | `state` | 0 pending, 1 sent (kept for the retention), 2 parked |
//! | `not_before_ms` | not sent before this time (the database's clock): backoff, schedules |
//! | `lease_owner`, `lease_until_ms` | the relay sending it, and until when (the database's clock) |
//! | `attempts`, `last_error` | failed sends so far, and the last failure or the reason it was parked |
//! | `done_at_ms` | when it was sent or parked (the database's clock) |
//!
//! # Leases, per store
//!
//! A relay leases a batch in one short transaction: it reads the first due, unleased rows by
//! `seq` (PostgreSQL and MariaDB: `FOR UPDATE SKIP LOCKED`, so a second relay leasing at the
//! same time skips them; SQLite: `BEGIN IMMEDIATE`, one lease at a time), keeps only the rows
//! that no earlier pending row of their ordering key precedes outside the batch (that row is
//! leased by another relay, or waiting out a backoff), and stamps them with its name and the
//! lease's end. Sending happens after that transaction, so no database lock is held while the
//! broker is called. Acknowledged rows are deleted (or marked sent and purged later in bounded
//! batches when [`OutboxOptions::sent_retention`] is set) within the relay's
//! `RelayOptions::mark_delay`, the rows of many turns in one statement.
//!
//! # Parked rows
//!
//! A row the broker refuses for good (the entity does not exist, the message is over its
//! size) is parked: kept with its reason in `last_error`, never sent again, and the rows
//! after it in its ordering key go on. [`SqlxOutbox::list`] shows them, and
//! [`SqlxOutbox::retry_parked`] and [`SqlxOutbox::discard_parked`] act on them (`twice outbox`
//! does the same from the command line).

mod dialect;
mod store;

pub(crate) use store::write_rows;

use std::sync::Arc;
use std::time::Duration;

use sqlx::{Database, Pool};
use twice::outbox::{Outgoing, Wake};
use twice::{Message, MessageId, Properties, SessionId, SharedClock, Timestamp};

pub use dialect::OutboxDialect;

use crate::{StoreError, validate_table};

/// Options of an outbox table.
#[derive(Clone, Debug)]
pub struct OutboxOptions {
    table: String,
    migrate: bool,
    sent_retention: Option<Duration>,
    purge_batch_size: u32,
    clock: SharedClock,
}

impl Default for OutboxOptions {
    fn default() -> Self {
        Self {
            table: "twice_outbox".to_owned(),
            migrate: true,
            sent_retention: None,
            purge_batch_size: 1000,
            clock: SharedClock::system(),
        }
    }
}

impl OutboxOptions {
    /// The defaults: table `twice_outbox`, migrations on, sent rows deleted at once, purge
    /// batches of 1000, the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// The table name (a plain identifier).
    #[must_use]
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The table name.
    pub fn get_table(&self) -> &str {
        &self.table
    }

    /// Whether [`SqlxOutbox::new`] runs the embedded migration (default on). Off, it checks
    /// that the table exists.
    #[must_use]
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether migrations run on start.
    pub fn get_migrate(&self) -> bool {
        self.migrate
    }

    /// How long sent rows are kept (marked sent) before they are purged; `None` (the default)
    /// deletes a row as soon as the broker has acknowledged it.
    #[must_use]
    pub fn sent_retention(mut self, retention: Option<Duration>) -> Self {
        self.sent_retention = retention.filter(|r| !r.is_zero());
        self
    }

    /// How long sent rows are kept.
    pub fn get_sent_retention(&self) -> Option<Duration> {
        self.sent_retention
    }

    /// How many sent rows one purge statement deletes at most (default 1000; at least 1).
    #[must_use]
    pub fn purge_batch_size(mut self, n: u32) -> Self {
        self.purge_batch_size = n.max(1);
        self
    }

    /// How many sent rows one purge statement deletes at most.
    pub fn get_purge_batch_size(&self) -> u32 {
        self.purge_batch_size
    }

    /// The clock that stamps `created_at_ms` on rows written outside a handler (a handler's
    /// rows take the processor's clock).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The clock.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// Where a row stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RowState {
    /// Waiting to be sent (or being sent).
    Pending,
    /// Sent, kept for the retention.
    Sent,
    /// Refused by the broker for good; kept with its reason.
    Parked,
}

impl RowState {
    fn code(self) -> i64 {
        match self {
            Self::Pending => 0,
            Self::Sent => 1,
            Self::Parked => 2,
        }
    }

    fn from_code(code: i64) -> Self {
        match code {
            0 => Self::Pending,
            1 => Self::Sent,
            _ => Self::Parked,
        }
    }
}

/// A row of the outbox, as [`SqlxOutbox::list`] shows it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct OutboxRow {
    /// The row's number.
    pub seq: i64,
    /// Where it stands.
    pub state: RowState,
    /// Where it goes.
    pub destination: String,
    /// The message id it is sent with.
    pub message_id: MessageId,
    /// Its ordering key.
    pub ordering_key: String,
    /// When it was written.
    pub created_at: Timestamp,
    /// Failed sends so far.
    pub attempts: u32,
    /// The last failure, or why it was parked.
    pub last_error: Option<String>,
    /// The message, body included.
    pub message: Message,
}

/// An outbox table on a sqlx pool; a cheap clone. See the [module docs](self).
pub struct SqlxOutbox<DB: Database> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: Database> {
    pool: Pool<DB>,
    options: OutboxOptions,
    wake: Wake,
}

impl<DB: Database> Clone for SqlxOutbox<DB> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<DB: Database> std::fmt::Debug for SqlxOutbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxOutbox")
            .field("database", &DB::NAME)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> SqlxOutbox<DB> {
    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// The options.
    pub fn options(&self) -> &OutboxOptions {
        &self.inner.options
    }

    fn table(&self) -> &str {
        &self.inner.options.table
    }

    /// Wakes a relay of this outbox in this process, as a commit of rows should: call it after
    /// committing a transaction you wrote rows in ([`SqlxOutbox::commit`] does). Without it the
    /// relay finds the rows at its next poll.
    pub fn wake(&self) {
        self.inner.wake.wake();
    }

    /// A writer of messages with random ids, for [`SqlxOutbox::write`]; its messages share an
    /// ordering key, so they are sent in the order they were added.
    pub fn writer(&self) -> Outgoing {
        Outgoing::random(self.inner.options.clock.now())
    }

    /// A writer whose message ids derive from `producer`, the business key `key` (say
    /// `order-42`) and each message's index: writing the same messages again for the same key
    /// (a retried HTTP request) gives the same ids, which the broker's duplicate detection or
    /// the receiver's inbox drops.
    pub fn writer_for(&self, producer: &str, key: &str) -> Outgoing {
        Outgoing::for_key(producer, key, self.inner.options.clock.now())
    }
}

/// The rows a handler's or a writer's messages become, and the statement that writes them.
pub(crate) fn insert_sql<DB: OutboxDialect>(table: &str, rows: usize, leased: bool) -> String {
    let (columns, per_row) = if leased { (", lease_owner, lease_until_ms", 8) } else { ("", 6) };
    let mut sql = format!(
        "INSERT INTO {table} (ordering_key, destination, message_id, headers, body, \
         created_at_ms{columns}) VALUES "
    );
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        let p: Vec<String> = (1..=6).map(|i| DB::param(row * per_row + i)).collect();
        sql.push('(');
        sql.push_str(&p.join(", "));
        if leased {
            // Leased to the local relay until the database's now plus its lease.
            let owner = DB::param(row * per_row + 7);
            let lease = DB::param(row * per_row + 8);
            sql.push_str(&format!(", {owner}, {} + {lease}", DB::DB_NOW_MS));
        }
        sql.push(')');
    }
    if leased {
        sql.push_str(" RETURNING seq");
    }
    sql
}

/// The rows one INSERT writes at most (eight parameters each at most, well under every
/// driver's limit).
pub(crate) const INSERT_CHUNK: usize = 100;

/// A message's fields other than its id and body, as the `headers` column holds them: only
/// those set, so that a message with nothing but a body writes `{}`. Every byte of a row is
/// written twice (its page and the write-ahead log) and read back by the relay.
#[derive(serde::Serialize)]
struct HeadersOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a SessionId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    subject: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    to: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reply_to: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reply_to_session_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    time_to_live: Option<Duration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scheduled_enqueue_time: Option<Timestamp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    partition_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Properties::is_empty")]
    application_properties: &'a Properties,
}

/// The `headers` column read back: a field absent is unset. Rows written whole (the message
/// id and an empty body among their fields) read the same way.
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct HeadersIn {
    message_id: Option<MessageId>,
    session_id: Option<SessionId>,
    correlation_id: Option<String>,
    subject: Option<String>,
    content_type: Option<String>,
    to: Option<String>,
    reply_to: Option<String>,
    reply_to_session_id: Option<String>,
    time_to_live: Option<Duration>,
    scheduled_enqueue_time: Option<Timestamp>,
    partition_key: Option<String>,
    application_properties: Properties,
}

/// A message's fields other than its id (the `message_id` column) and body, as the `headers`
/// column holds them.
pub(crate) fn headers_of(m: &Message) -> Result<String, StoreError> {
    let headers = HeadersOut {
        session_id: m.session_id.as_ref(),
        correlation_id: m.correlation_id.as_deref(),
        subject: m.subject.as_deref(),
        content_type: m.content_type.as_deref(),
        to: m.to.as_deref(),
        reply_to: m.reply_to.as_deref(),
        reply_to_session_id: m.reply_to_session_id.as_deref(),
        time_to_live: m.time_to_live,
        scheduled_enqueue_time: m.scheduled_enqueue_time,
        partition_key: m.partition_key.as_deref(),
        application_properties: &m.application_properties,
    };
    serde_json::to_string(&headers).map_err(|e| StoreError::BadOutboxRow(e.to_string()))
}

/// The message of a row, from its `message_id` (empty for none), `headers` and `body`.
pub(crate) fn message_of(id: &str, headers: &str, body: Vec<u8>) -> Result<Message, StoreError> {
    let h: HeadersIn =
        serde_json::from_str(headers).map_err(|e| StoreError::BadOutboxRow(e.to_string()))?;
    let mut message = Message::new(body);
    message.message_id = h.message_id.or_else(|| (!id.is_empty()).then(|| MessageId::new(id)));
    message.session_id = h.session_id;
    message.correlation_id = h.correlation_id;
    message.subject = h.subject;
    message.content_type = h.content_type;
    message.to = h.to;
    message.reply_to = h.reply_to;
    message.reply_to_session_id = h.reply_to_session_id;
    message.time_to_live = h.time_to_live;
    message.scheduled_enqueue_time = h.scheduled_enqueue_time;
    message.partition_key = h.partition_key;
    message.application_properties = h.application_properties;
    Ok(message)
}

/// `p(from), p(from + 1), ...`, `n` parameters.
pub(crate) fn params<DB: OutboxDialect>(from: usize, n: usize) -> String {
    (from..from + n).map(DB::param).collect::<Vec<_>>().join(", ")
}

impl<DB: Database> SqlxOutbox<DB> {
    fn from_parts(pool: Pool<DB>, options: OutboxOptions) -> Result<Self, StoreError> {
        validate_table(&options.table)?;
        Ok(Self { inner: Arc::new(Inner { pool, options, wake: Wake::new() }) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_round_trips_through_its_row() {
        let m = Message::new(vec![0_u8, 159, 146, 150])
            .with_message_id("m-1")
            .with_session_id("s")
            .with_property("n", 42_i64)
            .with_scheduled_enqueue_time(Timestamp::from_millis(7));
        let headers = headers_of(&m).expect("serialises");
        assert!(!headers.contains("159"), "the body is not in the headers: {headers}");
        assert!(!headers.contains("m-1"), "the id has its own column: {headers}");
        assert_eq!(message_of("m-1", &headers, m.body.to_vec()).expect("parses"), m);
        assert!(matches!(message_of("m-1", "{", vec![]), Err(StoreError::BadOutboxRow(_))));
        // A message with nothing but a body and an id writes nothing else.
        let plain = Message::new(vec![1_u8]).with_message_id("m-2");
        assert_eq!(headers_of(&plain).expect("serialises"), "{}");
        assert_eq!(message_of("m-2", "{}", vec![1]).expect("parses"), plain);
        assert_eq!(message_of("", "{}", vec![]).expect("parses").message_id, None);
    }

    #[test]
    fn a_row_written_with_the_whole_message_as_its_headers_still_reads() {
        // The form rows had before the headers held only the fields set.
        let m = Message::new(vec![7_u8])
            .with_message_id("m-1")
            .with_subject("s")
            .with_time_to_live(Duration::from_secs(3));
        let mut whole = m.clone();
        whole.body = Vec::<u8>::new().into();
        let headers = serde_json::to_string(&whole).expect("serialises");
        assert!(headers.contains("\"reply_to\":null"), "{headers}");
        assert_eq!(message_of("m-1", &headers, vec![7]).expect("parses"), m);
    }

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    #[test]
    fn inserts_are_written_in_each_dialect() {
        assert_eq!(
            insert_sql::<sqlx::Postgres>("o", 2, false),
            "INSERT INTO o (ordering_key, destination, message_id, headers, body, created_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6), ($7, $8, $9, $10, $11, $12)"
        );
        assert!(insert_sql::<sqlx::MySql>("o", 1, false).ends_with("VALUES (?, ?, ?, ?, ?, ?)"));
        assert!(insert_sql::<sqlx::Sqlite>("o", 1, false).ends_with("(?1, ?2, ?3, ?4, ?5, ?6)"));
        let leased = insert_sql::<sqlx::Postgres>("o", 2, true);
        assert!(leased.contains("created_at_ms, lease_owner, lease_until_ms)"), "{leased}");
        assert!(leased.contains(", $7, (extract(epoch"), "{leased}");
        assert!(leased.ends_with("::bigint + $16) RETURNING seq"), "{leased}");
        assert!(leased.contains("($9, $10, $11, $12, $13, $14, $15, "), "{leased}");
        assert_eq!(params::<sqlx::Postgres>(3, 2), "$3, $4");
    }
}
