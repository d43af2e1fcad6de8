//! A publisher's retry, and locks counted from the broker's delivery.

use std::time::Duration;

use twice::{Delivery as _, ManualClock, Message, Receive as _, SharedClock, Transport as _};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::proxy::{CutAfter, Proxy};
use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_send_whose_confirm_was_lost_keeps_its_id() {
    let q = TestQueue::new("twice-rmq");
    let Some(plain) = twice_testkit::require_service(
        "RabbitMQ",
        RabbitMqTransport::connect(RabbitMqOptions::new(RABBITMQ_URL, q.name())).await,
    ) else {
        return;
    };
    // The connection dies after the broker took the publish and before its confirm came back.
    let cut = CutAfter::new(b"body-of-the-cut-publish".to_vec());
    let rewrite = cut.clone();
    let proxy =
        Proxy::start_with("127.0.0.1:5672", move || Box::new(rewrite.clone())).await.unwrap();
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let t = RabbitMqTransport::connect(RabbitMqOptions::new(url, q.name())).await.unwrap();
    // A publisher without ids sends again after an error.
    let m = Message::new("body-of-the-cut-publish");
    if t.send(m.clone()).await.is_err() {
        t.send(m).await.unwrap();
    }
    assert!(cut.fired());
    let mut ids = Vec::new();
    while let Some(d) = plain.receive(1, Duration::from_millis(700)).await.unwrap().pop() {
        ids.push(d.message().message_id().as_str().to_owned());
        plain.complete(&d).await.unwrap();
    }
    assert!(!ids.is_empty());
    ids.dedup();
    assert_eq!(ids.len(), 1, "the copies of one send carry one id, which the claim makes one");
}

#[tokio::test]
async fn a_lock_and_its_renewal_limit_count_from_the_delivery_not_from_receive() {
    let clock = ManualClock::default();
    let shared = SharedClock::from(clock.clone());
    let q = TestQueue::new("twice-rmq");
    let options = RabbitMqOptions::new(RABBITMQ_URL, q.name())
        .lock_duration(Duration::from_secs(30))
        .consumer_timeout(Duration::from_secs(25))
        .prefetch(2)
        .clock(shared.clone());
    let Some(t) =
        twice_testkit::require_service("RabbitMQ", RabbitMqTransport::connect(options).await)
    else {
        return;
    };
    t.send(Message::new("a").with_message_id("a")).await.unwrap();
    t.send(Message::new("b").with_message_id("b")).await.unwrap();
    let start = shared.now();
    let a = t.receive(1, WAIT).await.unwrap().pop().expect("a");
    // The broker has delivered both: the second waits in the client, the broker's
    // consumer_timeout running from its delivery.
    let bound = SharedClock::system();
    let until = bound.now() + WAIT;
    while t.unsettled() < 2 {
        assert!(bound.now() < until, "the broker did not deliver the second message");
        bound.sleep(Duration::from_millis(10)).await;
    }
    clock.advance(Duration::from_secs(20));
    let b = t.receive(1, WAIT).await.unwrap().pop().expect("b");
    assert_eq!(b.message().delivery_count, 1);
    let cap = start + Duration::from_secs(25);
    assert_eq!(
        b.message().locked_until,
        Some(cap),
        "the lock of a delivery that waited 20 s in the client ends at consumer_timeout after \
         its delivery"
    );
    assert_eq!(t.renew_lock(&b).await.unwrap(), cap, "and no renewal goes past it");
    t.complete(&a).await.unwrap();
    t.complete(&b).await.unwrap();
}
