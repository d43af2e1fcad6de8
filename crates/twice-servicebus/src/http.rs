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

/// The most HTTP connections served at once; more wait in the listen backlog.
pub(crate) const MAX_HTTP_CONNECTIONS: usize = 64;
/// The largest request body accepted (an entity description is a few KiB).
pub(crate) const MAX_BODY: usize = 1024 * 1024;
/// The largest request head.
const MAX_HEAD: usize = 16 * 1024;
/// How long one connection may take, from accept to the last byte of its response.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) async fn serve<B: Backend>(listener: TcpListener, shared: Arc<Shared<B>>) {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| shared.options.http_addr.unwrap_or(shared.options.amqp_addr));
    let admin = Arc::new(Admin::new(shared.options.clock.now()));
    // A connection is accepted only with a slot free: beyond the limit, clients wait in the
    // kernel's backlog instead of each costing a task and a buffer here.
    let slots = Arc::new(Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let shared = shared.clone();
        let admin = admin.clone();
        tokio::spawn(async move {
            let request = async {
                let options = &shared.options;
                // A certificate of the server's own makes the port https only; a development
                // certificate adds https beside plain http.
                let (tls, https_only) = match (&options.tls, &options.http_tls) {
                    (Some(tls), _) => (Some(tls.clone()), true),
                    (None, dev) => (dev.clone(), false),
                };
                serve_connection(stream, peer, tls, https_only, &shared, &admin, addr).await
            };
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, request).await;
            drop(slot);
        });
    }
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// Serves one connection: TLS first when it opens with a TLS handshake and the port has a
/// certificate, then the request. A client speaking the wrong one (TLS to a port without a
/// certificate, plain HTTP to an https-only port) is answered or dropped with one line in the
/// log that says what to change.
async fn serve_connection<B: Backend>(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    https_only: bool,
    shared: &Arc<Shared<B>>,
    admin: &Admin,
    addr: SocketAddr,
) -> std::io::Result<()> {
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 0 {
        return Ok(());
    }
    match (first[0] == TLS_HANDSHAKE, tls) {
        (true, Some(tls)) => match tokio_rustls::TlsAcceptor::from(tls).accept(stream).await {
            Ok(stream) => http_request(stream, shared, admin, addr).await,
            Err(e) => {
                if hint::HTTPS_HANDSHAKE.due(shared.options.clock.now()) {
                    tracing::warn!(%peer, error = %e, "an https client's TLS handshake on {addr} failed: does it trust the server's certificate (its CA file)?");
                }
                Ok(())
            }
        },
        (true, None) => {
            if hint::HTTPS_ON_PLAIN_HTTP.due(shared.options.clock.now()) {
                tracing::warn!(%peer, "an https client reached {addr}, which serves plain http only: give the server a certificate (twice serve: --tls-cert, or keep its development certificate on) or use http://");
            }
            Ok(())
        }
        (false, _) if https_only => {
            if hint::HTTP_ON_HTTPS.due(shared.options.clock.now()) {
                tracing::warn!(%peer, "a plain http client reached {addr}, which serves https only: use https://");
            }
            let host = &shared.options.hostname;
            let msg = format!("this port speaks https: use https://{host}:{}/\n", addr.port());
            let mut stream = stream;
            respond(&mut stream, "400 Bad Request", "text/plain", &msg).await
        }
        (false, _) => http_request(stream, shared, admin, addr).await,
    }
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

/// Parses the head of `buf` once it holds all of it (`Ok(None)` until then).
fn parse_head(buf: &[u8]) -> Result<Option<Head>, &'static str> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Err("431 Request Header Fields Too Large")
        } else {
            Ok(None)
        };
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| "400 Bad Request")?;
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split_whitespace();
    let method = request_line.next().unwrap_or("").to_owned();
    let target = request_line.next().unwrap_or("").to_owned();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
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

async fn http_request<B: Backend>(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    shared: &Arc<Shared<B>>,
    admin: &Admin,
    addr: SocketAddr,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head = loop {
        match parse_head(&buf) {
            Ok(Some(head)) => break head,
            Ok(None) => {}
            Err(status) => return respond(&mut stream, status, "text/plain", "").await,
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let header = |name: &str| head.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    if header("transfer-encoding").is_some() {
        return respond(
            &mut stream,
            "411 Length Required",
            "text/plain",
            "send a content-length\n",
        )
        .await;
    }
    let length = match header("content-length").map(str::parse::<usize>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return respond(&mut stream, "400 Bad Request", "text/plain", "bad content-length\n")
                .await;
        }
    };
    if length > MAX_BODY {
        let msg = format!("a request body is at most {MAX_BODY} bytes\n");
        return respond(&mut stream, "413 Payload Too Large", "text/plain", &msg).await;
    }
    let mut body = buf.split_off(head.body_at.min(buf.len()));
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    let (path, query) = head.target.split_once('?').unwrap_or((head.target.as_str(), ""));
    if crate::console::owns(path) {
        let method = head.method.as_str();
        let req = Request { method, path, query, headers: &head.headers, body: &body };
        let r = crate::console::handle(shared, addr, &req).await;
        return respond_with(&mut stream, r.status, r.content_type, &r.headers, &r.body).await;
    }
    let (status, content_type, body) = match (head.method.as_str(), path) {
        ("GET", "/health") => {
            let (status, body) = health(shared.backend.health());
            (status, "application/json", body)
        }
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics_text(shared).await),
        ("GET", "/entities") => ("200 OK", "application/json", entities_json(shared).await),
        (method, _) => {
            let req = Request { method, path, query, headers: &head.headers, body: &body };
            let r = crate::admin::handle(shared, admin, addr, &req).await;
            (r.status, r.content_type, r.body)
        }
    };
    respond(&mut stream, status, content_type, &body).await
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
