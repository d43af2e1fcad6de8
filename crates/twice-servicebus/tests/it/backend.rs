//! The front end's boundary to the broker: what a link's calls may reach.

use std::time::Duration;

use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Backend, BackendError, ReceiveMode, Settlement};

/// A lock token is a capability of the link that received the message: presented through
/// another entity's link (or `$management` node) it settles, renews and completes nothing.
#[tokio::test]
async fn a_lock_token_settles_nothing_through_another_entitys_link() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    for q in ["a", "b"] {
        broker.create_queue(q, QueueProperties::default()).await.unwrap();
        broker.send(q, twice::Message::new(q)).await.unwrap();
    }
    let got = Backend::receive(&broker, "a", ReceiveMode::PeekLock, 1, Duration::from_secs(1))
        .await
        .unwrap();
    let lock = got[0].lock_token.expect("peek-lock");
    let lost = |r: &Result<_, BackendError>| matches!(r, Err(BackendError::LockLost));

    let complete = Backend::settle(&broker, "b", lock, Settlement::Complete).await;
    assert!(lost(&complete), "{complete:?}");
    let many = Backend::complete_many(&broker, "b", vec![lock, lock]).await;
    assert!(many.iter().all(lost), "{many:?}");
    let renew = Backend::renew_lock(&broker, "b", lock).await;
    assert!(matches!(renew, Err(BackendError::LockLost)), "{renew:?}");
    let dlq = Backend::settle(&broker, "a/$deadletterqueue", lock, Settlement::Complete).await;
    assert!(lost(&dlq), "{dlq:?}");
    let a = broker.counts("a").await.unwrap();
    assert_eq!((a.active, a.locked), (1, 1), "the message is still locked in a");

    // Through its own entity the same token works.
    Backend::settle(&broker, "a", lock, Settlement::Complete).await.unwrap();
    assert_eq!(broker.counts("a").await.unwrap().active, 0);
    assert_eq!(broker.counts("b").await.unwrap().active, 1);
    broker.shutdown().await;
}

/// Replacing a rule (the administration API's `PUT` with `If-Match`) changes that rule alone:
/// rules other clients add to the subscription meanwhile all stay.
#[tokio::test]
async fn replacing_a_rule_keeps_the_rules_added_meanwhile() {
    use twice_broker::config::{Filter, Rule, SubscriptionProperties, TopicProperties};
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    let first = Rule::new("r", Filter::True);
    broker
        .create_subscription_with_rules("t", "s", SubscriptionProperties::default(), vec![first])
        .await
        .unwrap();
    let added: Vec<String> = (0..40).map(|i| format!("added-{i}")).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, name) in added.iter().enumerate() {
        let b = broker.clone();
        tasks.spawn(async move {
            Backend::admin_replace_rule(&b, "t", "s", Rule::new("r", Filter::False)).await
        });
        // Each add comes a few scheduling turns later than the replace beside it, so that
        // some land between a replace's start and its end.
        let (b, name) = (broker.clone(), name.clone());
        tasks.spawn(async move {
            for _ in 0..i % 8 {
                tokio::task::yield_now().await;
            }
            Backend::admin_create_rule(&b, "t", "s", Rule::new(name, Filter::True)).await
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    let rules = broker.get_rules("t", "s").await.unwrap();
    let lost: Vec<&String> =
        added.iter().filter(|n| !rules.iter().any(|r| &r.name == *n)).collect();
    assert!(lost.is_empty(), "rules lost to a concurrent replace: {lost:?}");
    let r = rules.iter().find(|r| r.name == "r").expect("the replaced rule");
    assert_eq!(r.filter, Filter::False);
    assert_eq!(rules.len(), added.len() + 1);
    broker.shutdown().await;
}
