//! Queues that exist before the transport, declared by hand with arguments of their own.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use twice::{Delivery as _, Message, Properties, Receive as _, Transport as _};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};

const WAIT: Duration = Duration::from_secs(5);

/// Declares `queue` as its owner did, with `arguments`.
async fn declare_by_hand(queue: &str, arguments: &[(&str, AMQPValue)]) -> Option<()> {
    let conn = Connection::connect(RABBITMQ_URL, ConnectionProperties::default()).await;
    let conn = twice_testkit::require_service("RabbitMQ", conn)?;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    for (k, v) in arguments {
        args.insert((*k).into(), v.clone());
    }
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    ch.queue_declare(queue.into(), durable, args).await.unwrap();
    conn.close(200, "done".into()).await.unwrap();
    Some(())
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

#[tokio::test]
async fn a_quorum_queue_declared_by_hand_is_used_as_it_is_and_what_it_lacks_is_named() {
    let q = TestQueue::new("twice-rmq");
    let args = [
        ("x-queue-type", text("quorum")),
        ("x-max-length", AMQPValue::LongLongInt(10_000)),
        ("x-message-ttl", AMQPValue::LongLongInt(3_600_000)),
    ];
    let Some(()) = declare_by_hand(q.name(), &args).await else { return };
    let options = RabbitMqOptions::new(RABBITMQ_URL, q.name()).max_delivery_count(Some(2));
    let t = RabbitMqTransport::connect(options).await.expect("connect to the queue as it is");
    assert_eq!(
        t.entity().message_time_to_live,
        Some(Duration::from_secs(3600)),
        "the queue's own x-message-ttl"
    );
    let notes = t.notes().join("\n");
    assert!(notes.contains("no delivery limit"), "{notes}");
    assert!(notes.contains("no dead-letter target"), "{notes}");
    assert!(notes.contains("rabbitmqctl set_policy"), "how to add it: {notes}");
    // It works as a queue of the transport's: past MaxDeliveryCount the transport moves the
    // message itself.
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    for _ in 0..2 {
        let d = t.receive(1, WAIT).await.unwrap().pop().expect("a delivery");
        t.abandon(&d, Properties::new()).await.unwrap();
    }
    assert!(t.receive(1, Duration::from_millis(500)).await.unwrap().is_empty());
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = dlq.receive(1, WAIT).await.unwrap().pop().expect("dead-lettered");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn a_classic_queue_is_counted_by_the_transport() {
    let q = TestQueue::new("twice-rmq");
    let Some(()) = declare_by_hand(q.name(), &[]).await else { return };
    let options = RabbitMqOptions::new(RABBITMQ_URL, q.name()).max_delivery_count(Some(3));
    let t = RabbitMqTransport::connect(options).await.expect("connect to the queue as it is");
    assert!(t.notes().join("\n").contains("not a quorum queue"), "{:?}", t.notes());
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    for expected in 1..=3 {
        let d = t.receive(1, WAIT).await.unwrap().pop().expect("a delivery");
        assert_eq!(d.message().delivery_count, expected);
        t.abandon(&d, Properties::new()).await.unwrap();
    }
    assert!(t.receive(1, Duration::from_millis(500)).await.unwrap().is_empty());
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = dlq.receive(1, WAIT).await.unwrap().pop().expect("dead-lettered");
    assert_eq!(d.message().message_id().as_str(), "m");
    dlq.complete(&d).await.unwrap();
}

#[tokio::test]
async fn a_transport_that_may_not_declare_opens_the_queues_that_exist_and_no_other() {
    let q = TestQueue::new("twice-rmq");
    let made = RabbitMqTransport::connect(RabbitMqOptions::new(RABBITMQ_URL, q.name())).await;
    let Some(_made) = twice_testkit::require_service("RabbitMQ", made) else { return };
    let options = RabbitMqOptions::new(RABBITMQ_URL, q.name()).declare(false);
    let t = RabbitMqTransport::connect(options).await.expect("the queue exists");
    let dlq = t.dead_letter_receiver().await.expect("its dead-letter queue exists");
    assert_eq!(dlq.ready_count().await.unwrap(), 0);
    let missing =
        RabbitMqOptions::new(RABBITMQ_URL, format!("{}-missing", q.name())).declare(false);
    let err = RabbitMqTransport::connect(missing).await.unwrap_err();
    assert!(matches!(err, twice::TransportError::EntityNotFound(_)), "{err:?}");
}
