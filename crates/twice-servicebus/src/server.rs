//! The listener: accepts AMQP connections within the limits, runs the HTTP side port, and
//! shuts down when told.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::backend::Backend;
use crate::connection::{self, Admission};
use crate::http;
use crate::metrics::Metrics;
use crate::options::ServerOptions;
use crate::shared::Shared;

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
    /// An option is out of range (see [`ServerOptions`]); nothing was bound.
    #[error("invalid server options: {0}")]
    InvalidOptions(String),
    /// Accepting connections failed.
    #[error("accepting connections failed: {0}")]
    Accept(#[source] std::io::Error),
}

/// The Service Bus front end: AMQP 1.0 for the SDKs, and an HTTP port for health, metrics and
/// the administration API.
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
    /// Binds the AMQP port and, if configured, the HTTP port, once the options are in range.
    pub async fn bind(options: ServerOptions, backend: B) -> Result<Self, ServerError> {
        options.check().map_err(ServerError::InvalidOptions)?;
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
        // The bound addresses, not the asked ones (port 0 picks a port): tokens must name these.
        let mut options = options;
        if let Ok(addr) = amqp.local_addr() {
            options.amqp_addr = addr;
        }
        if let Some(addr) = http.as_ref().and_then(|h| h.local_addr().ok()) {
            options.http_addr = Some(addr);
        }
        let shared = Arc::new(Shared { backend, options, metrics: Arc::new(Metrics::default()) });
        Ok(Self { shared, amqp, http })
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
        let slots = Arc::new(Semaphore::new(self.shared.options.max_connections));
        let pending = crate::pending::Pending::new(self.shared.options.max_pending_connections);
        let mut tasks = JoinSet::new();
        if let Some(listener) = self.http {
            let shared = self.shared.clone();
            let mut stop = stop_rx.clone();
            tasks.spawn(async move {
                tokio::select! {
                    () = http::serve(listener, shared) => {}
                    _ = stop.changed() => {}
                }
            });
        }
        tokio::pin!(shutdown);
        let mut accept_failures = 0u32;
        let result = loop {
            tokio::select! {
                () = &mut shutdown => break Ok(()),
                accepted = self.amqp.accept() => {
                    let (stream, _) = match accepted {
                        Ok(a) => a,
                        // Out of file descriptors and the like: wait and try again rather than
                        // stopping the server, backing off up to a second, with one warning
                        // for a run of failures rather than one per attempt.
                        Err(e) if is_transient(&e) => {
                            if accept_failures == 0 {
                                tracing::warn!(error = %e, "accept failed; retrying with backoff");
                            } else {
                                tracing::debug!(error = %e, failures = accept_failures, "accept failed");
                            }
                            let backoff = Duration::from_millis(5 << accept_failures.min(8));
                            accept_failures = accept_failures.saturating_add(1);
                            tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
                            continue;
                        }
                        Err(e) => break Err(ServerError::Accept(e)),
                    };
                    if accept_failures > 0 {
                        tracing::warn!(failures = accept_failures, "accepting connections again");
                        accept_failures = 0;
                    }
                    // A connection in its handshake holds a pending place, not a connection
                    // slot; past the pending limit a new connection evicts the oldest one
                    // still in its handshake, so idle or slow sockets cannot lock out a real
                    // client (which is through in milliseconds).
                    let (mut handshake, evicted) = pending.admit();
                    if evicted {
                        tracing::debug!("too many connections in their handshake: the oldest is dropped");
                    }
                    let _ = stream.set_nodelay(true);
                    let shared = self.shared.clone();
                    let stop = stop_rx.clone();
                    let slots = slots.clone();
                    match shared.options.tls.clone() {
                        None => {
                            let admission = Admission { handshake, slots };
                            tasks.spawn(connection::serve(stream, shared, stop, admission));
                        }
                        Some(tls) => {
                            tasks.spawn(async move {
                                // The TLS handshake holds the pending slot and is bounded like
                                // the AMQP handshake after it.
                                let limit = shared.options.handshake_timeout;
                                let clock = shared.options.clock.clone();
                                let accept = async move {
                                    let mut first = [0u8; 1];
                                    let plain = matches!(stream.peek(&mut first).await, Ok(1) if first[0] == b'A');
                                    if plain && crate::hint::AMQP_ON_AMQPS.due(clock.now()) {
                                        tracing::warn!(
                                            "a plain AMQP client reached the amqps (TLS) port: remove UseDevelopmentEmulator=true from its connection string"
                                        );
                                    }
                                    tokio_rustls::TlsAcceptor::from(tls).accept(stream).await
                                };
                                let accepted = tokio::select! {
                                    accepted = tokio::time::timeout(limit, accept) => accepted,
                                    () = handshake.evicted() => return,
                                };
                                let admission = Admission { handshake, slots };
                                match accepted {
                                    Ok(Ok(tls)) => {
                                        connection::serve(tls, shared, stop, admission)
                                            .await;
                                    }
                                    Ok(Err(e)) => {
                                        tracing::debug!(error = %e, "tls handshake failed");
                                    }
                                    Err(_) => tracing::debug!("tls handshake timed out"),
                                }
                            });
                        }
                    }
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
