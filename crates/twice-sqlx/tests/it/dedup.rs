//! Dedup-only mode at its edges, on every store: a lock lost while the record commits, a copy
//! that meets the record of a copy still in progress.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::Transaction;
use tokio::sync::{Semaphore, mpsc};
use twice::{
    Claim, ErrorClass, Inbox, Json, ManualClock, MessageId, Mode, Processor, ProcessorOptions,
    RetryPolicy, SharedClock, Timestamp,
};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::processor::{Ship, order, processor};
use crate::support::{
    Fixture, Shutdown, create_shipments, inbox_rows, queue, shipments, until, until_async,
};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

fn options(clock: &ManualClock) -> ProcessorOptions {
    ProcessorOptions::new()
        .consumer("shipping")
        .clock(SharedClock::from(clock.clone()))
        .mode(Mode::DedupOnly)
}

/// A store whose first record commits and then takes so long to return that the message lock
/// runs out meanwhile (the clock jumps past it, then the call stalls).
#[derive(Debug)]
struct SlowFirstRecord<I> {
    inner: I,
    clock: ManualClock,
    stall: AtomicBool,
}

impl<I: Inbox> Inbox for SlowFirstRecord<I> {
    type Tx = I::Tx;
    type Error = I::Error;

    fn retention(&self) -> Option<Duration> {
        self.inner.retention()
    }
    fn max_connections(&self) -> Option<u32> {
        self.inner.max_connections()
    }
    async fn begin(&self) -> Result<I::Tx, I::Error> {
        self.inner.begin().await
    }
    async fn claim<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        id: &'a MessageId,
        now: Timestamp,
    ) -> Result<Claim, I::Error> {
        self.inner.claim(tx, consumer, id, now).await
    }
    async fn check_committable<'a>(&'a self, tx: &'a mut I::Tx) -> Result<(), I::Error> {
        self.inner.check_committable(tx).await
    }
    async fn commit(&self, tx: I::Tx) -> Result<(), I::Error> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: I::Tx) -> Result<(), I::Error> {
        self.inner.rollback(tx).await
    }
    async fn record<'a>(
        &'a self,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
        now: Timestamp,
    ) -> Result<Claim, I::Error> {
        let recorded = self.inner.record(consumer, id, owner, now).await;
        if self.stall.swap(false, Ordering::SeqCst) {
            self.clock.advance(Duration::from_secs(31));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        recorded
    }
    async fn finish<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, I::Error> {
        self.inner.finish(tx, consumer, id, owner).await
    }
    async fn forget<'a>(
        &'a self,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, I::Error> {
        self.inner.forget(consumer, id, owner).await
    }
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        self.inner.classify(error)
    }
}

/// The lock runs out while the record commits: the record must not outlive the attempt, or
/// every redelivery would meet it and be completed without the work. The redelivery does the
/// work.
async fn dedup_only_a_lock_lost_while_recording_leaves_no_record<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let (queue, clock) = queue("orders").await;
    let inner = f.inbox(InboxOptions::new().table("inbox_dedup_lost")).await;
    let inbox = SlowFirstRecord { inner, clock: clock.clone(), stall: AtomicBool::new(true) };
    let handler = Ship::<F>::new();
    let calls = handler.calls.clone();
    let p = Processor::from_arcs(
        Arc::new(queue.receiver().await),
        Arc::new(inbox),
        Arc::new(Json::new(handler)),
        options(&clock),
    )
    .on_error(|e| eprintln!("{} processor: {e}", F::NAME));
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-31-placed", 31)).await;
    until_async("completed", || async { queue.completed().await == 1 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(s.lock_lost, 1, "{}: the first attempt lost its lock: {s:?}", F::NAME);
    assert_eq!(
        shipments(&f).await,
        1,
        "{}: the message was completed without its work (the lost attempt's record stayed): \
         {s:?}",
        F::NAME
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!(inbox_rows(&f, "inbox_dedup_lost").await, 1);
}
on_all_stores!(dedup_only_a_lock_lost_while_recording_leaves_no_record);

/// Two copies of one message: the first records the id and is still working when the second
/// meets the record. The first then fails (permanently, so its copy is dead-lettered) and
/// removes its record. The second must not have been completed as a duplicate of work that
/// never happened: it waits for the first copy's outcome, then does the work.
async fn dedup_only_a_copy_meeting_a_record_in_progress_waits_for_its_outcome<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_dedup_wait")).await);
    let (queue, clock) = queue("orders").await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let mut first = Ship::<F>::new();
    first.entered = Some(entered_tx);
    first.gate = Some(gate.clone());
    first.fail_permanently_once = Some(Arc::new(AtomicBool::new(true)));
    let a = processor::<F>(&queue, inbox.clone(), first, options(&clock)).await;
    let stop_a = Shutdown::default();
    let ta = tokio::spawn(a.run(stop_a.wait()));
    queue.send(order("order-32-placed", 32)).await;
    entered.recv().await.expect("first copy entered its handler");

    let second = Ship::<F>::new();
    let second_calls = second.calls.clone();
    let retry = RetryPolicy::new().backoff(Duration::from_secs(1), Duration::from_secs(1));
    let b = processor::<F>(&queue, inbox.clone(), second, options(&clock).retry(retry)).await;
    let cb = b.counters();
    let shutdown = Shutdown::default();
    let tb = tokio::spawn(b.run(shutdown.wait()));
    queue.send(order("order-32-placed", 32)).await;
    // SQLite: the first copy's transaction holds the write lock, so the second copy's record
    // waits for it to end and cannot meet the record while the first copy works.
    let sqlite = F::NAME == "sqlite";
    until("the second copy met the first one's record", || {
        let s = cb.snapshot();
        s.completed == 1 || s.infrastructure_retries >= 1 || (sqlite && s.received == 1)
    })
    .await;

    stop_a.trigger();
    gate.add_permits(1); // the first copy fails now, and is dead-lettered
    until_async("the first copy dead-lettered, the second completed", || async {
        clock.advance(Duration::from_millis(50)); // the second copy's backoff
        queue.completed().await == 1 && !queue.dead_letters().await.is_empty()
    })
    .await;
    shutdown.trigger();
    ta.await.expect("join").expect("run");
    tb.await.expect("join").expect("run");

    let s = cb.snapshot();
    assert_eq!(
        shipments(&f).await,
        1,
        "{}: the second copy was completed although the work never happened: {s:?}",
        F::NAME
    );
    assert_eq!(second_calls.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!(inbox_rows(&f, "inbox_dedup_wait").await, 1);
}
on_all_stores!(dedup_only_a_copy_meeting_a_record_in_progress_waits_for_its_outcome);
