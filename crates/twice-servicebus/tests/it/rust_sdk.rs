//! The Rust `azservicebus` crate (feature `unsecured`, the named-key constructor that keeps the
//! port) against a running server: send, receive, every settlement, sessions.

use std::time::Duration;

use azservicebus::authorization::AzureNamedKeyCredential;
use azservicebus::core::BasicRetryPolicy;
use azservicebus::receiver::DeadLetterOptions;
use azservicebus::{
    ServiceBusClient, ServiceBusClientOptions, ServiceBusMessage, ServiceBusReceiveMode,
    ServiceBusReceiverOptions, ServiceBusSessionReceiverOptions, SubQueue,
};

use crate::harness::TestServer;

async fn client(port: u16) -> ServiceBusClient<BasicRetryPolicy> {
    ServiceBusClient::unsecured()
        .new_from_named_key_credential(
            format!("localhost:{port}"),
            AzureNamedKeyCredential::new("RootManageSharedAccessKey", "SAS_KEY_VALUE"),
            ServiceBusClientOptions::default(),
        )
        .await
        .expect("connect")
}

const WAIT: Option<Duration> = Some(Duration::from_secs(5));

/// Runs a test body against a server, then `verify` against the broker: the test passes on
/// what the SDK calls returned and on what the broker holds afterwards. The server runs on its
/// own runtime, as it would in its own process, and the SDK on another with large stacks (its
/// futures are deep in debug builds).
///
/// fe2o3-amqp 0.14 (under azservicebus 0.25) registers a sent delivery as unsettled only after
/// handing the transfer to its session task (`SenderLink::send_payload_with_transfer`), so a
/// settlement that arrives before that is dropped and its `send` waits forever. Across a network
/// the race never shows; here the SDK talks to the server through a proxy that adds a
/// millisecond on the way back, as a network would (see the crate documentation). A run that
/// still hangs fails; it is not retried.
fn run<F, Fut, V, VFut>(body: F, verify: V)
where
    F: FnOnce(u16) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
    V: FnOnce(twice_broker::Broker) -> VFut,
    VFut: std::future::Future<Output = ()>,
{
    let server_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = server_rt.block_on(TestServer::start());
    let port =
        server_rt.block_on(crate::harness::latency_proxy(server.addr, Duration::from_millis(1)));
    on_sdk_runtime(body(port));
    server_rt.block_on(verify(server.broker.clone()));
    server_rt.block_on(server.stop());
    server_rt.shutdown_timeout(Duration::from_secs(1));
}

/// Runs SDK calls on a runtime of their own, in a thread with large stacks (the SDK's futures
/// are deep in debug builds), and returns their result; fails if they do not return within
/// two minutes (a guard against a hang, not a measure: they normally take a few seconds).
pub fn on_sdk_runtime<T, Fut>(calls: Fut) -> T
where
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let outcome = std::thread::Builder::new()
        .stack_size(64 * 1024 * 1024)
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_stack_size(64 * 1024 * 1024)
                .enable_all()
                .build()
                .unwrap();
            let outcome = rt.block_on(async move {
                let task = tokio::spawn(calls);
                tokio::time::timeout(Duration::from_secs(120), task).await
            });
            // The SDK leaves tasks behind; do not wait for them.
            rt.shutdown_timeout(Duration::from_secs(1));
            outcome
        })
        .unwrap()
        .join()
        .unwrap();
    match outcome {
        Ok(joined) => joined.unwrap(),
        Err(_) => panic!("the azservicebus calls did not return (the client race above?)"),
    }
}

#[test]
fn rust_sdk_send_receive_and_settle() {
    run(send_receive_and_settle, |broker| async move {
        // Everything was completed, received and deleted, or dead-lettered and then completed.
        let counts = broker.counts("q17").await.unwrap();
        assert_eq!((counts.active, counts.deferred, counts.dead_letter), (0, 0, 0));
    });
}

#[test]
fn rust_sdk_sessions() {
    run(sessions, |broker| async move {
        let counts = broker.counts("sessq6").await.unwrap();
        assert_eq!(counts.active, 0, "every session message was completed");
        // The state set through the SDK is the broker's.
        let s1 = broker.accept_session("sessq6", &"s1".into()).await.unwrap();
        assert_eq!(s1.get_state().await.unwrap().as_deref(), Some(&b"st"[..]));
        s1.close().await.unwrap();
    });
}

async fn send_receive_and_settle(port: u16) {
    let mut client = client(port).await;
    let mut sender = client.create_sender("q17", Default::default()).await.unwrap();
    let mut first = ServiceBusMessage::new("rust-1");
    first.set_message_id("rm1").unwrap();
    first.set_subject("subj".to_owned());
    sender.send_message(first).await.unwrap();
    sender.send_messages(vec!["rust-2", "rust-3", "rust-4"]).await.unwrap();

    let mut receiver = client.create_receiver_for_queue("q17", Default::default()).await.unwrap();
    let m = receiver.receive_message_with_max_wait_time(WAIT).await.unwrap().expect("a message");
    assert_eq!(m.body().unwrap(), b"rust-1");
    assert_eq!(m.message_id().as_deref(), Some("rm1"));
    assert_eq!(m.subject(), Some("subj"));
    // The Rust SDK counts deliveries from 1 (the wire carries 0 on the first).
    assert_eq!(m.delivery_count(), Some(1));
    assert!(m.sequence_number() >= 1);
    let until = m.locked_until().expect("locked until");
    let mut m = m;
    receiver.renew_message_lock(&mut m).await.unwrap();
    assert!(m.locked_until().expect("renewed") >= until);
    receiver.complete_message(&m).await.unwrap();

    let abandoned = receiver.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(abandoned.body().unwrap(), b"rust-2");
    receiver.abandon_message(&abandoned, None).await.unwrap();
    let again = receiver.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(again.body().unwrap(), b"rust-2");
    assert_eq!(again.delivery_count(), Some(2));
    let seq = again.sequence_number();
    receiver.defer_message(&again, None).await.unwrap();
    let deferred = receiver.receive_deferred_message(seq).await.unwrap().expect("deferred");
    assert_eq!(deferred.body().unwrap(), b"rust-2");
    receiver.complete_message(&deferred).await.unwrap();

    let poison = receiver.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(poison.body().unwrap(), b"rust-3");
    let options = DeadLetterOptions {
        dead_letter_reason: Some("r".into()),
        dead_letter_error_description: Some("d".into()),
        properties_to_modify: None,
    };
    receiver.dead_letter_message(&poison, options).await.unwrap();

    let peeked = receiver.peek_messages(5, None).await.unwrap();
    assert_eq!(peeked.len(), 1, "rust-4 is the one message left to peek");
    receiver.dispose().await.unwrap();

    let options = ServiceBusReceiverOptions {
        receive_mode: ServiceBusReceiveMode::ReceiveAndDelete,
        ..Default::default()
    };
    let mut rd = client.create_receiver_for_queue("q17", options).await.unwrap();
    let last = rd.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(last.body().unwrap(), b"rust-4");
    rd.dispose().await.unwrap();

    let options =
        ServiceBusReceiverOptions { sub_queue: SubQueue::DeadLetter, ..Default::default() };
    let mut dlq = client.create_receiver_for_queue("q17", options).await.unwrap();
    let dead = dlq.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(dead.body().unwrap(), b"rust-3");
    assert_eq!(dead.dead_letter_reason(), Some("r"));
    assert_eq!(dead.dead_letter_error_description(), Some("d"));
    dlq.complete_message(&dead).await.unwrap();
    dlq.dispose().await.unwrap();
    sender.dispose().await.unwrap();
    client.dispose().await.unwrap();
}

async fn sessions(port: u16) {
    let mut client = client(port).await;
    let mut sender = client.create_sender("sessq6", Default::default()).await.unwrap();
    for body in ["a", "b"] {
        let mut m = ServiceBusMessage::new(body);
        m.set_session_id("s1".to_owned()).unwrap();
        sender.send_message(m).await.unwrap();
    }
    let mut session = client
        .accept_next_session_for_queue("sessq6", ServiceBusSessionReceiverOptions::default())
        .await
        .unwrap();
    assert_eq!(session.session_id(), "s1");
    let got = session.receive_messages_with_max_wait_time(2, WAIT).await.unwrap();
    let bodies: Vec<&[u8]> = got.iter().map(|m| m.body().unwrap()).collect();
    assert_eq!(bodies, vec![b"a".as_slice(), b"b".as_slice()]);
    for m in &got {
        session.complete_message(m).await.unwrap();
    }
    session.set_session_state(b"st".to_vec()).await.unwrap();
    assert_eq!(session.session_state().await.unwrap(), b"st".to_vec());
    session.renew_session_lock().await.unwrap();
    session.dispose().await.unwrap();

    let mut m = ServiceBusMessage::new("named");
    m.set_session_id("s2".to_owned()).unwrap();
    sender.send_message(m).await.unwrap();
    let mut named = client
        .accept_session_for_queue("sessq6", "s2", ServiceBusSessionReceiverOptions::default())
        .await
        .unwrap();
    let m = named.receive_message_with_max_wait_time(WAIT).await.unwrap().unwrap();
    assert_eq!(m.body().unwrap(), b"named");
    assert_eq!(m.session_id(), Some("s2"));
    named.complete_message(&m).await.unwrap();
    named.dispose().await.unwrap();
    sender.dispose().await.unwrap();
    client.dispose().await.unwrap();
}
