//! `twice dlq` on RabbitMQ and NATS JetStream, against the machine's servers.

use std::process::{Command, Output};
use std::time::Duration;

use twice::{DeadLetterReason, Delivery as _, Message, Receive as _};
use twice_nats::{NatsOptions, NatsTransport};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_testkit::nats::{NATS_URL, TestStream};
use twice_testkit::rabbitmq::{RABBITMQ_URL, TestQueue};

const WAIT: Duration = Duration::from_secs(5);

fn dlq(connection: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["dlq", "--connection", connection])
        .args(args)
        .env_remove("TWICE_CONNECTION_STRING")
        .output()
        .expect("running the twice binary")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "twice dlq failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// Sends each `(id, reason)` and dead-letters it with that reason.
async fn dead_letter<T: twice::Transport>(
    t: &T,
    send: impl AsyncFn(Message),
    messages: &[(&str, &str)],
) {
    for (id, _) in messages {
        send(Message::new(format!("body of {id}")).with_message_id(*id)).await;
    }
    for _ in messages {
        let d = t.receive(1, WAIT).await.unwrap().pop().expect("a message to dead-letter");
        let id = d.message().message_id().as_str().to_owned();
        let reason = messages.iter().find(|(i, _)| *i == id).unwrap().1;
        t.dead_letter(&d, DeadLetterReason::new(reason, format!("{id} failed"))).await.unwrap();
    }
}

/// Takes every message of `t` now there; returns their ids.
async fn take_all<T: twice::Transport>(t: &T) -> Vec<String> {
    let mut ids = Vec::new();
    loop {
        let got = t.receive(10, Duration::from_millis(700)).await.unwrap();
        if got.is_empty() {
            ids.sort();
            return ids;
        }
        for d in &got {
            ids.push(d.message().message_id().as_str().to_owned());
            t.complete(d).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_rabbitmq_lists_shows_exports_resubmits_and_purges() {
    let q = TestQueue::new("twice-dlq");
    let options = RabbitMqOptions::new(RABBITMQ_URL, q.name());
    let Some(t) =
        twice_testkit::require_service("RabbitMQ", RabbitMqTransport::connect(options).await)
    else {
        return;
    };
    let send = async |m: Message| {
        t.send(m).await.unwrap();
    };
    dead_letter(&t, send, &[("m1", "Poison"), ("m2", "Rejected"), ("m3", "Poison")]).await;
    let c = RABBITMQ_URL;

    let listed = ok(&dlq(c, &["list", "--entity", q.name()]));
    assert!(listed.contains("DEAD-LETTERED"), "{listed}");
    let row = listed.lines().find(|l| l.starts_with(q.name())).expect("the queue's row");
    assert_eq!(row.split_whitespace().collect::<Vec<_>>()[1..3], ["0", "3"], "{listed}");
    let json = json_lines(&ok(&dlq(c, &["list", "--entity", q.name(), "--json"])));
    assert_eq!(json[0]["dead_lettered"], 3);
    let failed = dlq(c, &["list"]);
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("--entity"), "one clear line");

    let shown = ok(&dlq(c, &["show", q.name()]));
    assert!(shown.contains("3 message(s) shown"), "{shown}");
    assert!(shown.contains("id=m1") && shown.contains("reason=Poison"), "{shown}");
    assert!(shown.contains("body: body of m2"), "{shown}");
    let exported = json_lines(&ok(&dlq(c, &["export", q.name()])));
    assert_eq!(exported.len(), 3, "show and export put everything back");
    assert!(exported.iter().any(|m| m["body"] == "body of m3"));

    let failed = dlq(c, &["resubmit", q.name(), "--sequence", "1"]);
    assert!(String::from_utf8_lossy(&failed.stderr).contains("no stable sequence number"));
    let out = ok(&dlq(c, &["resubmit", q.name(), "--reason", "Poison"]));
    assert!(out.contains("resubmitted 2 of 2"), "{out}");
    assert_eq!(take_all(&t).await, ["m1", "m3"], "the copies are back in the queue");
    let dead = t.dead_letter_receiver().await.unwrap();
    assert_eq!(dead.ready_count().await.unwrap(), 1, "m2 stays, put back");

    let out = dlq(c, &["purge", q.name()]);
    assert!(!out.status.success(), "purge asks first, and off a terminal it needs --yes");
    let out = ok(&dlq(c, &["purge", q.name(), "--yes"]));
    assert!(out.contains("deleted 1 message(s)"), "{out}");
    assert_eq!(dead.ready_count().await.unwrap(), 0);

    let missing = dlq(c, &["show", "no-such-queue-anywhere"]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no queue"), "one clear line");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_nats_lists_shows_exports_resubmits_and_purges() {
    let s = TestStream::new("TWICE_DLQ");
    let options = NatsOptions::new(NATS_URL, s.name());
    let Some(t) = twice_testkit::require_service("NATS", NatsTransport::connect(options).await)
    else {
        return;
    };
    let send = async |m: Message| {
        t.send(m).await.unwrap();
    };
    dead_letter(&t, send, &[("m1", "Poison"), ("m2", "Rejected"), ("m3", "Poison")]).await;
    let c = NATS_URL;

    let listed = ok(&dlq(c, &["list", "--entity", s.name()]));
    let row = listed.lines().find(|l| l.starts_with(s.name())).expect("the stream's row");
    assert_eq!(row.split_whitespace().collect::<Vec<_>>()[1..3], ["0", "3"], "{listed}");
    assert!(!listed.contains("_DEAD_LETTER "), "a dead-letter stream is no entity: {listed}");

    let shown = ok(&dlq(c, &["show", s.name(), "--json"]));
    let shown = json_lines(&shown);
    assert_eq!(shown.len(), 3);
    assert_eq!(shown[0]["message_id"], "m1");
    assert_eq!(shown[0]["dead_letter_reason"], "Poison");
    assert_eq!(shown[0]["dead_letter_source"], s.name());
    let first_sequence = shown[0]["sequence_number"].as_i64().unwrap().to_string();

    // The main stream saw these ids inside its duplicate window: their copies would be
    // dropped, so they stay dead-lettered unless given new ids.
    let out = dlq(c, &["resubmit", s.name(), "--sequence", &first_sequence]);
    let stdout = ok(&out);
    assert!(stdout.contains("resubmitted 0 of 1") && stdout.contains("1 kept"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("duplicate window"));
    let out = ok(&dlq(c, &["resubmit", s.name(), "--sequence", &first_sequence, "--new-id"]));
    assert!(out.contains("resubmitted 1 of 1"), "{out}");
    let back = t.receive(1, WAIT).await.unwrap().pop().expect("the copy");
    assert_eq!(
        back.message().message.application_properties.get("OriginalMessageId"),
        Some(&"m1".into())
    );
    t.complete(&back).await.unwrap();
    assert_eq!(t.message_count().await.unwrap(), 0);

    let exported = json_lines(&ok(&dlq(c, &["export", s.name()])));
    assert_eq!(exported.len(), 2);
    let out = ok(&dlq(c, &["purge", s.name(), "--yes"]));
    assert!(out.contains("deleted 2 message(s)"), "{out}");
    let json = json_lines(&ok(&dlq(c, &["list", "--entity", s.name(), "--json"])));
    assert_eq!(json[0]["dead_lettered"], 0);

    let missing = dlq(c, &["show", "NO_SUCH_STREAM_ANYWHERE"]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no stream"), "one clear line");
}

/// `twice dlq watch` on NATS: the baseline, then a rise logged with the newest reason and
/// served as metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_watch_on_nats_logs_a_rise_with_its_reason() {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    let s = TestStream::new("TWICE_DLQ");
    let options = NatsOptions::new(NATS_URL, s.name());
    let Some(t) = twice_testkit::require_service("NATS", NatsTransport::connect(options).await)
    else {
        return;
    };
    let send = async |m: Message| {
        t.send(m).await.unwrap();
    };
    dead_letter(&t, send, &[("before", "Old")]).await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["dlq", "--connection", NATS_URL, "watch", "--interval", "200ms"])
        .args(["--metrics", "127.0.0.1:0", "--entity", s.name()])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
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
    let scrape = || {
        let mut conn = std::net::TcpStream::connect(metrics.as_deref().unwrap()).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).unwrap();
        response
    };
    let entity = format!("entity=\"{}\"", s.name());
    assert!(scrape().contains(&format!("twice_dlq_messages{{{entity}}} 1\n")), "the baseline");
    dead_letter(&t, send, &[("x", "Poison")]).await;
    let mut rose = None;
    // At most a hundred waits of 100 ms, each ended early by a line.
    for _ in 0..100 {
        match log.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains("dead-letter count rose") => {
                rose = Some(line);
                break;
            }
            Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("the watcher's stderr ended: {e}"),
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let line = rose.expect("a warning within ten seconds");
    for field in ["from=1", "to=2", "reason=Poison"] {
        assert!(line.contains(field), "{field} in {line}");
    }
}
