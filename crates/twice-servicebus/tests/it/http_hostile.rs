//! The HTTP port under hostile clients: DNS rebinding (a foreign `Host`), malformed framing,
//! and idle sockets that must not lock out `/health`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use twice_servicebus::ServerOptions;

use crate::harness::TestServer;

/// Sends one raw request and returns the response's status line and body.
async fn raw(server: &TestServer, request: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(server.http).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.lines().next().unwrap_or("").to_owned();
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

fn token(server: &TestServer) -> String {
    let expiry = twice::Clock::now(&server.clock).as_millis() / 1000 + 3600;
    let resource = format!("https://localhost:{}", server.http.port());
    twice_servicebus::sas::sign(&resource, "RootManageSharedAccessKey", "SAS_KEY_VALUE", expiry)
}

/// A web page whose own name was rebound to this address sends its name as `Host` (with a
/// matching `Origin`, and a token signed with the emulator's well-known key): it reaches no
/// route but `/health`, and deletes nothing.
#[tokio::test]
async fn a_foreign_host_reaches_nothing_but_health() {
    let server = TestServer::start_with(ServerOptions::new().allow_host("box.lan"), None).await;
    let port = server.http.port();
    let auth = token(&server);
    let foreign = format!("rebind.attacker.example:{port}");
    let request = |method: &str, path: &str, host: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\nAuthorization: {auth}\r\ncontent-length: 0\r\n\r\n"
        )
    };
    for (method, path) in [
        ("DELETE", "/q2"),
        ("GET", "/$Resources/queues"),
        ("GET", "/entities"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/api/entities"),
        ("POST", "/$reset"),
    ] {
        let (status, body) = raw(&server, &request(method, path, &foreign)).await;
        assert_eq!(status, "HTTP/1.1 421 Misdirected Request", "{method} {path}: {body}");
        assert!(body.contains("--allow-host"), "{body}");
    }
    let (status, _) = raw(&server, &request("GET", "/health", &foreign)).await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    // The queue is still there; the names the server serves reach it.
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "LOCALHOST.".to_owned(),
        "box.lan".to_owned(),
    ] {
        let (status, body) = raw(&server, &request("GET", "/q2", &host)).await;
        assert_eq!(status, "HTTP/1.1 200 OK", "{host}: {body}");
    }
    // A name that merely contains an allowed one is foreign.
    for host in ["localhost.attacker.example", "127.0.0.1.nip.io", "x@localhost:1"] {
        let (status, _) = raw(&server, &request("GET", "/entities", host)).await;
        assert_eq!(status, "HTTP/1.1 421 Misdirected Request", "{host}");
    }
}

/// RFC 9112: conflicting or malformed `Content-Length` is a 400, before anything is done.
#[tokio::test]
async fn malformed_framing_is_refused_with_400() {
    let server = TestServer::start().await;
    let auth = token(&server);
    // A queue description the server would create the queue from, were it framed well.
    let body = concat!(
        r#"<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml">"#,
        r#"<QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect">"#,
        "</QueueDescription></content></entry>"
    );
    let n = body.len();
    for framing in [
        format!("content-length: 0\r\ncontent-length: {n}"),
        format!("content-length: {n}, {}", n + 1),
        format!("content-length: +{n}"),
        format!("content-length : {n}"),
        format!("content-length: 0x{n:x}"),
        "content-length:".to_owned(),
        format!(" content-length: {n}"),
        format!("x-folded: a\r\n b\r\ncontent-length: {n}"),
    ] {
        let req = format!(
            "PUT /framed HTTP/1.1\r\nhost: localhost\r\nauthorization: {auth}\r\n{framing}\r\n\r\n{body}"
        );
        let (status, text) = raw(&server, &req).await;
        assert_eq!(status, "HTTP/1.1 400 Bad Request", "{framing:?}: {text}");
        assert!(text.contains("content-length") || text.contains("header"), "{framing:?}: {text}");
    }
    // Well framed, the same request creates the queue; the same length twice is one length.
    let req = format!(
        "PUT /framed2 HTTP/1.1\r\nhost: localhost\r\nauthorization: {auth}\r\ncontent-length: {n}\r\ncontent-length: {n}\r\n\r\n{body}"
    );
    assert_eq!(raw(&server, &req).await.0, "HTTP/1.1 201 Created");
    let req =
        "GET /health HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\ncontent-length: 0\r\n\r\n";
    assert_eq!(raw(&server, req).await.0, "HTTP/1.1 200 OK");
    let req = format!("GET /framed HTTP/1.1\r\nhost: localhost\r\nauthorization: {auth}\r\n\r\n");
    assert_eq!(raw(&server, &req).await.0, "HTTP/1.1 404 Not Found", "nothing was created");
}

/// 300 connections that send nothing (more than the 256 kept while they send their request)
/// do not keep `/health` from answering: each new connection evicts the oldest silent one.
#[tokio::test]
async fn idle_connections_do_not_lock_out_health() {
    let server = TestServer::start().await;
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::net::TcpStream::connect(server.http).await.unwrap());
    }
    let mut probe = tokio::net::TcpStream::connect(server.http).await.unwrap();
    probe.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    // Far less than the 10 s an idle connection may take to send its request.
    tokio::time::timeout(Duration::from_secs(5), probe.read_to_end(&mut out))
        .await
        .expect("/health answered while 300 idle connections are open")
        .unwrap();
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200 OK"));
    drop(idle);
}
