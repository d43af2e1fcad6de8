//! Keeping a message's lock: a renewal that cannot extend the lock is not repeated in a loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use twice::{
    BoxFuture, Clock as _, Context, HandlerFn, ManualClock, Message, Processor, ProcessorOptions,
    ReceivedMessage, SequenceNumber, SharedClock, Timestamp, handler_fn,
};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx};

/// Polls `cond` until it holds; the bound only keeps a broken test from hanging.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..30_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting for: {what}");
}

/// The broker will not extend the lock past its first end (as RabbitMQ's `consumer_timeout`
/// caps a delivery): its renewal answers the same locked-until. The keeper renews once, sees
/// that the lock did not move, and waits for it to run out; it does not ask again and again
/// (which, against a transport that answers at once, spun a worker thread without yielding
/// until the lock's end). When the lock runs out the handler is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_cannot_extend_the_lock_is_not_repeated() {
    let clock = ManualClock::default();
    let transport = Arc::new(MemoryTransport::new());
    let until_at = clock.now() + Duration::from_secs(30);
    *transport.renew_cap.lock().expect("cap") = Some(until_at);
    let mut message = ReceivedMessage::new(
        Message::new("{}").with_message_id("long"),
        SequenceNumber::new(1),
        Timestamp::from_millis(0),
    );
    message.locked_until = Some(until_at);
    transport.push(message);
    let entered = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&entered);
    let handler = handler_fn(move |_: Context<'_>, _: &mut MemoryTx| {
        seen.store(true, Ordering::SeqCst);
        Box::pin(std::future::pending()) as BoxFuture<'_, _>
    });
    let p: Processor<_, _, HandlerFn<_>> = Processor::from_arcs(
        Arc::clone(&transport),
        Arc::new(MemoryInbox::default()),
        Arc::new(handler),
        ProcessorOptions::new()
            .clock(SharedClock::from(clock.clone()))
            .max_wait(Duration::from_millis(20)),
    );
    let counters = p.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(p.run(async move {
        let _ = stopped.await;
    }));
    until("the handler runs", || entered.load(Ordering::SeqCst)).await;
    // The lock (60 s by the entity's properties, 30 s left) is renewed 10 s before its end.
    clock.advance(Duration::from_secs(25));
    until("a renewal", || transport.renew_calls.load(Ordering::SeqCst) >= 1).await;
    clock.advance(Duration::from_secs(6));
    until("the lock ran out", || counters.snapshot().lock_lost == 1).await;
    let _ = stop.send(());
    task.await.expect("join").expect("run");

    let calls = transport.renew_calls.load(Ordering::SeqCst);
    assert_eq!(calls, 1, "renewals asked for a lock that could not be extended");
    assert_eq!(counters.snapshot().committed, 0);
}
