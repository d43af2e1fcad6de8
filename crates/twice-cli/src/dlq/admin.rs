//! The runtime counts of a namespace's queues and subscriptions, from the Service Bus
//! administration API (ATOM over HTTP): `twice serve`'s `--http` port, or `https://<namespace>`
//! on 443 for Azure. Every request carries `Authorization: SharedAccessSignature …` signed for
//! the namespace, which needs the `Manage` claim.
//!
//! A small HTTP/1.1 client (one `GET` per connection, `Connection: close`) is all it takes;
//! TLS is rustls with the webpki roots, as the AMQP client uses, or with the CA certificates
//! the user names (`--ca-file`).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use twice_servicebus_client::TlsOptions;
use twice_servicebus_client::atom::{blocks, element, iso_duration, parse_response};

/// How long one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The most entries a list returns at once.
const PAGE: usize = 100;

/// The variable that names the administration API for `twice dlq`, `twice demo` and `twice
/// health` when `--admin-url` (`--url`) is not given.
pub(crate) const ADMIN_URL_VAR: &str = "TWICE_ADMIN_URL";

/// An error of the administration API, one line each.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdminError {
    #[error(
        "cannot reach the administration API at {url}: {reason} (give --admin-url or set TWICE_ADMIN_URL: twice serve prints it)"
    )]
    Unreachable { url: String, reason: String },
    #[error(
        "unauthorized: the administration API at {url} refused the key (it needs the Manage claim): {detail}"
    )]
    Unauthorized { url: String, detail: String },
    #[error("no entity '{0}' in the namespace")]
    NotFound(String),
    #[error("the administration API answered {status} for {path}: {detail}")]
    Status { status: u16, path: String, detail: String },
    #[error(
        "the administration API at {url} has a certificate this machine does not trust: {reason} ({UNTRUSTED_HINT})"
    )]
    Untrusted { url: String, reason: String },
    #[error(
        "the administration API at {url} does not answer TLS: give its http:// address with --admin-url or TWICE_ADMIN_URL, or add UseDevelopmentEmulator=true; to the connection string"
    )]
    NotTls { url: String },
    #[error("the administration API at {url} did not answer HTTP: {reason}")]
    Protocol { url: String, reason: String },
}

/// How requests are signed.
#[derive(Clone)]
pub(crate) enum Auth {
    /// A key and its name: a token is signed per request.
    Key { name: String, key: String },
    /// A signature given as is.
    Signature(String),
    /// No token: for `/health`, which asks none.
    Anonymous,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Key { name, .. } => write!(f, "Key({name})"),
            Auth::Signature(_) => f.write_str("Signature(<redacted>)"),
            Auth::Anonymous => f.write_str("Anonymous"),
        }
    }
}

/// Where `twice serve`'s HTTP port is, for the commands that talk to it alone (`twice health`,
/// `twice reset`).
#[derive(Debug, clap::Args)]
pub(crate) struct ServeUrlArgs {
    /// `twice serve`'s HTTP port (its `--http`), as `http://HOST:PORT`, or `https://…` when it
    /// serves TLS. Default: the TWICE_ADMIN_URL variable, else `http://127.0.0.1:5300`.
    #[arg(
        long,
        env = ADMIN_URL_VAR,
        value_name = "URL",
        default_value = "http://127.0.0.1:5300",
        value_parser = AdminUrl::parse
    )]
    pub(crate) url: AdminUrl,
    /// Trust only the CA certificates in this PEM file for https.
    #[arg(long, value_name = "FILE")]
    pub(crate) ca_file: Option<std::path::PathBuf>,
}

impl ServeUrlArgs {
    /// An administration client for the URL, trusting `--ca-file` when given.
    pub(crate) fn client(&self, auth: Auth) -> anyhow::Result<AdminClient> {
        let ca = self.ca_file.as_deref().map(Ca::load).transpose().map_err(anyhow::Error::msg)?;
        Ok(Ca::admin(ca.as_ref(), AdminClient::new(self.url.clone(), auth)))
    }
}

/// Where the administration API is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AdminUrl {
    pub(crate) https: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl AdminUrl {
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        let (https, rest) = if let Some(r) = s.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = s.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(format!("expected http://HOST[:PORT] or https://HOST[:PORT], got {s:?}"));
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(format!("expected a URL without a path, got {s:?}"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                let port = p.parse().map_err(|_| format!("bad port in {s:?}"))?;
                (h.to_owned(), port)
            }
            _ => (authority.to_owned(), if https { 443 } else { 80 }),
        };
        Ok(Self { https, host, port })
    }

    fn base(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.port)
    }
}

impl std::fmt::Display for AdminUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.base())
    }
}

/// A queue or subscription with its counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct EntityCounts {
    /// `queue` or `topic/Subscriptions/name`.
    pub(crate) path: String,
    pub(crate) active: u64,
    pub(crate) dead_letter: u64,
    pub(crate) scheduled: u64,
    /// `MessageCount` less the three others: the administration API has no deferred count of
    /// its own.
    pub(crate) deferred: u64,
}

/// What resubmitting to an entity must know of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dedup {
    /// `None`: the entity has no duplicate detection.
    pub(crate) window: Option<Duration>,
}

/// What to do about a server certificate this machine does not trust.
const UNTRUSTED_HINT: &str = "a certificate signed by a CA of your own: give --ca-file with that CA; for twice serve's development certificate, the ca.pem its banner prints (dev-https/ in its data directory)";

/// What to do about a server that speaks plain AMQP to a connection string that asks for TLS.
pub(crate) const PLAIN_AMQP_HINT: &str = "the server speaks plain AMQP, without TLS: add UseDevelopmentEmulator=true; to the connection string";

/// The CA certificates of `--ca-file`, trusted for amqps and for the administration API over
/// https instead of the public roots.
#[derive(Clone, Debug)]
pub(crate) struct Ca(TlsOptions);

impl Ca {
    /// Reads the PEM file at `path`; an error names the file.
    pub(crate) fn load(path: &std::path::Path) -> Result<Self, String> {
        let pem = std::fs::read(path)
            .map_err(|e| format!("reading the CA file {}: {e}", path.display()))?;
        let tls = TlsOptions::with_ca_pem(&pem)
            .map_err(|e| format!("the CA file {}: {e}", path.display()))?;
        Ok(Self(tls))
    }

    /// The client options of `connection_string`, trusting this CA where they use TLS (an
    /// emulator connection string asks for plain AMQP, and keeps it).
    pub(crate) fn client_options(
        ca: Option<&Self>,
        connection_string: &str,
    ) -> Result<twice_servicebus_client::ClientOptions, twice_servicebus_client::Error> {
        let options =
            twice_servicebus_client::ClientOptions::from_connection_string(connection_string)?;
        Ok(match ca {
            Some(ca) if options.get_tls().is_some() => options.tls(Some(ca.0.clone())),
            _ => options,
        })
    }

    /// `admin`, trusting this CA for https.
    pub(crate) fn admin(ca: Option<&Self>, admin: AdminClient) -> AdminClient {
        match ca {
            Some(ca) => admin.trust(ca.0.root_store()),
            None => admin,
        }
    }

    /// What to add to the message of client error `e`: how to trust the server, when `e` is a
    /// TLS failure and no CA was given.
    /// A server that answers without TLS is told apart from one whose certificate is not
    /// trusted: it serves plain AMQP, which the connection string asks for with the emulator
    /// flag.
    pub(crate) fn hint(ca: Option<&Self>, e: &twice_servicebus_client::Error) -> String {
        match e {
            twice_servicebus_client::Error::NotTls { .. } => format!(" ({PLAIN_AMQP_HINT})"),
            twice_servicebus_client::Error::Tls(_) if ca.is_none() => {
                format!(" ({UNTRUSTED_HINT})")
            }
            _ => String::new(),
        }
    }
}

/// The administration API of one namespace.
#[derive(Debug)]
pub(crate) struct AdminClient {
    url: AdminUrl,
    auth: Auth,
    /// The roots https trusts: the webpki roots unless the user named others.
    roots: Arc<rustls::RootCertStore>,
}

impl AdminClient {
    pub(crate) fn new(url: AdminUrl, auth: Auth) -> Self {
        Self { url, auth, roots: TlsOptions::webpki_roots().root_store() }
    }

    /// Trusts these roots for https instead of the webpki ones.
    #[must_use]
    pub(crate) fn trust(mut self, roots: Arc<rustls::RootCertStore>) -> Self {
        self.roots = roots;
        self
    }

    /// The administration API of the namespace a connection string names: at `url`, else
    /// `http://HOST:5300` for the emulator (and `twice serve`'s default `--http`) or
    /// `https://HOST` for Azure; signed with the connection string's key or signature.
    pub(crate) fn for_connection_string(
        cs: &twice_servicebus_client::ConnectionString,
        url: Option<AdminUrl>,
    ) -> Result<Self, String> {
        let url = url.unwrap_or_else(|| AdminUrl {
            https: !cs.is_emulator(),
            host: cs.host().to_owned(),
            port: if cs.is_emulator() { 5300 } else { 443 },
        });
        let auth = match (cs.key_name(), cs.key(), cs.signature()) {
            (Some(name), Some(key), _) => Auth::Key { name: name.to_owned(), key: key.to_owned() },
            (_, _, Some(sig)) => Auth::Signature(sig.to_owned()),
            _ => return Err("the connection string has neither a key nor a signature".to_owned()),
        };
        Ok(Self::new(url, auth))
    }

    fn token(&self) -> String {
        match &self.auth {
            Auth::Signature(s) => s.clone(),
            Auth::Anonymous => String::new(),
            Auth::Key { name, key } => {
                // The namespace's root: the token covers every entity.
                let scheme = if self.url.https { "https" } else { "http" };
                let audience = format!("{scheme}://{}/", self.url.host);
                twice_servicebus_client::SasKeyProvider::new(name, key)
                    .sign(&audience)
                    .token()
                    .to_owned()
            }
        }
    }

    /// Every queue and subscription with its counts, queues first, in the API's order.
    pub(crate) async fn list(&self) -> Result<Vec<EntityCounts>, AdminError> {
        let mut out = Vec::new();
        for entry in self.feed("$Resources/queues").await? {
            out.push(counts_of(&entry));
        }
        for topic in self.feed("$Resources/topics").await? {
            let name = title(&topic);
            for entry in self.feed(&format!("{name}/Subscriptions")).await? {
                let mut c = counts_of(&entry);
                c.path = format!("{name}/Subscriptions/{}", c.path);
                out.push(c);
            }
        }
        Ok(out)
    }

    /// The counts of one queue or subscription (`topic/Subscriptions/name`).
    pub(crate) async fn counts(&self, entity: &str) -> Result<EntityCounts, AdminError> {
        let body = self.get(entity).await?;
        // An unknown path is answered with an empty feed, not an entry.
        if !body.contains("<entry") {
            return Err(AdminError::NotFound(entity.to_owned()));
        }
        Ok(EntityCounts { path: entity.to_owned(), ..counts_of(&body) })
    }

    /// The duplicate detection of a queue or topic.
    pub(crate) async fn dedup(&self, entity: &str) -> Result<Dedup, AdminError> {
        let body = self.get(entity).await?;
        // An unknown path is answered with an empty feed, not an entry.
        if !body.contains("<entry") {
            return Err(AdminError::NotFound(entity.to_owned()));
        }
        let on = element(&body, "RequiresDuplicateDetection").is_some_and(|v| v == "true");
        let window = element(&body, "DuplicateDetectionHistoryTimeWindow")
            .and_then(|v| iso_duration(&v))
            .unwrap_or(Duration::from_secs(600));
        Ok(Dedup { window: on.then_some(window) })
    }

    /// The entries of a feed, every page.
    async fn feed(&self, path: &str) -> Result<Vec<String>, AdminError> {
        let mut entries = Vec::new();
        loop {
            let body = self.get(&format!("{path}?$skip={}&$top={PAGE}", entries.len())).await?;
            let page: Vec<String> = blocks(&body, "entry");
            let n = page.len();
            entries.extend(page);
            if n < PAGE {
                return Ok(entries);
            }
        }
    }

    /// Creates a queue with these properties (the others at the service's defaults).
    pub(crate) async fn create_queue(
        &self,
        name: &str,
        lock: Duration,
        max_delivery_count: u32,
        duplicate_window: Duration,
    ) -> Result<(), AdminError> {
        let body = format!(
            concat!(
                r#"<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml">"#,
                r#"<QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect" "#,
                r#"xmlns:i="http://www.w3.org/2001/XMLSchema-instance">"#,
                "<LockDuration>PT{}S</LockDuration>",
                "<RequiresDuplicateDetection>true</RequiresDuplicateDetection>",
                "<DuplicateDetectionHistoryTimeWindow>PT{}S</DuplicateDetectionHistoryTimeWindow>",
                "<MaxDeliveryCount>{}</MaxDeliveryCount>",
                "</QueueDescription></content></entry>"
            ),
            lock.as_secs(),
            duplicate_window.as_secs(),
            max_delivery_count
        );
        self.request("PUT", name, Some(&body)).await.map(|_| ())
    }

    /// `POST /$reset` (`twice serve`'s own): empties every entity; returns how many there are
    /// and how long the server took.
    pub(crate) async fn reset(&self) -> Result<(u64, f64), AdminError> {
        let body = self.request("POST", "$reset", None).await?;
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| {
            AdminError::Protocol { url: self.url.base(), reason: format!("reset answer: {e}") }
        })?;
        let entities = v.get("entities").and_then(serde_json::Value::as_u64).unwrap_or(0);
        let ms = v.get("elapsed_ms").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        Ok((entities, ms))
    }

    /// `GET /health`: the status code and the body (`twice serve` answers 200 while it serves
    /// and 503 with the reason once it cannot).
    pub(crate) async fn health(&self) -> Result<(u16, String), AdminError> {
        let request = format!(
            "GET /health HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nConnection: close\r\n\r\n",
            self.url.host
        );
        let raw = tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request.as_bytes()))
            .await
            .map_err(|_| self.unreachable("no answer within 30 s"))??;
        parse_response(&raw).map_err(|reason| AdminError::Protocol { url: self.url.base(), reason })
    }

    async fn get(&self, path_and_query: &str) -> Result<String, AdminError> {
        self.request("GET", path_and_query, None).await
    }

    async fn request(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&str>,
    ) -> Result<String, AdminError> {
        let sep = if path_and_query.contains('?') { '&' } else { '?' };
        let target = format!("/{path_and_query}{sep}api-version=2021-05");
        let content = body.map_or(String::new(), |b| {
            format!("Content-Type: application/atom+xml\r\nContent-Length: {}\r\n", b.len())
        });
        let request = format!(
            "{method} {} HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nAccept: application/atom+xml\r\n{content}Connection: close\r\n\r\n{}",
            encode_path(&target),
            self.url.host,
            self.token(),
            body.unwrap_or_default()
        );
        let raw = tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request.as_bytes()))
            .await
            .map_err(|_| self.unreachable("no answer within 30 s"))??;
        let (status, body) = parse_response(&raw)
            .map_err(|reason| AdminError::Protocol { url: self.url.base(), reason })?;
        let entity = path_and_query.split('?').next().unwrap_or_default().to_owned();
        match status {
            200..=299 => Ok(body),
            401 | 403 => Err(AdminError::Unauthorized {
                url: self.url.base(),
                detail: element(&body, "Detail").unwrap_or(body),
            }),
            404 => Err(AdminError::NotFound(entity)),
            _ => Err(AdminError::Status {
                status,
                path: entity,
                detail: element(&body, "Detail").unwrap_or(body),
            }),
        }
    }

    fn unreachable(&self, reason: impl ToString) -> AdminError {
        AdminError::Unreachable { url: self.url.base(), reason: reason.to_string() }
    }

    async fn exchange(&self, request: &[u8]) -> Result<Vec<u8>, AdminError> {
        let tcp = TcpStream::connect((self.url.host.as_str(), self.url.port))
            .await
            .map_err(|e| self.unreachable(e))?;
        if !self.url.https {
            return roundtrip(tcp, request).await.map_err(|e| self.unreachable(e));
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| self.unreachable(e))?
        .with_root_certificates(self.roots.clone())
        .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from(self.url.host.clone())
            .map_err(|e| self.unreachable(e))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                Some(rustls::Error::InvalidCertificate(reason)) => {
                    AdminError::Untrusted { url: self.url.base(), reason: format!("{reason:?}") }
                }
                // A plain HTTP server answers the client hello with `HTTP/1.1 400`, or closes
                // the connection without a word (twice serve, once it gives up waiting for a
                // request line).
                Some(rustls::Error::InvalidMessage(_)) => {
                    AdminError::NotTls { url: self.url.base() }
                }
                None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    AdminError::NotTls { url: self.url.base() }
                }
                _ => self.unreachable(format!("tls: {e}")),
            })?;
        roundtrip(tls, request).await.map_err(|e| self.unreachable(e))
    }
}

async fn roundtrip<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    request: &[u8],
) -> std::io::Result<Vec<u8>> {
    s.write_all(request).await?;
    s.flush().await?;
    let mut out = Vec::new();
    match s.read_to_end(&mut out).await {
        Ok(_) => Ok(out),
        // A TLS peer that closes without close_notify after a whole response.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !out.is_empty() => Ok(out),
        Err(e) => Err(e),
    }
}

/// Percent-encodes what a path may not hold as is (`$` stays: the API's own paths use it).
fn encode_path(target: &str) -> String {
    let mut out = String::with_capacity(target.len());
    for b in target.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' => out.push(char::from(b)),
            b'-' | b'_' | b'.' | b'~' | b'/' | b'$' | b'?' | b'&' | b'=' => out.push(char::from(b)),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn title(entry: &str) -> String {
    element(entry, "title").unwrap_or_default()
}

fn counts_of(entry: &str) -> EntityCounts {
    let n = |name: &str| element(entry, name).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let (active, dead_letter, scheduled) =
        (n("ActiveMessageCount"), n("DeadLetterMessageCount"), n("ScheduledMessageCount"));
    let transfers = n("TransferMessageCount") + n("TransferDeadLetterMessageCount");
    let total = n("MessageCount");
    EntityCounts {
        path: title(entry),
        active,
        dead_letter,
        scheduled,
        deferred: total.saturating_sub(active + dead_letter + scheduled + transfers),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_and_without_ports() {
        let u = AdminUrl::parse("http://127.0.0.1:5300").unwrap();
        assert_eq!((u.https, u.host.as_str(), u.port), (false, "127.0.0.1", 5300));
        let u = AdminUrl::parse("https://ns.servicebus.windows.net/").unwrap();
        assert_eq!((u.https, u.port), (true, 443));
        assert!(AdminUrl::parse("ftp://x").is_err());
        assert!(AdminUrl::parse("http://x/path").is_err());
    }

    #[test]
    fn responses_parse_with_a_length_or_in_chunks() {
        let (s, b) = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").unwrap();
        assert_eq!((s, b.as_str()), (200, "abc"));
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let (s, b) = parse_response(chunked).unwrap();
        assert_eq!((s, b.as_str()), (404, "abcde"));
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }

    #[test]
    fn counts_come_from_the_entry_whatever_the_prefix() {
        let entry = r#"<title type="text">orders</title><content><QueueDescription><MessageCount>9</MessageCount><CountDetails xmlns:d2p1="x"><d2p1:ActiveMessageCount>3</d2p1:ActiveMessageCount><d2p1:DeadLetterMessageCount>2</d2p1:DeadLetterMessageCount><d2p1:ScheduledMessageCount>1</d2p1:ScheduledMessageCount><d2p1:TransferDeadLetterMessageCount>0</d2p1:TransferDeadLetterMessageCount><d2p1:TransferMessageCount>0</d2p1:TransferMessageCount></CountDetails></QueueDescription></content>"#;
        let c = counts_of(entry);
        assert_eq!(
            c,
            EntityCounts {
                path: "orders".into(),
                active: 3,
                dead_letter: 2,
                scheduled: 1,
                deferred: 3
            }
        );
        let feed =
            "<feed><entry><title>a</title></entry><entry><title>b&amp;c</title></entry></feed>";
        let titles: Vec<String> = blocks(feed, "entry").iter().map(|e| title(e)).collect();
        assert_eq!(titles, ["a", "b&c"]);
    }

    #[test]
    fn iso_durations_parse() {
        assert_eq!(iso_duration("PT10M"), Some(Duration::from_secs(600)));
        assert_eq!(iso_duration("P1DT2H"), Some(Duration::from_secs(93_600)));
        assert_eq!(iso_duration("PT0.5S"), Some(Duration::from_millis(500)));
        assert_eq!(iso_duration("10M"), None);
    }
}
