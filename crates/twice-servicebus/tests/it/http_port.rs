//! The HTTP port's limits as options, its stages (receiving, queued, answering) and the
//! answers it gives to requests it refuses before routing them.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Server, ServerError, ServerOptions};

use crate::harness::TestServer;

/// Far more than any answer here takes, far less than the 10 s default limits.
const PATIENCE: Duration = Duration::from_secs(5);

/// Reads until the server closes, within [`PATIENCE`]; the text read.
async fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut out))
        .await
        .expect("the server closed the connection in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `request` on a new connection and reads the whole answer.
async fn exchange(http: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(http).await.unwrap();
    s.write_all(request).await.unwrap();
    read_all(&mut s).await
}

fn status_line(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n";

/// A server with plain http only on its HTTP port (no development certificate beside it).
struct PlainServer {
    http: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl PlainServer {
    async fn start(options: ServerOptions) -> Self {
        let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
        let options = options
            .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
            .http_addr(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
        let server = Server::bind(options, broker).await.unwrap();
        let http = server.http_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(server.run(async move {
            let _ = stopped.await;
        }));
        Self { http, stop: Some(stop) }
    }
}

impl Drop for PlainServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[tokio::test]
async fn http_limits_of_zero_are_refused_naming_the_option() {
    let refused: [(ServerOptions, &str); 5] = [
        (ServerOptions::new().max_http_answering(0), "max_http_answering"),
        (ServerOptions::new().max_http_receiving(0), "max_http_receiving"),
        (ServerOptions::new().max_http_body(0), "max_http_body"),
        (ServerOptions::new().http_receive_timeout(Duration::ZERO), "http_receive_timeout"),
        (ServerOptions::new().http_answer_timeout(Duration::ZERO), "http_answer_timeout"),
    ];
    for (options, name) in refused {
        let broker = Broker::open(BrokerOptions::in_memory()).await.unwrap();
        let options = options
            .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
            .http_addr(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
        let err = Server::bind(options, broker).await.expect_err(name);
        assert!(matches!(err, ServerError::InvalidOptions(_)), "{name}: {err:?}");
        assert!(err.to_string().contains(name), "{err}");
    }
    let defaults = ServerOptions::new();
    assert_eq!(defaults.get_max_http_answering(), 64);
    assert_eq!(defaults.get_max_http_receiving(), 256);
    assert_eq!(defaults.get_max_http_body(), 1024 * 1024);
    assert_eq!(defaults.get_http_receive_timeout(), Duration::from_secs(10));
    assert_eq!(defaults.get_http_answer_timeout(), Duration::from_secs(10));
}

/// A body longer than the configured cap is refused from its `Content-Length`, before a byte
/// of it is sent; one at the cap is read and reaches the administration API.
#[tokio::test]
async fn a_body_over_the_configured_cap_gets_413_before_it_is_sent() {
    let server = TestServer::start_with(ServerOptions::new().max_http_body(64), None).await;
    let head = |n: usize| {
        format!("PUT /capped HTTP/1.1\r\nhost: localhost\r\ncontent-length: {n}\r\n\r\n")
    };
    let answer = exchange(server.http, head(65).as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 413 Payload Too Large", "{answer}");
    assert_eq!(body(&answer), "a request body is at most 64 bytes\n");
    let at_cap = format!("{}{}", head(64), "x".repeat(64));
    let answer = exchange(server.http, at_cap.as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 401 Unauthorized", "read and routed: {answer}");
}

/// With one answering slot: a connection still sending its body holds none (others are
/// answered meanwhile), an answered request gives its slot back, and the slow one is answered
/// once its body is in.
#[tokio::test]
async fn only_a_received_request_takes_an_answering_slot() {
    let server = TestServer::start_with(ServerOptions::new().max_http_answering(1), None).await;
    let mut slow = TcpStream::connect(server.http).await.unwrap();
    let head = "PUT /slowq HTTP/1.1\r\nhost: localhost\r\ncontent-length: 10\r\n\r\n";
    slow.write_all(format!("{head}<entr").as_bytes()).await.unwrap();
    for _ in 0..3 {
        let answer = exchange(server.http, HEALTH).await;
        assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
    }
    slow.write_all(b"y/>\r\n").await.unwrap();
    let answer = read_all(&mut slow).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 401 Unauthorized", "{answer}");
}

/// A client that has not sent its whole request within the configured time is dropped
/// without an answer.
#[tokio::test]
async fn a_request_not_in_within_the_receive_timeout_is_dropped() {
    let options = ServerOptions::new().http_receive_timeout(Duration::from_millis(200));
    let server = TestServer::start_with(options, None).await;
    for partial in [&b""[..], b"GET /health HTTP/1.1\r\nhost: local"] {
        let mut s = TcpStream::connect(server.http).await.unwrap();
        s.write_all(partial).await.unwrap();
        assert_eq!(read_all(&mut s).await, "", "{partial:?}");
    }
    assert_eq!(status_line(&exchange(server.http, HEALTH).await), "HTTP/1.1 200 OK");
}

/// Past the configured number of connections still receiving, a new one evicts the oldest.
#[tokio::test]
async fn the_oldest_receiving_connection_is_evicted_past_the_configured_number() {
    let server = TestServer::start_with(ServerOptions::new().max_http_receiving(2), None).await;
    let mut first = TcpStream::connect(server.http).await.unwrap();
    let mut second = TcpStream::connect(server.http).await.unwrap();
    let _third = TcpStream::connect(server.http).await.unwrap();
    assert_eq!(read_all(&mut first).await, "", "the oldest is closed");
    let mut byte = [0u8; 1];
    let open = tokio::time::timeout(Duration::ZERO, second.read(&mut byte)).await;
    assert!(open.is_err(), "the second still waits: {open:?}");
    assert_eq!(status_line(&exchange(server.http, HEALTH).await), "HTTP/1.1 200 OK");
    assert_eq!(read_all(&mut second).await, "", "evicted by the request just answered");
}

/// One request per connection: the answer says `connection: close` and the connection closes,
/// even when the client asks to keep it and sends a second request.
#[tokio::test]
async fn each_connection_answers_one_request_and_closes() {
    let server = TestServer::start().await;
    let keep = b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: keep-alive\r\n\r\n";
    let answer = exchange(server.http, &[&keep[..], HEALTH].concat()).await;
    assert_eq!(answer.matches("HTTP/1.1 200 OK").count(), 1, "{answer}");
    assert!(answer.to_ascii_lowercase().contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(answer.contains("\r\ncontent-type: application/json\r\n"), "{answer}");
}

/// A client that shuts down its sending side once its request is out still gets the answer.
#[tokio::test]
async fn a_client_that_half_closes_after_its_request_is_answered() {
    let server = TestServer::start().await;
    let mut s = TcpStream::connect(server.http).await.unwrap();
    s.write_all(b"GET /entities HTTP/1.1\r\nhost: localhost\r\n\r\n").await.unwrap();
    s.shutdown().await.unwrap();
    let answer = read_all(&mut s).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert!(body(&answer).contains("\"q1\""), "{answer}");
}

/// Framing the port does not take: a transfer coding (411, also beside a `Content-Length`),
/// and a head over 16 KiB (431); each answer says why, and nothing is created.
#[tokio::test]
async fn transfer_codings_get_411_and_oversized_heads_431() {
    let server = TestServer::start().await;
    let chunked =
        "PUT /chunkq HTTP/1.1\r\nhost: localhost\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
    let smuggled = "PUT /chunkq HTTP/1.1\r\nhost: localhost\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
    for request in [chunked, smuggled] {
        let answer = exchange(server.http, request.as_bytes()).await;
        assert_eq!(status_line(&answer), "HTTP/1.1 411 Length Required", "{answer}");
        assert_eq!(body(&answer), "send a content-length\n");
    }
    let big = format!(
        "GET /health HTTP/1.1\r\nhost: localhost\r\nx-big: {}\r\n\r\n",
        "a".repeat(17 * 1024)
    );
    let answer = exchange(server.http, big.as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 431 Request Header Fields Too Large", "{answer}");
    assert!(body(&answer).contains("too large"), "{answer}");
    let get = "GET /chunkq HTTP/1.1\r\nhost: localhost\r\n\r\n";
    let answer = exchange(server.http, get.as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 401 Unauthorized", "{answer}");
}

/// A TLS client on a port that serves plain http only gets a plain answer that says so (its
/// TLS library names it "not TLS"; a person reading the bytes sees why).
#[tokio::test]
async fn a_tls_hello_on_a_plain_port_is_answered_in_plain_text() {
    let server = PlainServer::start(ServerOptions::new()).await;
    let hello = [0x16, 0x03, 0x01, 0x00, 0x05, 1, 0, 0, 1, 0];
    let answer = exchange(server.http, &hello).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 400 Bad Request", "{answer}");
    assert_eq!(body(&answer), "this port speaks plain http, not https\n");
    assert_eq!(status_line(&exchange(server.http, HEALTH).await), "HTTP/1.1 200 OK");
}

/// The `Host` check holds for names beyond ASCII, and for the name in an absolute-form
/// target, which RFC 9112 puts before `Host`.
#[tokio::test]
async fn foreign_hosts_beyond_ascii_or_in_the_target_get_421() {
    let server = TestServer::start().await;
    let requests = [
        "GET /entities HTTP/1.1\r\nhost: rebind.exämple\r\n\r\n".to_owned(),
        "GET http://rebind.example/entities HTTP/1.1\r\nhost: localhost\r\n\r\n".to_owned(),
    ];
    for request in requests {
        let answer = exchange(server.http, request.as_bytes()).await;
        assert_eq!(status_line(&answer), "HTTP/1.1 421 Misdirected Request", "{answer}");
    }
    let port = server.http.port();
    let ours = format!("GET http://localhost:{port}/entities HTTP/1.1\r\nhost: x\r\n\r\n");
    let answer = exchange(server.http, ours.as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
}
