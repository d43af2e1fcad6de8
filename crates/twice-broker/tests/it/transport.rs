//! The in-process `twice::Transport`, as the idempotent processor uses it.

use std::time::Duration;
use twice::Receive;

use twice::{
    DeadLetterReason, ManualClock, Message, SessionReceiver, SessionTransport, Transport,
    TransportError,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};

use crate::support::NOW;

async fn broker(clock: &ManualClock) -> Broker {
    Broker::open(BrokerOptions::in_memory().clock(clock.clone())).await.unwrap()
}

#[tokio::test]
async fn entity_info_comes_from_the_entity_properties() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let props = QueueProperties::default()
        .with_lock_duration(Duration::from_secs(30))
        .with_max_delivery_count(5)
        .with_duplicate_detection(Duration::from_secs(600));
    broker.create_queue("orders", props).await.unwrap();
    let rx = broker.receiver("orders").await.unwrap();
    let info = rx.entity();
    assert_eq!(info.path, "orders");
    assert_eq!(info.lock_duration, Duration::from_secs(30));
    assert_eq!(info.max_delivery_count, Some(5));
    assert_eq!(info.duplicate_detection_window, Some(Duration::from_secs(600)));
    assert!(!info.requires_session);
    assert!(matches!(
        broker.receiver("missing").await,
        Err(twice_broker::Error::EntityNotFound(_))
    ));
}

#[tokio::test]
async fn receive_complete_abandon_renew_and_expiry() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let props = QueueProperties::default().with_lock_duration(Duration::from_secs(30));
    broker.create_queue("q", props).await.unwrap();
    let rx = broker.receiver("q").await.unwrap();
    broker
        .send_batch(
            "q",
            vec![Message::new("a").with_message_id("a"), Message::new("b").with_message_id("b")],
        )
        .await
        .unwrap();

    let got = rx.receive(10, NOW).await.unwrap();
    assert_eq!(got.len(), 2);
    rx.complete(&got[0]).await.unwrap();
    let err = rx.complete(&got[0]).await.unwrap_err();
    assert!(err.is_lock_lost(), "settling twice: {err:?}");

    let props = [("reason".to_owned(), twice::Value::from("retry"))].into_iter().collect();
    rx.abandon(&got[1], props).await.unwrap();
    let b = rx.receive(1, NOW).await.unwrap().remove(0);
    assert_eq!(b.delivery_count, 2);
    assert_eq!(b.message.application_properties["reason"], twice::Value::from("retry"));

    clock.advance(Duration::from_secs(20));
    let until = rx.renew_lock(&b).await.unwrap();
    assert_eq!(until, broker.clock().now() + Duration::from_secs(30));
    clock.advance(Duration::from_secs(29));
    rx.defer(&b).await.unwrap();
    let deferred = broker.receive_deferred("q", &[b.sequence_number]).await.unwrap().remove(0);
    // The lock of a deferred message received by number expires like any other.
    clock.advance(Duration::from_secs(30));
    assert!(matches!(rx.complete(&deferred).await, Err(TransportError::LockLost)));
    let again = broker.receive_deferred("q", &[b.sequence_number]).await.unwrap().remove(0);
    rx.dead_letter(&again, DeadLetterReason::new("Poison", "cannot parse")).await.unwrap();
    let dlq = broker.receive("q/$DeadLetterQueue", 1, NOW).await.unwrap().remove(0);
    assert_eq!(dlq.dead_letter_reason.as_deref(), Some("Poison"));
    assert_eq!(dlq.dead_letter_error_description.as_deref(), Some("cannot parse"));
}

#[tokio::test]
async fn a_released_message_comes_back_without_a_count() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    broker.create_queue("q", QueueProperties::default()).await.unwrap();
    let rx = broker.receiver("q").await.unwrap();
    broker.send("q", Message::new("x")).await.unwrap();
    let m = rx.receive(1, NOW).await.unwrap().remove(0);
    rx.release(&m).await.unwrap();
    assert_eq!(rx.receive(1, NOW).await.unwrap()[0].delivery_count, 1);
}

#[tokio::test]
async fn sessions_deliver_in_order_to_one_holder() {
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    broker.create_queue("s", QueueProperties::default().with_requires_session(true)).await.unwrap();
    let rx = broker.receiver("s").await.unwrap();
    assert!(rx.entity().requires_session);
    let batch = (0..5)
        .map(|i| {
            Message::new(format!("{i}")).with_session_id(if i % 2 == 0 { "even" } else { "odd" })
        })
        .collect();
    broker.send_batch("s", batch).await.unwrap();

    let first = rx.accept_next_session(NOW).await.unwrap().expect("a session with messages");
    assert_eq!(first.session_id().as_str(), "even");
    let second = rx.accept_next_session(NOW).await.unwrap().expect("the other session");
    assert_eq!(second.session_id().as_str(), "odd");
    assert!(rx.accept_next_session(NOW).await.unwrap().is_none());
    let err = rx.accept_session(&"even".into()).await.unwrap_err();
    assert!(matches!(err, TransportError::Invalid(_)), "held by another receiver: {err:?}");

    let evens = Receive::receive(&first, 10, NOW).await.unwrap();
    let bodies: Vec<_> = evens.iter().map(|m| m.body().clone()).collect();
    assert_eq!(bodies, ["0", "2", "4"]);
    for m in &evens {
        Receive::complete(&first, m).await.unwrap();
    }
    SessionReceiver::set_state(&first, Some("done".into())).await.unwrap();
    assert_eq!(SessionReceiver::get_state(&first).await.unwrap(), Some("done".into()));
    let before = first.locked_until();
    clock.advance(Duration::from_secs(10));
    assert!(SessionReceiver::renew_session_lock(&first).await.unwrap() > before);
    SessionReceiver::close(first).await.unwrap();

    // The odd session's lock expires: its messages go to the next holder.
    clock.advance(Duration::from_secs(61));
    let err = Receive::receive(&second, 10, NOW).await.unwrap_err();
    assert!(err.is_lock_lost(), "{err:?}");
    let next = rx.accept_next_session(NOW).await.unwrap().expect("odd is free again");
    assert_eq!(next.session_id().as_str(), "odd");
    assert_eq!(Receive::receive(&next, 10, NOW).await.unwrap().len(), 2);
}

#[tokio::test]
async fn entity_info_carries_the_default_message_time_to_live() {
    use twice_broker::config::{SubscriptionProperties, TopicProperties};
    let clock = ManualClock::default();
    let broker = broker(&clock).await;
    let minute = Duration::from_secs(60);
    let props = QueueProperties::default().with_default_message_time_to_live(minute);
    broker.create_queue("short", props).await.unwrap();
    broker.create_queue("forever", QueueProperties::default()).await.unwrap();
    let topic = TopicProperties::default().with_default_message_time_to_live(5 * minute);
    broker.create_topic("events", topic).await.unwrap();
    let shorter = SubscriptionProperties::default().with_default_message_time_to_live(2 * minute);
    broker.create_subscription("events", "shorter", shorter).await.unwrap();
    let longer = SubscriptionProperties::default().with_default_message_time_to_live(9 * minute);
    broker.create_subscription("events", "longer", longer).await.unwrap();
    broker.create_subscription("events", "unset", SubscriptionProperties::default()).await.unwrap();

    let ttl = |path: &'static str| {
        let broker = broker.clone();
        async move { broker.receiver(path).await.unwrap().entity().message_time_to_live }
    };
    assert_eq!(ttl("short").await, Some(minute));
    assert_eq!(ttl("forever").await, None, "no DefaultMessageTimeToLive is forever");
    assert_eq!(ttl("events/Subscriptions/shorter").await, Some(2 * minute));
    assert_eq!(
        ttl("events/Subscriptions/longer").await,
        Some(5 * minute),
        "the topic's is shorter"
    );
    assert_eq!(ttl("events/Subscriptions/unset").await, Some(5 * minute));
    assert_eq!(ttl("short/$DeadLetterQueue").await, None, "dead-lettered messages do not expire");
}
