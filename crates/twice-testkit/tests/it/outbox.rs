//! The outbox relay on every transport's [`Publish`]: RabbitMQ, NATS JetStream and the
//! Service Bus client on `twice serve` (the embedded broker's is in twice-sqlx's tests). On
//! each, a relay that dies between the broker's acknowledgement and the deletion of its rows
//! has them sent again with the same ids, and a twice processor downstream handles each
//! message once; a destination the broker does not have is parked, and the rows after it go
//! on.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use twice::{
    Message, MessageId, Outcome, Processor, ProcessorOptions, Publish, Relay, RelayOptions,
    Transport, handler_fn,
};
use twice_sqlx::{InboxOptions, OutboxOptions, RowState, SqlxInbox, SqlxOutbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::require_service;

const N: usize = 10;
type Pg = sqlx::Postgres;

/// What the scenario needs of one transport.
struct Target<P, T> {
    publisher: P,
    /// Where the rows go.
    destination: String,
    /// A destination the broker does not have.
    missing: String,
    /// The receiver of `destination`.
    receiver: T,
    /// Whether the broker drops a re-sent id itself.
    drops_duplicates: bool,
}

/// Waits for `cond`, a bound only so that a broken test ends.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..120_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("gave up waiting for: {what}");
}

async fn relay_dies_after_the_ack_and_the_receiver_handles_each_message_once<P, T>(
    name: &str,
    target: Target<P, T>,
) where
    P: Publish + Clone,
    T: Transport,
{
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_outbox").await) else {
        return;
    };
    let pool = db.pool(10).await.expect("pool");
    let outbox: SqlxOutbox<Pg> =
        SqlxOutbox::new(pool.clone(), OutboxOptions::new()).await.expect("outbox");
    let mut tx = pool.begin().await.expect("begin");
    let writer = outbox.writer();
    writer.push(&target.missing, Message::new("nowhere")).expect("valid");
    for i in 0..N {
        writer.push(&target.destination, Message::new(format!("{i}"))).expect("valid");
    }
    outbox.write(&mut tx, &writer).await.expect("write");
    outbox.commit(tx).await.expect("commit");

    let lease = Duration::from_millis(500);
    let options =
        RelayOptions::new().poll_interval(Duration::from_millis(20)).lease_duration(lease);
    let died = Arc::new(AtomicBool::new(false));
    let first = Relay::new(outbox.clone(), target.publisher.clone(), options.clone())
        .on_acknowledged({
            let died = Arc::clone(&died);
            move |_| {
                died.store(true, Ordering::SeqCst);
                ControlFlow::Break(())
            }
        });
    let first_counters = first.counters();
    first.run(std::future::pending()).await;
    assert!(died.load(Ordering::SeqCst), "{name}");
    assert_eq!(first_counters.snapshot().sent, N as u64, "{name}: {:?}", first_counters.snapshot());
    assert_eq!(first_counters.snapshot().parked, 1, "{name}: the missing destination is parked");

    let second = Relay::new(outbox.clone(), target.publisher.clone(), options);
    let counters = second.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(second.run(async move {
        let _ = stopped.await;
    }));
    until("the rows sent again", || counters.snapshot().sent == N as u64).await;
    // Counted at the acknowledgement; deleted just after.
    for _ in 0..60_000 {
        if outbox.list(Some(RowState::Pending), 100).await.expect("list").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = stop.send(());
    task.await.expect("join");
    let pending: Vec<_> = outbox.list(Some(RowState::Pending), 100).await.expect("list");
    assert!(pending.is_empty(), "{name}: {} rows left", pending.len());
    let parked = outbox.list(Some(RowState::Parked), 100).await.expect("list");
    assert_eq!(parked.len(), 1, "{name}");
    assert_eq!(parked[0].destination, target.missing);

    // Downstream: every copy the broker kept, handled by a twice processor.
    let copies_expected = if target.drops_duplicates { N } else { 2 * N };
    let inbox = SqlxInbox::<Pg>::new(pool.clone(), InboxOptions::new().table("downstream"))
        .await
        .expect("inbox");
    let seen: Arc<std::sync::Mutex<HashMap<MessageId, usize>>> = Arc::default();
    let handler = handler_fn::<sqlx::Transaction<'static, Pg>, _>({
        let seen = Arc::clone(&seen);
        move |ctx, _tx| {
            *seen.lock().expect("seen").entry(ctx.message_id().clone()).or_default() += 1;
            Box::pin(async { Ok(Outcome::Complete) })
        }
    });
    let processor = Processor::new(
        target.receiver,
        inbox,
        handler,
        ProcessorOptions::new().consumer("downstream").max_concurrent_calls(4),
    );
    let completed = processor.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.await;
    }));
    until("every copy settled", || completed.snapshot().completed == copies_expected as u64).await;
    let _ = stop.send(());
    task.await.expect("join").expect("run");
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), N, "{name}: {N} messages handled: {seen:?}");
    assert!(seen.values().all(|&n| n == 1), "{name}: each once: {seen:?}");
    let c = completed.snapshot();
    assert_eq!(
        c.duplicates_already_processed + c.duplicates_concurrent_copy,
        (copies_expected - N) as u64,
        "{name}: the copies met the inbox: {c:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_rabbitmq() {
    use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
    use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};
    let queue = TestQueue::new("twice-outbox");
    let connected =
        RabbitMqTransport::connect(RabbitMqOptions::new(RABBITMQ_URL, queue.name())).await;
    let Some(transport) = require_service("RabbitMQ", connected) else { return };
    let target = Target {
        publisher: transport.clone(),
        destination: queue.name().to_owned(),
        missing: format!("{}-missing", queue.name()),
        receiver: transport,
        drops_duplicates: false,
    };
    relay_dies_after_the_ack_and_the_receiver_handles_each_message_once("rabbitmq", target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_nats() {
    use twice_nats::{NatsOptions, NatsTransport};
    use twice_testkit::nats::{NATS_URL, TestStream};
    let stream = TestStream::new("TWICE_OUTBOX");
    let connected = NatsTransport::connect(NatsOptions::new(NATS_URL, stream.name())).await;
    let Some(transport) = require_service("NATS", connected) else { return };
    let target = Target {
        publisher: transport.clone(),
        destination: stream.subject(),
        missing: format!("{}.nowhere", stream.subject()),
        receiver: transport,
        drops_duplicates: true,
    };
    relay_dies_after_the_ack_and_the_receiver_handles_each_message_once("nats", target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_twice_serve() {
    use twice_broker::config::QueueProperties;
    use twice_broker::{Broker, BrokerOptions};
    let broker = Broker::open(BrokerOptions::in_memory()).await.expect("broker");
    let properties = QueueProperties::default().with_duplicate_detection(Duration::from_secs(600));
    broker.create_queue("shipped", properties).await.expect("queue");
    let options = twice_servicebus::ServerOptions::new()
        .amqp_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(None);
    let server = twice_servicebus::Server::bind(options, broker.clone()).await.expect("bind");
    let client = twice_servicebus_client::ServiceBusClient::from_connection_string(
        &server.connection_string(),
    )
    .expect("client");
    tokio::spawn(server.run(std::future::pending()));
    let target = Target {
        publisher: Arc::new(client.publisher()),
        destination: "shipped".to_owned(),
        missing: "nowhere".to_owned(),
        receiver: client.receiver("shipped", twice_servicebus_client::ReceiverOptions::new()),
        drops_duplicates: true,
    };
    relay_dies_after_the_ack_and_the_receiver_handles_each_message_once("twice serve", target)
        .await;
}
