//! The administration API (ATOM over HTTP) with the SDKs' `ServiceBusAdministrationClient`:
//! Python (`tests/python/admin`) and JavaScript (`tests/js/admin.test.mjs`), and raw HTTP for
//! the limits.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{TestServer, crate_dir, may_skip, node_env, python_env, run_suite};

fn pytest(python: &std::path::Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "--timeout=120"]);
    cmd
}

async fn python_or_skip() -> Option<std::path::PathBuf> {
    match tokio::task::spawn_blocking(python_env).await.unwrap() {
        Ok(p) => Some(p),
        Err(e) => {
            may_skip(&format!("cannot set up the Python SDK: {e}"));
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_admin_client_suite() {
    let Some(python) = python_or_skip().await else { return };
    let server = TestServer::start().await;
    let mut cmd = pytest(&python);
    cmd.arg("--ignore")
        .arg(crate_dir().join("tests/python/admin/restart"))
        .arg(crate_dir().join("tests/python/admin"));
    let out = run_suite(cmd, &server, Duration::from_secs(300)).await;
    println!("{}", out.text);
    assert!(out.success, "pytest failed:\n{}", out.text);
    assert!(out.text.contains(" passed"), "pytest ran no test:\n{}", out.text);
    assert!(!out.text.contains(" failed"), "{}", out.text);
}

/// Entities created through the API are in the durable log: a restarted broker has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_admin_entities_survive_a_restart() {
    let Some(python) = python_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    for phase in ["create", "check"] {
        let server =
            TestServer::start_with(twice_servicebus::ServerOptions::new(), Some(dir.path())).await;
        let mut cmd = pytest(&python);
        cmd.arg(crate_dir().join("tests/python/admin/restart")).env("SB_PHASE", phase);
        let out = run_suite(cmd, &server, Duration::from_secs(120)).await;
        assert!(out.success, "{phase} phase failed:\n{}", out.text);
        assert!(out.text.contains("1 passed"), "{}", out.text);
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_admin_client_suite() {
    let dir = match tokio::task::spawn_blocking(|| node_env(&["admin.test.mjs"])).await.unwrap() {
        Ok(d) => d,
        Err(e) => {
            may_skip(&format!("cannot set up the JavaScript SDK: {e}"));
            return;
        }
    };
    // The test file is beside a link to `node_modules`, so its imports resolve.
    let test_file = dir.path().join("admin.test.mjs");
    let server = TestServer::start().await;
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg("--test").arg("--test-concurrency=1").arg(&test_file).current_dir(dir.path());
    let out = run_suite(cmd, &server, Duration::from_secs(300)).await;
    println!("{}", out.text);
    assert!(out.success, "node --test failed:\n{}", out.text);
    assert!(out.text.contains("# fail 0"), "{}", out.text);
    assert!(!out.text.contains("# pass 0"), "node ran no test:\n{}", out.text);
}

/// Sends one raw request and returns the response's status line and body.
async fn raw(server: &TestServer, request: &[u8]) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(server.http).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.lines().next().unwrap_or("").to_owned();
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

fn token(server: &TestServer, key: &str) -> String {
    let expiry = twice::Clock::now(&server.clock).as_millis() / 1000 + 3600;
    let resource = format!("https://localhost:{}", server.http.port());
    twice_servicebus::sas::sign(&resource, "RootManageSharedAccessKey", key, expiry)
}

#[tokio::test]
async fn admin_requests_need_a_valid_token_and_health_stays_open() {
    let server = TestServer::start().await;
    let (status, _) = raw(&server, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let (status, body) = raw(&server, b"GET /q1 HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.1 401 Unauthorized");
    assert!(body.contains("<Code>401</Code>"), "{body}");
    let bad = token(&server, "WRONG");
    let req = format!("GET /q1 HTTP/1.1\r\nauthorization: {bad}\r\n\r\n");
    let (status, body) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 401 Unauthorized", "{body}");
    assert!(body.contains("signature does not match"), "{body}");
    let good = token(&server, "SAS_KEY_VALUE");
    let req = format!("GET /q1 HTTP/1.1\r\nauthorization: {good}\r\n\r\n");
    let (status, body) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(body.contains("<QueueDescription"), "{body}");
    // The server's clock decides expiry: two hours on, the token is void.
    server.clock.advance(Duration::from_secs(7200));
    let (status, body) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 401 Unauthorized", "{body}");
    assert!(body.contains("expired"), "{body}");
}

#[tokio::test]
async fn bad_bodies_get_400_and_large_ones_413() {
    let server = TestServer::start().await;
    let good = token(&server, "SAS_KEY_VALUE");
    let body = "<entry><content><QueueDescription>";
    let req = format!(
        "PUT /newq HTTP/1.1\r\nauthorization: {good}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, text) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 400 Bad Request", "{text}");
    assert!(text.contains("not well-formed") || text.contains("ends inside"), "{text}");
    let req = format!(
        "PUT /newq HTTP/1.1\r\nauthorization: {good}\r\ncontent-length: {}\r\n\r\n",
        2 * 1024 * 1024
    );
    let (status, _) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 413 Payload Too Large");
    // Nothing was created by either.
    let req = format!("GET /newq HTTP/1.1\r\nauthorization: {good}\r\n\r\n");
    let (status, _) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
}

/// A body within the size limit but with tens of thousands of attributes or elements is
/// refused before its parse costs more than its size: a 400 that names the limit.
#[tokio::test]
async fn bodies_with_too_many_attributes_or_elements_get_400_naming_the_limit() {
    let server = TestServer::start().await;
    let good = token(&server, "SAS_KEY_VALUE");
    let attrs: String = (0..50_000).map(|i| format!(" a{i}=''")).collect();
    let many_attrs = format!("<entry><content><QueueDescription{attrs}/></content></entry>");
    let many_elements = format!("<entry>{}</entry>", "<a/>".repeat(200_000));
    for (body, limit) in
        [(many_attrs, "more than 64 attributes"), (many_elements, "more than 4096 elements")]
    {
        assert!(body.len() < 1024 * 1024);
        let req = format!(
            "PUT /newq HTTP/1.1\r\nauthorization: {good}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, text) = raw(&server, req.as_bytes()).await;
        assert_eq!(status, "HTTP/1.1 400 Bad Request", "{text}");
        assert!(text.contains(limit), "{text}");
    }
    let req = format!("GET /newq HTTP/1.1\r\nauthorization: {good}\r\n\r\n");
    let (status, _) = raw(&server, req.as_bytes()).await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
}
