//! The HTTP side port: its listener, and the bodies it serves (health, Prometheus text, the
//! entity list, the web console of [`crate::console`], and the administration API of
//! [`crate::admin`]).
//!
//! hyper speaks HTTP on each connection this listener accepts; the listener keeps the
//! admission, the limits and the routing. A server with a certificate speaks https on this
//! port, with the certificate of amqps: the administration API and the console carry SAS
//! tokens, and the SDKs' administration clients speak only https. A plain request there gets a
//! plain `400` that says so.
//!
//! A connection answers one request, with `connection: close`, in three stages, each bounded:
//! *receiving* (its TLS handshake, then its request's head and body, each within
//! [`ServerOptions::http_receive_timeout`]), in which it holds a place among the
//! [`ServerOptions::max_http_receiving`] connections still receiving and a newer connection may
//! evict it; *queued*, until one of the [`ServerOptions::max_http_answering`] answering slots is
//! free; *answering*, holding that slot until its answer is written, within
//! [`ServerOptions::http_answer_timeout`]. A request hyper cannot parse (RFC 9112 framing: a
//! malformed or conflicting `Content-Length`, whitespace before a header's colon, folded
//! lines) is refused in the first stage with hyper's status and a line saying why.
//!
//! [`ServerOptions::http_receive_timeout`]: crate::ServerOptions::http_receive_timeout
//! [`ServerOptions::max_http_receiving`]: crate::ServerOptions::max_http_receiving
//! [`ServerOptions::max_http_answering`]: crate::ServerOptions::max_http_answering
//! [`ServerOptions::http_answer_timeout`]: crate::ServerOptions::http_answer_timeout

use std::collections::BTreeMap;
use std::fmt::Write;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::ext::ReasonPhrase;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Sleep;

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

/// The largest request head (hyper answers 431 beyond it).
const MAX_HEAD: usize = 16 * 1024;
/// The most bytes of hyper's own refusal kept (a status line and a few headers).
const MAX_HELD: usize = 1024;

/// The HTTP connection settings: one request per connection, answered with
/// `connection: close`, so that a connection holds an answering slot for exactly one request
/// and never idles between requests.
fn http1() -> http1::Builder {
    let mut http = http1::Builder::new();
    http.keep_alive(false)
        // A client that shuts down its sending side after its request still gets the answer.
        .half_close(true)
        .max_header_size(MAX_HEAD)
        // The connection's task bounds the head and the body together (`receiving`).
        .header_read_timeout(None);
    http
}

pub(crate) async fn serve<B: Backend>(listener: TcpListener, shared: Arc<Shared<B>>) {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| shared.options.http_addr.unwrap_or(shared.options.amqp_addr));
    let options = &shared.options;
    let receiving = Pending::new(options.max_http_receiving);
    let port = Arc::new(Port {
        admin: Admin::new(options.clock.now()),
        slots: Semaphore::new(options.max_http_answering),
        http: http1(),
        addr,
        shared: shared.clone(),
    });
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (ticket, _) = receiving.admit();
        let port = port.clone();
        tokio::spawn(async move { port.connection(stream, peer, ticket).await });
    }
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// What serving the port's connections needs.
struct Port<B> {
    shared: Arc<Shared<B>>,
    admin: Admin,
    /// The answering slots.
    slots: Semaphore,
    http: http1::Builder,
    addr: SocketAddr,
}

/// How a connection's request is answered.
#[derive(Debug)]
enum Mode {
    /// Routed: the port's own traffic.
    Serve,
    /// A plain request on an https-only port: a `400` with this text, which names the URL.
    HttpsOnly(String),
    /// A TLS handshake on a port without a certificate: hyper refuses it as a malformed
    /// request, and the refusal says that the port speaks plain http.
    NotTls,
}

/// What a connection's task and the service hyper calls for its request share.
#[derive(Debug, Default)]
struct Exchange {
    /// Set when hyper hands the request to the service: from then on hyper writes its answer.
    dispatched: AtomicBool,
    /// Notified by the service once the whole request is in.
    received: Notify,
    /// Notified by the task once the request holds an answering slot.
    go: Notify,
    /// What hyper wrote before any request reached the service: its refusal of a request it
    /// could not parse (see [`Held`]). A short section with no `.await` inside.
    refusal: Mutex<Vec<u8>>,
}

impl Exchange {
    fn dispatched(&self) -> bool {
        self.dispatched.load(Ordering::Relaxed)
    }

    fn hold(&self, bytes: &[u8]) {
        let mut held = self.refusal.lock().unwrap_or_else(PoisonError::into_inner);
        let room = MAX_HELD.saturating_sub(held.len());
        held.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn take_refusal(&self) -> Vec<u8> {
        std::mem::take(&mut *self.refusal.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl<B: Backend> Port<B> {
    /// Serves one connection: TLS first when it opens with a TLS handshake and the port has a
    /// certificate, then the request. A client speaking the wrong one (TLS to a port without
    /// a certificate, plain HTTP to an https-only port) is answered or dropped with one line in
    /// the log that says what to change. Until its request is in, the connection can be
    /// evicted by newer ones (`ticket`).
    async fn connection(&self, stream: TcpStream, peer: SocketAddr, mut ticket: Ticket) {
        let options = &self.shared.options;
        let (addr, now) = (self.addr, options.clock.now());
        // A certificate of the server's own makes the port https only; a development
        // certificate adds https beside plain http.
        let (tls, https_only) = match (&options.tls, &options.http_tls) {
            (Some(tls), _) => (Some(tls.clone()), true),
            (None, dev) => (dev.clone(), false),
        };
        let limit = options.http_receive_timeout;
        let mut first = [0u8; 1];
        let peeked = tokio::select! {
            peeked = tokio::time::timeout(limit, stream.peek(&mut first)) => peeked,
            () = ticket.evicted() => return,
        };
        if !matches!(peeked, Ok(Ok(1..))) {
            return;
        }
        match (first[0] == TLS_HANDSHAKE, tls) {
            (true, Some(tls)) => {
                let accept = tokio_rustls::TlsAcceptor::from(tls).accept(stream);
                let accepted = tokio::select! {
                    accepted = tokio::time::timeout(limit, accept) => accepted,
                    () = ticket.evicted() => return,
                };
                match accepted {
                    Ok(Ok(stream)) => self.exchange(stream, ticket, Mode::Serve).await,
                    Ok(Err(e)) => {
                        if hint::HTTPS_HANDSHAKE.due(now) {
                            tracing::warn!(%peer, error = %e, "an https client's TLS handshake on {addr} failed: does it trust the server's certificate (its CA file)?");
                        }
                    }
                    Err(_) => {}
                }
            }
            (true, None) => {
                if hint::HTTPS_ON_PLAIN_HTTP.due(now) {
                    tracing::warn!(%peer, "an https client reached {addr}, which serves plain http only: give the server a certificate (twice serve: --tls-cert, or keep its development certificate on) or use http://");
                }
                self.exchange(stream, ticket, Mode::NotTls).await;
            }
            (false, _) if https_only => {
                if hint::HTTP_ON_HTTPS.due(now) {
                    tracing::warn!(%peer, "a plain http client reached {addr}, which serves https only: use https://");
                }
                let host = &options.hostname;
                let msg = format!("this port speaks https: use https://{host}:{}/\n", addr.port());
                self.exchange(stream, ticket, Mode::HttpsOnly(msg)).await;
            }
            (false, _) => self.exchange(stream, ticket, Mode::Serve).await,
        }
    }

    /// Serves the request of a connection (after its TLS handshake) through hyper, then
    /// answers a request hyper refused with hyper's status and the reason.
    async fn exchange<S>(&self, mut stream: S, ticket: Ticket, mode: Mode)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let state = Exchange::default();
        let receiving = tokio::time::sleep(self.shared.options.http_receive_timeout);
        tokio::pin!(receiving);
        let io = TokioIo::new(Held { stream: &mut stream, state: &state });
        let Some(ended) = self.drive(io, ticket, &state, &mode, receiving.as_mut()).await else {
            return;
        };
        let held = state.take_refusal();
        if held.is_empty() {
            return;
        }
        let reason = match (&mode, &ended) {
            (Mode::NotTls, _) => "this port speaks plain http, not https\n".to_owned(),
            (_, Err(e)) => format!("a malformed request: {e}\n"),
            (_, Ok(())) => "a malformed request\n".to_owned(),
        };
        let deadline = receiving.deadline();
        let _ = tokio::time::timeout_at(deadline, refuse(&mut stream, &held, &reason)).await;
    }

    /// Runs hyper on the connection through the three stages: `None` when the connection was
    /// dropped (evicted, or out of time), else how hyper ended.
    async fn drive<I>(
        &self,
        io: I,
        mut ticket: Ticket,
        state: &Exchange,
        mode: &Mode,
        mut receiving: Pin<&mut Sleep>,
    ) -> Option<hyper::Result<()>>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin,
    {
        let service = service_fn(|request| self.call(request, state, mode));
        let conn = self.http.serve_connection(io, service);
        tokio::pin!(conn);
        // Receiving: the head and the body, evictable by newer connections. A request refused
        // before its body, by hyper or by `call`, is answered in this stage.
        tokio::select! {
            ended = &mut conn => return Some(ended),
            () = state.received.notified() => {}
            () = ticket.evicted() => return None,
            () = &mut receiving => return None,
        }
        drop(ticket);
        // Queued: the request waits for an answering slot.
        let slot = tokio::select! {
            ended = &mut conn => return Some(ended),
            slot = self.slots.acquire() => slot.ok()?,
        };
        state.go.notify_one();
        // Answering, writing the answer included, with the slot held until then.
        let ended = tokio::time::timeout(self.shared.options.http_answer_timeout, conn).await;
        drop(slot);
        ended.ok()
    }

    /// The service hyper calls with the request: receives its body, waits for the task to
    /// give it a slot, and answers.
    ///
    /// # Cancel safety
    ///
    /// As the routes: the console's changes finish in tasks of their own, but an
    /// administration request dropped half way (by the answer timeout) may have changed an
    /// entity without answering.
    async fn call(
        &self,
        request: http::Request<Incoming>,
        state: &Exchange,
        mode: &Mode,
    ) -> Result<Response<Full<Bytes>>, hyper::Error> {
        state.dispatched.store(true, Ordering::Relaxed);
        if let Mode::HttpsOnly(msg) = mode {
            return Ok(text("400 Bad Request", msg));
        }
        let (head, body) = request.into_parts();
        if let Some(refusal) = self.refuse_early(&head, &body) {
            return Ok(refusal);
        }
        // At most the body cap: hyper delivers exactly the `Content-Length` checked above.
        let body = body.collect().await?.to_bytes();
        state.received.notify_one();
        state.go.notified().await;
        Ok(self.answer(&head, &body).await)
    }

    /// A request refused before its body is read: header values that are not UTF-8, a
    /// transfer coding (RFC 9112 lets a server ask for a length instead), or a body over the
    /// cap. hyper has refused malformed framing already.
    fn refuse_early(&self, head: &Parts, body: &Incoming) -> Option<Response<Full<Bytes>>> {
        if head.headers.values().any(|v| std::str::from_utf8(v.as_bytes()).is_err()) {
            return Some(text("400 Bad Request", "the request head is not UTF-8\n"));
        }
        if head.headers.contains_key(header::TRANSFER_ENCODING) {
            return Some(text("411 Length Required", "send a content-length\n"));
        }
        let cap = self.shared.options.max_http_body;
        if body.size_hint().lower() > u64::try_from(cap).unwrap_or(u64::MAX) {
            let msg = format!("a request body is at most {cap} bytes\n");
            return Some(text("413 Payload Too Large", &msg));
        }
        None
    }

    async fn answer(&self, head: &Parts, body: &[u8]) -> Response<Full<Bytes>> {
        let (shared, addr) = (&self.shared, self.addr);
        let (path, query) = (head.uri.path(), head.uri.query().unwrap_or(""));
        // The name the request is for: its target's when it names one (absolute form, RFC 9112
        // section 3.2.2), else its `Host`; one that is not text names no server of ours.
        let host = match head.uri.authority() {
            Some(authority) => Some(authority.as_str()),
            None => head
                .headers
                .get(header::HOST)
                .map(|v| std::str::from_utf8(v.as_bytes()).unwrap_or_default()),
        };
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
            return text("421 Misdirected Request", &msg);
        }
        let method = head.method.as_str();
        let req = Request { method, path, query, headers: &head.headers, body };
        if crate::console::owns(path) {
            let r = crate::console::handle(shared, addr, &req).await;
            return reply(r.status, r.content_type, &r.headers, r.body);
        }
        let (status, content_type, body) = match (method, path) {
            ("GET", "/health") => {
                let (status, body) = health(shared.backend.health());
                (status, "application/json", body)
            }
            ("GET", "/metrics") => {
                ("200 OK", "text/plain; version=0.0.4", metrics_text(shared).await)
            }
            ("GET", "/entities") => ("200 OK", "application/json", entities_json(shared).await),
            _ => {
                let r = crate::admin::handle(shared, &self.admin, addr, &req).await;
                (r.status, r.content_type, r.body)
            }
        };
        reply(status, content_type, &[], body)
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

/// A plain-text answer.
fn text(status: &str, body: &str) -> Response<Full<Bytes>> {
    reply(status, "text/plain", &[], body.to_owned())
}

/// An answer; `status` is the text of a status line as the routes give it (`404 Not Found`),
/// and its reason goes out as given.
fn reply(
    status: &str,
    content_type: &'static str,
    headers: &[(&'static str, &'static str)],
    body: String,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let (code, reason) = status.split_once(' ').unwrap_or((status, ""));
    let code = code.parse().ok().and_then(|c| StatusCode::from_u16(c).ok());
    let code = code.unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.status_mut() = code;
    if code.canonical_reason() != Some(reason)
        && let Ok(reason) = ReasonPhrase::try_from(reason.as_bytes())
    {
        response.extensions_mut().insert(reason);
    }
    let fields = response.headers_mut();
    fields.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    fields.insert(header::CONNECTION, HeaderValue::from_static("close"));
    for (name, value) in headers {
        fields.insert(HeaderName::from_static(name), HeaderValue::from_static(value));
    }
    response
}

/// Answers a request hyper refused: hyper's status line (hyper chose the status), then the
/// reason as plain text.
async fn refuse<S: AsyncWrite + Unpin>(
    stream: &mut S,
    held: &[u8],
    reason: &str,
) -> io::Result<()> {
    let end = held.windows(2).position(|w| w == b"\r\n").unwrap_or(held.len());
    let status_line = String::from_utf8_lossy(&held[..end]);
    let answer = format!(
        "{status_line}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reason}",
        reason.len()
    );
    stream.write_all(answer.as_bytes()).await?;
    stream.shutdown().await
}

/// The connection under hyper. Until a request reaches the service, what hyper writes can only
/// be its own refusal of a request it could not parse: a status line and no reason. That is
/// held in the [`Exchange`], and the stream is neither flushed nor shut down, so that the
/// task can answer with hyper's status and the reason ([`refuse`]). From the request on, hyper
/// writes through.
struct Held<'a, S> {
    stream: &'a mut S,
    state: &'a Exchange,
}

impl<S: AsyncRead + Unpin> AsyncRead for Held<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Held<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.state.dispatched() {
            return Pin::new(&mut *this.stream).poll_write(cx, buf);
        }
        this.state.hold(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.state.dispatched() {
            return Pin::new(&mut *this.stream).poll_write_vectored(cx, bufs);
        }
        bufs.iter().for_each(|b| this.state.hold(b));
        Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.state.dispatched() {
            return Pin::new(&mut *this.stream).poll_flush(cx);
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.state.dispatched() {
            return Pin::new(&mut *this.stream).poll_shutdown(cx);
        }
        Poll::Ready(Ok(()))
    }
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
