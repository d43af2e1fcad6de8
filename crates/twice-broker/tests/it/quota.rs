//! `MaxSizeInMegabytes`: an entity holds at most that much; a send past it is refused with a
//! typed error and changes nothing, and sends are accepted again once messages leave.

use twice::{Message, Properties};
use twice_broker::config::{
    Config, DEFAULT_MAX_SIZE_IN_MEGABYTES, QueueProperties, SubscriptionProperties, TopicProperties,
};
use twice_broker::{Broker, BrokerOptions, Error};

use crate::support::NOW;

/// A message of 64 KiB: sixteen of them fill a MiB.
fn big(i: usize) -> Message {
    Message::new(vec![b'x'; 64 * 1024]).with_message_id(format!("m{i}"))
}

/// Sends until the entity refuses; returns how many were accepted and the refusal.
async fn fill(broker: &Broker, path: &str) -> (usize, Error) {
    for i in 0..100 {
        if let Err(e) = broker.send(path, big(i)).await {
            return (i, e);
        }
    }
    panic!("{path} took 100 messages of 64 KiB past a quota of 1 MiB");
}

#[test]
fn the_default_quota_is_service_bus_s() {
    assert_eq!(DEFAULT_MAX_SIZE_IN_MEGABYTES, 1024);
    assert_eq!(QueueProperties::default().max_size_in_megabytes, 1024);
    assert_eq!(TopicProperties::default().max_size_in_megabytes, 1024);
    let zero = QueueProperties::default().with_max_size_in_megabytes(0);
    assert!(matches!(zero.validate(), Err(Error::InvalidProperty { .. })));
}

#[tokio::test]
async fn a_full_queue_refuses_sends_until_messages_leave() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    let props = QueueProperties::default().with_max_size_in_megabytes(1);
    broker.create_queue("q", props).await.unwrap();
    let (accepted, refused) = fill(&broker, "q").await;
    assert!(refused.is_quota_exceeded(), "{refused}");
    match &refused {
        Error::QuotaExceeded { entity, max_size_in_megabytes, size, .. } => {
            assert_eq!((entity.as_str(), *max_size_in_megabytes), ("q", 1));
            assert!(*size <= 1024 * 1024, "{size}");
        }
        other => panic!("{other}"),
    }
    // Headers count too, so a little less than 16 fit; what was refused is not there.
    assert!((14..16).contains(&accepted), "{accepted} messages of 64 KiB fit in 1 MiB");
    assert_eq!(broker.counts("q").await.unwrap().active, accepted as u64);
    // A batch that would not fit is refused whole.
    let batch: Vec<Message> = (100..102).map(big).collect();
    assert!(broker.send_batch("q", batch).await.unwrap_err().is_quota_exceeded());
    // A dead-lettered message still counts; a completed one no longer does.
    let got = broker.receive("q", 2, NOW).await.unwrap();
    let why = twice::DeadLetterReason::new("test", "");
    broker.dead_letter(got[0].lock_token.unwrap(), why, Properties::new()).await.unwrap();
    assert!(broker.send("q", big(200)).await.unwrap_err().is_quota_exceeded());
    broker.complete(got[1].lock_token.unwrap()).await.unwrap();
    broker.send("q", big(201)).await.unwrap();
    broker.shutdown().await;
}

#[tokio::test]
async fn a_topic_counts_the_copies_its_subscriptions_hold() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    let props = TopicProperties::default().with_max_size_in_megabytes(1);
    broker.create_topic("t", props).await.unwrap();
    for s in ["a", "b"] {
        broker.create_subscription("t", s, SubscriptionProperties::default()).await.unwrap();
    }
    let (accepted, refused) = fill(&broker, "t").await;
    assert!(refused.is_quota_exceeded(), "{refused}");
    // Two copies of each: half as many as a queue takes.
    assert!((7..8).contains(&accepted), "{accepted} messages of 64 KiB to two subscriptions");
    broker.shutdown().await;
}

#[test]
fn config_json_sets_the_quota() {
    let config = Config::from_json(
        r#"{ "UserConfig": { "Namespaces": [{ "Name": "ns",
            "Queues": [{ "Name": "q", "Properties": { "MaxSizeInMegabytes": 2048 } }],
            "Topics": [{ "Name": "t", "Properties": { "MaxSizeInMegabytes": 5120 } }] }] } }"#,
    )
    .unwrap();
    let ns = &config.namespaces[0];
    assert_eq!(ns.queues[0].1.max_size_in_megabytes, 2048);
    assert_eq!(ns.topics[0].properties.max_size_in_megabytes, 5120);
    let too_big = r#"{ "UserConfig": { "Namespaces": [{ "Name": "ns",
        "Queues": [{ "Name": "q", "Properties": { "MaxSizeInMegabytes": 0 } }] }] } }"#;
    match Config::from_json(too_big) {
        Err(Error::Config { path, .. }) => {
            assert_eq!(path, "UserConfig.Namespaces[0].Queues[0].Properties.MaxSizeInMegabytes");
        }
        other => panic!("a quota of 0 was accepted: {other:?}"),
    }
}

#[tokio::test]
async fn a_quota_set_through_the_api_survives_a_restart_and_old_segments_leaving() {
    let dir = tempfile::tempdir().unwrap();
    // Small segments: the log rolls many times, and the segments holding the creation and the
    // update are compacted away; only the checkpoints restate the entities.
    let options = || BrokerOptions::durable(dir.path()).segment_size(64 * 1024);
    let broker = Broker::open(options()).await.unwrap();
    broker
        .create_queue("q", QueueProperties::default().with_max_size_in_megabytes(1))
        .await
        .unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    broker.create_subscription("t", "s", SubscriptionProperties::default()).await.unwrap();
    broker
        .update_topic("t", TopicProperties::default().with_max_size_in_megabytes(1))
        .await
        .unwrap();
    broker.shutdown().await;

    let broker = Broker::open(options()).await.unwrap();
    let (accepted, refused) = fill(&broker, "q").await;
    assert!(refused.is_quota_exceeded(), "{refused}");
    assert!((14..16).contains(&accepted), "{accepted} messages of 64 KiB in 1 MiB after a restart");
    let (accepted, refused) = fill(&broker, "t").await;
    assert!(refused.is_quota_exceeded(), "{refused}");
    assert!((14..16).contains(&accepted), "{accepted} messages of 64 KiB in the topic's 1 MiB");
    // Empty both, and push enough through the log to retire the segments written so far.
    for path in ["q", "t/Subscriptions/s"] {
        loop {
            let got = broker.receive(path, 10, NOW).await.unwrap();
            if got.is_empty() {
                break;
            }
            for m in got {
                broker.complete(m.lock_token.unwrap()).await.unwrap();
            }
        }
    }
    broker.create_queue("churn", QueueProperties::default()).await.unwrap();
    for i in 0..64 {
        broker.send("churn", big(1000 + i)).await.unwrap();
        let got = broker.receive("churn", 1, NOW).await.unwrap();
        broker.complete(got[0].lock_token.unwrap()).await.unwrap();
    }
    broker.shutdown().await;

    let broker = Broker::open(options()).await.unwrap();
    let (accepted, refused) = fill(&broker, "q").await;
    assert!(refused.is_quota_exceeded(), "{refused}");
    assert!((14..16).contains(&accepted), "{accepted} messages after compaction");
    broker.shutdown().await;
}
