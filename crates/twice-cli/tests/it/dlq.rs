//! `twice dlq` against a `twice serve` child process: messages are dead-lettered through the
//! Service Bus client, then listed, shown, exported, resubmitted and purged with the binary.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
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
          "DuplicateDetectionHistoryTimeWindow": "PT10M" } },
        { "Name": "carts", "Properties": { "RequiresSession": true } },
        { "Name": "held", "Properties": { "LockDuration": "PT5S" } }
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
        Self::start_with(&[])
    }

    /// As [`Serve::start`], with more arguments for `twice serve`.
    fn start_with(extra: &[&str]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("Config.json");
        std::fs::write(&config, CONFIG).unwrap();
        let config = config.to_str().unwrap();
        let mut args = vec!["--in-memory", "--config", config];
        args.extend_from_slice(extra);
        let process = ServeProcess::start(env!("CARGO_BIN_EXE_twice"), &args);
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
    assert!(err.contains("no entity 'nope' in the namespace"), "{err}");
    let err = failed(&s.dlq(&["purge", "nope", "--yes"]));
    assert!(err.contains("no entity 'nope' in the namespace"), "{err}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_json_has_one_object_per_entity_for_scripts() {
    let s = Serve::start();
    let client = s.client();
    dead_letter(&client, "orders", &[("a", "Poison"), ("b", "Poison")]).await;
    client.sender("orders").send_message(Message::new("live")).await.unwrap();
    let listed = json_lines(&ok(&s.dlq(&["list", "--json"])));
    let paths: Vec<&str> = listed.iter().map(|e| e["entity"].as_str().unwrap()).collect();
    assert_eq!(paths, ["orders", "payments", "carts", "held", "events/Subscriptions/billing"]);
    let orders = &listed[0];
    assert_eq!(orders["active"], 1);
    assert_eq!(orders["dead_lettered"], 2);
    assert_eq!(orders["scheduled"], 0);
    assert_eq!(orders["deferred"], 0);
    let filtered = json_lines(&ok(&s.dlq(&["list", "--json", "--entity", "pay"])));
    assert_eq!(filtered.len(), 1);
    assert_eq!(filtered[0]["entity"], "payments");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resubmit_filters_on_a_property_and_combines_filters() {
    let s = Serve::start();
    let client = s.client();
    let sender = client.sender("orders");
    for (id, tenant) in [("t1", "acme"), ("t2", "globex"), ("t3", "acme")] {
        let m = Message::new(id).with_message_id(id).with_property("tenant", tenant);
        sender.send_message(m).await.unwrap();
    }
    let receiver = client.receiver("orders", ReceiverOptions::new().prefetch(10));
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(receiver.receive_messages(10, WAIT).await.unwrap());
    }
    for d in &got {
        let reason = if d.message().message_id().as_str() == "t3" { "Timeout" } else { "Poison" };
        receiver.dead_letter_message(d, DeadLetterReason::new(reason, "")).await.unwrap();
    }
    let out =
        ok(&s.dlq(&["resubmit", "orders", "--property", "tenant=acme", "--reason", "Poison"]));
    assert!(out.contains("resubmitted 1 of 1"), "{out}");
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().unwrap();
    assert_eq!(d.message().message_id().as_str(), "t1", "acme and Poison: only t1");
    receiver.complete_message(&d).await.unwrap();
    let out = ok(&s.dlq(&["resubmit", "orders", "--property", "tenant=acme"]));
    assert!(out.contains("resubmitted 1 of 1"), "{out}");
    assert_eq!(s.counts("orders"), [1, 1, 0, 0], "t3 back, t2 (globex) still dead-lettered");
    // Usage errors are clap's: the error line, then a hint.
    let usage = |args: &[&str]| {
        let out = s.dlq(args);
        assert!(!out.status.success(), "expected a usage error for {args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = usage(&["resubmit", "orders", "--property", "tenant"]);
    assert!(err.contains("KEY=VALUE"), "{err}");
    let err = usage(&["resubmit", "orders", "--all", "--reason", "Poison"]);
    assert!(err.contains("--all") && err.contains("cannot be used with"), "{err}");
    assert_eq!(s.counts("orders"), [1, 1, 0, 0], "a refused command moves nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resubmit_to_a_session_enabled_queue_keeps_the_session_id() {
    use twice::{Receive as _, SessionReceiver as _};
    let s = Serve::start();
    let client = s.client();
    let cart = twice::SessionId::new("cart-7");
    let sent = Message::new("add").with_message_id("c1").with_session_id(cart.as_str());
    client.sender("carts").send_message(sent).await.unwrap();
    let sessions = client.session_receiver("carts", ReceiverOptions::new());
    let session = sessions.accept_session(&cart).await.unwrap();
    let d = session.receive(1, WAIT).await.unwrap().pop().unwrap();
    session.dead_letter(&d, DeadLetterReason::new("Poison", "")).await.unwrap();
    session.close().await.unwrap();
    assert_eq!(s.counts("carts"), [0, 1, 0, 0]);

    let out = ok(&s.dlq(&["resubmit", "carts", "--all"]));
    assert!(out.contains("resubmitted 1 of 1"), "{out}");
    assert_eq!(s.counts("carts"), [1, 0, 0, 0]);
    let session = sessions.accept_next_session(WAIT).await.unwrap().expect("the session is back");
    assert_eq!(session.session_id(), &cart);
    let d = session.receive(1, WAIT).await.unwrap().pop().expect("the copy, in its session");
    assert_eq!(d.message().message_id().as_str(), "c1");
    assert_eq!(d.message().message.session_id.as_ref(), Some(&cart));
    session.complete(&d).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_without_the_rights_a_command_needs_is_one_clear_line() {
    let mut s = Serve::start_with(&[
        "--sas-key",
        "RootManageSharedAccessKey=SAS_KEY_VALUE",
        "--sas-key",
        "reader=READER_KEY:Listen",
    ]);
    // With keys of its own, the server prints the connection string without the key.
    s.connection_string =
        s.connection_string.replace("<the key of RootManageSharedAccessKey>", "SAS_KEY_VALUE");
    dead_letter(&s.client(), "orders", &[("a", "Poison")]).await;
    let reader = s
        .connection_string
        .replace("RootManageSharedAccessKey", "reader")
        .replace("SAS_KEY_VALUE", "READER_KEY");
    let err = failed(&s.dlq_with(&reader, &["list"]));
    assert!(err.contains("unauthorized") && err.contains("Manage"), "{err}");
    let shown = json_lines(&ok(&s.dlq_with(&reader, &["show", "orders", "--json"])));
    assert_eq!(shown.len(), 1, "peeking needs Listen only");
    let err = failed(&s.dlq_with(&reader, &["resubmit", "orders", "--all", "--new-id"]));
    assert!(err.contains("unauthorized") && err.contains("Send"), "{err}");
    assert_eq!(s.counts("orders"), [0, 1, 0, 0], "the message stays dead-lettered");
}

/// `twice dlq watch` as a child process: its metrics address, and its stderr lines as they
/// come; killed on drop.
struct Watch {
    child: Child,
    metrics: String,
    log: std::sync::mpsc::Receiver<String>,
}

impl Watch {
    fn start(s: &Serve) -> Watch {
        let mut child = Command::new(env!("CARGO_BIN_EXE_twice"))
            .args(["dlq", "watch", "--interval", "200ms", "--metrics", "127.0.0.1:0"])
            .args(["--admin-url", &s.admin_url])
            .env("TWICE_CONNECTION_STRING", &s.connection_string)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting twice dlq watch");
        let (tx, log) = std::sync::mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut metrics = None;
        loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "twice dlq watch ended before watching");
            if let Some(url) = line.trim().strip_prefix("metrics: http://") {
                metrics = Some(url.trim_end_matches("/metrics").to_owned());
            }
            if line.starts_with("watching") {
                break;
            }
        }
        Watch { child, metrics: metrics.expect("a metrics line"), log }
    }

    /// The Prometheus text the watcher serves.
    fn scrape(&self) -> String {
        use std::io::Write as _;
        let mut conn = std::net::TcpStream::connect(&self.metrics).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        response
    }

    /// The first stderr line containing `text`, within ten seconds.
    fn log_line(&self, text: &str) -> String {
        // At most a hundred waits of 100 ms, each ended early by a line.
        for _ in 0..100 {
            match self.log.recv_timeout(Duration::from_millis(100)) {
                Ok(line) if line.contains(text) => return line,
                Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(e) => panic!("the watcher's stderr ended: {e}"),
            }
        }
        panic!("no log line with {text:?} within ten seconds")
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_logs_a_rise_and_serves_it_as_metrics() {
    let s = Serve::start();
    let client = s.client();
    dead_letter(&client, "orders", &[("before", "Old")]).await;
    let w = Watch::start(&s);
    let text = w.scrape();
    assert!(text.contains("twice_dlq_messages{entity=\"orders\"} 1\n"), "{text}");
    assert!(text.contains("twice_dlq_increases_total{entity=\"orders\"} 0\n"), "the baseline");
    assert!(text.contains("twice_dlq_messages{entity=\"events/Subscriptions/billing\"} 0\n"));

    dead_letter(&client, "orders", &[("x", "Poison")]).await;
    let line = w.log_line("dead-letter count rose");
    assert!(line.contains("WARN"), "{line}");
    for field in ["entity=orders", "from=1", "to=2", "reason=Poison"] {
        assert!(line.contains(field), "{field} in {line}");
    }
    let text = w.scrape();
    assert!(text.contains("twice_dlq_messages{entity=\"orders\"} 2\n"), "{text}");
    assert!(text.contains("twice_dlq_increases_total{entity=\"orders\"} 1\n"), "{text}");
    assert!(text.contains("# TYPE twice_dlq_messages gauge"), "{text}");

    // A second rise names the newest message's reason, not the first one's.
    dead_letter(&client, "orders", &[("y", "Timeout")]).await;
    let line = w.log_line("dead-letter count rose");
    assert!(line.contains("to=3") && line.contains("reason=Timeout"), "{line}");
}

#[test]
fn watch_stops_at_once_when_it_cannot_read_the_counts() {
    let s = Serve::start();
    let wrong = s.connection_string.replace("SAS_KEY_VALUE", "not-the-key");
    let err = failed(&s.dlq_with(&wrong, &["watch", "--interval", "1s"]));
    assert!(err.contains("unauthorized"), "{err}");
}

/// `--ca-file`: against `twice serve --tls-cert` with a certificate of a private CA, `list`
/// (the administration API over https) and `show` (amqps) trust that CA; without it, each is
/// one line that names the certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_trusts_a_private_ca_given_with_ca_file() {
    let certs = twice_testkit::tls::TestCertificates::localhost();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    std::fs::write(path("cert.pem"), &certs.cert_pem).unwrap();
    std::fs::write(path("key.pem"), &certs.key_pem).unwrap();
    std::fs::write(path("ca.pem"), &certs.ca_pem).unwrap();
    let mut s =
        Serve::start_with(&["--tls-cert", &path("cert.pem"), "--tls-key", &path("key.pem")]);
    // The certificate names `localhost`.
    let port = s.admin_url.rsplit(':').next().unwrap().to_owned();
    assert!(s.admin_url.starts_with("https://"), "{}", s.admin_url);
    s.admin_url = format!("https://localhost:{port}");
    let tls = twice_servicebus_client::TlsOptions::with_ca_pem(certs.ca_pem.as_bytes()).unwrap();
    let options =
        twice_servicebus_client::ClientOptions::from_connection_string(&s.connection_string)
            .unwrap()
            .tls(Some(tls));
    dead_letter(&ServiceBusClient::new(options), "orders", &[("t", "Poison")]).await;

    let ca = path("ca.pem");
    let listed = ok(&s.dlq(&["list", "--ca-file", &ca]));
    let line =
        listed.lines().find(|l| l.starts_with("orders ")).unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(line.split_whitespace().nth(2), Some("1"), "{line}");
    let shown = json_lines(&ok(&s.dlq(&["show", "orders", "--json", "--ca-file", &ca])));
    assert_eq!(shown.len(), 1);
    assert_eq!(shown[0]["dead_letter_reason"], "Poison");

    for args in [&["list"][..], &["show", "orders"][..]] {
        let err = failed(&s.dlq(args));
        assert!(err.contains("certificate") && err.contains("--ca-file"), "{args:?}: {err}");
    }
    let err = failed(&s.dlq(&["list", "--ca-file", &path("missing.pem")]));
    assert!(err.contains("missing.pem"), "{err}");
    let err = failed(&s.dlq(&["list", "--ca-file", &path("key.pem")]));
    assert!(err.contains("key.pem") && err.contains("certificate"), "{err}");
}

/// A purge counts the dead-letter queue's messages with a peek, then deletes them. Its first
/// receive can come back empty while messages are there: its wait may go on attaching the
/// link (on a loaded machine), or, as here, another receiver holds the one message locked
/// (for 5 s, longer than one receive waits). The purge goes on until what it counted is
/// deleted or a peek finds the queue empty; it never reports "deleted 0" for a queue that
/// holds messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_what_it_counted_even_when_its_first_receive_finds_nothing() {
    let s = Serve::start();
    let client = s.client();
    dead_letter(&client, "held", &[("x", "Poison")]).await;
    let holder = client.receiver("held/$DeadLetterQueue", ReceiverOptions::new());
    let held = holder.receive_messages(1, WAIT).await.unwrap();
    assert_eq!(held.len(), 1, "the dead-lettered message, locked by another receiver");

    let out = ok(&s.dlq(&["purge", "held", "--yes"]));
    assert!(out.contains("deleted 1 message"), "{out}");
    assert_eq!(s.counts("held"), [0, 0, 0, 0]);
}

#[test]
fn watch_names_metrics_when_its_port_is_in_use() {
    let s = Serve::start();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let err = failed(&s.dlq(&["watch", "--interval", "1s", "--metrics", &addr]));
    assert_eq!(
        err,
        format!(
            "error: --metrics {addr} is in use (Address already in use); choose another port with --metrics"
        )
    );
}

/// A connection string without `UseDevelopmentEmulator=true` asks for TLS: against the plain
/// server, amqp (`show`) and the administration API over https (`list`) each name the flag
/// to add, not a CA file.
#[test]
fn a_plain_server_asked_for_tls_is_told_to_add_the_emulator_flag() {
    let s = Serve::start();
    let tls = s.connection_string.replace("UseDevelopmentEmulator=true;", "");
    assert_ne!(tls, s.connection_string);
    let err = failed(&s.dlq_with(&tls, &["show", "orders"]));
    assert!(err.contains("add UseDevelopmentEmulator=true; to the connection string"), "{err}");
    assert!(!err.contains("--ca-file"), "{err}");

    // Its HTTP port answers https with its development certificate, which is not trusted
    // here: the advice names the CA file to trust.
    let list = |admin_url: &str| {
        let https = admin_url.replace("http://", "https://");
        let out = Command::new(env!("CARGO_BIN_EXE_twice"))
            .args(["dlq", "list", "--admin-url", &https])
            .env("TWICE_CONNECTION_STRING", &tls)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        failed(&out)
    };
    let err = list(&s.admin_url);
    assert!(err.contains("--ca-file") && err.contains("dev-https/"), "{err}");
    // Without it (--no-dev-https), the port does not answer TLS: the flag to add is named.
    let plain = Serve::start_with(&["--no-dev-https"]);
    let err = list(&plain.admin_url);
    assert!(err.contains("does not answer TLS"), "{err}");
    assert!(err.contains("UseDevelopmentEmulator=true;") && !err.contains("--ca-file"), "{err}");
}

/// `twice dlq export` (from the running server) and `twice data export` (from its data
/// directory once stopped) write the same dead-lettered message as the same JSON object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_export_and_data_export_write_one_shape() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let data = dir.path().join("data");
    let process = ServeProcess::start(
        env!("CARGO_BIN_EXE_twice"),
        &["--config", config.to_str().unwrap(), "--data-dir", data.to_str().unwrap()],
    );
    let connection_string = process.connection_string().unwrap().to_owned();
    let client = ServiceBusClient::from_connection_string(&connection_string).unwrap();
    let mut message = Message::new("shape").with_message_id("id-shape").with_subject("s");
    message.application_properties.insert("tenant".into(), twice::Value::from("t1"));
    client.sender("orders").send_message(message).await.unwrap();
    let receiver = client.receiver("orders", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().expect("the message");
    receiver.dead_letter_message(&d, DeadLetterReason::new("Poison", "it failed")).await.unwrap();
    receiver.close().await;
    client.close().await;

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["dlq", "export", "orders", "--admin-url", &process.http_url()])
        .env("TWICE_CONNECTION_STRING", &connection_string)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let from_dlq = json_lines(&ok(&out));
    assert!(process.terminate().status.success());
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["data", "export", data.to_str().unwrap(), "--entity", "orders/$DeadLetterQueue"])
        .output()
        .unwrap();
    let from_data = json_lines(&ok(&out));
    assert_eq!(from_dlq.len(), 1);
    assert_eq!(from_data.len(), 1);
    let keys = |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&from_dlq[0]), keys(&from_data[0]));
    assert_eq!(from_dlq[0], from_data[0]);
    assert_eq!(from_dlq[0]["body"], "shape");
    assert_eq!(from_dlq[0]["dead_letter_reason"], "Poison");
    assert_eq!(from_dlq[0]["properties"]["tenant"], "t1");
}

/// The console's JSON API and `twice dlq show --json` show a dead-lettered message as one
/// and the same object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_and_dlq_show_render_a_message_identically() {
    let s = Serve::start();
    let client = s.client();
    let mut message = Message::new("same everywhere")
        .with_message_id("id-same")
        .with_subject("s")
        .with_correlation_id("c-1");
    message.application_properties.insert("tenant".into(), twice::Value::from("t1"));
    message.application_properties.insert("n".into(), twice::Value::Long(7));
    client.sender("orders").send_message(message).await.unwrap();
    let receiver = client.receiver("orders", ReceiverOptions::new());
    let d = receiver.receive_messages(1, WAIT).await.unwrap().pop().expect("the message");
    receiver.dead_letter_message(&d, DeadLetterReason::new("Poison", "it failed")).await.unwrap();
    receiver.close().await;
    client.close().await;

    let shown = json_lines(&ok(&s.dlq(&["show", "orders", "--json"])));
    let http = s.admin_url.trim_start_matches("http://").to_owned();
    let expiry = twice::Clock::now(&twice::SystemClock).as_millis() / 1000 + 600;
    let token = twice_servicebus::sas::sign(
        &format!("http://{http}/"),
        "RootManageSharedAccessKey",
        "SAS_KEY_VALUE",
        expiry,
    );
    let mut stream = std::net::TcpStream::connect(&http).unwrap();
    std::io::Write::write_all(
        &mut stream,
        format!(
            "GET /$console/api/peek?entity=orders&dlq=1 HTTP/1.1\r\nHost: localhost\r\n\
             Authorization: {token}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.1 200"), "{response}");
    let console: serde_json::Value = serde_json::from_str(body).expect("JSON");
    let from_console = &console["messages"][0];
    assert_eq!(shown.len(), 1);
    assert_eq!(&shown[0], from_console);
    assert_eq!(shown[0]["body_preview"], "same everywhere");
    assert_eq!(shown[0]["dead_letter_reason"], "Poison");
    assert_eq!(shown[0]["properties"], serde_json::json!({ "tenant": "t1", "n": 7 }));
}
