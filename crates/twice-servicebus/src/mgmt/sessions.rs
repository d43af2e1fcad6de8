//! The operations on sessions: the lock and state of a session this connection holds, and
//! the list of sessions with messages.

use bytes::Bytes;
use twice::SessionId;
use twice_amqp::servicebus::ManagementReply;

use super::{Ctx, Status, bounded};
use crate::backend::{Backend, BackendSession};

/// `renew-session-lock`: the session's new expiry.
pub(super) async fn renew_lock<B: Backend>(
    ctx: &Ctx<'_, B>,
    sid: SessionId,
) -> Result<Status, Status> {
    let until = ctx.held(&sid)?.renew().await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::Expiration(until)))
}

/// `get-session-state`.
pub(super) async fn get_state<B: Backend>(
    ctx: &Ctx<'_, B>,
    sid: SessionId,
) -> Result<Status, Status> {
    let state = ctx.held(&sid)?.get_state().await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::SessionState(state)))
}

/// `set-session-state`: sets the state, or with none clears it.
pub(super) async fn set_state<B: Backend>(
    ctx: &Ctx<'_, B>,
    sid: SessionId,
    state: Option<Bytes>,
) -> Result<Status, Status> {
    ctx.held(&sid)?.set_state(state).await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::Empty))
}

/// `get-message-sessions`: up to 1,000 sessions after `skip`.
pub(super) async fn list<B: Backend>(
    ctx: &Ctx<'_, B>,
    skip: i64,
    top: i64,
) -> Result<Status, Status> {
    let skip = bounded(skip, 0, i64::MAX);
    let ids = ctx
        .backend
        .list_sessions(ctx.entity, skip, bounded(top, 1, 1000))
        .await
        .map_err(|e| Status::backend(&e))?;
    if ids.is_empty() {
        return Ok(Status::no_content());
    }
    let skip = i64::try_from(skip).unwrap_or(i64::MAX);
    Ok(Status::ok(ManagementReply::Sessions { skip, ids }))
}
