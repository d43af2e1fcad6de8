//! Message bodies live on disk: a large backlog keeps resident memory bounded.

use std::process::Command;

use crate::support::example_bin;

/// The full test queues 1,000,000 messages of 1 KiB (set `TWICE_FULL_MEMORY_TEST=1`); by
/// default a smaller backlog keeps the suite fast.
fn message_count() -> usize {
    if std::env::var("TWICE_FULL_MEMORY_TEST").is_ok_and(|v| v == "1") {
        1_000_000
    } else {
        100_000
    }
}

fn run(args: &[&str]) -> (u64, u64) {
    let out = Command::new(example_bin("broker_child")).args(args).output().expect("run child");
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text:?}"))
    };
    println!("{args:?}: {}", text.replace('\n', ", "));
    (field("active"), field("rss_kib"))
}

#[test]
fn a_large_durable_backlog_stays_under_300_mib() {
    let dir = tempfile::tempdir().unwrap();
    let n = message_count();
    let d = dir.path().to_str().unwrap();
    let (active, rss) = run(&["fill", d, &n.to_string()]);
    assert_eq!(active, n as u64);
    assert!(rss < 300 * 1024, "resident memory after queueing {n} messages: {rss} KiB");
    let (active, rss) = run(&["reopen", d]);
    assert_eq!(active, n as u64);
    assert!(rss < 300 * 1024, "resident memory after replaying {n} messages: {rss} KiB");
}
