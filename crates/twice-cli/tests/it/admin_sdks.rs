//! The SDKs' administration clients against `twice serve` with nothing but configuration: the
//! connection string with the HTTP port, and the CA file the banner prints in the variable it
//! names. No transport, policy or verification override in the client code.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use twice_testkit::sdk::Sdks;
use twice_testkit::serve::ServeProcess;

fn start(args: &[&str]) -> ServeProcess {
    ServeProcess::start(env!("CARGO_BIN_EXE_twice"), args)
}

/// Fails in CI, skips with the reason elsewhere.
fn skip(reason: &str) {
    assert!(std::env::var_os("CI").is_none(), "{reason} (CI is set, so this fails)");
    eprintln!("skipping: {reason}");
}

fn sdk_tests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../twice-servicebus/tests")
}

fn admin_connection_string(serve: &ServeProcess) -> String {
    let port = serve.http_addr().rsplit_once(':').map(|(_, p)| p.to_owned()).unwrap();
    format!(
        "Endpoint=sb://localhost:{port};SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;"
    )
}

const PYTHON: &str = r#"
import os
from azure.servicebus.management import ServiceBusAdministrationClient
with ServiceBusAdministrationClient.from_connection_string(os.environ["CS"], retry_total=0) as a:
    a.create_queue("made-by-python")
    print("queues:", sorted(q.name for q in a.list_queues()))
"#;

const NODE: &str = r#"
import { ServiceBusAdministrationClient } from "@azure/service-bus";
const a = new ServiceBusAdministrationClient(process.env.CS, { retryOptions: { maxRetries: 0 } });
await a.createQueue("made-by-node");
const names = [];
for await (const q of a.listQueues()) names.push(q.name);
console.log("queues:", names.sort().join(","));
"#;

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn the_sdks_administration_clients_work_with_the_printed_ca_alone() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let serve = start(&["--data-dir", data.to_str().unwrap()]);
    let ca = serve.dev_ca().unwrap_or_else(|| panic!("no CA line: {:?}", serve.banner()));
    assert!(ca.is_absolute() && ca.starts_with(&data) && ca.is_file(), "{}", ca.display());
    let node_line = serve.banner().iter().any(|l| l.contains("NODE_EXTRA_CA_CERTS="));
    assert!(node_line, "{:?}", serve.banner());
    let cs = admin_connection_string(&serve);
    // Plain http keeps working on the same port, for browsers and `twice` commands.
    assert_eq!(serve.get("/health").status, 200);

    match Sdks::machine().python(&sdk_tests().join("python/requirements.txt")) {
        Err(e) => skip(&format!("cannot set up the Python SDK: {e}")),
        Ok(python) => {
            let out = Command::new(python)
                .args(["-c", PYTHON])
                .env("CS", &cs)
                .env("REQUESTS_CA_BUNDLE", &ca)
                .output()
                .unwrap();
            let t = text(&out);
            assert!(out.status.success(), "{t}");
            assert!(t.contains("made-by-python"), "{t}");
        }
    }
    match Sdks::machine().node(&sdk_tests().join("js/package.json")) {
        Err(e) => skip(&format!("cannot set up the JavaScript SDK: {e}")),
        Ok(env) => {
            let work = Sdks::node_workdir(&env).unwrap();
            let script = work.path().join("admin.mjs");
            std::fs::File::create(&script).unwrap().write_all(NODE.as_bytes()).unwrap();
            let out = Command::new("node")
                .arg(&script)
                .current_dir(work.path())
                .env("CS", &cs)
                .env("NODE_EXTRA_CA_CERTS", &ca)
                .output()
                .unwrap();
            let t = text(&out);
            assert!(out.status.success(), "{t}");
            assert!(t.contains("made-by-node") && t.contains("made-by-python"), "{t}");
        }
    }

    // A restart keeps the certificate: a CA trusted once stays trusted.
    let before = std::fs::read(&ca).unwrap();
    assert!(serve.terminate().status.success());
    let again = start(&["--data-dir", data.to_str().unwrap()]);
    assert_eq!(again.dev_ca().as_deref(), Some(ca.as_path()));
    assert_eq!(std::fs::read(&ca).unwrap(), before);
}

/// Sends a TLS record's first bytes (what every TLS client sends first) to `addr`, then reads
/// until the server closes.
fn tls_hello(addr: &str) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 1, 0, 0, 1, 0]).unwrap();
    let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
}

#[test]
fn a_tls_client_on_a_plain_port_is_one_clear_line_in_the_log() {
    let serve = start(&["--in-memory", "--no-dev-https"]);
    assert!(serve.dev_ca().is_none(), "{:?}", serve.banner());
    let http = serve.http_addr();
    let amqp = serve.amqp_addr().to_string();
    for _ in 0..3 {
        tls_hello(&http);
        tls_hello(&amqp);
    }
    let stopped = serve.terminate();
    let err = stopped.stderr;
    let https = err.matches("an https client reached").count();
    assert_eq!(https, 1, "once, however often it retries:\n{err}");
    assert!(err.contains("--tls-cert"), "{err}");
    let amqps = err.matches("an amqps (TLS) client reached the plain AMQP port").count();
    assert_eq!(amqps, 1, "{err}");
    assert!(err.contains("UseDevelopmentEmulator=true"), "{err}");
}

/// The reverse: with a certificate (`--tls-cert`), a plain HTTP client on the HTTP port and a
/// plain AMQP client on the amqps port are each one log line, however often they retry.
#[test]
fn a_plain_client_on_a_tls_port_is_one_clear_line_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let certs = twice_testkit::tls::TestCertificates::localhost();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, &certs.cert_pem).unwrap();
    std::fs::write(&key, &certs.key_pem).unwrap();
    let serve = start(&[
        "--in-memory",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let http = serve.http_addr();
    let amqp = serve.amqp_addr().to_string();
    for _ in 0..3 {
        let mut s = std::net::TcpStream::connect(&http).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut s, &mut answer);
        assert!(answer.contains("this port speaks https"), "{answer}");
        let mut s = std::net::TcpStream::connect(&amqp).unwrap();
        s.write_all(b"AMQP\x03\x01\x00\x00").unwrap();
        let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
    }
    let err = serve.terminate().stderr;
    let http_line = err.matches("a plain http client reached").count();
    assert_eq!(http_line, 1, "once, however often it retries:\n{err}");
    let amqp_line = err.matches("a plain AMQP client reached the amqps (TLS) port").count();
    assert_eq!(amqp_line, 1, "{err}");
    assert!(err.contains("remove UseDevelopmentEmulator=true"), "{err}");
}
