//! Helpers shared by the tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use twice::{ManualClock, Message, ReceivedMessage, SequenceNumber};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};

/// Opens a durable broker in `dir` on a manual clock.
pub(crate) async fn open(dir: &Path, clock: &ManualClock) -> Broker {
    Broker::open(BrokerOptions::durable(dir).clock(clock.clone())).await.expect("open broker")
}

/// Opens a durable broker with a queue named `q` (created if missing).
pub(crate) async fn open_with_queue(dir: &Path, clock: &ManualClock) -> Broker {
    let broker = open(dir, clock).await;
    match broker.create_queue("q", QueueProperties::default()).await {
        Ok(()) | Err(twice_broker::Error::EntityAlreadyExists(_)) => {}
        Err(e) => panic!("create queue: {e}"),
    }
    broker
}

/// Every message of an entity, by peeking.
pub(crate) async fn peek_all(broker: &Broker, path: &str) -> Vec<ReceivedMessage> {
    let mut out = Vec::new();
    let mut from = SequenceNumber::new(0);
    loop {
        let page = broker.peek(path, from, 1000).await.expect("peek");
        let Some(last) = page.last() else { return out };
        from = last.sequence_number.next();
        out.extend(page);
    }
}

/// A message with this id and body.
pub(crate) fn msg(id: &str) -> Message {
    Message::new(format!("body of {id}")).with_message_id(id)
}

/// No wait: a receive that returns at once.
pub(crate) const NOW: Duration = Duration::ZERO;

/// The path of an example of this crate, never stale (see
/// [`twice_testkit::process::example_bin`]).
pub(crate) fn example_bin(name: &str) -> PathBuf {
    twice_testkit::process::example_bin(env!("CARGO_MANIFEST_DIR"), "twice-broker", name, &[])
}
