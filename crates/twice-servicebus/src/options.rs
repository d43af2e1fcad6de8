//! Server options, builder-lite, with the defaults the SDKs and the official emulator expect.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use twice::SharedClock;

use crate::sas::Keys;

/// How a [`Server`](crate::Server) listens and what it allows.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub(crate) amqp_addr: SocketAddr,
    pub(crate) http_addr: Option<SocketAddr>,
    pub(crate) keys: Keys,
    pub(crate) max_frame_size: u32,
    pub(crate) max_connections: usize,
    pub(crate) max_pending_connections: usize,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_sessions_per_connection: usize,
    pub(crate) max_links_per_session: usize,
    pub(crate) max_unsettled_per_link: u32,
    pub(crate) max_message_size: u64,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_bytes_in_flight: usize,
    pub(crate) write_timeout: Duration,
    pub(crate) hostname: String,
    pub(crate) allowed_hosts: Vec<String>,
    pub(crate) max_http_answering: usize,
    pub(crate) max_http_receiving: usize,
    pub(crate) max_http_body: usize,
    pub(crate) http_receive_timeout: Duration,
    pub(crate) http_answer_timeout: Duration,
    pub(crate) tls: Option<Arc<rustls::ServerConfig>>,
    pub(crate) http_tls: Option<Arc<rustls::ServerConfig>>,
    pub(crate) clock: SharedClock,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            amqp_addr: SocketAddr::from(([127, 0, 0, 1], 5673)),
            http_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5300))),
            keys: Keys::emulator_default(),
            max_frame_size: 1024 * 1024,
            max_connections: 1024,
            max_pending_connections: 256,
            handshake_timeout: Duration::from_secs(10),
            max_sessions_per_connection: 256,
            max_links_per_session: 256,
            max_unsettled_per_link: 5000,
            max_message_size: 256 * 1024,
            idle_timeout: Duration::from_secs(120),
            max_bytes_in_flight: 16 * 1024 * 1024,
            write_timeout: Duration::from_secs(30),
            hostname: "localhost".to_owned(),
            allowed_hosts: Vec::new(),
            max_http_answering: 64,
            max_http_receiving: 256,
            max_http_body: 1024 * 1024,
            http_receive_timeout: Duration::from_secs(10),
            http_answer_timeout: Duration::from_secs(10),
            tls: None,
            http_tls: None,
            clock: SharedClock::system(),
        }
    }
}

impl ServerOptions {
    /// The defaults: AMQP on 127.0.0.1:5673, HTTP on 127.0.0.1:5300, the emulator's key, 1 MiB
    /// frames, 1024 connections (and 256 more in their handshake), a 10 s handshake, 256 sessions
    /// per connection, 256 links per session, 5000 unsettled deliveries per link,
    /// 256 KiB messages, 120 s idle timeout, 16 MiB of sends in flight per connection, 30 s
    /// socket writes; on the HTTP port 64 requests answered at once, 256 connections still
    /// sending their request, 1 MiB request bodies, 10 s to receive a request and 10 s to
    /// answer it.
    pub fn new() -> Self {
        Self::default()
    }

    /// The AMQP listen address (port 0 picks a free port).
    #[must_use]
    pub fn amqp_addr(mut self, addr: SocketAddr) -> Self {
        self.amqp_addr = addr;
        self
    }

    /// The HTTP listen address for `/health`, `/metrics` and `/entities`; `None` serves no HTTP.
    #[must_use]
    pub fn http_addr(mut self, addr: Option<SocketAddr>) -> Self {
        self.http_addr = addr;
        self
    }

    /// The shared access keys tokens are checked against.
    #[must_use]
    pub fn keys(mut self, keys: Keys) -> Self {
        self.keys = keys;
        self
    }

    /// The largest frame accepted (at least 512 bytes).
    #[must_use]
    pub fn max_frame_size(mut self, n: u32) -> Self {
        self.max_frame_size = n.max(crate::frame::MIN_MAX_FRAME_SIZE);
        self
    }

    /// The most connections served at once; more are refused.
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// The most connections that may be in their handshake (protocol headers, SASL and `open`)
    /// at once, apart from [`max_connections`](Self::max_connections); past it, a new
    /// connection evicts the oldest one still in its handshake, so idle or slow sockets cannot
    /// lock out a real client.
    #[must_use]
    pub fn max_pending_connections(mut self, n: usize) -> Self {
        self.max_pending_connections = n.max(1);
        self
    }

    /// How long a connection may take from its first byte to its `open`; a slower one is
    /// dropped.
    #[must_use]
    pub fn handshake_timeout(mut self, d: Duration) -> Self {
        self.handshake_timeout = d;
        self
    }

    /// The most AMQP sessions one connection may begin (the `channel-max` the server
    /// announces is one less); a `begin` beyond it closes the connection.
    #[must_use]
    pub fn max_sessions_per_connection(mut self, n: usize) -> Self {
        self.max_sessions_per_connection = n.clamp(1, 65_536);
        self
    }

    /// The most links one AMQP session may attach (the `handle-max` the server announces is
    /// one less); an attach beyond it closes the connection.
    #[must_use]
    pub fn max_links_per_session(mut self, n: usize) -> Self {
        self.max_links_per_session = n.max(1);
        self
    }

    /// The most unsettled deliveries a receiver link may hold.
    #[must_use]
    pub fn max_unsettled_per_link(mut self, n: u32) -> Self {
        self.max_unsettled_per_link = n.max(1);
        self
    }

    /// The largest message (or batch) accepted, in bytes.
    #[must_use]
    pub fn max_message_size(mut self, n: u64) -> Self {
        self.max_message_size = n;
        self
    }

    /// The idle timeout advertised; a peer silent for twice as long is disconnected.
    #[must_use]
    pub fn idle_timeout(mut self, d: Duration) -> Self {
        self.idle_timeout = d;
        self
    }

    /// The most bytes of sends one connection may have waiting for the broker; past it the
    /// connection stops reading its socket until the broker catches up.
    #[must_use]
    pub fn max_bytes_in_flight(mut self, n: usize) -> Self {
        self.max_bytes_in_flight = n;
        self
    }

    /// How long one write to a client may take; a client that stops reading is disconnected.
    #[must_use]
    pub fn write_timeout(mut self, d: Duration) -> Self {
        self.write_timeout = d;
        self
    }

    /// The host name put in the connection string.
    #[must_use]
    pub fn hostname(mut self, h: impl Into<String>) -> Self {
        self.hostname = h.into();
        self
    }

    /// Another host name the HTTP routes answer to, besides loopback's, the host name and the
    /// HTTP address: a request naming any other in its `Host` header (a web page that rebound
    /// its own name to this address) gets 421, except `/health`.
    #[must_use]
    pub fn allow_host(mut self, name: impl Into<String>) -> Self {
        self.allowed_hosts.push(name.into());
        self
    }

    /// The most HTTP requests answered at once (default 64): a connection takes one of these
    /// slots once its whole request is in, and holds it until its answer is written; more
    /// received requests wait for a slot. [`Server::bind`](crate::Server::bind) refuses 0.
    #[must_use]
    pub fn max_http_answering(mut self, n: usize) -> Self {
        self.max_http_answering = n;
        self
    }

    /// The most HTTP connections still sending their request (TLS handshake, head, body) at
    /// once (default 256); past it a new connection evicts the oldest of them, so idle or slow
    /// sockets cannot lock out a real client. [`Server::bind`](crate::Server::bind) refuses 0.
    #[must_use]
    pub fn max_http_receiving(mut self, n: usize) -> Self {
        self.max_http_receiving = n;
        self
    }

    /// The largest HTTP request body accepted, in bytes (default 1 MiB; an entity description
    /// is a few KiB); a larger one is answered `413 Payload Too Large` before it is read.
    /// [`Server::bind`](crate::Server::bind) refuses 0.
    #[must_use]
    pub fn max_http_body(mut self, n: usize) -> Self {
        self.max_http_body = n;
        self
    }

    /// How long an HTTP client may take for its TLS handshake, and then for its request (head
    /// and body), each (default 10 s); a slower one is dropped.
    /// [`Server::bind`](crate::Server::bind) refuses zero.
    #[must_use]
    pub fn http_receive_timeout(mut self, d: Duration) -> Self {
        self.http_receive_timeout = d;
        self
    }

    /// How long answering an HTTP request may take once it holds a slot, writing the answer
    /// included (default 10 s); past it the connection is dropped without an answer.
    /// [`Server::bind`](crate::Server::bind) refuses zero.
    #[must_use]
    pub fn http_answer_timeout(mut self, d: Duration) -> Self {
        self.http_answer_timeout = d;
        self
    }

    /// The clock for token expiry (default: the system clock; tests move time instead of
    /// waiting).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Serves amqps: TLS with this certificate chain and private key (PEM), as Azure does on
    /// port 5671. The connection string then leaves out `UseDevelopmentEmulator`, so clients
    /// use TLS.
    pub fn tls_pem(mut self, cert_chain: &[u8], key: &[u8]) -> Result<Self, TlsError> {
        self.tls = Some(server_config(cert_chain, key)?);
        Ok(self)
    }

    /// Serves https beside plain http on the HTTP port, with this certificate chain and private
    /// key (PEM): a connection that opens with a TLS handshake gets TLS, any other plain HTTP.
    /// Meant for a development certificate ([`DevCertificate`](crate::dev_tls::DevCertificate)),
    /// so that the SDKs' administration clients, which only speak https, work with
    /// configuration alone while browsers and scripts keep plain http. Without effect with
    /// [`tls_pem`](Self::tls_pem), whose certificate makes the port speak https only.
    pub fn http_tls_pem(mut self, cert_chain: &[u8], key: &[u8]) -> Result<Self, TlsError> {
        self.http_tls = Some(server_config(cert_chain, key)?);
        Ok(self)
    }

    /// Whether the server speaks TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The AMQP listen address.
    pub fn get_amqp_addr(&self) -> SocketAddr {
        self.amqp_addr
    }

    /// The HTTP listen address.
    pub fn get_http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The largest frame accepted.
    pub fn get_max_frame_size(&self) -> u32 {
        self.max_frame_size
    }

    /// The most connections served at once.
    pub fn get_max_connections(&self) -> usize {
        self.max_connections
    }

    /// The most connections in their handshake at once.
    pub fn get_max_pending_connections(&self) -> usize {
        self.max_pending_connections
    }

    /// How long a handshake may take.
    pub fn get_handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    /// The most sessions per connection.
    pub fn get_max_sessions_per_connection(&self) -> usize {
        self.max_sessions_per_connection
    }

    /// The most links per session.
    pub fn get_max_links_per_session(&self) -> usize {
        self.max_links_per_session
    }

    /// The most unsettled deliveries per receiver link.
    pub fn get_max_unsettled_per_link(&self) -> u32 {
        self.max_unsettled_per_link
    }

    /// The largest message accepted.
    pub fn get_max_message_size(&self) -> u64 {
        self.max_message_size
    }

    /// The most bytes of sends in flight per connection.
    pub fn get_max_bytes_in_flight(&self) -> usize {
        self.max_bytes_in_flight
    }

    /// How long one write to a client may take.
    pub fn get_write_timeout(&self) -> Duration {
        self.write_timeout
    }

    /// The idle timeout.
    pub fn get_idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// The most HTTP requests answered at once.
    pub fn get_max_http_answering(&self) -> usize {
        self.max_http_answering
    }

    /// The most HTTP connections still sending their request.
    pub fn get_max_http_receiving(&self) -> usize {
        self.max_http_receiving
    }

    /// The largest HTTP request body accepted.
    pub fn get_max_http_body(&self) -> usize {
        self.max_http_body
    }

    /// How long an HTTP client may take for its TLS handshake, and for its request.
    pub fn get_http_receive_timeout(&self) -> Duration {
        self.http_receive_timeout
    }

    /// How long answering an HTTP request may take.
    pub fn get_http_answer_timeout(&self) -> Duration {
        self.http_answer_timeout
    }

    /// Checks the values the setters take as given: each HTTP limit must let something
    /// through.
    pub(crate) fn check(&self) -> Result<(), String> {
        let refuse = |name: &str, why: &str| Err(format!("ServerOptions::{name}: {why}"));
        let max_permits = tokio::sync::Semaphore::MAX_PERMITS;
        if self.max_http_answering == 0 {
            return refuse("max_http_answering", "must be at least 1");
        }
        if self.max_http_answering > max_permits {
            return refuse("max_http_answering", &format!("must be at most {max_permits}"));
        }
        if self.max_http_receiving == 0 {
            return refuse("max_http_receiving", "must be at least 1");
        }
        if self.max_http_body == 0 {
            return refuse("max_http_body", "must be at least 1 byte");
        }
        if self.http_receive_timeout.is_zero() {
            return refuse("http_receive_timeout", "must be longer than zero");
        }
        if self.http_answer_timeout.is_zero() {
            return refuse("http_answer_timeout", "must be longer than zero");
        }
        Ok(())
    }

    /// The clock for token expiry.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// Why a certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("tls: {0}")]
pub struct TlsError(String);

/// A TLS server configuration from a PEM certificate chain and private key.
fn server_config(cert_chain: &[u8], key: &[u8]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert_chain)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError(format!("certificate: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError("no certificate in the certificate file".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError(format!("key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(e.to_string()))?;
    Ok(Arc::new(config))
}
