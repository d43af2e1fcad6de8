//! One fresh database per test.
//!
//! PostgreSQL and MariaDB run on every development and CI machine (PostgreSQL on
//! 127.0.0.1:5432 with trust authentication, MariaDB on 127.0.0.1:3306 as root without a
//! password). Each harness creates a database with a unique name and drops it on `Drop`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
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

/// A fresh PostgreSQL database, dropped (with its connections) on `Drop`.
pub struct PgDatabase {
    name: String,
    options: PgConnectOptions,
}

impl fmt::Debug for PgDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgDatabase").field("name", &self.name).finish()
    }
}

impl PgDatabase {
    /// Creates a database named after `prefix` plus a random suffix.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn create(prefix: &str) -> Result<Self, sqlx::Error> {
        let name = unique_name(prefix);
        let admin = PgConnectOptions::from_str(POSTGRES_URL)?;
        let mut conn = admin.connect().await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
        conn.close().await?;
        Ok(Self { options: admin.database(&name), name })
    }

    /// The database name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection options for the database.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A pool of up to `max` connections.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn pool(&self, max: u32) -> Result<PgPool, sqlx::Error> {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.options())
            .await
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        crate::run_cleanup("test database", move || async move {
            let mut conn = PgConnectOptions::from_str(POSTGRES_URL)?.connect().await?;
            sqlx::query(&sql).execute(&mut conn).await?;
            conn.close().await
        });
    }
}

/// A fresh MariaDB database, dropped on `Drop`.
pub struct MariaDatabase {
    name: String,
    options: MySqlConnectOptions,
}

impl fmt::Debug for MariaDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MariaDatabase").field("name", &self.name).finish()
    }
}

impl MariaDatabase {
    /// Creates a database named after `prefix` plus a random suffix.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn create(prefix: &str) -> Result<Self, sqlx::Error> {
        let name = unique_name(prefix);
        let admin = MySqlConnectOptions::from_str(MARIADB_URL)?;
        let mut conn = admin.connect().await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
        conn.close().await?;
        Ok(Self { options: admin.database(&name), name })
    }

    /// The database name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection options for the database.
    pub fn options(&self) -> MySqlConnectOptions {
        self.options.clone()
    }

    /// A pool of up to `max` connections.
    ///
    /// # Errors
    ///
    /// When the server is unreachable.
    pub async fn pool(&self, max: u32) -> Result<MySqlPool, sqlx::Error> {
        MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.options())
            .await
    }
}

impl Drop for MariaDatabase {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {}", self.name);
        crate::run_cleanup("test database", move || async move {
            let mut conn = MySqlConnectOptions::from_str(MARIADB_URL)?.connect().await?;
            sqlx::query(&sql).execute(&mut conn).await?;
            conn.close().await
        });
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
