//! The official SDKs' credential constructors (a named key, a SAS signature), which always use
//! TLS, against the server with a certificate made here; each SDK trusts the test CA the way it
//! documents (Python: `connection_verify`; Node: `NODE_EXTRA_CA_CERTS`).

use std::time::Duration;

use twice_servicebus::ServerOptions;
use twice_testkit::tls::TestCertificates;

use crate::harness::{TestServer, crate_dir, may_skip, node_env, python_env, run_suite};

/// A TLS server whose certificate for `localhost` is signed by a fresh CA, and that CA's PEM
/// in a file.
async fn tls_server() -> (TestServer, tempfile::NamedTempFile) {
    let certs = TestCertificates::localhost();
    let options =
        ServerOptions::new().tls_pem(certs.cert_pem.as_bytes(), certs.key_pem.as_bytes()).unwrap();
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca_file.path(), &certs.ca_pem).unwrap();
    (TestServer::start_with(options, None).await, ca_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_credentials_connect_over_tls() {
    let python = match tokio::task::spawn_blocking(python_env).await.unwrap() {
        Ok(p) => p,
        Err(e) => {
            may_skip(&format!("cannot set up the Python SDK: {e}"));
            return;
        }
    };
    let (server, ca) = tls_server().await;
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "--timeout=120"])
        .arg(crate_dir().join("tests/python/tls"))
        .env("SB_TLS_CA", ca.path());
    let out = run_suite(cmd, &server, Duration::from_secs(180)).await;
    println!("{}", out.text);
    assert!(out.success, "pytest failed:\n{}", out.text);
    assert!(out.text.contains("4 passed"), "{}", out.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk_credentials_connect_over_tls() {
    let dir = match tokio::task::spawn_blocking(|| node_env(&["tls.test.mjs"])).await.unwrap() {
        Ok(d) => d,
        Err(e) => {
            may_skip(&format!("cannot set up the JavaScript SDK: {e}"));
            return;
        }
    };
    // The test file is beside a link to `node_modules`, so its imports resolve.
    let test_file = dir.path().join("tls.test.mjs");
    let (server, ca) = tls_server().await;
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg("--test")
        .arg("--test-concurrency=1")
        .arg(&test_file)
        .current_dir(dir.path())
        .env("NODE_EXTRA_CA_CERTS", ca.path());
    let out = run_suite(cmd, &server, Duration::from_secs(180)).await;
    println!("{}", out.text);
    assert!(out.success, "node --test failed:\n{}", out.text);
    assert!(out.text.contains("# pass 3") && out.text.contains("# fail 0"), "{}", out.text);
}

/// Sends `request` over TLS to `addr`, trusting the PEM CA `ca`; returns the whole response.
async fn https(addr: std::net::SocketAddr, ca: &str, request: &str) -> std::io::Result<String> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls =
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp).await?;
    tls.write_all(request.as_bytes()).await?;
    let mut out = Vec::new();
    tls.read_to_end(&mut out).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// With a certificate, the HTTP port (health, metrics, the console and the administration API,
/// which carries SAS tokens) speaks https with it too; a plain request gets a plain answer
/// that says so, and the port goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_port_speaks_https_with_the_servers_certificate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let certs = TestCertificates::localhost();
    let options =
        ServerOptions::new().tls_pem(certs.cert_pem.as_bytes(), certs.key_pem.as_bytes()).unwrap();
    let server = TestServer::start_with(options, None).await;
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n");
    let health = https(server.http, &certs.ca_pem, &get("/health")).await.unwrap();
    assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
    assert!(health.ends_with(r#"{"status":"healthy"}"#), "{health}");
    let console = https(server.http, &certs.ca_pem, &get("/")).await.unwrap();
    assert!(console.starts_with("HTTP/1.1 200 OK\r\n") && console.contains("<html"), "{console}");
    // The administration API over https refuses a request without a token, as over http.
    let feed = https(server.http, &certs.ca_pem, &get("/$Resources/queues")).await.unwrap();
    assert!(feed.starts_with("HTTP/1.1 401"), "{feed}");

    let mut plain = tokio::net::TcpStream::connect(server.http).await.unwrap();
    plain.write_all(get("/health").as_bytes()).await.unwrap();
    let mut answer = String::new();
    plain.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{answer}");
    assert!(answer.contains("https://"), "{answer}");
    assert!(!answer.contains("healthy"), "{answer}");

    // A client that does not trust the certificate gets no answer at all.
    let other = TestCertificates::localhost();
    assert!(https(server.http, &other.ca_pem, &get("/health")).await.is_err());
    let again = https(server.http, &certs.ca_pem, &get("/health")).await.unwrap();
    assert!(again.starts_with("HTTP/1.1 200 OK\r\n"), "{again}");
    server.stop().await;
}
