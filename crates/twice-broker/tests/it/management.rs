//! Subscription rules and session listing through the broker's API.

use twice::{ManualClock, Message, SessionId};
use twice_broker::config::{
    Filter, QueueProperties, Rule, SubscriptionProperties, TopicProperties,
};

use crate::support::{NOW, open};

#[tokio::test]
async fn a_subscription_whose_rules_are_all_deleted_receives_nothing_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    broker.create_subscription("t", "s", SubscriptionProperties::default()).await.unwrap();
    // Created without rules, it has the `$Default` rule, as in Service Bus.
    assert_eq!(broker.get_rules("t", "s").await.unwrap(), vec![Rule::default_rule()]);
    broker.send("t", Message::new("one")).await.unwrap();
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 1);

    broker.delete_rule("t", "s", Rule::DEFAULT_NAME).await.unwrap();
    assert_eq!(broker.get_rules("t", "s").await.unwrap(), vec![]);
    broker.send("t", Message::new("two")).await.unwrap();
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 1);
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    assert_eq!(broker.get_rules("t", "s").await.unwrap(), vec![]);
    broker.send("t", Message::new("three")).await.unwrap();
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 1);
    broker.create_rule("t", "s", Rule::new("all", Filter::True)).await.unwrap();
    broker.send("t", Message::new("four")).await.unwrap();
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 2);
    broker.shutdown().await;
}

#[tokio::test]
async fn sessions_are_listed_in_order_of_their_oldest_message() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    broker.create_queue("q", QueueProperties::default().with_requires_session(true)).await.unwrap();
    assert!(broker.list_sessions("q").await.unwrap().is_empty());
    for (i, session) in ["s2", "s1", "s2", "s3"].into_iter().enumerate() {
        let m = Message::new(format!("m{i}")).with_session_id(session);
        broker.send("q", m).await.unwrap();
    }
    let s1 = SessionId::from("s1");
    // A session whose message is locked is still listed; one whose messages are all gone is
    // not, even with state.
    let held = broker.accept_session("q", &s1).await.unwrap();
    let got = held.receive(1, NOW).await.unwrap();
    let ids = |v: Vec<SessionId>| v.into_iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(ids(broker.list_sessions("q").await.unwrap()), ["s2", "s1", "s3"]);
    held.set_state(Some("state".into())).await.unwrap();
    held.complete(got[0].lock_token.unwrap()).await.unwrap();
    assert_eq!(ids(broker.list_sessions("q").await.unwrap()), ["s2", "s3"]);
    assert!(matches!(
        broker.list_sessions("q/$DeadLetterQueue").await,
        Err(twice_broker::Error::SessionsNotEnabled(_))
    ));
    broker.shutdown().await;
}

#[tokio::test]
async fn sql_rules_with_actions_give_changed_copies_that_survive_a_restart() {
    use twice::{SequenceNumber, Value};
    use twice_broker::sql::{SqlAction, SqlFilter};

    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    let sql = |s: &str| Filter::Sql(SqlFilter::parse(s).unwrap());
    let rules = vec![
        // Two rules without an action: one copy between them.
        Rule::new("red", sql("color = 'red'")),
        Rule::new("any-color", sql("EXISTS(color)")),
        // A rule with an action: a copy of its own.
        Rule::new("rush", sql("quantity > 10")).with_action(
            SqlAction::parse("SET priority = 'high'; REMOVE color; SET sys.Label = 'routed'")
                .unwrap(),
        ),
    ];
    broker
        .create_subscription_with_rules("t", "s", SubscriptionProperties::default(), rules)
        .await
        .unwrap();
    // A rule name that exists is refused.
    let again = broker.create_rule("t", "s", Rule::new("RED", Filter::True)).await;
    assert!(matches!(again, Err(twice_broker::Error::EntityAlreadyExists(_))), "{again:?}");

    let mut m = Message::new("order").with_subject("new");
    m.application_properties.insert("color".into(), "red".into());
    m.application_properties.insert("quantity".into(), Value::Int(12));
    broker.send("t", m).await.unwrap();
    let mut small = Message::new("small");
    small.application_properties.insert("quantity".into(), Value::Int(1));
    broker.send("t", small).await.unwrap();

    let check = |got: Vec<twice::ReceivedMessage>| {
        assert_eq!(got.len(), 2, "{got:?}");
        let (plain, copy) = (&got[0].message, &got[1].message);
        assert_eq!(plain.application_properties.get("color"), Some(&Value::from("red")));
        assert_eq!(plain.subject.as_deref(), Some("new"));
        assert!(!plain.application_properties.contains_key("RuleName"));
        assert_eq!(copy.body.as_ref(), b"order");
        assert_eq!(copy.subject.as_deref(), Some("routed"));
        assert_eq!(copy.application_properties.get("priority"), Some(&Value::from("high")));
        assert_eq!(copy.application_properties.get("RuleName"), Some(&Value::from("rush")));
        assert!(!copy.application_properties.contains_key("color"));
        assert_eq!(copy.application_properties.get("quantity"), Some(&Value::Int(12)));
        assert_ne!(got[0].sequence_number, got[1].sequence_number);
    };
    check(broker.peek("t/Subscriptions/s", SequenceNumber::new(0), 10).await.unwrap());
    broker.shutdown().await;

    // Replayed from the log: the copy keeps its changes.
    let broker = open(dir.path(), &clock).await;
    check(broker.peek("t/Subscriptions/s", SequenceNumber::new(0), 10).await.unwrap());
    broker.shutdown().await;
}

/// `reset`: every kind of message, lock, session state and remembered id is gone from every
/// entity, in one call that a restart keeps; entities, properties and rules stay.
#[tokio::test]
async fn reset_empties_every_entity_and_keeps_their_definitions_across_a_restart() {
    use std::time::Duration;
    use twice::{DeadLetterReason, Properties};
    use twice_broker::SendOutcome;

    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    let dedup = QueueProperties::default().with_duplicate_detection(Duration::from_secs(600));
    broker.create_queue("q", dedup).await.unwrap();
    broker
        .create_queue("sq", QueueProperties::default().with_requires_session(true))
        .await
        .unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    let rules = vec![Rule::new("all", Filter::True)];
    let sub = SubscriptionProperties::default();
    broker.create_subscription_with_rules("t", "s", sub, rules.clone()).await.unwrap();
    let before = broker.list_entities().await.unwrap();

    // Active, locked, deferred, dead-lettered and scheduled messages, and a remembered id.
    for id in ["a", "b", "c", "d", "e"] {
        let sent = broker.send("q", Message::new(id).with_message_id(id)).await.unwrap();
        assert!(matches!(sent, SendOutcome::Enqueued(_)));
    }
    let got = broker.receive("q", 3, NOW).await.unwrap();
    broker.defer(got[0].lock_token.unwrap(), Properties::default()).await.unwrap();
    let why = DeadLetterReason::new("test", "");
    broker.dead_letter(got[1].lock_token.unwrap(), why, Properties::default()).await.unwrap();
    let locked = got[2].lock_token.unwrap();
    let later = twice::Timestamp::from_millis(i64::MAX / 2);
    broker.schedule("q", vec![Message::new("later")], later).await.unwrap();
    broker.send("t", Message::new("to s")).await.unwrap();
    broker.send("sq", Message::new("x").with_session_id("s1")).await.unwrap();
    let held = broker.accept_session("sq", &SessionId::from("s1")).await.unwrap();
    held.set_state(Some("state".into())).await.unwrap();
    drop(held);
    let counts = broker.counts("q").await.unwrap();
    assert_eq!(
        (counts.active, counts.deferred, counts.dead_letter, counts.scheduled),
        (3, 1, 1, 1)
    );

    assert_eq!(broker.reset().await.unwrap(), 4);

    for path in ["q", "sq", "t/Subscriptions/s"] {
        let c = broker.counts(path).await.unwrap();
        let all = (c.active, c.locked, c.deferred, c.scheduled, c.dead_letter);
        assert_eq!(all, (0, 0, 0, 0, 0), "{path}");
    }
    assert_eq!(broker.counts("t").await.unwrap().scheduled, 0);
    assert!(broker.complete(locked).await.is_err(), "a lock from before the reset is gone");
    assert!(broker.list_sessions("sq").await.unwrap().is_empty());
    // The remembered id is forgotten: the same id is a new message.
    let again = broker.send("q", Message::new("a").with_message_id("a")).await.unwrap();
    assert!(matches!(again, SendOutcome::Enqueued(_)), "{again:?}");
    assert_eq!(broker.get_rules("t", "s").await.unwrap(), rules);
    assert_eq!(broker.list_entities().await.unwrap(), before);
    broker.shutdown().await;

    // A restart replays the reset.
    let broker = open(dir.path(), &clock).await;
    assert_eq!(broker.list_entities().await.unwrap(), before);
    assert_eq!(broker.counts("q").await.unwrap().active, 1);
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 0);
    let held = broker.accept_session("sq", &SessionId::from("s1")).await.unwrap();
    assert_eq!(held.get_state().await.unwrap(), None);
    broker.shutdown().await;
}

#[tokio::test]
async fn a_replaced_rule_filters_in_place_of_the_old_one_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    broker.create_subscription("t", "s", SubscriptionProperties::default()).await.unwrap();
    broker.create_rule("t", "s", Rule::new("other", Filter::False)).await.unwrap();

    // Names compare without case, as in Service Bus; each rule keeps its place.
    broker.replace_rule("t", "s", Rule::new(Rule::DEFAULT_NAME, Filter::False)).await.unwrap();
    broker.replace_rule("t", "s", Rule::new("OTHER", Filter::True)).await.unwrap();
    let names =
        |rules: Vec<Rule>| rules.into_iter().map(|r| (r.name, r.filter)).collect::<Vec<_>>();
    let expected =
        vec![(Rule::DEFAULT_NAME.to_owned(), Filter::False), ("OTHER".to_owned(), Filter::True)];
    assert_eq!(names(broker.get_rules("t", "s").await.unwrap()), expected);
    broker.send("t", Message::new("one")).await.unwrap();
    assert_eq!(broker.counts("t/Subscriptions/s").await.unwrap().active, 1);

    let missing = broker.replace_rule("t", "s", Rule::new("nope", Filter::True)).await;
    assert!(matches!(missing, Err(twice_broker::Error::EntityNotFound(_))), "{missing:?}");
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    assert_eq!(names(broker.get_rules("t", "s").await.unwrap()), expected);
    broker.shutdown().await;
}
