//! The RabbitMQ transport against the RabbitMQ server on 127.0.0.1:5672.

mod brownfield;
mod handled;
mod loss;
mod versions;
mod vhosts;

use std::time::Duration;
use twice::Receive as _;

use twice::{
    DeadLetterReason, Delivery as _, ManualClock, Message, Properties, SharedClock, Transport,
    TransportError,
};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::proxy::Proxy;
use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};

const WAIT: Duration = Duration::from_secs(5);

/// A fresh queue (deleted on drop) and a transport on it, or `None` when RabbitMQ is down and
/// `CI` is not set.
async fn queue(
    configure: impl FnOnce(RabbitMqOptions) -> RabbitMqOptions,
) -> Option<(TestQueue, RabbitMqTransport)> {
    let q = TestQueue::new("twice-rmq");
    let options = configure(RabbitMqOptions::new(RABBITMQ_URL, q.name()));
    let t = twice_testkit::require_service("RabbitMQ", RabbitMqTransport::connect(options).await)?;
    Some((q, t))
}

async fn receive_one(t: &RabbitMqTransport) -> twice_rabbitmq::RabbitMqDelivery {
    let mut got = t.receive(1, WAIT).await.expect("receive");
    assert_eq!(got.len(), 1, "one message was expected");
    got.remove(0)
}

#[tokio::test]
async fn a_sent_message_arrives_with_its_id_fields_and_properties() {
    let Some((_q, t)) = queue(|o| o).await else { return };
    let sent = Message::new("body")
        .with_message_id("m-1")
        .with_correlation_id("c-1")
        .with_subject("order")
        .with_content_type("application/json")
        .with_session_id("s-1")
        .with_property("tenant", "acme")
        .with_property("n", 7i64)
        .with_property("flag", true);
    t.send(sent).await.unwrap();
    let d = receive_one(&t).await;
    let m = d.message();
    assert_eq!(m.message_id().as_str(), "m-1");
    assert_eq!(m.message.correlation_id.as_deref(), Some("c-1"));
    assert_eq!(m.message.subject.as_deref(), Some("order"));
    assert_eq!(m.message.content_type.as_deref(), Some("application/json"));
    assert_eq!(m.message.session_id.as_ref().map(|s| s.as_str()), Some("s-1"));
    assert_eq!(m.message.application_properties.get("tenant"), Some(&"acme".into()));
    assert_eq!(m.message.application_properties.get("n"), Some(&7i64.into()));
    assert_eq!(m.message.application_properties.get("flag"), Some(&true.into()));
    assert_eq!(m.body().as_ref(), b"body");
    assert_eq!(m.delivery_count, 1);
    assert!(m.locked_until.is_some());
    t.complete(&d).await.unwrap();
    assert!(t.receive(1, Duration::from_millis(300)).await.unwrap().is_empty());
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost(), "a second settlement is refused");
}

#[tokio::test]
async fn a_message_sent_without_an_id_is_given_one() {
    let Some((_q, t)) = queue(|o| o).await else { return };
    let id = t.send(Message::new("x")).await.unwrap();
    assert!(!id.as_str().is_empty());
    let d = receive_one(&t).await;
    assert_eq!(d.message().message_id(), &id);
    t.complete(&d).await.unwrap();
}

#[tokio::test]
async fn abandon_redelivers_with_a_rising_count_until_the_limit_dead_letters_it() {
    let Some((_q, t)) = queue(|o| o.max_delivery_count(Some(3))).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    for expected in 1..=3 {
        let d = receive_one(&t).await;
        assert_eq!(d.message().delivery_count, expected);
        t.abandon(&d, Properties::new()).await.unwrap();
    }
    assert!(t.receive(1, Duration::from_millis(500)).await.unwrap().is_empty());
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await;
    assert_eq!(d.message().message_id().as_str(), "m");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn dead_letter_carries_the_reason_and_description_in_headers() {
    let Some((_q, t)) = queue(|o| o).await else { return };
    t.send(Message::new("x").with_message_id("m").with_property("k", "v")).await.unwrap();
    let d = receive_one(&t).await;
    t.dead_letter(&d, DeadLetterReason::new("Bad", "it was bad")).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await;
    let m = d.message();
    assert_eq!(m.message_id().as_str(), "m");
    assert_eq!(m.dead_letter_reason.as_deref(), Some("Bad"));
    assert_eq!(m.dead_letter_error_description.as_deref(), Some("it was bad"));
    assert_eq!(m.dead_letter_source.as_deref(), Some(t.queue()));
    assert_eq!(m.message.application_properties.get("k"), Some(&"v".into()));
    assert!(matches!(
        dlq.dead_letter(&d, DeadLetterReason::default()).await,
        Err(TransportError::Unsupported(_))
    ));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn an_expired_lock_requeues_the_message_with_a_higher_count() {
    let clock = ManualClock::default();
    let shared = SharedClock::from(clock.clone());
    let Some((_q, t)) =
        queue(|o| o.lock_duration(Duration::from_secs(10)).clock(shared.clone())).await
    else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    assert_eq!(t.unsettled(), 1);
    clock.advance(Duration::from_secs(11));
    let again = receive_one(&t).await;
    assert_eq!(again.message().delivery_count, 2);
    assert_eq!(t.unsettled(), 1, "the expired delivery is no longer held");
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost(), "the old delivery lost its lock");
    t.complete(&again).await.unwrap();
    assert_eq!(t.unsettled(), 0);
}

#[tokio::test]
async fn renewal_extends_the_lock_but_never_past_the_consumer_timeout() {
    let clock = ManualClock::default();
    let shared = SharedClock::from(clock.clone());
    let Some((_q, t)) = queue(|o| {
        o.lock_duration(Duration::from_secs(10))
            .consumer_timeout(Duration::from_secs(25))
            .clock(shared.clone())
    })
    .await
    else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    let start = d.message().locked_until.unwrap() - Duration::from_secs(10);
    clock.advance(Duration::from_secs(8));
    assert_eq!(t.renew_lock(&d).await.unwrap(), start + Duration::from_secs(18));
    clock.advance(Duration::from_secs(8));
    assert_eq!(t.renew_lock(&d).await.unwrap(), start + Duration::from_secs(25), "capped");
    clock.advance(Duration::from_secs(9));
    assert!(t.renew_lock(&d).await.unwrap_err().is_lock_lost());
    let again = receive_one(&t).await;
    assert_eq!(again.message().delivery_count, 2);
    t.complete(&again).await.unwrap();
}

#[tokio::test]
async fn a_message_without_an_id_is_dead_lettered_not_handled() {
    let Some((q, t)) = queue(|o| o).await else { return };
    q.publish_raw(b"anonymous").await.unwrap();
    t.send(Message::new("named").with_message_id("named")).await.unwrap();
    let d = receive_one(&t).await;
    assert_eq!(d.message().message_id().as_str(), "named", "the anonymous one is never handed out");
    t.complete(&d).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await;
    assert_eq!(d.message().body().as_ref(), b"anonymous");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some(twice_rabbitmq::MISSING_MESSAGE_ID));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn defer_and_abandon_with_properties_are_unsupported() {
    let Some((_q, t)) = queue(|o| o).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    assert!(matches!(t.defer(&d).await, Err(TransportError::Unsupported(_))));
    let mut props = Properties::new();
    props.insert("why".into(), "x".into());
    assert!(matches!(t.abandon(&d, props).await, Err(TransportError::Unsupported(_))));
    t.complete(&d).await.unwrap();
}

#[tokio::test]
async fn a_queue_declared_with_other_arguments_is_used_as_it_is() {
    let Some((q, _t)) = queue(|o| o.max_delivery_count(Some(3))).await else { return };
    let other = RabbitMqOptions::new(RABBITMQ_URL, q.name()).max_delivery_count(Some(5));
    let t = RabbitMqTransport::connect(other).await.expect("no PRECONDITION_FAILED");
    assert_eq!(t.entity().max_delivery_count, Some(3), "the queue's own limit holds");
    assert!(t.notes().is_empty(), "nothing is missing: {:?}", t.notes());
}

#[tokio::test]
async fn after_the_connection_is_cut_the_transport_reconnects_and_old_deliveries_lost_their_lock() {
    let Some(proxy) =
        twice_testkit::require_service("RabbitMQ", Proxy::start("127.0.0.1:5672").await)
    else {
        return;
    };
    let q = TestQueue::new("twice-rmq");
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let Some(t) = twice_testkit::require_service(
        "RabbitMQ",
        RabbitMqTransport::connect(RabbitMqOptions::new(url, q.name())).await,
    ) else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    proxy.cut();
    // The first call after the cut may see the dead connection; a later one reconnects.
    let mut again = Vec::new();
    for _ in 0..20 {
        match t.receive(1, Duration::from_secs(1)).await {
            Ok(got) if !got.is_empty() => {
                again = got;
                break;
            }
            Ok(_) => {}
            Err(e) => assert!(e.is_transient(), "{e:?}"),
        }
    }
    assert_eq!(again.len(), 1, "the message comes back on the new connection");
    assert_eq!(again[0].message().message_id().as_str(), "m");
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost());
    t.complete(&again[0]).await.unwrap();
    t.send(Message::new("y").with_message_id("n")).await.unwrap();
}

#[tokio::test]
async fn the_message_time_to_live_is_declared_reported_and_expires_messages() {
    let ttl = Duration::from_millis(500);
    let Some((_q, t)) = queue(|o| o.message_time_to_live(Some(ttl))).await else { return };
    assert_eq!(t.entity().message_time_to_live, Some(ttl));
    t.send(Message::new("x").with_message_id("short-lived")).await.unwrap();
    tokio::time::sleep(ttl * 3).await;
    assert!(t.receive(1, Duration::from_millis(300)).await.unwrap().is_empty(), "expired");
    let dlq = t.dead_letter_receiver().await.unwrap();
    assert_eq!(dlq.entity().message_time_to_live, None, "dead-lettered messages stay");
    let mut got = dlq.receive(1, WAIT).await.unwrap();
    assert_eq!(got.len(), 1, "the expired message is dead-lettered");
    let d = got.remove(0);
    assert_eq!(d.message().message_id().as_str(), "short-lived");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some("TTLExpiredException"));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn a_queue_without_a_time_to_live_reports_none() {
    let Some((_q, t)) = queue(|o| o).await else { return };
    assert_eq!(t.entity().message_time_to_live, None);
}
