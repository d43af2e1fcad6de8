//! The processor's guarantees, as the seeds state them, on every store.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;
use sqlx::Transaction;
use tokio::sync::{Barrier, Semaphore, mpsc};
use twice::{
    Context, DESERIALIZATION_FAILED, HandlerError, Inbox, Json, JsonHandler, Message, Mode,
    Outcome, Processor, ProcessorOptions, SharedClock,
};
use twice_broker::Receiver;
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::support::{
    BrokerQueue, Fixture, Shutdown, create_shipments, inbox_rows, queue, shipments, until,
    until_async,
};

/// The broker's reason for a message delivered MaxDeliveryCount times.
const MAX_DELIVERY_COUNT_EXCEEDED: &str = "MaxDeliveryCountExceeded";

#[derive(Deserialize)]
pub struct OrderPlaced {
    pub order_id: i64,
}

pub fn order(message_id: &str, order_id: i64) -> Message {
    Message::new(format!(r#"{{"order_id":{order_id}}}"#)).with_message_id(message_id)
}

/// The seed's handler: one shipment per order, with knobs for the scenarios.
pub struct Ship<F> {
    pub calls: Arc<AtomicUsize>,
    /// Told the message id once the shipment row is written (still uncommitted).
    pub entered: Option<mpsc::UnboundedSender<String>>,
    /// When set, the handler waits for a permit after writing (forever if none comes).
    pub gate: Option<Arc<Semaphore>>,
    /// When set, the handler fails transiently after writing.
    pub fail: bool,
    /// When set (and still true), the handler panics after writing, once.
    pub panic_once: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// When set (and still true), the handler runs a statement that fails after writing, once,
    /// ignores the error and returns `Complete` (a handler that logs and carries on).
    pub swallow_error_once: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// While above zero, the handler fails transiently after writing and counts it down.
    pub fail_times: Option<Arc<AtomicUsize>>,
    /// When set (and still true), the handler fails permanently after writing (and after the
    /// gate), once.
    pub fail_permanently_once: Option<Arc<std::sync::atomic::AtomicBool>>,
    _store: PhantomData<fn() -> F>,
}

impl<F> Ship<F> {
    pub fn new() -> Self {
        Self {
            calls: Arc::default(),
            entered: None,
            gate: None,
            fail: false,
            panic_once: None,
            swallow_error_once: None,
            fail_times: None,
            fail_permanently_once: None,
            _store: PhantomData,
        }
    }
}

impl<F: Fixture> JsonHandler<OrderPlaced, Transaction<'static, F::DB>> for Ship<F> {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        order: OrderPlaced,
        tx: &'a mut Transaction<'static, F::DB>,
    ) -> Result<Outcome, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        F::insert_shipment(tx, order.order_id, ctx.message_id().as_str()).await?;
        if self.swallow_error_once.as_ref().is_some_and(|p| p.swap(false, Ordering::SeqCst)) {
            let failed = F::try_exec(tx, "INSERT INTO no_such_table (x) VALUES (1)").await;
            assert!(failed.is_err(), "the statement must fail");
        }
        if let Some(entered) = &self.entered {
            let _ = entered.send(ctx.message_id().to_string());
        }
        if let Some(gate) = &self.gate {
            match gate.acquire().await {
                Ok(permit) => permit.forget(),
                Err(_) => std::future::pending::<()>().await,
            }
        }
        let fail_now = self.fail_times.as_ref().is_some_and(|n| {
            n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
        });
        if self.fail_permanently_once.as_ref().is_some_and(|p| p.swap(false, Ordering::SeqCst)) {
            return Err(HandlerError::permanent(
                "Refused",
                std::io::Error::other("downstream refused this attempt"),
            ));
        }
        if self.fail || fail_now {
            return Err(HandlerError::transient(std::io::Error::other("downstream unavailable")));
        }
        if self.panic_once.as_ref().is_some_and(|p| p.swap(false, Ordering::SeqCst)) {
            panic!("a bug in the handler");
        }
        Ok(Outcome::Complete)
    }
}

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

/// A processor of `queue` with the `Ship` handler, claiming in `inbox`.
pub async fn processor<F: Fixture>(
    queue: &BrokerQueue,
    inbox: Arc<Inboxed<F>>,
    handler: Ship<F>,
    options: ProcessorOptions,
) -> Processor<Receiver, Inboxed<F>, Json<Ship<F>, OrderPlaced>>
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let receiver = Arc::new(queue.receiver().await);
    Processor::from_arcs(receiver, inbox, Arc::new(Json::new(handler)), options)
        .on_error(|e| eprintln!("{} processor: {e}", F::NAME))
}

fn options(clock: &twice::ManualClock) -> ProcessorOptions {
    ProcessorOptions::new().consumer("shipping").clock(SharedClock::from(clock.clone()))
}

/// Two copies of one message, taken by two processors at the same instant, 200 times: one
/// shipment each time.
async fn two_copies_at_the_same_instant<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    const ROUNDS: usize = 200;
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_same_instant")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let a = processor::<F>(&queue, inbox.clone(), Ship::new(), options(&clock)).await;
    let b = processor::<F>(&queue, inbox.clone(), Ship::new(), options(&clock)).await;
    let (ca, cb) = (a.counters(), b.counters());
    let ta = tokio::spawn(a.run(shutdown.wait()));
    let tb = tokio::spawn(b.run(shutdown.wait()));
    for round in 0..ROUNDS {
        let id = format!("order-{round}-placed");
        let order_id = i64::try_from(round).expect("small");
        // A sender-side duplicate: two copies of one message, each waking a processor.
        queue.send(order(&id, order_id)).await;
        queue.send(order(&id, order_id)).await;
        until_async("both copies completed", || async {
            queue.completed().await == u64::try_from(2 * (round + 1)).unwrap_or(u64::MAX)
        })
        .await;
    }
    shutdown.trigger();
    ta.await.expect("join").expect("run a");
    tb.await.expect("join").expect("run b");

    let (sa, sb) = (ca.snapshot(), cb.snapshot());
    let rounds = i64::try_from(ROUNDS).expect("small");
    assert_eq!(shipments(&f).await, rounds, "{}: one shipment per message", F::NAME);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM (SELECT order_id FROM shipments GROUP BY order_id HAVING COUNT(*) > 1) d")
            .await,
        0
    );
    assert_eq!(inbox_rows(&f, "inbox_same_instant").await, rounds);
    assert_eq!(sa.committed + sb.committed, 200);
    let duplicates = sa.duplicates_already_processed
        + sb.duplicates_already_processed
        + sa.duplicates_concurrent_copy
        + sb.duplicates_concurrent_copy;
    assert_eq!(duplicates, 200, "{sa:?} {sb:?}");
    assert_eq!(sa.completed + sb.completed, 400);
    assert_eq!(sa.abandoned + sb.abandoned, 0, "{sa:?} {sb:?}");
    println!(
        "{}: {} of {ROUNDS} duplicates were concurrent copies (the claim waited or raced)",
        F::NAME,
        sa.duplicates_concurrent_copy + sb.duplicates_concurrent_copy
    );
}
on_all_stores!(two_copies_at_the_same_instant);

/// How long a step of an overlap scenario may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(120);

/// Awaits `step`, failing the test with `what` if it takes longer than [`STEP`].
async fn within<T>(what: &str, step: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(STEP, step).await {
        Ok(done) => done,
        Err(_) => panic!("gave up waiting for: {what}"),
    }
}

/// Copies of one message whose claims provably overlap: the first copy holds its claim,
/// uncommitted, in its handler; `waiting` more copies are received by processors of their
/// own and their claims are observed waiting on the first one's lock (PostgreSQL: `pg_locks`;
/// MariaDB: the claim statements still running; SQLite: received, no claim returned, no
/// handler called). Then the first ends as `first_commits` says, and the others see that
/// outcome: exactly one copy's work is kept, nothing is dead-lettered.
///
/// With two or more waiters on MariaDB, a first copy that rolls back leaves the waiters
/// holding shared locks on the key, each wanting the exclusive one: InnoDB picks all but one
/// as deadlock victims (error 1213), which the processor retries in process, and their next
/// claims find the winner's.
async fn overlapping_copies<F: Fixture>(f: F, first_commits: bool, waiting: usize)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_overlap")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();

    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let mut first = Ship::<F>::new();
    first.entered = Some(entered_tx);
    first.gate = Some(gate.clone());
    first.fail = !first_commits;
    let a = processor::<F>(&queue, inbox.clone(), first, options(&clock)).await;
    let ca = a.counters();
    // The first processor stops after this message, so an abandoned copy's redelivery goes to
    // another processor and cannot overtake the waiting copies.
    let stop_a = Shutdown::default();
    let ta = tokio::spawn(a.run(stop_a.wait()));
    queue.send(order("order-7-placed", 7)).await;
    within("the first copy to enter its handler", entered.recv()).await.expect("entered");

    // The other copies arrive while the first holds an uncommitted claim, one processor each
    // (one concurrent call each, so no processor takes two).
    let calls = Arc::new(AtomicUsize::new(0));
    let mut others = Vec::new();
    for _ in 0..waiting {
        let mut handler = Ship::<F>::new();
        handler.calls = Arc::clone(&calls);
        let retry = twice::RetryPolicy::new()
            .backoff(Duration::from_millis(10), Duration::from_millis(100));
        let p = processor::<F>(&queue, inbox.clone(), handler, options(&clock).retry(retry)).await;
        let counters = p.counters();
        others.push((counters, tokio::spawn(p.run(shutdown.wait()))));
    }
    for _ in 0..waiting {
        queue.send(order("order-7-placed", 7)).await;
    }
    let sum = |pick: fn(&twice::CounterSnapshot) -> u64| -> u64 {
        others.iter().map(|(c, _)| pick(&c.snapshot())).sum()
    };
    let expected = i64::try_from(waiting).expect("small");
    if f.lock_waiters().await.is_some() {
        until_async("the other claims wait on the first", || async {
            f.lock_waiters().await == Some(expected)
        })
        .await;
    } else {
        until("the other copies are received", || sum(|s| s.received) == waiting as u64).await;
    }
    assert_eq!(sum(|s| s.claims), 0, "{}: no other claim has returned", F::NAME);
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the other copies must wait");

    stop_a.trigger();
    gate.add_permits(1); // the first copy now commits, or fails and rolls back
    let all = u64::try_from(waiting + 1).expect("small");
    // A deadlock victim is retried after a backoff on the processor's clock, which only the
    // test moves: without this advance the victim would wait for ever.
    let completed = async {
        while queue.completed().await < all {
            clock.advance(Duration::from_millis(10));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    if tokio::time::timeout(STEP, completed).await.is_err() {
        let snapshots: Vec<_> = others.iter().map(|(c, _)| c.snapshot()).collect();
        panic!(
            "{}: gave up waiting for every copy to complete ({} of {all}): first {:?}, \
             others {snapshots:?}",
            F::NAME,
            queue.completed().await,
            ca.snapshot()
        );
    }
    shutdown.trigger();
    within("the first processor to stop", ta).await.expect("join").expect("run");
    let (counters, tasks): (Vec<_>, Vec<_>) = others.into_iter().unzip();
    for task in tasks {
        within("a processor to stop", task).await.expect("join").expect("run");
    }

    let sa = ca.snapshot();
    let others: Vec<_> = counters.iter().map(|c| c.snapshot()).collect();
    assert_eq!(shipments(&f).await, 1, "{}", F::NAME);
    let committed: u64 = others.iter().map(|s| s.committed).sum();
    let duplicates: u64 =
        others.iter().map(|s| s.duplicates_already_processed + s.duplicates_concurrent_copy).sum();
    let retried: u64 = others.iter().map(|s| s.infrastructure_retries).sum();
    let abandoned: u64 = others.iter().map(|s| s.abandoned + s.dead_lettered).sum();
    println!("{}: {waiting} waiting copies, {retried} retried in process", F::NAME);
    if first_commits {
        assert_eq!((sa.committed, committed), (1, 0), "{sa:?} {others:?}");
        let concurrent: u64 = others.iter().map(|s| s.duplicates_concurrent_copy).sum();
        assert_eq!(concurrent, waiting as u64, "{}: {others:?}", F::NAME);
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the other copies did no work");
    } else {
        // The first copy was abandoned; one waiting copy did the work, and the rest (the
        // first copy's redelivery among them) met its claim.
        assert_eq!(sa.abandoned, 1, "{sa:?}");
        assert_eq!(committed, 1, "{}: {others:?}", F::NAME);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{}: the work was done once", F::NAME);
        assert_eq!(duplicates, waiting as u64, "{}: {others:?}", F::NAME);
    }
    // On MariaDB every waiter but one is a deadlock victim when the first rolls back; the
    // others' waits end without an error.
    let victims = if F::NAME == "mariadb" && !first_commits { waiting - 1 } else { 0 };
    assert_eq!(retried, victims as u64, "{}: {others:?}", F::NAME);
    assert_eq!(abandoned, 0, "{}: no waiting copy was abandoned: {others:?}", F::NAME);
    assert!(queue.dead_letters().await.is_empty());
}

async fn first_copy_rolls_back_second_does_the_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    overlapping_copies(f, false, 1).await;
}
on_all_stores!(first_copy_rolls_back_second_does_the_work);

async fn first_copy_commits_second_waits_then_is_a_duplicate<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    overlapping_copies(f, true, 1).await;
}
on_all_stores!(first_copy_commits_second_waits_then_is_a_duplicate);

/// Three copies: the first rolls back while two wait on its claim (on MariaDB, the waiters
/// deadlock and one is the victim); one of the two does the work, once.
async fn three_copies_first_rolls_back_one_other_does_the_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    overlapping_copies(f, false, 2).await;
}
on_all_stores!(three_copies_first_rolls_back_one_other_does_the_work);

/// Three copies: the first commits while two wait on its claim; both are duplicates.
async fn three_copies_first_commits_both_others_are_duplicates<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    overlapping_copies(f, true, 2).await;
}
on_all_stores!(three_copies_first_commits_both_others_are_duplicates);

/// A handler outlives its lock (no renewal); the message goes to a second receiver while the
/// first is still running; the first is cancelled and rolled back: one shipment.
async fn handler_outlives_its_lock<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_lock")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();

    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let mut slow = Ship::<F>::new();
    slow.entered = Some(entered_tx);
    slow.gate = Some(Arc::new(Semaphore::new(0))); // never opens: a handler stuck downstream
    let a = processor::<F>(
        &queue,
        inbox.clone(),
        slow,
        options(&clock).max_auto_lock_renewal_duration(Duration::ZERO),
    )
    .await;
    let ca = a.counters();
    // The first processor stops receiving once its handler runs (its run then waits for that
    // handler): the redelivery must go to the second, not back into the stuck handler, however
    // late the second processor's task gets to its first receive.
    let stop_a = Shutdown::default();
    let ta = tokio::spawn(a.run(stop_a.wait()));
    queue.send(order("order-9-placed", 9)).await;
    entered.recv().await.expect("first copy entered its handler");
    stop_a.trigger();

    let b = processor::<F>(&queue, inbox.clone(), Ship::new(), options(&clock)).await;
    let cb = b.counters();
    let tb = tokio::spawn(b.run(shutdown.wait()));
    // The lock runs out: the broker hands the message to the second receiver, and the first
    // receiver's processor cancels its handler.
    clock.advance(Duration::from_secs(31));
    until_async("the second copy completed", || async { queue.completed().await == 1 }).await;
    until("the first copy saw its lock lost", || ca.snapshot().lock_lost == 1).await;
    shutdown.trigger();
    ta.await.expect("join").expect("run");
    tb.await.expect("join").expect("run");

    let (sa, sb) = (ca.snapshot(), cb.snapshot());
    assert_eq!(shipments(&f).await, 1, "{}", F::NAME);
    assert_eq!(sa.committed, 0, "{sa:?}");
    assert_eq!(sa.completed, 0, "{sa:?}");
    assert_eq!(sb.committed, 1, "{sb:?}");
    assert_eq!(queue.active_count().await, 0);
}
on_all_stores!(handler_outlives_its_lock);

/// The same order published twice under different message ids: the unique business key
/// catches the second; both messages are completed.
async fn business_key_catches_a_republished_event<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, true).await;
    let inbox = Arc::new(
        f.inbox(
            InboxOptions::new()
                .table("inbox_business")
                .business_key("shipments", "shipments_order_id"),
        )
        .await,
    );
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let reported = Arc::new(std::sync::Mutex::new(Vec::new()));
    let p =
        processor::<F>(&queue, inbox, Ship::new(), options(&clock).max_concurrent_calls(2)).await;
    let p = p.on_business_key_duplicate({
        let reported = Arc::clone(&reported);
        move |d: &twice::BusinessKeyDuplicate| {
            reported.lock().unwrap().push((d.message_id.as_str().to_owned(), d.constraint.clone()));
        }
    });
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-5-placed-a", 5)).await;
    queue.send(order("order-5-placed-b", 5)).await;
    until_async("both completed", || async { queue.completed().await == 2 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(shipments(&f).await, 1, "{}", F::NAME);
    assert_eq!(s.duplicates_business_key, 1, "{s:?}");
    assert_eq!(s.committed, 1, "{s:?}");
    assert_eq!(s.completed, 2, "{s:?}");
    assert_eq!(s.abandoned + s.dead_lettered, 0, "{s:?}");
    // The losing message's claim was rolled back with its work.
    assert_eq!(inbox_rows(&f, "inbox_business").await, 1);
    // The application hears of it: a constant key written by a buggy handler would otherwise
    // turn every later message into a silent duplicate.
    let reported = reported.lock().unwrap().clone();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(reported[0].0.starts_with("order-5-placed-"), "{reported:?}");
    assert_eq!(reported[0].1, "shipments_order_id", "{reported:?}");
}
on_all_stores!(business_key_catches_a_republished_event);

/// A handler that always fails is retried until MaxDeliveryCount, then the broker
/// dead-letters the message; no claim is left behind.
async fn always_failing_handler_is_dead_lettered<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_poison")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let mut failing = Ship::<F>::new();
    failing.fail = true;
    let calls = failing.calls.clone();
    let p = processor::<F>(&queue, inbox, failing, options(&clock)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-3-placed", 3)).await;
    // The dead-lettering happens on the receive after the tenth abandon.
    until_async("dead-lettered", || async { queue.dead_letters().await.len() == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let dead = queue.dead_letters().await;
    assert_eq!(dead[0].dead_letter_reason.as_deref(), Some(MAX_DELIVERY_COUNT_EXCEEDED));
    // MaxDeliveryCount deliveries reached the handler; the broker took it from there.
    assert_eq!(calls.load(Ordering::SeqCst), 10);
    let s = counters.snapshot();
    assert_eq!(s.abandoned, 10, "{s:?}");
    assert_eq!(s.handler_errors, 10, "{s:?}");
    assert_eq!(shipments(&f).await, 0, "{}", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_poison").await, 0, "claims are rolled back");
}
on_all_stores!(always_failing_handler_is_dead_lettered);

/// A body that is not JSON is dead-lettered at once with `DeserializationFailed`.
async fn bad_json_is_dead_lettered_at_once<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_bad_json")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let handler = Ship::<F>::new();
    let calls = handler.calls.clone();
    let p = processor::<F>(&queue, inbox, handler, options(&clock)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(Message::new("{not json").with_message_id("order-x-placed")).await;
    until_async("dead-lettered", || async { queue.dead_letters().await.len() == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let dead = queue.dead_letters().await;
    assert_eq!(dead[0].dead_letter_reason.as_deref(), Some(DESERIALIZATION_FAILED));
    assert_eq!(dead[0].delivery_count, 1, "dead-lettered on the first delivery");
    let description = dead[0].dead_letter_error_description.clone().unwrap_or_default();
    assert!(description.contains("line 1"), "the parse error is the description: {description}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(counters.snapshot().dead_lettered, 1);
    assert_eq!(inbox_rows(&f, "inbox_bad_json").await, 0);
}
on_all_stores!(bad_json_is_dead_lettered_at_once);

/// Seed 2's strategy 3 as written ("check, then insert" in one transaction) lets two copies
/// that race both pass the check: the payment is charged twice (and, on PostgreSQL and MariaDB,
/// the order shipped twice). The claim, under the same race, charges and ships once.
async fn check_then_insert_double_processes_the_claim_does_not<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    f.exec("CREATE TABLE naive_processed (id VARCHAR(255) NOT NULL)").await;

    // Strategy 3 as written, run by two copies that both reach the check before either saves.
    let charges = Arc::new(AtomicUsize::new(0));
    let both_checked = Arc::new(Barrier::new(2));
    let copies = (0..2).map(|_| {
        let pool = f.pool().clone();
        let charges = charges.clone();
        let both_checked = both_checked.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await?;
            if F::naive_seen(&mut tx, "order-1-placed").await? {
                return Ok::<_, sqlx::Error>(());
            }
            both_checked.wait().await;
            charges.fetch_add(1, Ordering::SeqCst); // the payment API, outside the database
            F::naive_record(&mut tx, "order-1-placed").await?;
            F::insert_shipment(&mut tx, 1, "order-1-placed").await?;
            tx.commit().await
        })
    });
    let results: Vec<_> = futures::future::join_all(copies).await;
    let naive_shipments = shipments(&f).await;
    assert_eq!(charges.load(Ordering::SeqCst), 2, "{}: both copies charged", F::NAME);
    if F::NAME == "sqlite" {
        // SQLite refuses the second writer's stale snapshot, so only the payment doubled.
        assert!(naive_shipments >= 1);
    } else {
        assert_eq!(naive_shipments, 2, "{}: both copies shipped", F::NAME);
        assert!(results.iter().all(|r| matches!(r, Ok(Ok(())))));
    }

    // The claim under the same race: two copies at once, charged in the handler.
    f.exec("DELETE FROM shipments").await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_versus")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let a_handler = Ship::<F>::new();
    let b_handler = Ship::<F>::new();
    let (ca_calls, cb_calls) = (a_handler.calls.clone(), b_handler.calls.clone());
    let a = processor::<F>(&queue, inbox.clone(), a_handler, options(&clock)).await;
    let b = processor::<F>(&queue, inbox.clone(), b_handler, options(&clock)).await;
    let ta = tokio::spawn(a.run(shutdown.wait()));
    let tb = tokio::spawn(b.run(shutdown.wait()));
    const ROUNDS: usize = 20;
    for round in 0..ROUNDS {
        let id = format!("order-{round}-versus");
        queue.send(order(&id, i64::try_from(round).expect("small"))).await;
        queue.send(order(&id, i64::try_from(round).expect("small"))).await;
        until_async("both copies completed", || async {
            queue.completed().await == u64::try_from(2 * (round + 1)).unwrap_or(u64::MAX)
        })
        .await;
    }
    shutdown.trigger();
    ta.await.expect("join").expect("run");
    tb.await.expect("join").expect("run");
    let handler_runs = ca_calls.load(Ordering::SeqCst) + cb_calls.load(Ordering::SeqCst);
    assert_eq!(handler_runs, ROUNDS, "{}: one charge per message", F::NAME);
    assert_eq!(shipments(&f).await, i64::try_from(ROUNDS).expect("small"));
}
on_all_stores!(check_then_insert_double_processes_the_claim_does_not);

/// Natural idempotency: no claim, the handler's upsert makes the second run a no-op.
async fn naturally_idempotent_mode_runs_without_a_claim<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, true).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_natural")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let handler = Ship::<F>::new();
    let calls = handler.calls.clone();
    // The unique order id plays the upsert's part here: a second run would fail, so this
    // shows the mode runs the handler twice and takes no claim.
    let p = processor::<F>(&queue, inbox, handler, options(&clock).mode(Mode::NaturallyIdempotent))
        .await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-11-placed", 11)).await;
    until_async("completed", || async { queue.completed().await == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(counters.snapshot().claims, 0);
    assert_eq!(inbox_rows(&f, "inbox_natural").await, 0);
    assert_eq!(shipments(&f).await, 1);
}
on_all_stores!(naturally_idempotent_mode_runs_without_a_claim);

/// A retention shorter than the redelivery horizon stops the processor before it starts.
async fn short_retention_is_refused<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let (queue, clock) = queue("orders").await;
    // 10 deliveries × 30 s lock + 5 min renewal = 10 min.
    let enough = Arc::new(
        f.inbox(
            InboxOptions::new().table("inbox_retention").retention(Some(Duration::from_secs(600))),
        )
        .await,
    );
    processor::<F>(&queue, enough, Ship::new(), options(&clock))
        .await
        .check()
        .expect("600 s is enough");
    let short = Arc::new(
        f.inbox(
            InboxOptions::new().table("inbox_retention").retention(Some(Duration::from_secs(599))),
        )
        .await,
    );
    let p = processor::<F>(&queue, short, Ship::new(), options(&clock)).await;
    let err = p.run(std::future::pending()).await.expect_err("must refuse");
    let text = err.to_string();
    assert!(text.contains("599 s"), "{text}");
    assert!(text.contains("for 10 min"), "{text}");
    assert!(
        text.contains("MaxDeliveryCount 10 × LockDuration 30 s + MaxAutoLockRenewalDuration 5 min"),
        "{text}"
    );
}
on_all_stores!(short_retention_is_refused);

/// A dead-lettered message resubmitted with its own id comes back to the claim it may have
/// made: a retention shorter than the oldest resubmit stops the processor, with the numbers.
async fn a_resubmit_older_than_the_retention_is_refused<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let (queue, clock) = queue("orders").await;
    let days = |n: u64| Duration::from_secs(n * 24 * 3600);
    let resubmits = options(&clock).max_resubmit_age(Some(days(3)));
    // Lock and deliveries ask for 10 min, the resubmits for 3 days.
    let week = Arc::new(
        f.inbox(InboxOptions::new().table("inbox_resubmit").retention(Some(days(7)))).await,
    );
    processor::<F>(&queue, week, Ship::new(), resubmits.clone())
        .await
        .check()
        .expect("7 days cover resubmits of up to 3 days");
    let day = Arc::new(
        f.inbox(InboxOptions::new().table("inbox_resubmit").retention(Some(days(1)))).await,
    );
    let p = processor::<F>(&queue, day, Ship::new(), resubmits).await;
    let text = p.check().expect_err("must refuse").to_string();
    assert!(text.contains("for 1 d"), "{text}");
    assert!(text.contains("for 3 d"), "{text}");
    assert!(text.contains("resubmitted from the dead-letter queue up to 3 d"), "{text}");
}
on_all_stores!(a_resubmit_older_than_the_retention_is_refused);

/// A session's messages are handled one at a time, in order, and a duplicate inside the
/// session still meets the claim; the session processor's health says it is receiving while it
/// runs, when it last completed, and not after it stops.
async fn session_processor_keeps_order_and_claims<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_sessions")).await);
    let clock = twice::ManualClock::default();
    let broker =
        twice_broker::Broker::open(twice_broker::BrokerOptions::in_memory().clock(clock.clone()))
            .await
            .expect("broker");
    broker
        .create_queue(
            "order-events",
            twice_broker::config::QueueProperties::default()
                .with_lock_duration(Duration::from_secs(30))
                .with_requires_session(true),
        )
        .await
        .expect("queue");
    for (id, order_id) in [("e-1", 1), ("e-2", 2), ("e-2", 2), ("e-3", 3)] {
        let message = order(id, order_id).with_session_id("customer-9");
        broker.send("order-events", message).await.expect("send");
    }
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let mut handler = Ship::<F>::new();
    handler.entered = Some(entered_tx);
    let receiver = broker.receiver("order-events").await.expect("receiver");
    let p = twice::SessionProcessor::from_arcs(
        Arc::new(receiver),
        inbox,
        Arc::new(Json::new(handler)),
        twice::SessionProcessorOptions::new()
            .consumer("shipping")
            .clock(SharedClock::from(clock.clone())),
    );
    let counters = p.counters();
    let health = p.health_handle();
    let before = health.check().await;
    assert!(!before.receiving && before.last_receive_at.is_none(), "{before:?}");
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    let queue = BrokerQueue::existing(broker, "order-events");
    until_async("all four completed", || async { queue.completed().await == 4 }).await;
    let running = health.check().await;
    assert!(running.receiving && running.is_healthy(), "{}: {running:?}", F::NAME);
    assert!(running.last_receive_at.is_some(), "{running:?}");
    assert_eq!(running.last_completed_at, Some(twice::Clock::now(&clock)), "{running:?}");
    shutdown.trigger();
    task.await.expect("join").expect("run");
    let stopped = health.check().await;
    assert!(!stopped.receiving && !stopped.is_healthy(), "{stopped:?}");

    let mut order_seen = Vec::new();
    while let Ok(id) = entered.try_recv() {
        order_seen.push(id);
    }
    assert_eq!(order_seen, ["e-1", "e-2", "e-3"], "{}: in order, the duplicate skipped", F::NAME);
    let s = counters.snapshot();
    assert_eq!(s.committed, 3, "{s:?}");
    assert_eq!(s.duplicates_already_processed + s.duplicates_concurrent_copy, 1, "{s:?}");
    assert_eq!(shipments(&f).await, 3);
}
on_all_stores!(session_processor_keeps_order_and_claims);

/// Dedup-only mode (seed strategy 2): the id is recorded and committed before the work; a
/// second copy meets the record and is completed without running the handler.
async fn dedup_only_mode_records_first<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_dedup_mode")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let mut handler = Ship::<F>::new();
    handler.entered = Some(entered_tx);
    let calls = handler.calls.clone();
    let p = processor::<F>(&queue, inbox, handler, options(&clock).mode(Mode::DedupOnly)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-21-placed", 21)).await;
    queue.send(order("order-21-placed", 21)).await;
    until_async("both completed", || async { queue.completed().await == 2 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    assert!(entered.try_recv().is_ok());
    let s = counters.snapshot();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!(s.duplicates_already_processed + s.duplicates_concurrent_copy, 1, "{s:?}");
    assert_eq!(inbox_rows(&f, "inbox_dedup_mode").await, 1);
    assert_eq!(shipments(&f).await, 1);
}
on_all_stores!(dedup_only_mode_records_first);

/// A handler that panics: its work is rolled back, the message abandoned and retried.
async fn a_panicking_handler_rolls_back_and_is_retried<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_panic")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let mut handler = Ship::<F>::new();
    handler.panic_once = Some(Arc::new(std::sync::atomic::AtomicBool::new(true)));
    let calls = handler.calls.clone();
    let p = processor::<F>(&queue, inbox, handler, options(&clock)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-31-placed", 31)).await;
    until_async("completed", || async { queue.completed().await == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    let s = counters.snapshot();
    assert_eq!(s.handler_panics, 1, "{s:?}");
    assert_eq!(s.abandoned, 1, "{s:?}");
    assert_eq!(s.committed, 1, "{s:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(shipments(&f).await, 1, "{}: the panicked attempt was rolled back", F::NAME);
}
on_all_stores!(a_panicking_handler_rolls_back_and_is_retried);

/// A handler that runs longer than the lock keeps it: the processor renews it in the
/// background, and the message completes without being handed to anyone else.
async fn a_long_handler_keeps_its_lock_by_renewal<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_renew")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let mut slow = Ship::<F>::new();
    slow.entered = Some(entered_tx);
    slow.gate = Some(gate.clone());
    let p = processor::<F>(&queue, inbox, slow, options(&clock)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-41-placed", 41)).await;
    entered.recv().await.expect("entered");
    // The lock is 30 s and renewed 10 s before it runs out: two renewals in 50 s.
    clock.advance(Duration::from_secs(25));
    until("first renewal", || counters.snapshot().renewals == 1).await;
    clock.advance(Duration::from_secs(25));
    until("second renewal", || counters.snapshot().renewals == 2).await;
    gate.add_permits(1);
    until_async("completed", || async { queue.completed().await == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    let s = counters.snapshot();
    assert_eq!(s.lock_lost, 0, "{s:?}");
    assert_eq!(s.committed, 1, "{s:?}");
    assert_eq!(s.completed, 1, "{s:?}");
    assert_eq!(shipments(&f).await, 1);
}
on_all_stores!(a_long_handler_keeps_its_lock_by_renewal);

/// Shutdown while a handler runs: the processor stops receiving, releases the prefetched
/// messages no handler took, lets the one in flight commit and complete, then returns.
async fn shutdown_finishes_in_flight_work_and_releases_prefetched<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_shutdown")).await);
    let (queue, clock) = queue("orders").await;
    for i in 0..3 {
        queue.send(order(&format!("order-5{i}-placed"), 50 + i)).await;
    }
    let shutdown = Shutdown::default();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let mut slow = Ship::<F>::new();
    slow.entered = Some(entered_tx);
    slow.gate = Some(gate.clone());
    let p = processor::<F>(&queue, inbox, slow, options(&clock).prefetch_count(3)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    entered.recv().await.expect("the first message is in its handler");
    shutdown.trigger();
    until("the prefetched messages are released", || counters.snapshot().released == 2).await;
    assert!(!task.is_finished(), "run waits for the message in flight");
    gate.add_permits(1);
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!((s.received, s.committed, s.completed, s.released), (1, 1, 1, 2), "{s:?}");
    assert_eq!(queue.completed().await, 1);
    assert_eq!(queue.active_count().await, 2, "the released messages wait for the next receiver");
    assert_eq!(shipments(&f).await, 1);
}
on_all_stores!(shutdown_finishes_in_flight_work_and_releases_prefetched);
