//! `$management`: the operations the SDKs run beside their links (research §7), one handler
//! function per operation. The request and reply envelopes, the operations and their bodies
//! are `twice_amqp::servicebus`'s, which the client shares; this module runs them against the
//! broker.
//!
//! - `messages`: locks, settlement, peek, scheduling, deferred messages;
//! - `sessions`: session locks and state, and the list of sessions;
//! - `rules`: a subscription's rules.

mod messages;
mod rules;
mod sessions;

use std::sync::Arc;

use twice::{LockToken, SessionId};
use twice_amqp::servicebus::{Condition, ManagementReply, ManagementRequest, RequestError};

use crate::backend::{Backend, BackendError};
use crate::codec::{DecodeError, Value};
use crate::conditions::{self as cond, backend_error};
use crate::metrics::Metrics;
use crate::sas::Claim;

pub(crate) use twice_amqp::servicebus::{Reply, Request};

/// The outcome of an operation before it is wrapped in a reply.
struct Status {
    code: i32,
    condition: Option<Condition>,
    description: String,
    body: Value,
}

impl Status {
    fn ok(body: ManagementReply) -> Self {
        Self { code: 200, condition: None, description: "OK".into(), body: body.to_value() }
    }

    /// Nothing found (no messages, sessions or rules): a success with an empty body.
    fn no_content() -> Self {
        Self {
            code: 204,
            condition: Some(Condition::MessageNotFound),
            description: "No messages".into(),
            body: Value::Map(vec![]),
        }
    }

    fn error(code: i32, condition: Condition, description: impl Into<String>) -> Self {
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
        Self {
            code,
            condition: Some(cond::of_backend(e)),
            description: backend_error(e).description.unwrap_or_default(),
            body: Value::Null,
        }
    }

    fn reply_to(self, req: &Request) -> Reply {
        let mut reply = Reply::to_request(req, self.code, self.description);
        reply.condition = self.condition.map(String::from);
        reply.body = self.body;
        reply
    }
}

/// A request the body of which is wrong.
fn bad(description: impl Into<String>) -> Status {
    Status::error(400, Condition::ArgumentError, description)
}

/// The reply to a request that could not be parsed.
pub(crate) fn decode_error(e: &DecodeError) -> Reply {
    // No message-id and no reply-to could be read: the reply names neither.
    let req = Request::new("", Value::Null);
    Status::error(400, Condition::DecodeError, e.to_string()).reply_to(&req)
}

/// The reply to a request the connection's tokens do not allow.
pub(crate) fn unauthorized(req: &Request, why: String) -> Reply {
    Status::error(401, Condition::UnauthorizedAccess, why).reply_to(req)
}

/// The claim a request needs (its operation's); an operation twice does not know needs
/// listening, and is refused as unsupported once allowed.
pub(crate) fn claim_of(req: &Request) -> Claim {
    req.operation()
        .and_then(twice_amqp::servicebus::Operation::parse)
        .map_or(Claim::Listen, |op| op.claim())
}

/// The `session-id` a request names, if any.
pub(crate) fn session_id(req: &Request) -> Option<String> {
    req.body.get("session-id").and_then(Value::as_str).map(str::to_owned)
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
    let mut settled = Vec::new();
    let ctx = Ctx { backend, metrics, held, entity };
    let status = match ManagementRequest::parse(&req) {
        Ok(op) => match run(&ctx, op, &mut settled).await {
            Ok(s) | Err(s) => s,
        },
        Err(e @ RequestError::Unsupported(_)) => {
            Status::error(501, Condition::NotImplemented, e.to_string())
        }
        Err(RequestError::Invalid(why)) => bad(why),
    };
    if status.code >= 300 && status.code != 404 {
        let op = req.operation().unwrap_or("");
        tracing::debug!(operation = %op, code = status.code, "management request failed");
    }
    (status.reply_to(&req), settled)
}

/// Runs a request: each operation has its handler.
async fn run<B: Backend>(
    ctx: &Ctx<'_, B>,
    req: ManagementRequest,
    settled: &mut Vec<LockToken>,
) -> Result<Status, Status> {
    use ManagementRequest as R;
    match req {
        R::RenewLock { lock_tokens } => messages::renew_lock(ctx, lock_tokens).await,
        R::UpdateDisposition { lock_tokens, settle, session_id } => {
            messages::update_disposition(ctx, lock_tokens, settle, session_id, settled).await
        }
        R::PeekMessage { from, count, session_id } => {
            messages::peek(ctx, from, count, session_id).await
        }
        R::ScheduleMessage { messages } => messages::schedule(ctx, messages).await,
        R::CancelScheduledMessage { sequence_numbers } => {
            messages::cancel_scheduled(ctx, sequence_numbers).await
        }
        R::ReceiveBySequenceNumber { sequence_numbers, receive_and_delete, session_id } => {
            messages::receive_deferred(ctx, sequence_numbers, receive_and_delete, session_id).await
        }
        R::RenewSessionLock { session_id } => sessions::renew_lock(ctx, session_id).await,
        R::GetSessionState { session_id } => sessions::get_state(ctx, session_id).await,
        R::SetSessionState { session_id, state } => {
            sessions::set_state(ctx, session_id, state).await
        }
        R::GetMessageSessions { skip, top } => sessions::list(ctx, skip, top).await,
        R::AddRule { name, description } => rules::add(ctx, name, &description).await,
        R::RemoveRule { name } => rules::remove(ctx, &name).await,
        R::EnumerateRules { skip, top } => rules::enumerate(ctx, skip, top).await,
    }
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
    fn held(&self, sid: &SessionId) -> Result<Arc<B::Session>, Status> {
        self.held.clone().ok_or_else(|| {
            Status::error(
                410,
                Condition::SessionLockLost,
                format!("the session '{sid}' is not locked by this receiver"),
            )
        })
    }
}

/// A count from a request as a `usize` within `min..=max`.
fn bounded(n: i64, min: i64, max: i64) -> usize {
    usize::try_from(n.clamp(min, max)).unwrap_or(0)
}
