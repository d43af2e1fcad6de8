//! A session held for longer than MaxAutoLockRenewalDuration, on every store: its lock is
//! renewed for as long as the session is held, not for a fixed time after it was accepted.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Transaction;
use tokio::sync::{Semaphore, mpsc};
use twice::{Clock as _, Inbox, Json, SessionProcessor, SessionProcessorOptions, SharedClock};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::processor::{Ship, order};
use crate::support::{
    BrokerQueue, Fixture, Shutdown, create_shipments, shipments, until, until_async,
};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

/// The session's lock (30 s) is renewed 10 s before it runs out: every 20 s.
const RENEW_EVERY: Duration = Duration::from_secs(20);

/// One customer's session: a message at once, a second one four minutes later whose handler
/// runs two and a half minutes, past five minutes after the session was accepted (the default
/// MaxAutoLockRenewalDuration). The session is held throughout (a long idle timeout), its lock
/// renewed all along, and the second message completes on its first delivery.
async fn a_session_is_renewed_for_as_long_as_it_is_held<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_held")).await);
    let clock = twice::ManualClock::default();
    let broker =
        Broker::open(BrokerOptions::in_memory().clock(clock.clone())).await.expect("broker");
    let properties = QueueProperties::default()
        .with_lock_duration(Duration::from_secs(30))
        .with_requires_session(true);
    broker.create_queue("order-events", properties).await.expect("queue");
    let queue = BrokerQueue::existing(broker.clone(), "order-events");
    queue.send(order("e-1", 1).with_session_id("customer-9")).await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(1));
    let mut handler = Ship::<F>::new();
    handler.entered = Some(entered_tx);
    handler.gate = Some(Arc::clone(&gate));
    let receiver = broker.receiver("order-events").await.expect("receiver");
    let p = SessionProcessor::from_arcs(
        Arc::new(receiver),
        inbox,
        Arc::new(Json::new(handler)),
        SessionProcessorOptions::new()
            .consumer("shipping")
            .session_idle_timeout(Duration::from_secs(3600))
            .clock(SharedClock::from(clock.clone())),
    )
    .on_error(|e| eprintln!("{} session processor: {e}", F::NAME));
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    assert_eq!(entered.recv().await.as_deref(), Some("e-1"));
    let accepted = clock.now();
    until_async("e-1 completed", || async { queue.completed().await == 1 }).await;

    // Ten seconds at a time, each step once the renewals due so far are done.
    let step_to = |minutes_and_seconds: u64| {
        let clock = clock.clone();
        let counters = Arc::clone(&counters);
        async move {
            while clock.now().duration_since(accepted) < Duration::from_secs(minutes_and_seconds) {
                clock.advance(Duration::from_secs(10));
                let elapsed = clock.now().duration_since(accepted);
                let due = elapsed.as_secs() / RENEW_EVERY.as_secs();
                let what = format!("{due} renewals {elapsed:?} after the accept");
                until(&what, || counters.snapshot().renewals >= due).await;
            }
        }
    };
    step_to(240).await;
    queue.send(order("e-2", 2).with_session_id("customer-9")).await;
    assert_eq!(entered.recv().await.as_deref(), Some("e-2"));
    step_to(390).await;
    gate.add_permits(1);
    until_async("e-2 completed", || async { queue.completed().await == 2 }).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!((s.lock_lost, s.committed, s.completed), (0, 2, 2), "{}: {s:?}", F::NAME);
    assert!(s.renewals >= 19, "{}: renewed past five minutes: {s:?}", F::NAME);
    assert_eq!(shipments(&f).await, 2, "{}", F::NAME);
    assert!(queue.dead_letters().await.is_empty());
}
on_all_stores!(a_session_is_renewed_for_as_long_as_it_is_held);
