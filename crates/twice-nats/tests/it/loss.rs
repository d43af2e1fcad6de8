//! The ways a message could be lost or wrongly completed on JetStream, each shown on a real
//! server: a reused position-derived id, a dead-letter copy dropped as a duplicate, a message
//! stranded past MaxDeliver, a publisher's retry stored twice.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt as _;
use twice::{DeadLetterReason, Delivery as _, Message, MessageIdentity, Properties, Receive as _};
use twice_nats::{NatsOptions, NatsTransport, dead_letter_stream_name};
use twice_testkit::nats::{NATS_URL, TestStream};
use twice_testkit::proxy::nats::Swallow;
use twice_testkit::proxy::{CutAfter, Proxy};

use crate::handled::{Inbox, run_until};

const BOUND: Duration = Duration::from_secs(20);

async fn js() -> Option<jetstream::Context> {
    let client = twice_testkit::require_service("NATS", async_nats::connect(NATS_URL).await)?;
    Some(jetstream::new(client))
}

/// Receives from `t` until a message comes or the bound passes.
async fn receive_within(t: &NatsTransport, bound: Duration) -> Option<twice_nats::NatsDelivery> {
    let clock = twice::SharedClock::system();
    let until = clock.now() + bound;
    while clock.now() < until {
        if let Some(d) = t.receive(1, Duration::from_millis(500)).await.ok()?.pop() {
            return Some(d);
        }
    }
    None
}

#[tokio::test]
async fn a_new_message_without_an_id_on_a_remade_stream_is_handled() {
    let s = TestStream::new("TWICE_NATS");
    let Some(js) = js().await else { return };
    // A producer that sets no id, and a receiver that names such messages by their content.
    let identity = MessageIdentity::message_id().or_content_hash();
    let options = || NatsOptions::new(NATS_URL, s.name()).identity(identity.clone());
    let inbox = Inbox::new().await;
    let t = NatsTransport::connect(options()).await.unwrap();
    s.publish_raw(b"first").await.unwrap();
    let seen = run_until(t, &inbox, "orders", BOUND, |c| c.completed >= 1).await;
    assert_eq!(seen.handled, ["first"]);
    // The stream is deleted and made again: its sequence starts again at 1.
    js.delete_stream(s.name()).await.unwrap();
    let t = NatsTransport::connect(options()).await.unwrap();
    s.publish_raw(b"second").await.unwrap();
    let seen = run_until(t, &inbox, "orders", BOUND, |c| c.completed >= 1).await;
    assert_eq!(seen.handled, ["second"], "the new message was completed without its handler");
}

#[tokio::test]
async fn a_dead_letter_copy_from_a_remade_stream_is_not_dropped_as_a_duplicate() {
    let s = TestStream::new("TWICE_NATS");
    let Some(js) = js().await else { return };
    let options = || NatsOptions::new(NATS_URL, s.name());
    let t = NatsTransport::connect(options()).await.unwrap();
    t.send(Message::new("a").with_message_id("a")).await.unwrap();
    let d = receive_within(&t, BOUND).await.expect("a");
    t.dead_letter(&d, DeadLetterReason::new("Bad", "a")).await.unwrap();
    // Only the stream is made again; its dead-letter stream, with its duplicate window, stays.
    js.delete_stream(s.name()).await.unwrap();
    let t = NatsTransport::connect(options()).await.unwrap();
    t.send(Message::new("b").with_message_id("b")).await.unwrap();
    let d = receive_within(&t, BOUND).await.expect("b");
    assert_eq!(d.message().sequence_number.get(), 1, "the sequence started again");
    t.dead_letter(&d, DeadLetterReason::new("Bad", "b")).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let mut ids = Vec::new();
    while let Some(d) = receive_within(&dlq, Duration::from_secs(2)).await {
        ids.push(d.message().message_id().as_str().to_owned());
        dlq.complete(&d).await.unwrap();
    }
    ids.sort();
    assert_eq!(ids, ["a", "b"], "a dead-lettered message is in neither stream");
    assert_eq!(t.message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_message_past_max_delivery_count_whose_move_failed_is_dead_lettered_later() {
    let s = TestStream::new("TWICE_NATS");
    let Some(js) = js().await else { return };
    let options = NatsOptions::new(NATS_URL, s.name())
        .max_delivery_count(Some(1))
        .lock_duration(Duration::from_secs(1));
    let t = NatsTransport::connect(options).await.unwrap();
    let advisory = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.twice", s.name());
    let mut advisories = js.client().subscribe(advisory).await.unwrap();
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    let d = receive_within(&t, BOUND).await.expect("the first delivery");
    t.abandon(&d, Properties::new()).await.unwrap();
    // The dead-letter stream is gone (deleted by mistake): moving the message fails.
    js.delete_stream(dead_letter_stream_name(s.name())).await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer =
        js.get_stream(s.name()).await.unwrap().get_consumer("twice").await.unwrap();
    // Wait until the server has either given up on the message (the advisory) or delivered it
    // a third time: the failed move did not end its deliveries.
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    loop {
        assert!(clock.now() < until, "neither an advisory nor a further delivery came");
        assert!(t.receive(1, Duration::from_millis(200)).await.unwrap().is_empty());
        let gave_up = tokio::time::timeout(Duration::from_millis(10), advisories.next()).await;
        if gave_up.is_ok() || consumer.info().await.unwrap().delivered.consumer_sequence >= 3 {
            break;
        }
    }
    // The dead-letter stream is made again: the message must end there.
    let dlq = t.dead_letter_receiver().await.unwrap();
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    let mut moved = None;
    while moved.is_none() && clock.now() < until {
        assert!(t.receive(1, Duration::from_millis(200)).await.unwrap().is_empty());
        moved = dlq.receive(1, Duration::from_millis(200)).await.unwrap().pop();
    }
    let moved = moved.expect("the message stayed undelivered in the stream");
    assert_eq!(moved.message().message_id().as_str(), "m");
    assert_eq!(moved.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&moved).await.unwrap();
    assert_eq!(t.message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_message_stranded_while_no_transport_was_connected_is_dead_lettered_on_connect() {
    use async_nats::jetstream::stream;
    let s = TestStream::new("TWICE_NATS");
    let Some(js) = js().await else { return };
    // A stream and consumer as a transport made them, with MaxDeliver = MaxDeliveryCount + 1.
    let created = js
        .create_stream(stream::Config {
            name: s.name().to_owned(),
            subjects: vec![s.subject()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..stream::Config::default()
        })
        .await
        .unwrap();
    let consumer: jetstream::consumer::PullConsumer = created
        .create_consumer(pull::Config {
            durable_name: Some("twice".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_deliver: 2,
            ..pull::Config::default()
        })
        .await
        .unwrap();
    let headers = {
        let mut h = async_nats::HeaderMap::new();
        h.insert(async_nats::header::NATS_MESSAGE_ID, "m");
        h
    };
    js.publish_with_headers(s.subject(), headers, "x".into()).await.unwrap().await.unwrap();
    // A process takes both deliveries and dies without settling, while no transport listens
    // for the advisory.
    for _ in 0..2 {
        let mut batch = consumer.batch().max_messages(1).expires(BOUND).messages().await.unwrap();
        let m = batch.next().await.expect("a delivery").unwrap();
        m.ack_with(jetstream::AckKind::Nak(None)).await.unwrap();
    }
    let mut batch =
        consumer.batch().max_messages(1).expires(Duration::from_secs(1)).messages().await.unwrap();
    assert!(batch.next().await.is_none(), "JetStream stopped delivering it");
    let options = NatsOptions::new(NATS_URL, s.name()).max_delivery_count(Some(1));
    let t = NatsTransport::connect(options).await.unwrap();
    let dlq = t.dead_letter_receiver().await.unwrap();
    let moved =
        receive_within(&dlq, BOUND).await.expect("the stranded message stayed in the stream");
    assert_eq!(moved.message().message_id().as_str(), "m");
    assert_eq!(moved.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&moved).await.unwrap();
    assert_eq!(t.message_count().await.unwrap(), 0);
}

#[tokio::test]
async fn a_send_whose_acknowledgement_was_lost_is_stored_once() {
    let s = TestStream::new("TWICE_NATS");
    let cut = CutAfter::new(format!("HPUB {} ", s.subject()));
    let rewrite = cut.clone();
    let proxy = Proxy::start_with("127.0.0.1:4222", move || Box::new(rewrite.clone())).await;
    let Some(proxy) = twice_testkit::require_service("NATS", proxy) else { return };
    let url = format!("nats://{}", proxy.addr());
    let t = NatsTransport::connect(NatsOptions::new(url, s.name())).await.unwrap();
    // A publisher without ids: the connection dies after the stream stored the message and
    // before its acknowledgement came back. What a publisher does after an error is to send
    // again.
    let m = Message::new("once");
    if t.send(m.clone()).await.is_err() {
        t.send(m).await.unwrap();
    }
    assert!(cut.fired(), "the connection was cut after the publish");
    assert_eq!(t.message_count().await.unwrap(), 1, "one message stored once");
}

#[tokio::test]
async fn a_message_stranded_while_a_transport_is_connected_is_moved_on_the_advisory() {
    use async_nats::jetstream::stream;
    let s = TestStream::new("TWICE_NATS");
    let Some(js) = js().await else { return };
    let created = js
        .create_stream(stream::Config {
            name: s.name().to_owned(),
            subjects: vec![s.subject()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..stream::Config::default()
        })
        .await
        .unwrap();
    // A consumer with a MaxDeliver of its own, and an AckWait longer than the test: only the
    // advisory, not the next sweep, can move the message in time.
    let consumer: jetstream::consumer::PullConsumer = created
        .create_consumer(pull::Config {
            durable_name: Some("twice".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(120),
            max_deliver: 2,
            ..pull::Config::default()
        })
        .await
        .unwrap();
    let options = NatsOptions::new(NATS_URL, s.name()).max_delivery_count(Some(1));
    let t = NatsTransport::connect(options).await.unwrap();
    assert!(!t.notes().is_empty(), "the consumer's own AckWait is noted");
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    // Another process takes both deliveries and gives them back; JetStream gives up.
    for _ in 0..2 {
        let mut batch = consumer.batch().max_messages(1).expires(BOUND).messages().await.unwrap();
        let m = batch.next().await.expect("a delivery").unwrap();
        m.ack_with(jetstream::AckKind::Nak(None)).await.unwrap();
    }
    let mut batch =
        consumer.batch().max_messages(1).expires(Duration::from_secs(1)).messages().await.unwrap();
    assert!(batch.next().await.is_none(), "JetStream stopped delivering it");
    let dlq = t.dead_letter_receiver().await.unwrap();
    let moved = receive_within(&dlq, BOUND).await.expect("moved on the advisory");
    assert_eq!(moved.message().message_id().as_str(), "m");
    assert_eq!(moved.message().dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    dlq.complete(&moved).await.unwrap();
}

/// A pull request the server never answers (lost on the way, or with a server that was killed
/// before it answered) must not hang `receive`: the call gives up a little after its wait, and a
/// later call pulls again. Seen in `twice chaos --broker nats://…`, where every processor ended
/// waiting on such a pull and the orders after it were never handled.
#[tokio::test]
async fn a_pull_the_server_never_answers_does_not_hang_receive() {
    let s = TestStream::new("TWICE_NATS");
    let swallow = Swallow::new("$JS.API.CONSUMER.MSG.NEXT.");
    let rewrite = swallow.clone();
    let proxy = Proxy::start_with("127.0.0.1:4222", move || Box::new(rewrite.clone())).await;
    let Some(proxy) = twice_testkit::require_service("NATS", proxy) else { return };
    let url = format!("nats://{}", proxy.addr());
    let t = NatsTransport::connect(NatsOptions::new(url, s.name())).await.unwrap();
    t.send(Message::new("x").with_message_id("m")).await.unwrap();
    swallow.arm(true);
    let got = tokio::time::timeout(BOUND, t.receive(1, Duration::from_millis(500))).await;
    assert!(swallow.dropped() > 0, "the pull request was removed");
    let got = got.expect("receive returned although the server never answered its pull");
    assert!(got.is_err() || got.unwrap().is_empty(), "nothing can have come");
    swallow.arm(false);
    let d = receive_within(&t, BOUND).await.expect("the message, once pulls are answered again");
    assert_eq!(d.message().message_id().as_str(), "m");
    t.complete(&d).await.unwrap();
}
