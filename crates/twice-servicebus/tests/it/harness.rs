//! Test harness: a server on a free port with a manual clock, the SDK environments (made once
//! per machine by `twice_testkit::sdk`), and child processes that run the SDK suites.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use twice::{Clock, ManualClock, SharedClock, SystemClock};
use twice_broker::config::Config;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::dev_tls::DevCertificate;
use twice_servicebus::{Server, ServerOptions};
use twice_testkit::sdk::{SdkError, Sdks};

/// The entities every SDK suite may use, in the official emulator's `Config.json` form.
pub fn standard_config() -> Config {
    let mut queues: Vec<String> = (1..=23)
        .map(|i| {
            format!(
                r#"{{"Name":"q{i}","Properties":{{"LockDuration":"PT1M","MaxDeliveryCount":10}}}}"#
            )
        })
        .collect();
    queues.extend((1..=8).map(|i| {
        format!(
            r#"{{"Name":"sessq{i}","Properties":{{"RequiresSession":true,"LockDuration":"PT1M"}}}}"#
        )
    }));
    queues.extend(["dupq", "dupq2"].map(|name| {
        format!(
            r#"{{"Name":"{name}","Properties":{{"RequiresDuplicateDetection":true,"DuplicateDetectionHistoryTimeWindow":"PT1M"}}}}"#
        )
    }));
    queues.push(r#"{"Name":"quotaq","Properties":{"MaxSizeInMegabytes":1}}"#.to_owned());
    queues.push(r#"{"Name":"ttlq","Properties":{"DefaultMessageTimeToLive":"PT10M"}}"#.to_owned());
    queues.push(r#"{"Name":"rawq","Properties":{}}"#.to_owned());
    let json = format!(
        r#"{{"UserConfig":{{"Namespaces":[{{"Name":"sbemulatorns","Queues":[{}],"Topics":[{{"Name":"topic1","Subscriptions":[{{"Name":"sub1"}},{{"Name":"sub2"}}]}},{{"Name":"topic2","Subscriptions":[{{"Name":"all"}},{{"Name":"filtered"}}]}},{{"Name":"topic3","Subscriptions":[{{"Name":"sql"}}]}}]}}],"Logging":{{"Type":"Console"}}}}}}"#,
        queues.join(",")
    );
    Config::from_json(&json).expect("test config")
}

/// A running server; stops when dropped.
pub struct TestServer {
    pub addr: SocketAddr,
    pub http: SocketAddr,
    pub control: SocketAddr,
    pub connection_string: String,
    pub broker: Broker,
    /// The CA of the HTTP port's development certificate (https beside http), when the server
    /// has no certificate of its own; [`run_suite`] has the SDKs trust it.
    pub dev_ca: Option<PathBuf>,
    _dev_dir: Option<tempfile::TempDir>,
    /// The clock the broker and the server read; tests move it.
    pub clock: ManualClock,
    task: Option<tokio::task::JoinHandle<Result<(), twice_servicebus::ServerError>>>,
    stop: Option<oneshot::Sender<()>>,
    stop_control: Option<oneshot::Sender<()>>,
}

impl TestServer {
    /// Starts a server on an in-memory broker with the standard entities.
    pub async fn start() -> Self {
        Self::start_with(ServerOptions::new(), None).await
    }

    /// Starts a server with these options on a broker (durable in `dir` when given).
    pub async fn start_with(options: ServerOptions, dir: Option<&Path>) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
        // The manual clock starts at the real time so the SDKs' tokens are current.
        let clock = ManualClock::new(SystemClock.now());
        let shared = SharedClock::from(clock.clone());
        let broker_options = match dir {
            Some(d) => BrokerOptions::durable(d),
            None => BrokerOptions::in_memory(),
        };
        let broker = Broker::open(broker_options.clock(shared.clone()).config(standard_config()))
            .await
            .expect("open broker");
        // As `twice serve` does: https beside http on the HTTP port with a development
        // certificate, unless the server has a certificate of its own.
        let (options, dev_ca, dev_dir) = if options.is_tls() {
            (options, None, None)
        } else {
            let dir = tempfile::tempdir().expect("temporary directory");
            let names = ["localhost", "127.0.0.1", "::1"].map(str::to_owned);
            let cert = DevCertificate::load_or_create(dir.path(), &names).expect("dev certificate");
            let options = options.http_tls_pem(&cert.cert_pem, &cert.key_pem).expect("dev tls");
            (options, Some(cert.ca_file), Some(dir))
        };
        let options = options
            .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
            .http_addr(Some(SocketAddr::from(([127, 0, 0, 1], 0))))
            .clock(shared);
        let server = Server::bind(options, broker.clone()).await.expect("bind");
        let addr = server.amqp_addr();
        let http = server.http_addr().expect("http port");
        let connection_string = server.connection_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = stopped.await;
        }));
        let (control, stop_control) = control_port(clock.clone()).await;
        Self {
            addr,
            http,
            control,
            connection_string,
            broker,
            dev_ca,
            _dev_dir: dev_dir,
            clock,
            task: Some(task),
            stop: Some(stop),
            stop_control: Some(stop_control),
        }
    }

    /// Stops the server and shuts the broker down (its data stays in its directory).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.broker.shutdown().await;
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(s) = self.stop_control.take() {
            let _ = s.send(());
        }
    }
}

/// A tiny HTTP port through which an SDK test moves the server's clock:
/// `GET /advance?ms=N`.
async fn control_port(clock: ManualClock) -> (SocketAddr, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind control");
    let addr = listener.local_addr().expect("addr");
    let (tx, mut rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = &mut rx => return,
            };
            let Ok((mut s, _)) = accepted else { continue };
            let clock = clock.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 2048];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]);
                let ms = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|p| p.split("ms=").nth(1))
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or(0);
                if ms >= 0 {
                    clock.advance(Duration::from_millis(ms.unsigned_abs()));
                } else {
                    clock.set(clock.now() - Duration::from_millis(ms.unsigned_abs()));
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    (addr, tx)
}

pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether a missing tool may skip a test (only outside CI).
pub fn may_skip(reason: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("{reason} (CI is set, so this fails instead of skipping)");
    }
    eprintln!("skipping: {reason}");
    true
}

/// The Python interpreter of a venv with the pinned SDK, made once per machine.
pub fn python_env() -> Result<PathBuf, SdkError> {
    Sdks::machine().python(&crate_dir().join("tests/python/requirements.txt"))
}

/// A fresh directory, removed on drop, where Node finds the pinned JS SDK (made once per
/// machine) and the test scripts `files` of `tests/js/` are copied.
pub fn node_env(files: &[&str]) -> Result<tempfile::TempDir, SdkError> {
    let env = Sdks::machine().node(&crate_dir().join("tests/js/package.json"))?;
    let work = Sdks::node_workdir(&env)?;
    for file in files {
        std::fs::copy(crate_dir().join("tests/js").join(file), work.path().join(file))
            .map_err(|e| SdkError::Io { what: format!("copying {file}"), source: e })?;
    }
    Ok(work)
}

/// The result of a child process.
pub struct Output {
    pub success: bool,
    pub text: String,
}

/// Runs a command with the server's coordinates in its environment; kills it after `limit`.
pub async fn run_suite(
    mut cmd: tokio::process::Command,
    server: &TestServer,
    limit: Duration,
) -> Output {
    cmd.env("SB_CONNECTION_STRING", &server.connection_string)
        .env("SB_PORT", server.addr.port().to_string())
        .env("SB_HTTP", format!("http://{}", server.http))
        .env("SB_CLOCK", format!("http://{}", server.control))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(ca) = &server.dev_ca {
        // What `twice serve` prints for the SDKs' administration clients (https only).
        cmd.env("REQUESTS_CA_BUNDLE", ca).env("NODE_EXTRA_CA_CERTS", ca);
    }
    let child = cmd.spawn().expect("spawn suite");
    // A second guard that needs no runtime: a thread that kills the child a little after the
    // limit, in case the runtime that drives the timeout below is stuck.
    let (done, finished) = std::sync::mpsc::channel::<()>();
    if let Some(pid) = child.id() {
        let grace = limit + Duration::from_secs(15);
        std::thread::spawn(move || {
            if finished.recv_timeout(grace) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                eprintln!("suite still running {grace:?} after its start: killing pid {pid}");
                let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        });
    }
    let result = tokio::time::timeout(limit, child.wait_with_output()).await;
    drop(done);
    match result {
        Ok(Ok(out)) => Output {
            success: out.status.success(),
            text: format!(
                "{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        },
        Ok(Err(e)) => Output { success: false, text: e.to_string() },
        Err(_) => Output { success: false, text: format!("suite did not finish within {limit:?}") },
    }
}

/// A TCP proxy to `target` that delays what flows back to the client by `delay` per read, as a
/// network would; returns its port. It serves until the runtime stops.
pub async fn latency_proxy(target: SocketAddr, delay: Duration) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else { return };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    let _ = sw.shutdown().await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    tokio::time::sleep(delay).await;
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = cw.shutdown().await;
                up.abort();
            });
        }
    });
    port
}
