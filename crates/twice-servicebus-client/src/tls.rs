//! TLS (amqps) with rustls: the webpki roots for Azure, or a custom CA (a private namespace
//! proxy, `twice serve --tls-cert` in tests).

use std::fmt;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::engine::Engine;
use crate::error::Error;

/// Which certificates the client trusts.
#[derive(Clone)]
pub struct TlsOptions {
    roots: Arc<RootCertStore>,
    server_name: Option<String>,
}

impl fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsOptions")
            .field("roots", &self.roots.len())
            .field("server_name", &self.server_name)
            .finish()
    }
}

impl TlsOptions {
    /// The Mozilla root certificates compiled into the client (`webpki-roots`), which include
    /// the roots Azure Service Bus certificates chain to.
    pub fn webpki_roots() -> Self {
        let roots = RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        Self { roots: Arc::new(roots), server_name: None }
    }

    /// Trust only the CA certificates in this PEM text.
    pub fn with_ca_pem(pem: &[u8]) -> Result<Self, Error> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| Error::Tls(format!("bad CA certificate: {e}")))?;
            roots.add(cert).map_err(|e| Error::Tls(format!("unusable CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(Error::Tls("no certificate in the CA file".into()));
        }
        Ok(Self { roots: Arc::new(roots), server_name: None })
    }

    /// The root certificates trusted, for another TLS client of the same servers (such as an
    /// https client of the namespace's administration API).
    pub fn root_store(&self) -> Arc<RootCertStore> {
        self.roots.clone()
    }

    /// The name to check the server's certificate against, when it differs from the host
    /// connected to (default: the host).
    #[must_use]
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }
}

/// Opens TCP (and TLS with `tls`) to the namespace at `host`:`port` and starts an AMQP
/// connection on it.
pub(crate) async fn connect(
    host: &str,
    port: u16,
    tls: Option<&TlsOptions>,
) -> Result<Engine, Error> {
    let addr = format!("{host}:{port}");
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|source| Error::Connect { addr: addr.clone(), source })?;
    // Settlements and requests are small frames; waiting to batch them only adds latency.
    tcp.set_nodelay(true).map_err(|source| Error::Connect { addr: addr.clone(), source })?;
    let Some(tls) = tls else {
        return Engine::start(tcp, host).await;
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_root_certificates(tls.roots.clone())
        .with_no_client_auth();
    let name = tls.server_name.clone().unwrap_or_else(|| host.to_owned());
    let name = ServerName::try_from(name).map_err(|e| Error::Tls(e.to_string()))?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| handshake_error(&e, &addr))?;
    Engine::start(stream, host).await
}

/// A failed TLS handshake: [`Error::NotTls`] when the peer's answer was not TLS at all (a
/// plain AMQP server answers the client hello with its protocol header, `AMQP…`, which rustls
/// reads as a record of an invalid content type), [`Error::Tls`] otherwise (a certificate the
/// client does not trust, a protocol version it refuses).
fn handshake_error(e: &std::io::Error, addr: &str) -> Error {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidMessage(_)) => Error::NotTls { addr: addr.to_owned() },
        _ => Error::Tls(e.to_string()),
    }
}
