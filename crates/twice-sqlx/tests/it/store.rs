//! The inbox stores on their own: the claim waits for a concurrent uncommitted claim, the
//! purge, migrations, dedup-only records.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Transaction;
use twice::{Claim, Inbox, MessageId, Stopwatch, Timestamp};
use twice_sqlx::{InboxOptions, Purge, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::support::{Fixture, create_shipments, inbox_rows, until, until_async};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

const T0: Timestamp = Timestamp::from_millis(1_893_456_000_000);

/// Claims `id` in a new transaction on another task and returns its result once the first
/// transaction (`holder`) has been ended by `end`.
async fn second_claim_after<F: Fixture>(f: &F, inbox: Arc<Inboxed<F>>, commit_first: bool) -> Claim
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let id = MessageId::new(if commit_first { "m-commit" } else { "m-rollback" });
    let mut first = inbox.begin().await.expect("begin");
    assert_eq!(inbox.claim(&mut first, "c", &id, T0).await.expect("claim"), Claim::Claimed);

    let second = tokio::spawn({
        let inbox = inbox.clone();
        let id = id.clone();
        async move {
            let mut tx = inbox.begin().await?;
            let claim = inbox.claim(&mut tx, "c", &id, T0 + Duration::from_secs(1)).await?;
            inbox.rollback(tx).await?;
            Ok::<_, StoreError>(claim)
        }
    });
    match f.lock_waiters().await {
        // Proof that the second claim waits on the first one's key, not on a snapshot.
        Some(_) => {
            until_async("the second claim waits", || async { f.lock_waiters().await == Some(1) })
                .await
        }
        // SQLite: the second transaction waits for the write lock at BEGIN IMMEDIATE.
        None => {
            for _ in 0..50 {
                tokio::task::yield_now().await;
            }
        }
    }
    assert!(!second.is_finished(), "{}: the second claim must wait", F::NAME);
    if commit_first {
        inbox.commit(first).await.expect("commit");
    } else {
        inbox.rollback(first).await.expect("rollback");
    }
    second.await.expect("join").expect("second claim")
}

async fn a_concurrent_claim_waits_then_sees_the_outcome<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_wait")).await);
    assert_eq!(
        second_claim_after(&f, inbox.clone(), true).await,
        Claim::Duplicate { claimed_at: Some(T0) },
        "{}: the first committed, so the second is a duplicate",
        F::NAME
    );
    assert_eq!(
        second_claim_after(&f, inbox.clone(), false).await,
        Claim::Claimed,
        "{}: the first rolled back, so the second claims",
        F::NAME
    );
    assert_eq!(inbox_rows(&f, "inbox_wait").await, 1);
}
on_all_stores!(a_concurrent_claim_waits_then_sees_the_outcome);

async fn claims_are_scoped_per_consumer<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let inbox = f.inbox(InboxOptions::new().table("inbox_scope")).await;
    let id = MessageId::new("shared-by-two-subscriptions");
    for consumer in ["events/Subscriptions/billing", "events/Subscriptions/shipping"] {
        let mut tx = inbox.begin().await.expect("begin");
        assert_eq!(inbox.claim(&mut tx, consumer, &id, T0).await.expect("claim"), Claim::Claimed);
        inbox.commit(tx).await.expect("commit");
    }
    // Ids differ by case only: distinct keys (MariaDB uses a binary collation for this).
    let mut tx = inbox.begin().await.expect("begin");
    let upper = MessageId::new("SHARED-BY-TWO-SUBSCRIPTIONS");
    assert_eq!(
        inbox.claim(&mut tx, "events/Subscriptions/billing", &upper, T0).await.expect("claim"),
        Claim::Claimed
    );
    inbox.rollback(tx).await.expect("rollback");
    // An over-long id is refused before it reaches the database.
    let mut tx = inbox.begin().await.expect("begin");
    let long = MessageId::new("x".repeat(256));
    assert!(matches!(
        inbox.claim(&mut tx, "c", &long, T0).await,
        Err(StoreError::KeyTooLong { .. })
    ));
    inbox.rollback(tx).await.expect("rollback");
    assert_eq!(inbox_rows(&f, "inbox_scope").await, 2);
}
on_all_stores!(claims_are_scoped_per_consumer);

async fn purge_deletes_old_claims_in_batches<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError> + Purge,
{
    // 20 claims of a consumer whose retention is over at once, 10 of one that keeps them.
    let gone = f
        .inbox(
            InboxOptions::new()
                .table("inbox_purge")
                .retention(Some(Duration::ZERO))
                .purge_batch_size(7),
        )
        .await;
    let kept = f
        .inbox(
            InboxOptions::new()
                .table("inbox_purge")
                .retention(Some(Duration::from_secs(3600)))
                .purge_batch_size(7),
        )
        .await;
    for i in 0..30_i64 {
        let (inbox, consumer) = if i < 20 { (&gone, "gone") } else { (&kept, "kept") };
        let id = MessageId::new(format!("m-{i}"));
        let claim = inbox.record(consumer, &id, "owner", T0).await.expect("record");
        assert_eq!(claim, Claim::Claimed);
    }
    tokio::time::sleep(Duration::from_millis(20)).await; // past the database's millisecond
    assert_eq!(kept.purge().await.expect("purge"), 20, "{}", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_purge").await, 10);
    assert_eq!(kept.purge().await.expect("purge"), 0);
}
on_all_stores!(purge_deletes_old_claims_in_batches);

/// Two consumers share a table with different retention: whichever instance purges, each
/// consumer's rows go by that consumer's retention, measured on the database's clock (an
/// application clock hours off changes nothing).
async fn purge_keeps_each_consumers_retention_on_the_database_clock<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError> + Purge,
{
    let table = "inbox_retention";
    let short = f.inbox(InboxOptions::new().table(table).retention(Some(Duration::ZERO))).await;
    let long =
        f.inbox(InboxOptions::new().table(table).retention(Some(Duration::from_secs(3600)))).await;
    // The application's clock is two hours ahead of the database's.
    let app_now = twice::SharedClock::system().now() + Duration::from_secs(7200);
    for i in 0..3 {
        let id = MessageId::new(format!("m-{i}"));
        for (inbox, consumer) in [(&short, "short"), (&long, "long")] {
            let mut tx = inbox.begin().await.expect("begin");
            assert_eq!(
                inbox.claim(&mut tx, consumer, &id, app_now).await.expect("claim"),
                Claim::Claimed
            );
            inbox.commit(tx).await.expect("commit");
        }
    }
    tokio::time::sleep(Duration::from_millis(20)).await; // past the database's millisecond
    let rows = |consumer: &'static str| {
        let f = &f;
        async move {
            f.count(&format!("SELECT COUNT(*) FROM {table} WHERE consumer = '{consumer}'")).await
        }
    };
    // The short retention's instance purges: the long consumer's rows stay.
    assert_eq!(short.purge().await.expect("purge"), 3, "{}", F::NAME);
    assert_eq!((rows("short").await, rows("long").await), (0, 3), "{}", F::NAME);
    for i in 0..3 {
        let id = MessageId::new(format!("n-{i}"));
        let mut tx = short.begin().await.expect("begin");
        short.claim(&mut tx, "short", &id, app_now).await.expect("claim");
        short.commit(tx).await.expect("commit");
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The long retention's instance purges: the short consumer's rows go all the same.
    assert_eq!(long.purge().await.expect("purge"), 3, "{}", F::NAME);
    assert_eq!((rows("short").await, rows("long").await), (0, 3), "{}", F::NAME);
}
on_all_stores!(purge_keeps_each_consumers_retention_on_the_database_clock);

async fn migrations_run_once_and_can_be_skipped<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    // Two instances starting together both migrate; the second finds the work done.
    let (a, b) = tokio::join!(
        f.inbox(InboxOptions::new().table("inbox_mig")),
        f.inbox(InboxOptions::new().table("inbox_mig"))
    );
    drop((a, b));
    // Each version recorded once, none missing: versions 1 to n, n rows.
    let rows = f.count("SELECT COUNT(*) FROM inbox_mig_migrations").await;
    assert!(rows >= 1);
    assert_eq!(f.count("SELECT MAX(version) FROM inbox_mig_migrations").await, rows);
    let skipped = f.inbox(InboxOptions::new().table("inbox_unmigrated").migrate(false)).await;
    let mut tx = skipped.begin().await.expect("begin");
    assert!(skipped.claim(&mut tx, "c", &MessageId::new("m"), T0).await.is_err(), "no table");
}
on_all_stores!(migrations_run_once_and_can_be_skipped);

async fn dedup_only_records_are_owned_and_finished_with_the_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let inbox = f.inbox(InboxOptions::new().table("inbox_dedup")).await;
    let id = MessageId::new("m-1");
    let later = T0 + Duration::from_secs(5);
    assert_eq!(inbox.record("c", &id, "a", T0).await.expect("record"), Claim::Claimed);
    // Another owner meets a record in progress; the same owner (a retry) holds it still.
    assert_eq!(
        inbox.record("c", &id, "b", later).await.expect("record"),
        Claim::InProgress { claimed_at: Some(T0) },
        "{}",
        F::NAME
    );
    assert_eq!(inbox.record("c", &id, "a", later).await.expect("record"), Claim::Claimed);
    // Only the owner removes it.
    assert!(!inbox.forget("c", &id, "b").await.expect("forget"), "{}", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_dedup").await, 1);
    assert!(inbox.forget("c", &id, "a").await.expect("forget"));
    assert_eq!(inbox.record("c", &id, "b", T0).await.expect("record"), Claim::Claimed);
    // Finished in a transaction that rolls back: still in progress.
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.finish(&mut tx, "c", &id, "b").await.expect("finish"));
    inbox.rollback(tx).await.expect("rollback");
    assert!(matches!(inbox.record("c", &id, "c", later).await, Ok(Claim::InProgress { .. })));
    // Another owner cannot finish it; the owner's finish commits with the work.
    let mut tx = inbox.begin().await.expect("begin");
    assert!(!inbox.finish(&mut tx, "c", &id, "a").await.expect("finish"));
    assert!(inbox.finish(&mut tx, "c", &id, "b").await.expect("finish"));
    inbox.commit(tx).await.expect("commit");
    assert_eq!(
        inbox.record("c", &id, "c", later).await.expect("record"),
        Claim::Duplicate { claimed_at: Some(T0) }
    );
    // A done record is never forgotten, not even by its owner.
    assert!(!inbox.forget("c", &id, "b").await.expect("forget"));
    assert_eq!(inbox_rows(&f, "inbox_dedup").await, 1);
    // A claim made in claim mode is done.
    let other = MessageId::new("m-2");
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(inbox.claim(&mut tx, "c", &other, T0).await.expect("claim"), Claim::Claimed);
    inbox.commit(tx).await.expect("commit");
    assert!(matches!(inbox.record("c", &other, "a", T0).await, Ok(Claim::Duplicate { .. })));
}
on_all_stores!(dedup_only_records_are_owned_and_finished_with_the_work);

#[test]
fn invalid_table_names_are_refused() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("dir");
        let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(
            dir.path().join("x.db"),
        ))
        .await
        .expect("pool");
        let err = SqlxInbox::new(pool.clone(), InboxOptions::new().table("inbox; DROP TABLE x"))
            .await
            .expect_err("refused");
        assert!(matches!(err, StoreError::InvalidTableName(_)));
        let err = SqlxInbox::new(pool, InboxOptions::new().business_key("x", "no_such_index"))
            .await
            .expect_err("refused");
        assert!(matches!(err, StoreError::BusinessKeyNotFound { .. }), "{err}");
    });
}

/// A business key must be a unique key of the table it is registered with: a missing key, a
/// key of another table, and a non-unique index are each refused at start with a typed error.
async fn a_business_key_must_be_a_unique_key_of_its_table<F: Fixture>(f: F)
where
    F::DB: twice_sqlx::Backend,
{
    create_shipments(&f, true).await;
    f.exec("CREATE TABLE returns (order_id BIGINT NOT NULL)").await;
    f.exec("CREATE INDEX returns_order_id ON returns (order_id)").await;
    let refused = [
        ("shipments", "no_such_key"),
        ("returns", "shipments_order_id"),
        ("returns", "returns_order_id"),
        ("no_such_table", "shipments_order_id"),
    ];
    for (table, key) in refused {
        let options = InboxOptions::new().table("inbox_keys").business_key(table, key);
        match SqlxInbox::new(f.pool().clone(), options).await {
            Err(StoreError::BusinessKeyNotFound { table: t, key: k }) => {
                assert_eq!((t.as_str(), k.as_str()), (table, key));
            }
            other => panic!("{}: ({table}, {key}) must be refused: {other:?}", F::NAME),
        }
    }
    let options =
        InboxOptions::new().table("inbox_keys").business_key("shipments", "shipments_order_id");
    let inbox = SqlxInbox::new(f.pool().clone(), options).await;
    assert!(inbox.is_ok(), "{}: {inbox:?}", F::NAME);
}
on_all_stores!(a_business_key_must_be_a_unique_key_of_its_table);

/// A `begin` given up at a random moment (the processor gives up when the message lock is lost
/// while it waits for a connection or for the write lock, and at shutdown) leaves no
/// transaction open on the connection it borrowed. The pool has one connection, so the check
/// after each round asks the very connection the cancelled begin used. The moments are drawn
/// from a seeded generator over twice the time a begin takes, so most rounds stop the begin
/// somewhere inside its round trip.
async fn a_cancelled_begin_leaves_no_transaction_on_its_connection<F: Fixture>(f: F)
where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    const ROUNDS: u32 = 300;
    // One connection: what one borrower leaves on it, the next one meets.
    let pool = f.pool_with(1, Duration::from_secs(60)).await;
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new().table("inbox_cancelled")).await;
    let inbox = inbox.expect("inbox");
    // How long a begin takes here, to spread the cancellations over it.
    let watch = Stopwatch::start();
    for _ in 0..20 {
        inbox.rollback(inbox.begin().await.expect("begin")).await.expect("rollback");
    }
    let span = (watch.elapsed() / 10).max(Duration::from_micros(20));
    let seed = u64::from(std::process::id());
    let mut rng = seed;
    let mut cancelled = 0;
    for round in 0..ROUNDS {
        rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let fraction = f64::from(u32::try_from(rng >> 44).unwrap_or(0)) / f64::from(1_u32 << 20);
        let patience = span.mul_f64(fraction);
        // The connection goes back to the pool in a task of its own after each use; wait for
        // it, so that the begin's time goes to its round trip rather than to the pool.
        until("the connection is back in the pool", || pool.num_idle() == 1).await;
        let gave_up = tokio::select! {
            biased;
            begun = inbox.begin() => {
                inbox.rollback(begun.expect("begin")).await.expect("rollback");
                false
            }
            () = spin(patience) => true,
        };
        cancelled += u32::from(gave_up);
        assert!(
            !F::in_transaction(&pool).await,
            "{}: round {round} (seed {seed}, given up after {patience:?}): a transaction was \
             left open on the connection",
            F::NAME
        );
    }
    println!("{}: {cancelled} of {ROUNDS} begins were given up midway", F::NAME);
    assert!(cancelled > 0, "{}: no begin was cancelled; the test proved nothing", F::NAME);
}
on_all_stores!(a_cancelled_begin_leaves_no_transaction_on_its_connection);

/// Resolves after `d` of real time, yielding meanwhile: finer than the runtime's timer, whose
/// resolution (1 ms) is longer than a begin.
async fn spin(d: Duration) {
    let watch = Stopwatch::start();
    while watch.elapsed() < d {
        tokio::task::yield_now().await;
    }
}

/// Ids that differ only by trailing spaces are different ids (MariaDB's `utf8mb4_bin` is a
/// PAD SPACE collation, under which they were one key).
async fn ids_differing_by_trailing_spaces_are_distinct<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let inbox = f.inbox(InboxOptions::new().table("inbox_spaces")).await;
    for (consumer, id) in [("c", "m"), ("c", "m "), ("c", "m  "), ("c ", "m")] {
        let mut tx = inbox.begin().await.expect("begin");
        let claim = inbox.claim(&mut tx, consumer, &MessageId::new(id), T0).await.expect("claim");
        assert_eq!(claim, Claim::Claimed, "{}: ({consumer:?}, {id:?})", F::NAME);
        inbox.commit(tx).await.expect("commit");
    }
    assert_eq!(inbox_rows(&f, "inbox_spaces").await, 4);
}
on_all_stores!(ids_differing_by_trailing_spaces_are_distinct);

/// A table made before dedup-only records had a state and an owner gains both; its rows are
/// done, so a record of one of their ids is a duplicate, and nothing removes them.
async fn existing_tables_gain_record_states_and_their_rows_are_done<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    drop(f.inbox(InboxOptions::new().table("inbox_old")).await);
    // Back to the table as it was before the state and owner columns.
    let version = if F::NAME == "mariadb" { 3 } else { 2 };
    f.exec("ALTER TABLE inbox_old DROP COLUMN state").await;
    f.exec("ALTER TABLE inbox_old DROP COLUMN owner").await;
    f.exec(&format!("DELETE FROM inbox_old_migrations WHERE version = {version}")).await;
    f.exec("INSERT INTO inbox_old (consumer, message_id, processed_at_ms) VALUES ('c', 'm', 1)")
        .await;
    let inbox = f.inbox(InboxOptions::new().table("inbox_old")).await;
    let id = MessageId::new("m");
    assert_eq!(
        inbox.record("c", &id, "a", T0).await.expect("record"),
        Claim::Duplicate { claimed_at: Some(Timestamp::from_millis(1)) },
        "{}",
        F::NAME
    );
    assert!(!inbox.forget("c", &id, "a").await.expect("forget"));
    assert_eq!(inbox_rows(&f, "inbox_old").await, 1);
    assert_eq!(inbox.record("c", &MessageId::new("n"), "a", T0).await.expect("r"), Claim::Claimed);
}
on_all_stores!(existing_tables_gain_record_states_and_their_rows_are_done);
