//! What the transport does on RabbitMQ 4.0 and 4.3, where their semantics differ from the 3.10
//! of these machines: shown through a proxy that makes the 3.10 server look and count as the
//! newer one does (`twice_testkit::proxy::amqp`). An emulation of the documented differences,
//! not the newer server itself.

use std::time::Duration;

use twice::{DeadLetterReason, Delivery as _, Message, Properties, Receive as _};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::proxy::Proxy;
use twice_testkit::proxy::amqp::Emulation;
use twice_testkit::rabbitmq::TestQueue;

const WAIT: Duration = Duration::from_secs(5);

/// A fresh queue and a transport on it that sees RabbitMQ as `emulation` shows it.
async fn queue_on(
    emulation: Emulation,
    configure: impl FnOnce(RabbitMqOptions) -> RabbitMqOptions,
) -> Option<(TestQueue, Proxy, RabbitMqTransport)> {
    let proxy = Proxy::start_with("127.0.0.1:5672", move || emulation.rewrite()).await;
    let proxy = twice_testkit::require_service("RabbitMQ", proxy)?;
    let q = TestQueue::new("twice-rmq");
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let t = RabbitMqTransport::connect(configure(RabbitMqOptions::new(url, q.name())))
        .await
        .expect("connecting through the proxy");
    Some((q, proxy, t))
}

async fn receive_one(t: &RabbitMqTransport) -> Option<twice_rabbitmq::RabbitMqDelivery> {
    t.receive(1, WAIT).await.expect("receive").pop()
}

#[tokio::test]
async fn on_4_0_a_dead_lettered_message_survives_more_returns_than_the_default_limit() {
    let Some((_q, _p, t)) = queue_on(Emulation::v4_0(), |o| o).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await.expect("the message");
    t.dead_letter(&d, DeadLetterReason::new("Bad", "bad")).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    // Someone reading the dead-letter queue puts the message back, again and again: more
    // often than RabbitMQ 4.0's default delivery limit of 20.
    for i in 0..25 {
        let d = receive_one(&dlq).await.unwrap_or_else(|| panic!("dropped after {i} returns"));
        dlq.abandon(&d, Properties::new()).await.unwrap();
    }
    let d = receive_one(&dlq).await.expect("the dead-lettered message was dropped");
    assert_eq!(d.message().message_id().as_str(), "m");
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn on_4_0_an_unlimited_max_delivery_count_has_no_limit() {
    let Some((_q, _p, t)) = queue_on(Emulation::v4_0(), |o| o.max_delivery_count(None)).await
    else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    for i in 0..25 {
        let d = receive_one(&t).await.unwrap_or_else(|| panic!("gone after {i} returns"));
        t.abandon(&d, Properties::new()).await.unwrap();
    }
    let d = receive_one(&t).await.expect("dead-lettered although the count is unlimited");
    t.complete(&d).await.unwrap();
}

#[tokio::test]
async fn on_4_3_abandon_still_reaches_max_delivery_count() {
    let Some((_q, _p, t)) = queue_on(Emulation::v4_3(), |o| o.max_delivery_count(Some(3))).await
    else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    for expected in 1..=3 {
        let d = receive_one(&t).await.expect("a delivery");
        assert_eq!(d.message().delivery_count, expected, "the count of each delivery");
        t.abandon(&d, Properties::new()).await.unwrap();
    }
    assert!(
        t.receive(1, Duration::from_millis(500)).await.unwrap().is_empty(),
        "delivered past MaxDeliveryCount"
    );
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await.expect("in the dead-letter queue");
    assert_eq!(d.message().message_id().as_str(), "m");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn on_4_3_an_expired_lock_still_counts_a_delivery() {
    let clock = twice::ManualClock::default();
    let shared = twice::SharedClock::from(clock.clone());
    let Some((_q, _p, t)) = queue_on(Emulation::v4_3(), |o| {
        o.lock_duration(Duration::from_secs(10)).clock(shared.clone())
    })
    .await
    else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await.expect("the message");
    clock.advance(Duration::from_secs(11));
    let again = receive_one(&t).await.expect("back after its lock ran out");
    assert_eq!(again.message().delivery_count, 2);
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost());
    t.complete(&again).await.unwrap();
}
