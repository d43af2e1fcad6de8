//! What the kit needs of each store beyond the inbox: running an effect query.

use sqlx::{MySql, Pool, Postgres, Row as _, Sqlite};
use twice::BoxFuture;

/// A database the kit proves handlers on: SQLite, PostgreSQL or MariaDB/MySQL.
pub trait Store: twice_sqlx::Backend {
    /// Runs an effect query, `SELECT key, COUNT(*) ...`, and returns its rows as
    /// `(key as text, count)`. The key may be text or an integer column.
    fn effect_counts<'a>(
        pool: &'a Pool<Self>,
        sql: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, String>>;
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
    ($db:ty) => {
        impl Store for $db {
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

store!(Sqlite);
store!(Postgres);
store!(MySql);
