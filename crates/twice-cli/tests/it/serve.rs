//! `twice serve` as a user runs it: start, health, clean stop on SIGTERM, restart on the same
//! data directory, clear errors on bad input.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use twice_servicebus::frame;
use twice_servicebus::performative::{Open, Performative, SaslInit};
use twice_testkit::serve::ServeProcess;

/// Starts `twice serve ARGS` on free ports and waits until it is ready.
fn start(args: &[&str]) -> ServeProcess {
    ServeProcess::start(env!("CARGO_BIN_EXE_twice"), args)
}

/// Starts it under a hard limit of `fds` open files, as a shell's `ulimit -n` sets.
fn start_with_descriptor_limit(fds: u32, args: &[&str]) -> ServeProcess {
    let mut command = Command::new("sh");
    command.args([
        "-c",
        &format!("ulimit -n {fds} && exec \"$0\" \"$@\""),
        env!("CARGO_BIN_EXE_twice"),
    ]);
    ServeProcess::start_command(command, args)
}

const CONFIG: &str = r#"{
  "UserConfig": {
    "Namespaces": [{
      "Name": "sbemulatorns",
      "Queues": [{ "Name": "orders", "Properties": { "LockDuration": "PT30S", "MaxDeliveryCount": 5 } }],
      "Topics": [{ "Name": "events", "Properties": {},
        "Subscriptions": [{ "Name": "billing", "Properties": {}, "Rules": [] }] }]
    }],
    "Logging": { "Type": "Console" }
  }
}"#;

#[test]
fn serve_prints_the_connection_string_serves_health_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let data = dir.path().join("data");
    let args = ["--config", config.to_str().unwrap(), "--data-dir", data.to_str().unwrap()];

    let serve = start(&args);
    let banner = serve.banner().join("\n");
    assert!(banner.contains("connection string: Endpoint=sb://localhost:"), "{banner}");
    assert!(
        banner.contains(
            "SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;"
        ),
        "{banner}"
    );
    let health = serve.get("/health");
    assert_eq!(health.status, 200, "{health}");
    let entities = serve.get("/entities").body;
    assert!(entities.contains("\"orders\""), "{entities}");
    assert!(entities.contains("events/Subscriptions/billing"), "{entities}");
    let status = serve.terminate().status;
    assert!(status.success(), "SIGTERM must stop twice serve cleanly: {status}");

    // The same directory and config start again.
    let serve = start(&args);
    assert!(serve.get("/entities").body.contains("\"orders\""));
    assert!(serve.terminate().status.success());
}

#[test]
fn serve_refuses_a_bad_config_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG.replace("\"PT30S\"", "\"PT0.1S\"")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["serve", "--in-memory", "--amqp", "127.0.0.1:0", "--no-http", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains("LockDuration"), "the error names the property: {stderr}");
    assert!(stderr.contains("Queues[0]"), "the error names the path: {stderr}");
}

#[test]
fn serve_refuses_a_second_process_on_the_same_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let first = start(&["--data-dir", &data, "--no-http"]);
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["serve", "--amqp", "127.0.0.1:0", "--no-http", "--data-dir", &data])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: "), "{stderr}");
    drop(first);
}

#[test]
fn serve_applies_its_limits_and_refuses_out_of_range_ones() {
    // Out of range: one clear line from the argument parser, nothing started.
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["serve", "--in-memory", "--no-http", "--max-frame-size", "100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains("--max-frame-size"), "the error names the option: {stderr}");

    // One connection at most: a second is told why, in AMQP, instead of being reset.
    let serve = start(&["--in-memory", "--no-http", "--max-connections", "1"]);
    let amqp = serve.amqp_addr().to_string();
    let mut hello = frame::SASL_HEADER.to_vec();
    let init = SaslInit { mechanism: "ANONYMOUS".into(), initial_response: None, hostname: None };
    frame::write_frame(&mut hello, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
    hello.extend_from_slice(&frame::AMQP_HEADER);
    let open = Open { container_id: "second".into(), ..Open::default() };
    frame::write_frame(&mut hello, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    // A connection counts once it has sent `open`: the first is served before the second
    // arrives.
    let mut first = TcpStream::connect(&amqp).unwrap();
    first.write_all(&hello).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut second = TcpStream::connect(&amqp).unwrap();
    second.write_all(&hello).unwrap();
    // Read what comes within a few seconds (heartbeats would keep a plain read going).
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = twice::clock::Stopwatch::start();
    second.set_read_timeout(Some(std::time::Duration::from_millis(200))).unwrap();
    while deadline.elapsed() < std::time::Duration::from_secs(5) {
        match second.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.contains("amqp:resource-limit-exceeded")
            && answer.contains("the server serves at most 1 connections"),
        "the second connection is closed for the connection limit: {answer:?}"
    );
    drop(first);
    assert!(serve.terminate().status.success());
}

/// The HTTP port's limits are flags: out of range they are refused by name; a body over
/// `--http-max-body` gets 413 before it is sent, while one within it is read.
#[test]
fn serve_applies_its_http_limits() {
    for (flag, value) in [
        ("--http-max-body", "0"),
        ("--http-max-answering", "0"),
        ("--http-max-receiving", "0"),
        ("--http-timeout", "0"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_twice"))
            .args(["serve", "--in-memory", flag, value])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: ") && stderr.contains(flag), "{flag}: {stderr}");
    }
    let serve = start(&["--in-memory", "--no-dev-https", "--http-max-body", "2048"]);
    let ask = |length: usize| {
        let mut s = TcpStream::connect(serve.http_addr()).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let head = format!(
            "PUT /orders?api-version=2021-05 HTTP/1.1\r\nHost: localhost\r\n\
             Content-Length: {length}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(head.as_bytes()).unwrap();
        if length <= 2048 {
            s.write_all(&vec![b'x'; length]).unwrap();
        }
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    };
    let over = ask(4096);
    assert!(over.contains(" 413 ") && over.contains("at most 2048 bytes"), "{over}");
    let within = ask(1500);
    assert!(!within.contains(" 413 ") && within.starts_with("HTTP/1.1 "), "{within}");
    assert!(serve.terminate().status.success());
}

#[test]
fn serve_prints_no_key_but_the_emulators_default() {
    let serve = start(&["--in-memory", "--no-http", "--sas-key", "mine=s3cr3t-k3y"]);
    let banner = serve.banner().join("\n");
    assert!(banner.contains("SharedAccessKeyName=mine"), "{banner}");
    let err = serve.terminate().stderr;
    assert!(!banner.contains("s3cr3t-k3y") && !err.contains("s3cr3t-k3y"), "{banner}\n{err}");
    // The emulator's well-known key is no secret: its connection string works as printed.
    let default = start(&["--in-memory", "--no-http"]);
    assert!(default.banner().join("\n").contains("SharedAccessKey=SAS_KEY_VALUE"));
}

#[test]
fn serve_warns_when_the_default_key_is_reachable_beyond_loopback() {
    let serve = start(&["--in-memory", "--no-http", "--amqp", "0.0.0.0:0"]);
    let err = serve.terminate().stderr;
    assert!(err.contains("warning") && err.contains("well-known key"), "{err}");
    // On loopback there is nothing to warn about.
    let local = start(&["--in-memory", "--no-http"]);
    assert!(!local.terminate().stderr.contains("well-known key"));
}

#[test]
fn serve_in_memory_does_not_claim_anything_is_on_disk() {
    let serve = start(&["--in-memory", "--no-http"]);
    let banner = serve.banner().join("\n");
    let stopped = serve.terminate();
    assert!(stopped.status.success());
    let rest = stopped.stdout;
    assert!(rest.contains("stopped"), "{rest}");
    let all = format!("{banner}\n{rest}\n{}", stopped.stderr);
    assert!(!all.contains("on disk"), "{all}");
}

#[test]
fn serve_keeps_its_connections_within_the_descriptor_limit() {
    let serve = start_with_descriptor_limit(200, &["--in-memory", "--no-http"]);
    let line =
        serve.banner().iter().find(|l| l.starts_with("connections: at most")).expect("limits line");
    let numbers: Vec<u64> =
        line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    let (connections, pending) = (numbers[0], numbers[1]);
    assert!(connections + pending < 200, "{line}");
    assert!(connections >= 1 && pending >= 1, "{line}");
}

/// `--tls-cert/--tls-key`: amqps with a certificate made here; a client that trusts its CA
/// sends and receives, the printed connection string asks for TLS, and the HTTP port is https.
#[test]
fn serve_speaks_amqps_with_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certs = twice_testkit::tls::TestCertificates::localhost();
    let (cert_path, key_path, config) =
        (dir.path().join("cert.pem"), dir.path().join("key.pem"), dir.path().join("Config.json"));
    std::fs::write(&cert_path, &certs.cert_pem).unwrap();
    std::fs::write(&key_path, &certs.key_pem).unwrap();
    std::fs::write(&config, CONFIG).unwrap();
    let serve = start(&[
        "--in-memory",
        "--no-http",
        "--config",
        config.to_str().unwrap(),
        "--tls-cert",
        cert_path.to_str().unwrap(),
        "--tls-key",
        key_path.to_str().unwrap(),
    ]);
    let cs = serve.connection_string().expect("connection string").to_owned();
    assert!(!cs.contains("UseDevelopmentEmulator"), "{cs}");
    assert!(serve.banner().iter().any(|l| l.contains("amqps")), "{:?}", serve.banner());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let tls =
            twice_servicebus_client::TlsOptions::with_ca_pem(certs.ca_pem.as_bytes()).unwrap();
        let options = twice_servicebus_client::ClientOptions::from_connection_string(&cs)
            .unwrap()
            .tls(Some(tls));
        let client = twice_servicebus_client::ServiceBusClient::new(options);
        client.sender("orders").send_message(twice::Message::new("over tls")).await.unwrap();
        let receiver = client.receiver("orders", twice_servicebus_client::ReceiverOptions::new());
        let d = receiver
            .receive_messages(1, std::time::Duration::from_secs(10))
            .await
            .unwrap()
            .pop()
            .expect("a message");
        assert_eq!(&d.message().body()[..], b"over tls");
        receiver.complete_message(&d).await.unwrap();
    });
    // With a key of the user's own (not printed), the connection string asks for TLS too.
    let own = start(&[
        "--in-memory",
        "--http",
        "127.0.0.1:0",
        "--sas-key",
        "mine=b3duLWtleQ==",
        "--tls-cert",
        cert_path.to_str().unwrap(),
        "--tls-key",
        key_path.to_str().unwrap(),
    ]);
    let cs = own.connection_string().expect("connection string");
    assert!(cs.contains("SharedAccessKeyName=mine"), "{cs}");
    assert!(!cs.contains("UseDevelopmentEmulator"), "{cs}");
    // The HTTP port speaks https with the same certificate, and the banner says so.
    let console = own.banner().iter().find(|l| l.starts_with("web console: ")).cloned();
    let console = console.unwrap_or_else(|| panic!("{:?}", own.banner()));
    assert!(console.starts_with("web console: https://127.0.0.1:"), "{console}");
}

#[test]
fn serve_refuses_a_tls_key_that_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, "not a certificate").unwrap();
    std::fs::write(&key, "not a key").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["serve", "--in-memory", "--no-http", "--amqp", "127.0.0.1:0"])
        .args(["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TLS certificate"), "{err}");
}

/// Whether the server at `addr` answers the SASL protocol header with its own (a connection
/// it accepted and serves).
fn answers_protocol_header(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else { return false };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    if s.write_all(&frame::SASL_HEADER).is_err() {
        return false;
    }
    let mut header = [0u8; 8];
    s.read_exact(&mut header).is_ok() && header == frame::SASL_HEADER
}

/// Out of descriptors (here: idle clients of the HTTP port hold them all), accepting AMQP
/// connections fails; the server backs off with one warning, not one per attempt, and serves
/// again as soon as descriptors are free.
#[test]
fn serve_backs_off_quietly_when_descriptors_run_out_and_serves_again() {
    let mut serve = start_with_descriptor_limit(64, &["--in-memory"]);
    let amqp = serve.amqp_addr().to_string();
    let http = serve.http_addr();
    assert!(answers_protocol_header(&amqp), "served before the descriptors run out");
    // Idle HTTP clients: each holds one of the server's descriptors until its request times
    // out, and the HTTP port serves 64 at once, as many as the process may open in all. The
    // kernel completes more connections than the server can accept.
    let idle: Vec<TcpStream> = (0..160).filter_map(|_| TcpStream::connect(&http).ok()).collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Connections to the AMQP port wait in the backlog while every accept fails.
    let waiting: Vec<TcpStream> = (0..5).filter_map(|_| TcpStream::connect(&amqp).ok()).collect();
    let mut answer = [0u8; 8];
    let mut first = waiting.first().expect("a connection in the backlog").try_clone().unwrap();
    first.set_read_timeout(Some(std::time::Duration::from_millis(1500))).unwrap();
    first.write_all(&frame::SASL_HEADER).unwrap();
    assert!(first.read_exact(&mut answer).is_err(), "no connection is served without a descriptor");
    // Everything is let go (the connections in the backlog too: at this limit the server has
    // room for one handshake at a time).
    drop((first, waiting, idle));
    let deadline = twice::clock::Stopwatch::start();
    while !answers_protocol_header(&amqp) {
        assert!(
            deadline.elapsed() < std::time::Duration::from_secs(10),
            "the server serves again once descriptors are free"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(serve.is_running(), "still running");
    let err = serve.terminate().stderr;
    let failed = err.matches("accept failed").count();
    assert_eq!(failed, 1, "one warning for the whole episode, not one per attempt:\n{err}");
    assert_eq!(err.matches("accepting connections again").count(), 1, "{err}");
}

/// `twice health` for a container's healthcheck: exit status 0 while `twice serve` serves,
/// found by the `TWICE_ADMIN_URL` its banner says to export; 1 with one line when nothing
/// answers.
#[test]
fn health_exits_zero_while_serve_serves_and_one_with_a_line_when_nothing_answers() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let serve = start(&["--data-dir", data.to_str().unwrap()]);
    let banner = serve.banner().join("\n");
    let export = format!("administration API: export TWICE_ADMIN_URL={}", serve.http_url());
    assert!(banner.contains(&export), "{banner}");
    let health = |envs: &[(&str, &str)], args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_twice"))
            .arg("health")
            .args(args)
            .env_remove("TWICE_ADMIN_URL")
            .envs(envs.iter().copied())
            .output()
            .expect("running twice health")
    };
    let out = health(&[("TWICE_ADMIN_URL", &serve.http_url())], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim(), format!("healthy: {}/health", serve.http_url()));
    let out = health(&[], &["--url", &serve.http_url(), "--quiet"]);
    assert!(out.status.success());
    assert!(out.stdout.is_empty());

    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let out = health(&[("TWICE_ADMIN_URL", &format!("http://{closed}"))], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("unhealthy: cannot reach the administration API"), "{stderr}");
    assert!(stderr.contains("give --url or set TWICE_ADMIN_URL"), "{stderr}");
    let out = health(&[], &["--url", "ftp://x"]);
    assert_eq!(out.status.code(), Some(2), "a bad URL is a usage error");
}

/// `twice reset` empties every entity of a running `twice serve` (messages, dead letters,
/// remembered ids) and keeps the entities; a wrong key or an unreachable server is one line
/// naming the fix, with exit status 1.
#[test]
fn reset_empties_every_entity_of_a_running_server() {
    use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let serve = start(&["--in-memory", "--config", config.to_str().unwrap()]);
    let cs = serve.connection_string().expect("connection string").to_owned();
    let url = format!("http://{}", serve.http_addr());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = ServiceBusClient::from_connection_string(&cs).unwrap();
    rt.block_on(async {
        for i in 0..5 {
            let m = twice::Message::new(format!("m{i}")).with_message_id(format!("id-{i}"));
            client.sender("orders").send_message(m).await.unwrap();
        }
        client.sender("events").send_message(twice::Message::new("e")).await.unwrap();
    });
    let entities = serve.get("/entities").body;
    assert!(entities.contains(r#""active":5"#), "{entities}");

    let reset = || {
        Command::new(env!("CARGO_BIN_EXE_twice"))
            .arg("reset")
            .env("TWICE_ADMIN_URL", &url)
            .output()
            .unwrap()
    };
    let out = reset();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("reset 3 entities at "), "{stdout}");
    let entities = serve.get("/entities").body;
    assert!(
        !entities.contains(r#""active":5"#) && !entities.contains(r#""active":1"#),
        "{entities}"
    );
    for path in ["\"orders\"", "\"events\"", "events/Subscriptions/billing"] {
        assert!(entities.contains(path), "the entities stay: {entities}");
    }
    // Open clients keep working, and ids sent before the reset are new again.
    rt.block_on(async {
        let m = twice::Message::new("again").with_message_id("id-0");
        client.sender("orders").send_message(m).await.unwrap();
        let receiver = client.receiver("orders", ReceiverOptions::new());
        let got = receiver.receive_messages(10, std::time::Duration::from_secs(10)).await.unwrap();
        let bodies: Vec<_> = got.iter().map(|d| d.message().body().to_vec()).collect();
        assert_eq!(bodies, vec![b"again".to_vec()]);
    });

    let wrong = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(["reset", "--url", &url, "--sas-key", "RootManageSharedAccessKey=wrong"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert_eq!(wrong.status.code(), Some(1), "{err}");
    assert!(err.contains("refused the key") && err.lines().count() == 1, "{err}");
    drop(serve);
    let gone = reset();
    let err = String::from_utf8_lossy(&gone.stderr);
    assert_eq!(gone.status.code(), Some(1), "{err}");
    assert!(err.contains("give --url or set TWICE_ADMIN_URL") && err.lines().count() == 1, "{err}");
}

/// Runs `twice ARGS` to its end; returns its exit status and stderr.
fn run_twice(args: &[&str]) -> (std::process::ExitStatus, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).trim().to_owned())
}

#[test]
fn a_port_in_use_names_its_flag_with_the_cause_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();

    let (status, stderr) = run_twice(&["serve", "--in-memory", "--no-http", "--amqp", &addr]);
    assert!(!status.success());
    assert_eq!(
        stderr,
        format!(
            "error: --amqp {addr} is in use (Address already in use); choose another port with --amqp"
        )
    );

    let (status, stderr) =
        run_twice(&["serve", "--in-memory", "--amqp", "127.0.0.1:0", "--http", &addr]);
    assert!(!status.success());
    assert_eq!(
        stderr,
        format!(
            "error: --http {addr} is in use (Address already in use); choose another port with --http"
        )
    );
}

/// A broker whose log cannot be written (here a file-size limit, `ulimit -f`, makes every
/// write past it fail as a full disk does) tells the clients why: a send and a new attach get
/// `amqp:resource-limit-exceeded` with the reason (the SDKs' quota error), never "not found";
/// `/health` and the administration API answer 503 with it.
#[test]
fn a_storage_failure_is_told_to_clients_as_a_quota_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("Config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let data = dir.path().join("data");
    let mut command = Command::new("sh");
    // Writes past the limit fail with EFBIG instead of killing the process (SIGXFSZ ignored).
    command.args([
        "-c",
        "trap '' XFSZ && ulimit -f 1024 && exec \"$0\" \"$@\"",
        env!("CARGO_BIN_EXE_twice"),
    ]);
    let serve = ServeProcess::start_command(
        command,
        &["--config", config.to_str().unwrap(), "--data-dir", data.to_str().unwrap()],
    );
    let cs = serve.connection_string().expect("connection string").to_owned();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client =
            twice_servicebus_client::ServiceBusClient::from_connection_string(&cs).unwrap();
        let sender = client.sender("orders");
        let body = "x".repeat(200 * 1024);
        let mut failure = None;
        // The limit (at most 1 MiB) is reached within a few 200 KiB messages.
        for _ in 0..40 {
            if let Err(e) = sender.send_message(twice::Message::new(body.clone())).await {
                failure = Some(e);
                break;
            }
        }
        let e = failure.expect("a send fails once the log cannot grow");
        assert_eq!(e.condition(), Some("amqp:resource-limit-exceeded"), "{e}");
        assert!(e.to_string().contains("storage failed"), "{e}");
        assert!(!e.is_not_found(), "{e}");
        // The broker takes nothing more: the next send on the same link is told the same.
        let e = sender.send_message(twice::Message::new("z")).await.unwrap_err();
        assert_eq!(e.condition(), Some("amqp:resource-limit-exceeded"), "{e}");
        assert!(e.to_string().contains("storage failed"), "{e}");
        // A new link to the same queue is not told that the queue is missing.
        let again = twice_servicebus_client::ServiceBusClient::from_connection_string(&cs).unwrap();
        let e = again.sender("orders").send_message(twice::Message::new("y")).await.unwrap_err();
        assert_eq!(e.condition(), Some("amqp:resource-limit-exceeded"), "{e}");
        assert!(e.to_string().contains("storage failed"), "{e}");
    });
    let health = serve.get("/health");
    assert_eq!(health.status, 503, "{health}");
    assert!(health.body.contains("storage failed"), "{health}");
    let expiry = twice::Clock::now(&twice::SystemClock).as_millis() / 1000 + 600;
    let token = twice_servicebus::sas::sign(
        "http://localhost/",
        "RootManageSharedAccessKey",
        "SAS_KEY_VALUE",
        expiry,
    );
    let mut s = TcpStream::connect(serve.http_addr()).unwrap();
    write!(
        s,
        "GET /orders HTTP/1.1\r\nHost: localhost\r\nAuthorization: {token}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut admin = String::new();
    s.read_to_string(&mut admin).unwrap();
    assert!(admin.starts_with("HTTP/1.1 503"), "{admin}");
    assert!(admin.contains("storage failed"), "{admin}");
}
