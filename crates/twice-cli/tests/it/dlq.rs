//! `twice dlq` against a `twice serve` child process: messages are dead-lettered through the
//! Service Bus client, then listed, shown, exported, resubmitted and purged with the binary.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use twice::{DeadLetterReason, Message};
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};
use twice_testkit::serve::ServeProcess;

const WAIT: Duration = Duration::from_secs(5);

const CONFIG: &str = r#"{
  "UserConfig": {
    "Namespaces": [{
      "Name": "sbemulatorns",
      "Queues": [
        { "Name": "orders", "Properties": { "LockDuration": "PT30S", "MaxDeliveryCount": 5 } },
        { "Name": "payments", "Properties": { "RequiresDuplicateDetection": true,
          "DuplicateDetectionHistoryTimeWindow": "PT10M" } }
      ],
      "Topics": [{ "Name": "events", "Properties": {},
        "Subscriptions": [{ "Name": "billing", "Properties": {}, "Rules": [] }] }]
    }],
    "Logging": { "Type": "Console" }
  }
}"#;

/// `twice serve --in-memory` with [`CONFIG`] on free ports; killed on drop.
struct Serve {
    /// Dropped before the directory that holds its config.
    _process: ServeProcess,
    connection_string: String,
    admin_url: String,
    _dir: tempfile::TempDir,
}

impl Serve {
    fn start() -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("Config.json");
        std::fs::write(&config, CONFIG).unwrap();
        let process = ServeProcess::start(
            env!("CARGO_BIN_EXE_twice"),
            &["--in-memory", "--config", config.to_str().unwrap()],
        );
        Serve {
            connection_string: process.connection_string().expect("a connection string").into(),
            admin_url: process.http_url(),
            _process: process,
            _dir: dir,
        }
    }

    fn client(&self) -> ServiceBusClient {
        ServiceBusClient::from_connection_string(&self.connection_string).unwrap()
    }

    /// Runs `twice dlq ARGS` against this server.
    fn dlq(&self, args: &[&str]) -> Output {
        self.dlq_with(&self.connection_string, args)
    }

    fn dlq_with(&self, connection_string: &str, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_twice"))
            .arg("dlq")
            .args(args)
            .args(["--admin-url", &self.admin_url])
            .env("TWICE_CONNECTION_STRING", connection_string)
            .stdin(Stdio::null())
            .output()
            .expect("running twice dlq")
    }

    /// The counts `twice dlq list` prints for `entity`: active, dead-lettered, scheduled,
    /// deferred.
    fn counts(&self, entity: &str) -> [u64; 4] {
        let out = self.dlq(&["list"]);
        let stdout = ok(&out);
        let line = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(entity))
            .unwrap_or_else(|| panic!("no line for {entity} in {stdout}"));
        let n: Vec<u64> = line.split_whitespace().skip(1).map(|v| v.parse().unwrap()).collect();
        [n[0], n[1], n[2], n[3]]
    }
}

/// The stdout of a successful run.
fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "twice dlq failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The stderr of a failed run, which must be one line.
fn failed(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure: {}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    assert_eq!(stderr.lines().count(), 1, "one line of error: {stderr}");
    stderr
}

/// Sends `bodies` to `entity` with ids `id-<body>` and dead-letters each with its reason.
async fn dead_letter(client: &ServiceBusClient, entity: &str, messages: &[(&str, &str)]) {
    let sender = client.sender(entity);
    for (body, _) in messages {
        sender
            .send_message(Message::new(body.to_string()).with_message_id(format!("id-{body}")))
            .await
            .unwrap();
    }
    let receiver = client.receiver(entity, ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < messages.len() {
        got.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    for d in &got {
        let body = String::from_utf8_lossy(d.message().body()).into_owned();
        let reason = messages.iter().find(|(b, _)| *b == body).unwrap().1;
        receiver
            .dead_letter_message(d, DeadLetterReason::new(reason, format!("{body} failed")))
            .await
            .unwrap();
    }
    receiver.close().await;
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_lists_shows_exports_resubmits_and_purges() {
    let s = Serve::start();
    let client = s.client();
    dead_letter(&client, "orders", &[("a", "Poison"), ("b", "Timeout"), ("c", "Poison")]).await;
    assert_eq!(s.counts("orders"), [0, 3, 0, 0]);
    assert_eq!(s.counts("events/Subscriptions/billing"), [0, 0, 0, 0]);
    let filtered = ok(&s.dlq(&["list", "--entity", "BILL"]));
    assert!(filtered.contains("events/Subscriptions/billing") && !filtered.contains("orders"));

    let shown = json_lines(&ok(&s.dlq(&["show", "orders", "--json"])));
    assert_eq!(shown.len(), 3);
    assert_eq!(shown[0]["message_id"], "id-a");
    assert_eq!(shown[0]["dead_letter_reason"], "Poison");
    assert_eq!(shown[1]["dead_letter_reason"], "Timeout");
    assert_eq!(shown[1]["dead_letter_description"], "b failed");
    assert_eq!(shown[2]["body_preview"], "c");
    assert_eq!(json_lines(&ok(&s.dlq(&["show", "orders", "--json", "--max", "2"]))).len(), 2);
    let human = ok(&s.dlq(&["show", "orders"]));
    assert!(human.contains("reason=Timeout") && human.contains("description: b failed"), "{human}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dlq.jsonl");
    ok(&s.dlq(&["export", "orders", "--output", file.to_str().unwrap()]));
    let exported = json_lines(&std::fs::read_to_string(&file).unwrap());
    let bodies: Vec<&str> = exported.iter().map(|m| m["body"].as_str().unwrap()).collect();
    assert_eq!(bodies, ["a", "b", "c"]);
    assert_eq!(s.counts("orders"), [0, 3, 0, 0], "an export removes nothing");

    let out = ok(&s.dlq(&["resubmit", "orders", "--reason", "Poison"]));
    assert!(out.contains("resubmitted 2 of 2"), "{out}");
    assert_eq!(s.counts("orders"), [2, 1, 0, 0]);
    let receiver = client.receiver("orders", ReceiverOptions::new().prefetch(10));
    let mut back = Vec::new();
    while back.len() < 2 {
        back.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    let mut ids: Vec<String> =
        back.iter().map(|d| d.message().message_id().as_str().to_owned()).collect();
    ids.sort();
    assert_eq!(ids, ["id-a", "id-c"], "the copies keep their ids");
    for d in &back {
        assert!(d.message().dead_letter_reason.is_none());
        receiver.complete_message(d).await.unwrap();
    }

    let refused = failed(&s.dlq(&["purge", "orders"]));
    assert!(refused.contains("--yes"), "{refused}");
    assert_eq!(s.counts("orders"), [0, 1, 0, 0], "nothing deleted without a confirmation");
    let out = ok(&s.dlq(&["purge", "orders", "--yes"]));
    assert!(out.contains("deleted 1 message"), "{out}");
    assert_eq!(s.counts("orders"), [0, 0, 0, 0]);
    assert!(json_lines(&ok(&s.dlq(&["show", "orders", "--json"]))).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resubmit_keeps_what_duplicate_detection_would_drop_unless_given_new_ids() {
    let s = Serve::start();
    let client = s.client();
    dead_letter(&client, "payments", &[("p1", "Poison")]).await;
    let out = s.dlq(&["resubmit", "payments", "--all"]);
    let stdout = ok(&out);
    assert!(stdout.contains("resubmitted 0 of 1") && stdout.contains("1 kept"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--new-id"));
    assert_eq!(s.counts("payments"), [0, 1, 0, 0], "the message stays dead-lettered");

    let stdout = ok(&s.dlq(&["resubmit", "payments", "--sequence", "1", "--new-id"]));
    assert!(stdout.contains("resubmitted 1 of 1"), "{stdout}");
    assert_eq!(s.counts("payments"), [1, 0, 0, 0]);
    let receiver = client.receiver("payments", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_ne!(d.message().message_id().as_str(), "id-p1");
    assert_eq!(
        d.message().message.application_properties.get("OriginalMessageId"),
        Some(&twice::Value::from("id-p1"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_is_resubmitted_to_its_topic_only_when_asked() {
    let s = Serve::start();
    let client = s.client();
    client.sender("events").send_message(Message::new("e1")).await.unwrap();
    let sub = client.receiver("events/Subscriptions/billing", ReceiverOptions::new());
    let d = sub.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    sub.dead_letter_message(&d, DeadLetterReason::new("Stale", "old")).await.unwrap();
    let err = failed(&s.dlq(&["resubmit", "events/Subscriptions/billing", "--all"]));
    assert!(err.contains("--to"), "{err}");
    let stdout =
        ok(&s.dlq(&["resubmit", "events/Subscriptions/billing", "--all", "--to", "events"]));
    assert!(stdout.contains("resubmitted 1 of 1"), "{stdout}");
    assert_eq!(s.counts("events/Subscriptions/billing"), [1, 0, 0, 0]);
}

#[test]
fn wrong_keys_unknown_entities_and_bad_strings_are_one_clear_line() {
    let s = Serve::start();
    let wrong = s.connection_string.replace("SAS_KEY_VALUE", "not-the-key");
    let err = failed(&s.dlq_with(&wrong, &["show", "orders"]));
    assert!(err.contains("unauthorized"), "{err}");
    let err = failed(&s.dlq_with(&wrong, &["list"]));
    assert!(err.contains("unauthorized"), "{err}");
    let err = failed(&s.dlq(&["show", "nope"]));
    assert!(
        err.contains("no entity 'nope/$DeadLetterQueue'") || err.contains("no entity 'nope"),
        "{err}"
    );
    let err = failed(&s.dlq_with("Endpoint=nothing", &["list"]));
    assert!(err.contains("connection string"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["dlq", "list"])
        .env_remove("TWICE_CONNECTION_STRING")
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("TWICE_CONNECTION_STRING"), "{err}");
}
