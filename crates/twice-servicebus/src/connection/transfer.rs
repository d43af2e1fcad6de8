//! What the client sends: transfers to an entity (handed to the link's sender task), `$cbs` and
//! `$management` requests and their replies, and dispositions (handed to the settler), with
//! the echoes that follow once the broker has applied them.

use std::sync::Arc;

use tokio::sync::mpsc;
use twice::LockToken;
use twice_amqp::reassembly::{Partial, Step, reassemble};
use twice_amqp::servicebus::Settle;

use crate::address::Node;
use crate::backend::{Backend, Settlement};
use crate::conditions::{self as cond, token_expired};
use crate::mapping;
use crate::metrics::Counter;
use crate::mgmt;
use crate::performative::{
    AmqpError, Disposition, Flow, Outcome, Performative, ROLE_RECEIVER, ROLE_SENDER, Transfer,
};
use crate::settle;

use super::links::{request_task, sender_task};
use super::state::{Echo, Job, Out, PendingSend, Unsettled, need_of, update_pump};
use super::{Conn, SENDER_CREDIT, SESSION_WINDOW};

impl<B: Backend> Conn<B> {
    pub(super) fn on_transfer(&mut self, ch: u16, t: Transfer, payload: &[u8]) {
        let max_size = usize::try_from(self.shared.options.max_message_size).unwrap_or(usize::MAX);
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        s.next_incoming_id = s.next_incoming_id.wrapping_add(1);
        s.frames_since_flow += 1;
        if s.frames_since_flow >= SESSION_WINDOW / 2 {
            // Reopen the session window before the peer runs out of it (multi-frame messages
            // use it faster than link credit is topped up).
            s.frames_since_flow = 0;
            let fl = sflow!(s);
            self.out.send(s.local_channel, &Performative::Flow(fl));
        }
        // A transfer on a handle that is not attached (never attached, or refused or detached
        // by twice) is a session error (AMQP 1.0 section 2.7.5): nothing it carries is used.
        let Some(l) = s.links.get_mut(&t.handle).filter(|l| !l.detached) else {
            let error = AmqpError::new(
                cond::UNATTACHED_HANDLE,
                format!("transfer on handle {}, which is not attached", t.handle),
            );
            self.end_session(ch, error);
            return;
        };
        if l.client_receives {
            return;
        }
        // Checked once per delivery: the token that authorized the link may have expired.
        let now = self.shared.options.clock.now().as_millis() / 1000;
        if l.partial.is_none()
            && l.node != Node::Cbs
            && !self.grants.allows(&l.path, now, need_of(l))
        {
            let error = token_expired(&l.path);
            self.link_error(ch, t.handle, error);
            return;
        }
        if l.partial.is_none() {
            // A new delivery takes one credit; one the client was not given ends the link.
            if l.rx_credit == 0 {
                let error = AmqpError::new(
                    cond::TRANSFER_LIMIT,
                    "transfer beyond the link credit the server granted",
                );
                self.link_error(ch, t.handle, error);
                return;
            }
            l.rx_credit -= 1;
            l.rx_delivery_count = l.rx_delivery_count.wrapping_add(1);
        }
        let done = match reassemble(&mut l.partial, &t, payload, max_size) {
            Step::More | Step::Aborted => return,
            Step::Done(done) => done,
        };
        let node = l.node.clone();
        let link_id = l.id;
        let outcome = if done.oversize {
            Outcome::Rejected(Some(AmqpError::new(
                cond::MESSAGE_SIZE,
                format!(
                    "The received message exceeds the maximum message size of {max_size} bytes."
                ),
            )))
        } else {
            match &node {
                Node::Entity(e) => match mapping::messages_of(&done.payload, done.format) {
                    Err(err) => {
                        Outcome::Rejected(Some(AmqpError::new(cond::DECODE_ERROR, err.to_string())))
                    }
                    Ok(messages) => {
                        // Sends are handed to the link's sender task, which stores them in
                        // order and in groups; the connection reads on meanwhile.
                        let pending = PendingSend {
                            delivery_id: done.delivery_id,
                            settled: done.settled,
                            bytes: done.payload.len(),
                            messages,
                        };
                        // Its credit comes back once it is stored (see `on_sent`).
                        self.queue_send(ch, t.handle, e, pending);
                        return;
                    }
                },
                Node::Cbs => {
                    let reply = self.on_cbs(&done.payload);
                    self.settle_received(ch, &done, &Outcome::Accepted);
                    if let Some(reply) = reply {
                        self.reply(link_id, reply);
                    }
                    return self.top_up(ch, t.handle);
                }
                Node::Management(e) => {
                    // The request is settled at once; its reply follows from the link's
                    // request task, as a request/response peer expects.
                    self.settle_received(ch, &done, &Outcome::Accepted);
                    match mgmt::Request::parse(&done.payload) {
                        Ok(req)
                            if !self.authorized(
                                &format!("{e}/$management"),
                                Some(mgmt::claim_of(&req)),
                            ) =>
                        {
                            let why = format!("the token for '{e}' does not allow this operation");
                            self.reply(link_id, mgmt::unauthorized(&req, why));
                        }
                        Ok(req) => {
                            let held =
                                mgmt::session_id(&req).and_then(|sid| self.held_session(e, &sid));
                            // Its credit comes back once it is answered.
                            self.queue_request(ch, t.handle, e, req, held);
                            return;
                        }
                        Err(err) => self.reply(link_id, mgmt::decode_error(&err)),
                    }
                    return self.top_up(ch, t.handle);
                }
            }
        };
        self.settle_received(ch, &done, &outcome);
        self.top_up(ch, t.handle);
    }

    /// Settles a delivery the client sent with `outcome`, unless the client sent it settled.
    fn settle_received(&mut self, ch: u16, p: &Partial, outcome: &Outcome) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        if !p.settled {
            let d = Disposition {
                role: ROLE_RECEIVER,
                first: p.delivery_id,
                last: None,
                settled: true,
                state: Some(outcome.to_value()),
            };
            self.out.send(s.local_channel, &Performative::Disposition(d));
        }
    }

    /// Gives a client sender more credit when half of it is used: as much as keeps its
    /// deliveries not yet stored (or answered) within [`SENDER_CREDIT`].
    fn top_up(&mut self, ch: u16, handle: u32) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle).filter(|l| !l.detached) else { return };
        let grant = SENDER_CREDIT.saturating_sub(l.rx_in_flight);
        if l.rx_credit < SENDER_CREDIT / 2 && grant > l.rx_credit {
            l.rx_credit = grant;
            let fl = Flow {
                handle: Some(l.local_handle),
                delivery_count: Some(l.rx_delivery_count),
                link_credit: Some(grant),
                ..sflow!(s)
            };
            self.out.send(s.local_channel, &Performative::Flow(fl));
        }
    }

    /// Counts `n` deliveries of a link as answered, and tops its credit up.
    pub(super) fn answered(&mut self, link: u64, n: usize) {
        let Some(&(ch, handle)) = self.links.get(&link) else { return };
        if let Some(l) = self.sessions.get_mut(&ch).and_then(|s| s.links.get_mut(&handle)) {
            l.rx_in_flight = l.rx_in_flight.saturating_sub(u32::try_from(n).unwrap_or(u32::MAX));
        }
        self.top_up(ch, handle);
    }

    /// Queues a send on the link's sender task, starting it on first use.
    fn queue_send(&mut self, ch: u16, handle: u32, entity: &str, pending: PendingSend) {
        let Some(l) = self.sessions.get_mut(&ch).and_then(|s| s.links.get_mut(&handle)) else {
            return;
        };
        l.rx_in_flight += 1;
        self.bytes_in_flight += pending.bytes;
        let tx = l.sends.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let max = usize::try_from(self.shared.options.max_message_size).unwrap_or(usize::MAX);
            tokio::spawn(sender_task(
                self.shared.backend.clone(),
                entity.to_owned(),
                max,
                rx,
                self.events.clone(),
                l.id,
            ));
            tx
        });
        let _ = tx.send(pending);
    }

    /// Queues a management request on the link's request task, starting it on first use.
    fn queue_request(
        &mut self,
        ch: u16,
        handle: u32,
        entity: &str,
        req: mgmt::Request,
        held: Option<Arc<B::Session>>,
    ) {
        let Some(l) = self.sessions.get_mut(&ch).and_then(|s| s.links.get_mut(&handle)) else {
            return;
        };
        l.rx_in_flight += 1;
        let tx = l.requests.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(request_task(
                self.shared.backend.clone(),
                self.shared.metrics.clone(),
                entity.to_owned(),
                rx,
                self.events.clone(),
                l.id,
            ));
            tx
        });
        let _ = tx.send((req, held));
    }

    /// Settles sends the sender task has stored (or failed to).
    pub(super) fn on_sent(
        &mut self,
        link: u64,
        entity: &str,
        results: Vec<(u32, bool, usize, Outcome)>,
    ) {
        for (_, _, n, outcome) in &results {
            if *outcome == Outcome::Accepted {
                self.shared.metrics.add(entity, Counter::Send, u64::try_from(*n).unwrap_or(0));
            }
        }
        let Some(&(ch, _)) = self.links.get(&link) else { return };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let echoes = results.into_iter().map(|(id, settled, _, outcome)| (id, outcome, !settled));
        send_echoes(&mut self.out, s.local_channel, ROLE_RECEIVER, echoes);
    }

    /// Sends a management or CBS reply on the client's receiver link for it.
    pub(super) fn reply(&mut self, request_link: u64, reply: mgmt::Reply) {
        let Some(&(ch, handle)) = self.links.get(&request_link) else { return };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(req) = s.links.get(&handle) else { return };
        let node = req.node.clone();
        let to = reply.to.clone();
        let candidates =
            || s.links.iter().filter(|(_, l)| l.client_receives && l.node == node && !l.detached);
        let target = candidates()
            .find(|(_, l)| to.is_some() && (l.target_address == to || Some(&l.name) == to.as_ref()))
            .or_else(|| candidates().next())
            .map(|(h, _)| *h);
        let Some(target) = target else {
            tracing::debug!("no reply link for a management request");
            return;
        };
        let payload = reply.encode();
        let Some(l) = s.links.get_mut(&target) else { return };
        tracing::trace!(link = %l.name, credit = l.credit, queued = l.replies.len(), "reply");
        if l.credit == 0 {
            l.replies.push_back(payload);
        } else {
            s.send_reply(target, payload);
            self.out.flush(s);
        }
    }

    /// Hands the client's dispositions to the settlers of their links; each echo goes out
    /// when the broker has applied the outcome.
    pub(super) fn on_disposition(&mut self, ch: u16, d: &Disposition) {
        if d.role != ROLE_RECEIVER {
            return;
        }
        let outcome = match d.state.as_ref().map(Outcome::from_value) {
            Some(Ok(o)) => o,
            Some(Err(_)) | None => Outcome::Other,
        };
        let last = d.last.unwrap_or(d.first);
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let (how, echo) = settlement_of(&outcome);
        let settle = |id: u32, u: Unsettled| {
            let job = Job::Settle {
                delivery_id: id,
                lock: u.lock,
                how: how.clone(),
                echo: echo.clone(),
                reply: !d.settled,
            };
            if let Some(&(_, handle)) = self.links.get(&u.link)
                && let Some(l) = s.links.get(&handle)
            {
                l.job(job);
            }
        };
        // A client settling message by message names one delivery.
        if d.first == last {
            if let Some(u) = s.unsettled.remove(&d.first) {
                settle(d.first, u);
            }
            return;
        }
        // Only the unsettled deliveries in the range are work, whatever its width (it may wrap
        // around the end of the id space).
        let ids: Vec<u32> = if d.first <= last {
            s.unsettled.range(d.first..=last).map(|(id, _)| *id).collect()
        } else {
            s.unsettled
                .range(d.first..)
                .chain(s.unsettled.range(..=last))
                .map(|(id, _)| *id)
                .collect()
        };
        for id in ids {
            if let Some(u) = s.unsettled.remove(&id) {
                settle(id, u);
            }
        }
    }

    /// Echoes the outcomes a settler applied, and lets the pump take more.
    pub(super) fn on_settled(&mut self, link: u64, results: Vec<Echo>) {
        let max_unsettled = self.shared.options.max_unsettled_per_link;
        let Some(&(ch, handle)) = self.links.get(&link) else { return };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        if let Some(l) = s.links.get_mut(&handle) {
            let n = u32::try_from(results.len()).unwrap_or(u32::MAX);
            l.unsettled = l.unsettled.saturating_sub(n);
            update_pump(l, max_unsettled);
        }
        send_echoes(&mut self.out, s.local_channel, ROLE_SENDER, results.into_iter());
    }

    /// Forgets a delivery settled through `$management`, so a later disposition is ignored.
    pub(super) fn forget_lock(&mut self, lock: LockToken) {
        for s in self.sessions.values_mut() {
            s.unsettled.retain(|_, u| u.lock != lock);
        }
    }
}

/// Writes dispositions for settled deliveries, one frame per run of consecutive delivery ids
/// with the same outcome; those the client does not wait for are skipped.
fn send_echoes(out: &mut Out, channel: u16, role: bool, echoes: impl Iterator<Item = Echo>) {
    let mut run: Option<(u32, u32, Outcome)> = None;
    let emit = |out: &mut Out, (first, last, state): (u32, u32, Outcome)| {
        let d = Disposition {
            role,
            first,
            last: (last != first).then_some(last),
            settled: true,
            state: Some(state.to_value()),
        };
        out.send(channel, &Performative::Disposition(d));
    };
    for (id, outcome, reply) in echoes {
        if !reply {
            continue;
        }
        run = match run.take() {
            Some((first, last, o)) if last.wrapping_add(1) == id && o == outcome => {
                Some((first, id, o))
            }
            Some(done) => {
                emit(out, done);
                Some((id, id, outcome))
            }
            None => Some((id, id, outcome)),
        };
    }
    if let Some(done) = run {
        emit(out, done);
    }
}

/// What a client's outcome asks of the broker, and the outcome to echo (research §8.3): the
/// same type, without the dead-letter error a `rejected` came with.
fn settlement_of(outcome: &Outcome) -> (Option<Settlement>, Outcome) {
    (Settle::from_outcome(outcome).map(settle::settlement_of), Settle::echo_of(outcome))
}
