//! The shared HTTP client against real sockets: servers written here byte by byte (so the
//! client is checked against what a server really sends, not against hyper's own server), and
//! a rustls server with a certificate made in the test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use twice_servicebus_client::TlsOptions;
use twice_servicebus_client::http::{self, Connection, HttpError, Method, Request, Target};
use twice_testkit::tls::TestCertificates;

const WAIT: Duration = Duration::from_secs(10);

/// Reads one request's head (and a `Content-Length` body) from `stream`; empty at the end of
/// the stream.
async fn read_request(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => buf.push(byte[0]),
            _ => return String::from_utf8_lossy(&buf).into_owned(),
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let length = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(str::to_owned))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.expect("the request body");
    head + &String::from_utf8_lossy(&body)
}

/// A server that answers each request on one connection with the next of `answers`, then
/// closes it; the task returns the requests it read.
async fn server(answers: Vec<&'static [u8]>) -> (SocketAddr, JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut requests = Vec::new();
        for answer in answers {
            requests.push(read_request(&mut stream).await);
            stream.write_all(answer).await.expect("write the answer");
        }
        let _ = stream.shutdown().await;
        requests
    });
    (addr, task)
}

fn plain(addr: SocketAddr) -> Target {
    Target::http(addr.ip().to_string(), addr.port())
}

#[tokio::test]
async fn answers_are_read_whole_by_their_length_or_their_chunks() {
    let (addr, requests) =
        server(vec![b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\nX-Kind: length\r\n\r\nabc"])
            .await;
    let request = Request::new(Method::PUT, "/orders?api-version=2021-05")
        .header("Authorization", "SharedAccessSignature sr=x")
        .body("application/atom+xml", "<entry/>");
    let answer = http::request(&plain(addr), request).await.expect("an answer");
    assert_eq!(answer.status().as_u16(), 201);
    assert_eq!(answer.text(), "abc");
    assert_eq!(answer.headers()["x-kind"], "length");
    let sent = requests.await.expect("the server").remove(0);
    assert!(sent.starts_with("PUT /orders?api-version=2021-05 HTTP/1.1\r\n"), "{sent}");
    let lower = sent.to_ascii_lowercase();
    for line in [
        format!("host: {addr}\r\n"),
        "authorization: sharedaccesssignature sr=x\r\n".to_owned(),
        "content-type: application/atom+xml\r\n".to_owned(),
        "content-length: 8\r\n".to_owned(),
        "connection: close\r\n".to_owned(),
    ] {
        assert!(lower.contains(&line), "{line:?} in {sent}");
    }
    assert!(sent.ends_with("\r\n\r\n<entry/>"), "{sent}");

    let (addr, _) = server(vec![
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    ])
    .await;
    let answer = http::get(&plain(addr), "/x", WAIT).await.expect("an answer");
    assert_eq!((answer.status().as_u16(), answer.text().as_str()), (404, "abcde"));
}

#[tokio::test]
async fn a_connection_kept_open_carries_one_request_after_another() {
    let (addr, requests) = server(vec![
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst",
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond",
    ])
    .await;
    let mut connection = Connection::open(&plain(addr), WAIT).await.expect("connect");
    let first = connection.send(&Request::get("/1")).await.expect("the first answer");
    assert_eq!(first.text(), "first");
    assert!(connection.is_open());
    let second = connection.send(&Request::get("/2")).await.expect("the second answer");
    assert_eq!(second.text(), "second");
    let sent = requests.await.expect("the server");
    assert_eq!(sent.len(), 2, "both on the one connection the server accepted");
    assert!(!sent[0].to_ascii_lowercase().contains("connection: close"), "{}", sent[0]);
    // The server closed it after its last answer: the connection says so, and takes no
    // third request.
    tokio::time::timeout(WAIT, async {
        while connection.is_open() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the connection is seen closed");
    let third = connection.send(&Request::get("/3")).await;
    assert!(matches!(third, Err(HttpError::Protocol { .. })), "{third:?}");
}

#[tokio::test]
async fn a_refused_connection_a_silent_server_and_a_large_body_are_told_apart() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let e = http::get(&plain(addr), "/", WAIT).await.expect_err("nothing listens");
    assert!(e.is_connection_refused(), "{e}");
    assert!(e.to_string().starts_with(&format!("cannot connect to {addr}: ")), "{e}");

    // Accepts, and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = silent.local_addr().expect("addr");
    let e = http::get(&plain(addr), "/", Duration::from_millis(300)).await.expect_err("silent");
    assert!(e.is_timeout(), "{e}");
    assert!(matches!(e, HttpError::Timeout { after, .. } if after == Duration::from_millis(300)));
    drop(silent);

    let (addr, _) = server(vec![b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789"]).await;
    let e = http::request(&plain(addr), Request::get("/").max_body(9)).await.expect_err("large");
    assert!(matches!(e, HttpError::TooLarge { limit: 9, .. }), "{e}");
    let (addr, _) = server(vec![
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n01234\r\n5\r\n56789\r\n0\r\n\r\n",
    ])
    .await;
    let e = http::request(&plain(addr), Request::get("/").max_body(9)).await.expect_err("large");
    assert!(matches!(e, HttpError::TooLarge { limit: 9, .. }), "chunks count too: {e}");

    let (addr, _) = server(vec![b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]).await;
    let e = http::get(&plain(addr), "/", WAIT).await.expect_err("not HTTP");
    assert!(matches!(e, HttpError::Protocol { .. }), "{e}");

    let e = http::request(&plain(addr), Request::get("/").header("Idempotency-Key", "a\r\nb"))
        .await
        .expect_err("a line break in a header");
    assert!(matches!(e, HttpError::Request(_)), "{e}");
}

/// A rustls server with `certs`' certificate for `localhost`, answering one request per
/// connection with `200 ok`.
async fn tls_server(certs: &TestCertificates) -> SocketAddr {
    use rustls_pki_types::pem::PemObject as _;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(certs.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("the certificate");
    let key = PrivateKeyDer::from_pem_slice(certs.key_pem.as_bytes()).expect("the key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("a server configuration");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake: nothing to answer.
                let Ok(mut tls) = acceptor.accept(stream).await else { return };
                let mut buf = [0u8; 4096];
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await;
                let _ = tls.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn https_trusts_only_its_roots_and_a_plain_server_is_not_tls() {
    let certs = TestCertificates::localhost();
    let addr = tls_server(&certs).await;
    let ca = TlsOptions::with_ca_pem(certs.ca_pem.as_bytes()).expect("the CA");
    let trusted = Target::https("localhost", addr.port(), ca.root_store());
    let answer = http::get(&trusted, "/", WAIT).await.expect("an answer over https");
    assert_eq!((answer.status().as_u16(), answer.text().as_str()), (200, "ok"));

    let public = Target::https("localhost", addr.port(), TlsOptions::webpki_roots().root_store());
    let e = http::get(&public, "/", WAIT).await.expect_err("the test CA is not a public root");
    assert!(matches!(e, HttpError::Untrusted { .. }), "{e}");
    assert!(e.to_string().contains("certificate"), "{e}");

    // A plain HTTP server answers the client hello, which is no request line, with a plain
    // 400; another closes the connection without a word.
    for answer in [&b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"[..], b""] {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 512];
            let _ = stream.read(&mut buf).await;
            let _ = stream.write_all(answer).await;
            let _ = stream.shutdown().await;
        });
        let e = http::get(&Target::https("localhost", port, ca.root_store()), "/", WAIT)
            .await
            .expect_err("a plain server");
        assert!(matches!(e, HttpError::NotTls { .. }), "{answer:?}: {e}");
    }
}
