//! Helpers shared by the tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use twice::{ManualClock, Message, ReceivedMessage, SequenceNumber};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};

/// Opens a durable broker in `dir` on a manual clock.
pub(crate) async fn open(dir: &Path, clock: &ManualClock) -> Broker {
    Broker::open(BrokerOptions::durable(dir).with_clock(clock.clone())).await.expect("open broker")
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

/// The path of a binary built from this crate's examples.
///
/// `cargo test -p twice-broker` builds examples next to the test binary. When it is missing or
/// older than the library or its own source (a run limited with `--test it` builds neither), it
/// is built into a separate target directory, since the cargo running this test holds the lock
/// of the main one.
pub(crate) fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/it-<hash> → target/<profile>/examples/<name>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile directory");
    let path = profile_dir.join("examples").join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{name}.rs"));
    let newest_lib = std::fs::read_dir(profile_dir.join("deps"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            file.starts_with("libtwice_broker-") && file.ends_with(".rlib")
        })
        .filter_map(|e| modified(&e.path()))
        .max();
    let inputs = [modified(&source), newest_lib].into_iter().flatten().max();
    if let Some(built) = modified(&path) {
        if inputs.is_none_or(|newest| built >= newest) {
            return path;
        }
    }
    let release = profile_dir.file_name().is_some_and(|p| p == "release");
    let target = profile_dir.parent().expect("target directory").join("example-children");
    let mut cmd = std::process::Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", "twice-broker", "--example", name])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "building example {name} failed");
    target.join(if release { "release" } else { "debug" }).join("examples").join(name)
}
