//! The runtime counts of a namespace's queues and subscriptions, from the Service Bus
//! administration API (ATOM over HTTP): `twice serve`'s `--http` port, or `https://<namespace>`
//! on 443 for Azure. Every request carries `Authorization: SharedAccessSignature …` signed for
//! the namespace, which needs the `Manage` claim.
//!
//! The requests go through the Service Bus client's HTTP client
//! ([`twice_servicebus_client::http`], one request per connection); TLS is rustls with the
//! webpki roots, as the AMQP client uses, or with the CA certificates the user names
//! (`--ca-file`).

use std::sync::Arc;
use std::time::Duration;

use twice_servicebus_client::TlsOptions;
use twice_servicebus_client::atom::{blocks, element, iso_duration};
use twice_servicebus_client::http::{self, HttpError, Method, Request, Target};

/// How long one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read: a page of a hundred entries is far below it.
const MAX_ANSWER: usize = 16 << 20;
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
    #[error("cannot send the request to the administration API at {url}: {reason}")]
    Request { url: String, reason: String },
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
        self.request(Method::PUT, name, Some(body)).await.map(|_| ())
    }

    /// `POST /$reset` (`twice serve`'s own): empties every entity; returns how many there are
    /// and how long the server took.
    pub(crate) async fn reset(&self) -> Result<(u64, f64), AdminError> {
        let body = self.request(Method::POST, "$reset", None).await?;
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
        let request = Request::get("/health")
            .header("Accept", "application/json")
            .timeout(REQUEST_TIMEOUT)
            .max_body(MAX_ANSWER);
        let answer =
            http::request(&self.target(), request).await.map_err(|e| self.request_error(e))?;
        Ok((answer.status().as_u16(), answer.text()))
    }

    async fn get(&self, path_and_query: &str) -> Result<String, AdminError> {
        self.request(Method::GET, path_and_query, None).await
    }

    async fn request(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<String>,
    ) -> Result<String, AdminError> {
        let sep = if path_and_query.contains('?') { '&' } else { '?' };
        let target = format!("/{path_and_query}{sep}api-version=2021-05");
        let mut request = Request::new(method, encode_path(&target))
            .header("Accept", "application/atom+xml")
            .timeout(REQUEST_TIMEOUT)
            .max_body(MAX_ANSWER);
        if !matches!(self.auth, Auth::Anonymous) {
            request = request.header("Authorization", self.token());
        }
        if let Some(body) = body {
            request = request.body("application/atom+xml", body);
        }
        let answer =
            http::request(&self.target(), request).await.map_err(|e| self.request_error(e))?;
        let (status, body) = (answer.status().as_u16(), answer.text());
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

    /// Where the requests go: https trusts the client's roots.
    fn target(&self) -> Target {
        if self.url.https {
            Target::https(self.url.host.as_str(), self.url.port, Arc::clone(&self.roots))
        } else {
            Target::http(self.url.host.as_str(), self.url.port)
        }
    }

    /// A request that got no answer, in the words of this API and with what to do about it.
    fn request_error(&self, e: HttpError) -> AdminError {
        let url = self.url.base();
        match e {
            HttpError::Connect { source, .. } => {
                AdminError::Unreachable { url, reason: source.to_string() }
            }
            HttpError::Timeout { after, .. } => AdminError::Unreachable {
                url,
                reason: format!("no answer within {} s", after.as_secs()),
            },
            HttpError::Untrusted { reason, .. } => AdminError::Untrusted { url, reason },
            HttpError::NotTls { .. } => AdminError::NotTls { url },
            HttpError::Tls { reason, .. } => {
                AdminError::Unreachable { url, reason: format!("tls: {reason}") }
            }
            HttpError::Request(reason) => AdminError::Request { url, reason },
            HttpError::Protocol { reason, .. } => AdminError::Protocol { url, reason },
            // A body too large.
            e => AdminError::Protocol { url, reason: e.to_string() },
        }
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
