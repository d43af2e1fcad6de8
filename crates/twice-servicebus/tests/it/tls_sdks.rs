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
    assert!(out.text.contains("3 passed"), "{}", out.text);
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
    assert!(out.text.contains("# pass 2") && out.text.contains("# fail 0"), "{}", out.text);
}
