//! `$management` request/response: the operations the SDKs run beside their links (research
//! §7), and the request and reply envelopes `$cbs` shares.
//!
//! A reply carries `correlation-id` = the request's `message-id` with its AMQP type, and the
//! status as `statusCode` (int) / `statusDescription` / `errorCondition` (symbol).

use std::sync::Arc;

use bytes::Bytes;
use twice::{DeadLetterReason, LockToken, Message, MessageId, SequenceNumber, SessionId};

use twice_broker::config::{CorrelationFilter, Filter};
use twice_broker::sql::{SqlAction, SqlFilter};

use crate::backend::{Backend, BackendError, BackendSession, ReceiveMode, Rule, Settlement};
use crate::codec::{DecodeError, Decoder, Value};
use crate::conditions::{self as cond, backend_error};
use crate::mapping::{self, Presentation, Sections};
use crate::metrics::{Counter, Metrics};
use crate::performative::described_list;
use crate::sas::Claim;

/// A request on `$management` or `$cbs`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Request {
    /// `properties.message-id`, any AMQP type.
    pub(crate) message_id: Value,
    /// `properties.reply-to`.
    pub(crate) reply_to: Option<String>,
    /// Application properties.
    pub(crate) properties: Vec<(Value, Value)>,
    /// The `amqp-value` body.
    pub(crate) body: Value,
}

impl Request {
    /// Parses a request message.
    pub(crate) fn parse(payload: &[u8]) -> Result<Self, DecodeError> {
        let mut req = Request {
            message_id: Value::Null,
            reply_to: None,
            properties: Vec::new(),
            body: Value::Null,
        };
        let mut d = Decoder::new(payload);
        while !d.is_empty() {
            let v = d.value()?;
            match v.descriptor_code() {
                Some(0x73) => {
                    let f = v.undescribed().as_seq().unwrap_or(&[]);
                    req.message_id = f.first().cloned().unwrap_or(Value::Null);
                    req.reply_to = f.get(4).and_then(|r| r.as_str()).map(str::to_owned);
                }
                Some(0x74) => {
                    req.properties = v.undescribed().as_map().map(<[_]>::to_vec).unwrap_or_default()
                }
                Some(0x77) => req.body = v.undescribed().clone(),
                _ => {}
            }
        }
        Ok(req)
    }

    /// The `operation` application property.
    pub(crate) fn operation(&self) -> Option<&str> {
        self.properties
            .iter()
            .find(|(k, _)| k.as_str() == Some("operation"))
            .and_then(|(_, v)| v.as_str())
    }
}

/// A reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    /// `properties.to` (the request's reply-to).
    pub(crate) to: Option<String>,
    /// `properties.correlation-id`.
    pub(crate) correlation_id: Value,
    /// Application properties.
    pub(crate) properties: Vec<(Value, Value)>,
    /// The `amqp-value` body.
    pub(crate) body: Value,
}

impl Reply {
    /// The encoded message.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        described_list(
            0x73,
            vec![
                Value::Null,
                Value::Null,
                self.to.clone().map_or(Value::Null, Value::String),
                Value::Null,
                Value::Null,
                self.correlation_id.clone(),
            ],
        )
        .encode(&mut out);
        Value::described(0x74, Value::Map(self.properties.clone())).encode(&mut out);
        Value::described(0x77, self.body.clone()).encode(&mut out);
        out
    }
}

/// The outcome of an operation before it is wrapped in a reply.
struct Status {
    code: i32,
    condition: Option<&'static str>,
    description: String,
    body: Value,
}

impl Status {
    fn ok(body: Value) -> Self {
        Self { code: 200, condition: None, description: "OK".into(), body }
    }

    fn no_content() -> Self {
        Self {
            code: 204,
            condition: Some(cond::MESSAGE_NOT_FOUND),
            description: "No messages".into(),
            body: Value::Map(vec![]),
        }
    }

    fn error(code: i32, condition: &'static str, description: impl Into<String>) -> Self {
        Self {
            code,
            condition: Some(condition),
            description: description.into(),
            body: Value::Null,
        }
    }

    fn backend(e: &BackendError) -> Self {
        let code = match e {
            BackendError::LockLost | BackendError::SessionLockLost => 410,
            BackendError::EntityNotFound(_) | BackendError::MessageNotFound(_) => 404,
            BackendError::SessionCannotBeLocked(_) | BackendError::AlreadyExists(_) => 409,
            BackendError::QuotaExceeded(_) => 403,
            BackendError::Invalid(_) | BackendError::MessageSizeExceeded(_) => 400,
            BackendError::Unsupported(_) => 501,
            BackendError::Unavailable(_) | BackendError::StorageFailed(_) => 503,
        };
        let err = backend_error(e);
        let condition = cond::of_backend(e);
        Self {
            code,
            condition: Some(condition),
            description: err.description.unwrap_or_default(),
            body: Value::Null,
        }
    }
}

/// The reply to a request that could not be parsed.
pub(crate) fn decode_error(e: &DecodeError) -> Reply {
    reply(None, Value::Null, Status::error(400, cond::DECODE_ERROR, e.to_string()))
}

/// The reply to a request the connection's tokens do not allow.
pub(crate) fn unauthorized(req: &Request, why: String) -> Reply {
    reply(req.reply_to.clone(), req.message_id.clone(), Status::error(401, cond::UNAUTHORIZED, why))
}

/// The claim an operation needs: scheduling is sending, rules are managing, the rest (peek,
/// locks, settlement, deferred messages, sessions) is listening.
pub(crate) fn claim_of(req: &Request) -> Claim {
    match req.operation().unwrap_or("") {
        "com.microsoft:schedule-message" | "com.microsoft:cancel-scheduled-message" => Claim::Send,
        "com.microsoft:add-rule"
        | "com.microsoft:remove-rule"
        | "com.microsoft:enumerate-rules" => Claim::Manage,
        _ => Claim::Listen,
    }
}

/// The `session-id` a request names, if any.
pub(crate) fn session_id(req: &Request) -> Option<String> {
    text(&req.body, "session-id")
}

/// Handles one `$management` request for `entity`. `held` is the session this connection
/// holds under the request's `session-id`, if it names one. Returns the reply and the locks the
/// request settled (so the connection ignores later dispositions for them).
///
/// # Cancel safety
///
/// Not cancel safe: a request dropped half way may have settled some of its locks.
pub(crate) async fn handle<B: Backend>(
    backend: &B,
    metrics: &Metrics,
    held: Option<Arc<B::Session>>,
    entity: &str,
    req: Request,
) -> (Reply, Vec<LockToken>) {
    let op = req.operation().unwrap_or("").to_owned();
    let mut settled = Vec::new();
    let ctx = Ctx { backend, metrics, held, entity };
    let status = match run(&ctx, &op, &req.body, &mut settled).await {
        Ok(s) | Err(s) => s,
    };
    if status.code >= 300 && status.code != 404 {
        tracing::debug!(operation = %op, code = status.code, "management request failed");
    }
    (reply(req.reply_to.clone(), req.message_id.clone(), status), settled)
}

/// What a request runs against.
struct Ctx<'a, B: Backend> {
    backend: &'a B,
    metrics: &'a Metrics,
    held: Option<Arc<B::Session>>,
    entity: &'a str,
}

impl<B: Backend> Ctx<'_, B> {
    /// The session the request names, which this connection must hold.
    fn held(&self, sid: Option<&str>) -> Result<Arc<B::Session>, Status> {
        let sid = sid.ok_or_else(|| bad("'session-id' is missing"))?;
        self.held.clone().ok_or_else(|| {
            Status::error(
                410,
                cond::SESSION_LOCK_LOST,
                format!("the session '{sid}' is not locked by this receiver"),
            )
        })
    }
}

fn reply(to: Option<String>, correlation_id: Value, s: Status) -> Reply {
    let mut properties = vec![
        (Value::string("statusCode"), Value::Int(s.code)),
        (Value::string("statusDescription"), Value::String(s.description)),
    ];
    if let Some(c) = s.condition {
        properties.push((Value::string("errorCondition"), Value::symbol(c)));
    }
    Reply { to, correlation_id, properties, body: s.body }
}

fn bad(description: impl Into<String>) -> Status {
    Status::error(400, cond::ARGUMENT, description)
}

fn uuids(body: &Value, key: &str) -> Result<Vec<LockToken>, Status> {
    let items =
        body.get(key).and_then(Value::as_seq).ok_or_else(|| bad(format!("'{key}' is missing")))?;
    items
        .iter()
        .map(|v| match v {
            Value::Uuid(u) => Ok(LockToken::from_uuid(*u)),
            _ => Err(bad(format!("'{key}' must hold uuids"))),
        })
        .collect()
}

fn longs(body: &Value, key: &str) -> Result<Vec<SequenceNumber>, Status> {
    let items =
        body.get(key).and_then(Value::as_seq).ok_or_else(|| bad(format!("'{key}' is missing")))?;
    items
        .iter()
        .map(|v| {
            v.as_i64()
                .map(SequenceNumber::new)
                .ok_or_else(|| bad(format!("'{key}' must hold longs")))
        })
        .collect()
}

fn text(body: &Value, key: &str) -> Option<String> {
    body.get(key).and_then(Value::as_str).map(str::to_owned)
}

fn int(body: &Value, key: &str) -> Option<i64> {
    body.get(key).and_then(Value::as_i64)
}

fn messages_list(items: Vec<Value>) -> Value {
    Value::Map(vec![(Value::string("messages"), Value::List(items))])
}

async fn run<B: Backend>(
    ctx: &Ctx<'_, B>,
    op: &str,
    body: &Value,
    settled: &mut Vec<LockToken>,
) -> Result<Status, Status> {
    let backend = ctx.backend;
    let entity = ctx.entity;
    let session_id = text(body, "session-id");
    match op {
        "com.microsoft:renew-lock" => {
            let mut expirations = Vec::new();
            for lock in uuids(body, "lock-tokens")? {
                let until =
                    backend.renew_lock(entity, lock).await.map_err(|e| Status::backend(&e))?;
                expirations.push(until.as_millis());
            }
            Ok(Status::ok(Value::Map(vec![(
                Value::string("expirations"),
                Value::timestamp_array(expirations),
            )])))
        }
        "com.microsoft:update-disposition" => {
            let status = text(body, "disposition-status").unwrap_or_default();
            let props = mapping::properties_of(body.get("properties-to-modify"), &[]);
            let how = match status.as_str() {
                "completed" => Settlement::Complete,
                "abandoned" => Settlement::Abandon(props),
                "defered" | "deferred" => Settlement::Defer(props),
                "suspended" => Settlement::DeadLetter(
                    DeadLetterReason::new(
                        text(body, "deadletter-reason").unwrap_or_default(),
                        text(body, "deadletter-description").unwrap_or_default(),
                    ),
                    props,
                ),
                other => return Err(bad(format!("unknown disposition-status '{other}'"))),
            };
            let counter = match &how {
                Settlement::Complete => Counter::Complete,
                Settlement::Abandon(_) => Counter::Abandon,
                Settlement::DeadLetter(..) => Counter::DeadLetter,
                _ => Counter::Receive,
            };
            let session = match &session_id {
                Some(sid) => Some(ctx.held(Some(sid.as_str()))?),
                None => None,
            };
            for lock in uuids(body, "lock-tokens")? {
                let r = match &session {
                    Some(s) => s.settle(lock, how.clone()).await,
                    None => backend.settle(entity, lock, how.clone()).await,
                };
                match r {
                    Ok(()) => {
                        settled.push(lock);
                        if counter != Counter::Receive {
                            ctx.metrics.add(entity, counter, 1);
                        }
                    }
                    Err(e) => {
                        if matches!(e, BackendError::LockLost | BackendError::SessionLockLost) {
                            ctx.metrics.add(entity, Counter::LockLost, 1);
                        }
                        return Err(Status::backend(&e));
                    }
                }
            }
            Ok(Status::ok(Value::Map(vec![])))
        }
        "com.microsoft:peek-message" => {
            let from = SequenceNumber::new(int(body, "from-sequence-number").unwrap_or(1).max(0));
            let count = usize::try_from(int(body, "message-count").unwrap_or(1).clamp(1, 1000))
                .unwrap_or(1);
            let found = backend
                .peek(entity, session_id.map(SessionId::new), from, count)
                .await
                .map_err(|e| Status::backend(&e))?;
            if found.is_empty() {
                return Ok(Status::no_content());
            }
            let items = found
                .iter()
                .map(|m| {
                    let bytes = mapping::encode_received(m, Presentation::Unlocked);
                    Value::Map(vec![(Value::string("message"), Value::Binary(Bytes::from(bytes)))])
                })
                .collect();
            Ok(Status::ok(messages_list(items)))
        }
        "com.microsoft:schedule-message" => {
            let items = body
                .get("messages")
                .and_then(Value::as_seq)
                .ok_or_else(|| bad("'messages' is missing"))?;
            let mut messages = Vec::with_capacity(items.len());
            for item in items {
                let raw = item
                    .get("message")
                    .and_then(Value::as_binary)
                    .ok_or_else(|| bad("a scheduled message has no 'message'"))?;
                let mut m: Message =
                    Sections::parse(raw).map_err(|e| bad(e.to_string()))?.to_message();
                if m.message_id.is_none() {
                    m.message_id = text(item, "message-id").map(MessageId::new);
                }
                if m.session_id.is_none() {
                    m.session_id = text(item, "session-id").map(SessionId::new);
                }
                if m.partition_key.is_none() {
                    m.partition_key = text(item, "partition-key");
                }
                messages.push(m);
            }
            let n = u64::try_from(messages.len()).unwrap_or(0);
            let seqs = backend.schedule(entity, messages).await.map_err(|e| Status::backend(&e))?;
            ctx.metrics.add(entity, Counter::Send, n);
            Ok(Status::ok(Value::Map(vec![(
                Value::string("sequence-numbers"),
                Value::long_array(seqs.iter().map(|s| s.get())),
            )])))
        }
        "com.microsoft:cancel-scheduled-message" => {
            let seqs = longs(body, "sequence-numbers")?;
            backend.cancel_scheduled(entity, seqs).await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![])))
        }
        "com.microsoft:receive-by-sequence-number" => {
            let seqs = longs(body, "sequence-numbers")?;
            let mode = match int(body, "receiver-settle-mode") {
                Some(0) => ReceiveMode::ReceiveAndDelete,
                _ => ReceiveMode::PeekLock,
            };
            let found = match &session_id {
                Some(sid) => ctx.held(Some(sid.as_str()))?.receive_deferred(mode, seqs).await,
                None => backend.receive_deferred(entity, mode, seqs).await,
            }
            .map_err(|e| Status::backend(&e))?;
            if found.is_empty() {
                return Ok(Status::no_content());
            }
            ctx.metrics.add(entity, Counter::Receive, u64::try_from(found.len()).unwrap_or(0));
            let items = found
                .iter()
                .map(|m| {
                    let bytes = mapping::encode_received(m, Presentation::Locked);
                    let mut entry = Vec::new();
                    if let Some(lock) = m.lock_token {
                        entry.push((Value::string("lock-token"), Value::Uuid(*lock.as_uuid())));
                    }
                    entry.push((Value::string("message"), Value::Binary(Bytes::from(bytes))));
                    Value::Map(entry)
                })
                .collect();
            Ok(Status::ok(messages_list(items)))
        }
        "com.microsoft:renew-session-lock" => {
            let s = ctx.held(session_id.as_deref())?;
            let until = s.renew().await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![(
                Value::string("expiration"),
                Value::Timestamp(until.as_millis()),
            )])))
        }
        "com.microsoft:get-session-state" => {
            let s = ctx.held(session_id.as_deref())?;
            let state = s.get_state().await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![(
                Value::string("session-state"),
                state.map_or(Value::Null, Value::Binary),
            )])))
        }
        "com.microsoft:set-session-state" => {
            let s = ctx.held(session_id.as_deref())?;
            let state = match body.get("session-state") {
                Some(Value::Binary(b)) => Some(b.clone()),
                Some(Value::Null) | None => None,
                Some(_) => return Err(bad("'session-state' must be binary")),
            };
            s.set_state(state).await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![])))
        }
        "com.microsoft:get-message-sessions" => {
            let skip = usize::try_from(int(body, "skip").unwrap_or(0).max(0)).unwrap_or(0);
            let top =
                usize::try_from(int(body, "top").unwrap_or(100).clamp(1, 1000)).unwrap_or(100);
            let ids =
                backend.list_sessions(entity, skip, top).await.map_err(|e| Status::backend(&e))?;
            if ids.is_empty() {
                return Ok(Status::no_content());
            }
            Ok(Status::ok(Value::Map(vec![
                (Value::string("skip"), Value::Int(i32::try_from(skip).unwrap_or(i32::MAX))),
                (
                    Value::string("sessions-ids"),
                    Value::string_array(ids.iter().map(|s| s.as_str().to_owned())),
                ),
            ])))
        }
        "com.microsoft:add-rule" => {
            let name = text(body, "rule-name").ok_or_else(|| bad("'rule-name' is missing"))?;
            let desc =
                body.get("rule-description").ok_or_else(|| bad("'rule-description' is missing"))?;
            let rule = rule_of(name, desc)?;
            backend.add_rule(entity, rule).await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![])))
        }
        "com.microsoft:remove-rule" => {
            let name = text(body, "rule-name").ok_or_else(|| bad("'rule-name' is missing"))?;
            backend.remove_rule(entity, &name).await.map_err(|e| Status::backend(&e))?;
            Ok(Status::ok(Value::Map(vec![])))
        }
        "com.microsoft:enumerate-rules" => {
            let skip = usize::try_from(int(body, "skip").unwrap_or(0).max(0)).unwrap_or(0);
            let top = usize::try_from(int(body, "top").unwrap_or(100).max(0)).unwrap_or(100);
            let rules = backend.rules(entity).await.map_err(|e| Status::backend(&e))?;
            let items: Vec<Value> = rules.iter().skip(skip).take(top).map(rule_value).collect();
            if items.is_empty() {
                return Ok(Status::no_content());
            }
            Ok(Status::ok(Value::Map(vec![(Value::string("rules"), Value::List(items))])))
        }
        other => Err(Status::error(
            501,
            cond::NOT_IMPLEMENTED,
            format!("operation '{other}' is not supported"),
        )),
    }
}

/// Descriptor codes of the rule types (`com.microsoft:*:list`), as the SDKs match them.
const SQL_FILTER: u64 = 0x0000_0013_7000_0006;
const TRUE_FILTER: u64 = 0x0000_0013_7000_0007;
const FALSE_FILTER: u64 = 0x0000_0013_7000_0008;
const CORRELATION_FILTER: u64 = 0x0000_0013_7000_0009;
const RULE_DESCRIPTION: u64 = 0x0000_0137_0000_0004;
const EMPTY_ACTION: u64 = 0x0000_0137_0000_0005;
const SQL_ACTION: u64 = 0x0000_0137_0000_0006;

/// A rule from an `add-rule` description map (`sql-filter` / `correlation-filter` /
/// `sql-rule-action`); a SQL expression that does not parse is a bad request.
fn rule_of(name: String, desc: &Value) -> Result<Rule, Status> {
    let invalid = |e: &dyn std::fmt::Display, s: &str| {
        Status::backend(&BackendError::Invalid(format!("{e} in {s:?}")))
    };
    let action = desc.get("sql-rule-action").and_then(|a| text(a, "expression"));
    let filter = if let Some(sql) = desc.get("sql-filter") {
        let expr = text(sql, "expression").ok_or_else(|| bad("sql-filter needs an expression"))?;
        match expr.trim().to_ascii_uppercase().as_str() {
            "1=1" | "TRUE" => Filter::True,
            "1=0" | "FALSE" => Filter::False,
            _ => Filter::Sql(SqlFilter::parse(&expr).map_err(|e| invalid(&e, &expr))?),
        }
    } else if let Some(c) = desc.get("correlation-filter") {
        let mut f = CorrelationFilter::default();
        f.correlation_id = text(c, "correlation-id");
        f.message_id = text(c, "message-id");
        f.to = text(c, "to");
        f.reply_to = text(c, "reply-to");
        f.subject = text(c, "label").or_else(|| text(c, "subject"));
        f.session_id = text(c, "session-id");
        f.reply_to_session_id = text(c, "reply-to-session-id");
        f.content_type = text(c, "content-type");
        f.properties = mapping::properties_of(c.get("properties"), &[]);
        Filter::Correlation(f)
    } else {
        Filter::True
    };
    let mut rule = Rule::new(name, filter);
    if let Some(a) = action {
        rule = rule.with_action(SqlAction::parse(&a).map_err(|e| invalid(&e, &a))?);
    }
    Ok(rule)
}

/// A rule as the `enumerate-rules` reply describes it.
fn rule_value(rule: &Rule) -> Value {
    let s = |o: &Option<String>| o.clone().map_or(Value::Null, Value::String);
    let filter = match &rule.filter {
        Filter::Sql(f) => {
            described_list(SQL_FILTER, vec![Value::String(f.expression().to_owned())])
        }
        Filter::True => described_list(TRUE_FILTER, vec![Value::string("1=1")]),
        Filter::Correlation(c) => described_list(
            CORRELATION_FILTER,
            vec![
                s(&c.correlation_id),
                s(&c.message_id),
                s(&c.to),
                s(&c.reply_to),
                s(&c.subject),
                s(&c.session_id),
                s(&c.reply_to_session_id),
                s(&c.content_type),
                Value::Map(
                    c.properties
                        .iter()
                        .map(|(k, v)| (Value::String(k.clone()), mapping::from_twice_value(v)))
                        .collect(),
                ),
            ],
        ),
        // `False`, and any filter this reply has no descriptor for, selects nothing.
        _ => described_list(FALSE_FILTER, vec![Value::string("1=0")]),
    };
    let action = match &rule.action {
        Some(a) => described_list(SQL_ACTION, vec![Value::String(a.expression().to_owned())]),
        None => described_list(EMPTY_ACTION, vec![]),
    };
    Value::Map(vec![(
        Value::string("rule-description"),
        described_list(RULE_DESCRIPTION, vec![filter, action, Value::String(rule.name.clone())]),
    )])
}
