//! A small HTTP client (version 1.1 only) on hyper, for the few HTTP calls twice makes to hosts
//! it knows: a namespace's administration API (`twice serve`'s HTTP port, the emulator's,
//! Azure's), and the loopback services of the demo and of the test kit.
//!
//! Each call names its [`Target`] (host, port, and the roots https trusts) and its
//! [`Request`] (method, path, headers, body, time limit, largest body read). [`request`] makes
//! one connection for one request; a [`Connection`] stays open for the next request
//! (keep-alive). Errors are typed ([`HttpError`]): a connection refused, no answer in time, a
//! certificate not trusted, a plain server on a TLS connection, an answer that is not HTTP, a
//! body too large.
//!
//! ```no_run
//! use std::time::Duration;
//! use twice_servicebus_client::http::{self, Target};
//!
//! # async fn run() -> Result<(), http::HttpError> {
//! let health = http::get(&Target::http("127.0.0.1", 5300), "/health", Duration::from_secs(5)).await?;
//! println!("{} {}", health.status(), health.text());
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

pub use ::http::{HeaderMap, Method, StatusCode};

/// How long a request may take by default, connection included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest body read by default.
pub const DEFAULT_MAX_BODY: usize = 1 << 20;

/// Where requests go: a host and a port, over TLS (https) or not.
#[derive(Clone)]
pub struct Target {
    host: String,
    port: u16,
    /// The roots https trusts; `None` for plain http.
    tls: Option<Arc<RootCertStore>>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("roots", &self.tls.as_ref().map(|r| r.len()))
            .finish()
    }
}

impl Target {
    /// `http://host:port`.
    pub fn http(host: impl Into<String>, port: u16) -> Self {
        Self { host: host.into(), port, tls: None }
    }

    /// `https://host:port`, trusting the certificates `roots` holds (for example
    /// [`crate::TlsOptions::root_store`]); the server's certificate must name `host`.
    pub fn https(host: impl Into<String>, port: u16, roots: Arc<RootCertStore>) -> Self {
        Self { host: host.into(), port, tls: Some(roots) }
    }

    /// The host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether requests go over TLS.
    pub fn is_https(&self) -> bool {
        self.tls.is_some()
    }

    /// `host:port`, as errors name it.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The `Host` header: the port only when it is not the scheme's own.
    fn authority(&self) -> String {
        let default = if self.is_https() { 443 } else { 80 };
        if self.port == default {
            if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() }
        } else {
            self.addr()
        }
    }
}

/// One request: method, path and query, headers, body, and its limits.
#[derive(Clone, Debug)]
pub struct Request {
    method: Method,
    path: String,
    headers: Vec<(String, String)>,
    body: Bytes,
    timeout: Duration,
    max_body: usize,
}

impl Request {
    /// `method` on `path_and_query` (`/health`, `/orders?api-version=2021-05`), already
    /// percent-encoded; no body, [`DEFAULT_TIMEOUT`], [`DEFAULT_MAX_BODY`].
    pub fn new(method: Method, path_and_query: impl Into<String>) -> Self {
        Self {
            method,
            path: path_and_query.into(),
            headers: Vec::new(),
            body: Bytes::new(),
            timeout: DEFAULT_TIMEOUT,
            max_body: DEFAULT_MAX_BODY,
        }
    }

    /// `GET path_and_query`.
    pub fn get(path_and_query: impl Into<String>) -> Self {
        Self::new(Method::GET, path_and_query)
    }

    /// Adds a header. A name or value HTTP does not allow (a line break in it) fails the
    /// request with [`HttpError::Request`], before anything is sent.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The body, with its `Content-Type` (its `Content-Length` is set from it).
    #[must_use]
    pub fn body(mut self, content_type: &str, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self.header("Content-Type", content_type)
    }

    /// How long the request may take, from the connection to the last byte of the answer
    /// (default [`DEFAULT_TIMEOUT`]).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The largest answer body read (default [`DEFAULT_MAX_BODY`]); a larger one is
    /// [`HttpError::TooLarge`].
    #[must_use]
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// The hyper request for `target`.
    fn build(
        &self,
        target: &Target,
        close: bool,
    ) -> Result<::http::Request<Full<Bytes>>, HttpError> {
        let mut builder = ::http::Request::builder()
            .method(self.method.clone())
            .uri(self.path.as_str())
            .header(::http::header::HOST, target.authority());
        for (name, value) in &self.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        if close {
            builder = builder.header(::http::header::CONNECTION, "close");
        }
        builder
            .body(Full::new(self.body.clone()))
            .map_err(|e| HttpError::Request(format!("{} {}: {e}", self.method, self.path)))
    }
}

/// An answer: its status, headers and body.
#[derive(Clone, Debug)]
pub struct Response {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Response {
    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body, taken.
    pub fn into_body(self) -> Bytes {
        self.body
    }
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The TCP connection could not be made (refused, unreachable, a name that does not
    /// resolve).
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The host and port.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No whole answer within the request's time limit.
    #[error("{addr} did not answer within {} s", after.as_secs_f64())]
    Timeout {
        /// The host and port.
        addr: String,
        /// The time limit.
        after: Duration,
    },
    /// The server's certificate is not one the client trusts (an unknown CA, another name,
    /// expired).
    #[error("{addr} has a certificate this client does not trust: {reason}")]
    Untrusted {
        /// The host and port.
        addr: String,
        /// What is wrong with the certificate.
        reason: String,
    },
    /// The peer answered the TLS handshake as a plain server does (with plain HTTP, or by
    /// closing the connection): it does not speak TLS on this port.
    #[error("{addr} does not answer TLS: it answered the TLS handshake as a plain server")]
    NotTls {
        /// The host and port.
        addr: String,
    },
    /// TLS failed otherwise (a protocol version or cipher refused, an alert).
    #[error("tls with {addr}: {reason}")]
    Tls {
        /// The host and port.
        addr: String,
        /// The failure.
        reason: String,
    },
    /// The peer's answer is not HTTP, or the connection ended before it was whole.
    #[error("{addr} did not answer HTTP: {reason}")]
    Protocol {
        /// The host and port.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The answer's body is larger than the request allows.
    #[error("the answer of {addr} is larger than {limit} bytes")]
    TooLarge {
        /// The host and port.
        addr: String,
        /// The limit.
        limit: usize,
    },
    /// The request cannot be sent as given (a header or path HTTP does not allow).
    #[error("invalid request: {0}")]
    Request(String),
}

impl HttpError {
    /// Whether nothing listens at the address (the connection was refused).
    pub fn is_connection_refused(&self) -> bool {
        matches!(self, HttpError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused)
    }

    /// Whether the request ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(self, HttpError::Timeout { .. })
    }
}

/// `GET path_and_query` on `target`, on a connection of its own.
///
/// # Errors
///
/// As [`request`].
///
/// # Cancel safety
///
/// Cancel safe: dropping the future closes its connection.
pub async fn get(
    target: &Target,
    path_and_query: &str,
    timeout: Duration,
) -> Result<Response, HttpError> {
    request(target, Request::get(path_and_query).timeout(timeout)).await
}

/// Sends `request` to `target` on a connection of its own, closed after the answer
/// (`Connection: close`), and reads the whole answer. Any status is an answer: the caller
/// decides what a 404 or a 503 means.
///
/// # Errors
///
/// [`HttpError`]: no connection, no answer in time, TLS refused, not HTTP, a body too large.
///
/// # Cancel safety
///
/// Cancel safe in that dropping the future closes its connection; a request cut off may or
/// may not have reached the server.
pub async fn request(target: &Target, request: Request) -> Result<Response, HttpError> {
    let limit = request.timeout;
    let built = request.build(target, true)?;
    let exchange = async {
        let mut connection = Connection::connect(target).await?;
        connection.exchange(built, request.max_body).await
    };
    tokio::time::timeout(limit, exchange)
        .await
        .map_err(|_| HttpError::Timeout { addr: target.addr(), after: limit })?
}

/// A connection kept open for several requests, one at a time (keep-alive).
#[derive(Debug)]
pub struct Connection {
    target: Target,
    sender: SendRequest<Full<Bytes>>,
}

impl Connection {
    /// Connects to `target` (TCP, then TLS for https) within `timeout`.
    ///
    /// # Errors
    ///
    /// [`HttpError::Connect`], [`HttpError::Timeout`], and for https
    /// [`HttpError::Untrusted`], [`HttpError::NotTls`] or [`HttpError::Tls`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a connection half made is closed.
    pub async fn open(target: &Target, timeout: Duration) -> Result<Self, HttpError> {
        tokio::time::timeout(timeout, Self::connect(target))
            .await
            .map_err(|_| HttpError::Timeout { addr: target.addr(), after: timeout })?
    }

    /// Whether the connection can take another request: the server has not closed it, and
    /// the last answer was read whole.
    pub fn is_open(&self) -> bool {
        self.sender.is_ready()
    }

    /// Sends `request` and reads its whole answer, within the request's time limit. After an
    /// error the connection is not to be used again.
    ///
    /// # Errors
    ///
    /// [`HttpError::Protocol`] when the server closed the connection or did not answer HTTP,
    /// [`HttpError::Timeout`], [`HttpError::TooLarge`], [`HttpError::Request`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a request cut off may or may not have reached the server, and the
    /// connection is then not ready for another.
    pub async fn send(&mut self, request: &Request) -> Result<Response, HttpError> {
        let limit = request.timeout;
        let addr = self.target.addr();
        let built = request.build(&self.target, false)?;
        tokio::time::timeout(limit, self.exchange(built, request.max_body))
            .await
            .map_err(|_| HttpError::Timeout { addr, after: limit })?
    }

    async fn connect(target: &Target) -> Result<Self, HttpError> {
        let addr = target.addr();
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|source| HttpError::Connect { addr: addr.clone(), source })?;
        // Requests are small and answered at once: waiting to batch them only adds latency.
        tcp.set_nodelay(true)
            .map_err(|source| HttpError::Connect { addr: addr.clone(), source })?;
        let sender = match &target.tls {
            None => start(tcp, &addr).await?,
            Some(roots) => start(tls(tcp, target, roots).await?, &addr).await?,
        };
        Ok(Self { target: target.clone(), sender })
    }

    async fn exchange(
        &mut self,
        built: ::http::Request<Full<Bytes>>,
        max_body: usize,
    ) -> Result<Response, HttpError> {
        let addr = self.target.addr();
        let protocol =
            |e: &hyper::Error| HttpError::Protocol { addr: addr.clone(), reason: why(e) };
        self.sender.ready().await.map_err(|e| protocol(&e))?;
        let response = self.sender.send_request(built).await.map_err(|e| protocol(&e))?;
        let (parts, mut body) = response.into_parts();
        let too_large = || HttpError::TooLarge { addr: addr.clone(), limit: max_body };
        let length = parts
            .headers
            .get(::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if length.is_some_and(|n| n > u64::try_from(max_body).unwrap_or(u64::MAX)) {
            return Err(too_large());
        }
        let mut out = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| protocol(&e))?;
            if let Ok(data) = frame.into_data() {
                if out.len().saturating_add(data.len()) > max_body {
                    return Err(too_large());
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(Response { status: parts.status, headers: parts.headers, body: out.freeze() })
    }
}

/// Starts HTTP on `io`; a task drives the connection until both sides are done with it.
async fn start<S>(io: S, addr: &str) -> Result<SendRequest<Full<Bytes>>, HttpError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| HttpError::Protocol { addr: addr.to_owned(), reason: why(&e) })?;
    let addr = addr.to_owned();
    tokio::spawn(async move {
        // Its errors reach the request waiting on it; this is only the connection's end.
        if let Err(e) = connection.await {
            tracing::debug!(addr, error = %why(&e), "an HTTP connection ended");
        }
    });
    Ok(sender)
}

/// The TLS handshake, its failures told apart.
async fn tls(
    tcp: TcpStream,
    target: &Target,
    roots: &Arc<RootCertStore>,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, HttpError> {
    let addr = target.addr();
    let failed = |reason: String| HttpError::Tls { addr: addr.clone(), reason };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| failed(e.to_string()))?
    .with_root_certificates(Arc::clone(roots))
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(target.host.clone())
        .map_err(|e| failed(format!("{:?} is not a server name: {e}", target.host)))?;
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.map_err(|e| {
        match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::InvalidCertificate(reason)) => {
                HttpError::Untrusted { addr: addr.clone(), reason: reason.to_string() }
            }
            // A plain HTTP server answers the client hello with a plain `400` response, which
            // rustls reads as a record of an invalid content type.
            Some(rustls::Error::InvalidMessage(_)) => HttpError::NotTls { addr: addr.clone() },
            // Or it closes the connection without a word (`twice serve`, once it gives up
            // waiting for a request line).
            None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                HttpError::NotTls { addr: addr.clone() }
            }
            _ => failed(e.to_string()),
        }
    })
}

/// A hyper error and its causes on one line.
fn why(e: &hyper::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
