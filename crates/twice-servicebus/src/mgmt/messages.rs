//! The operations on messages: lock renewal, settlement by lock token, peek, scheduling and
//! deferred messages.

use twice::{LockToken, Message, MessageId, SequenceNumber, SessionId};
use twice_amqp::servicebus::{ManagementReply, ReplyMessage, Scheduled, Settle};

use super::{Ctx, Status, bad, bounded};
use crate::backend::{Backend, ReceiveMode};
use crate::mapping::{self, Presentation, Sections};
use crate::metrics::Counter;
use crate::settle::{count, counter_of, settle_one, settlement_of};

/// `renew-lock`: each lock's new expiry, or the first failure.
pub(super) async fn renew_lock<B: Backend>(
    ctx: &Ctx<'_, B>,
    locks: Vec<LockToken>,
) -> Result<Status, Status> {
    let mut expirations = Vec::with_capacity(locks.len());
    for lock in locks {
        let until =
            ctx.backend.renew_lock(ctx.entity, lock).await.map_err(|e| Status::backend(&e))?;
        expirations.push(until);
    }
    Ok(Status::ok(ManagementReply::Expirations(expirations)))
}

/// `update-disposition`: settles each lock in turn (on the named session, which this
/// connection must hold), stopping at the first failure; `settled` gets those that were.
pub(super) async fn update_disposition<B: Backend>(
    ctx: &Ctx<'_, B>,
    locks: Vec<LockToken>,
    how: Settle,
    session_id: Option<SessionId>,
    settled: &mut Vec<LockToken>,
) -> Result<Status, Status> {
    let how = settlement_of(how);
    let counter = counter_of(&how);
    let session = session_id.map(|sid| ctx.held(&sid)).transpose()?;
    for lock in locks {
        let r = settle_one(ctx.backend, ctx.entity, session.as_deref(), lock, how.clone()).await;
        count(ctx.metrics, ctx.entity, counter, &r);
        r.map_err(|e| Status::backend(&e))?;
        settled.push(lock);
    }
    Ok(Status::ok(ManagementReply::Empty))
}

/// `peek-message`: up to 1,000 messages from a sequence number on, unlocked.
pub(super) async fn peek<B: Backend>(
    ctx: &Ctx<'_, B>,
    from: i64,
    count: i64,
    session_id: Option<SessionId>,
) -> Result<Status, Status> {
    let from = SequenceNumber::new(from.max(0));
    let found = ctx
        .backend
        .peek(ctx.entity, session_id, from, bounded(count, 1, 1000))
        .await
        .map_err(|e| Status::backend(&e))?;
    if found.is_empty() {
        return Ok(Status::no_content());
    }
    let items = found
        .iter()
        .map(|m| ReplyMessage {
            lock_token: None,
            message: mapping::encode_received(m, Presentation::Unlocked).into(),
        })
        .collect();
    Ok(Status::ok(ManagementReply::Messages(items)))
}

/// `schedule-message`: the messages, each with the ids the request names beside it where
/// the message has none, stored for later; their sequence numbers.
pub(super) async fn schedule<B: Backend>(
    ctx: &Ctx<'_, B>,
    items: Vec<Scheduled>,
) -> Result<Status, Status> {
    let mut messages = Vec::with_capacity(items.len());
    for item in items {
        let mut m: Message =
            Sections::parse(&item.message).map_err(|e| bad(e.to_string()))?.to_message();
        if m.message_id.is_none() {
            m.message_id = item.message_id.map(MessageId::new);
        }
        if m.session_id.is_none() {
            m.session_id = item.session_id.map(SessionId::new);
        }
        if m.partition_key.is_none() {
            m.partition_key = item.partition_key;
        }
        messages.push(m);
    }
    let n = u64::try_from(messages.len()).unwrap_or(0);
    let seqs = ctx.backend.schedule(ctx.entity, messages).await.map_err(|e| Status::backend(&e))?;
    ctx.metrics.add(ctx.entity, Counter::Send, n);
    Ok(Status::ok(ManagementReply::SequenceNumbers(seqs)))
}

/// `cancel-scheduled-message`.
pub(super) async fn cancel_scheduled<B: Backend>(
    ctx: &Ctx<'_, B>,
    seqs: Vec<SequenceNumber>,
) -> Result<Status, Status> {
    ctx.backend.cancel_scheduled(ctx.entity, seqs).await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::Empty))
}

/// `receive-by-sequence-number`: deferred messages, locked (with their lock tokens beside
/// them) or removed; a session's through the session this connection holds.
pub(super) async fn receive_deferred<B: Backend>(
    ctx: &Ctx<'_, B>,
    seqs: Vec<SequenceNumber>,
    receive_and_delete: bool,
    session_id: Option<SessionId>,
) -> Result<Status, Status> {
    use crate::backend::BackendSession;
    let mode =
        if receive_and_delete { ReceiveMode::ReceiveAndDelete } else { ReceiveMode::PeekLock };
    let found = match &session_id {
        Some(sid) => ctx.held(sid)?.receive_deferred(mode, seqs).await,
        None => ctx.backend.receive_deferred(ctx.entity, mode, seqs).await,
    }
    .map_err(|e| Status::backend(&e))?;
    if found.is_empty() {
        return Ok(Status::no_content());
    }
    ctx.metrics.add(ctx.entity, Counter::Receive, u64::try_from(found.len()).unwrap_or(0));
    let items = found
        .iter()
        .map(|m| ReplyMessage {
            lock_token: m.lock_token,
            message: mapping::encode_received(m, Presentation::Locked).into(),
        })
        .collect();
    Ok(Status::ok(ManagementReply::Messages(items)))
}
