//! An entity's properties from the namespace's administration API (ATOM over HTTP(S)): the
//! lock duration, MaxDeliveryCount, time to live, sessions and duplicate detection a
//! processor's decisions rest on. AMQP does not carry them, and `$management` has no operation
//! that reads them.
//!
//! Azure serves the API on `https://<namespace>` (443); the emulator and `twice serve` on a
//! port of their own, `http://<host>:5300` by default. Reading an entity needs the `Manage`
//! claim, which a processor's `Listen` key lacks: the receiver then says so in a warning and
//! goes on with the Service Bus defaults, or with what `ReceiverOptions::entity_info` gives.
//!
//! One `GET` per connection (`Connection: close`), rustls for https with the roots the AMQP
//! connection trusts.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use twice::EntityInfo;

use crate::atom::{element, iso_duration, parse_response};
use crate::client::Inner;
use crate::endpoint::AdminEndpoint;
use crate::error::Error;
use crate::token::TokenType;

/// How long one request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest response read.
const MAX_RESPONSE: usize = 1 << 20;
/// Service Bus writes "no time to live" as `TimeSpan.MaxValue`.
const FOREVER_DAYS: u64 = 10_675_199;

/// The entity `path` (a queue, or `topic/Subscriptions/name`; a `/$DeadLetterQueue` reads
/// its parent's) as the administration API describes it. A subscription's time to live is the
/// shorter of its own and its topic's, and its duplicate detection its topic's. A dead-letter
/// queue has its parent's lock, and no delivery limit, sessions or time to live (as the
/// embedded broker reports it).
pub(crate) async fn entity_properties(inner: &Inner, path: &str) -> Result<EntityInfo, Error> {
    let parent = strip_dead_letter(path);
    let dead_letter = parent.len() < path.len();
    let entry = get(inner, parent).await?;
    let mut info = EntityInfo::new(path);
    if let Some(d) = element(&entry, "LockDuration").and_then(|v| iso_duration(&v)) {
        info.lock_duration = d;
    }
    info.max_delivery_count = element(&entry, "MaxDeliveryCount").and_then(|v| v.parse().ok());
    info.requires_session = element(&entry, "RequiresSession").is_some_and(|v| v == "true");
    info.message_time_to_live = ttl(&entry);
    let dedup_of = match parent.split_once("/Subscriptions/") {
        Some((topic, _)) => {
            let topic = get(inner, topic).await?;
            info.message_time_to_live = match (info.message_time_to_live, ttl(&topic)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            topic
        }
        None => entry,
    };
    info.duplicate_detection_window = (element(&dedup_of, "RequiresDuplicateDetection")
        .is_some_and(|v| v == "true"))
    .then(|| {
        element(&dedup_of, "DuplicateDetectionHistoryTimeWindow")
            .and_then(|v| iso_duration(&v))
            .unwrap_or(Duration::from_secs(600))
    });
    if dead_letter {
        // A dead-letter queue never dead-letters again, has no sessions and keeps its
        // messages until they are received.
        info.max_delivery_count = None;
        info.requires_session = false;
        info.message_time_to_live = None;
    }
    Ok(info)
}

/// The path without its `/$DeadLetterQueue` (any case).
fn strip_dead_letter(path: &str) -> &str {
    const SUFFIX: &str = "/$deadletterqueue";
    let n = path.len().saturating_sub(SUFFIX.len());
    match path.get(n..) {
        Some(tail) if tail.eq_ignore_ascii_case(SUFFIX) => &path[..n],
        _ => path,
    }
}

/// The entity's time to live; `None` when it has none.
fn ttl(entry: &str) -> Option<Duration> {
    element(entry, "DefaultMessageTimeToLive")
        .and_then(|v| iso_duration(&v))
        .filter(|d| d.as_secs() / 86_400 < FOREVER_DAYS)
}

/// The ATOM entry of `path`.
async fn get(inner: &Inner, path: &str) -> Result<String, Error> {
    let endpoint = inner.options.get_admin_endpoint();
    let scheme = if endpoint.is_https() { "https" } else { "http" };
    // A token for the namespace: it covers every entity.
    let audience = format!("{scheme}://{}/", endpoint.host());
    let token = inner.options.provider().token(&audience).await?;
    let authorization = match token.token_type() {
        TokenType::Jwt => format!("Bearer {}", token.token()),
        _ => token.token().to_owned(),
    };
    let request = format!(
        "GET /{}?api-version=2021-05 HTTP/1.1\r\nHost: {}\r\nAuthorization: {authorization}\r\n\
         Accept: application/atom+xml\r\nConnection: close\r\n\r\n",
        encode_path(path),
        endpoint.host(),
    );
    let operation = format!("GET {endpoint}/{path}");
    let raw = tokio::time::timeout(REQUEST_TIMEOUT, exchange(inner, &endpoint, request.as_bytes()))
        .await
        .map_err(|_| Error::Timeout)??;
    let (status, body) = parse_response(&raw).map_err(|e| {
        Error::Invalid(format!("{operation}: the administration API did not answer HTTP: {e}"))
    })?;
    let failed = |status: u16, description: String| Error::Management {
        operation: operation.clone(),
        status: i32::from(status),
        condition: None,
        description,
    };
    match status {
        // An unknown path is answered with an empty feed, not an entry.
        200..=299 if body.contains("<entry") => Ok(body),
        200..=299 => Err(failed(404, format!("no entity {path:?} in the namespace"))),
        _ => Err(failed(status, element(&body, "Detail").unwrap_or(body))),
    }
}

async fn exchange(
    inner: &Inner,
    endpoint: &AdminEndpoint,
    request: &[u8],
) -> Result<Vec<u8>, Error> {
    let addr = format!("{}:{}", endpoint.host(), endpoint.port());
    let tcp = TcpStream::connect((endpoint.host(), endpoint.port()))
        .await
        .map_err(|source| Error::Connect { addr: addr.clone(), source })?;
    if !endpoint.is_https() {
        return roundtrip(tcp, request).await.map_err(|source| Error::Connect { addr, source });
    }
    let roots = inner
        .options
        .get_tls()
        .map_or_else(|| crate::TlsOptions::webpki_roots().root_store(), |t| t.root_store());
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Tls(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(endpoint.host().to_owned())
        .map_err(|e| Error::Tls(e.to_string()))?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| Error::Tls(e.to_string()))?;
    roundtrip(tls, request).await.map_err(|source| Error::Connect { addr, source })
}

async fn roundtrip<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    request: &[u8],
) -> std::io::Result<Vec<u8>> {
    s.write_all(request).await?;
    s.flush().await?;
    let mut out = Vec::new();
    let mut limited = (&mut s).take(u64::try_from(MAX_RESPONSE).unwrap_or(u64::MAX));
    match limited.read_to_end(&mut out).await {
        Ok(_) => Ok(out),
        // A TLS peer that closes without close_notify after a whole response.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !out.is_empty() => Ok(out),
        Err(e) => Err(e),
    }
}

/// Percent-encodes what a path may not hold as is (`$` and `/` stay).
fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' | b'$' => {
                out.push(char::from(b));
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_elements_read_as_service_bus_writes_them() {
        assert_eq!(iso_duration("PT30S"), Some(Duration::from_secs(30)));
        assert_eq!(iso_duration("PT1M30.5S"), Some(Duration::from_millis(90_500)));
        assert_eq!(iso_duration("P14D"), Some(Duration::from_secs(14 * 86_400)));
        assert_eq!(iso_duration("P1DT2H"), Some(Duration::from_secs(86_400 + 7200)));
        assert_eq!(iso_duration("30S"), None);
        let entry = "<entry><content><QueueDescription xmlns=\"x\"><LockDuration>PT45S</LockDuration>\
                     <d2p1:MaxDeliveryCount>3</d2p1:MaxDeliveryCount>\
                     <DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S</DefaultMessageTimeToLive>\
                     </QueueDescription></content></entry>";
        assert_eq!(element(entry, "LockDuration").as_deref(), Some("PT45S"));
        assert_eq!(element(entry, "MaxDeliveryCount").as_deref(), Some("3"));
        assert_eq!(ttl(entry), None, "TimeSpan.MaxValue is no time to live");
        assert_eq!(strip_dead_letter("q/$DeadLetterQueue"), "q");
        assert_eq!(strip_dead_letter("t/Subscriptions/s/$deadletterqueue"), "t/Subscriptions/s");
        assert_eq!(strip_dead_letter("q"), "q");
    }
}
