//! One AMQP connection: handshake, sessions, links, credit, settlement, `$cbs` and
//! `$management`.
//!
//! A connection is one task that owns all of its state and is the only writer of its socket.
//! It never waits for the broker: every broker call runs in a task of the link it serves, which
//! reports back over a channel, so frames keep being read (and sends, settlements and receives
//! of many links stay in flight together) while the broker writes to disk:
//!
//! - a client sender link has a *sender task* that stores its messages in order, grouping what
//!   has queued up into one broker call;
//! - a client receiver link has a *pump* that takes messages within the link credit, and a
//!   *settler* that applies the client's dispositions in order, completing runs of them in one
//!   broker call, and releases the link's session lock last;
//! - a `$management` link has a *request task* that answers its requests in order;
//! - a session receiver link has a timer that notices a lost session lock while the link idles.
//!
//! Outgoing transfers respect the peer's session incoming window: deliveries wait in the
//! session's queue until the peer's flow makes room.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use twice::{LockToken, ReceivedMessage, SessionId, SharedClock};
use uuid::Uuid;

use crate::address::{self, Node};
use crate::backend::{Backend, BackendError, BackendSession, EntityKind, ReceiveMode, Settlement};
use crate::codec::Value;
use crate::conditions::{self as cond, backend_error, not_found, session_lock_lost, token_expired};
use crate::frame::{self, Frame, FrameReader, ReadError};
use crate::grants::{Grants, audience_is_ours, same_secret};
use crate::ids::IdPool;
use crate::mapping::{self, Presentation};
use crate::metrics::{Counter, Metrics};
use crate::mgmt;
use crate::performative::{
    AmqpError, Attach, Begin, Detach, Disposition, Flow, Open, Outcome, Performative,
    ROLE_RECEIVER, ROLE_SENDER, Transfer,
};
use crate::sas::{Claim, Claims};
use crate::shared::Shared;

/// Credit granted to client senders, topped up when half is used.
const SENDER_CREDIT: u32 = 1000;
/// The session window twice advertises.
const SESSION_WINDOW: u32 = 5000;
/// How long a pump waits in one receive call before asking again.
const PUMP_WAIT: Duration = Duration::from_secs(30);
/// How long an accept-next-session waits when the client gives no `com.microsoft:timeout`.
const DEFAULT_SESSION_WAIT: Duration = Duration::from_secs(65);
/// The most settlements a settler takes from its queue at once.
const SETTLE_BATCH: usize = 1024;
/// The most messages a pump asks for in one receive, whatever the credit.
const PUMP_BATCH: u64 = 512;

/// The claim a link needs: sending to an entity, receiving from one, or (for a management
/// node, checked per request) any.
fn need_of<S>(l: &Link<S>) -> Option<Claim> {
    match l.node {
        Node::Entity(_) if l.client_receives => Some(Claim::Listen),
        Node::Entity(_) => Some(Claim::Send),
        Node::Management(_) | Node::Cbs => None,
    }
}

/// Why a connection ends.
#[derive(Debug)]
enum End {
    /// Close with this error (or cleanly).
    Close(Option<AmqpError>),
    /// Drop the socket without a close frame.
    Drop,
}

/// What the pump of a receiver link may take.
///
/// `limit` counts messages the pump has handed over since the link was attached: the pump may
/// take more while it has handed over fewer. Counting in absolute terms means a batch still on
/// its way to the connection is never counted twice. `drain` is the number of the drain the
/// client asked for last (0 when it is not draining).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PumpCtl {
    limit: u64,
    drain: u64,
}

/// Where a receiver link takes messages from.
enum Source<S> {
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
type Echo = (u32, Outcome, bool);

/// Reports from the tasks a connection spawned.
enum Event<S> {
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
struct PendingSend {
    delivery_id: u32,
    settled: bool,
    /// The size of the transfer, counted against the connection's bytes in flight.
    bytes: usize,
    messages: Vec<twice::Message>,
}

/// Work for a receiver link's settler, applied in the order queued.
enum Job {
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
    fn completes(&self) -> Option<LockToken> {
        match self {
            Job::Settle { lock, how: Some(Settlement::Complete), .. } | Job::Complete(lock) => {
                Some(*lock)
            }
            _ => None,
        }
    }
}

/// A delivery twice sent and the client has not settled.
struct Unsettled {
    link: u64,
    lock: LockToken,
}

#[derive(Default)]
struct Partial {
    delivery_id: u32,
    format: u32,
    settled: bool,
    buf: Vec<u8>,
    oversize: bool,
}

/// A delivery on its way out, frame by frame as the peer's session window allows.
struct Outgoing {
    link: u64,
    remote_handle: u32,
    local_handle: u32,
    delivery_id: u32,
    tag: Bytes,
    settled: bool,
    payload: Vec<u8>,
    /// Payload bytes already written.
    written: usize,
    started: bool,
    /// The broker lock of the message: completed once written when `settled`
    /// (receive-and-delete), released if the delivery is dropped before it is written.
    lock: Option<LockToken>,
}

/// What waits in a session's outgoing queue: deliveries, and the link flows that must not
/// overtake them (a drain answer counts the deliveries before it).
enum Queued {
    Delivery(Outgoing),
    Flow { link: u64, flow: Flow },
}

impl Queued {
    fn link(&self) -> u64 {
        match self {
            Queued::Delivery(o) => o.link,
            Queued::Flow { link, .. } => *link,
        }
    }
}

struct Link<S> {
    id: u64,
    name: String,
    local_handle: u32,
    /// The client receives on this link (twice sends).
    client_receives: bool,
    node: Node,
    path: String,
    target_address: Option<String>,
    attach: Attach,
    /// twice has sent its attach.
    attached: bool,
    /// twice has sent its detach.
    detached: bool,
    // Twice as sender.
    mode: ReceiveMode,
    delivery_count: u32,
    credit: u32,
    /// A drain the client asked for is not answered yet.
    drain: bool,
    /// The number of the client's last drain.
    drain_seq: u64,
    /// Messages the pump handed over (see [`PumpCtl`]).
    taken: u64,
    unsettled: u32,
    pump: Option<watch::Sender<PumpCtl>>,
    session: Option<Arc<S>>,
    settle: Option<mpsc::UnboundedSender<Job>>,
    /// Dropping it stops the link's session lock timer.
    lock_watch: Option<oneshot::Sender<()>>,
    replies: VecDeque<Vec<u8>>,
    // Twice as receiver.
    rx_delivery_count: u32,
    rx_credit: u32,
    /// Deliveries received and handed to the sender or request task, not yet answered: the
    /// credit they took comes back only when they are.
    rx_in_flight: u32,
    partial: Option<Partial>,
    sends: Option<mpsc::UnboundedSender<PendingSend>>,
    requests: Option<mpsc::UnboundedSender<(mgmt::Request, Option<Arc<S>>)>>,
}

impl<S> Link<S> {
    /// Queues work for the link's settler.
    fn job(&self, job: Job) {
        if let Some(tx) = &self.settle {
            let _ = tx.send(job);
        }
    }
}

struct Session<S> {
    local_channel: u16,
    next_outgoing_id: u32,
    next_delivery_id: u32,
    next_incoming_id: u32,
    incoming_window: u32,
    /// How many more transfer frames the peer takes (its incoming window as twice sees it).
    remote_incoming_window: u32,
    frames_since_flow: u32,
    links: HashMap<u32, Link<S>>,
    /// Local handles of this session's links.
    handles: IdPool,
    /// By delivery id, ordered so a disposition's range costs only the deliveries in it.
    unsettled: BTreeMap<u32, Unsettled>,
    outgoing: VecDeque<Queued>,
}

/// The session fields of a flow, read field by field so a link of the session may stay
/// borrowed.
macro_rules! sflow {
    ($s:expr) => {
        Flow {
            next_incoming_id: Some($s.next_incoming_id),
            incoming_window: $s.incoming_window,
            next_outgoing_id: $s.next_outgoing_id,
            outgoing_window: SESSION_WINDOW,
            ..Flow::default()
        }
    };
}

impl<S> Session<S> {
    /// Forgets a link of this session, giving its local handle back.
    fn remove_link(&mut self, handle: u32) -> Option<Link<S>> {
        let l = self.links.remove(&handle)?;
        self.handles.give_back(l.local_handle);
        Some(l)
    }

    /// Queues a delivery on the link with this remote handle; returns its delivery id.
    fn deliver(
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
    fn send_reply(&mut self, handle: u32, payload: Vec<u8>) {
        let Some(l) = self.links.get_mut(&handle) else { return };
        l.credit = l.credit.saturating_sub(1);
        l.delivery_count = l.delivery_count.wrapping_add(1);
        let tag = Bytes::copy_from_slice(&u64::from(l.delivery_count).to_be_bytes());
        self.deliver(handle, tag, true, payload, None);
    }

    /// Queues a link flow behind the deliveries already queued.
    fn link_flow(&mut self, link: u64, flow: Flow) {
        self.outgoing.push_back(Queued::Flow { link, flow });
    }

    /// Drops the queued deliveries of one link (or of all), releasing their messages.
    fn discard_outgoing(&mut self, link: Option<u64>) {
        let queued = std::mem::take(&mut self.outgoing);
        for q in queued {
            if link.is_some_and(|id| id != q.link()) {
                self.outgoing.push_back(q);
                continue;
            }
            let Queued::Delivery(o) = q else { continue };
            self.unsettled.remove(&o.delivery_id);
            if let Some(lock) = o.lock {
                if let Some(l) = self.links.get(&o.remote_handle).filter(|l| l.id == o.link) {
                    l.job(Job::Release(lock));
                }
            }
        }
    }
}

/// Bytes waiting to be written, and how to split transfers.
struct Out {
    buf: Vec<u8>,
    peer_max_frame: u32,
}

impl Out {
    fn send(&mut self, channel: u16, p: &Performative) {
        tracing::trace!(channel, frame = ?p, "send");
        frame::write_frame(&mut self.buf, frame::TYPE_AMQP, channel, p, &[]);
    }

    /// Writes what a session has queued while the peer's window has room: deliveries split
    /// into frames that fit the peer's frame size, and the link flows between them.
    fn flush<S>(&mut self, s: &mut Session<S>) {
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
                delivery_tag: first.then(|| o.tag.clone()),
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

struct Conn<B: Backend> {
    shared: Arc<Shared<B>>,
    out: Out,
    sessions: HashMap<u16, Session<B::Session>>,
    /// Link id to (remote channel, remote handle).
    links: HashMap<u64, (u16, u32)>,
    next_link_id: u64,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    /// Local channels of the sessions.
    channels: IdPool,
    /// Bytes of transfers handed to sender tasks and not yet stored: past
    /// [`ServerOptions::max_bytes_in_flight`](crate::ServerOptions::max_bytes_in_flight) the
    /// connection stops reading until the broker catches up.
    bytes_in_flight: usize,
    /// Paths the connection may use (from tokens); `Some("")` is all of them.
    grants: Grants,
    channel_max: u16,
    heard: bool,
}

/// What a connection needs to be let in: the pending slot it holds during its handshake, and
/// the connection slots it takes one of once it has sent `open`.
pub(crate) struct Admission {
    pub(crate) handshake: OwnedSemaphorePermit,
    pub(crate) slots: Arc<Semaphore>,
}

/// Counts a connection as open for as long as it lives.
struct Opened<'a>(&'a Metrics);

impl Drop for Opened<'_> {
    fn drop(&mut self) {
        self.0.connection_closed();
    }
}

/// Serves one connection until it closes, the peer goes silent, or `shutdown` fires.
///
/// The handshake (protocol headers, SASL, `open`) must finish within the handshake timeout.
/// A connection over the connection limit is then answered with `open` and a `close` carrying
/// `amqp:resource-limit-exceeded`, so the client sees why (a quota error) instead of a reset.
///
/// # Cancel safety
///
/// Dropping the future drops the connection without a close frame; the tasks of its links end
/// when they notice, releasing what they hold.
pub(crate) async fn serve<B, IO>(
    io: IO,
    shared: Arc<Shared<B>>,
    mut shutdown: watch::Receiver<bool>,
    admission: Admission,
) where
    B: Backend,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (rd, mut wr) = tokio::io::split(io);
    // Until `open` has negotiated a frame size, frames are at most 512 bytes (AMQP 1.0 section
    // 2.4.1): an unauthenticated peer cannot make the server buffer more.
    let mut reader = FrameReader::new(rd, frame::MIN_MAX_FRAME_SIZE);
    let opening = async {
        let sasl_ok = handshake(&mut reader, &mut wr, &shared).await?;
        let first = reader.read_frame().await.map_err(|_| ())?;
        Ok::<_, ()>((sasl_ok, first))
    };
    let (sasl_ok, first) =
        match tokio::time::timeout(shared.options.handshake_timeout, opening).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(())) | Err(_) => return,
        };
    let Ok(_slot) = admission.slots.try_acquire_owned() else {
        tracing::warn!("connection refused: the connection limit is reached");
        drop(admission.handshake);
        refuse(&first, &mut wr, &shared).await;
        return;
    };
    drop(admission.handshake);
    shared.metrics.connection_opened();
    let _opened = Opened(&shared.metrics);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut conn = Conn {
        shared: shared.clone(),
        out: Out { buf: Vec::new(), peer_max_frame: frame::MIN_MAX_FRAME_SIZE },
        sessions: HashMap::new(),
        links: HashMap::new(),
        channels: IdPool::default(),
        bytes_in_flight: 0,
        next_link_id: 0,
        events: tx,
        grants: match sasl_ok {
            Some(claims) => Grants::everything(claims),
            None => Grants::default(),
        },
        channel_max: u16::MAX,
        heard: true,
    };
    // The first frame must be `open`.
    let (heartbeat, idle_ticks) = match conn.on_open(&first) {
        Ok(v) => v,
        Err(end) => {
            conn.finish(&mut wr, end).await;
            return;
        }
    };
    if wr.write_all(&conn.out.buf).await.is_err() {
        return;
    }
    conn.out.buf.clear();
    reader.set_max_frame_size(shared.options.max_frame_size);
    let mut ticker = tokio::time::interval(heartbeat);
    ticker.tick().await;
    let mut silent_ticks = 0u32;
    let max_in_flight = shared.options.max_bytes_in_flight;
    let write_timeout = shared.options.write_timeout;
    let end = loop {
        // Backpressure: while the broker has not stored what this connection sent, the socket
        // is not read, so a fast producer is held by TCP rather than by the server's memory.
        let reading = conn.bytes_in_flight <= max_in_flight;
        let step = tokio::select! {
            f = reader.read_frame(), if reading => match f {
                Ok(f) => {
                    conn.heard = true;
                    conn.on_frame(&f)
                }
                Err(ReadError::TooLarge { size, max }) => Err(End::Close(Some(AmqpError::new(
                    cond::FRAME_TOO_LARGE,
                    format!("frame of {size} bytes exceeds the maximum frame size {max}"),
                )))),
                Err(ReadError::BadHeader { .. }) => Err(End::Close(Some(AmqpError::new(
                    cond::FRAME_TOO_LARGE,
                    "malformed frame header",
                )))),
                Err(_) => Err(End::Drop),
            },
            Some(ev) = rx.recv() => {
                conn.on_event(ev);
                // Take whatever else has been reported, so one write carries it all.
                while let Ok(ev) = rx.try_recv() {
                    conn.on_event(ev);
                }
                Ok(())
            }
            _ = ticker.tick() => {
                conn.detach_unauthorized();
                // A connection the server does not read is not idle.
                if conn.heard || !reading {
                    silent_ticks = 0;
                } else {
                    silent_ticks += 1;
                }
                conn.heard = false;
                if silent_ticks >= idle_ticks {
                    Err(End::Close(Some(AmqpError::new(cond::RESOURCE_LIMIT, "idle timeout: no frames from the peer"))))
                } else {
                    if conn.out.buf.is_empty() {
                        conn.out.buf.extend_from_slice(&frame::HEARTBEAT);
                    }
                    Ok(())
                }
            }
            _ = shutdown.changed() => Err(End::Close(Some(AmqpError::new(cond::FORCED, "the server is shutting down")))),
        };
        if !conn.out.buf.is_empty() {
            // A client that stops reading is dropped rather than holding the connection (and
            // what its links hold) forever.
            match tokio::time::timeout(write_timeout, wr.write_all(&conn.out.buf)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => break End::Drop,
                Err(_) => {
                    tracing::debug!("dropping a connection whose peer stopped reading");
                    break End::Drop;
                }
            }
            conn.out.buf.clear();
        }
        if let Err(end) = step {
            break end;
        }
    };
    conn.finish(&mut wr, end).await;
}

/// Answers a connection over the limit whose first frame was `open`: `open` and a `close`
/// with `amqp:resource-limit-exceeded`.
///
/// # Cancel safety
///
/// Dropping the future drops the connection.
async fn refuse<B: Backend, W: AsyncWrite + Unpin>(first: &Frame, wr: &mut W, shared: &Shared<B>) {
    if !matches!(Performative::decode(&first.body), Ok((Performative::Open(_), _))) {
        return;
    }
    let error = AmqpError::new(
        cond::RESOURCE_LIMIT,
        format!("the server serves at most {} connections", shared.options.max_connections),
    );
    let mut out = Vec::new();
    let open = Open { container_id: "twice".into(), max_frame_size: 65536, ..Open::default() };
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Close(Some(error)), &[]);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        wr.write_all(&out).await?;
        wr.shutdown().await
    })
    .await;
}

/// Protocol headers and SASL. Returns the claims of the configured key SASL PLAIN
/// authenticated with, if it did.
async fn handshake<B: Backend, R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut FrameReader<R>,
    wr: &mut W,
    shared: &Shared<B>,
) -> Result<Option<Claims>, ()> {
    let mut header = reader.read_protocol_header().await.map_err(|_| ())?;
    let mut plain_ok = None;
    if header == frame::SASL_HEADER {
        let mut out = frame::SASL_HEADER.to_vec();
        let mechs = Performative::SaslMechanisms(vec![
            "MSSBCBS".into(),
            "ANONYMOUS".into(),
            "PLAIN".into(),
        ]);
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &mechs, &[]);
        wr.write_all(&out).await.map_err(|_| ())?;
        let f = reader.read_frame().await.map_err(|_| ())?;
        let init = match Performative::decode(&f.body) {
            Ok((Performative::SaslInit(i), _)) if f.kind == frame::TYPE_SASL => i,
            _ => return Err(()),
        };
        let code = match init.mechanism.as_str() {
            "ANONYMOUS" | "MSSBCBS" => 0,
            "PLAIN" => {
                let resp = init.initial_response.unwrap_or_default();
                let mut parts = resp.split(|b| *b == 0);
                let _authzid = parts.next();
                let user = parts.next().and_then(|u| std::str::from_utf8(u).ok());
                let pass = parts.next().and_then(|p| std::str::from_utf8(p).ok());
                match (user, pass) {
                    (Some(u), Some(p))
                        if shared
                            .options
                            .keys
                            .get(u)
                            .is_some_and(|k| same_secret(k.as_bytes(), p.as_bytes())) =>
                    {
                        plain_ok = Some(shared.options.keys.claims(u));
                        0
                    }
                    _ => 1,
                }
            }
            _ => 1,
        };
        let mut out = Vec::new();
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslOutcome(code), &[]);
        wr.write_all(&out).await.map_err(|_| ())?;
        if code != 0 {
            tracing::debug!(mechanism = %init.mechanism, "sasl authentication failed");
            return Err(());
        }
        header = reader.read_protocol_header().await.map_err(|_| ())?;
    }
    if header != frame::AMQP_HEADER {
        // The specification's answer to an unsupported header: ours, then close.
        let _ = wr.write_all(&frame::AMQP_HEADER).await;
        return Err(());
    }
    wr.write_all(&frame::AMQP_HEADER).await.map_err(|_| ())?;
    Ok(plain_ok)
}

impl<B: Backend> Conn<B> {
    async fn finish<W: AsyncWrite + Unpin>(&mut self, wr: &mut W, end: End) {
        if let End::Close(err) = end {
            if let Some(e) = &err {
                tracing::debug!(condition = %e.condition, "closing connection");
            }
            self.out.send(0, &Performative::Close(err));
            let _ = wr.write_all(&self.out.buf).await;
            let _ = wr.flush().await;
        }
        let sessions: Vec<u16> = self.sessions.keys().copied().collect();
        for ch in sessions {
            self.drop_session(ch);
        }
    }

    fn on_open(&mut self, f: &Frame) -> Result<(Duration, u32), End> {
        let open = match Performative::decode(&f.body) {
            Ok((Performative::Open(o), _)) if f.kind == frame::TYPE_AMQP => o,
            Ok(_) => {
                return Err(End::Close(Some(AmqpError::new(cond::NOT_ALLOWED, "expected open"))));
            }
            Err(e) => {
                return Err(End::Close(Some(AmqpError::new(cond::DECODE_ERROR, e.to_string()))));
            }
        };
        self.out.peer_max_frame = open.max_frame_size.max(frame::MIN_MAX_FRAME_SIZE);
        self.channel_max = open.channel_max;
        let opts = &self.shared.options;
        let idle_ms = u32::try_from(opts.idle_timeout.as_millis()).unwrap_or(u32::MAX);
        self.out.send(
            0,
            &Performative::Open(Open {
                container_id: "twice".into(),
                hostname: None,
                max_frame_size: opts.max_frame_size,
                channel_max: max_channel(opts.max_sessions_per_connection),
                idle_time_out: (idle_ms > 0).then_some(idle_ms),
                properties: None,
            }),
        );
        // Heartbeat at half the peer's idle timeout (at most every 10 s); drop a peer silent
        // for twice ours.
        let peer_idle = open
            .idle_time_out
            .filter(|ms| *ms > 0)
            .map(|ms| Duration::from_millis(u64::from(ms) / 2));
        let beat = peer_idle
            .unwrap_or(Duration::from_secs(10))
            .clamp(Duration::from_millis(100), Duration::from_secs(10));
        let ticks = if opts.idle_timeout.is_zero() {
            u32::MAX
        } else {
            let n = (opts.idle_timeout * 2).as_millis() / beat.as_millis().max(1);
            u32::try_from(n).unwrap_or(u32::MAX).max(2)
        };
        Ok((beat, ticks))
    }

    fn on_frame(&mut self, f: &Frame) -> Result<(), End> {
        if f.body.is_empty() {
            return Ok(());
        }
        if f.kind != frame::TYPE_AMQP {
            return Err(End::Close(Some(AmqpError::new(
                cond::NOT_ALLOWED,
                "unexpected frame type",
            ))));
        }
        let (p, payload) = Performative::decode(&f.body).map_err(|e| {
            let c = match e {
                crate::performative::FrameError::Unknown(_) => cond::NOT_IMPLEMENTED,
                _ => cond::DECODE_ERROR,
            };
            End::Close(Some(AmqpError::new(c, e.to_string())))
        })?;
        tracing::trace!(channel = f.channel, frame = ?p, payload = payload.len(), "recv");
        let ch = f.channel;
        match p {
            Performative::Open(_) => {
                Err(End::Close(Some(AmqpError::new(cond::NOT_ALLOWED, "open received twice"))))
            }
            Performative::Close(_) => {
                let sessions: Vec<u16> = self.sessions.keys().copied().collect();
                for s in sessions {
                    self.drop_session(s);
                }
                Err(End::Close(None))
            }
            Performative::Begin(b) => self.on_begin(ch, &b),
            Performative::End(_) => {
                if let Some(local) = self.sessions.get(&ch).map(|s| s.local_channel) {
                    self.drop_session(ch);
                    self.out.send(local, &Performative::End(None));
                }
                Ok(())
            }
            Performative::Attach(a) => self.on_attach(ch, a),
            Performative::Detach(d) => {
                self.on_detach(ch, &d);
                Ok(())
            }
            Performative::Flow(fl) => {
                self.on_flow(ch, &fl);
                Ok(())
            }
            Performative::Transfer(t) => {
                self.on_transfer(ch, t, payload);
                Ok(())
            }
            Performative::Disposition(d) => {
                self.on_disposition(ch, &d);
                Ok(())
            }
            Performative::SaslMechanisms(_)
            | Performative::SaslInit(_)
            | Performative::SaslOutcome(_) => Err(End::Close(Some(AmqpError::new(
                cond::NOT_ALLOWED,
                "sasl frame after the handshake",
            )))),
        }
    }

    fn on_begin(&mut self, ch: u16, b: &Begin) -> Result<(), End> {
        // Beyond the channel-max twice announced: a framing error (AMQP 1.0 section 2.7.1),
        // which bounds the sessions of a connection.
        if ch > max_channel(self.shared.options.max_sessions_per_connection) {
            return Err(End::Close(Some(AmqpError::new(
                cond::FRAME_TOO_LARGE,
                format!("begin on channel {ch}, beyond the channel-max announced"),
            ))));
        }
        if ch > self.channel_max || self.sessions.contains_key(&ch) {
            return Ok(());
        }
        // At most as many sessions as channels, so a local channel always fits.
        let local = u16::try_from(self.channels.take()).unwrap_or(u16::MAX);
        self.sessions.insert(
            ch,
            Session {
                local_channel: local,
                next_outgoing_id: 0,
                next_delivery_id: 0,
                next_incoming_id: b.next_outgoing_id,
                incoming_window: SESSION_WINDOW,
                remote_incoming_window: b.incoming_window,
                frames_since_flow: 0,
                links: HashMap::new(),
                handles: IdPool::default(),
                unsettled: BTreeMap::new(),
                outgoing: VecDeque::new(),
            },
        );
        self.out.send(
            local,
            &Performative::Begin(Begin {
                remote_channel: Some(ch),
                next_outgoing_id: 0,
                incoming_window: SESSION_WINDOW,
                outgoing_window: SESSION_WINDOW,
                handle_max: handle_max(self.shared.options.max_links_per_session),
            }),
        );
        Ok(())
    }

    /// Forgets a session and everything its links hold (without sending anything).
    fn drop_session(&mut self, ch: u16) {
        let Some(mut s) = self.sessions.remove(&ch) else { return };
        self.channels.give_back(u32::from(s.local_channel));
        s.discard_outgoing(None);
        for (_, link) in s.links.drain() {
            self.links.remove(&link.id);
            release_link(link);
        }
    }

    fn authorized(&self, path: &str, need: Option<Claim>) -> bool {
        self.grants.allows(path, self.shared.clock.now().as_millis() / 1000, need)
    }

    /// Records a link and checks what needs no broker; the broker's answer about the entity
    /// comes back as [`Event::Resolved`].
    fn on_attach(&mut self, ch: u16, a: Attach) -> Result<(), End> {
        let max_links = self.shared.options.max_links_per_session;
        // Beyond the handle-max twice announced: a framing error (AMQP 1.0 section 2.7.2),
        // which bounds the links of a session.
        if a.handle > handle_max(max_links) {
            return Err(End::Close(Some(AmqpError::new(
                cond::FRAME_TOO_LARGE,
                format!("attach with handle {}, beyond the handle-max announced", a.handle),
            ))));
        }
        let Some(s) = self.sessions.get_mut(&ch) else { return Ok(()) };
        if let Some(old) = s.links.get(&a.handle).map(|l| l.id) {
            // A reused handle: the client forgot the old link; so does twice.
            s.discard_outgoing(Some(old));
            if let Some(old) = s.remove_link(a.handle) {
                self.links.remove(&old.id);
                release_link(old);
            }
        }
        let client_receives = a.role == ROLE_RECEIVER;
        let terminus = crate::performative::Terminus::parse(
            if client_receives { a.source.as_ref() } else { a.target.as_ref() },
            client_receives,
        );
        let path = address::normalize(terminus.address.as_deref().unwrap_or(""));
        let node = Node::of(&path);
        let target_address = crate::performative::Terminus::parse(a.target.as_ref(), false).address;
        let id = self.next_link_id;
        self.next_link_id += 1;
        let local_handle = s.handles.take();
        let mode = if client_receives && a.snd_settle_mode == Some(1) {
            ReceiveMode::ReceiveAndDelete
        } else {
            ReceiveMode::PeekLock
        };
        let link = Link {
            id,
            name: a.name.clone(),
            local_handle,
            client_receives,
            node: node.clone(),
            path: path.clone(),
            target_address,
            rx_delivery_count: a.initial_delivery_count.unwrap_or(0),
            attach: a,
            attached: false,
            detached: false,
            mode,
            delivery_count: 0,
            credit: 0,
            drain: false,
            drain_seq: 0,
            taken: 0,
            unsettled: 0,
            pump: None,
            session: None,
            settle: None,
            lock_watch: None,
            replies: VecDeque::new(),
            rx_credit: 0,
            rx_in_flight: 0,
            partial: None,
            sends: None,
            requests: None,
        };
        let handle = link.attach.handle;
        let too_many = s.links.len() >= max_links;
        s.links.insert(handle, link);
        self.links.insert(id, (ch, handle));
        if too_many {
            let error = AmqpError::new(
                cond::RESOURCE_LIMIT,
                format!("a session may attach at most {max_links} links"),
            );
            self.refuse(ch, handle, error);
            return Ok(());
        }
        let entity = match &node {
            Node::Cbs => {
                self.accept_attach(ch, handle, None);
                return Ok(());
            }
            Node::Management(e) | Node::Entity(e) => e.clone(),
        };
        // A token for the entity covers its management node; so does one for the node.
        let need = match &node {
            Node::Management(_) | Node::Cbs => None,
            Node::Entity(_) if client_receives => Some(Claim::Listen),
            Node::Entity(_) => Some(Claim::Send),
        };
        if !self.authorized(&path, need) {
            let error = AmqpError::new(
                cond::UNAUTHORIZED,
                format!("unauthorized access to '{entity}': put a valid token to $cbs first"),
            );
            self.refuse(ch, handle, error);
            return Ok(());
        }
        let backend = self.shared.backend.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let kind = backend.entity(&entity).await;
            let _ = events.send(Event::Resolved { link: id, kind });
        });
        Ok(())
    }

    /// Finishes an attach once the broker said what its entity is.
    fn on_resolved(&mut self, link: u64, kind: Option<EntityKind>) {
        let Some(&(ch, handle)) = self.links.get(&link) else { return };
        let Some(l) = self.sessions.get(&ch).and_then(|s| s.links.get(&handle)) else { return };
        if l.detached {
            // Refused meanwhile (a transfer beyond its credit).
            return;
        }
        let (e, node) = match &l.node {
            Node::Cbs => return,
            Node::Management(e) | Node::Entity(e) => (e.clone(), l.node.clone()),
        };
        let Some(kind) = kind else {
            self.refuse(ch, handle, not_found(&e));
            return;
        };
        if let Node::Management(_) = node {
            self.accept_attach(ch, handle, None);
            return;
        }
        let client_receives = l.client_receives;
        if !client_receives {
            if matches!(kind, EntityKind::Subscription { .. } | EntityKind::DeadLetter) {
                let error = AmqpError::new(cond::NOT_ALLOWED, format!("cannot send to '{e}'"));
                self.refuse(ch, handle, error);
            } else {
                self.accept_attach(ch, handle, None);
            }
            return;
        }
        if kind == EntityKind::Topic {
            let error = AmqpError::new(
                cond::NOT_ALLOWED,
                format!("cannot receive from topic '{e}'; receive from one of its subscriptions"),
            );
            self.refuse(ch, handle, error);
            return;
        }
        let terminus = crate::performative::Terminus::parse(l.attach.source.as_ref(), true);
        let session_filter = terminus.filter.as_ref().and_then(|f| f.as_map()).and_then(|m| {
            m.iter()
                .find(|(k, _)| k.as_str() == Some(cond::SESSION_FILTER))
                .map(|(_, v)| v.undescribed().clone())
        });
        let Some(want) = session_filter else {
            if kind.requires_session() {
                let error = AmqpError::new(
                    cond::NOT_ALLOWED,
                    "It is not possible for an entity that requires sessions to create a non-sessionful message receiver.",
                );
                self.refuse(ch, handle, error);
            } else {
                self.accept_attach(ch, handle, None);
            }
            return;
        };
        let want = want.as_str().map(SessionId::new);
        let wait = l
            .attach
            .properties
            .as_ref()
            .and_then(|p| p.get(cond::TIMEOUT_PROPERTY))
            .and_then(Value::as_i64)
            .and_then(|ms| u64::try_from(ms).ok())
            .map_or(DEFAULT_SESSION_WAIT, Duration::from_millis);
        let wait = if want.is_some() { Duration::ZERO } else { wait };
        let backend = self.shared.backend.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            // Bounded in real time whatever clock the broker runs on.
            let result = match tokio::time::timeout(
                wait + Duration::from_millis(50),
                backend.accept_session(&e, want, wait),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Ok(None),
            };
            if let Err(mpsc::error::SendError(Event::SessionAccepted {
                result: Ok(Some(s)), ..
            })) = events.send(Event::SessionAccepted { link, result })
            {
                s.close().await;
            }
        });
    }

    /// Sends twice's attach for a link, then the credit a client sender needs, or starts the
    /// tasks a client receiver needs.
    fn accept_attach(&mut self, ch: u16, handle: u32, session: Option<B::Session>) {
        let shared = self.shared.clone();
        let events = self.events.clone();
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        if l.detached {
            // Refused meanwhile: whatever was taken for it goes back.
            if let Some(sess) = session {
                tokio::spawn(async move { sess.close().await });
            }
            return;
        }
        let mut source = l.attach.source.clone();
        let mut properties = None;
        if let Some(sess) = session {
            let sid = sess.session_id().as_str().to_owned();
            source = source.map(|v| with_session_filter(&v, &sid));
            let ticks = sess
                .locked_until()
                .as_millis()
                .saturating_mul(10_000)
                .saturating_add(621_355_968_000_000_000);
            properties =
                Some(Value::Map(vec![(Value::symbol(cond::LOCKED_UNTIL_UTC), Value::Long(ticks))]));
            l.session = Some(Arc::new(sess));
        }
        let reply = Attach {
            name: l.name.clone(),
            handle: l.local_handle,
            role: !l.attach.role,
            snd_settle_mode: l.attach.snd_settle_mode,
            rcv_settle_mode: l.attach.rcv_settle_mode,
            source,
            target: l.attach.target.clone(),
            initial_delivery_count: l.client_receives.then_some(0),
            max_message_size: Some(shared.options.max_message_size),
            properties,
        };
        l.attached = true;
        self.out.send(s.local_channel, &Performative::Attach(reply));
        if !l.client_receives {
            l.rx_credit = SENDER_CREDIT;
            let fl = Flow {
                handle: Some(l.local_handle),
                delivery_count: Some(l.rx_delivery_count),
                link_credit: Some(SENDER_CREDIT),
                ..sflow!(s)
            };
            self.out.send(s.local_channel, &Performative::Flow(fl));
            return;
        }
        let Node::Entity(e) = &l.node else { return };
        let source = match &l.session {
            Some(sess) => Source::Session(sess.clone()),
            None => Source::Entity(e.clone()),
        };
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        tokio::spawn(settler(
            shared.backend.clone(),
            e.clone(),
            l.session.clone(),
            shared.metrics.clone(),
            settle_rx,
            events.clone(),
            l.id,
        ));
        l.settle = Some(settle_tx);
        if let Some(sess) = &l.session {
            let (stop, stopped) = oneshot::channel();
            tokio::spawn(watch_session_lock(
                sess.clone(),
                shared.clock.clone(),
                stopped,
                events.clone(),
                l.id,
            ));
            l.lock_watch = Some(stop);
        }
        let (tx, rx) = watch::channel(PumpCtl::default());
        tokio::spawn(pump(shared.backend.clone(), source, rx, events, l.id));
        l.pump = Some(tx);
        // Credit the client granted before the attach was answered counts from now.
        update_pump(l, shared.options.max_unsettled_per_link);
    }

    /// Refuses a link: attach with a null source (or target) and detach with the error.
    fn refuse(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        tracing::debug!(link = %l.name, condition = %error.condition, "refusing link");
        let reply = Attach {
            name: l.name.clone(),
            handle: l.local_handle,
            role: !l.attach.role,
            snd_settle_mode: l.attach.snd_settle_mode,
            rcv_settle_mode: l.attach.rcv_settle_mode,
            source: if l.client_receives { None } else { l.attach.source.clone() },
            target: if l.client_receives { l.attach.target.clone() } else { None },
            initial_delivery_count: l.client_receives.then_some(0),
            ..Attach::default()
        };
        l.attached = true;
        l.detached = true;
        let local = s.local_channel;
        let lh = l.local_handle;
        self.out.send(local, &Performative::Attach(reply));
        self.out.send(
            local,
            &Performative::Detach(Detach { handle: lh, closed: true, error: Some(error) }),
        );
    }

    fn on_detach(&mut self, ch: u16, d: &Detach) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(id) = s.links.get(&d.handle).map(|l| l.id) else { return };
        // Releases of what never went out are queued before the settler learns the link ended.
        s.discard_outgoing(Some(id));
        let Some(l) = s.remove_link(d.handle) else { return };
        self.links.remove(&l.id);
        let local = s.local_channel;
        s.unsettled.retain(|_, u| u.link != l.id);
        if !l.detached && l.attached {
            self.out.send(
                local,
                &Performative::Detach(Detach {
                    handle: l.local_handle,
                    closed: d.closed,
                    error: None,
                }),
            );
        }
        release_link(l);
    }

    fn on_flow(&mut self, ch: u16, f: &Flow) {
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

    fn on_transfer(&mut self, ch: u16, t: Transfer, payload: &[u8]) {
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
        let now = self.shared.clock.now().as_millis() / 1000;
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
        let partial = l.partial.get_or_insert_with(|| Partial {
            delivery_id: t.delivery_id.unwrap_or(0),
            format: t.message_format.unwrap_or(0),
            settled: t.settled.unwrap_or(false),
            ..Partial::default()
        });
        if let Some(id) = t.delivery_id {
            partial.delivery_id = id;
        }
        if t.settled == Some(true) {
            partial.settled = true;
        }
        if partial.buf.len() + payload.len() > max_size {
            partial.oversize = true;
            partial.buf.clear();
        } else if !partial.oversize {
            partial.buf.extend_from_slice(payload);
        }
        if t.more && !t.aborted {
            return;
        }
        let Some(done) = l.partial.take() else { return };
        if t.aborted {
            return;
        }
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
                Node::Entity(e) => match mapping::messages_of(&done.buf, done.format) {
                    Err(err) => {
                        Outcome::Rejected(Some(AmqpError::new(cond::DECODE_ERROR, err.to_string())))
                    }
                    Ok(messages) => {
                        // Sends are handed to the link's sender task, which stores them in
                        // order and in groups; the connection reads on meanwhile.
                        let pending = PendingSend {
                            delivery_id: done.delivery_id,
                            settled: done.settled,
                            bytes: done.buf.len(),
                            messages,
                        };
                        // Its credit comes back once it is stored (see `on_sent`).
                        self.queue_send(ch, t.handle, e, pending);
                        return;
                    }
                },
                Node::Cbs => {
                    let reply = self.on_cbs(&done.buf);
                    self.settle_request(ch, &done);
                    if let Some(reply) = reply {
                        self.reply(link_id, reply);
                    }
                    return self.top_up(ch, t.handle);
                }
                Node::Management(e) => {
                    // The request is settled at once; its reply follows from the link's
                    // request task, as a request/response peer expects.
                    self.settle_request(ch, &done);
                    match mgmt::Request::parse(&done.buf) {
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
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        if !done.settled {
            let d = Disposition {
                role: ROLE_RECEIVER,
                first: done.delivery_id,
                last: None,
                settled: true,
                state: Some(outcome.to_value()),
            };
            self.out.send(s.local_channel, &Performative::Disposition(d));
        }
        self.top_up(ch, t.handle);
    }

    /// Accepts a `$cbs` or `$management` request transfer.
    fn settle_request(&mut self, ch: u16, p: &Partial) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        if !p.settled {
            let d = Disposition {
                role: ROLE_RECEIVER,
                first: p.delivery_id,
                last: None,
                settled: true,
                state: Some(Outcome::Accepted.to_value()),
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
    fn answered(&mut self, link: u64, n: usize) {
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
    fn on_sent(&mut self, link: u64, entity: &str, results: Vec<(u32, bool, usize, Outcome)>) {
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

    fn on_cbs(&mut self, payload: &[u8]) -> Option<mgmt::Reply> {
        let now = self.shared.clock.now().as_millis() / 1000;
        let req = mgmt::Request::parse(payload).ok()?;
        let (status, description) = if req.operation() == Some("put-token") {
            let token = req.body.as_str().unwrap_or("");
            let opts = &self.shared.options;
            match opts.keys.validate(token, now) {
                Ok(grant) if !audience_is_ours(&grant.resource, &opts.hostname, opts.amqp_addr) => {
                    tracing::debug!("token refused: its audience names another host");
                    (401, "Unauthorized: the token's audience is not this namespace".to_owned())
                }
                Ok(grant) => {
                    let path = address::normalize(&grant.resource);
                    let claims = opts.keys.claims(&grant.key_name);
                    if self.grants.insert(path, grant.expiry, claims, now) {
                        (202, "Accepted".to_owned())
                    } else {
                        (403, "Forbidden: too many tokens on one connection".to_owned())
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "token refused");
                    (401, format!("Unauthorized: {e}"))
                }
            }
        } else {
            (400, "unknown operation".to_owned())
        };
        let mut props = vec![
            (Value::string("status-code"), Value::Int(status)),
            (Value::string("status-description"), Value::String(description)),
        ];
        if status == 401 {
            props.push((Value::string("error-condition"), Value::symbol(cond::UNAUTHORIZED)));
        }
        Some(mgmt::Reply {
            to: req.reply_to.clone(),
            correlation_id: req.message_id.clone(),
            properties: props,
            body: Value::Null,
        })
    }

    /// Sends a management or CBS reply on the client's receiver link for it.
    fn reply(&mut self, request_link: u64, reply: mgmt::Reply) {
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
    fn on_disposition(&mut self, ch: u16, d: &Disposition) {
        if d.role != ROLE_RECEIVER {
            return;
        }
        let outcome = match d.state.as_ref().map(Outcome::from_value) {
            Some(Ok(o)) => o,
            Some(Err(_)) | None => Outcome::Other,
        };
        let last = d.last.unwrap_or(d.first);
        let Some(s) = self.sessions.get_mut(&ch) else { return };
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
            let Some(u) = s.unsettled.remove(&id) else { continue };
            let (how, echo) = settlement_of(&outcome);
            let job = Job::Settle { delivery_id: id, lock: u.lock, how, echo, reply: !d.settled };
            if let Some(&(_, handle)) = self.links.get(&u.link) {
                if let Some(l) = s.links.get(&handle) {
                    l.job(job);
                }
            }
        }
    }

    fn on_event(&mut self, ev: Event<B::Session>) {
        match ev {
            Event::Resolved { link, kind } => self.on_resolved(link, kind),
            Event::SessionAccepted { link, result } => {
                let Some(&(ch, handle)) = self.links.get(&link) else {
                    if let Ok(Some(s)) = result {
                        tokio::spawn(async move { s.close().await });
                    }
                    return;
                };
                match result {
                    Ok(Some(session)) => self.accept_attach(ch, handle, Some(session)),
                    Ok(None) => self.refuse(
                        ch,
                        handle,
                        AmqpError::new(cond::TIMEOUT, "The operation did not complete within the allotted timeout: no session became available."),
                    ),
                    Err(e) => self.refuse(ch, handle, backend_error(&e)),
                }
            }
            Event::Sent { link, entity, results, bytes } => {
                self.bytes_in_flight = self.bytes_in_flight.saturating_sub(bytes);
                let n = results.len();
                self.on_sent(link, &entity, results);
                self.answered(link, n);
            }
            Event::Batch { link, drain, source, result } => {
                self.on_batch(link, drain, source, result);
            }
            Event::Settled { link, results } => self.on_settled(link, results),
            Event::Replied { link, reply, settled } => {
                for lock in settled {
                    self.forget_lock(lock);
                }
                self.reply(link, reply);
                self.answered(link, 1);
            }
            Event::SessionLockLost { link } => {
                let Some(&(ch, handle)) = self.links.get(&link) else { return };
                self.detach_with(ch, handle, session_lock_lost());
            }
        }
    }

    fn on_batch(
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
                let payload = mapping::encode_received(&m, Presentation::Locked);
                let tag = Bytes::copy_from_slice(&lock.as_uuid().to_bytes_le());
                if let Some(id) = s.deliver(handle, tag, false, payload, Some(lock)) {
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

    /// Echoes the outcomes a settler applied, and lets the pump take more.
    fn on_settled(&mut self, link: u64, results: Vec<Echo>) {
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

    /// Detaches the links whose token has expired (and was not renewed), as Service Bus does.
    fn detach_unauthorized(&mut self) {
        let mut expired = Vec::new();
        for (ch, s) in &self.sessions {
            for (handle, l) in &s.links {
                if l.attached
                    && !l.detached
                    && l.node != Node::Cbs
                    && !self.authorized(&l.path, need_of(l))
                {
                    expired.push((*ch, *handle, l.path.clone()));
                }
            }
        }
        for (ch, handle, path) in expired {
            self.detach_with(ch, handle, token_expired(&path));
        }
    }

    /// Ends a session for a session error: `end` with the error, and everything it held goes.
    fn end_session(&mut self, ch: u16, error: AmqpError) {
        let Some(local) = self.sessions.get(&ch).map(|s| s.local_channel) else { return };
        tracing::debug!(channel = ch, condition = %error.condition, "ending session");
        self.drop_session(ch);
        self.out.send(local, &Performative::End(Some(error)));
    }

    /// Ends a link for a link error: refused if twice has not answered its attach yet,
    /// detached otherwise.
    fn link_error(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let attached =
            self.sessions.get(&ch).and_then(|s| s.links.get(&handle)).is_some_and(|l| l.attached);
        if attached {
            self.detach_with(ch, handle, error);
        } else {
            self.refuse(ch, handle, error);
        }
    }

    /// Detaches a link twice's side ends (e.g. a session lock lost).
    fn detach_with(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        if l.detached {
            return;
        }
        l.detached = true;
        l.pump.take();
        l.lock_watch.take();
        let (id, lh) = (l.id, l.local_handle);
        s.discard_outgoing(Some(id));
        self.out.send(
            s.local_channel,
            &Performative::Detach(Detach { handle: lh, closed: true, error: Some(error) }),
        );
    }

    /// The session handle a receiver link of this connection holds for `entity`/`sid`.
    fn held_session(&self, entity: &str, sid: &str) -> Option<Arc<B::Session>> {
        self.sessions.values().flat_map(|s| s.links.values()).find_map(|l| {
            match (&l.node, &l.session) {
                (Node::Entity(e), Some(s))
                    if e == entity && s.session_id().as_str() == sid && !l.detached =>
                {
                    Some(s.clone())
                }
                _ => None,
            }
        })
    }

    /// Forgets a delivery settled through `$management`, so a later disposition is ignored.
    fn forget_lock(&mut self, lock: LockToken) {
        for s in self.sessions.values_mut() {
            s.unsettled.retain(|_, u| u.lock != lock);
        }
    }
}

/// The highest channel a connection with at most `sessions` sessions announces.
fn max_channel(sessions: usize) -> u16 {
    u16::try_from(sessions.saturating_sub(1)).unwrap_or(u16::MAX)
}

/// The highest handle a session with at most `links` links announces.
fn handle_max(links: usize) -> u32 {
    u32::try_from(links.saturating_sub(1)).unwrap_or(u32::MAX)
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

/// Tells the pump of a link what it may take now (see [`PumpCtl`]).
fn update_pump<S>(l: &mut Link<S>, max_unsettled: u32) {
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

/// Ends what a link holds: its pump and lock timer stop; its settler finishes the work queued
/// and then releases the session lock.
fn release_link<S: BackendSession>(mut l: Link<S>) {
    l.pump.take();
    l.lock_watch.take();
    let session = l.session.take();
    if l.settle.take().is_none() {
        if let Some(s) = session {
            tokio::spawn(async move { s.close().await });
        }
    }
}

/// Unlocks messages taken for a link that cannot deliver them.
fn release_all<B: Backend>(
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

/// What a client's outcome asks of the broker, and the outcome to echo (research §8.3): the
/// same type, without the dead-letter error a `rejected` came with.
fn settlement_of(outcome: &Outcome) -> (Option<Settlement>, Outcome) {
    match outcome {
        Outcome::Accepted => (Some(Settlement::Complete), Outcome::Accepted),
        Outcome::Released => (Some(Settlement::Release), Outcome::Released),
        Outcome::Modified { undeliverable_here: true, message_annotations, .. } => (
            Some(Settlement::Defer(mapping::properties_of(message_annotations.as_ref(), &[]))),
            outcome.clone(),
        ),
        Outcome::Modified { message_annotations, .. } => (
            Some(Settlement::Abandon(mapping::properties_of(message_annotations.as_ref(), &[]))),
            outcome.clone(),
        ),
        Outcome::Rejected(err) => (Some(dead_letter_of(err.as_ref())), Outcome::Rejected(None)),
        Outcome::Other => (None, Outcome::Accepted),
    }
}

/// The dead-letter settlement a `rejected` outcome asks for.
fn dead_letter_of(err: Option<&AmqpError>) -> Settlement {
    let info = err.and_then(|e| e.info.as_ref());
    let text = |k: &str| info.and_then(|i| i.get(k)).and_then(|v| v.as_str()).map(str::to_owned);
    let reason = text("DeadLetterReason");
    let description =
        text("DeadLetterErrorDescription").or_else(|| err.and_then(|e| e.description.clone()));
    let properties =
        mapping::properties_of(info, &["DeadLetterReason", "DeadLetterErrorDescription"]);
    Settlement::DeadLetter { reason, description, properties }
}

/// The source with `com.microsoft:session-filter` set to the session id, as a plain string.
fn with_session_filter(source: &Value, sid: &str) -> Value {
    let Value::Described(d, inner) = source else { return source.clone() };
    let mut fields = inner.as_seq().map(<[Value]>::to_vec).unwrap_or_default();
    while fields.len() < 8 {
        fields.push(Value::Null);
    }
    let mut filter: Vec<(Value, Value)> = fields[7].as_map().map(<[_]>::to_vec).unwrap_or_default();
    filter.retain(|(k, _)| k.as_str() != Some(cond::SESSION_FILTER));
    filter.push((Value::symbol(cond::SESSION_FILTER), Value::string(sid)));
    fields[7] = Value::Map(filter);
    Value::Described(d.clone(), Box::new(Value::List(fields)))
}

/// Takes up to `max` messages, locked: receive-and-delete links complete theirs once written,
/// so a message that never reaches the client can always be released.
///
/// # Cancel safety
///
/// As [`Backend::receive`]. `twice-broker` keeps that promise only until it has answered: a
/// reply already on its way is lost with the future, its messages locked until their lock
/// expires. So the pump drops a receive only for a session whose lock it is about to release,
/// which unlocks them.
async fn take<B: Backend>(
    backend: &B,
    source: &Source<B::Session>,
    max: usize,
    wait: Duration,
) -> Result<Vec<ReceivedMessage>, BackendError> {
    match source {
        Source::Entity(e) => backend.receive(e, ReceiveMode::PeekLock, max, wait).await,
        Source::Session(s) => s.receive(ReceiveMode::PeekLock, max, wait).await,
    }
}

/// Reports what the pump took; false when the pump should stop (the receive failed, or the
/// connection is gone, in which case the messages are released).
fn report<B: Backend>(
    backend: &B,
    source: &Source<B::Session>,
    events: &mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
    drain: u64,
    result: Result<Vec<ReceivedMessage>, BackendError>,
) -> bool {
    let failed = result.is_err();
    let batch = Event::Batch { link, drain, source: source.clone(), result };
    match events.send(batch) {
        Ok(()) => !failed,
        Err(mpsc::error::SendError(Event::Batch { result: Ok(messages), .. })) => {
            release_all(backend, source, messages);
            false
        }
        Err(_) => false,
    }
}

/// A receiver link's pump: takes messages within the credit and reports them.
///
/// A receive is never dropped while the link lives: a broker reply already on its way would be
/// lost with it, and its messages would stay locked. A drain that comes during a long poll is
/// answered at once with nothing (the poll would have ended had anything come), and what the
/// poll brings later is released by the connection, which has no credit left for it.
async fn pump<B: Backend>(
    backend: B,
    source: Source<B::Session>,
    mut ctl: watch::Receiver<PumpCtl>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    let mut handed = 0u64;
    let mut drained = 0u64;
    loop {
        let c = *ctl.borrow_and_update();
        let room = c.limit.saturating_sub(handed);
        let max = usize::try_from(room.min(PUMP_BATCH)).unwrap_or(1);
        if c.drain > drained {
            drained = c.drain;
            let result = if room == 0 {
                Ok(Vec::new())
            } else {
                take(&backend, &source, max, Duration::ZERO).await
            };
            handed += result.as_ref().map_or(0, |m| u64::try_from(m.len()).unwrap_or(u64::MAX));
            if !report(&backend, &source, &events, link, c.drain, result) {
                return;
            }
            continue;
        }
        if room == 0 {
            if ctl.changed().await.is_err() {
                return;
            }
            continue;
        }
        let receive = take(&backend, &source, max, PUMP_WAIT);
        tokio::pin!(receive);
        let result = loop {
            tokio::select! {
                biased;
                r = &mut receive => break r,
                changed = ctl.changed() => {
                    if changed.is_err() {
                        // The link is gone. A session's receive is dropped: releasing the
                        // session, which follows at once, unlocks anything it held. An entity's
                        // runs to its end and what it took goes back.
                        if let Source::Entity(_) = source {
                            if let Ok(messages) = receive.await {
                                release_all(&backend, &source, messages);
                            }
                        }
                        return;
                    }
                    let d = ctl.borrow().drain;
                    if d > drained {
                        drained = d;
                        if !report(&backend, &source, &events, link, d, Ok(Vec::new())) {
                            return;
                        }
                    }
                }
            }
        };
        if matches!(&result, Ok(m) if m.is_empty()) {
            continue;
        }
        handed += result.as_ref().map_or(0, |m| u64::try_from(m.len()).unwrap_or(u64::MAX));
        if !report(&backend, &source, &events, link, 0, result) {
            return;
        }
    }
}

/// A receiver link's settler: applies the client's dispositions in order, completing each run
/// of completions in one broker call (one durable write), and reports the echoes. When the
/// link ends it finishes what is queued, then releases the link's session lock.
async fn settler<B: Backend>(
    backend: B,
    entity: String,
    session: Option<Arc<B::Session>>,
    metrics: Arc<Metrics>,
    mut rx: mpsc::UnboundedReceiver<Job>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    let mut jobs = Vec::with_capacity(SETTLE_BATCH);
    while rx.recv_many(&mut jobs, SETTLE_BATCH).await > 0 {
        let mut echoes = Vec::new();
        let mut queue = jobs.drain(..).peekable();
        while let Some(job) = queue.next() {
            if job.completes().is_some() {
                let mut run = vec![job];
                while let Some(next) = queue.next_if(|j| j.completes().is_some()) {
                    run.push(next);
                }
                let locks = run.iter().filter_map(Job::completes).collect();
                let results = match &session {
                    Some(s) => s.complete_many(locks).await,
                    None => backend.complete_many(&entity, locks).await,
                };
                let mut results = results.into_iter();
                for job in run {
                    let r = results
                        .next()
                        .unwrap_or_else(|| Err(BackendError::Unavailable("no answer".into())));
                    if let Job::Settle { delivery_id, echo, reply, .. } = job {
                        let echo = echo_of(
                            &metrics,
                            &entity,
                            session.is_some(),
                            Counter::Complete,
                            r,
                            echo,
                        );
                        echoes.push((delivery_id, echo, reply));
                    }
                }
                continue;
            }
            match job {
                Job::Release(lock) => {
                    let _ = settle_one(
                        &backend,
                        &entity,
                        session.as_deref(),
                        lock,
                        Settlement::Release,
                    )
                    .await;
                }
                // Completions ran above.
                Job::Complete(_) => {}
                Job::Settle { delivery_id, how: None, echo, reply, .. } => {
                    echoes.push((delivery_id, echo, reply));
                }
                Job::Settle { delivery_id, lock, how: Some(how), echo, reply } => {
                    let counter = match &how {
                        Settlement::Abandon(_) => Counter::Abandon,
                        Settlement::DeadLetter { .. } => Counter::DeadLetter,
                        // Not counted: completions run above; defer and release have no counter.
                        _ => Counter::Receive,
                    };
                    let r = settle_one(&backend, &entity, session.as_deref(), lock, how).await;
                    let echo = echo_of(&metrics, &entity, session.is_some(), counter, r, echo);
                    echoes.push((delivery_id, echo, reply));
                }
            }
        }
        drop(queue);
        // A connection that is gone gets no echoes; the work is done all the same.
        if !echoes.is_empty() {
            let _ = events.send(Event::Settled { link, results: echoes });
        }
    }
    if let Some(s) = session {
        s.close().await;
    }
}

async fn settle_one<B: Backend>(
    backend: &B,
    entity: &str,
    session: Option<&B::Session>,
    lock: LockToken,
    how: Settlement,
) -> Result<(), BackendError> {
    match session {
        Some(s) => s.settle(lock, how).await,
        None => backend.settle(entity, lock, how).await,
    }
}

/// The outcome to echo once the broker answered, counting it.
fn echo_of(
    metrics: &Metrics,
    entity: &str,
    in_session: bool,
    counter: Counter,
    result: Result<(), BackendError>,
    echo: Outcome,
) -> Outcome {
    let e = match result {
        Ok(()) => {
            if counter != Counter::Receive {
                metrics.add(entity, counter, 1);
            }
            return echo;
        }
        Err(e) => e,
    };
    metrics.add(entity, Counter::LockLost, 1);
    let cond = if in_session && e == BackendError::SessionLockLost {
        cond::SESSION_LOCK_LOST
    } else if e == BackendError::LockLost || e == BackendError::SessionLockLost {
        cond::LOCK_LOST
    } else {
        return Outcome::Rejected(Some(backend_error(&e)));
    };
    Outcome::Rejected(Some(AmqpError::new(
        cond,
        "The lock supplied is invalid. Either the lock expired, or the message has already been removed from the queue.",
    )))
}

/// A `$management` link's request task: answers its requests in order.
async fn request_task<B: Backend>(
    backend: B,
    metrics: Arc<Metrics>,
    entity: String,
    mut rx: mpsc::UnboundedReceiver<(mgmt::Request, Option<Arc<B::Session>>)>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    while let Some((req, held)) = rx.recv().await {
        let (reply, settled) = mgmt::handle(&backend, &metrics, held, &entity, req).await;
        if events.send(Event::Replied { link, reply, settled }).is_err() {
            return;
        }
    }
}

/// Watches the lock of a session receiver link on the server's clock, so a lock that expires
/// while the link idles (no credit, so no receive to fail) detaches it with
/// `com.microsoft:session-lock-lost`. Ends when `stop` is dropped.
async fn watch_session_lock<S: BackendSession>(
    session: Arc<S>,
    clock: SharedClock,
    mut stop: oneshot::Receiver<()>,
    events: mpsc::UnboundedSender<Event<S>>,
    link: u64,
) {
    let mut deadline = session.locked_until();
    let period = deadline.duration_since(clock.now()).max(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = clock.sleep_until(deadline) => {}
            _ = &mut stop => return,
        }
        let renewed = session.locked_until();
        if renewed > deadline {
            deadline = renewed;
            continue;
        }
        let checked = tokio::select! {
            r = session.check_lock() => r,
            _ = &mut stop => return,
        };
        match checked {
            Err(BackendError::SessionLockLost) => {
                let _ = events.send(Event::SessionLockLost { link });
                return;
            }
            // Still held: renewed through one of its messages, which this handle does not see.
            // Look again a lock period from now.
            _ => deadline = clock.now() + period,
        }
    }
}

/// The sender task of one client sender link: stores its messages in order, grouping what has
/// queued up into batches within the size limit so one durable write serves many sends.
async fn sender_task<B: Backend>(
    backend: B,
    entity: String,
    max_batch_bytes: usize,
    mut rx: mpsc::UnboundedReceiver<PendingSend>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    fn size(p: &PendingSend) -> usize {
        p.messages.iter().map(|m| m.body.len() + 256).sum()
    }
    let mut group = Vec::with_capacity(256);
    while rx.recv_many(&mut group, 256).await > 0 {
        let mut results = Vec::with_capacity(group.len());
        let mut start = 0;
        while start < group.len() {
            // The largest run from `start` that fits one batch (at least one send).
            let mut end = start + 1;
            let mut bytes = size(&group[start]);
            while end < group.len() && bytes + size(&group[end]) <= max_batch_bytes {
                bytes += size(&group[end]);
                end += 1;
            }
            let chunk = &group[start..end];
            let all: Vec<twice::Message> =
                chunk.iter().flat_map(|p| p.messages.iter().cloned()).collect();
            match backend.send(&entity, all).await {
                Ok(_) => results.extend(
                    chunk
                        .iter()
                        .map(|p| (p.delivery_id, p.settled, p.messages.len(), Outcome::Accepted)),
                ),
                // A batch is all or nothing: find out which sends were refused one by one.
                Err(e) if chunk.len() == 1 => {
                    let p = &chunk[0];
                    results.push((
                        p.delivery_id,
                        p.settled,
                        0,
                        Outcome::Rejected(Some(backend_error(&e))),
                    ));
                }
                Err(_) => {
                    for p in chunk {
                        let outcome = match backend.send(&entity, p.messages.clone()).await {
                            Ok(_) => Outcome::Accepted,
                            Err(e) => Outcome::Rejected(Some(backend_error(&e))),
                        };
                        results.push((p.delivery_id, p.settled, p.messages.len(), outcome));
                    }
                }
            }
            start = end;
        }
        let bytes = group.iter().map(|p| p.bytes).sum();
        group.clear();
        let entity = entity.clone();
        if events.send(Event::Sent { link, entity, results, bytes }).is_err() {
            return;
        }
    }
}
