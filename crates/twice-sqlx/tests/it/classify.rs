//! The store's classification of errors the databases really raise: those of a failover
//! (a read-only transaction or server), a full disk and a write conflict are transient, so
//! the processor retries them in process; an id the inbox key cannot hold is permanent.

use sqlx::Connection as _;
use twice::{ErrorClass, Inbox, MessageId, Timestamp};
use twice_sqlx::{InboxOptions, StoreError};

use crate::support::{Fixture, Lite, Maria, Pg};

/// The class of the error `result` carries.
fn class_of<I: Inbox, T: std::fmt::Debug>(inbox: &I, result: Result<T, sqlx::Error>) -> ErrorClass {
    let error = result.expect_err("the statement must fail");
    inbox.classify(&StoreError::Database(error))
}

/// A claim whose id is longer than the key's 256 characters: never the store's fault.
async fn a_too_long_id_is_permanent<F: Fixture>(f: &F)
where
    twice_sqlx::SqlxInbox<F::DB>: Inbox<Error = StoreError>,
{
    let inbox = f.inbox(InboxOptions::new().table("inbox_classify")).await;
    let mut tx = inbox.begin().await.expect("begin");
    let id = MessageId::new("x".repeat(256));
    let e = inbox.claim(&mut tx, "c", &id, Timestamp::from_millis(0)).await.expect_err("too long");
    assert_eq!(inbox.classify(&e), ErrorClass::Permanent, "{}: {e}", F::NAME);
}

#[tokio::test]
async fn postgres_read_only_transactions_are_transient() {
    let Some(f) = Pg::create().await else { return };
    let inbox = f.inbox(InboxOptions::new().table("inbox_classify")).await;
    let mut conn = f.pool().acquire().await.expect("acquire");
    let mut tx = conn.begin().await.expect("begin");
    sqlx::query("SET TRANSACTION READ ONLY").execute(&mut *tx).await.expect("read only");
    let insert = sqlx::query(
        "INSERT INTO inbox_classify (consumer, message_id, processed_at_ms) \
                              VALUES ('c', 'm', 0)",
    )
    .execute(&mut *tx)
    .await;
    // SQLSTATE 25006, what a primary demoted in a failover answers.
    assert_eq!(class_of(&inbox, insert), ErrorClass::Transient);
    drop(tx);
    a_too_long_id_is_permanent(&f).await;
}

#[tokio::test]
async fn mariadb_read_only_and_write_conflicts_are_transient() {
    let Some(f) = Maria::create().await else { return };
    let inbox = f.inbox(InboxOptions::new().table("inbox_classify")).await;
    f.exec("CREATE TABLE accounts (id INT PRIMARY KEY, balance INT NOT NULL) ENGINE = InnoDB")
        .await;
    f.exec("INSERT INTO accounts VALUES (1, 10)").await;

    // 1792: a write in a READ ONLY transaction.
    let mut conn = f.pool().acquire().await.expect("acquire");
    sqlx::query("SET SESSION TRANSACTION READ ONLY").execute(&mut *conn).await.expect("set");
    let mut tx = conn.begin().await.expect("begin");
    let update =
        sqlx::query("UPDATE accounts SET balance = 11 WHERE id = 1").execute(&mut *tx).await;
    assert_eq!(class_of(&inbox, update), ErrorClass::Transient, "1792");
    tx.rollback().await.expect("rollback");
    sqlx::query("SET SESSION TRANSACTION READ WRITE").execute(&mut *conn).await.expect("set");

    // 1020: under innodb_snapshot_isolation, a row another transaction changed since this
    // one's snapshot was taken.
    sqlx::query("SET SESSION innodb_snapshot_isolation = ON")
        .execute(&mut *conn)
        .await
        .expect("set");
    let mut tx = conn.begin().await.expect("begin");
    let _: i32 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 1")
        .fetch_one(&mut *tx)
        .await
        .expect("snapshot");
    f.exec("UPDATE accounts SET balance = 12 WHERE id = 1").await;
    let update =
        sqlx::query("UPDATE accounts SET balance = 13 WHERE id = 1").execute(&mut *tx).await;
    assert_eq!(class_of(&inbox, update), ErrorClass::Transient, "1020");
    drop(tx);
    drop(conn);
    a_too_long_id_is_permanent(&f).await;
}

#[tokio::test]
async fn sqlite_read_only_and_full_databases_are_transient() {
    let Some(f) = Lite::create().await else { return };
    let inbox = f.inbox(InboxOptions::new().table("inbox_classify")).await;
    f.exec("CREATE TABLE blobs (b BLOB NOT NULL)").await;
    let mut conn = f.pool().acquire().await.expect("acquire");

    // 8 (SQLITE_READONLY).
    sqlx::query("PRAGMA query_only = ON").execute(&mut *conn).await.expect("pragma");
    let insert = sqlx::query("INSERT INTO blobs (b) VALUES (x'00')").execute(&mut *conn).await;
    assert_eq!(class_of(&inbox, insert), ErrorClass::Transient, "SQLITE_READONLY");
    sqlx::query("PRAGMA query_only = OFF").execute(&mut *conn).await.expect("pragma");

    // 13 (SQLITE_FULL): no page may be added to the file.
    let pages: i64 =
        sqlx::query_scalar("PRAGMA page_count").fetch_one(&mut *conn).await.expect("pages");
    sqlx::query(&format!("PRAGMA max_page_count = {pages}"))
        .execute(&mut *conn)
        .await
        .expect("pragma");
    let insert =
        sqlx::query("INSERT INTO blobs (b) VALUES (zeroblob(1000000))").execute(&mut *conn).await;
    assert_eq!(class_of(&inbox, insert), ErrorClass::Transient, "SQLITE_FULL");
    drop(conn);
    a_too_long_id_is_permanent(&f).await;
}
