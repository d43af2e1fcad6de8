//! `twice outbox` on an outbox whose relay parked what the broker refused: status, list,
//! retry and discard, as an operator runs them, and the errors of a bad invocation.

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use twice::{Message, Relay, RelayOptions};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{OutboxOptions, SqlxOutbox};

fn twice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(args)
        .env_remove("TWICE_STORE")
        .output()
        .expect("running the twice binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json_lines(out: &Output) -> Vec<Value> {
    stdout(out).lines().map(|l| serde_json::from_str(l).expect("one JSON object a line")).collect()
}

/// An SQLite outbox with one row sent and two parked (their queues do not exist).
async fn parked_outbox(path: &std::path::Path) {
    let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(path))
        .await
        .expect("pool");
    let outbox = SqlxOutbox::new(pool.clone(), OutboxOptions::new()).await.expect("outbox");
    let broker = Broker::open(BrokerOptions::in_memory()).await.expect("broker");
    broker.create_queue("shipped", QueueProperties::default()).await.expect("queue");
    let mut tx = pool.begin().await.expect("begin");
    let writer = outbox.writer();
    for (to, body) in [("shipped", "a"), ("nowhere", "b"), ("elsewhere", "c")] {
        writer.push(to, Message::new(body)).expect("valid");
    }
    outbox.write(&mut tx, &writer).await.expect("write");
    outbox.commit(tx).await.expect("commit");
    let relay = Relay::new(
        outbox.clone(),
        broker,
        RelayOptions::new().poll_interval(Duration::from_millis(10)),
    );
    let counters = relay.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    for _ in 0..60_000 {
        let s = counters.snapshot();
        // Counted at the acknowledgement; its row is deleted just after.
        let pending = twice::OutboxStore::stats(&outbox).await.expect("stats").pending;
        if s.sent == 1 && s.parked == 2 && pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = stop.send(());
    task.await.expect("join");
    assert_eq!(counters.snapshot().parked, 2);
}

#[test]
fn an_operator_sees_parked_rows_and_retries_or_discards_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shop.db");
    tokio::runtime::Runtime::new().unwrap().block_on(parked_outbox(&path));
    let store = format!("sqlite:{}", path.display());

    let out = twice(&["outbox", "status", "--store", &store, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let status: Value = serde_json::from_str(stdout(&out).trim()).expect("json");
    assert_eq!((status["pending"].as_u64(), status["parked"].as_u64()), (Some(0), Some(2)));

    let out = twice(&["outbox", "status", "--store", &store]);
    assert!(stdout(&out).contains("parked    2"), "{}", stdout(&out));
    assert!(stdout(&out).contains("twice outbox retry"), "says what to do: {}", stdout(&out));

    let out = twice(&["outbox", "list", "--store", &store, "--json"]);
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 2, "{}", stdout(&out));
    assert_eq!(rows[0]["destination"], "nowhere");
    assert_eq!(rows[0]["state"], "parked");
    let reason = rows[0]["last_error"].as_str().unwrap_or_default();
    assert!(reason.contains("not found"), "the broker's reason: {reason}");
    let out = twice(&["outbox", "list", "--store", &store]);
    assert!(stdout(&out).contains("elsewhere"), "{}", stdout(&out));

    let seq = rows[0]["seq"].as_i64().unwrap().to_string();
    let out = twice(&["outbox", "retry", "--store", &store, "--seq", &seq]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("1 parked rows made pending again"), "{}", stdout(&out));

    // Not on a terminal, a discard needs --yes, and deletes nothing without it.
    let out = twice(&["outbox", "discard", "--store", &store, "--all"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--yes"), "{}", stderr(&out));
    let out = twice(&["outbox", "discard", "--store", &store, "--all", "--yes"]);
    assert!(stdout(&out).contains("1 parked rows deleted"), "{}", stdout(&out));

    let out = twice(&["outbox", "list", "--store", &store, "--pending", "--json"]);
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["destination"], "nowhere");
    assert_eq!(rows[0]["attempts"], 0, "a retried row starts again");
}

#[test]
fn a_bad_invocation_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = twice(&["outbox", "status"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--store"), "{}", stderr(&out));

    let path = dir.path().join("missing.db");
    let out = twice(&["outbox", "status", "--store", &format!("sqlite:{}", path.display())]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));

    // A database without the table: the error names the migration that makes it.
    let path = dir.path().join("empty.db");
    std::fs::File::create(&path).unwrap();
    let out = twice(&["outbox", "status", "--store", &format!("sqlite:{}", path.display())]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("\"twice_outbox\" does not exist") && err.contains("migration 1"),
        "{err}"
    );
    assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{err}");

    let out = twice(&["outbox", "status", "--store", "oracle://x"]);
    assert!(stderr(&out).contains("unknown store"), "{}", stderr(&out));
}
