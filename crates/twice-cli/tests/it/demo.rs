//! `twice demo` end to end: the JSON it prints must show twice keeping every invariant while
//! the naive handler, under the same injected faults, really repeats effects.

use std::process::Command;

use serde_json::Value;
use twice_testkit::rabbitmq::TestQueue;
use twice_testkit::serve::ServeProcess;

const POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const MARIADB_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// Runs the demo with enough orders and fault rates that every fault occurs, and parses its
/// JSON. Returns the exit status too.
fn run_demo(extra: &[&str]) -> (bool, Value) {
    run_demo_orders(300, extra)
}

fn run_demo_orders(orders: u64, extra: &[&str]) -> (bool, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--json", "--orders", &orders.to_string(), "--seed", "11"])
        .args(["--bad-json-rate", "0.02", "--reject-rate", "0.02", "--slow", "3"])
        .args(extra)
        .output()
        .expect("running the twice binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "the demo did not print one JSON object ({e}).\nstdout: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), json)
}

fn n(v: &Value, path: &[&str]) -> u64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_u64().unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

fn check(success: bool, json: &Value) {
    check_orders(300, success, json);
}

fn check_orders(orders: u64, success: bool, json: &Value) {
    let valid = n(json, &["valid_orders"]);
    let poison = n(json, &["poison"]);
    assert_eq!(n(json, &["orders"]), orders);
    assert_eq!(valid + poison, orders);
    assert!(poison > 0, "the run must contain poison messages: {json}");
    assert_eq!(json["invariants_hold"], Value::Bool(true), "{json:#}");
    assert!(success, "exit status must be 0 when the invariants hold");

    // twice: every effect exactly once, every poison message in the DLQ, nothing lost.
    assert_eq!(n(json, &["twice", "shipments"]), valid);
    assert_eq!(n(json, &["twice", "charges"]), valid);
    assert_eq!(n(json, &["twice", "emails"]), valid);
    assert_eq!(n(json, &["twice", "dead_lettered"]), poison);
    assert_eq!(n(json, &["twice", "lost"]), 0);
    // Each layer really caught something (RabbitMQ has no duplicate detection: the inbox claim
    // catches its sender retries instead; Service Bus drops duplicates without telling).
    if json["broker_reports_duplicates"] == Value::Bool(true) {
        assert!(n(json, &["twice", "duplicates", "broker"]) > 0, "{json:#}");
    } else {
        assert!(["rabbitmq", "serve", "servicebus"].contains(&json["broker"].as_str().unwrap()));
        assert_eq!(n(json, &["twice", "duplicates", "broker"]), 0, "{json:#}");
    }
    // The inbox claim catches the redeliveries of completions lost after the commit; with
    // batches the first delivery of an order planned for that fault is often not the one
    // completed (a lock ran out while its batch waited), so the fault may not fire at all.
    if n(json, &["faults", "completions_lost"]) > 0 {
        assert!(n(json, &["twice", "duplicates", "inbox"]) > 0, "{json:#}");
    }
    assert!(n(json, &["twice", "duplicates", "business_key"]) > 0, "{json:#}");

    // Its OrderShipped events: one per valid order reached the loyalty service, none for
    // work that rolled back, none for a poison order; the relay that stopped after the
    // broker's acknowledgement had its rows sent again, and those copies were dropped.
    assert_eq!(n(json, &["twice", "events", "points"]), valid, "{json:#}");
    assert_eq!(n(json, &["twice", "events", "lost"]), 0);
    assert_eq!(n(json, &["twice", "events", "repeated"]), 0);
    assert_eq!(n(json, &["twice", "events", "for_unshipped_orders"]), 0);
    assert_eq!(n(json, &["twice", "events", "for_rolled_back_work"]), 0);
    assert!(n(json, &["twice", "events", "published"]) >= valid, "{json:#}");
    assert_eq!(n(json, &["faults", "relay_stopped_after_ack"]), 1, "{json:#}");

    // The naive handler met the same faults and repeated effects: the demo injected them.
    assert!(n(json, &["naive", "events", "for_rolled_back_work"]) > 0, "{json:#}");
    assert!(n(json, &["naive", "events", "repeated"]) > 0, "{json:#}");
    assert!(n(json, &["naive", "charges"]) > valid, "naive did not double-charge: {json:#}");
    assert!(n(json, &["naive", "emails"]) > valid, "naive did not repeat emails: {json:#}");
    assert!(n(json, &["naive", "shipments"]) > valid, "naive did not repeat shipments: {json:#}");
}

fn reachable(addr: &str) -> bool {
    let ok = std::net::TcpStream::connect(addr).is_ok();
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "{addr} is required (CI is set) but unreachable");
        eprintln!("skipping: {addr} is unreachable; set CI=1 to make this a failure");
    }
    ok
}

#[test]
fn demo_on_sqlite_keeps_every_invariant_and_naive_double_charges() {
    let (success, json) = run_demo(&[]);
    check(success, &json);
}

#[test]
fn demo_on_postgres_keeps_every_invariant_and_naive_double_charges() {
    if !reachable("127.0.0.1:5432") {
        return;
    }
    let (success, json) = run_demo(&["--store", POSTGRES_URL]);
    assert_eq!(json["store"], "postgres");
    check(success, &json);
}

#[test]
fn demo_with_batches_on_postgres_keeps_every_invariant() {
    if !reachable("127.0.0.1:5432") {
        return;
    }
    let (success, json) = run_demo(&["--store", POSTGRES_URL, "--batch", "16"]);
    check(success, &json);
}

#[test]
fn demo_on_mariadb_keeps_every_invariant_and_naive_double_charges() {
    if !reachable("127.0.0.1:3306") {
        return;
    }
    let (success, json) = run_demo(&["--store", MARIADB_URL]);
    assert_eq!(json["store"], "mysql");
    check(success, &json);
}

#[test]
fn demo_on_rabbitmq_keeps_every_invariant_and_naive_double_charges() {
    if !reachable("127.0.0.1:5672") {
        return;
    }
    let (success, json) = run_demo(&["--broker", "amqp://guest:guest@127.0.0.1:5672/%2f"]);
    assert_eq!(json["broker"], "rabbitmq");
    check(success, &json);
}

#[test]
fn demo_on_rabbitmq_quorum_queues_declared_by_hand_keeps_every_invariant() {
    if !reachable("127.0.0.1:5672") {
        return;
    }
    let prefix = twice_testkit::db::unique_name("hand");
    // Quorum queues as their owner declared them: a length limit, a delivery limit of their
    // own, no dead-letter target; the demo must use them as they are.
    let queues = ["naive", "twice"].map(|q| TestQueue::named(format!("{prefix}-{q}")));
    let rt = tokio::runtime::Runtime::new().unwrap();
    for q in &queues {
        rt.block_on(q.declare_by_hand(
            &[("x-queue-type", "quorum")],
            &[("x-max-length", 100_000), ("x-delivery-limit", 20)],
        ))
        .expect("declaring the queue by hand");
    }
    let (success, json) = run_demo(&[
        "--broker",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "--queues",
        prefix.as_str(),
    ]);
    assert_eq!(json["broker"], "rabbitmq");
    check(success, &json);
}

#[test]
fn demo_on_nats_keeps_every_invariant_and_naive_double_charges() {
    if !reachable("127.0.0.1:4222") {
        return;
    }
    let (success, json) = run_demo(&["--broker", "nats://127.0.0.1:4222"]);
    assert_eq!(json["broker"], "nats");
    check(success, &json);
}

#[test]
fn bad_arguments_give_one_clear_line_and_a_failure_status() {
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--crash-rate", "1.5"])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("1.5 is not between 0 and 1"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--store", "oracle://x"])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: unknown store"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--broker", "sb://localhost"])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown broker"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--broker", "Endpoint=sb://localhost"])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a usable Service Bus connection string"), "{stderr}");
}

#[test]
fn demo_on_twice_serve_in_process_keeps_every_invariant() {
    let (success, json) = run_demo_orders(200, &["--broker", "serve"]);
    assert_eq!(json["broker"], "serve");
    assert_eq!(json["broker_reports_duplicates"], Value::Bool(false));
    check_orders(200, success, &json);
}

/// The demo's four queues, as `twice serve --config` takes them.
const DEMO_QUEUES: &str = r#"{"UserConfig":{"Namespaces":[{"Name":"sbemulatorns","Queues":[
  {"Name":"orders-naive","Properties":{"LockDuration":"PT5S","MaxDeliveryCount":10,
    "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT10M"}},
  {"Name":"orders-twice","Properties":{"LockDuration":"PT5S","MaxDeliveryCount":10,
    "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT10M"}},
  {"Name":"shipped-naive","Properties":{"LockDuration":"PT5S","MaxDeliveryCount":10,
    "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT10M"}},
  {"Name":"shipped-twice","Properties":{"LockDuration":"PT5S","MaxDeliveryCount":10,
    "RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT10M"}}]}]}}"#;

/// `twice serve` as a child process on a free port with its own key; returns the process and
/// the connection string.
fn serve_child(dir: &std::path::Path, config: Option<&str>) -> (ServeProcess, String) {
    serve_child_http(dir, config, false)
}

/// [`serve_child`], with the HTTP port (and its administration API) on a free port when
/// `http` is set.
fn serve_child_http(
    dir: &std::path::Path,
    config: Option<&str>,
    http: bool,
) -> (ServeProcess, String) {
    let data = dir.join("data");
    let mut args = vec!["--sas-key", "demo=c2VjcmV0LWRlbW8ta2V5", "--data-dir"];
    args.push(data.to_str().unwrap());
    if !http {
        args.push("--no-http");
    }
    let path = dir.join("Config.json");
    if let Some(config) = config {
        std::fs::write(&path, config).unwrap();
        args.extend(["--config", path.to_str().unwrap()]);
    }
    let serve = ServeProcess::start(env!("CARGO_BIN_EXE_twice"), &args);
    let port = serve.amqp_addr().port();
    let cs = format!(
        "Endpoint=sb://localhost:{port};SharedAccessKeyName=demo;SharedAccessKey=c2VjcmV0LWRlbW8ta2V5;UseDevelopmentEmulator=true"
    );
    (serve, cs)
}

#[test]
fn demo_on_a_connection_string_to_twice_serve_keeps_every_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let (_serve, cs) = serve_child(dir.path(), Some(DEMO_QUEUES));
    let (success, json) = run_demo_orders(200, &["--broker", &cs]);
    assert_eq!(json["broker"], "servicebus");
    check_orders(200, success, &json);
}

#[test]
fn demo_on_a_namespace_without_its_queues_says_how_to_make_them() {
    let dir = tempfile::tempdir().unwrap();
    let (_serve, cs) = serve_child(dir.path(), None);
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--broker", &cs])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(r#"the queue "orders-naive" does not exist"#), "{stderr}");
    assert!(stderr.contains(r#""Name":"orders-twice""#), "{stderr}");
    assert!(stderr.contains(r#""Name":"shipped-twice""#), "{stderr}");
    assert!(stderr.contains("--config"), "{stderr}");
}

#[test]
fn demo_creates_its_queues_through_the_administration_api() {
    let dir = tempfile::tempdir().unwrap();
    let (serve, cs) = serve_child_http(dir.path(), None, true);
    let admin = serve.http_url();
    let (success, json) = run_demo_orders(100, &["--broker", &cs, "--admin-url", &admin]);
    assert_eq!(json["broker"], "servicebus");
    check_orders(100, success, &json);
    // The poison messages stay in the dead-letter queue, for `twice dlq` to look at.
    // `twice dlq` finds the administration API by the variable `twice serve` says to export.
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["dlq", "list", "--connection-string", &cs])
        .env("TWICE_ADMIN_URL", &admin)
        .output()
        .expect("running twice dlq");
    let listed = String::from_utf8_lossy(&out.stdout);
    let poison = n(&json, &["poison"]);
    let line = listed.lines().find(|l| l.starts_with("orders-twice")).expect("orders-twice listed");
    let counts: Vec<u64> = line.split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect();
    assert_eq!(counts.get(1), Some(&poison), "{listed}");
}

/// `--ca-file`: the demo over amqps against `twice serve --tls-cert` with a certificate of a
/// CA made here, creating its queues through the administration API over https; without the
/// CA it stops at once with a line that names the certificate and the option.
#[test]
fn demo_over_tls_trusts_the_ca_given_with_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let certs = twice_testkit::tls::TestCertificates::localhost();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    std::fs::write(path("cert.pem"), &certs.cert_pem).unwrap();
    std::fs::write(path("key.pem"), &certs.key_pem).unwrap();
    std::fs::write(path("ca.pem"), &certs.ca_pem).unwrap();
    let data = path("data");
    let serve = ServeProcess::start(
        env!("CARGO_BIN_EXE_twice"),
        &[
            "--sas-key",
            "demo=c2VjcmV0LWRlbW8ta2V5",
            "--data-dir",
            &data,
            "--tls-cert",
            &path("cert.pem"),
            "--tls-key",
            &path("key.pem"),
        ],
    );
    let port = serve.amqp_addr().port();
    let cs = format!(
        "Endpoint=sb://localhost:{port};SharedAccessKeyName=demo;SharedAccessKey=c2VjcmV0LWRlbW8ta2V5"
    );
    let http_port = serve.http_addr().rsplit(':').next().unwrap().to_owned();
    let admin = format!("https://localhost:{http_port}");
    let (success, json) = run_demo_orders(
        100,
        &["--broker", &cs, "--admin-url", &admin, "--ca-file", &path("ca.pem")],
    );
    assert_eq!(json["broker"], "servicebus");
    check_orders(100, success, &json);

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--broker", &cs, "--admin-url", &admin])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("certificate") && stderr.contains("--ca-file"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--ca-file", &path("ca.pem")])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--ca-file applies to a Service Bus connection string"), "{stderr}");
}

/// A connection string without `UseDevelopmentEmulator=true` asks for TLS; against a plain
/// `twice serve` the demo stops at once with the fix (the flag), not the advice for a
/// certificate.
#[test]
fn demo_against_a_plain_server_without_the_emulator_flag_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let serve = ServeProcess::start(
        env!("CARGO_BIN_EXE_twice"),
        &["--sas-key", "demo=c2VjcmV0LWRlbW8ta2V5", "--data-dir", data.to_str().unwrap()],
    );
    let port = serve.amqp_addr().port();
    let cs = format!(
        "Endpoint=sb://localhost:{port};SharedAccessKeyName=demo;SharedAccessKey=c2VjcmV0LWRlbW8ta2V5"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["demo", "--orders", "5", "--broker", &cs, "--admin-url", &serve.http_url()])
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("add UseDevelopmentEmulator=true;"), "{stderr}");
    assert!(!stderr.contains("--ca-file"), "{stderr}");
}
