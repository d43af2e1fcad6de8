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
//! One `GET` per connection (`Connection: close`) through [`crate::http`], rustls for https
//! with the roots the AMQP connection trusts.

use std::time::Duration;

use twice::EntityInfo;

use crate::atom::{element, iso_duration};
use crate::client::Inner;
use crate::endpoint::AdminEndpoint;
use crate::error::Error;
use crate::http::{self, HttpError, Request, Target};
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
    let request = Request::get(format!("/{}?api-version=2021-05", encode_path(path)))
        .header("Authorization", authorization)
        .header("Accept", "application/atom+xml")
        .timeout(REQUEST_TIMEOUT)
        .max_body(MAX_RESPONSE);
    let operation = format!("GET {endpoint}/{path}");
    let response = http::request(&target(inner, &endpoint), request)
        .await
        .map_err(|e| request_error(&operation, e))?;
    let (status, body) = (response.status().as_u16(), response.text());
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

/// Where the API is, with the roots the AMQP connection trusts for https.
fn target(inner: &Inner, endpoint: &AdminEndpoint) -> Target {
    if !endpoint.is_https() {
        return Target::http(endpoint.host(), endpoint.port());
    }
    let roots = inner
        .options
        .get_tls()
        .map_or_else(|| crate::TlsOptions::webpki_roots().root_store(), |t| t.root_store());
    Target::https(endpoint.host(), endpoint.port(), roots)
}

/// The client's error for a request that got no answer: a connection refused and a time-out
/// as the AMQP connection reports them (both transient), TLS as TLS.
fn request_error(operation: &str, e: HttpError) -> Error {
    match e {
        HttpError::Connect { addr, source } => Error::Connect { addr, source },
        HttpError::Timeout { .. } => Error::Timeout,
        e @ (HttpError::Untrusted { .. } | HttpError::NotTls { .. } | HttpError::Tls { .. }) => {
            Error::Tls(e.to_string())
        }
        e => Error::Invalid(format!("{operation}: {e}")),
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
