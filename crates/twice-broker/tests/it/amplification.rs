//! Write amplification: what compaction writes stays within a small multiple of what is sent,
//! whatever the backlog.

use std::path::Path;
use std::time::Duration;

use twice::{ManualClock, Message};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};

const SEGMENT: u64 = 64 << 10;

async fn open_small_segments(dir: &Path) -> Broker {
    let options = BrokerOptions::durable(dir).clock(ManualClock::default()).segment_size(SEGMENT);
    let broker = Broker::open(options).await.expect("open broker");
    broker.create_queue("backlog", QueueProperties::default()).await.unwrap();
    broker.create_queue("work", QueueProperties::default()).await.unwrap();
    broker
}

async fn written(broker: &Broker) -> u64 {
    broker.storage_statistics().await.unwrap().bytes_written
}

/// A backlog four segments large that nobody consumes, in messages of `size` bytes.
async fn fill_backlog(broker: &Broker, size: usize) {
    let n = usize::try_from(4 * SEGMENT).unwrap() / size;
    for i in 0..n {
        broker
            .send("backlog", Message::new(vec![7u8; size]).with_message_id(format!("b{i}")))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn sends_and_completions_next_to_a_backlog_write_at_most_three_times_what_is_sent() {
    for size in [4 << 10, 16 << 10] {
        let dir = tempfile::tempdir().unwrap();
        let broker = open_small_segments(dir.path()).await;
        fill_backlog(&broker, size).await;
        let before = written(&broker).await;
        let mut sent = 0u64;
        for i in 0..200 {
            let body = vec![u8::try_from(i % 200).unwrap(); size];
            sent += body.len() as u64;
            broker.send("work", Message::new(body).with_message_id(format!("w{i}"))).await.unwrap();
            let got = broker.receive("work", 1, Duration::ZERO).await.unwrap();
            broker.complete(got[0].lock_token.unwrap()).await.unwrap();
        }
        let wrote = written(&broker).await - before;
        assert!(
            wrote <= 3 * sent,
            "{size}-byte messages: {wrote} bytes written for {sent} bytes sent"
        );
        broker.shutdown().await;
    }
}

#[tokio::test]
async fn tiny_sends_next_to_a_backlog_do_not_move_it() {
    let dir = tempfile::tempdir().unwrap();
    let broker = open_small_segments(dir.path()).await;
    fill_backlog(&broker, 16 << 10).await;
    let before = written(&broker).await;
    for i in 0..20 {
        broker
            .send("work", Message::new("0123456789").with_message_id(format!("t{i}")))
            .await
            .unwrap();
    }
    let wrote = written(&broker).await - before;
    // Twenty records of a few hundred bytes each, and at most one checkpoint and one move of
    // less than a quarter of a segment.
    assert!(wrote < SEGMENT, "{wrote} bytes written for twenty 10-byte sends");
    broker.shutdown().await;
}

/// A rule change writes the rule, not the subscription with every rule it has: the bytes one
/// change adds to the log do not grow with the rules already there, and the rules are all
/// back after a restart.
#[tokio::test]
async fn a_rule_change_writes_in_proportion_to_the_rule_not_to_the_subscription() {
    use twice_broker::config::{Filter, Rule, SubscriptionProperties, TopicProperties};
    use twice_broker::sql::SqlFilter;

    let dir = tempfile::tempdir().unwrap();
    let options = || BrokerOptions::durable(dir.path()).clock(ManualClock::default());
    let broker = Broker::open(options()).await.unwrap();
    broker.create_topic("t", TopicProperties::default()).await.unwrap();
    broker.create_subscription("t", "s", SubscriptionProperties::default()).await.unwrap();
    // Rules of about 4 KB each: a SQL filter near the 4,096-byte limit.
    let rule = |i: usize| {
        let text = format!("color = '{}{i}'", "x".repeat(4000));
        Rule::new(format!("r{i}"), Filter::Sql(SqlFilter::parse(&text).unwrap()))
    };
    let mut most = 0;
    for i in 0..300 {
        let before = written(&broker).await;
        broker.create_rule("t", "s", rule(i)).await.unwrap();
        most = most.max(written(&broker).await - before);
    }
    // One rule's text and the record around it, whatever the number of rules before it.
    assert!(most < 12 * 1024, "a rule change wrote up to {most} bytes");
    let before = written(&broker).await;
    broker.delete_rule("t", "s", "r7").await.unwrap();
    let removed = written(&broker).await - before;
    assert!(removed < 4 * 1024, "removing a rule wrote {removed} bytes");
    broker.shutdown().await;
    drop(broker);

    let broker = Broker::open(options()).await.unwrap();
    let rules = broker.get_rules("t", "s").await.unwrap();
    assert_eq!(rules.len(), 300, "$Default and 299 of the 300 added");
    assert!(rules.iter().all(|r| r.name != "r7"));
    assert_eq!(rules.last().unwrap(), &rule(299));
}
