//! The processor at the edges of its promise, on every store: a transaction the database
//! aborted, a cancelled begin, failures that are not the message's fault, messages without an
//! id.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::Transaction;
use twice::{Inbox, ProcessorOptions, RetryPolicy, SharedClock};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::processor::{Ship, order, processor};
use crate::support::{
    Fixture, Shutdown, create_shipments, inbox_rows, queue, shipments, until, until_async,
};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

fn options(clock: &twice::ManualClock) -> ProcessorOptions {
    ProcessorOptions::new().consumer("shipping").clock(SharedClock::from(clock.clone()))
}

fn batched(options: ProcessorOptions, batch: Option<usize>) -> ProcessorOptions {
    match batch {
        Some(n) => options.batch_size(n),
        None => options,
    }
}

/// A handler whose statement fails, and which logs the error and returns `Complete` anyway:
/// on PostgreSQL the failure aborted the transaction, and its COMMIT is a silent rollback.
/// The message is never completed without its work: the attempt counts as a handler error,
/// the message comes back, and the second attempt ships. (On MariaDB and SQLite a failed
/// statement leaves the transaction usable, and the first attempt commits.)
async fn an_aborted_transaction_is_never_completed_without_its_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    aborted_transaction(f, None).await;
}
on_all_stores!(an_aborted_transaction_is_never_completed_without_its_work);

/// The same in a batch: the failed statement aborts the handler's savepoint, and its message
/// alone fails and comes back.
async fn an_aborted_batch_is_never_completed_without_its_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    aborted_transaction(f, Some(4)).await;
}
on_all_stores!(an_aborted_batch_is_never_completed_without_its_work);

async fn aborted_transaction<F: Fixture>(f: F, batch: Option<usize>)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_aborted")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let mut handler = Ship::<F>::new();
    handler.swallow_error_once = Some(Arc::new(AtomicBool::new(true)));
    let calls = handler.calls.clone();
    let p = processor::<F>(&queue, inbox, handler, batched(options(&clock), batch)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-61-placed", 61)).await;
    until_async("completed", || async { queue.completed().await == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(shipments(&f).await, 1, "{}: the completed message has its work", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_aborted").await, 1, "{}: and its claim", F::NAME);
    assert_eq!(s.committed, 1, "{}: {s:?}", F::NAME);
    let expected_calls = if F::NAME == "postgres" { 2 } else { 1 };
    assert_eq!(calls.load(Ordering::SeqCst), expected_calls, "{}: {s:?}", F::NAME);
    // In a batch too: the handler's own savepoint is aborted, so its message alone fails.
    assert_eq!(s.handler_errors, u64::try_from(expected_calls - 1).unwrap_or(0), "{s:?}");
}

/// The database has no connection to spare (every pooled connection is busy elsewhere, a
/// two-second blip): the processor waits with backoff and tries again, renewing the lock,
/// instead of abandoning the message and spending one of its deliveries per failure.
async fn infrastructure_failures_are_retried_without_counting_a_delivery<F: Fixture>(f: F)
where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    infrastructure_failures(f, None).await;
}
on_all_stores!(infrastructure_failures_are_retried_without_counting_a_delivery);

/// The same with batches.
async fn infrastructure_failures_of_a_batch_are_retried_without_counting_a_delivery<F: Fixture>(
    f: F,
) where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    infrastructure_failures(f, Some(4)).await;
}
on_all_stores!(infrastructure_failures_of_a_batch_are_retried_without_counting_a_delivery);

async fn infrastructure_failures<F: Fixture>(f: F, batch: Option<usize>)
where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let pool = f.pool_with(2, Duration::from_millis(100)).await;
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new().table("inbox_blip"));
    let inbox = Arc::new(inbox.await.expect("inbox"));
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let retry = RetryPolicy::new().backoff(Duration::from_millis(100), Duration::from_secs(1));
    let options = batched(options(&clock).retry(retry), batch);
    let p = processor::<F>(&queue, inbox, Ship::new(), options).await;
    let counters = p.counters();
    // The blip: both connections taken before the message arrives.
    let held = (pool.acquire().await.expect("hold"), pool.acquire().await.expect("hold"));
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-81-placed", 81)).await;
    until_async("two attempts failed for want of a connection", || async {
        clock.advance(Duration::from_millis(50)); // the backoff runs on the processor's clock
        counters.snapshot().infrastructure_retries >= 2
    })
    .await;
    drop(held);
    until_async("completed", || async {
        clock.advance(Duration::from_millis(50));
        queue.completed().await == 1
    })
    .await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!((s.received, s.abandoned, s.committed), (1, 0, 1), "{}: {s:?}", F::NAME);
    assert_eq!(s.lock_lost, 0, "the lock was renewed while it waited: {s:?}");
    assert_eq!(shipments(&f).await, 1);
}

/// A handler error is retried at once as often as the policy says, then the message is handed
/// back to come again after each delayed-redelivery step; its delivery count never rises.
async fn handler_errors_are_retried_at_once_then_redelivered_later<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    handler_errors(f, None).await;
}
on_all_stores!(handler_errors_are_retried_at_once_then_redelivered_later);

/// The same in a batch: the immediate retries run under the message's savepoint.
async fn handler_errors_in_a_batch_are_retried_at_once_then_redelivered_later<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    handler_errors(f, Some(4)).await;
}
on_all_stores!(handler_errors_in_a_batch_are_retried_at_once_then_redelivered_later);

async fn handler_errors<F: Fixture>(f: F, batch: Option<usize>)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_redeliver")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let mut handler = Ship::<F>::new();
    let failures = Arc::new(AtomicUsize::new(4));
    handler.fail_times = Some(failures.clone());
    let calls = handler.calls.clone();
    let retry = RetryPolicy::new()
        .immediate_retries(1)
        .delayed_redelivery([Duration::from_secs(10), Duration::from_secs(60)]);
    let options = batched(options(&clock).retry(retry), batch);
    let p = processor::<F>(&queue, inbox, handler, options).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-82-placed", 82)).await;
    // Two attempts (one immediate retry), then the message waits 10 s.
    until("handed back for later", || counters.snapshot().delayed_redeliveries == 1).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    clock.advance(Duration::from_secs(9));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{}: not before its delay", F::NAME);
    clock.advance(Duration::from_secs(1));
    until("handed back a second time", || counters.snapshot().delayed_redeliveries == 2).await;
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    clock.advance(Duration::from_secs(60));
    until("committed", || counters.snapshot().committed == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(calls.load(Ordering::SeqCst), 5, "{s:?}");
    assert_eq!((s.immediate_retries, s.delayed_redeliveries), (2, 2), "{s:?}");
    assert_eq!((s.abandoned, s.dead_lettered), (0, 0), "{s:?}");
    assert_eq!(shipments(&f).await, 1, "{}", F::NAME);
    assert!(queue.dead_letters().await.is_empty());
    assert_eq!(queue.active_count().await, 0);
}

/// A pool with fewer connections than MaxConcurrentCalls is refused at start, with the numbers.
async fn a_pool_smaller_than_max_concurrent_calls_is_refused<F: Fixture>(f: F)
where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let pool = f.pool_with(3, Duration::from_secs(60)).await;
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new().table("inbox_small_pool"));
    let inbox = Arc::new(inbox.await.expect("inbox"));
    let (queue, clock) = queue("orders").await;
    let enough =
        processor::<F>(&queue, inbox.clone(), Ship::new(), options(&clock).max_concurrent_calls(3));
    enough.await.check().expect("3 connections for 3 calls");
    let p =
        processor::<F>(&queue, inbox, Ship::new(), options(&clock).max_concurrent_calls(4)).await;
    let err = p.run(std::future::pending()).await.expect_err("must refuse");
    let text = err.to_string();
    assert!(text.contains("3 connections, fewer than MaxConcurrentCalls 4"), "{}: {text}", F::NAME);
}
on_all_stores!(a_pool_smaller_than_max_concurrent_calls_is_refused);

/// A handler's insert refers to a row that is not there yet (the message about the order
/// overtook the one that creates it): the foreign-key violation is retried like any other
/// unclassified error, on every store, and the redelivery after the parent arrived succeeds.
/// It is not dead-lettered at once. The retry is a delayed redelivery on the processor's
/// clock, so no loop of failed deliveries can spend MaxDeliveryCount before the parent row is
/// written, however slow the machine.
async fn a_foreign_key_violation_is_retried_on_every_store<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    f.exec("CREATE TABLE orders (id BIGINT NOT NULL PRIMARY KEY)").await;
    f.exec(
        "CREATE TABLE shipments (order_id BIGINT NOT NULL, message_id VARCHAR(255) NOT NULL, \
         FOREIGN KEY (order_id) REFERENCES orders (id))",
    )
    .await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_fk")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let retry = RetryPolicy::new().delayed_redelivery([Duration::from_secs(60)]);
    let p = processor::<F>(&queue, inbox, Ship::new(), options(&clock).retry(retry)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-91-shipped", 91)).await;
    until("the first delivery handed back for later", || {
        let s = counters.snapshot();
        s.delayed_redeliveries + s.abandoned + s.dead_lettered >= 1
    })
    .await;
    let first = counters.snapshot();
    f.exec("INSERT INTO orders (id) VALUES (91)").await;
    clock.advance(Duration::from_secs(60));
    until("committed", || counters.snapshot().committed == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    assert_eq!(
        (first.delayed_redeliveries, first.abandoned, first.dead_lettered),
        (1, 0, 0),
        "{}: a foreign-key violation is retried, not dead-lettered at once: {first:?}",
        F::NAME
    );
    assert_eq!(shipments(&f).await, 1, "{}", F::NAME);
    assert!(queue.dead_letters().await.is_empty());
    assert_eq!(queue.active_count().await, 0);
}
on_all_stores!(a_foreign_key_violation_is_retried_on_every_store);

/// PostgreSQL: a registered business key declared `DEFERRABLE INITIALLY DEFERRED` is checked at
/// COMMIT, after the handler returned `Complete`. The commit's unique violation is classified
/// by its constraint as a business-key duplicate: the message completes as one, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deferred_business_key_fires_at_commit_as_a_duplicate() {
    use crate::support::Pg;
    let Some(f) = <Pg as Fixture>::create().await else { return };
    create_shipments(&f, false).await;
    f.exec(
        "ALTER TABLE shipments ADD CONSTRAINT shipments_order_id UNIQUE (order_id) \
         DEFERRABLE INITIALLY DEFERRED",
    )
    .await;
    let inbox = Arc::new(
        f.inbox(
            InboxOptions::new()
                .table("inbox_deferred")
                .business_key("shipments", "shipments_order_id"),
        )
        .await,
    );
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let at_commit = Arc::new(std::sync::Mutex::new(Vec::new()));
    let p = processor::<Pg>(&queue, inbox, Ship::new(), options(&clock)).await;
    let p = p.on_business_key_duplicate({
        let at_commit = Arc::clone(&at_commit);
        move |d: &twice::BusinessKeyDuplicate| at_commit.lock().unwrap().push(d.at_commit)
    });
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-5-placed-a", 5)).await;
    queue.send(order("order-5-placed-b", 5)).await;
    until_async("both completed", || async { queue.completed().await == 2 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    assert_eq!(*at_commit.lock().unwrap(), vec![true], "reported as fired at COMMIT");
    let s = counters.snapshot();
    assert_eq!(shipments(&f).await, 1);
    assert_eq!(s.duplicates_business_key, 1, "{s:?}");
    assert_eq!((s.committed, s.completed), (1, 2), "{s:?}");
    assert_eq!(s.abandoned + s.dead_lettered + s.infrastructure_retries, 0, "{s:?}");
    assert_eq!(inbox_rows(&f, "inbox_deferred").await, 1, "the losing claim rolled back");
}
