//! The processor's health: receiving, last receive, last completion, and the inbox probe.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use twice::{
    BoxFuture, Clock as _, Context, Handler, HealthHandle, ManualClock, Message, Outcome,
    Processor, ProcessorOptions, handler_fn,
};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx, Settled};

/// A processor on `transport` and `inbox` whose handler completes every message, with a
/// manual clock.
fn processor(
    transport: &Arc<MemoryTransport>,
    inbox: &Arc<MemoryInbox>,
    clock: &ManualClock,
    max_wait: Duration,
) -> Processor<MemoryTransport, MemoryInbox, impl Handler<MemoryTx>> {
    let handler = handler_fn(|_: Context<'_>, _: &mut MemoryTx| {
        Box::pin(async { Ok(Outcome::Complete) }) as BoxFuture<'_, _>
    });
    Processor::from_arcs(
        Arc::clone(transport),
        Arc::clone(inbox),
        Arc::new(handler),
        ProcessorOptions::new().max_wait(max_wait).clock(clock.clone().into()),
    )
}

/// Waits (in real time) until `f` holds, or fails naming `what`.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..5_000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting until {what}");
}

#[tokio::test]
async fn before_the_run_the_processor_is_not_receiving_and_its_inbox_answers() {
    let (transport, inbox) = (Arc::new(MemoryTransport::new()), Arc::new(MemoryInbox::default()));
    let clock = ManualClock::default();
    let health = processor(&transport, &inbox, &clock, Duration::from_millis(20)).health_handle();
    let h = health.check().await;
    assert!(!h.receiving, "{h:?}");
    assert_eq!((h.last_receive_at, h.last_completed_at), (None, None));
    assert_eq!(h.inbox_reachable, Ok(()));
    assert!(!h.is_healthy(), "not receiving is not healthy");
}

#[tokio::test]
async fn while_running_it_is_receiving_and_after_a_completion_it_says_when_then_stops() {
    let (transport, inbox) = (Arc::new(MemoryTransport::new()), Arc::new(MemoryInbox::default()));
    let clock = ManualClock::default();
    let start = clock.now();
    let p = processor(&transport, &inbox, &clock, Duration::from_millis(20));
    let health: HealthHandle = p.health_handle();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(p.run(async {
        let _ = stop_rx.await;
    }));

    for _ in 0..5_000 {
        if health.check().await.last_receive_at.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let h = health.check().await;
    assert!(h.receiving && h.is_healthy(), "{h:?}");
    assert_eq!(h.last_receive_at, Some(start), "the manual clock has not moved");
    assert_eq!(h.last_completed_at, None, "nothing completed yet");

    clock.advance(Duration::from_secs(7));
    transport.send(Message::new("{}").with_message_id("order-1"));
    let t = transport.clone();
    until("the message is completed", || t.settled().len() == 1).await;
    assert_eq!(transport.settled()[0].2, Settled::Complete);
    let h = health.check().await;
    assert_eq!(h.last_completed_at, Some(start + Duration::from_secs(7)), "{h:?}");
    assert!(h.receiving, "{h:?}");

    stop_tx.send(()).expect("the run listens");
    run.await.expect("no panic").expect("run");
    let h = health.check().await;
    assert!(!h.receiving, "the run has ended: {h:?}");
    assert_eq!(h.last_completed_at, Some(start + Duration::from_secs(7)), "kept after the run");
}

#[tokio::test]
async fn a_receive_that_does_not_return_for_three_waits_is_not_receiving() {
    let (transport, inbox) = (Arc::new(MemoryTransport::new()), Arc::new(MemoryInbox::default()));
    let clock = ManualClock::default();
    // The transport waits in real time, up to a minute: the receive is still pending while the
    // manual clock moves past three waits.
    let p = processor(&transport, &inbox, &clock, Duration::from_secs(60));
    let health = p.health_handle();
    let run = tokio::spawn(p.run(std::future::pending()));
    let probe = health.clone();
    until("the run loop is up", || probe.receiving()).await;
    // Let the loop reach its first receive.
    tokio::time::sleep(Duration::from_millis(20)).await;
    clock.advance(Duration::from_secs(180));
    assert!(health.receiving(), "three waits are tolerated");
    clock.advance(Duration::from_secs(1));
    let h = health.check().await;
    assert!(!h.receiving, "{h:?}");
    assert_eq!(h.last_receive_at, None, "no receive has returned");
    run.abort();
}

#[tokio::test]
async fn an_inbox_whose_begin_fails_is_reported_unreachable() {
    let (transport, inbox) = (Arc::new(MemoryTransport::new()), Arc::new(MemoryInbox::default()));
    let clock = ManualClock::default();
    let health = processor(&transport, &inbox, &clock, Duration::from_millis(20)).health_handle();
    inbox.faults.begin_failures.store(1, Ordering::SeqCst);
    let h = health.check().await;
    assert_eq!(h.inbox_reachable, Err("begin: no connection to the store".to_owned()), "{h:?}");
    assert!(!h.is_healthy());
    let h = health.check().await;
    assert_eq!(h.inbox_reachable, Ok(()), "the store answers again");
}
