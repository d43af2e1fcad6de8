//! What survives a restart, and what does not.

use std::time::Duration;

use bytes::Bytes;
use twice::{ManualClock, SessionId};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};

use crate::support::{NOW, msg, open, open_with_queue, peek_all};

#[tokio::test]
async fn an_acknowledged_send_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open_with_queue(dir.path(), &clock).await;
    let mut seqs = Vec::new();
    for i in 0..100 {
        let out = broker.send("q", msg(&format!("m{i}"))).await.unwrap();
        seqs.push(out.sequence_number().unwrap());
    }
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    let all = peek_all(&broker, "q").await;
    assert_eq!(all.len(), 100);
    for (i, m) in all.iter().enumerate() {
        assert_eq!(m.message_id().as_str(), format!("m{i}"));
        assert_eq!(m.body().as_ref(), format!("body of m{i}").as_bytes());
        assert_eq!(m.sequence_number, seqs[i]);
    }
    // Sequence numbers go on where they stopped.
    let next = broker.send("q", msg("after")).await.unwrap().sequence_number().unwrap();
    assert!(next > seqs[99]);
}

#[tokio::test]
async fn a_completed_message_never_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open_with_queue(dir.path(), &clock).await;
    broker.send_batch("q", vec![msg("a"), msg("b"), msg("c")]).await.unwrap();
    let got = broker.receive("q", 2, NOW).await.unwrap();
    assert_eq!(got.len(), 2);
    broker.complete(got[0].lock_token.unwrap()).await.unwrap();
    broker.complete(got[1].lock_token.unwrap()).await.unwrap();
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    let ids: Vec<_> =
        peek_all(&broker, "q").await.iter().map(|m| m.message_id().to_string()).collect();
    assert_eq!(ids, ["c"]);
}

#[tokio::test]
async fn delivery_counts_survive_and_held_locks_come_back_counted() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open_with_queue(dir.path(), &clock).await;
    broker.send_batch("q", vec![msg("abandoned"), msg("locked")]).await.unwrap();
    let first = broker.receive("q", 1, NOW).await.unwrap();
    broker.abandon(first[0].lock_token.unwrap(), Default::default()).await.unwrap();
    // Delivered twice now: "abandoned" comes first again, then "locked".
    let got = broker.receive("q", 2, NOW).await.unwrap();
    assert_eq!(got[0].message_id().as_str(), "abandoned");
    assert_eq!(got[0].delivery_count, 2);
    assert_eq!(got[1].delivery_count, 1);
    broker.abandon(got[0].lock_token.unwrap(), Default::default()).await.unwrap();
    // "locked" stays locked when the broker stops.
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    let counts = broker.counts("q").await.unwrap();
    assert_eq!((counts.active, counts.locked), (2, 0), "locks do not survive a restart");
    let got = broker.receive("q", 2, NOW).await.unwrap();
    let by_id = |id: &str| got.iter().find(|m| m.message_id().as_str() == id).unwrap();
    assert_eq!(by_id("abandoned").delivery_count, 3, "two abandons survive");
    assert_eq!(by_id("locked").delivery_count, 2, "the lock held at the stop counts");
}

#[tokio::test]
async fn session_state_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    let props = QueueProperties::default().with_requires_session(true);
    broker.create_queue("s", props).await.unwrap();
    broker.send("s", msg("x").with_session_id("order-1")).await.unwrap();
    let session = broker.accept_session("s", &SessionId::new("order-1")).await.unwrap();
    session.set_state(Some(Bytes::from_static(b"step 2"))).await.unwrap();
    session.close().await.unwrap();
    broker.shutdown().await;

    let broker = open(dir.path(), &clock).await;
    let session = broker.accept_session("s", &SessionId::new("order-1")).await.unwrap();
    assert_eq!(session.get_state().await.unwrap(), Some(Bytes::from_static(b"step 2")));
    let got = session.receive(10, NOW).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message_id().as_str(), "x");
}

#[tokio::test]
async fn entities_and_their_properties_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    let props = QueueProperties::default().with_lock_duration(Duration::from_secs(30));
    broker.create_queue("orders", props.clone()).await.unwrap();
    broker.shutdown().await;
    let broker = open(dir.path(), &clock).await;
    assert_eq!(broker.get_queue("orders").await.unwrap(), props);
}

#[tokio::test]
async fn old_segments_are_deleted_once_their_messages_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::default();
    let options =
        || BrokerOptions::durable(dir.path()).clock(clock.clone()).segment_size(16 * 1024);
    let broker = Broker::open(options()).await.unwrap();
    broker.create_queue("q", QueueProperties::default()).await.unwrap();
    // A deferred message stays for the whole test: it pins the first segment until compaction
    // relocates it.
    broker.send("q", msg("keeper")).await.unwrap();
    let keeper = broker.receive("q", 1, NOW).await.unwrap().remove(0);
    broker.defer(keeper.lock_token.unwrap(), Default::default()).await.unwrap();
    for round in 0..40 {
        let batch: Vec<_> = (0..20).map(|i| msg(&format!("r{round}-{i}"))).collect();
        broker.send_batch("q", batch).await.unwrap();
        let got = broker.receive_and_delete("q", 100, NOW).await.unwrap();
        assert_eq!(got.len(), 20);
    }
    let stats = broker.storage_statistics().await.unwrap();
    assert!(stats.segments <= 3, "old segments are deleted: {stats:?}");
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert!(files <= 4, "segment files plus the lock file: {files}");
    broker.shutdown().await;

    let broker = Broker::open(options()).await.unwrap();
    let left = peek_all(&broker, "q").await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].message_id().as_str(), "keeper");
    assert_eq!(left[0].body().as_ref(), b"body of keeper");
    let got = broker.receive_deferred("q", &[keeper.sequence_number]).await.unwrap();
    assert_eq!(got[0].message_id().as_str(), "keeper");
}
