//! A process killed after commit and before complete: the redelivery is a no-op that completes.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Transaction;
use tokio::io::{AsyncBufReadExt, BufReader};

use twice::{Clock as _, Inbox, ProcessorOptions, SharedClock, SystemClock};
use twice_sqlx::{InboxOptions, StoreError};

use crate::on_all_stores;
use twice_broker::{Broker, BrokerOptions};

use crate::processor::{Ship, processor};
use crate::support::{
    BrokerQueue, Fixture, Shutdown, create_shipments, inbox_rows, shipments, until_async,
};

/// The example binary `crash_after_commit`, built from the current source (see
/// [`twice_testkit::process::example_bin`]).
fn child_binary() -> PathBuf {
    twice_testkit::process::example_bin(
        env!("CARGO_MANIFEST_DIR"),
        "twice-sqlx",
        "crash_after_commit",
        &["sqlite", "postgres", "mysql"],
    )
}

async fn crash_after_commit_then_redelivery_is_a_no_op<F: Fixture>(f: F)
where
    twice_sqlx::SqlxInbox<F::DB>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    crash_after_commit_before_completion(f, 1).await;
}
on_all_stores!(crash_after_commit_then_redelivery_is_a_no_op);

/// A batch of five committed in one transaction, the process killed before any settlement:
/// the five redeliveries meet their claims.
async fn crash_after_a_batch_commit_before_its_settlements<F: Fixture>(f: F)
where
    twice_sqlx::SqlxInbox<F::DB>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    crash_after_commit_before_completion(f, 5).await;
}
on_all_stores!(crash_after_a_batch_commit_before_its_settlements);

/// The child processes `batch` orders (in one batch when more than one) and is killed once
/// their transaction has committed; a processor over the reopened broker then completes every
/// redelivery as a duplicate without running the handler.
async fn crash_after_commit_before_completion<F: Fixture>(f: F, batch: usize)
where
    twice_sqlx::SqlxInbox<F::DB>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let broker_dir = tempfile::tempdir().expect("broker dir");
    let dir = broker_dir.path().display().to_string();
    let mut child = tokio::process::Command::new(child_binary())
        .args([F::NAME, &f.url(), "inbox_crash", &dir, &batch.to_string()])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the crash_after_commit example");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = lines.next_line().await.expect("read").expect("the child printed a line");
    assert_eq!(line, "committed order-1-placed");
    // SIGKILL: no destructor, no rollback, no completion.
    child.start_kill().expect("kill");
    let status = child.wait().await.expect("wait");
    {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "killed by SIGKILL");
    }
    let n = i64::try_from(batch).expect("small");
    assert_eq!(shipments(&f).await, n, "{}: the work committed", F::NAME);
    assert_eq!(inbox_rows(&f, "inbox_crash").await, n, "and so did the claims");

    // The broker, reopened from its directory, redelivers the message it never saw completed.
    // Its clock starts where the child's system clock is now, past the dead receiver's 30 s
    // lock, so the test holds in any year.
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_crash")).await);
    let clock = twice::ManualClock::new(SystemClock.now() + Duration::from_secs(31));
    let broker = Broker::open(BrokerOptions::durable(&dir).clock(clock.clone()))
        .await
        .expect("reopen the broker");
    let queue = BrokerQueue::existing(broker, "orders");
    let handler = Ship::<F>::new();
    let calls = handler.calls.clone();
    let p = processor::<F>(
        &queue,
        inbox,
        handler,
        ProcessorOptions::new()
            .consumer("shipping")
            .batch_size(batch)
            .clock(SharedClock::from(clock.clone())),
    )
    .await;
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    let all = u64::try_from(batch).expect("small");
    until_async("the redeliveries completed", || async { queue.completed().await == all }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler did not run again");
    assert_eq!(s.duplicates_already_processed, all, "{s:?}");
    assert_eq!(s.completed, all, "{s:?}");
    assert_eq!(shipments(&f).await, n, "{}: still one shipment per order", F::NAME);
    assert_eq!(queue.active_count().await, 0);
    let redelivered = queue.broker.statistics("orders").await.expect("statistics");
    assert_eq!(redelivered.completed, all);
}
