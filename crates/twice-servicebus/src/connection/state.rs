//! The state of sessions and links, and what waits on them: the deliveries queued to go out
//! and the bytes written for them, the deliveries not yet settled, the partial transfers coming
//! in, the work queued for a link's tasks and what those tasks report. The files beside this
//! one act on this state; none of it acts on them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use twice::{LockToken, ReceivedMessage};

use crate::address::Node;
use crate::backend::{BackendError, EntityKind, ReceiveMode, Settlement};
use crate::frame;
use crate::ids::IdPool;
use crate::mgmt;
use crate::performative::{Attach, Flow, Outcome, Performative, Transfer};
use crate::sas::Claim;

use super::SESSION_WINDOW;

pub(super) struct Link<S> {
    pub(super) id: u64,
    pub(super) name: String,
    pub(super) local_handle: u32,
    /// The client receives on this link (twice sends).
    pub(super) client_receives: bool,
    pub(super) node: Node,
    pub(super) path: String,
    pub(super) target_address: Option<String>,
    pub(super) attach: Attach,
    /// twice has sent its attach.
    pub(super) attached: bool,
    /// twice has sent its detach.
    pub(super) detached: bool,
    // Twice as sender.
    pub(super) mode: ReceiveMode,
    pub(super) delivery_count: u32,
    pub(super) credit: u32,
    /// A drain the client asked for is not answered yet.
    pub(super) drain: bool,
    /// The number of the client's last drain.
    pub(super) drain_seq: u64,
    /// Messages the pump handed over (see [`PumpCtl`]).
    pub(super) taken: u64,
    pub(super) unsettled: u32,
    pub(super) pump: Option<watch::Sender<PumpCtl>>,
    pub(super) session: Option<Arc<S>>,
    pub(super) settle: Option<mpsc::UnboundedSender<Job>>,
    /// Dropping it stops the link's session lock timer.
    pub(super) lock_watch: Option<oneshot::Sender<()>>,
    pub(super) replies: VecDeque<Vec<u8>>,
    // Twice as receiver.
    pub(super) rx_delivery_count: u32,
    pub(super) rx_credit: u32,
    /// Deliveries received and handed to the sender or request task, not yet answered: the
    /// credit they took comes back only when they are.
    pub(super) rx_in_flight: u32,
    /// The delivery whose transfer frames are coming in.
    pub(super) partial: Option<twice_amqp::reassembly::Partial>,
    pub(super) sends: Option<mpsc::UnboundedSender<PendingSend>>,
    pub(super) requests: Option<mpsc::UnboundedSender<(mgmt::Request, Option<Arc<S>>)>>,
}

impl<S> Link<S> {
    /// Queues work for the link's settler.
    pub(super) fn job(&self, job: Job) {
        if let Some(tx) = &self.settle {
            let _ = tx.send(job);
        }
    }
}

pub(super) struct Session<S> {
    pub(super) local_channel: u16,
    pub(super) next_outgoing_id: u32,
    pub(super) next_delivery_id: u32,
    pub(super) next_incoming_id: u32,
    pub(super) incoming_window: u32,
    /// How many more transfer frames the peer takes (its incoming window as twice sees it).
    pub(super) remote_incoming_window: u32,
    pub(super) frames_since_flow: u32,
    pub(super) links: HashMap<u32, Link<S>>,
    /// Local handles of this session's links.
    pub(super) handles: IdPool,
    /// By delivery id, ordered so a disposition's range costs only the deliveries in it.
    pub(super) unsettled: BTreeMap<u32, Unsettled>,
    pub(super) outgoing: VecDeque<Queued>,
}

impl<S> Session<S> {
    /// Forgets a link of this session, giving its local handle back.
    pub(super) fn remove_link(&mut self, handle: u32) -> Option<Link<S>> {
        let l = self.links.remove(&handle)?;
        self.handles.give_back(l.local_handle);
        Some(l)
    }

    /// Queues a delivery on the link with this remote handle; returns its delivery id.
    pub(super) fn deliver(
        &mut self,
        remote_handle: u32,
        tag: Bytes,
        settled: bool,
        payload: Vec<u8>,
        lock: Option<LockToken>,
    ) -> Option<u32> {
        let l = self.links.get(&remote_handle)?;
        let delivery_id = self.next_delivery_id;
        self.next_delivery_id = self.next_delivery_id.wrapping_add(1);
        self.outgoing.push_back(Queued::Delivery(Outgoing {
            link: l.id,
            remote_handle,
            local_handle: l.local_handle,
            delivery_id,
            tag,
            settled,
            payload,
            written: 0,
            started: false,
            lock,
        }));
        Some(delivery_id)
    }

    /// Queues a settled reply on a management or CBS receiver link.
    pub(super) fn send_reply(&mut self, handle: u32, payload: Vec<u8>) {
        let Some(l) = self.links.get_mut(&handle) else { return };
        l.credit = l.credit.saturating_sub(1);
        l.delivery_count = l.delivery_count.wrapping_add(1);
        let tag = Bytes::copy_from_slice(&u64::from(l.delivery_count).to_be_bytes());
        self.deliver(handle, tag, true, payload, None);
    }

    /// Queues a link flow behind the deliveries already queued.
    pub(super) fn link_flow(&mut self, link: u64, flow: Flow) {
        self.outgoing.push_back(Queued::Flow { link, flow });
    }

    /// Drops the queued deliveries of one link (or of all), releasing their messages.
    pub(super) fn discard_outgoing(&mut self, link: Option<u64>) {
        let queued = std::mem::take(&mut self.outgoing);
        for q in queued {
            if link.is_some_and(|id| id != q.link()) {
                self.outgoing.push_back(q);
                continue;
            }
            let Queued::Delivery(o) = q else { continue };
            self.unsettled.remove(&o.delivery_id);
            if let Some(lock) = o.lock
                && let Some(l) = self.links.get(&o.remote_handle).filter(|l| l.id == o.link)
            {
                l.job(Job::Release(lock));
            }
        }
    }
}

/// A delivery on its way out, frame by frame as the peer's session window allows.
pub(super) struct Outgoing {
    pub(super) link: u64,
    pub(super) remote_handle: u32,
    pub(super) local_handle: u32,
    pub(super) delivery_id: u32,
    pub(super) tag: Bytes,
    pub(super) settled: bool,
    pub(super) payload: Vec<u8>,
    /// Payload bytes already written.
    pub(super) written: usize,
    pub(super) started: bool,
    /// The broker lock of the message: completed once written when `settled`
    /// (receive-and-delete), released if the delivery is dropped before it is written.
    pub(super) lock: Option<LockToken>,
}

/// What waits in a session's outgoing queue: deliveries, and the link flows that must not
/// overtake them (a drain answer counts the deliveries before it).
pub(super) enum Queued {
    Delivery(Outgoing),
    Flow { link: u64, flow: Flow },
}

impl Queued {
    pub(super) fn link(&self) -> u64 {
        match self {
            Queued::Delivery(o) => o.link,
            Queued::Flow { link, .. } => *link,
        }
    }
}

/// Bytes waiting to be written, and how to split transfers.
pub(super) struct Out {
    pub(super) buf: Vec<u8>,
    pub(super) peer_max_frame: u32,
}

impl Out {
    pub(super) fn send(&mut self, channel: u16, p: &Performative) {
        tracing::trace!(channel, frame = ?p, "send");
        frame::write_frame(&mut self.buf, frame::TYPE_AMQP, channel, p, &[]);
    }

    /// Writes an unsettled delivery as one transfer frame whose payload `write` encodes in
    /// place, when nothing waits in the session's queue before it, the peer's window has room
    /// and the frame fits the peer's frame size; returns its delivery id. Otherwise writes
    /// nothing and gives the tag back, for the delivery to be queued
    /// ([`Session::deliver`]).
    ///
    /// `at_least` is a bound below the payload's size: a payload surely too large for one frame
    /// is not encoded here only to be encoded again for the queue.
    pub(super) fn write_delivery<S>(
        &mut self,
        s: &mut Session<S>,
        remote_handle: u32,
        tag: Bytes,
        at_least: usize,
        write: impl FnOnce(&mut Vec<u8>),
    ) -> Result<u32, Bytes> {
        let max = usize::try_from(self.peer_max_frame).unwrap_or(usize::MAX);
        let Some(l) = s.links.get(&remote_handle) else { return Err(tag) };
        if !s.outgoing.is_empty() || s.remote_incoming_window == 0 || at_least > max {
            return Err(tag);
        }
        let delivery_id = s.next_delivery_id;
        let t = Transfer {
            handle: l.local_handle,
            delivery_id: Some(delivery_id),
            delivery_tag: Some(tag),
            message_format: Some(0),
            settled: Some(false),
            ..Transfer::default()
        };
        let start = self.buf.len();
        let p = Performative::Transfer(t);
        let size =
            frame::write_frame_with(&mut self.buf, frame::TYPE_AMQP, s.local_channel, &p, write);
        if size > max {
            self.buf.truncate(start);
            let tag = match p {
                Performative::Transfer(t) => t.delivery_tag,
                _ => None,
            };
            return Err(tag.unwrap_or_default());
        }
        tracing::trace!(
            channel = s.local_channel,
            handle = l.local_handle,
            delivery_id,
            settled = false,
            bytes = size,
            "send transfer"
        );
        s.next_delivery_id = s.next_delivery_id.wrapping_add(1);
        s.next_outgoing_id = s.next_outgoing_id.wrapping_add(1);
        s.remote_incoming_window -= 1;
        Ok(delivery_id)
    }

    /// Writes what a session has queued while the peer's window has room: deliveries split
    /// into frames that fit the peer's frame size, and the link flows between them.
    pub(super) fn flush<S>(&mut self, s: &mut Session<S>) {
        let max = usize::try_from(self.peer_max_frame).unwrap_or(usize::MAX);
        loop {
            let o = match s.outgoing.front_mut() {
                None => break,
                Some(Queued::Flow { .. }) => {
                    let Some(Queued::Flow { flow, .. }) = s.outgoing.pop_front() else { break };
                    // The session fields as they are now, not as they were when it was queued.
                    let flow = Flow { ..flow_with_session(flow, s) };
                    self.send(s.local_channel, &Performative::Flow(flow));
                    continue;
                }
                Some(Queued::Delivery(o)) => o,
            };
            if s.remote_incoming_window == 0 {
                break;
            }
            // Room for the frame header and the largest transfer performative twice writes.
            let room = max.saturating_sub(8 + 64 + o.tag.len()).max(64);
            let end = o.payload.len().min(o.written + room);
            let more = end < o.payload.len();
            let first = !o.started;
            if first {
                tracing::trace!(
                    channel = s.local_channel,
                    handle = o.local_handle,
                    delivery_id = o.delivery_id,
                    settled = o.settled,
                    bytes = o.payload.len(),
                    "send transfer"
                );
            }
            let t = Transfer {
                handle: o.local_handle,
                delivery_id: first.then_some(o.delivery_id),
                // The tag goes out once, with the first frame.
                delivery_tag: first.then(|| std::mem::take(&mut o.tag)),
                message_format: first.then_some(0),
                settled: Some(o.settled),
                more,
                ..Transfer::default()
            };
            frame::write_frame(
                &mut self.buf,
                frame::TYPE_AMQP,
                s.local_channel,
                &Performative::Transfer(t),
                o.payload.get(o.written..end).unwrap_or(&[]),
            );
            o.written = end;
            o.started = true;
            s.next_outgoing_id = s.next_outgoing_id.wrapping_add(1);
            s.remote_incoming_window -= 1;
            if more {
                continue;
            }
            let Some(Queued::Delivery(done)) = s.outgoing.pop_front() else { break };
            if let (true, Some(lock)) = (done.settled, done.lock) {
                // Receive-and-delete: the message is the client's now.
                if let Some(l) = s.links.get(&done.remote_handle).filter(|l| l.id == done.link) {
                    l.job(Job::Complete(lock));
                }
            }
        }
    }
}

/// A link flow with the session's current fields.
fn flow_with_session<S>(link: Flow, s: &Session<S>) -> Flow {
    Flow {
        handle: link.handle,
        delivery_count: link.delivery_count,
        link_credit: link.link_credit,
        available: link.available,
        drain: link.drain,
        echo: link.echo,
        ..sflow!(s)
    }
}

/// Tells the pump of a link what it may take now (see [`PumpCtl`]).
pub(super) fn update_pump<S>(l: &mut Link<S>, max_unsettled: u32) {
    let Some(pump) = &l.pump else { return };
    let credit = if l.mode == ReceiveMode::ReceiveAndDelete {
        l.credit
    } else {
        l.credit.min(max_unsettled.saturating_sub(l.unsettled))
    };
    let ctl = PumpCtl {
        limit: l.taken + u64::from(credit),
        drain: if l.drain { l.drain_seq } else { 0 },
    };
    // Only a change wakes the pump.
    pump.send_if_modified(|current| {
        let changed = *current != ctl;
        *current = ctl;
        changed
    });
}

/// What the pump of a receiver link may take.
///
/// `limit` counts messages the pump has handed over since the link was attached: the pump may
/// take more while it has handed over fewer. Counting in absolute terms means a batch still on
/// its way to the connection is never counted twice. `drain` is the number of the drain the
/// client asked for last (0 when it is not draining).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PumpCtl {
    pub(super) limit: u64,
    pub(super) drain: u64,
}

/// Where a receiver link takes messages from.
pub(super) enum Source<S> {
    Entity(String),
    Session(Arc<S>),
}

impl<S> Clone for Source<S> {
    fn clone(&self) -> Self {
        match self {
            Source::Entity(e) => Source::Entity(e.clone()),
            Source::Session(s) => Source::Session(s.clone()),
        }
    }
}

/// A delivery outcome to echo: delivery id, outcome, and whether the client waits for it.
pub(super) type Echo = (u32, Outcome, bool);

/// Reports from the tasks a connection spawned.
pub(super) enum Event<S> {
    /// The pump took messages (or answers drain number `drain` with what it found).
    Batch {
        link: u64,
        drain: u64,
        source: Source<S>,
        result: Result<Vec<ReceivedMessage>, BackendError>,
    },
    /// The broker knows the entity of an attach (or not).
    Resolved {
        link: u64,
        kind: Option<EntityKind>,
    },
    SessionAccepted {
        link: u64,
        result: Result<Option<S>, BackendError>,
    },
    /// Sends of one sender link stored (or refused): delivery id, settled by the client,
    /// message count, outcome; and the bytes of the transfers.
    Sent {
        link: u64,
        entity: String,
        results: Vec<(u32, bool, usize, Outcome)>,
        bytes: usize,
    },
    /// Dispositions the settler applied.
    Settled {
        link: u64,
        results: Vec<Echo>,
    },
    /// A management request answered; `settled` are the locks it settled.
    Replied {
        link: u64,
        reply: mgmt::Reply,
        settled: Vec<LockToken>,
    },
    /// The session lock of a session receiver link is gone.
    SessionLockLost {
        link: u64,
    },
}

/// A send waiting for its link's sender task.
pub(super) struct PendingSend {
    pub(super) delivery_id: u32,
    pub(super) settled: bool,
    /// The size of the transfer, counted against the connection's bytes in flight.
    pub(super) bytes: usize,
    pub(super) messages: Vec<twice::Message>,
}

/// Work for a receiver link's settler, applied in the order queued.
pub(super) enum Job {
    /// A client's disposition: apply `how` (nothing for a non-terminal state), then echo
    /// `echo` (or the error the broker gave) if `reply`.
    Settle {
        delivery_id: u32,
        lock: LockToken,
        how: Option<Settlement>,
        echo: Outcome,
        reply: bool,
    },
    /// Complete a message delivered settled (receive-and-delete) once it is written.
    Complete(LockToken),
    /// Release a message taken but never delivered.
    Release(LockToken),
}

impl Job {
    /// The lock of a completion, which runs with its neighbours in one broker call.
    pub(super) fn completes(&self) -> Option<LockToken> {
        match self {
            Job::Settle { lock, how: Some(Settlement::Complete), .. } | Job::Complete(lock) => {
                Some(*lock)
            }
            _ => None,
        }
    }
}

/// A delivery twice sent and the client has not settled.
pub(super) struct Unsettled {
    pub(super) link: u64,
    pub(super) lock: LockToken,
}

/// The claim a link needs: sending to an entity, receiving from one, or (for a management
/// node, checked per request) any.
pub(super) fn need_of<S>(l: &Link<S>) -> Option<Claim> {
    match l.node {
        Node::Entity(_) if l.client_receives => Some(Claim::Listen),
        Node::Entity(_) => Some(Claim::Send),
        Node::Management(_) | Node::Cbs => None,
    }
}

/// The highest channel a connection with at most `sessions` sessions announces.
pub(super) fn max_channel(sessions: usize) -> u16 {
    u16::try_from(sessions.saturating_sub(1)).unwrap_or(u16::MAX)
}
