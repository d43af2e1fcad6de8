//! The claim's transaction whatever the pool's isolation level, and a waiting claim whose
//! message lock runs out.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Transaction;
use tokio::sync::{Semaphore, mpsc};
use twice::{Inbox, ProcessorOptions, SharedClock, Stopwatch};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_server_stores;
use crate::processor::{Ship, order, processor};
use crate::support::{BrokerQueue, Fixture, Shutdown, create_shipments, queue, shipments, until};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

/// Two overlapping copies on a pool whose sessions run at REPEATABLE READ, then at
/// SERIALIZABLE: the second copy waits on the first one's claim and, once the first commits,
/// completes as a duplicate: no serialization failure, no retry.
async fn a_waiting_copy_completes_as_a_duplicate_at_any_isolation_level<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    F::DB: twice_sqlx::Backend,
{
    create_shipments(&f, false).await;
    let levels: [(&str, &'static str); 2] = if F::NAME == "postgres" {
        [
            (
                "repeatable_read",
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            ),
            (
                "serializable",
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            ),
        ]
    } else {
        [
            ("repeatable_read", "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"),
            ("serializable", "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"),
        ]
    };
    for (round, (level, statement)) in levels.into_iter().enumerate() {
        let pool = f.pool_after_connect(4, statement).await;
        let table = format!("inbox_{level}");
        let inbox =
            Arc::new(SqlxInbox::new(pool, InboxOptions::new().table(table)).await.expect("inbox"));
        let (queue, clock) = queue("orders").await;
        let options =
            || ProcessorOptions::new().consumer("shipping").clock(SharedClock::from(clock.clone()));
        let id = format!("order-{round}-placed");
        let order_id = i64::try_from(round).expect("small");

        let (entered_tx, mut entered) = mpsc::unbounded_channel();
        let gate = Arc::new(Semaphore::new(0));
        let mut first = Ship::<F>::new();
        first.entered = Some(entered_tx);
        first.gate = Some(gate.clone());
        let a = processor::<F>(&queue, inbox.clone(), first, options()).await;
        let ca = a.counters();
        let stop_a = Shutdown::default();
        let ta = tokio::spawn(a.run(stop_a.wait()));
        queue.send(order(&id, order_id)).await;
        entered.recv().await.expect("first copy entered its handler");

        let second = Ship::<F>::new();
        let second_calls = second.calls.clone();
        let b = processor::<F>(&queue, inbox.clone(), second, options()).await;
        let cb = b.counters();
        let stop_b = Shutdown::default();
        let tb = tokio::spawn(b.run(stop_b.wait()));
        queue.send(order(&id, order_id)).await;
        crate::support::until_async("the second claim waits on the first", || async {
            f.lock_waiters().await == Some(1)
        })
        .await;

        stop_a.trigger();
        gate.add_permits(1);
        crate::support::until_async("both copies completed", || async {
            queue.completed().await == 2
        })
        .await;
        stop_b.trigger();
        ta.await.expect("join").expect("run");
        tb.await.expect("join").expect("run");

        let (sa, sb) = (ca.snapshot(), cb.snapshot());
        assert_eq!(sa.committed, 1, "{} {level}: {sa:?}", F::NAME);
        assert_eq!(sb.duplicates_concurrent_copy, 1, "{} {level}: {sb:?}", F::NAME);
        assert_eq!(sb.infrastructure_retries, 0, "{} {level}: no serialization failure", F::NAME);
        assert_eq!(second_calls.load(Ordering::SeqCst), 0, "{level}: the second copy did no work");
    }
    assert_eq!(shipments(&f).await, 2, "{}: one shipment per message", F::NAME);
}
on_server_stores!(a_waiting_copy_completes_as_a_duplicate_at_any_isolation_level);

/// The lock of the queue in the lock-wait scenario: short, because the scenario waits for it to
/// run out on the system clock.
const LOCK: Duration = Duration::from_secs(5);

/// The first copy holds its claim (its handler waits); the second copy's claim waits on it,
/// on a pool of one connection and with one concurrent call, and its lock, not renewed, runs
/// out while it waits. The database ends the wait when the lock runs out: within a second of
/// that the second processor's connection is back in its pool and its one concurrent call is
/// free, so another message is processed while the first copy still holds its claim.
async fn a_copy_whose_lock_runs_out_while_it_waits_frees_its_connection_and_permit<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    F::DB: twice_sqlx::Backend,
{
    create_shipments(&f, false).await;
    let table = "inbox_lock_wait";
    let inbox = Arc::new(f.inbox(InboxOptions::new().table(table)).await);
    // The system clock: the database's lock wait runs on it.
    let broker = Broker::open(BrokerOptions::in_memory()).await.expect("open broker");
    broker
        .create_queue(
            "orders",
            QueueProperties::default().with_lock_duration(LOCK).with_max_delivery_count(1),
        )
        .await
        .expect("create queue");
    let queue = BrokerQueue::existing(broker, "orders");
    let shutdown = Shutdown::default();

    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let mut first = Ship::<F>::new();
    first.entered = Some(entered_tx);
    first.gate = Some(gate.clone());
    let a =
        processor::<F>(&queue, inbox.clone(), first, ProcessorOptions::new().consumer("shipping"))
            .await;
    let ca = a.counters();
    let ta = tokio::spawn(a.run(shutdown.wait()));
    queue.send(order("order-7-placed", 7)).await;
    entered.recv().await.expect("first copy entered its handler");

    // The second processor: one connection, one call, no lock renewal.
    let pool = f.pool_with(1, Duration::from_secs(60)).await;
    let inbox_b = Arc::new(
        SqlxInbox::new(pool.clone(), InboxOptions::new().table(table).migrate(false))
            .await
            .expect("inbox"),
    );
    let b = processor::<F>(
        &queue,
        inbox_b,
        Ship::new(),
        ProcessorOptions::new()
            .consumer("shipping")
            .max_concurrent_calls(1)
            .max_auto_lock_renewal_duration(Duration::ZERO),
    )
    .await;
    let cb = b.counters();
    let tb = tokio::spawn(b.run(shutdown.wait()));
    queue.send(order("order-7-placed", 7)).await;
    crate::support::until_async("the second claim waits on the first", || async {
        f.lock_waiters().await == Some(1)
    })
    .await;
    let waiting = Stopwatch::start();
    assert_eq!(pool.num_idle(), 0, "{}: the waiting claim holds the connection", F::NAME);

    // Within a second of the lock's end: the connection is idle in the pool and the copy is
    // settled as lost, which ends its task and frees its permit.
    let freed = tokio::time::timeout(
        LOCK + Duration::from_secs(1),
        until("the connection and the permit are free", || {
            pool.num_idle() == 1 && cb.snapshot().lock_lost == 1
        }),
    )
    .await;
    assert!(
        freed.is_ok(),
        "{}: {:?} after the wait was seen, idle connections {}, {:?}",
        F::NAME,
        waiting.elapsed(),
        pool.num_idle(),
        cb.snapshot()
    );

    // The permit and the connection serve another message while the first copy still holds
    // its claim.
    queue.send(order("order-8-placed", 8)).await;
    let served = tokio::time::timeout(
        Duration::from_secs(30),
        until("the other message committed", || cb.snapshot().committed == 1),
    )
    .await;
    assert!(served.is_ok(), "{}: {:?}", F::NAME, cb.snapshot());
    assert_eq!(ca.snapshot().committed, 0, "the first copy still holds its claim");

    gate.add_permits(1);
    let done = tokio::time::timeout(
        Duration::from_secs(30),
        until("the first copy committed", || ca.snapshot().committed == 1),
    )
    .await;
    assert!(done.is_ok(), "{}: {:?}", F::NAME, ca.snapshot());
    shutdown.trigger();
    ta.await.expect("join").expect("run");
    tb.await.expect("join").expect("run");
    assert_eq!(shipments(&f).await, 2, "{}: orders 7 and 8, once each", F::NAME);
}
on_server_stores!(a_copy_whose_lock_runs_out_while_it_waits_frees_its_connection_and_permit);
