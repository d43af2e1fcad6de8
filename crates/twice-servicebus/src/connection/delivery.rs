//! What twice sends: link credit and drain, and the messages a pump took turned into
//! deliveries on the session's outgoing queue (written by [`super::state::Out`]).

use bytes::Bytes;
use twice::{LockToken, ReceivedMessage};
use uuid::Uuid;

use crate::address::Node;
use crate::backend::{Backend, BackendError, BackendSession, ReceiveMode, Settlement};
use crate::conditions::{backend_error, session_lock_lost, token_expired};
use crate::mapping::{self, Presentation};
use crate::metrics::Counter;
use crate::performative::{Flow, Performative};

use super::state::{Job, Source, Unsettled, need_of, update_pump};
use super::{Conn, SESSION_WINDOW};

impl<B: Backend> Conn<B> {
    pub(super) fn on_flow(&mut self, ch: u16, f: &Flow) {
        let max_unsettled = self.shared.options.max_unsettled_per_link;
        // Credit for a link whose token expired detaches it instead.
        let expired = f.handle.and_then(|h| {
            let l = self.sessions.get(&ch)?.links.get(&h)?;
            let live = l.attached && !l.detached && l.node != Node::Cbs;
            (live && !self.authorized(&l.path, need_of(l))).then(|| (h, l.path.clone()))
        });
        if let Some((handle, path)) = expired {
            self.detach_with(ch, handle, token_expired(&path));
            return;
        }
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        // The peer's incoming window, per the specification: its next-incoming-id plus its
        // window, less what twice has sent (a next-incoming-id it does not know yet is our
        // initial 0).
        let limit = f.next_incoming_id.unwrap_or(0).wrapping_add(f.incoming_window);
        let window = limit.wrapping_sub(s.next_outgoing_id);
        s.remote_incoming_window = if window > u32::MAX / 2 { 0 } else { window };
        let Some(handle) = f.handle else {
            if f.echo {
                let fl = sflow!(s);
                self.out.send(s.local_channel, &Performative::Flow(fl));
            }
            self.out.flush(s);
            return;
        };
        // A flow for a link twice refused or detached changes nothing.
        let Some(l) = s.links.get_mut(&handle).filter(|l| !l.detached) else {
            self.out.flush(s);
            return;
        };
        if !l.client_receives {
            if f.echo {
                let fl = Flow {
                    handle: Some(l.local_handle),
                    delivery_count: Some(l.rx_delivery_count),
                    link_credit: Some(l.rx_credit),
                    ..sflow!(s)
                };
                self.out.send(s.local_channel, &Performative::Flow(fl));
            }
            self.out.flush(s);
            return;
        }
        // Credit per the specification: the receiver's delivery-count plus its credit, less what
        // twice has sent.
        let theirs = f.delivery_count.unwrap_or(0);
        let total = theirs.wrapping_add(f.link_credit.unwrap_or(0));
        let credit = total.wrapping_sub(l.delivery_count);
        l.credit = if credit > u32::MAX / 2 { 0 } else { credit.min(1_000_000) };
        if f.drain {
            l.drain = true;
            l.drain_seq += 1;
        } else {
            l.drain = false;
        }
        // Replies queued on a management or CBS link go out first.
        loop {
            let Some(l) = s.links.get_mut(&handle) else { return };
            if l.credit == 0 {
                break;
            }
            let Some(payload) = l.replies.pop_front() else { break };
            s.send_reply(handle, payload);
        }
        let Some(l) = s.links.get_mut(&handle) else { return };
        let answer_now = l.drain && (l.pump.is_none() || l.credit == 0);
        if answer_now {
            // Nothing to wait for: the unused credit is spent, as the specification asks.
            l.delivery_count = l.delivery_count.wrapping_add(l.credit);
            l.credit = 0;
            l.drain = false;
        }
        let link = l.id;
        let reply = (answer_now || f.echo).then(|| Flow {
            handle: Some(l.local_handle),
            delivery_count: Some(l.delivery_count),
            link_credit: Some(l.credit),
            drain: f.drain,
            ..sflow!(s)
        });
        update_pump(l, max_unsettled);
        if let Some(fl) = reply {
            // Behind the deliveries still queued, which its delivery-count includes.
            s.link_flow(link, fl);
        }
        self.out.flush(s);
    }

    pub(super) fn on_batch(
        &mut self,
        link: u64,
        drain: u64,
        source: Source<B::Session>,
        result: Result<Vec<ReceivedMessage>, BackendError>,
    ) {
        let max_unsettled = self.shared.options.max_unsettled_per_link;
        let messages = match result {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "receive failed");
                if let Some(&(ch, handle)) = self.links.get(&link) {
                    let err = match e {
                        BackendError::SessionLockLost => session_lock_lost(),
                        other => backend_error(&other),
                    };
                    self.detach_with(ch, handle, err);
                }
                return;
            }
        };
        let Some(&(ch, handle)) = self.links.get(&link) else {
            // The link is gone: what it took goes back.
            release_all(&self.shared.backend, &source, messages);
            return;
        };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        l.taken += u64::try_from(messages.len()).unwrap_or(u64::MAX);
        let entity = l.path.clone();
        let mode = l.mode;
        let mut sent = 0u64;
        for m in messages {
            let Some(l) = s.links.get_mut(&handle) else { break };
            let Some(lock) = m.lock_token else { continue };
            if l.credit == 0 || l.detached {
                // More than the credit: a long poll that finished after a drain.
                l.job(Job::Release(lock));
                continue;
            }
            l.credit -= 1;
            l.delivery_count = l.delivery_count.wrapping_add(1);
            sent += 1;
            if mode == ReceiveMode::ReceiveAndDelete {
                let payload = mapping::encode_received(&m, Presentation::Unlocked);
                let tag = Bytes::copy_from_slice(&Uuid::new_v4().to_bytes_le());
                s.deliver(handle, tag, true, payload, Some(lock));
            } else {
                l.unsettled += 1;
                let tag = Bytes::copy_from_slice(&lock.as_uuid().to_bytes_le());
                // Straight into the connection's buffer when it can go now, else queued.
                let at_least = m.message.body.len() + 32;
                let written = self.out.write_delivery(s, handle, tag, at_least, |out| {
                    mapping::encode_received_into(out, &m, Presentation::Locked);
                });
                let id = written.or_else(|tag| {
                    let payload = mapping::encode_received(&m, Presentation::Locked);
                    s.deliver(handle, tag, false, payload, Some(lock)).ok_or(())
                });
                if let Ok(id) = id {
                    s.unsettled.insert(id, Unsettled { link, lock });
                }
            }
        }
        if sent > 0 {
            self.shared.metrics.add(&entity, Counter::Receive, sent);
        }
        let Some(l) = s.links.get_mut(&handle) else { return };
        if drain != 0 && l.drain && drain == l.drain_seq {
            l.delivery_count = l.delivery_count.wrapping_add(l.credit);
            l.credit = 0;
            l.drain = false;
            let fl = Flow {
                handle: Some(l.local_handle),
                delivery_count: Some(l.delivery_count),
                link_credit: Some(0),
                drain: true,
                ..sflow!(s)
            };
            s.link_flow(link, fl);
        }
        self.out.flush(s);
        if let Some(l) = s.links.get_mut(&handle) {
            update_pump(l, max_unsettled);
        }
    }
}

/// Unlocks messages taken for a link that cannot deliver them.
pub(super) fn release_all<B: Backend>(
    backend: &B,
    source: &Source<B::Session>,
    messages: Vec<ReceivedMessage>,
) {
    let locks: Vec<LockToken> = messages.iter().filter_map(|m| m.lock_token).collect();
    if locks.is_empty() {
        return;
    }
    let backend = backend.clone();
    let source = source.clone();
    tokio::spawn(async move {
        for lock in locks {
            let _ = match &source {
                Source::Session(s) => s.settle(lock, Settlement::Release).await,
                Source::Entity(e) => backend.settle(e, lock, Settlement::Release).await,
            };
        }
    });
}
