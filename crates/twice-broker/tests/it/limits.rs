//! Caps on how many entities a namespace, subscriptions a topic and rules a subscription
//! hold: past them a create is refused with a typed error naming the limit, and changes
//! nothing.

use twice_broker::config::{
    Config, Filter, QueueProperties, Rule, SubscriptionProperties, TopicProperties,
};
use twice_broker::{Broker, BrokerOptions};

#[tokio::test]
async fn the_default_caps_are_service_bus_standard_s() {
    let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    for i in 1..10_000 {
        broker.create_queue(&format!("q{i}"), QueueProperties::default()).await.unwrap();
    }
    let refused = broker.create_queue("one-too-many", QueueProperties::default()).await;
    let refused = refused.expect_err("a 10,001st queue or topic");
    assert!(refused.is_limit_exceeded(), "{refused}");
    assert!(refused.to_string().contains("holds 10000 queues and topics"), "{refused}");
    assert!(broker.get_queue("one-too-many").await.is_err(), "nothing was created");
    let refused = broker.create_topic("t2", TopicProperties::default()).await.unwrap_err();
    assert!(refused.to_string().contains("10000"), "{refused}");

    for i in 0..2_000 {
        broker
            .create_subscription("t", &format!("s{i}"), SubscriptionProperties::default())
            .await
            .unwrap();
    }
    let refused = broker.create_subscription("t", "s2000", SubscriptionProperties::default()).await;
    let refused = refused.expect_err("a 2,001st subscription");
    assert!(refused.to_string().contains("holds 2000 subscriptions"), "{refused}");

    // `$Default` and 1,999 more rules.
    for i in 1..2_000 {
        broker.create_rule("t", "s0", Rule::new(format!("r{i}"), Filter::False)).await.unwrap();
    }
    let refused = broker.create_rule("t", "s0", Rule::new("r2000", Filter::False)).await;
    let refused = refused.expect_err("a 2,001st rule");
    assert!(refused.to_string().contains("holds 2000 rules"), "{refused}");
    assert_eq!(broker.get_rules("t", "s0").await.unwrap().len(), 2_000);
}

#[tokio::test]
async fn caps_are_options_and_every_way_of_creating_is_held_to_them() {
    let options = || {
        BrokerOptions::in_memory()
            .max_entities(2)
            .max_subscriptions_per_topic(1)
            .max_rules_per_subscription(2)
    };
    let broker = Broker::open(options()).await.unwrap();
    broker.create_queue("q1", QueueProperties::default()).await.unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    let refused = broker.create_queue("q2", QueueProperties::default()).await.unwrap_err();
    assert!(refused.is_limit_exceeded(), "{refused}");
    assert!(refused.to_string().contains("max_entities"), "{refused}");
    // Deleting one makes room.
    broker.delete_entity("q1").await.unwrap();
    broker.create_queue("q2", QueueProperties::default()).await.unwrap();

    broker.create_subscription("t", "s1", SubscriptionProperties::default()).await.unwrap();
    let refused = broker.create_subscription("t", "s2", SubscriptionProperties::default()).await;
    let refused = refused.unwrap_err();
    assert!(refused.to_string().contains("max_subscriptions_per_topic"), "{refused}");
    broker.create_rule("t", "s1", Rule::new("r1", Filter::False)).await.unwrap();
    let refused = broker.create_rule("t", "s1", Rule::new("r2", Filter::False)).await.unwrap_err();
    assert!(refused.is_limit_exceeded(), "{refused}");
    assert!(refused.to_string().contains("t/Subscriptions/s1/Rules/r2"), "{refused}");
    assert_eq!(broker.get_rules("t", "s1").await.unwrap().len(), 2);
    // A subscription created with more rules than the cap is refused whole.
    broker.delete_subscription("t", "s1").await.unwrap();
    let rules = (0..3).map(|i| Rule::new(format!("r{i}"), Filter::False)).collect();
    let refused = broker
        .create_subscription_with_rules("t", "s3", SubscriptionProperties::default(), rules)
        .await
        .unwrap_err();
    assert!(refused.is_limit_exceeded(), "{refused}");

    // A configuration file past a cap does not open.
    let config = Config::from_json(
        r#"{"UserConfig":{"Namespaces":[{"Name":"ns","Queues":[{"Name":"a"},{"Name":"b"},{"Name":"c"}],"Topics":[]}],"Logging":{"Type":"Console"}}}"#,
    )
    .unwrap();
    let refused = Broker::open(options().config(config)).await.unwrap_err();
    assert!(refused.is_limit_exceeded(), "{refused}");
    assert!(refused.to_string().contains("holds 2 queues and topics"), "{refused}");
}
