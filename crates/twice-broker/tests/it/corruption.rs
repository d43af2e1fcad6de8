//! Damaged data directories: corruption is an error, a torn tail is repaired.

use std::path::{Path, PathBuf};

use twice::ManualClock;
use twice_broker::{Broker, BrokerOptions, Error};

use crate::support::{msg, open, open_with_queue, peek_all};

fn first_segment(dir: &Path) -> PathBuf {
    dir.join("00000000000000000001.seg")
}

async fn fill(dir: &Path, n: usize) {
    let broker = open_with_queue(dir, &ManualClock::default()).await;
    for i in 0..n {
        broker.send("q", msg(&format!("m{i}"))).await.unwrap();
    }
    broker.shutdown().await;
}

#[tokio::test]
async fn a_flipped_byte_in_an_acknowledged_record_fails_the_open() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 50).await;
    let path = first_segment(dir.path());
    let mut data = std::fs::read(&path).unwrap();
    let middle = data.len() / 2;
    data[middle] ^= 0x10;
    std::fs::write(&path, &data).unwrap();

    let err = Broker::open(BrokerOptions::durable(dir.path())).await.unwrap_err();
    match err {
        Error::CorruptLog { segment, offset } => {
            assert_eq!(segment, 1);
            assert!(
                offset <= middle as u64 && offset > 0,
                "the damaged record starts before {middle}"
            );
        }
        other => panic!("expected CorruptLog, got {other:?}"),
    }
    // Nothing was repaired or dropped behind the caller's back.
    assert_eq!(std::fs::read(&path).unwrap(), data);
}

#[tokio::test]
async fn a_torn_tail_is_truncated_and_earlier_records_stay() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 10).await;
    let path = first_segment(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    // Cut the last record (the send of m9) short, as a crash in the middle of its write would.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 5).unwrap();

    let clock = ManualClock::default();
    let broker = open(dir.path(), &clock).await;
    let ids: Vec<_> =
        peek_all(&broker, "q").await.iter().map(|m| m.message_id().to_string()).collect();
    let expected: Vec<_> = (0..9).map(|i| format!("m{i}")).collect();
    assert_eq!(ids, expected);
    // The repaired log takes new writes that survive the next restart.
    broker.send("q", msg("after")).await.unwrap();
    broker.shutdown().await;
    let broker = open(dir.path(), &clock).await;
    assert_eq!(peek_all(&broker, "q").await.len(), 10);
}

#[tokio::test]
async fn garbage_after_the_last_record_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 5).await;
    let path = first_segment(dir.path());
    let mut data = std::fs::read(&path).unwrap();
    data.extend_from_slice(&[0u8; 100]);
    std::fs::write(&path, &data).unwrap();
    let broker = open(dir.path(), &ManualClock::default()).await;
    assert_eq!(peek_all(&broker, "q").await.len(), 5);
}

#[tokio::test]
async fn a_data_directory_is_opened_by_one_broker_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::open(BrokerOptions::durable(dir.path())).await.unwrap();
    let second = Broker::open(BrokerOptions::durable(dir.path())).await;
    assert!(matches!(second, Err(Error::DirectoryInUse(_))), "{second:?}");
    broker.shutdown().await;
    Broker::open(BrokerOptions::durable(dir.path())).await.unwrap();
}
