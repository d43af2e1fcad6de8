//! The entity's properties, read from the namespace's administration API (here `twice
//! serve`'s HTTP port), are what the processor's checks rest on; the options override them
//! only where they are given.

use std::time::Duration;

use twice::{Processor, ProcessorError, ProcessorOptions, Transport as _};
use twice_broker::config::{QueueProperties, SubscriptionProperties, TopicProperties};
use twice_servicebus_client::{AdminEndpoint, ClientOptions, ReceiverOptions, ServiceBusClient};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::require_service;

use crate::harness::Serve;

const HOUR: Duration = Duration::from_secs(3600);

fn orders() -> QueueProperties {
    let mut q = QueueProperties::default()
        .with_lock_duration(Duration::from_secs(45))
        .with_max_delivery_count(3)
        .with_default_message_time_to_live(2 * HOUR);
    q.requires_duplicate_detection = true;
    q.duplicate_detection_history_time_window = Duration::from_secs(900);
    q
}

#[tokio::test]
async fn a_receiver_reads_its_entitys_properties_and_the_options_override_them() {
    let s = Serve::start_with_admin().await;
    s.broker.create_queue("orders", orders()).await.expect("queue");
    s.broker
        .create_topic("events", TopicProperties::default().with_default_message_time_to_live(HOUR))
        .await
        .expect("topic");
    let sub = SubscriptionProperties::default()
        .with_lock_duration(Duration::from_secs(20))
        .with_max_delivery_count(4)
        .with_default_message_time_to_live(3 * HOUR)
        .with_requires_session(true);
    s.broker.create_subscription("events", "billing", sub).await.expect("subscription");
    let client = s.client();

    let receiver = client.receiver("orders", ReceiverOptions::new());
    assert_eq!(receiver.entity().max_delivery_count, Some(10), "the defaults before the read");
    let read = receiver.entity_properties().await.expect("read");
    assert_eq!(read.lock_duration, Duration::from_secs(45));
    assert_eq!(read.max_delivery_count, Some(3));
    assert_eq!(read.message_time_to_live, Some(2 * HOUR));
    assert_eq!(read.duplicate_detection_window, Some(Duration::from_secs(900)));
    assert!(!read.requires_session);
    assert_eq!(receiver.entity(), &read, "the transport answers with what it read");

    // A subscription: its own lock and deliveries, the shorter time to live of it and its
    // topic.
    let billing = client.receiver("events/Subscriptions/billing", ReceiverOptions::new());
    let read = billing.entity_properties().await.expect("read");
    assert_eq!(read.path, "events/Subscriptions/billing");
    assert_eq!((read.lock_duration, read.max_delivery_count), (Duration::from_secs(20), Some(4)));
    assert_eq!(read.message_time_to_live, Some(HOUR));
    assert!(read.requires_session);

    // The options override only what they give.
    let told = client.receiver("orders", ReceiverOptions::new().message_time_to_live(HOUR / 2));
    let read = told.entity_properties().await.expect("read");
    assert_eq!((read.max_delivery_count, read.message_time_to_live), (Some(3), Some(HOUR / 2)));

    // A dead-letter queue: its entity's lock; it never dead-letters again and keeps what it
    // holds.
    let dead = client.receiver("orders/$DeadLetterQueue", ReceiverOptions::new());
    let read = dead.entity_properties().await.expect("read");
    assert_eq!(read.path, "orders/$DeadLetterQueue");
    assert_eq!(read.lock_duration, Duration::from_secs(45));
    assert_eq!((read.max_delivery_count, read.message_time_to_live), (None, None));

    let missing = client.receiver("no-such-queue", ReceiverOptions::new());
    let e = missing.entity_properties().await.expect_err("no such entity");
    assert!(e.is_not_found(), "{e}");
}

/// The administration API cannot be reached: the receiver goes on with the Service Bus
/// defaults (and says so in a warning) rather than fail.
#[tokio::test]
async fn without_the_administration_api_the_defaults_stand() {
    let s = Serve::start().await;
    s.broker.create_queue("orders", orders()).await.expect("queue");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let options = ClientOptions::from_connection_string(&s.connection_string)
        .expect("connection string")
        .admin_endpoint(Some(AdminEndpoint::http("127.0.0.1", port)));
    let client = ServiceBusClient::new(options);
    let receiver = client.receiver("orders", ReceiverOptions::new());
    let e = receiver.entity_properties().await.expect_err("no API");
    assert!(matches!(e, twice_servicebus_client::Error::Connect { .. }), "{e}");
    let read = receiver.read_entity().await.expect("the defaults, for the processor");
    assert_eq!((read.lock_duration, read.max_delivery_count), (Duration::from_secs(60), Some(10)));
}

/// The processor's retention check uses what the namespace says: this queue keeps messages
/// for two hours, so an inbox that forgets ids after one is refused, with the entity's own
/// numbers in the error.
#[tokio::test]
async fn the_processor_checks_the_inbox_against_the_entitys_own_properties() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let s = Serve::start_with_admin().await;
    s.broker.create_queue("orders", orders()).await.expect("queue");
    let client = s.client();
    let pool = db.pool(2).await.expect("pool");
    let inbox = SqlxInbox::new(pool, InboxOptions::new().retention(Some(HOUR))).await.unwrap();
    let handler = twice::handler_fn(
        |_: twice::Context<'_>, _: &mut sqlx::Transaction<'static, sqlx::Postgres>| {
            Box::pin(async { Ok(twice::Outcome::Complete) }) as twice::BoxFuture<'_, _>
        },
    );
    let p = Processor::new(
        client.receiver("orders", ReceiverOptions::new()),
        inbox,
        handler,
        ProcessorOptions::new(),
    );
    let run = tokio::time::timeout(Duration::from_secs(30), p.run(std::future::pending())).await;
    let refused = run.expect("refused at the start, not running").expect_err("must refuse");
    let text = refused.to_string();
    assert!(matches!(refused, ProcessorError::RetentionTooShort { .. }), "{text}");
    assert!(text.contains("MaxDeliveryCount 3 × LockDuration 45 s"), "{text}");
    assert!(text.contains("message time to live 2 h"), "{text}");
}
