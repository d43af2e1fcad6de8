//! Receive, settle, send and manage messages through the client against `twice serve`.

use std::time::Duration;

use twice::{DeadLetterReason, Message, Properties, SessionId, Value as TwiceValue};
use twice_servicebus_client::{ReceiveMode, ReceiverOptions, StableIdSender};

use crate::harness::Serve;

const WAIT: Duration = Duration::from_secs(5);
const BRIEF: Duration = Duration::from_millis(200);

fn body(d: &twice_servicebus_client::ServiceBusDelivery) -> String {
    String::from_utf8_lossy(d.message().body()).into_owned()
}

#[tokio::test]
async fn sends_receives_and_completes() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("q");
    for i in 0..3 {
        sender
            .send_message(Message::new(format!("m{i}")).with_message_id(format!("id{i}")))
            .await
            .unwrap();
    }
    let receiver = client.receiver("q", ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    let bodies: Vec<String> = got.iter().map(body).collect();
    assert_eq!(bodies, ["m0", "m1", "m2"]);
    assert_eq!(got[1].message().message_id().as_str(), "id1");
    assert_eq!(got[0].message().delivery_count, 1);
    assert!(got[0].lock_token().is_some());
    assert!(got[0].message().sequence_number.get() > 0);
    for d in &got {
        receiver.complete_message(d).await.unwrap();
    }
    assert!(receiver.receive_messages(10, BRIEF).await.unwrap().is_empty());
    // Settling twice: the lock is gone.
    let err = receiver.complete_message(&got[0]).await.unwrap_err();
    assert!(err.is_lock_lost(), "{err}");
}

#[tokio::test]
async fn abandons_with_properties_and_dead_letters_with_a_reason() {
    let s = Serve::start().await;
    let client = s.client();
    client.sender("q").send_message(Message::new("poison")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    let mut props = Properties::new();
    props.insert("attempt".into(), TwiceValue::from("first"));
    receiver.abandon_message(&d, props).await.unwrap();
    let again = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(again.message().delivery_count, 2);
    assert_eq!(
        again.message().message.application_properties.get("attempt"),
        Some(&TwiceValue::from("first"))
    );
    receiver
        .dead_letter_message(&again, DeadLetterReason::new("Poison", "cannot be parsed"))
        .await
        .unwrap();
    let dlq = client.receiver("q/$DeadLetterQueue", ReceiverOptions::new());
    let dead = dlq.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(body(&dead), "poison");
    assert_eq!(dead.message().dead_letter_reason.as_deref(), Some("Poison"));
    assert_eq!(dead.message().dead_letter_error_description.as_deref(), Some("cannot be parsed"));
    dlq.complete_message(&dead).await.unwrap();
}

#[tokio::test]
async fn defers_and_receives_deferred_by_sequence_number() {
    let s = Serve::start().await;
    let client = s.client();
    client.sender("q").send_message(Message::new("later")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    let seq = d.message().sequence_number;
    receiver.defer_message(&d).await.unwrap();
    assert!(receiver.receive_messages(1, BRIEF).await.unwrap().is_empty());
    let deferred = receiver.receive_deferred_messages(&[seq]).await.unwrap();
    assert_eq!(deferred.len(), 1);
    assert_eq!(body(&deferred[0]), "later");
    assert_eq!(deferred[0].message().state, twice::MessageState::Deferred);
    let until = receiver.renew_message_lock(&deferred[0]).await.unwrap();
    assert!(until > s.clock_now());
    receiver.complete_message(&deferred[0]).await.unwrap();
    let gone = receiver.receive_deferred_messages(&[seq]).await.unwrap_err();
    assert!(gone.is_message_not_found(), "{gone}");
}

#[tokio::test]
async fn renews_a_lock_past_its_expiry() {
    let s = Serve::start().await;
    let client = s.client();
    client.sender("q").send_message(Message::new("slow")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    let first = d.message().locked_until.unwrap();
    s.clock.advance(Duration::from_secs(20));
    let renewed = receiver.renew_message_lock(&d).await.unwrap();
    assert!(renewed > first, "{renewed:?} <= {first:?}");
    // Past the first lock's end, but within the renewed one: the lock still holds.
    s.clock.advance(Duration::from_secs(20));
    receiver.complete_message(&d).await.unwrap();
}

#[tokio::test]
async fn receive_and_delete_takes_messages_without_locks() {
    let s = Serve::start().await;
    let client = s.client();
    client.sender("q").send_message(Message::new("once")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new().mode(ReceiveMode::ReceiveAndDelete));
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(body(&d), "once");
    assert!(d.lock_token().is_none());
    assert!(matches!(
        receiver.complete_message(&d).await,
        Err(twice_servicebus_client::Error::Invalid(_))
    ));
    let peek = client.receiver("q", ReceiverOptions::new());
    assert!(peek.receive_messages(1, BRIEF).await.unwrap().is_empty());
}

#[tokio::test]
async fn sends_batches_and_schedules_and_cancels() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("q");
    sender
        .send_batch(vec![Message::new("b1"), Message::new("b2"), Message::new("b3")])
        .await
        .unwrap();
    let later = s.clock_now() + Duration::from_secs(3600);
    let seqs = sender.schedule_messages(vec![Message::new("cancelled")], later).await.unwrap();
    assert_eq!(seqs.len(), 1);
    sender.cancel_scheduled_messages(&seqs).await.unwrap();
    let due = s.clock_now() + Duration::from_secs(60);
    sender.schedule_messages(vec![Message::new("scheduled")], due).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    assert_eq!(got.iter().map(body).collect::<Vec<_>>(), ["b1", "b2", "b3"]);
    for d in &got {
        receiver.complete_message(d).await.unwrap();
    }
    assert!(receiver.receive_messages(1, BRIEF).await.unwrap().is_empty());
    s.clock.advance(Duration::from_secs(61));
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(body(&d), "scheduled");
    assert!(receiver.receive_messages(1, BRIEF).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_stable_id_sender_stores_a_resent_event_once() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = StableIdSender::new(client.sender("dup"));
    let id = sender.send("order-7", "OrderPlaced", Message::new("a")).await.unwrap();
    assert_eq!(id.as_str(), "order-7:OrderPlaced");
    // The retry of a send whose answer was lost: same key, same event, same id.
    sender.send("order-7", "OrderPlaced", Message::new("a")).await.unwrap();
    sender.send("order-7", "OrderShipped", Message::new("b")).await.unwrap();
    let receiver = client.receiver("dup", ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    got.extend(receiver.receive_messages(10, BRIEF).await.unwrap());
    let ids: Vec<&str> = got.iter().map(|d| d.message().message_id().as_str()).collect();
    assert_eq!(ids, ["order-7:OrderPlaced", "order-7:OrderShipped"]);
}

#[tokio::test]
async fn sessions_are_accepted_with_state_and_lock_renewal() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("sess");
    for (sid, b) in [("a", "a1"), ("a", "a2"), ("b", "b1")] {
        sender.send_message(Message::new(b).with_session_id(sid)).await.unwrap();
    }
    let sessions = client.session_receiver("sess", ReceiverOptions::new().prefetch(10));
    let a = sessions.accept_session(&SessionId::new("a")).await.unwrap();
    assert_eq!(a.session_id().as_str(), "a");
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(a.receive_messages(10, WAIT).await.unwrap());
    }
    assert_eq!(got.iter().map(body).collect::<Vec<_>>(), ["a1", "a2"]);
    for d in &got {
        a.complete_message(d).await.unwrap();
    }
    assert_eq!(a.session_state().await.unwrap(), None);
    a.set_session_state(Some(bytes::Bytes::from_static(b"step-2"))).await.unwrap();
    assert_eq!(a.session_state().await.unwrap().as_deref(), Some(&b"step-2"[..]));
    let before = a.session_locked_until();
    s.clock.advance(Duration::from_secs(5));
    let renewed = a.renew_lock().await.unwrap();
    assert!(renewed > before);
    // A second receiver cannot lock a held session, and the next free one is "b".
    let other = s.client().session_receiver("sess", ReceiverOptions::new());
    let err = other.accept_session(&SessionId::new("a")).await.unwrap_err();
    assert_eq!(err.condition(), Some(twice_servicebus_client::condition::SESSION_CANNOT_BE_LOCKED));
    let b = other.accept_next_session(WAIT).await.unwrap().expect("session b");
    assert_eq!(b.session_id().as_str(), "b");
    // No third session has messages.
    assert!(other.accept_next_session(BRIEF).await.unwrap().is_none());
    a.close_session().await;
}

#[tokio::test]
async fn a_missing_entity_and_a_wrong_key_are_typed_errors() {
    let s = Serve::start().await;
    let err = s
        .client()
        .receiver("nope", ReceiverOptions::new())
        .receive_messages(1, BRIEF)
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let wrong = s.connection_string.replace("SAS_KEY_VALUE", "wrong");
    let client = twice_servicebus_client::ServiceBusClient::from_connection_string(&wrong).unwrap();
    let err = client.sender("q").send_message(Message::new("x")).await.unwrap_err();
    assert!(err.is_unauthorized(), "{err}");
    assert!(!err.is_transient());
}

#[tokio::test]
async fn after_a_restart_old_locks_are_lost_and_the_client_reconnects() {
    let mut s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("q");
    sender.send_message(Message::new("survivor").with_message_id("m1")).await.unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    s.restart().await;
    let err = receiver.complete_message(&d).await.unwrap_err();
    assert!(err.is_lock_lost(), "{err}");
    assert!(matches!(twice::TransportError::from(err), twice::TransportError::LockLost));
    // The message comes back on a new link of a new connection once its lock expires.
    s.clock.advance(Duration::from_secs(31));
    let again = receiver.receive_messages(1, WAIT).await.unwrap().pop().expect("redelivered");
    assert_eq!(again.message().message_id().as_str(), "m1");
    receiver.complete_message(&again).await.unwrap();
    sender.send_message(Message::new("after")).await.unwrap();
    let after = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(body(&after), "after");
}

/// Counts the tokens a client asks for.
#[derive(Debug)]
struct Counting {
    inner: twice_servicebus_client::SasKeyProvider,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl twice_servicebus_client::TokenProvider for Counting {
    fn token<'a>(
        &'a self,
        audience: &'a str,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<
                        twice_servicebus_client::AccessToken,
                        twice_servicebus_client::Error,
                    >,
                > + Send
                + 'a,
        >,
    > {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.token(audience)
    }
}

#[tokio::test]
async fn tokens_are_put_again_before_they_expire() {
    let s = Serve::start().await;
    let clock = twice::SharedClock::from(s.clock.clone());
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let provider = Counting {
        inner: twice_servicebus_client::SasKeyProvider::new(
            "RootManageSharedAccessKey",
            "SAS_KEY_VALUE",
        )
        .clock(clock.clone()),
        calls: calls.clone(),
    };
    let options =
        twice_servicebus_client::ClientOptions::from_connection_string(&s.connection_string)
            .unwrap()
            .token_provider(provider)
            .clock(clock);
    let client = twice_servicebus_client::ServiceBusClient::new(options);
    let sender = client.sender("q");
    sender.send_message(Message::new("one")).await.unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    for expected in [2, 3] {
        // Past the point 5 minutes before the hour-long token expires.
        s.clock.advance(Duration::from_secs(56 * 60));
        let waited = tokio::time::timeout(WAIT, async {
            while calls.load(std::sync::atomic::Ordering::SeqCst) < expected {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "no refresh number {expected}");
    }
    // The connection is the same one, still authorized.
    sender.send_message(Message::new("two")).await.unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[tokio::test]
async fn while_the_server_is_down_calls_fail_as_transient_and_then_recover() {
    let mut s = Serve::start().await;
    let options =
        twice_servicebus_client::ClientOptions::from_connection_string(&s.connection_string)
            .unwrap()
            .retry(twice_servicebus_client::RetryOptions {
                initial_backoff: Duration::from_millis(10),
                max_backoff: Duration::from_millis(50),
            });
    let client = twice_servicebus_client::ServiceBusClient::new(options);
    let sender = client.sender("q");
    let receiver = client.receiver("q", ReceiverOptions::new());
    sender.send_message(Message::new("before")).await.unwrap();
    s.pause().await;
    for _ in 0..3 {
        let err = sender.send_message(Message::new("lost")).await.unwrap_err();
        assert!(err.is_transient(), "{err}");
        let err = receiver.receive_messages(1, BRIEF).await.unwrap_err();
        assert!(matches!(
            twice::TransportError::from(err),
            twice::TransportError::Other { transient: true, .. }
        ));
    }
    s.resume().await;
    sender.send_message(Message::new("after")).await.unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(receiver.receive_messages(2, WAIT).await.unwrap());
    }
    assert_eq!(got.iter().map(body).collect::<Vec<_>>(), ["before", "after"]);
}

#[tokio::test]
async fn settling_after_the_session_lock_expired_fails_with_session_lock_lost() {
    let s = Serve::start().await;
    let client = s.client();
    client.sender("sess").send_message(Message::new("x").with_session_id("s1")).await.unwrap();
    let sessions = client.session_receiver("sess", ReceiverOptions::new());
    let session = sessions.accept_next_session(WAIT).await.unwrap().expect("a session");
    let d = session.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    // Past the 30 s session lock: the server detaches the session's link.
    s.clock.advance(Duration::from_secs(31));
    let err = session.receive_messages(1, WAIT).await.unwrap_err();
    assert!(err.is_session_lock_lost(), "{err}");
    let err = session.complete_message(&d).await.unwrap_err();
    assert!(err.is_session_lock_lost(), "{err}");
    assert!(matches!(twice::TransportError::from(err), twice::TransportError::SessionLockLost));
}

#[tokio::test]
async fn a_message_larger_than_a_frame_is_split_and_arrives_whole() {
    // The smallest frame AMQP allows: a 20 KB message takes dozens of transfer frames.
    let s = Serve::start_with(twice_servicebus::ServerOptions::new().max_frame_size(512)).await;
    let client = s.client();
    let big: String =
        (0..20_000).map(|i| char::from(b'a' + u8::try_from(i % 26).unwrap())).collect();
    client.sender("q").send_message(Message::new(big.clone())).await.unwrap();
    client
        .sender("q")
        .send_batch(vec![Message::new(big.clone()), Message::new("small")])
        .await
        .unwrap();
    let receiver = client.receiver("q", ReceiverOptions::new().prefetch(5));
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(receiver.receive_messages(5, WAIT).await.unwrap());
    }
    assert_eq!(body(&got[0]), big);
    assert_eq!(body(&got[1]), big);
    assert_eq!(body(&got[2]), "small");
}

#[tokio::test]
async fn peeks_a_queue_and_its_dead_letter_queue_without_locking() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("q");
    for i in 0..4 {
        sender.send_message(Message::new(format!("m{i}"))).await.unwrap();
    }
    let queue = client.receiver("q", ReceiverOptions::new().prefetch(10));
    let peeked = queue.peek_messages(None, 10).await.unwrap();
    let bodies: Vec<String> =
        peeked.iter().map(|m| String::from_utf8_lossy(m.body()).into_owned()).collect();
    assert_eq!(bodies, ["m0", "m1", "m2", "m3"]);
    assert!(peeked.iter().all(|m| m.lock_token.is_none()), "a peeked message has no lock");
    // From a sequence number on, and no more than asked.
    let from = peeked[2].sequence_number;
    let later = queue.peek_messages(Some(from), 1).await.unwrap();
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].sequence_number, from);
    // Nothing was locked: every message is still received.
    let mut received = Vec::new();
    while received.len() < 4 {
        let got = queue.receive_messages(10, WAIT).await.unwrap();
        assert!(!got.is_empty(), "a peeked message was not received");
        received.extend(got);
    }
    assert_eq!(received.len(), 4);
    for d in &received[..2] {
        queue.dead_letter_message(d, DeadLetterReason::new("Poison", "bad json")).await.unwrap();
    }
    let dlq = client.receiver("q/$DeadLetterQueue", ReceiverOptions::new());
    let dead = dlq.peek_messages(None, 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].dead_letter_reason.as_deref(), Some("Poison"));
    assert_eq!(dead[1].dead_letter_error_description.as_deref(), Some("bad json"));
    assert_eq!(String::from_utf8_lossy(dead[0].body()), "m0");
    // Peeking twice sees the same messages: the first peek locked nothing.
    assert_eq!(dlq.peek_messages(None, 10).await.unwrap().len(), 2);
    // Past the last message: nothing, not an error.
    let past = twice::SequenceNumber::new(dead[1].sequence_number.get() + 1);
    assert!(dlq.peek_messages(Some(past), 10).await.unwrap().is_empty());
}

#[tokio::test]
async fn peeks_a_subscription_and_its_dead_letter_queue() {
    let s = Serve::start().await;
    s.broker.create_topic("t", Default::default()).await.unwrap();
    s.broker.create_subscription("t", "s", Default::default()).await.unwrap();
    let client = s.client();
    client.sender("t").send_message(Message::new("event")).await.unwrap();
    let sub = client.receiver("t/Subscriptions/s", ReceiverOptions::new());
    assert_eq!(sub.peek_messages(None, 10).await.unwrap().len(), 1);
    let d = sub.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    sub.dead_letter_message(&d, DeadLetterReason::new("Stale", "too old")).await.unwrap();
    assert!(sub.peek_messages(None, 10).await.unwrap().is_empty());
    let dlq = client.receiver("t/Subscriptions/s/$DeadLetterQueue", ReceiverOptions::new());
    let dead = dlq.peek_messages(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].dead_letter_reason.as_deref(), Some("Stale"));
}

#[tokio::test]
async fn peeking_a_missing_entity_is_not_found() {
    let s = Serve::start().await;
    let err = s
        .client()
        .receiver("nope", ReceiverOptions::new())
        .peek_messages(None, 1)
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test]
async fn released_messages_are_available_at_once_and_not_delivered_again_to_the_closing_receiver() {
    let s = Serve::start().await;
    let client = s.client();
    let sender = client.sender("q");
    for i in 0..3 {
        sender.send_message(Message::new(format!("m{i}"))).await.unwrap();
    }
    let receiver = client.receiver("q", ReceiverOptions::new().prefetch(2));
    let mut held = Vec::new();
    while held.len() < 2 {
        held.extend(receiver.receive_messages(2, WAIT).await.unwrap());
    }
    receiver.release_and_close(held).await;
    // No lock expiry needed (the clock does not move): all three are there for another.
    let other = client.receiver("q", ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < 3 {
        let batch = other.receive_messages(10, WAIT).await.unwrap();
        assert!(!batch.is_empty(), "only {} of 3 messages came back", got.len());
        got.extend(batch);
    }
    assert!(got.iter().all(|d| d.message().delivery_count <= 2));
}

#[tokio::test]
async fn the_message_time_to_live_is_what_the_options_say_since_amqp_does_not_carry_it() {
    use twice::{EntityInfo, Transport as _};
    use twice_broker::config::QueueProperties;
    let s = Serve::start().await;
    let ttl = Duration::from_secs(30);
    let props = QueueProperties::default().with_default_message_time_to_live(ttl);
    s.broker.create_queue("short", props).await.unwrap();
    let client = s.client();

    let told = client.receiver("short", ReceiverOptions::new().message_time_to_live(ttl));
    assert_eq!(told.entity().message_time_to_live, Some(ttl));
    let untold = client.receiver("short", ReceiverOptions::new());
    assert_eq!(untold.entity().message_time_to_live, None, "not read over AMQP");

    let mut info = EntityInfo::new("short");
    info.lock_duration = Duration::from_secs(5);
    let both = ReceiverOptions::new().entity_info(info).message_time_to_live(ttl);
    let both = client.receiver("short", both);
    assert_eq!(both.entity().lock_duration, Duration::from_secs(5), "entity info is kept");
    assert_eq!(both.entity().message_time_to_live, Some(ttl));

    // The receiver told the truth: a message older than the time to live is gone.
    client.sender("short").send_message(Message::new("x").with_message_id("old")).await.unwrap();
    s.clock.advance(ttl + Duration::from_secs(1));
    assert!(told.receive_messages(1, BRIEF).await.unwrap().is_empty(), "expired");
}
