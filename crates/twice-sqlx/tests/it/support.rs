//! One fixture per store, so every scenario runs on SQLite, PostgreSQL and MariaDB.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::{Database, MySql, Pool, Postgres, Sqlite, Transaction};
use twice::MessageId;
use twice::{ManualClock, Message, ReceivedMessage, SequenceNumber};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver};
use twice_sqlx::{InboxOptions, OutboxOptions, OutboxRow, RowState, SqlxInbox, SqlxOutbox};
use twice_testkit::db::{MariaDatabase, PgDatabase, SqliteDatabase};
use twice_testkit::require_service;

/// A fresh database of one store, with the `shipments` table the scenarios write to.
pub trait Fixture: Send + Sync + Sized + 'static {
    type DB: Database;
    const NAME: &'static str;

    /// A fresh database; `None` when the server is down and `CI` is unset (the test skips).
    fn create() -> impl Future<Output = Option<Self>> + Send;
    fn pool(&self) -> &Pool<Self::DB>;
    fn inbox(&self, options: InboxOptions) -> impl Future<Output = SqlxInbox<Self::DB>> + Send;
    /// Runs a statement outside any transaction.
    fn exec(&self, sql: &str) -> impl Future<Output = ()> + Send;
    /// Runs a `SELECT COUNT(*)`-like query.
    fn count(&self, sql: &str) -> impl Future<Output = i64> + Send;
    /// Inserts a shipment inside the handler's transaction.
    fn insert_shipment(
        tx: &mut Transaction<'static, Self::DB>,
        order_id: i64,
        message_id: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// A second pool on the same database with `max` connections, of which a borrower waits
    /// for one at most `acquire_timeout`.
    fn pool_with(
        &self,
        max: u32,
        acquire_timeout: Duration,
    ) -> impl Future<Output = Pool<Self::DB>> + Send;
    /// A second pool on the same database with `max` connections whose sessions run
    /// `statement` when they connect (a session default such as the isolation level).
    fn pool_after_connect(
        &self,
        max: u32,
        statement: &'static str,
    ) -> impl Future<Output = Pool<Self::DB>> + Send;
    /// Whether the pool's one connection is inside a transaction, asked on that connection.
    fn in_transaction(pool: &Pool<Self::DB>) -> impl Future<Output = bool> + Send;
    /// Runs a statement inside the handler's transaction.
    fn try_exec(
        tx: &mut Transaction<'static, Self::DB>,
        sql: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Seed 2 strategy 3's check: is the id in `naive_processed`?
    fn naive_seen(
        tx: &mut Transaction<'static, Self::DB>,
        message_id: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Seed 2 strategy 3's record.
    fn naive_record(
        tx: &mut Transaction<'static, Self::DB>,
        message_id: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Sessions of this database waiting for a lock; `None` where the store cannot show it.
    fn lock_waiters(&self) -> impl Future<Output = Option<i64>> + Send;
    /// The `CREATE TABLE` for shipments.
    fn shipments_ddl() -> &'static str;
    /// How another process connects: a URL, or the SQLite file's path.
    fn url(&self) -> String;
    /// An outbox table on the store's pool.
    fn outbox(
        &self,
        options: OutboxOptions,
    ) -> impl Future<Output = Result<SqlxOutbox<Self::DB>, twice_sqlx::StoreError>> + Send;
    /// What an HTTP handler does outside any message handler: in a transaction of its own,
    /// ships `order_id` and sends `announce` to `destination` through `outbox`; commits (and
    /// wakes the relay) or rolls back. Returns the message id.
    fn ship_and_announce(
        &self,
        outbox: &SqlxOutbox<Self::DB>,
        order_id: i64,
        destination: &str,
        announce: Message,
        commit: bool,
    ) -> impl Future<Output = MessageId> + Send;
    /// Writes `messages` through `outbox` in order, in one transaction of its own, and commits.
    fn write_all(
        &self,
        outbox: &SqlxOutbox<Self::DB>,
        messages: Vec<(&'static str, Message)>,
    ) -> impl Future<Output = ()> + Send;
    /// The outbox's rows in `state`.
    fn rows(
        outbox: &SqlxOutbox<Self::DB>,
        state: RowState,
    ) -> impl Future<Output = Vec<OutboxRow>> + Send;
    /// Retries the parked rows `seqs`; returns how many.
    fn retry_parked(
        outbox: &SqlxOutbox<Self::DB>,
        seqs: Vec<i64>,
    ) -> impl Future<Output = u64> + Send;
    /// Discards every parked row; returns how many.
    fn discard_parked(outbox: &SqlxOutbox<Self::DB>) -> impl Future<Output = u64> + Send;
}

/// The body of the shipments a scenario writes.
macro_rules! ship_and_announce {
    () => {
        async fn ship_and_announce(
            &self,
            outbox: &SqlxOutbox<Self::DB>,
            order_id: i64,
            destination: &str,
            announce: Message,
            commit: bool,
        ) -> MessageId {
            let mut tx = self.pool().begin().await.expect("begin");
            Self::insert_shipment(&mut tx, order_id, "http").await.expect("insert");
            let id = outbox.send(&mut tx, destination, announce).await.expect("outbox send");
            if commit {
                outbox.commit(tx).await.expect("commit");
            } else {
                tx.rollback().await.expect("rollback");
            }
            id
        }
        async fn outbox(
            &self,
            options: OutboxOptions,
        ) -> Result<SqlxOutbox<Self::DB>, twice_sqlx::StoreError> {
            SqlxOutbox::new(self.pool().clone(), options).await
        }
        async fn write_all(
            &self,
            outbox: &SqlxOutbox<Self::DB>,
            messages: Vec<(&'static str, Message)>,
        ) {
            let mut tx = self.pool().begin().await.expect("begin");
            let writer = outbox.writer();
            for (destination, message) in messages {
                writer.push(destination, message).expect("valid");
            }
            outbox.write(&mut tx, &writer).await.expect("write");
            outbox.commit(tx).await.expect("commit");
        }
        async fn rows(outbox: &SqlxOutbox<Self::DB>, state: RowState) -> Vec<OutboxRow> {
            outbox.list(Some(state), 1000).await.expect("list")
        }
        async fn retry_parked(outbox: &SqlxOutbox<Self::DB>, seqs: Vec<i64>) -> u64 {
            outbox.retry_parked(Some(&seqs)).await.expect("retry")
        }
        async fn discard_parked(outbox: &SqlxOutbox<Self::DB>) -> u64 {
            outbox.discard_parked(None).await.expect("discard")
        }
    };
}

pub async fn create_shipments<F: Fixture>(f: &F, unique_order: bool) {
    f.exec(F::shipments_ddl()).await;
    if unique_order {
        f.exec("CREATE UNIQUE INDEX shipments_order_id ON shipments (order_id)").await;
    }
}

pub async fn shipments<F: Fixture>(f: &F) -> i64 {
    f.count("SELECT COUNT(*) FROM shipments").await
}

pub async fn inbox_rows<F: Fixture>(f: &F, table: &str) -> i64 {
    f.count(&format!("SELECT COUNT(*) FROM {table}")).await
}

pub struct Pg {
    db_: PgDatabase,
    pool: sqlx::PgPool,
}

impl Fixture for Pg {
    type DB = Postgres;
    const NAME: &'static str = "postgres";

    async fn create() -> Option<Self> {
        let db = require_service("PostgreSQL", PgDatabase::create("twice_it").await)?;
        let pool = db.pool(20).await.expect("pool");
        Some(Self { db_: db, pool })
    }
    fn pool(&self) -> &Pool<Postgres> {
        &self.pool
    }
    async fn inbox(&self, options: InboxOptions) -> SqlxInbox<Postgres> {
        SqlxInbox::new(self.pool.clone(), options).await.expect("inbox")
    }
    async fn exec(&self, sql: &str) {
        sqlx::query(sql).execute(&self.pool).await.expect(sql);
    }
    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.expect(sql)
    }
    async fn insert_shipment(
        tx: &mut Transaction<'static, Postgres>,
        order_id: i64,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO shipments (order_id, message_id) VALUES ($1, $2)")
            .bind(order_id)
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn try_exec(
        tx: &mut Transaction<'static, Postgres>,
        sql: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(sql).execute(&mut **tx).await.map(drop)
    }
    async fn pool_with(&self, max: u32, acquire_timeout: Duration) -> Pool<Postgres> {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(acquire_timeout)
            .connect_with(self.db_.options())
            .await
            .expect("pool")
    }
    async fn pool_after_connect(&self, max: u32, statement: &'static str) -> Pool<Postgres> {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max)
            .after_connect(move |conn, _| {
                Box::pin(async move { sqlx::query(statement).execute(conn).await.map(drop) })
            })
            .connect_with(self.db_.options())
            .await
            .expect("pool")
    }
    async fn in_transaction(pool: &Pool<Postgres>) -> bool {
        // Outside a transaction the statement is a transaction of its own, which starts with
        // it; inside one, now() is when the transaction began, before this statement. (The
        // simple query protocol, because the extended one restarts the statement's clock at
        // each of its steps.)
        use sqlx::Row as _;
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(pool)
            .await
            .expect("now() = statement_timestamp()");
        !row.get::<bool, _>(0)
    }
    async fn naive_seen(
        tx: &mut Transaction<'static, Postgres>,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM naive_processed WHERE id = $1)")
            .bind(message_id)
            .fetch_one(&mut **tx)
            .await
    }
    async fn naive_record(
        tx: &mut Transaction<'static, Postgres>,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO naive_processed (id) VALUES ($1)")
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn lock_waiters(&self) -> Option<i64> {
        Some(
            // An insert that meets an uncommitted row with its key waits for a share lock on
            // the inserting transaction's id.
            self.count(
                "SELECT COUNT(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE a.datname = current_database() AND l.locktype = 'transactionid' \
                 AND NOT l.granted",
            )
            .await,
        )
    }
    fn shipments_ddl() -> &'static str {
        "CREATE TABLE shipments (order_id BIGINT NOT NULL, message_id TEXT NOT NULL)"
    }
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.db_.name())
    }
    ship_and_announce!();
}

pub struct Maria {
    db_: MariaDatabase,
    pool: sqlx::MySqlPool,
}

impl Fixture for Maria {
    type DB = MySql;
    const NAME: &'static str = "mariadb";

    async fn create() -> Option<Self> {
        let db = require_service("MariaDB", MariaDatabase::create("twice_it").await)?;
        let pool = db.pool(20).await.expect("pool");
        Some(Self { db_: db, pool })
    }
    fn pool(&self) -> &Pool<MySql> {
        &self.pool
    }
    async fn inbox(&self, options: InboxOptions) -> SqlxInbox<MySql> {
        SqlxInbox::new(self.pool.clone(), options).await.expect("inbox")
    }
    async fn exec(&self, sql: &str) {
        sqlx::query(sql).execute(&self.pool).await.expect(sql);
    }
    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.expect(sql)
    }
    async fn insert_shipment(
        tx: &mut Transaction<'static, MySql>,
        order_id: i64,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO shipments (order_id, message_id) VALUES (?, ?)")
            .bind(order_id)
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn try_exec(tx: &mut Transaction<'static, MySql>, sql: &str) -> Result<(), sqlx::Error> {
        sqlx::query(sql).execute(&mut **tx).await.map(drop)
    }
    async fn pool_with(&self, max: u32, acquire_timeout: Duration) -> Pool<MySql> {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(acquire_timeout)
            .connect_with(self.db_.options())
            .await
            .expect("pool")
    }
    async fn pool_after_connect(&self, max: u32, statement: &'static str) -> Pool<MySql> {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(max)
            .after_connect(move |conn, _| {
                Box::pin(async move { sqlx::query(statement).execute(conn).await.map(drop) })
            })
            .connect_with(self.db_.options())
            .await
            .expect("pool")
    }
    async fn in_transaction(pool: &Pool<MySql>) -> bool {
        let open: i64 = sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
            .fetch_one(pool)
            .await
            .expect("@@in_transaction");
        open != 0
    }
    async fn naive_seen(
        tx: &mut Transaction<'static, MySql>,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM naive_processed WHERE id = ?")
            .bind(message_id)
            .fetch_one(&mut **tx)
            .await?;
        Ok(n > 0)
    }
    async fn naive_record(
        tx: &mut Transaction<'static, MySql>,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO naive_processed (id) VALUES (?)")
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn lock_waiters(&self) -> Option<i64> {
        Some(
            // MariaDB 10.11 does not list a transaction blocked in its first insert in
            // INNODB_TRX, so look for the claim statement still in progress instead.
            self.count(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                 WHERE DB = DATABASE() AND INFO LIKE 'INSERT IGNORE INTO inbox%' \
                 AND ID <> CONNECTION_ID()",
            )
            .await,
        )
    }
    fn shipments_ddl() -> &'static str {
        "CREATE TABLE shipments (order_id BIGINT NOT NULL, message_id VARCHAR(255) NOT NULL) ENGINE = InnoDB"
    }
    fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:3306/{}", self.db_.name())
    }
    ship_and_announce!();
}

pub struct Lite {
    db: SqliteDatabase,
    pool: sqlx::SqlitePool,
}

impl Fixture for Lite {
    type DB = Sqlite;
    const NAME: &'static str = "sqlite";

    async fn create() -> Option<Self> {
        let db = SqliteDatabase::create().expect("temp dir");
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(twice_sqlx::sqlite::connect_options(db.path()))
            .await
            .expect("pool");
        Some(Self { db, pool })
    }
    fn pool(&self) -> &Pool<Sqlite> {
        &self.pool
    }
    async fn inbox(&self, options: InboxOptions) -> SqlxInbox<Sqlite> {
        SqlxInbox::new(self.pool.clone(), options).await.expect("inbox")
    }
    async fn exec(&self, sql: &str) {
        sqlx::query(sql).execute(&self.pool).await.expect(sql);
    }
    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.expect(sql)
    }
    async fn insert_shipment(
        tx: &mut Transaction<'static, Sqlite>,
        order_id: i64,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO shipments (order_id, message_id) VALUES (?1, ?2)")
            .bind(order_id)
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn try_exec(tx: &mut Transaction<'static, Sqlite>, sql: &str) -> Result<(), sqlx::Error> {
        sqlx::query(sql).execute(&mut **tx).await.map(drop)
    }
    async fn pool_with(&self, max: u32, acquire_timeout: Duration) -> Pool<Sqlite> {
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(max)
            .acquire_timeout(acquire_timeout)
            .connect_with(twice_sqlx::sqlite::connect_options(self.db.path()))
            .await
            .expect("pool")
    }
    async fn pool_after_connect(&self, max: u32, statement: &'static str) -> Pool<Sqlite> {
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(max)
            .after_connect(move |conn, _| {
                Box::pin(async move { sqlx::query(statement).execute(conn).await.map(drop) })
            })
            .connect_with(twice_sqlx::sqlite::connect_options(self.db.path()))
            .await
            .expect("pool")
    }
    async fn in_transaction(pool: &Pool<Sqlite>) -> bool {
        // SQLite refuses a BEGIN inside a transaction (it has no other way to ask in SQL).
        let mut conn = pool.acquire().await.expect("acquire");
        match sqlx::query("BEGIN").execute(&mut *conn).await {
            Ok(_) => {
                sqlx::query("ROLLBACK").execute(&mut *conn).await.expect("rollback");
                false
            }
            Err(_) => true,
        }
    }
    async fn naive_seen(
        tx: &mut Transaction<'static, Sqlite>,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM naive_processed WHERE id = ?1")
            .bind(message_id)
            .fetch_one(&mut **tx)
            .await?;
        Ok(n > 0)
    }
    async fn naive_record(
        tx: &mut Transaction<'static, Sqlite>,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO naive_processed (id) VALUES (?1)")
            .bind(message_id)
            .execute(&mut **tx)
            .await
            .map(drop)
    }
    async fn lock_waiters(&self) -> Option<i64> {
        // A SQLite writer waits inside the library's busy handler, invisible from outside.
        None
    }
    fn shipments_ddl() -> &'static str {
        "CREATE TABLE shipments (order_id INTEGER NOT NULL, message_id TEXT NOT NULL)"
    }
    fn url(&self) -> String {
        self.db.path().display().to_string()
    }
    ship_and_announce!();
}

/// Runs `scenario` on every store: `on_all_stores!(name)` makes a module `name` with one test per
/// store.
#[macro_export]
macro_rules! on_all_stores {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                if let Some(f) = <$crate::support::Lite as $crate::support::Fixture>::create().await
                {
                    super::$scenario(f).await;
                }
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                if let Some(f) = <$crate::support::Pg as $crate::support::Fixture>::create().await {
                    super::$scenario(f).await;
                }
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn mariadb() {
                if let Some(f) =
                    <$crate::support::Maria as $crate::support::Fixture>::create().await
                {
                    super::$scenario(f).await;
                }
            }
        }
    };
}

/// Runs `scenario` on the stores with server sessions (PostgreSQL and MariaDB):
/// `on_server_stores!(name)` makes a module `name` with one test per store.
#[macro_export]
macro_rules! on_server_stores {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                if let Some(f) = <$crate::support::Pg as $crate::support::Fixture>::create().await {
                    super::$scenario(f).await;
                }
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn mariadb() {
                if let Some(f) =
                    <$crate::support::Maria as $crate::support::Fixture>::create().await
                {
                    super::$scenario(f).await;
                }
            }
        }
    };
}

/// A queue `orders` on an in-process embedded broker with a 30 s lock and MaxDeliveryCount
/// 10, on a manual clock.
pub async fn queue(path: &str) -> (BrokerQueue, ManualClock) {
    let clock = ManualClock::default();
    let broker =
        Broker::open(BrokerOptions::in_memory().clock(clock.clone())).await.expect("open broker");
    let queue = BrokerQueue::create(broker, path).await;
    (queue, clock)
}

/// One queue of an embedded broker, as the scenarios use it.
#[derive(Clone, Debug)]
pub struct BrokerQueue {
    pub broker: Broker,
    pub path: String,
}

impl BrokerQueue {
    /// Creates the queue (30 s lock, MaxDeliveryCount 10) on `broker`.
    pub async fn create(broker: Broker, path: &str) -> Self {
        broker
            .create_queue(
                path,
                QueueProperties::default().with_lock_duration(Duration::from_secs(30)),
            )
            .await
            .expect("create queue");
        Self { broker, path: path.to_owned() }
    }

    /// Opens the queue of a broker that already has it.
    pub fn existing(broker: Broker, path: &str) -> Self {
        Self { broker, path: path.to_owned() }
    }

    pub async fn send(&self, message: Message) {
        self.broker.send(&self.path, message).await.expect("send");
    }

    pub async fn receiver(&self) -> Receiver {
        self.broker.receiver(&self.path).await.expect("receiver")
    }

    /// Messages completed since the broker opened.
    pub async fn completed(&self) -> u64 {
        self.broker.statistics(&self.path).await.expect("statistics").completed
    }

    pub async fn active_count(&self) -> u64 {
        self.broker.counts(&self.path).await.expect("counts").active
    }

    pub async fn dead_letters(&self) -> Vec<ReceivedMessage> {
        self.broker
            .peek(&format!("{}/$DeadLetterQueue", self.path), SequenceNumber::new(0), 100)
            .await
            .expect("peek the dead-letter queue")
    }
}

/// Waits until `cond` holds, yielding to the runtime between checks. The bound only keeps a
/// broken test from hanging forever; no assertion depends on how long it took.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..120_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting for: {what}");
}

/// As [`until`], for a condition that needs a query.
pub async fn until_async<Fut: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> Fut) {
    for _ in 0..120_000 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting for: {what}");
}

/// A shutdown signal for processors: `trigger()` resolves every `wait()`.
#[derive(Clone, Default)]
pub struct Shutdown {
    fired: Arc<AtomicBool>,
    notify: Arc<tokio::sync::Notify>,
}

impl Shutdown {
    pub fn trigger(&self) {
        self.fired.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let fired = Arc::clone(&self.fired);
        let notify = Arc::clone(&self.notify);
        async move {
            loop {
                let notified = notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                if fired.load(Ordering::SeqCst) {
                    return;
                }
                notified.await;
            }
        }
    }
}
