//! One fresh database per test.
//!
//! PostgreSQL and MariaDB run on every development and CI machine (PostgreSQL on
//! 127.0.0.1:5432 with trust authentication, MariaDB on 127.0.0.1:3306 as root without a
//! password). Each harness creates a database with a unique name and drops it on `Drop`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{ConnectOptions, Connection};

/// The server every PostgreSQL test connects to.
pub const POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The server every MariaDB test connects to.
pub const MARIADB_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// A unique, valid identifier with this prefix.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A database server the tests create databases on: PostgreSQL or MariaDB.
pub trait Server: sqlx::Database {
    /// The server's name in messages.
    const SERVER: &'static str;
    /// The URL every test connects to.
    const URL: &'static str;

    /// The options of database `name` on the server of `admin`.
    fn with_database(admin: ConnectOptionsOf<Self>, name: &str) -> ConnectOptionsOf<Self>;

    /// The statement that drops database `name`, with its connections.
    fn drop_database(name: &str) -> String;

    /// Runs `sql` on the server, connected as [`Server::URL`] says.
    fn run(sql: String) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// The connection options of a database type.
pub type ConnectOptionsOf<DB> = <<DB as sqlx::Database>::Connection as Connection>::Options;

impl Server for sqlx::Postgres {
    const SERVER: &'static str = "PostgreSQL";
    const URL: &'static str = POSTGRES_URL;

    fn with_database(admin: PgConnectOptions, name: &str) -> PgConnectOptions {
        admin.database(name)
    }

    fn drop_database(name: &str) -> String {
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    }

    async fn run(sql: String) -> Result<(), sqlx::Error> {
        let mut conn = PgConnectOptions::from_str(Self::URL)?.connect().await?;
        sqlx::query(&sql).execute(&mut conn).await?;
        conn.close().await
    }
}

impl Server for sqlx::MySql {
    const SERVER: &'static str = "MariaDB";
    const URL: &'static str = MARIADB_URL;

    fn with_database(admin: MySqlConnectOptions, name: &str) -> MySqlConnectOptions {
        admin.database(name)
    }

    fn drop_database(name: &str) -> String {
        format!("DROP DATABASE IF EXISTS {name}")
    }

    async fn run(sql: String) -> Result<(), sqlx::Error> {
        let mut conn = MySqlConnectOptions::from_str(Self::URL)?.connect().await?;
        sqlx::query(&sql).execute(&mut conn).await?;
        conn.close().await
    }
}

/// A fresh database on a [`Server`], dropped (with its connections) on `Drop`.
pub struct ServerDatabase<DB: Server> {
    name: String,
    options: ConnectOptionsOf<DB>,
}

/// A fresh PostgreSQL database.
pub type PgDatabase = ServerDatabase<sqlx::Postgres>;
/// A fresh MariaDB database.
pub type MariaDatabase = ServerDatabase<sqlx::MySql>;

impl<DB: Server> fmt::Debug for ServerDatabase<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerDatabase")
            .field("server", &DB::SERVER)
            .field("name", &self.name)
            .finish()
    }
}

impl<DB: Server> ServerDatabase<DB> {
    /// Creates a database named after `prefix` plus a random suffix.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn create(prefix: &str) -> Result<Self, sqlx::Error> {
        let name = unique_name(prefix);
        DB::run(format!("CREATE DATABASE {name}")).await?;
        let admin = ConnectOptionsOf::<DB>::from_str(DB::URL)?;
        Ok(Self { options: DB::with_database(admin, &name), name })
    }

    /// The database name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection options for the database.
    pub fn options(&self) -> ConnectOptionsOf<DB> {
        self.options.clone()
    }

    /// A pool of up to `max` connections.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn pool(&self, max: u32) -> Result<sqlx::Pool<DB>, sqlx::Error> {
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.options())
            .await
    }

    /// As [`pool`](Self::pool), but handing out connections without pinging each first
    /// (`test_before_acquire(false)`): one round trip less per transaction.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn pool_without_ping(&self, max: u32) -> Result<sqlx::Pool<DB>, sqlx::Error> {
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .test_before_acquire(false)
            .connect_with(self.options())
            .await
    }
}

impl<DB: Server> Drop for ServerDatabase<DB> {
    fn drop(&mut self) {
        let sql = DB::drop_database(&self.name);
        crate::run_cleanup("test database", move || DB::run(sql));
    }
}

/// A fresh SQLite file in a temporary directory, removed on `Drop`.
#[derive(Debug)]
pub struct SqliteDatabase {
    dir: tempfile::TempDir,
}

impl SqliteDatabase {
    /// A new empty directory for the database file.
    ///
    /// # Errors
    ///
    /// When the temporary directory cannot be created.
    pub fn create() -> std::io::Result<Self> {
        Ok(Self { dir: tempfile::tempdir()? })
    }

    /// The database file.
    pub fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("inbox.db")
    }

    /// Connection options: WAL, a 30 s busy timeout, created if missing.
    pub fn options(&self) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(self.path())
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30))
    }

    /// A pool of up to `max` connections.
    ///
    /// # Errors
    ///
    /// When the file cannot be opened.
    pub async fn pool(&self, max: u32) -> Result<SqlitePool, sqlx::Error> {
        SqlitePoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.options())
            .await
    }
}
