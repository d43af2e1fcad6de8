//! The console's JSON API: counts, peeks and sessions to read, resubmit and purge to change.
//! It reads what the `twice dlq` commands read, through the same [`Backend`] the AMQP side
//! serves.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use twice::SequenceNumber;
use twice_broker::config::EntityDefinition;

use super::auth::{authorize, reads_need_token};
use super::{ApiError, Request, Response};
use crate::backend::{Backend, BackendError, BackendSession, EntityKind, ReceiveMode, Settlement};
use crate::sas::{Claim, url_decode};
use crate::shared::Shared;

/// The most messages one peek returns.
const MAX_PEEK: usize = 100;
/// The most sessions one page lists.
const MAX_SESSIONS: usize = 50;
/// The most sequence numbers one resubmit or purge names.
const MAX_SEQUENCES: usize = 100;
/// The most dead-lettered messages one resubmit or purge looks through to find those it names.
const MAX_SCAN: usize = 5_000;
/// Messages locked per receive while looking.
const SCAN_BATCH: usize = 100;
/// The longest entity path accepted.
const MAX_PATH: usize = 260;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// The parameters of a query string: only the names a request knows, each at most once.
#[derive(Debug, Default)]
pub(super) struct Query(Vec<(String, String)>);

impl Query {
    pub(super) fn parse(raw: &str, known: &[&str]) -> Result<Self, ApiError> {
        let mut out: Vec<(String, String)> = Vec::new();
        for pair in raw.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let (Some(k), Some(v)) = (url_decode(k), url_decode(v)) else {
                return Err(bad(format!("the parameter '{pair}' is not well percent-encoded")));
            };
            if !known.contains(&k.as_str()) {
                return Err(bad(format!("unknown parameter '{k}' (known: {})", known.join(", "))));
            }
            if out.iter().any(|(seen, _)| *seen == k) {
                return Err(bad(format!("the parameter '{k}' is given twice")));
            }
            out.push((k, v));
        }
        Ok(Self(out))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// A whole number in `min..=max`, `default` when absent.
    fn number(&self, name: &str, default: u64, min: u64, max: u64) -> Result<u64, ApiError> {
        let Some(raw) = self.get(name) else { return Ok(default) };
        match raw.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            _ => {
                Err(bad(format!("{name} must be a whole number from {min} to {max}, not '{raw}'")))
            }
        }
    }

    fn flag(&self, name: &str) -> Result<bool, ApiError> {
        match self.get(name) {
            None | Some("0" | "false") => Ok(false),
            Some("1" | "true") => Ok(true),
            Some(other) => Err(bad(format!("{name} must be 1, 0, true or false, not '{other}'"))),
        }
    }
}

/// Checks an entity path as a parameter gives it: normalised, not empty, without `$` (a
/// dead-letter queue is asked for with `dlq=1`), not too long.
fn entity_path(raw: Option<&str>) -> Result<String, ApiError> {
    let raw = raw.ok_or_else(|| bad("the parameter 'entity' is required"))?;
    let path = crate::address::normalize(raw);
    if path.is_empty() || path.len() > MAX_PATH || path.contains('$') {
        return Err(bad(format!(
            "'{raw}' is not an entity path (a queue, topic or topic/subscriptions/name of at most {MAX_PATH} characters, without '$')"
        )));
    }
    if path.chars().any(char::is_control) {
        return Err(bad("an entity path has no control characters"));
    }
    Ok(path)
}

/// The kind of an existing queue or subscription (what holds messages and a dead-letter
/// queue).
async fn holder_of_messages<B: Backend>(backend: &B, path: &str) -> Result<EntityKind, ApiError> {
    match backend.entity(path).await {
        Some(k @ (EntityKind::Queue { .. } | EntityKind::Subscription { .. })) => Ok(k),
        Some(_) => Err(bad(format!("'{path}' is a topic: its messages are in its subscriptions"))),
        // A broker whose storage failed answers no question: the entity is not missing.
        None => match backend.health() {
            Err(reason) => Err(ApiError::Unavailable(format!(
                "the broker cannot serve until restarted: {reason}"
            ))),
            Ok(()) => {
                Err(ApiError::NotFound(format!("the messaging entity '{path}' could not be found")))
            }
        },
    }
}

/// Checks the token for a read of message contents, unless the server has no key.
fn authorize_read<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
    path: &str,
) -> Result<(), ApiError> {
    if reads_need_token(shared) {
        authorize(shared, addr, req, &[path], &[Claim::Listen])
    } else {
        Ok(())
    }
}

/// `GET /$console/api/entities`: every entity's counts and its operation totals since the
/// server started, with the server's time, so the page computes rates between two polls.
pub(super) async fn entities<B: Backend>(shared: &Shared<B>) -> Response {
    let counters = shared.metrics.entities();
    let mut list = Vec::new();
    for s in shared.backend.stats().await {
        // The AMQP side counts under the normalised (lowercase) path.
        let c = counters.get(&s.path.to_ascii_lowercase()).cloned().unwrap_or_default();
        let sessions = shared.backend.entity(&s.path).await.is_some_and(|k| k.requires_session());
        list.push(serde_json::json!({
            "path": s.path,
            "kind": s.kind,
            "requires_session": sessions,
            "active": s.active,
            "scheduled": s.scheduled,
            "deferred": s.deferred,
            "dead_letter": s.dead_letter,
            "sends": c.sends,
            "receives": c.receives,
            "completes": c.completes,
            "dead_letters": c.dead_letters,
        }));
    }
    let body = serde_json::json!({
        "time_ms": shared.options.clock.now().as_millis(),
        "reads_need_token": reads_need_token(shared),
        "entities": list,
    });
    Response::json("200 OK", &body)
}

/// `GET /$console/api/peek`: up to `max` messages of an entity (or, with `dlq=1`, of its
/// dead-letter queue) from sequence number `from` on, without locking them.
pub(super) async fn peek<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
    q: &Query,
) -> Result<Response, ApiError> {
    let entity = entity_path(q.get("entity"))?;
    let dlq = q.flag("dlq")?;
    let from = q.number("from", 0, 0, i64::MAX.unsigned_abs())?;
    let max = q.number("max", 20, 1, MAX_PEEK as u64)?;
    holder_of_messages(&shared.backend, &entity).await?;
    authorize_read(shared, addr, req, &entity)?;
    let path = if dlq { format!("{entity}/$deadletterqueue") } else { entity.clone() };
    let from = SequenceNumber::new(i64::try_from(from).unwrap_or(i64::MAX));
    let max = usize::try_from(max).unwrap_or(MAX_PEEK);
    let messages = shared.backend.peek(&path, None, from, max).await?;
    let next = messages.last().map(|m| m.sequence_number.get().saturating_add(1));
    let body = serde_json::json!({
        "entity": entity,
        "path": path,
        "messages": messages.iter().map(twice::dead_letter::view_json).collect::<Vec<_>>(),
        "next_from": next,
    });
    Ok(Response::json("200 OK", &body))
}

/// `GET /$console/api/sessions`: the sessions of a session-enabled entity, each with its
/// message count (up to [`MAX_PEEK`], then `"more": true`) and, when no receiver holds it, its
/// state. Reading the state takes the session lock for the moment of the read; a receiver that
/// asks for that one session in that moment is told it is locked, as when another receiver
/// holds it, and may ask again.
pub(super) async fn sessions<B: Backend>(
    shared: &Shared<B>,
    addr: SocketAddr,
    req: &Request<'_>,
    q: &Query,
) -> Result<Response, ApiError> {
    let entity = entity_path(q.get("entity"))?;
    let skip = usize::try_from(q.number("skip", 0, 0, 1_000_000)?).unwrap_or(0);
    let top = q.number("top", 20, 1, MAX_SESSIONS as u64)?;
    let top = usize::try_from(top).unwrap_or(MAX_SESSIONS);
    if !holder_of_messages(&shared.backend, &entity).await?.requires_session() {
        return Err(bad(format!("'{entity}' does not require sessions")));
    }
    authorize_read(shared, addr, req, &entity)?;
    let backend = &shared.backend;
    let mut list = Vec::new();
    for id in backend.list_sessions(&entity, skip, top).await? {
        let first = SequenceNumber::new(0);
        let peeked = backend.peek(&entity, Some(id.clone()), first, MAX_PEEK + 1).await?;
        let mut o = serde_json::json!({
            "session_id": id.as_str(),
            "messages": peeked.len().min(MAX_PEEK),
            "more": peeked.len() > MAX_PEEK,
        });
        let fields = match backend.accept_session(&entity, Some(id), Duration::ZERO).await {
            Ok(Some(session)) => {
                let state = session.get_state().await;
                session.close().await;
                let state = state?;
                serde_json::json!({
                    "locked": false,
                    "state_size": state.as_ref().map(|s| s.len()),
                    "state_preview": state.as_deref().map(twice::dead_letter::preview),
                })
            }
            Ok(None) | Err(BackendError::SessionCannotBeLocked(_)) => {
                serde_json::json!({ "locked": true })
            }
            Err(e) => return Err(e.into()),
        };
        if let (Some(o), serde_json::Value::Object(f)) = (o.as_object_mut(), fields) {
            o.extend(f);
        }
        list.push(o);
    }
    let body = serde_json::json!({ "entity": entity, "skip": skip, "sessions": list });
    Ok(Response::json("200 OK", &body))
}

/// A POST body: a JSON object with only the fields a request knows.
struct Body(serde_json::Map<String, serde_json::Value>);

impl Body {
    fn parse(raw: &[u8], known: &[&str]) -> Result<Self, ApiError> {
        let value: serde_json::Value =
            serde_json::from_slice(raw).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
        let serde_json::Value::Object(map) = value else {
            return Err(bad("the body must be a JSON object"));
        };
        if let Some(k) = map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(bad(format!("unknown field '{k}' (known: {})", known.join(", "))));
        }
        Ok(Self(map))
    }

    fn text(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.0.get(name) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(bad(format!("'{name}' must be a string"))),
        }
    }

    fn flag(&self, name: &str) -> Result<bool, ApiError> {
        match self.0.get(name) {
            None | Some(serde_json::Value::Null) => Ok(false),
            Some(serde_json::Value::Bool(b)) => Ok(*b),
            Some(_) => Err(bad(format!("'{name}' must be true or false"))),
        }
    }

    /// `sequence_numbers`: 1 to [`MAX_SEQUENCES`] numbers, each at least 1.
    fn sequences(&self) -> Result<BTreeSet<i64>, ApiError> {
        let Some(serde_json::Value::Array(items)) = self.0.get("sequence_numbers") else {
            return Err(bad("'sequence_numbers' must be an array of sequence numbers"));
        };
        if items.is_empty() || items.len() > MAX_SEQUENCES {
            return Err(bad(format!("'sequence_numbers' must hold 1 to {MAX_SEQUENCES} numbers")));
        }
        items
            .iter()
            .map(|v| match v.as_i64() {
                Some(n) if n >= 1 => Ok(n),
                _ => Err(bad(format!("{v} is not a sequence number (a whole number from 1)"))),
            })
            .collect()
    }
}

/// What to do with each dead-lettered message asked for.
#[derive(Debug)]
enum Action {
    /// Send a copy to `target` and complete the dead-lettered one once the send is
    /// acknowledged; a message whose copy the target would drop as a duplicate (enqueued less
    /// than `window` ago, when it keeps its id) stays.
    Resubmit { target: String, new_id: bool, window: Option<Duration> },
    /// Complete it.
    Purge,
}

/// What became of the messages asked for.
#[derive(Debug, Default)]
struct Outcome {
    done: Vec<i64>,
    /// Left dead-lettered: inside the target's duplicate-detection window.
    kept: Vec<i64>,
    /// Sent, but the dead-lettered one could not be completed: in both places.
    in_both: Vec<(i64, String)>,
    /// Not found among the first [`MAX_SCAN`] dead-lettered messages.
    missing: Vec<i64>,
    /// Why the work stopped early, if it did.
    failure: Option<ApiError>,
}

/// Locks the dead-lettered messages of `dlq` batch by batch until every wanted one was seen
/// (or [`MAX_SCAN`] were), acts on the wanted ones, and releases the others at the end, so
/// each is seen once.
async fn settle_wanted<B: Backend>(
    shared: &Shared<B>,
    dlq: &str,
    mut wanted: BTreeSet<i64>,
    action: &Action,
) -> Outcome {
    let backend = &shared.backend;
    let now = shared.options.clock.now();
    let mut out = Outcome::default();
    let mut held = Vec::new();
    let mut scanned = 0usize;
    while !wanted.is_empty() && scanned < MAX_SCAN && out.failure.is_none() {
        // No wait: the messages asked for are there now or gone; a wait would also run on the
        // broker's clock, which a test may hold still.
        let batch =
            match backend.receive(dlq, ReceiveMode::PeekLock, SCAN_BATCH, Duration::ZERO).await {
                Ok(b) if b.is_empty() => break,
                Ok(b) => b,
                Err(e) => {
                    out.failure = Some(e.into());
                    break;
                }
            };
        for m in batch {
            scanned += 1;
            let Some(lock) = m.lock_token else { continue };
            let seq = m.sequence_number.get();
            if out.failure.is_some() || !wanted.remove(&seq) {
                held.push(lock);
                continue;
            }
            if let Action::Resubmit { target, new_id, window } = action {
                if window.is_some_and(|w| m.enqueued_time.saturating_add(w) > now) {
                    out.kept.push(seq);
                    held.push(lock);
                    continue;
                }
                if let Err(e) = backend
                    .send(target, vec![twice::dead_letter::resubmit_copy(&m.message, *new_id)])
                    .await
                {
                    let prefix = format!("sending the copy of #{seq} to '{target}' failed: ");
                    let e = ApiError::from(e).around(&prefix, "; it stays dead-lettered");
                    out.failure = Some(e);
                    held.push(lock);
                    continue;
                }
            }
            match backend.settle(dlq, lock, Settlement::Complete).await {
                Ok(()) => out.done.push(seq),
                Err(e) => out.in_both.push((seq, e.to_string())),
            }
        }
    }
    // The messages not asked for go back at once, not when their locks expire.
    for lock in held {
        let _ = backend.settle(dlq, lock, Settlement::Release).await;
    }
    out.missing = wanted.into_iter().collect();
    out
}

/// Runs the work in a task of its own, so that it ends even if the request is dropped, and
/// answers with what became of each message.
async fn run<B: Backend>(
    shared: &Arc<Shared<B>>,
    dlq: String,
    wanted: BTreeSet<i64>,
    action: Action,
) -> Result<Response, ApiError> {
    let task_shared = shared.clone();
    let task_dlq = dlq.clone();
    let out =
        tokio::spawn(async move { settle_wanted(&task_shared, &task_dlq, wanted, &action).await })
            .await
            .map_err(|e| ApiError::Internal(format!("the operation's task failed: {e}")))?;
    let in_both: Vec<_> = out
        .in_both
        .iter()
        .map(|(seq, why)| serde_json::json!({ "sequence_number": seq, "error": why }))
        .collect();
    let body = serde_json::json!({
        "path": dlq,
        "done": out.done,
        "kept": out.kept,
        "missing": out.missing,
        "in_both": in_both,
        "error": out.failure.as_ref().map(|e| serde_json::json!({ "code": e.code(), "message": e.to_string() })),
    });
    // Work that stopped before its first message is the error itself; after, a partial result.
    match out.failure {
        Some(e) if out.done.is_empty() => Err(e),
        _ => Ok(Response::json("200 OK", &body)),
    }
}

/// The duplicate-detection window of `target` if it has one.
async fn dedup_window<B: Backend>(backend: &B, target: &str) -> Result<Option<Duration>, ApiError> {
    match backend.admin_get(target).await {
        Ok(EntityDefinition::Queue { properties: p, .. }) => {
            Ok(p.requires_duplicate_detection.then_some(p.duplicate_detection_history_time_window))
        }
        Ok(EntityDefinition::Topic { properties: p, .. }) => {
            Ok(p.requires_duplicate_detection.then_some(p.duplicate_detection_history_time_window))
        }
        Ok(_) => Ok(None),
        Err(BackendError::Unsupported(_)) => Err(bad(format!(
            "cannot tell whether '{target}' detects duplicates: resubmit with \"new_id\": true"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// `POST /$console/api/resubmit` with `{"entity": E, "sequence_numbers": [..], "to": T,
/// "new_id": false}`: sends a copy of each named dead-lettered message of `E` to `T` (default
/// `E`, which must then be a queue) and completes the dead-lettered one only once the send is
/// acknowledged, as `twice dlq resubmit` does: a failure between the two leaves a duplicate,
/// never a loss.
pub(super) async fn resubmit<B: Backend>(
    shared: &Arc<Shared<B>>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Result<Response, ApiError> {
    let body = Body::parse(req.body, &["entity", "sequence_numbers", "to", "new_id"])?;
    let entity = entity_path(body.text("entity")?)?;
    let wanted = body.sequences()?;
    let new_id = body.flag("new_id")?;
    let kind = holder_of_messages(&shared.backend, &entity).await?;
    let target = match body.text("to")? {
        Some(t) => entity_path(Some(t))?,
        None if matches!(kind, EntityKind::Subscription { .. }) => {
            return Err(bad(format!(
                "'{entity}' is a subscription, which cannot be sent to: give \"to\" (its topic or a queue)"
            )));
        }
        None => entity.clone(),
    };
    match shared.backend.entity(&target).await {
        Some(EntityKind::Queue { .. } | EntityKind::Topic) => {}
        Some(_) => return Err(bad(format!("'{target}' cannot be sent to: give a queue or topic"))),
        None => {
            return Err(ApiError::NotFound(format!(
                "the messaging entity '{target}' could not be found"
            )));
        }
    }
    authorize(shared, addr, req, &[&entity, &target], &[Claim::Send, Claim::Listen])?;
    let window = if new_id { None } else { dedup_window(&shared.backend, &target).await? };
    let dlq = format!("{entity}/$deadletterqueue");
    run(shared, dlq, wanted, Action::Resubmit { target, new_id, window }).await
}

/// `POST /$console/api/purge` with `{"entity": E, "sequence_numbers": [..]}`: deletes those
/// dead-lettered messages of `E`.
pub(super) async fn purge<B: Backend>(
    shared: &Arc<Shared<B>>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Result<Response, ApiError> {
    let body = Body::parse(req.body, &["entity", "sequence_numbers"])?;
    let entity = entity_path(body.text("entity")?)?;
    let wanted = body.sequences()?;
    holder_of_messages(&shared.backend, &entity).await?;
    authorize(shared, addr, req, &[&entity], &[Claim::Send, Claim::Listen])?;
    run(shared, format!("{entity}/$deadletterqueue"), wanted, Action::Purge).await
}
