//! The NATS JetStream transport against the NATS server on 127.0.0.1:4222.

mod handled;
mod loss;

use std::time::Duration;
use twice::Receive as _;

use twice::{
    DeadLetterReason, Delivery as _, Message, MessageIdentity, Properties, Transport,
    TransportError,
};
use twice_nats::{NatsDelivery, NatsOptions, NatsTransport};
use twice_testkit::nats::{NATS_URL, TestStream};
use twice_testkit::proxy::Proxy;

const WAIT: Duration = Duration::from_secs(5);

/// A fresh stream (deleted on drop) and a transport on it, or `None` when NATS is down and `CI`
/// is not set.
async fn stream(
    configure: impl FnOnce(NatsOptions) -> NatsOptions,
) -> Option<(TestStream, NatsTransport)> {
    let s = TestStream::new("TWICE_NATS");
    let options = configure(NatsOptions::new(NATS_URL, s.name()));
    let t = twice_testkit::require_service("NATS", NatsTransport::connect(options).await)?;
    Some((s, t))
}

async fn receive_one(t: &NatsTransport) -> NatsDelivery {
    let mut got = t.receive(1, WAIT).await.expect("receive");
    assert_eq!(got.len(), 1, "one message was expected");
    got.remove(0)
}

#[tokio::test]
async fn a_sent_message_arrives_with_its_id_fields_and_string_properties() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    let sent = Message::new("body")
        .with_message_id("m-1")
        .with_correlation_id("c-1")
        .with_subject("order")
        .with_content_type("application/json")
        .with_session_id("s-1")
        .with_property("tenant", "acme")
        .with_property("n", 7i64);
    t.send(sent).await.unwrap();
    let d = receive_one(&t).await;
    let m = d.message();
    assert_eq!(m.message_id().as_str(), "m-1");
    assert_eq!(m.message.correlation_id.as_deref(), Some("c-1"));
    assert_eq!(m.message.subject.as_deref(), Some("order"));
    assert_eq!(m.message.content_type.as_deref(), Some("application/json"));
    assert_eq!(m.message.session_id.as_ref().map(|s| s.as_str()), Some("s-1"));
    assert_eq!(m.message.application_properties.get("tenant"), Some(&"acme".into()));
    assert_eq!(m.message.application_properties.get("n"), Some(&"7".into()), "headers are text");
    assert_eq!(m.body().as_ref(), b"body");
    assert_eq!(m.delivery_count, 1);
    assert_eq!(m.sequence_number.get(), 1);
    t.complete(&d).await.unwrap();
    assert!(t.receive(1, Duration::from_millis(300)).await.unwrap().is_empty());
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost(), "a second settlement is refused");
    assert_eq!(t.message_count().await.unwrap(), 0, "a completed message leaves the stream");
}

#[tokio::test]
async fn the_duplicate_window_drops_a_resent_id() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    let m = Message::new("x").with_message_id("same");
    assert!(!t.send_reporting_duplicate(m.clone()).await.unwrap());
    assert!(t.send_reporting_duplicate(m).await.unwrap(), "the second send is a duplicate");
    let d = receive_one(&t).await;
    t.complete(&d).await.unwrap();
    assert!(t.receive(1, Duration::from_millis(300)).await.unwrap().is_empty());
}

#[tokio::test]
async fn abandon_redelivers_with_a_rising_count_until_the_limit_dead_letters_it() {
    let Some((_s, t)) = stream(|o| o.max_delivery_count(Some(3))).await else { return };
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
    assert_eq!(t.message_count().await.unwrap(), 0, "it left the stream");
}

#[tokio::test]
async fn dead_letter_carries_the_reason_and_description_in_headers() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    t.send(Message::new("x").with_message_id("m").with_property("k", "v")).await.unwrap();
    let d = receive_one(&t).await;
    t.dead_letter(&d, DeadLetterReason::new("Bad", "it was bad")).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await;
    let m = d.message();
    assert_eq!(m.message_id().as_str(), "m");
    assert_eq!(m.dead_letter_reason.as_deref(), Some("Bad"));
    assert_eq!(m.dead_letter_error_description.as_deref(), Some("it was bad"));
    assert_eq!(m.dead_letter_source.as_deref(), Some(t.stream()));
    assert_eq!(m.message.application_properties.get("k"), Some(&"v".into()));
    assert!(matches!(
        dlq.dead_letter(&d, DeadLetterReason::default()).await,
        Err(TransportError::Unsupported(_))
    ));
    dlq.complete(&d).await.unwrap();
}

// The lock is the server's AckWait, so these two wait for the server's clock, a second or two.
#[tokio::test]
async fn an_expired_lock_redelivers_the_message_with_a_higher_count() {
    let Some((_s, t)) = stream(|o| o.lock_duration(Duration::from_secs(1))).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    let again = receive_one(&t).await;
    assert_eq!(again.message().delivery_count, 2);
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost(), "the old delivery lost its lock");
    t.complete(&again).await.unwrap();
}

#[tokio::test]
async fn renewal_keeps_the_message_from_being_redelivered() {
    let Some((_s, t)) = stream(|o| o.lock_duration(Duration::from_secs(1))).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    let first = d.message().locked_until.unwrap();
    let mut until = first;
    for _ in 0..4 {
        // Nothing comes while the lock is renewed every 500 ms, two lock durations in all.
        assert!(t.receive(1, Duration::from_millis(500)).await.unwrap().is_empty());
        until = t.renew_lock(&d).await.unwrap();
    }
    assert!(until > first);
    t.complete(&d).await.unwrap();
    assert!(t.receive(1, Duration::from_millis(1500)).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_message_without_an_id_is_dead_lettered_not_handled() {
    let Some((s, t)) = stream(|o| o).await else { return };
    s.publish_raw(b"anonymous").await.unwrap();
    t.send(Message::new("named").with_message_id("named")).await.unwrap();
    let d = receive_one(&t).await;
    assert_eq!(d.message().message_id().as_str(), "named", "the anonymous one is never handed out");
    t.complete(&d).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let d = receive_one(&dlq).await;
    assert_eq!(d.message().body().as_ref(), b"anonymous");
    assert_eq!(d.message().dead_letter_reason.as_deref(), Some(twice_nats::MISSING_MESSAGE_ID));
    assert!(!d.message().message_id().as_str().is_empty(), "shown under the id of its move");
    dlq.complete(&d).await.unwrap();
    assert_eq!(t.message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn the_identity_policy_names_messages_by_a_header_or_their_content() {
    let Some((s, t)) = stream(|o| o.identity(MessageIdentity::property("event-id"))).await else {
        return;
    };
    t.send(Message::new("x").with_message_id("broker-id").with_property("event-id", "e-7"))
        .await
        .unwrap();
    let d = receive_one(&t).await;
    assert_eq!(d.message().message_id().as_str(), "e-7", "the header, not Nats-Msg-Id");
    t.complete(&d).await.unwrap();

    let hashed = MessageIdentity::message_id().or_content_hash();
    let Some((s2, t2)) = stream(|o| o.identity(hashed)).await else { return };
    s2.publish_raw(b"same").await.unwrap();
    s2.publish_raw(b"same").await.unwrap();
    let got = t2.receive(2, WAIT).await.unwrap();
    assert_eq!(got.len(), 2, "two publications are two stored messages");
    let ids: Vec<_> = got.iter().map(|d| d.message().message_id().as_str().to_owned()).collect();
    assert_eq!(ids[0], ids[1], "of the same content: one id, so the claim makes them one");
    assert!(ids[0].starts_with("sha256:"));
    for d in &got {
        t2.complete(d).await.unwrap();
    }
    drop(s);
}

#[tokio::test]
async fn defer_and_abandon_with_properties_are_unsupported() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    assert!(matches!(t.defer(&d).await, Err(TransportError::Unsupported(_))));
    let mut props = Properties::new();
    props.insert("why".into(), "x".into());
    assert!(matches!(t.abandon(&d, props).await, Err(TransportError::Unsupported(_))));
    t.complete(&d).await.unwrap();
}

#[tokio::test]
async fn after_the_connection_is_cut_the_client_reconnects_and_settles() {
    let Some(proxy) = twice_testkit::require_service("NATS", Proxy::start("127.0.0.1:4222").await)
    else {
        return;
    };
    let s = TestStream::new("TWICE_NATS");
    let url = format!("nats://{}", proxy.addr());
    let Some(t) = twice_testkit::require_service(
        "NATS",
        NatsTransport::connect(NatsOptions::new(url, s.name())).await,
    ) else {
        return;
    };
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_one(&t).await;
    proxy.cut();
    // A delivery taken before the cut is still locked on the server: it settles after the
    // client has reconnected.
    let mut completed = Err(TransportError::Closed);
    for _ in 0..50 {
        completed = t.complete(&d).await;
        if completed.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    completed.unwrap();
    t.send(Message::new("y").with_message_id("n")).await.unwrap();
    let n = receive_one(&t).await;
    assert_eq!(n.message().message_id().as_str(), "n");
    t.complete(&n).await.unwrap();
}

#[tokio::test]
async fn the_message_time_to_live_is_the_max_age_of_the_stream() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    assert_eq!(t.entity().message_time_to_live, None, "max_age 0 keeps messages forever");

    let max_age = Duration::from_secs(90);
    let Some((_s, t)) = stream(|o| o.max_age(max_age)).await else { return };
    assert_eq!(t.entity().message_time_to_live, Some(max_age));
    assert_eq!(t.entity().duplicate_detection_window, Some(max_age), "no longer than max_age");
    let dlq = t.dead_letter_receiver().await.unwrap();
    assert_eq!(dlq.entity().message_time_to_live, None, "dead-lettered messages stay");
}

#[tokio::test]
async fn an_existing_stream_reports_its_own_max_age() {
    use async_nats::jetstream::stream;
    let s = TestStream::new("TWICE_NATS");
    let max_age = Duration::from_secs(1);
    let client = async_nats::connect(NATS_URL).await;
    let Some(client) = twice_testkit::require_service("NATS", client) else { return };
    let js = async_nats::jetstream::new(client);
    js.create_stream(stream::Config {
        name: s.name().to_owned(),
        subjects: vec![s.subject()],
        retention: stream::RetentionPolicy::WorkQueue,
        max_age,
        ..stream::Config::default()
    })
    .await
    .unwrap();
    let options = NatsOptions::new(NATS_URL, s.name()).max_age(Duration::from_secs(3600));
    let t = NatsTransport::connect(options).await.unwrap();
    assert_eq!(t.entity().message_time_to_live, Some(max_age), "the server's, not the option's");
    t.send(Message::new("x").with_message_id("short-lived")).await.unwrap();
    tokio::time::sleep(max_age * 2).await;
    assert!(t.receive(1, Duration::from_millis(300)).await.unwrap().is_empty(), "aged out");
}

#[tokio::test]
async fn the_lock_is_the_existing_consumers_ack_wait_counted_from_the_pull() {
    use async_nats::jetstream::{self, consumer::pull, stream};
    let s = TestStream::new("TWICE_NATS");
    let client = async_nats::connect(NATS_URL).await;
    let Some(client) = twice_testkit::require_service("NATS", client) else { return };
    let js = jetstream::new(client);
    let created = js
        .create_stream(stream::Config {
            name: s.name().to_owned(),
            subjects: vec![s.subject()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..stream::Config::default()
        })
        .await
        .unwrap();
    let ack_wait = Duration::from_secs(2);
    let _: jetstream::consumer::PullConsumer = created
        .create_consumer(pull::Config {
            durable_name: Some("twice".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait,
            ..pull::Config::default()
        })
        .await
        .unwrap();
    // The options say 60 s; the server's consumer says 2 s, and the server is right.
    let t = NatsTransport::connect(NatsOptions::new(NATS_URL, s.name())).await.unwrap();
    assert_eq!(t.entity().lock_duration, ack_wait, "the consumer's AckWait is the lock");
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let clock = twice::SharedClock::system();
    let before = clock.now();
    let d = receive_one(&t).await;
    let until = d.message().locked_until.unwrap();
    assert!(until <= before + ack_wait + Duration::from_millis(5), "no later than the server's");
    let again = receive_one(&t).await;
    assert_eq!(again.message().delivery_count, 2, "the server delivered it again at AckWait");
    assert!(t.complete(&d).await.unwrap_err().is_lock_lost());
    t.complete(&again).await.unwrap();
}

#[tokio::test]
async fn peek_reads_stored_messages_without_taking_them() {
    let Some((_s, t)) = stream(|o| o).await else { return };
    for id in ["a", "b", "c"] {
        t.send(Message::new(id).with_message_id(id)).await.unwrap();
    }
    let got = t.receive(2, WAIT).await.unwrap();
    t.complete(&got[1]).await.unwrap();
    t.release(&got[0]).await.unwrap();
    let peeked = t.peek(None, 10).await.unwrap();
    let ids: Vec<_> = peeked.iter().map(|m| m.message_id().as_str().to_owned()).collect();
    assert_eq!(ids, ["a", "c"], "the acknowledged one is gone; nothing is taken");
    assert_eq!(peeked[1].sequence_number.get(), 3);
    let from = t.peek(Some(2), 10).await.unwrap();
    assert_eq!(from.len(), 1);
    assert_eq!(t.message_count().await.unwrap(), 2);
}
