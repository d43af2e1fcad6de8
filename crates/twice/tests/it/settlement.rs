//! Settlement after the commit: off the call, bounded, and waited for at shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::timeout;
use twice::{
    BoxFuture, Clock as _, Context, Message, Outcome, Processor, ProcessorOptions, handler_fn,
};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx, Settled};

/// Long enough for anything that is going to happen; time is paused, so a failure costs
/// nothing.
const WITHIN: Duration = Duration::from_secs(10);

/// Waits (in paused time) until `done` holds; panics naming `what` if it never does.
async fn wait_until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting until {what}");
}

#[tokio::test(start_paused = true)]
async fn a_held_completion_frees_the_call_and_shutdown_waits_for_it() {
    let transport = Arc::new(MemoryTransport::new());
    let inbox = Arc::new(MemoryInbox::default());
    transport.hold_completions(true);
    for id in ["a", "b", "c"] {
        transport.send(Message::new("{}").with_message_id(id));
    }
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let handler = handler_fn(move |ctx: Context<'_>, tx: &mut MemoryTx| {
        let id = ctx.message_id().to_string();
        let _ = started_tx.send(id.clone());
        Box::pin(async move {
            tx.work.push(id);
            Ok(Outcome::Complete)
        }) as BoxFuture<'_, _>
    });
    let options =
        ProcessorOptions::new().max_concurrent_calls(1).max_wait(Duration::from_millis(20));
    let processor =
        Processor::from_arcs(transport.clone(), inbox.clone(), Arc::new(handler), options);
    let counters = processor.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(processor.run(async {
        let _ = stopped.await;
    }));

    let first = timeout(WITHIN, started.recv()).await.expect("the first handler starts");
    assert_eq!(first.as_deref(), Some("a"));
    wait_until("a's completion has started", || transport.completions_started() == 1).await;
    let second = timeout(WITHIN, started.recv()).await.ok().flatten();
    assert_eq!(
        second.as_deref(),
        Some("b"),
        "with one call, the next handler starts while the previous completion is held"
    );
    wait_until("b has committed", || counters.snapshot().committed == 2).await;
    assert!(
        transport.settled().is_empty(),
        "both completions are pending: {:?}",
        transport.settled()
    );
    assert_eq!(inbox.work(), ["a", "b"]);

    // One call and one pending settlement at most: c waits for b's settlement to start.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(started.try_recv().is_err(), "a third message started beyond the bound");
    assert_eq!(transport.completions_started(), 1);

    let _ = stop.send(());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!run.is_finished(), "run returned while a completion was still pending");

    transport.hold_completions(false);
    timeout(WITHIN, run)
        .await
        .expect("run ends once the completions are done")
        .expect("join")
        .expect("run");
    let settled: Vec<_> = transport.settled().into_iter().map(|(id, _, how)| (id, how)).collect();
    assert_eq!(settled.len(), 2, "{settled:?}");
    assert!(settled.iter().all(|(_, how)| *how == Settled::Complete), "{settled:?}");
    let s = counters.snapshot();
    assert_eq!((s.committed, s.completed), (2, 2), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_completion_that_finds_the_lock_lost_is_reported_and_the_work_stays() {
    let transport = Arc::new(MemoryTransport::new());
    let inbox = Arc::new(MemoryInbox::default());
    transport.hold_completions(true);
    transport.completions_lock_lost.store(1, std::sync::atomic::Ordering::SeqCst);
    transport.send(Message::new("{}").with_message_id("a"));
    let handler = handler_fn(move |ctx: Context<'_>, tx: &mut MemoryTx| {
        let id = ctx.message_id().to_string();
        Box::pin(async move {
            tx.work.push(id);
            Ok(Outcome::Complete)
        }) as BoxFuture<'_, _>
    });
    let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = errors.clone();
    let options = ProcessorOptions::new().max_wait(Duration::from_millis(20));
    let processor =
        Processor::from_arcs(transport.clone(), inbox.clone(), Arc::new(handler), options)
            .on_error(move |e| {
                let lock_lost = e
                    .error()
                    .downcast_ref::<twice::TransportError>()
                    .is_some_and(twice::TransportError::is_lock_lost);
                seen.lock().expect("errors").push((e.error_source(), lock_lost));
            });
    let counters = processor.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(processor.run(async {
        let _ = stopped.await;
    }));
    wait_until("a's completion has started", || transport.completions_started() == 1).await;
    let _ = stop.send(());
    transport.hold_completions(false);
    timeout(WITHIN, run).await.expect("run ends").expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!((s.committed, s.completed, s.settle_failures), (1, 0, 1), "{s:?}");
    assert_eq!(*errors.lock().expect("errors"), [(twice::ErrorSource::Settle, true)]);
    assert_eq!(inbox.work(), ["a"], "the committed work stays; the redelivery meets the claim");
    assert_eq!(inbox.claims(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_lock_is_renewed_while_the_completion_is_pending() {
    let clock = twice::ManualClock::default();
    let transport = Arc::new(MemoryTransport::new());
    let inbox = Arc::new(MemoryInbox::default());
    transport.hold_completions(true);
    // The entity's lock is 60 s; the processor renews it 10 s before it runs out.
    let mut message = twice::ReceivedMessage::new(
        Message::new("{}").with_message_id("a"),
        twice::SequenceNumber::new(0),
        clock.now(),
    );
    message.locked_until = Some(clock.now() + Duration::from_secs(60));
    transport.push(message);
    let handler = handler_fn(move |_: Context<'_>, _: &mut MemoryTx| {
        Box::pin(async move { Ok(Outcome::Complete) }) as BoxFuture<'_, _>
    });
    let options = ProcessorOptions::new()
        .max_wait(Duration::from_millis(20))
        .clock(twice::SharedClock::new(clock.clone()));
    let processor =
        Processor::from_arcs(transport.clone(), inbox.clone(), Arc::new(handler), options);
    let counters = processor.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(processor.run(async {
        let _ = stopped.await;
    }));
    wait_until("a's completion has started", || transport.completions_started() == 1).await;
    assert_eq!(counters.snapshot().renewals, 0);

    clock.advance(Duration::from_secs(55));
    wait_until("the lock is renewed", || counters.snapshot().renewals == 1).await;

    let _ = stop.send(());
    transport.hold_completions(false);
    timeout(WITHIN, run).await.expect("run ends").expect("join").expect("run");
    let s = counters.snapshot();
    assert_eq!((s.completed, s.settle_failures, s.lock_lost), (1, 0, 0), "{s:?}");
}
