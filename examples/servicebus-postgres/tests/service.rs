//! The example as a user runs it: `twice serve` with the example's `Config.json`, the service
//! as a child process on a fresh PostgreSQL database, orders sent by its `send` command.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use twice::SharedClock;
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};
use twice_testkit::db::{POSTGRES_URL, PgDatabase};
use twice_testkit::require_service;
use twice_testkit::serve::ServeProcess;

const SERVICE: &str = env!("CARGO_BIN_EXE_servicebus-postgres");
/// How long anything the test waits for may take before it fails.
const DEADLINE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_order_is_shipped_and_announced_once_and_sigterm_stops_the_service_cleanly() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("sb_example").await) else {
        return;
    };
    let database_url = format!("{}/{}", POSTGRES_URL.rsplit_once('/').expect("a URL").0, db.name());
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("Config.json");
    let Some(twice) = require_service("the twice binary", twice_binary()) else { return };
    let serve = ServeProcess::start(
        twice,
        &["--in-memory", "--config", config.to_str().expect("a UTF-8 path")],
    );
    let connection_string = serve.connection_string().expect("the default key's string").to_owned();
    let env = [
        ("SERVICEBUS_CONNECTION_STRING", connection_string.clone()),
        ("SERVICEBUS_ADMIN_URL", serve.http_url()),
        ("DATABASE_URL", database_url.clone()),
        ("HEALTH_ADDR", "127.0.0.1:0".to_owned()),
    ];

    let mut service = Service::start(&env);
    let health_line = service.line_starting("health: ");
    let health_addr =
        health_line.trim_start_matches("health: http://").trim_end_matches("/health").to_owned();

    // Orders 1, 2 and 3; then order 2 again, as a sender that retried would: the same id.
    send(&env, &["1", "2", "3"]);
    let again = send(&env, &["2"]);
    assert!(again.contains("order-2:OrderPlaced"), "{again}");

    let pool = sqlx::PgPool::connect(&database_url).await.expect("the test database");
    // Every order shipped and every event relayed (its outbox row deleted).
    let clock = SharedClock::system();
    let until = clock.now() + DEADLINE;
    loop {
        let shipped: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM shipments")
            .fetch_one(&pool)
            .await
            .expect("count shipments");
        let pending: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM twice_outbox")
            .fetch_one(&pool)
            .await
            .expect("count outbox rows");
        if shipped >= 3 && pending == 0 {
            break;
        }
        assert!(
            clock.now() < until,
            "after {DEADLINE:?}: {shipped} shipments, {pending} events unsent"
        );
        clock.sleep(Duration::from_millis(50)).await;
    }
    let orders: Vec<i64> = sqlx::query_scalar("SELECT order_id FROM shipments ORDER BY order_id")
        .fetch_all(&pool)
        .await
        .expect("read shipments");
    assert_eq!(orders, [1, 2, 3], "one shipment per order");

    // Every delivery handled: the counters
    // that `/health` shows.
    loop {
        let (status, report) = health(&health_addr);
        assert_eq!(status, "HTTP/1.1 200 OK", "the service is healthy: {report}");
        if report["completed"] == 3 && report["events_sent"] == 3 {
            break;
        }
        assert!(clock.now() < until, "after {DEADLINE:?}: {report}");
        clock.sleep(Duration::from_millis(50)).await;
    }

    let stopped = service.terminate();
    assert_eq!(
        stopped.status.code(),
        Some(0),
        "a clean exit on SIGTERM; it printed:\n{}",
        stopped.rest
    );
    assert!(
        stopped.rest.contains(
            "stopped: received 3, completed 3, duplicates 0 by the inbox and 0 by business key, \
             abandoned 0, dead-lettered 0, events sent 3"
        ),
        "the queue's duplicate detection dropped the re-sent order; it printed:\n{}",
        stopped.rest
    );

    // Nothing left unsettled on the broker: every order completed, nothing dead-lettered.
    let entities = serve_entities(&serve);
    let orders = entity(&entities, "orders");
    assert_eq!((orders["active"].as_u64(), orders["dead_letter"].as_u64()), (Some(0), Some(0)));

    // One OrderShipped event per order.
    let client = ServiceBusClient::from_connection_string(&connection_string).expect("client");
    let events = client.receiver("order-shipped", ReceiverOptions::new());
    let mut announced = Vec::new();
    while announced.len() < 3 {
        assert!(clock.now() < until, "events received: {announced:?}");
        for d in events.receive_messages(3, Duration::from_secs(1)).await.expect("receive") {
            let event: serde_json::Value =
                serde_json::from_slice(d.message().body()).expect("a JSON event");
            announced.push(event["order_id"].as_i64().expect("an order id"));
            events.complete_message(&d).await.expect("complete");
        }
    }
    announced.sort_unstable();
    assert_eq!(announced, [1, 2, 3], "one event per order");
    let entities = serve_entities(&serve);
    let shipped = entity(&entities, "order-shipped");
    assert_eq!(shipped["active"].as_u64(), Some(0), "no second event for any order");
    client.close().await;
}

/// Runs `servicebus-postgres send ORDERS…` and returns what it printed.
fn send(env: &[(&str, String)], orders: &[&str]) -> String {
    let out = Command::new(SERVICE)
        .arg("send")
        .args(orders)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run the sender");
    assert!(out.status.success(), "send failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `servicebus-postgres run` as a child process, its output read line by line.
struct Service {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

/// How the service ended, and what it printed after the lines the test waited for.
struct Stopped {
    status: ExitStatus,
    rest: String,
}

impl Service {
    fn start(env: &[(&str, String)]) -> Self {
        let mut child = Command::new(SERVICE)
            .arg("run")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the service");
        let stdout = child.stdout.take().expect("a piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { child, lines, seen: Vec::new() }
    }

    /// The first line that starts with `prefix`, waiting up to the deadline for it.
    fn line_starting(&mut self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(DEADLINE) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(line) => self.seen.push(line),
                Err(e) => panic!("no line `{prefix}…` ({e}); it printed {:?}", self.seen),
            }
        }
    }

    /// Sends SIGTERM, as a service manager stops a service, and waits for the exit.
    fn terminate(mut self) -> Stopped {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "sending SIGTERM");
        // A bound, so that a service that ignores the signal fails the test instead of hanging.
        let clock = SharedClock::system();
        let until = clock.now() + DEADLINE;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for the service") {
                break status;
            }
            assert!(clock.now() < until, "the service did not stop within {DEADLINE:?} of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let rest = self.lines.iter().collect::<Vec<_>>().join("\n");
        Stopped { status, rest }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // A test that failed half-way leaves no process behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `GET /health` of the service: the status line and the JSON body.
fn health(addr: &str) -> (String, serde_json::Value) {
    let response = http_get(addr, "/health");
    let status = response.lines().next().unwrap_or_default().to_owned();
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("/health: {e}: {response}"));
    (status, json)
}

/// The whole response to `GET path` on `addr`.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("write the request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("read the response");
    response
}

/// `twice serve`'s `/entities`: every entity with its counts.
fn serve_entities(serve: &ServeProcess) -> Vec<serde_json::Value> {
    let response = serve.get("/entities");
    assert_eq!(response.status, 200, "/entities: {response}");
    serde_json::from_str(&response.body).unwrap_or_else(|e| panic!("/entities: {e}: {response}"))
}

fn entity<'a>(entities: &'a [serde_json::Value], path: &str) -> &'a serde_json::Value {
    entities
        .iter()
        .find(|e| e["path"] == path)
        .unwrap_or_else(|| panic!("no entity {path} in {entities:?}"))
}

/// The `twice` binary that `cargo test --workspace` builds beside this test, or why there is
/// none to use: missing (this package tested alone), or older than a source it is built from.
fn twice_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/deps/service-<hash> → target/<profile>/twice
    let profile = exe.parent().and_then(Path::parent).ok_or("no target profile directory")?;
    let binary = profile.join("twice");
    let rebuild = "build it with `cargo build -p twice-cli`";
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}; {rebuild}", binary.display()))?;
    // Cargo's dep-info beside the binary lists every file it was built from.
    let dep_info = profile.join("twice.d");
    let sources = std::fs::read_to_string(&dep_info)
        .map_err(|e| format!("{}: {e}; {rebuild}", dep_info.display()))?;
    let (_, sources) = sources.split_once(": ").unwrap_or_default();
    for source in sources.split_whitespace() {
        let changed = std::fs::metadata(source).and_then(|m| m.modified());
        if changed.is_ok_and(|changed| changed > built) {
            return Err(format!("{} is older than {source}; {rebuild}", binary.display()));
        }
    }
    Ok(binary)
}
