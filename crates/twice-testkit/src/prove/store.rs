//! What the kit needs of each store beyond the inbox: running an effect query, and reaching the
//! server through a proxy that can cut a COMMIT.

use std::net::SocketAddr;

use sqlx::mysql::MySqlSslMode;
use sqlx::postgres::PgSslMode;
use sqlx::{MySql, Pool, Postgres, Row as _, Sqlite};
use twice::BoxFuture;

/// A database the kit proves handlers on: SQLite, PostgreSQL or MariaDB/MySQL.
pub trait Store: twice_sqlx::Backend {
    /// The bytes of a COMMIT as the driver sends it (sqlx's text protocol), which the
    /// commit-unknown scenario's proxy cuts; empty where there is no connection.
    const COMMIT: &'static [u8];

    /// Runs an effect query, `SELECT key, COUNT(*) ...`, and returns its rows as
    /// `(key as text, count)`. The key may be text or an integer column.
    fn effect_counts<'a>(
        pool: &'a Pool<Self>,
        sql: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, String>>;

    /// The `host:port` the pool connects to over TCP; the reason when it does not (SQLite
    /// runs in the process, a pool may use a Unix socket).
    ///
    /// # Errors
    ///
    /// The reason, when there is no TCP connection to the server.
    fn server(pool: &Pool<Self>) -> Result<String, String>;

    /// A pool with `pool`'s options and connect options, except that it connects to `addr`,
    /// without TLS (so that a proxy there sees the statements).
    fn via(pool: &Pool<Self>, addr: SocketAddr) -> Pool<Self>;
}

/// `host:port`, with an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// The key of a row as text, whatever its column type.
macro_rules! key_and_count {
    ($row:expr) => {{
        let row = $row;
        let key = row
            .try_get::<String, _>(0)
            .or_else(|_| row.try_get::<i64, _>(0).map(|k| k.to_string()))
            .or_else(|_| row.try_get::<i32, _>(0).map(|k| k.to_string()))
            .map_err(|e| format!("its first column is not a text or integer key: {e}"))?;
        let count = row
            .try_get::<i64, _>(1)
            .or_else(|_| row.try_get::<i32, _>(1).map(i64::from))
            .map_err(|e| format!("its second column is not an integer count: {e}"))?;
        (key, count)
    }};
}

macro_rules! store {
    ($db:ty, $commit:expr, { $($rest:tt)* }) => {
        impl Store for $db {
            const COMMIT: &'static [u8] = $commit;

            $($rest)*

            fn effect_counts<'a>(
                pool: &'a Pool<Self>,
                sql: &'a str,
            ) -> BoxFuture<'a, Result<Vec<(String, i64)>, String>> {
                Box::pin(async move {
                    let rows = sqlx::query(sql).fetch_all(pool).await.map_err(|e| e.to_string())?;
                    let mut out = Vec::with_capacity(rows.len());
                    for row in &rows {
                        out.push(key_and_count!(row));
                    }
                    Ok(out)
                })
            }
        }
    };
}

store!(Sqlite, b"", {
    fn server(_: &Pool<Self>) -> Result<String, String> {
        Err("SQLite runs in the process: there is no connection to cut during the COMMIT"
            .to_owned())
    }

    fn via(pool: &Pool<Self>, _: SocketAddr) -> Pool<Self> {
        pool.clone()
    }
});

// A simple query message: 'Q', its length (4 + 7), "COMMIT\0".
store!(Postgres, b"Q\0\0\0\x0bCOMMIT\0", {
    fn server(pool: &Pool<Self>) -> Result<String, String> {
        let options = pool.connect_options();
        match options.get_socket() {
            Some(socket) => Err(format!(
                "the pool connects through the Unix socket {}: there is no TCP connection to cut",
                socket.display()
            )),
            None if options.get_host().starts_with('/') => Err(format!(
                "the pool connects through a Unix socket in {}: there is no TCP connection to cut",
                options.get_host()
            )),
            None => Ok(host_port(options.get_host(), options.get_port())),
        }
    }

    fn via(pool: &Pool<Self>, addr: SocketAddr) -> Pool<Self> {
        let options = (*pool.connect_options())
            .clone()
            .host(&addr.ip().to_string())
            .port(addr.port())
            .ssl_mode(PgSslMode::Disable);
        pool.options().clone().connect_lazy_with(options)
    }
});

// A COM_QUERY packet: its length (7), sequence 0, the command 3, "COMMIT".
store!(MySql, b"\x07\0\0\0\x03COMMIT", {
    fn server(pool: &Pool<Self>) -> Result<String, String> {
        let options = pool.connect_options();
        match options.get_socket() {
            Some(socket) => Err(format!(
                "the pool connects through the Unix socket {}: there is no TCP connection to cut",
                socket.display()
            )),
            None => Ok(host_port(options.get_host(), options.get_port())),
        }
    }

    fn via(pool: &Pool<Self>, addr: SocketAddr) -> Pool<Self> {
        let options = (*pool.connect_options())
            .clone()
            .host(&addr.ip().to_string())
            .port(addr.port())
            .ssl_mode(MySqlSslMode::Disabled);
        pool.options().clone().connect_lazy_with(options)
    }
});
