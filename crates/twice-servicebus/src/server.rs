//! The listener: accepts AMQP connections within the limits, serves the HTTP side port, and
//! shuts down when told.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use twice::SharedClock;

use crate::backend::Backend;
use crate::metrics::Metrics;
use crate::options::ServerOptions;
use crate::performative::AmqpError;

/// How many connections over the limit are answered with a close at once.
const MAX_REFUSING: usize = 16;

/// What every connection shares.
#[derive(Debug)]
pub(crate) struct Shared<B> {
    pub(crate) backend: B,
    pub(crate) options: ServerOptions,
    pub(crate) clock: SharedClock,
    pub(crate) metrics: Arc<Metrics>,
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Binding a listen address failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Accepting connections failed.
    #[error("accepting connections failed: {0}")]
    Accept(#[source] std::io::Error),
}

/// The Service Bus front end: AMQP 1.0 for the SDKs, and an HTTP port for health and metrics.
///
/// [`Server::bind`] opens the ports (so the caller can print the addresses and the connection
/// string at once); [`Server::run`] serves until the shutdown future resolves. The server
/// prints nothing.
#[derive(Debug)]
pub struct Server<B> {
    shared: Arc<Shared<B>>,
    amqp: TcpListener,
    http: Option<TcpListener>,
}

impl<B: Backend> Server<B> {
    /// Binds the AMQP port and, if configured, the HTTP port.
    pub async fn bind(options: ServerOptions, backend: B) -> Result<Self, ServerError> {
        let amqp = TcpListener::bind(options.amqp_addr)
            .await
            .map_err(|source| ServerError::Bind { addr: options.amqp_addr, source })?;
        let http = match options.http_addr {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Bind { addr, source })?,
            ),
            None => None,
        };
        let shared = Arc::new(Shared {
            backend,
            options,
            clock: SharedClock::system(),
            metrics: Arc::new(Metrics::default()),
        });
        Ok(Self { shared, amqp, http })
    }

    /// Uses this clock for token expiry (tests move time instead of waiting).
    #[must_use]
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.clock = clock;
        }
        self
    }

    /// The bound AMQP address.
    pub fn amqp_addr(&self) -> SocketAddr {
        self.amqp.local_addr().unwrap_or(self.shared.options.amqp_addr)
    }

    /// The bound HTTP address, if serving HTTP.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The connection string for the SDKs, with the first configured key (the emulator's by
    /// default).
    pub fn connection_string(&self) -> String {
        let opts = &self.shared.options;
        let (name, key) =
            opts.keys.first().unwrap_or(("RootManageSharedAccessKey", "SAS_KEY_VALUE"));
        // Over TLS the string names no emulator, so clients use TLS (on the given port).
        let emulator = if opts.tls.is_some() { "" } else { "UseDevelopmentEmulator=true;" };
        format!(
            "Endpoint=sb://{}:{};SharedAccessKeyName={name};SharedAccessKey={key};{emulator}",
            opts.hostname,
            self.amqp_addr().port()
        )
    }

    /// The server's counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    /// Serves until `shutdown` resolves, then closes every connection (with a close frame)
    /// and returns.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops accepting; connections already accepted end when their tasks
    /// are dropped with the runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let permits = Arc::new(Semaphore::new(self.shared.options.max_connections));
        let refusals = Arc::new(Semaphore::new(MAX_REFUSING));
        let mut tasks = JoinSet::new();
        if let Some(http) = self.http {
            let shared = self.shared.clone();
            let mut stop = stop_rx.clone();
            tasks.spawn(async move {
                tokio::select! {
                    () = serve_http(http, shared) => {}
                    _ = stop.changed() => {}
                }
            });
        }
        tokio::pin!(shutdown);
        let result = loop {
            tokio::select! {
                () = &mut shutdown => break Ok(()),
                accepted = self.amqp.accept() => {
                    let (stream, _) = match accepted {
                        Ok(a) => a,
                        // Out of file descriptors and the like: wait and try again rather than
                        // stopping the server.
                        Err(e) if is_transient(&e) => {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                        Err(e) => break Err(ServerError::Accept(e)),
                    };
                    let Ok(permit) = permits.clone().try_acquire_owned() else {
                        tracing::warn!("connection refused: the connection limit is reached");
                        // The client is told why (a quota error) rather than reset, by a few
                        // refusals at a time: past that, a flood is dropped.
                        if let Ok(refusing) = refusals.clone().try_acquire_owned() {
                            let shared = self.shared.clone();
                            let error = AmqpError::new(
                                "amqp:resource-limit-exceeded",
                                format!(
                                    "the server serves at most {} connections",
                                    shared.options.max_connections
                                ),
                            );
                            tasks.spawn(async move {
                                crate::connection::refuse(stream, shared, error).await;
                                drop(refusing);
                            });
                        }
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let shared = self.shared.clone();
                    let stop = stop_rx.clone();
                    tasks.spawn(async move {
                        shared.metrics.connection_opened();
                        match shared.options.tls.clone() {
                            None => crate::connection::serve(stream, shared.clone(), stop).await,
                            Some(tls) => {
                                // The TLS handshake is bounded like the AMQP one after it.
                                let accept = tokio_rustls::TlsAcceptor::from(tls).accept(stream);
                                match tokio::time::timeout(Duration::from_secs(10), accept).await {
                                    Ok(Ok(tls)) => {
                                        crate::connection::serve(tls, shared.clone(), stop).await;
                                    }
                                    Ok(Err(e)) => tracing::debug!(error = %e, "tls handshake failed"),
                                    Err(_) => tracing::debug!("tls handshake timed out"),
                                }
                            }
                        }
                        shared.metrics.connection_closed();
                        drop(permit);
                    });
                    // Reap finished tasks so the set does not grow.
                    while tasks.try_join_next().is_some() {}
                }
            }
        };
        let _ = stop_tx.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        tasks.abort_all();
        result
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
    ) || e.raw_os_error().is_some()
}

async fn serve_http<B: Backend>(listener: TcpListener, shared: Arc<Shared<B>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(10), http_request(stream, &shared)).await;
        });
    }
}

async fn http_request<B: Backend>(
    mut stream: TcpStream,
    shared: &Shared<B>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() > 16 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("").split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/health") => ("200 OK", "application/json", r#"{"status":"healthy"}"#.to_owned()),
        ("GET", "/metrics") => {
            ("200 OK", "text/plain; version=0.0.4", crate::http::metrics_text(shared).await)
        }
        ("GET", "/entities") => {
            ("200 OK", "application/json", crate::http::entities_json(shared).await)
        }
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "method not allowed\n".to_owned()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
