//! Batches (`ProcessorOptions::batch_size`): many messages in one transaction, each handler
//! under its own savepoint, on every store. Each scenario sends its messages before the
//! processor starts, so that its first receive takes them all into one batch.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use sqlx::Transaction;
use tokio::sync::{Semaphore, mpsc};
use twice::{
    Context, DeadLetterReason, EntityInfo, HandlerError, Inbox, Json, JsonHandler, Outcome,
    Processor, ProcessorOptions, Properties, Receive, RetryPolicy, SharedClock, Timestamp,
    Transport, TransportError,
};
use twice_broker::Receiver;
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::processor::order;
use crate::support::{
    BrokerQueue, Fixture, Shutdown, create_shipments, inbox_rows, queue, shipments, until_async,
};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

#[derive(Deserialize)]
pub struct OrderPlaced {
    pub order_id: i64,
}

/// What the handler does with one order, the first time it sees it.
#[derive(Clone)]
enum Twist {
    /// Fails with a permanent error (the message is dead-lettered).
    FailPermanently,
    /// Fails with a transient error.
    FailTransiently,
    /// Returns `Abandon`.
    Abandon,
    /// Panics.
    Panic,
    /// Waits for a permit of the gate (forever if none comes), after writing.
    Block(Arc<Semaphore>),
    /// Runs a statement that fails, ignores the error and returns `Complete` (a handler that
    /// logs and carries on).
    SwallowError,
}

/// Ships each order (one row) and counts its calls per order; the twists apply once per order.
struct Ship<F> {
    calls: Arc<Mutex<HashMap<i64, usize>>>,
    twists: Mutex<HashMap<i64, Twist>>,
    entered: Option<mpsc::UnboundedSender<i64>>,
    _store: PhantomData<fn() -> F>,
}

impl<F> Ship<F> {
    fn new(twists: impl IntoIterator<Item = (i64, Twist)>) -> Self {
        Self {
            calls: Arc::default(),
            twists: Mutex::new(twists.into_iter().collect()),
            entered: None,
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
        *self.calls.lock().expect("calls").entry(order.order_id).or_default() += 1;
        F::insert_shipment(tx, order.order_id, ctx.message_id().as_str()).await?;
        if let Some(entered) = &self.entered {
            let _ = entered.send(order.order_id);
        }
        let twist = self.twists.lock().expect("twists").remove(&order.order_id);
        match twist {
            None => Ok(Outcome::Complete),
            Some(Twist::FailPermanently) => Err(HandlerError::permanent(
                "Refused",
                std::io::Error::other("downstream refused this order"),
            )),
            Some(Twist::FailTransiently) => {
                Err(HandlerError::transient(std::io::Error::other("downstream unavailable")))
            }
            Some(Twist::Abandon) => Ok(Outcome::Abandon),
            Some(Twist::Panic) => panic!("a bug in the handler"),
            Some(Twist::SwallowError) => {
                let failed = F::try_exec(tx, "INSERT INTO no_such_table (x) VALUES (1)").await;
                assert!(failed.is_err(), "the statement must fail");
                Ok(Outcome::Complete)
            }
            Some(Twist::Block(gate)) => {
                match gate.acquire().await {
                    Ok(permit) => permit.forget(),
                    Err(_) => std::future::pending::<()>().await,
                }
                Ok(Outcome::Complete)
            }
        }
    }
}

/// A processor of `transport` with the `Ship` handler, its errors printed.
fn batch_processor<F: Fixture, T: Transport>(
    transport: Arc<T>,
    inbox: Arc<Inboxed<F>>,
    handler: Ship<F>,
    options: ProcessorOptions,
) -> Processor<T, Inboxed<F>, Json<Ship<F>, OrderPlaced>>
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    Processor::from_arcs(transport, inbox, Arc::new(Json::new(handler)), options)
        .on_error(|e| eprintln!("{} processor: {e}", F::NAME))
}

/// One scenario under way: `orders` sent before the processor started (so that its first
/// receive takes them into one batch), the processor running with `handler`.
struct Scene<F> {
    queue: BrokerQueue,
    clock: twice::ManualClock,
    counters: Arc<twice::Counters>,
    calls: Arc<Mutex<HashMap<i64, usize>>>,
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<Result<(), twice::ProcessorError>>,
    _store: PhantomData<fn() -> F>,
}

impl<F: Fixture> Scene<F>
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    /// Makes the shipments table and the inbox table `table`, sends `orders` (by order id),
    /// and starts the processor on the queue's receiver as `transport` wraps it, with `batch`
    /// and whatever `more` adds to the options.
    async fn start<T: Transport>(
        f: &F,
        table: &str,
        orders: &[i64],
        handler: Ship<F>,
        transport: impl FnOnce(Receiver) -> T,
        options: impl FnOnce(ProcessorOptions) -> ProcessorOptions,
    ) -> Self {
        create_shipments(f, false).await;
        let inbox = Arc::new(f.inbox(InboxOptions::new().table(table)).await);
        let (queue, clock) = queue("orders").await;
        for &n in orders {
            queue.send(order(&format!("order-{n}-placed"), n)).await;
        }
        let calls = Arc::clone(&handler.calls);
        let options = options(self::options(&clock, 1));
        let p = batch_processor::<F, _>(
            Arc::new(transport(queue.receiver().await)),
            inbox,
            handler,
            options,
        );
        let counters = p.counters();
        let shutdown = Shutdown::default();
        let task = tokio::spawn(p.run(shutdown.wait()));
        Self { queue, clock, counters, calls, shutdown, task, _store: PhantomData }
    }

    /// Waits until the broker has completed `n` messages.
    async fn completed(&self, n: u64) {
        until_async("the completions", || async { self.queue.completed().await == n }).await;
    }

    /// Waits until the dead-letter queue holds `n` messages.
    async fn dead_lettered(&self, n: usize) {
        until_async("the dead letters", || async { self.queue.dead_letters().await.len() == n })
            .await;
    }

    /// Stops the processor; its counters and the handler's calls per order.
    async fn stop(self) -> (twice::CounterSnapshot, HashMap<i64, usize>) {
        self.shutdown.trigger();
        self.task.await.expect("join").expect("run");
        (self.counters.snapshot(), self.calls.lock().expect("calls").clone())
    }
}

fn options(clock: &twice::ManualClock, batch: usize) -> ProcessorOptions {
    ProcessorOptions::new()
        .consumer("shipping")
        .batch_size(batch)
        .clock(SharedClock::from(clock.clone()))
}

fn batch_of(n: usize) -> impl FnOnce(ProcessorOptions) -> ProcessorOptions {
    move |o| o.batch_size(n)
}

async fn shipments_of<F: Fixture>(f: &F, order_id: i64) -> i64 {
    f.count(&format!("SELECT COUNT(*) FROM shipments WHERE order_id = {order_id}")).await
}

/// Ten orders in one batch, one of them sent twice more later: ten shipments from one
/// transaction, and the later copies complete as duplicates.
async fn a_batch_commits_its_messages_in_one_transaction<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let orders: Vec<i64> = (1..=10).collect();
    let handler = Ship::<F>::new([]);
    let scene = Scene::start(&f, "inbox_batch_one", &orders, handler, |r| r, batch_of(10)).await;
    scene.completed(10).await;
    scene.queue.send(order("order-3-placed", 3)).await;
    scene.completed(11).await;
    let (s, calls) = scene.stop().await;

    assert_eq!(shipments(&f).await, 10, "{}", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_batch_one").await, 10);
    assert_eq!(calls.values().sum::<usize>(), 10);
    assert_eq!((s.committed, s.completed, s.batches_split), (10, 11, 0), "{s:?}");
    assert_eq!(s.duplicates_already_processed + s.duplicates_concurrent_copy, 1, "{s:?}");
}
on_all_stores!(a_batch_commits_its_messages_in_one_transaction);

/// In a batch of five, order 2 returns `Abandon`, order 3 fails permanently and order 4
/// panics: only their work is rolled back (each to its savepoint), and their claims with it,
/// so order 2 and 4 are handled again on redelivery and order 3 is dead-lettered unclaimed.
/// Orders 1 and 5 commit in the batch.
async fn failing_handlers_in_a_batch_roll_back_only_their_own_work<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let handler =
        Ship::<F>::new([(2, Twist::Abandon), (3, Twist::FailPermanently), (4, Twist::Panic)]);
    let orders = [1, 2, 3, 4, 5];
    let scene = Scene::start(&f, "inbox_batch_fail", &orders, handler, |r| r, batch_of(5)).await;
    // 1 and 5 complete; 2 and 4 are abandoned and come back at once, and then complete; 3 is
    // dead-lettered.
    scene.completed(4).await;
    scene.dead_lettered(1).await;
    let dead = scene.queue.dead_letters().await;
    let (s, calls) = scene.stop().await;

    for n in [1, 2, 4, 5] {
        assert_eq!(shipments_of(&f, n).await, 1, "{}: order {n} shipped once", F::NAME);
    }
    assert_eq!(shipments_of(&f, 3).await, 0, "{}: order 3's work rolled back", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_batch_fail").await, 4, "order 3's claim taken back");
    assert_eq!(calls, HashMap::from([(1, 1), (2, 2), (3, 1), (4, 2), (5, 1)]), "{}", F::NAME);
    assert_eq!((s.committed, s.abandoned, s.dead_lettered), (4, 2, 1), "{s:?}");
    assert_eq!((s.handler_panics, s.batches_split), (1, 0), "{s:?}");
    assert_eq!(dead[0].message_id().as_str(), "order-3-placed");
}
on_all_stores!(failing_handlers_in_a_batch_roll_back_only_their_own_work);

/// A handler that fails once is retried at once under the same savepoint, its claim kept:
/// the whole batch still commits once.
async fn an_immediate_retry_in_a_batch_reruns_only_that_handler<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let handler = Ship::<F>::new([(2, Twist::FailTransiently)]);
    let options =
        |o: ProcessorOptions| o.batch_size(3).retry(RetryPolicy::new().immediate_retries(1));
    let scene = Scene::start(&f, "inbox_batch_retry", &[1, 2, 3], handler, |r| r, options).await;
    scene.completed(3).await;
    let (s, calls) = scene.stop().await;

    assert_eq!(shipments(&f).await, 3, "{}: the failed attempt's row rolled back", F::NAME);
    assert_eq!(calls.get(&2), Some(&2));
    assert_eq!((s.committed, s.immediate_retries, s.abandoned), (3, 1, 0), "{s:?}");
    assert_eq!(s.batches_split, 0, "{s:?}");
}
on_all_stores!(an_immediate_retry_in_a_batch_reruns_only_that_handler);

/// Two copies of order 1 in one batch, the first of which fails for good: the second must
/// not be completed as the first's duplicate. It waits for the first's transaction, as a
/// concurrent copy does, then claims and ships. Two copies of order 2 in the same batch,
/// the first of which succeeds: the second completes as a duplicate.
async fn a_duplicate_inside_one_batch_waits_for_its_twin<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let handler = Ship::<F>::new([(1, Twist::FailPermanently)]);
    let orders = [1, 2, 1, 2];
    let scene = Scene::start(&f, "inbox_batch_twins", &orders, handler, |r| r, batch_of(4)).await;
    scene.completed(3).await;
    scene.dead_lettered(1).await;
    let (s, calls) = scene.stop().await;

    assert_eq!(shipments_of(&f, 1).await, 1, "{}: the twin shipped order 1", F::NAME);
    assert_eq!(shipments_of(&f, 2).await, 1, "{}: order 2 shipped once", F::NAME);
    assert_eq!(calls, HashMap::from([(1, 2), (2, 1)]));
    assert_eq!((s.committed, s.dead_lettered), (2, 1), "{s:?}");
    assert_eq!(s.duplicates_concurrent_copy + s.duplicates_already_processed, 1, "{s:?}");
}
on_all_stores!(a_duplicate_inside_one_batch_waits_for_its_twin);

/// In a batch of four, order 2's handler runs a statement that fails, ignores the error and
/// returns `Complete`. PostgreSQL has aborted the transaction: the next savepoint fails, the
/// batch is rolled back as a whole and its messages are processed one at a time, where order
/// 2's handler runs again. SQLite and MariaDB refuse only the statement: the batch commits.
/// Every order ships once either way.
async fn a_transaction_aborted_under_a_handler_splits_the_batch<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let handler = Ship::<F>::new([(2, Twist::SwallowError)]);
    let orders = [1, 2, 3, 4];
    let scene = Scene::start(&f, "inbox_batch_split", &orders, handler, |r| r, batch_of(4)).await;
    scene.completed(4).await;
    let (s, calls) = scene.stop().await;

    assert_eq!(shipments(&f).await, 4, "{}: one shipment per order", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_batch_split").await, 4);
    assert_eq!((s.committed, s.completed, s.abandoned), (4, 4, 0), "{s:?}");
    let aborts = F::NAME == "postgres";
    assert_eq!(s.batches_split, u64::from(aborts), "{}: {s:?}", F::NAME);
    // Split, every handler of the batch that ran before the failed savepoint runs again.
    let expected =
        if aborts { [(1, 2), (2, 2), (3, 1), (4, 1)] } else { [(1, 1), (2, 1), (3, 1), (4, 1)] };
    assert_eq!(calls, HashMap::from(expected), "{}", F::NAME);
}
on_all_stores!(a_transaction_aborted_under_a_handler_splits_the_batch);

/// A receiver whose lock renewal fails, as lost, for one message id.
#[derive(Debug)]
struct LosesLockOf {
    inner: Receiver,
    id: &'static str,
}

impl Receive for LosesLockOf {
    type Delivery = <Receiver as Receive>::Delivery;

    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<Self::Delivery>, TransportError> {
        self.inner.receive(max_messages, max_wait).await
    }
    async fn complete(&self, d: &Self::Delivery) -> Result<(), TransportError> {
        self.inner.complete(d).await
    }
    async fn abandon(&self, d: &Self::Delivery, p: Properties) -> Result<(), TransportError> {
        self.inner.abandon(d, p).await
    }
    async fn dead_letter(
        &self,
        d: &Self::Delivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.inner.dead_letter(d, reason).await
    }
    async fn defer(&self, d: &Self::Delivery) -> Result<(), TransportError> {
        self.inner.defer(d).await
    }
}

impl Transport for LosesLockOf {
    fn entity(&self) -> &EntityInfo {
        self.inner.entity()
    }
    fn claim_scope(&self) -> &str {
        self.inner.claim_scope()
    }
    async fn read_entity(&self) -> Result<EntityInfo, TransportError> {
        self.inner.read_entity().await
    }
    async fn release(&self, d: &Self::Delivery) -> Result<(), TransportError> {
        self.inner.release(d).await
    }
    async fn renew_lock(&self, d: &Self::Delivery) -> Result<Timestamp, TransportError> {
        if twice::Delivery::message(d).message_id().as_str() == self.id {
            return Err(TransportError::LockLost);
        }
        self.inner.renew_lock(d).await
    }
}

/// In a batch of four, order 2's handler is stuck when its lock is lost: only that handler is
/// cancelled and rolled back to its savepoint; the others go on, renewed, and commit. Order 2
/// is handled again when the broker redelivers it.
async fn lock_loss_of_one_message_cancels_only_its_handler<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    // The gate never opens: a handler stuck downstream.
    let mut handler = Ship::<F>::new([(2, Twist::Block(Arc::new(Semaphore::new(0))))]);
    handler.entered = Some(entered_tx);
    let loses = |inner| LosesLockOf { inner, id: "order-2-placed" };
    let orders = [1, 2, 3, 4];
    let scene = Scene::start(&f, "inbox_batch_lock", &orders, handler, loses, batch_of(4)).await;
    for expected in [1, 2] {
        assert_eq!(entered.recv().await, Some(expected));
    }
    // Past the renewal point (20 s into the 30 s lock): order 2's renewal fails, the others'
    // succeed.
    scene.clock.advance(Duration::from_secs(21));
    scene.completed(3).await;
    let s = scene.counters.snapshot();
    assert_eq!((s.lock_lost, s.committed, s.batches_split), (1, 3, 0), "{s:?}");
    assert_eq!(shipments_of(&f, 2).await, 0, "{}: order 2 rolled back", F::NAME);
    assert_eq!(shipments(&f).await, 3, "{}", F::NAME);
    // The broker's own lock on order 2 runs out; its redelivery is handled (the gate was
    // for the first call only).
    scene.clock.advance(Duration::from_secs(10));
    scene.completed(4).await;
    let (_, calls) = scene.stop().await;

    assert_eq!(shipments(&f).await, 4, "{}", F::NAME);
    assert_eq!(shipments_of(&f, 2).await, 1, "{}", F::NAME);
    assert_eq!(calls.get(&2), Some(&2));
    assert_eq!(inbox_rows(&f, "inbox_batch_lock").await, 4);
}
on_all_stores!(lock_loss_of_one_message_cancels_only_its_handler);

/// Two processors with batches of 8 take 150 orders, each sent twice: every order ships once,
/// whichever batches the copies land in, and every copy completes.
async fn copies_across_concurrent_batches_ship_once<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    const ORDERS: i64 = 150;
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_batch_copies")).await);
    let (queue, clock) = queue("orders").await;
    let shutdown = Shutdown::default();
    let mut runs = Vec::new();
    let calls = Arc::new(AtomicUsize::new(0));
    for _ in 0..2 {
        let handler = Ship::<F>::new([]);
        let mine = Arc::clone(&handler.calls);
        let p = batch_processor::<F, _>(
            Arc::new(queue.receiver().await),
            Arc::clone(&inbox),
            handler,
            options(&clock, 8)
                .max_concurrent_calls(2)
                .retry(RetryPolicy::new().backoff(Duration::ZERO, Duration::ZERO)),
        );
        runs.push((p.counters(), mine, tokio::spawn(p.run(shutdown.wait()))));
    }
    for n in 1..=ORDERS {
        let id = format!("order-{n}-placed");
        queue.send(order(&id, n)).await;
        queue.send(order(&id, n)).await;
    }
    let all = u64::try_from(2 * ORDERS).expect("small");
    until_async("every copy completed", || async { queue.completed().await == all }).await;
    shutdown.trigger();
    let mut committed = 0;
    for (counters, mine, task) in runs {
        task.await.expect("join").expect("run");
        let s = counters.snapshot();
        println!("{}: {s:?}", F::NAME);
        committed += s.committed;
        calls.fetch_add(mine.lock().expect("calls").values().sum(), Ordering::SeqCst);
    }
    assert_eq!(shipments(&f).await, ORDERS, "{}", F::NAME);
    assert_eq!(
        f.count("SELECT COUNT(*) FROM (SELECT order_id FROM shipments GROUP BY order_id HAVING COUNT(*) > 1) d")
            .await,
        0
    );
    assert_eq!(committed, u64::try_from(ORDERS).expect("small"));
    assert!(queue.dead_letters().await.is_empty());
    // A handler runs again only when its batch was split and it ran alone.
    assert!(calls.load(Ordering::SeqCst) >= 150, "{}", F::NAME);
}
on_all_stores!(copies_across_concurrent_batches_ship_once);

/// A batch size of 0, or batches outside the claim mode, are refused at start.
#[tokio::test]
async fn batches_outside_the_claim_mode_are_refused() {
    let Some(f) = <crate::support::Lite as Fixture>::create().await else { return };
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_batch_refused")).await);
    let (queue, clock) = queue("orders").await;
    for (batch, mode, refusal) in [
        (0, twice::Mode::Claim, "at least 1"),
        (4, twice::Mode::NaturallyIdempotent, "Mode::Claim"),
    ] {
        let handler = Ship::<crate::support::Lite>::new([]);
        let p = batch_processor::<crate::support::Lite, _>(
            Arc::new(queue.receiver().await),
            Arc::clone(&inbox),
            handler,
            options(&clock, batch).mode(mode),
        );
        let refused = p.run(std::future::pending()).await.expect_err("refused");
        assert!(refused.to_string().contains(refusal), "{refused}");
    }
}
