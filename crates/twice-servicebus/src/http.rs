//! The HTTP side port: its listener, and the bodies it serves (health, Prometheus text, the
//! entity list, the web console of [`crate::console`], and the administration API of
//! [`crate::admin`]).
//!
//! A server with a certificate speaks https on this port, with the certificate of amqps: the
//! administration API and the console carry SAS tokens, and the SDKs' administration clients
//! speak only https. A plain request there gets a plain `400` that says so.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::admin::Admin;

use crate::backend::{Backend, EntityStats};
use crate::hint;
use crate::metrics::EntityCounters;
use crate::pending::{Pending, Ticket};
use crate::request::Request;
use crate::shared::Shared;

fn label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// `/health`: 200 while the backend serves, 503 with the reason once it cannot (a broker
/// whose storage failed acknowledges nothing until it is restarted).
pub(crate) fn health(state: Result<(), String>) -> (&'static str, String) {
    match state {
        Ok(()) => ("200 OK", r#"{"status":"healthy"}"#.to_owned()),
        Err(reason) => (
            "503 Service Unavailable",
            serde_json::json!({ "status": "unhealthy", "reason": reason }).to_string(),
        ),
    }
}

/// `/metrics`: gauges per entity and state, counters per entity and operation, connections.
pub(crate) async fn metrics_text<B: Backend>(shared: &Shared<B>) -> String {
    let stats = shared.backend.stats().await;
    let counters = shared.metrics.entities();
    render(&stats, &counters, shared.metrics.connections(), shared.metrics.connections_total())
}

pub(crate) fn render(
    stats: &[EntityStats],
    counters: &BTreeMap<String, EntityCounters>,
    connections: u64,
    connections_total: u64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP twice_servicebus_messages Messages in an entity, by state.");
    let _ = writeln!(out, "# TYPE twice_servicebus_messages gauge");
    for s in stats {
        let e = label(&s.path);
        for (state, n) in [
            ("active", s.active),
            ("scheduled", s.scheduled),
            ("deferred", s.deferred),
            ("dead_letter", s.dead_letter),
        ] {
            let _ =
                writeln!(out, "twice_servicebus_messages{{entity=\"{e}\",state=\"{state}\"}} {n}");
        }
    }
    let _ = writeln!(
        out,
        "# HELP twice_servicebus_operations_total Operations on an entity through AMQP."
    );
    let _ = writeln!(out, "# TYPE twice_servicebus_operations_total counter");
    for (entity, c) in counters {
        let e = label(entity);
        for (op, n) in [
            ("send", c.sends),
            ("receive", c.receives),
            ("complete", c.completes),
            ("abandon", c.abandons),
            ("dead_letter", c.dead_letters),
            ("lock_lost", c.lock_losses),
        ] {
            let _ = writeln!(
                out,
                "twice_servicebus_operations_total{{entity=\"{e}\",operation=\"{op}\"}} {n}"
            );
        }
    }
    let _ = writeln!(out, "# HELP twice_servicebus_connections Open AMQP connections.");
    let _ = writeln!(out, "# TYPE twice_servicebus_connections gauge");
    let _ = writeln!(out, "twice_servicebus_connections {connections}");
    let _ = writeln!(out, "# HELP twice_servicebus_connections_total AMQP connections accepted.");
    let _ = writeln!(out, "# TYPE twice_servicebus_connections_total counter");
    let _ = writeln!(out, "twice_servicebus_connections_total {connections_total}");
    out
}

/// `/entities`: a JSON array of the entities and their counts.
pub(crate) async fn entities_json<B: Backend>(shared: &Shared<B>) -> String {
    let list: Vec<serde_json::Value> = shared
        .backend
        .stats()
        .await
        .iter()
        .map(|s| {
            serde_json::json!({
                "path": s.path,
                "kind": s.kind,
                "active": s.active,
                "scheduled": s.scheduled,
                "deferred": s.deferred,
                "dead_letter": s.dead_letter,
            })
        })
        .collect();
    serde_json::Value::Array(list).to_string()
}

/// The most HTTP requests answered at once; more wait for a slot once they are received.
pub(crate) const MAX_HTTP_CONNECTIONS: usize = 64;
/// The most connections still sending their request (TLS handshake, head, body); past it a
/// new connection evicts the oldest of them, so idle or slow sockets cannot lock out a real
/// client.
const MAX_RECEIVING: usize = 256;
/// The largest request body accepted (an entity description is a few KiB).
pub(crate) const MAX_BODY: usize = 1024 * 1024;
/// The largest request head.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take for each of its TLS handshake and its request.
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the answer may take once the request is in.
const RESPOND_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) async fn serve<B: Backend>(listener: TcpListener, shared: Arc<Shared<B>>) {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| shared.options.http_addr.unwrap_or(shared.options.amqp_addr));
    let admin = Arc::new(Admin::new(shared.options.clock.now()));
    let receiving = Pending::new(MAX_RECEIVING);
    let slots = Arc::new(Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (ticket, _) = receiving.admit();
        let conn =
            Conn { shared: shared.clone(), admin: admin.clone(), slots: slots.clone(), addr };
        tokio::spawn(async move {
            let options = &conn.shared.options;
            // A certificate of the server's own makes the port https only; a development
            // certificate adds https beside plain http.
            let (tls, https_only) = match (&options.tls, &options.http_tls) {
                (Some(tls), _) => (Some(tls.clone()), true),
                (None, dev) => (dev.clone(), false),
            };
            let _ = conn.serve(stream, peer, ticket, tls, https_only).await;
        });
    }
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// What serving one connection needs.
struct Conn<B> {
    shared: Arc<Shared<B>>,
    admin: Arc<Admin>,
    slots: Arc<Semaphore>,
    addr: SocketAddr,
}

/// A received request.
struct Received {
    head: Head,
    body: Vec<u8>,
}

impl<B: Backend> Conn<B> {
    /// Serves one connection: TLS first when it opens with a TLS handshake and the port has a
    /// certificate, then the request. A client speaking the wrong one (TLS to a port without
    /// a certificate, plain HTTP to an https-only port) is answered or dropped with one line in
    /// the log that says what to change. Until its request is in, the connection can be
    /// evicted by newer ones (`ticket`).
    async fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        mut ticket: Ticket,
        tls: Option<Arc<rustls::ServerConfig>>,
        https_only: bool,
    ) -> std::io::Result<()> {
        let (addr, now) = (self.addr, self.shared.options.clock.now());
        let mut first = [0u8; 1];
        let peeked = tokio::select! {
            peeked = tokio::time::timeout(RECEIVE_TIMEOUT, stream.peek(&mut first)) => peeked,
            () = ticket.evicted() => return Ok(()),
        };
        if peeked.map_err(|_| std::io::ErrorKind::TimedOut)?? == 0 {
            return Ok(());
        }
        match (first[0] == TLS_HANDSHAKE, tls) {
            (true, Some(tls)) => {
                let accept = tokio_rustls::TlsAcceptor::from(tls).accept(stream);
                let accepted = tokio::select! {
                    accepted = tokio::time::timeout(RECEIVE_TIMEOUT, accept) => accepted,
                    () = ticket.evicted() => return Ok(()),
                };
                match accepted {
                    Ok(Ok(stream)) => self.request(stream, ticket).await,
                    Ok(Err(e)) => {
                        if hint::HTTPS_HANDSHAKE.due(now) {
                            tracing::warn!(%peer, error = %e, "an https client's TLS handshake on {addr} failed: does it trust the server's certificate (its CA file)?");
                        }
                        Ok(())
                    }
                    Err(_) => Ok(()),
                }
            }
            (true, None) => {
                if hint::HTTPS_ON_PLAIN_HTTP.due(now) {
                    tracing::warn!(%peer, "an https client reached {addr}, which serves plain http only: give the server a certificate (twice serve: --tls-cert, or keep its development certificate on) or use http://");
                }
                // Plain text back, which the client's TLS names as "not TLS"; its hello is
                // read first, so that closing does not reset the connection under the answer.
                let mut stream = stream;
                let mut hello = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut hello)).await;
                let msg = "this port speaks plain http, not https\n";
                respond(&mut stream, "400 Bad Request", "text/plain", msg).await
            }
            (false, _) if https_only => {
                if hint::HTTP_ON_HTTPS.due(now) {
                    tracing::warn!(%peer, "a plain http client reached {addr}, which serves https only: use https://");
                }
                let host = &self.shared.options.hostname;
                let msg = format!("this port speaks https: use https://{host}:{}/\n", addr.port());
                let mut stream = stream;
                respond(&mut stream, "400 Bad Request", "text/plain", &msg).await
            }
            (false, _) => self.request(stream, ticket).await,
        }
    }

    /// Receives the request (evictable, within [`RECEIVE_TIMEOUT`]), then answers it in one of
    /// the [`MAX_HTTP_CONNECTIONS`] slots within [`RESPOND_TIMEOUT`].
    async fn request(
        &self,
        mut stream: impl AsyncRead + AsyncWrite + Unpin,
        mut ticket: Ticket,
    ) -> std::io::Result<()> {
        let received = tokio::select! {
            received = tokio::time::timeout(RECEIVE_TIMEOUT, receive(&mut stream)) => received,
            () = ticket.evicted() => return Ok(()),
        };
        drop(ticket);
        let received = match received {
            Err(_) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(Err((status, msg))))) => {
                return respond(&mut stream, status, "text/plain", &msg).await;
            }
            Ok(Ok(Some(Ok(received)))) => received,
        };
        let Ok(_slot) = self.slots.acquire().await else { return Ok(()) };
        tokio::time::timeout(RESPOND_TIMEOUT, self.answer(&mut stream, received))
            .await
            .unwrap_or(Ok(()))
    }

    async fn answer(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        Received { head, body }: Received,
    ) -> std::io::Result<()> {
        let (shared, addr) = (&self.shared, self.addr);
        let (path, query) = head.target.split_once('?').unwrap_or((head.target.as_str(), ""));
        let host = head.headers.iter().find(|(k, _)| k == "host").map(|(_, v)| v.as_str());
        // `/health` answers any name (container and cluster probes use addresses); every other
        // route only the names this server serves, so a web page that rebinds its own name to
        // this address (DNS rebinding) reaches nothing.
        if path != "/health"
            && let Some(host) = host
            && !host_allowed(&shared.options, addr, host)
        {
            let msg = format!(
                "this server does not answer to the host name in '{host}': it answers to {} (twice serve: add one with --allow-host)\n",
                allowed_hosts(&shared.options, addr).join(", ")
            );
            return respond(stream, "421 Misdirected Request", "text/plain", &msg).await;
        }
        if crate::console::owns(path) {
            let method = head.method.as_str();
            let req = Request { method, path, query, headers: &head.headers, body: &body };
            let r = crate::console::handle(shared, addr, &req).await;
            return respond_with(stream, r.status, r.content_type, &r.headers, &r.body).await;
        }
        let (status, content_type, body) = match (head.method.as_str(), path) {
            ("GET", "/health") => {
                let (status, body) = health(shared.backend.health());
                (status, "application/json", body)
            }
            ("GET", "/metrics") => {
                ("200 OK", "text/plain; version=0.0.4", metrics_text(shared).await)
            }
            ("GET", "/entities") => ("200 OK", "application/json", entities_json(shared).await),
            (method, _) => {
                let req = Request { method, path, query, headers: &head.headers, body: &body };
                let r = crate::admin::handle(shared, &self.admin, addr, &req).await;
                (r.status, r.content_type, r.body)
            }
        };
        respond(stream, status, content_type, &body).await
    }
}

/// The host names the HTTP routes answer to: loopback's, the server's host name, the address
/// it listens on (unless any), and those it was given.
fn allowed_hosts(options: &crate::ServerOptions, addr: SocketAddr) -> Vec<String> {
    let mut names: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(str::to_owned).into();
    let listen = (!addr.ip().is_unspecified()).then(|| addr.ip().to_string());
    for name in std::iter::once(options.hostname.clone()).chain(listen) {
        names.push(name.to_ascii_lowercase());
    }
    names.extend(options.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
    names.dedup();
    names
}

/// Whether a `Host` header (`name`, `name:port`, `[v6]:port`) names this server.
fn host_allowed(options: &crate::ServerOptions, addr: SocketAddr, host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or("", |(v6, _)| v6),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    !name.is_empty() && allowed_hosts(options, addr).contains(&name)
}

/// A client's error: its status and a line saying why.
type Refusal = (&'static str, String);

/// Reads one request: `Ok(None)` when the client went away, `Some(Err)` for a request to
/// refuse (malformed, too large).
async fn receive(
    stream: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<Option<Result<Received, Refusal>>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head = loop {
        match parse_head(&buf) {
            Ok(Some(head)) => break head,
            Ok(None) => {}
            Err(refusal) => return Ok(Some(Err(refusal))),
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let length = match head.content_length() {
        Ok(n) => n,
        Err(refusal) => return Ok(Some(Err(refusal))),
    };
    if length > MAX_BODY {
        let msg = format!("a request body is at most {MAX_BODY} bytes\n");
        return Ok(Some(Err(("413 Payload Too Large", msg))));
    }
    let mut body = buf.split_off(head.body_at.min(buf.len()));
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(Some(Ok(Received { head, body })))
}

/// A parsed request head.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    method: String,
    target: String,
    /// Lowercase names.
    headers: Vec<(String, String)>,
    /// Where the body starts in the buffer.
    body_at: usize,
}

impl Head {
    /// The body's length, framed strictly (RFC 9112 section 6): no transfer coding, and
    /// `Content-Length` given as digits only, once (or repeated with the same value).
    fn content_length(&self) -> Result<usize, Refusal> {
        let bad = |why: &str| ("400 Bad Request", format!("{why}\n"));
        if self.headers.iter().any(|(k, _)| k == "transfer-encoding") {
            return Err(("411 Length Required", "send a content-length\n".to_owned()));
        }
        let mut length = None;
        for (_, v) in self.headers.iter().filter(|(k, _)| k == "content-length") {
            for value in v.split(',').map(str::trim) {
                if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad("bad content-length: digits only"));
                }
                let n = value.parse::<usize>().map_err(|_| bad("bad content-length"))?;
                if length.is_some_and(|l| l != n) {
                    return Err(bad("conflicting content-length headers"));
                }
                length = Some(n);
            }
        }
        Ok(length.unwrap_or(0))
    }
}

/// Whether `name` is an HTTP token (RFC 9110 section 5.6.2): a header name.
fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Parses the head of `buf` once it holds all of it (`Ok(None)` until then). Refuses what
/// RFC 9112 says a server must: whitespace between a header's name and its colon, folded
/// lines, and header lines without a colon.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, Refusal> {
    let bad = |why: &str| ("400 Bad Request", format!("{why}\n"));
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Err(("431 Request Header Fields Too Large", String::new()))
        } else {
            Ok(None)
        };
    };
    let head =
        std::str::from_utf8(&buf[..end]).map_err(|_| bad("the request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split_whitespace();
    let method = request_line.next().unwrap_or("").to_owned();
    let target = request_line.next().unwrap_or("").to_owned();
    let mut headers = Vec::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(bad("a header line without a colon"));
        };
        if !is_token(name) {
            return Err(bad("a malformed header name (no space before the colon, no folding)"));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
    }
    Ok(Some(Head { method, target, headers, body_at: end + 4 }))
}

async fn respond(
    stream: &mut (impl AsyncWrite + Unpin),
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    respond_with(stream, status, content_type, &[], body).await
}

async fn respond_with(
    stream: &mut (impl AsyncWrite + Unpin),
    status: &str,
    content_type: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<()> {
    let mut response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        let _ = write!(response, "{name}: {value}\r\n");
    }
    response.push_str("\r\n");
    response.push_str(body);
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_is_503_with_the_reason_once_storage_failed() {
        assert_eq!(super::health(Ok(())), ("200 OK", r#"{"status":"healthy"}"#.to_owned()));
        let (status, body) = super::health(Err("storage failed: No space left".to_owned()));
        assert_eq!(status, "503 Service Unavailable");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "unhealthy");
        assert_eq!(v["reason"], "storage failed: No space left");
    }

    #[test]
    fn renders_prometheus_text() {
        let stats = vec![EntityStats {
            path: "q\"1".into(),
            kind: "queue".into(),
            active: 3,
            ..EntityStats::default()
        }];
        let mut counters = BTreeMap::new();
        counters.insert("q1".to_owned(), EntityCounters { sends: 5, ..EntityCounters::default() });
        let text = render(&stats, &counters, 2, 7);
        assert!(text.contains("twice_servicebus_messages{entity=\"q\\\"1\",state=\"active\"} 3"));
        assert!(
            text.contains("twice_servicebus_operations_total{entity=\"q1\",operation=\"send\"} 5")
        );
        assert!(text.contains("twice_servicebus_connections 2\n"));
        assert!(text.contains("twice_servicebus_connections_total 7\n"));
    }
}
