//! Long polls, timers and cancellation, on a manual clock.

use std::time::Duration;

use twice::{ManualClock, MessageState};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Error};

use crate::support::{NOW, msg};

async fn broker(clock: &ManualClock) -> Broker {
    let b = Broker::open(BrokerOptions::in_memory().clock(clock.clone())).await.unwrap();
    b.create_queue("q", QueueProperties::default()).await.unwrap();
    b
}

/// Lets a spawned task send its command, then makes sure the broker has handled it: commands
/// are served in order, so a round trip issued afterwards returns after it.
async fn settle(broker: &Broker) {
    tokio::task::yield_now().await;
    broker.counts("q").await.unwrap();
}

#[tokio::test]
async fn a_long_poll_wakes_on_arrival() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let waiting = tokio::spawn({
        let broker = broker.clone();
        async move { broker.receive("q", 5, Duration::from_secs(60)).await }
    });
    settle(&broker).await;
    assert!(!waiting.is_finished());
    broker.send("q", msg("late")).await.unwrap();
    let got = waiting.await.unwrap().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message_id().as_str(), "late");
}

#[tokio::test]
async fn a_long_poll_ends_empty_when_its_time_is_up() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let waiting = tokio::spawn({
        let broker = broker.clone();
        async move { broker.receive("q", 5, Duration::from_secs(30)).await }
    });
    settle(&broker).await;
    clock.advance(Duration::from_secs(29));
    settle(&broker).await;
    assert!(!waiting.is_finished());
    clock.advance(Duration::from_secs(1));
    assert!(waiting.await.unwrap().unwrap().is_empty());
}

#[tokio::test]
async fn a_dropped_receive_loses_nothing_and_counts_nothing() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let waiting = tokio::spawn({
        let broker = broker.clone();
        async move { broker.receive("q", 5, Duration::from_secs(60)).await }
    });
    settle(&broker).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    // The parked receive is served with this message, cannot hand it over, and releases it.
    broker.send("q", msg("m")).await.unwrap();
    let got = broker.receive("q", 5, NOW).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].delivery_count, 1, "an undelivered message is not a delivery");
}

#[tokio::test]
async fn an_expired_lock_cannot_settle_and_the_message_comes_back_counted() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    broker.send("q", msg("m")).await.unwrap();
    let first = broker.receive("q", 1, NOW).await.unwrap().remove(0);
    assert_eq!(first.locked_until, Some(clock_now(&broker) + Duration::from_secs(60)));
    assert!(broker.receive("q", 1, NOW).await.unwrap().is_empty(), "locked: invisible");
    clock.advance(Duration::from_secs(60));
    let err = broker.complete(first.lock_token.unwrap()).await.unwrap_err();
    assert!(matches!(err, Error::MessageLockLost), "{err:?}");
    let again = broker.receive("q", 1, NOW).await.unwrap().remove(0);
    assert_eq!(again.delivery_count, 2);
    assert_ne!(again.lock_token, first.lock_token);
}

#[tokio::test]
async fn a_renewed_lock_outlives_its_first_duration() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    broker.send("q", msg("m")).await.unwrap();
    let m = broker.receive("q", 1, NOW).await.unwrap().remove(0);
    clock.advance(Duration::from_secs(50));
    let until = broker.renew_lock(m.lock_token.unwrap()).await.unwrap();
    assert_eq!(until, clock_now(&broker) + Duration::from_secs(60));
    clock.advance(Duration::from_secs(50));
    broker.complete(m.lock_token.unwrap()).await.unwrap();
    assert_eq!(broker.counts("q").await.unwrap().active, 0);
}

#[tokio::test]
async fn a_scheduled_message_wakes_a_waiting_receiver_on_time() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let at = clock_now(&broker) + Duration::from_secs(10);
    let seqs = broker.schedule("q", vec![msg("later")], at).await.unwrap();
    let peeked = broker.peek("q", seqs[0], 1).await.unwrap();
    assert_eq!(peeked[0].state, MessageState::Scheduled);
    let waiting = tokio::spawn({
        let broker = broker.clone();
        async move { broker.receive("q", 1, Duration::from_secs(60)).await }
    });
    settle(&broker).await;
    clock.advance(Duration::from_secs(9));
    settle(&broker).await;
    assert!(!waiting.is_finished());
    clock.advance(Duration::from_secs(1));
    let got = waiting.await.unwrap().unwrap();
    assert_eq!(got[0].message_id().as_str(), "later");
}

#[tokio::test]
async fn calls_after_shutdown_fail_closed() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    broker.shutdown().await;
    assert!(matches!(broker.send("q", msg("m")).await, Err(Error::Closed)));
}

fn clock_now(broker: &Broker) -> twice::Timestamp {
    broker.clock().now()
}

/// The clock jumps past both a scheduled message's time and a waiting receive's deadline in
/// one step: the message is still delivered, to that receive or to the next one, never lost.
#[tokio::test]
async fn a_scheduled_message_due_when_the_receive_times_out_is_still_delivered() {
    for (by_send, durable) in [(false, false), (true, false), (false, true), (true, true)] {
        let clock = ManualClock::default();
        let dir = tempfile::tempdir().unwrap();
        let broker = if durable {
            let options = BrokerOptions::durable(dir.path()).clock(clock.clone());
            let b = Broker::open(options).await.unwrap();
            b.create_queue("q", QueueProperties::default()).await.unwrap();
            b
        } else {
            broker(&clock).await
        };
        let at = clock_now(&broker) + Duration::from_secs(600);
        if by_send {
            broker.send("q", msg("due").with_scheduled_enqueue_time(at)).await.unwrap();
        } else {
            broker.schedule("q", vec![msg("due")], at).await.unwrap();
        }
        let waiting = tokio::spawn({
            let broker = broker.clone();
            async move { broker.receive("q", 5, Duration::from_secs(30)).await }
        });
        settle(&broker).await;
        clock.advance(Duration::from_secs(660));
        // A receive waits on the manual clock, which stands still from here: a real-time
        // bound turns a lost message into a failure instead of a hang.
        let bound = std::time::Duration::from_secs(10);
        let first = tokio::time::timeout(bound, waiting)
            .await
            .unwrap_or_else(|_| panic!("the waiting receive never returned (durable: {durable})"))
            .unwrap()
            .unwrap();
        let got = if first.is_empty() {
            tokio::time::timeout(bound, broker.receive("q", 5, Duration::from_secs(1)))
                .await
                .unwrap_or_else(|_| panic!("the due message is lost (durable: {durable})"))
                .unwrap()
        } else {
            first
        };
        assert_eq!(
            got.len(),
            1,
            "the due message must be receivable (by send: {by_send}, durable: {durable})"
        );
        assert_eq!(got[0].message_id().as_str(), "due");
        let counts = broker.counts("q").await.unwrap();
        assert_eq!((counts.active, counts.locked, counts.scheduled), (1, 1, 0), "locked, not lost");
    }
}
