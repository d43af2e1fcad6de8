//! One AMQP connection: handshake, sessions, links, credit, settlement, `$cbs` and
//! `$management`.
//!
//! A connection is one task that owns all of its state. Frames are read and handled in order;
//! receiver links that wait for messages have a pump task each, which reports batches back to
//! the connection task over a channel, so the connection task is the only writer.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use twice::{LockToken, ReceivedMessage, SessionId};
use uuid::Uuid;

use crate::address::{self, Node};
use crate::backend::{Backend, BackendError, BackendSession, EntityKind, ReceiveMode, Settlement};
use crate::codec::Value;
use crate::frame::{self, Frame, FrameReader, ReadError};
use crate::mapping::{self, Presentation};
use crate::metrics::Counter;
use crate::mgmt;
use crate::performative::{
    AmqpError, Attach, Begin, Detach, Disposition, Flow, Open, Outcome, Performative,
    ROLE_RECEIVER, ROLE_SENDER, Transfer,
};
use crate::server::Shared;

/// Credit granted to client senders, topped up when half is used.
const SENDER_CREDIT: u32 = 1000;
/// The session window twice advertises.
const SESSION_WINDOW: u32 = 5000;
/// How long a pump waits in one receive call before looping.
const PUMP_WAIT: Duration = Duration::from_secs(30);
/// How long an accept-next-session waits when the client gives no `com.microsoft:timeout`.
const DEFAULT_SESSION_WAIT: Duration = Duration::from_secs(65);
/// How long the opening handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// AMQP and Service Bus error conditions twice sends.
pub(crate) mod cond {
    pub(crate) const DECODE_ERROR: &str = "amqp:decode-error";
    pub(crate) const FRAME_TOO_LARGE: &str = "amqp:connection:framing-error";
    pub(crate) const NOT_FOUND: &str = "amqp:not-found";
    pub(crate) const NOT_ALLOWED: &str = "amqp:not-allowed";
    pub(crate) const NOT_IMPLEMENTED: &str = "amqp:not-implemented";
    pub(crate) const UNAUTHORIZED: &str = "amqp:unauthorized-access";
    pub(crate) const RESOURCE_LIMIT: &str = "amqp:resource-limit-exceeded";
    pub(crate) const INTERNAL: &str = "amqp:internal-error";
    pub(crate) const MESSAGE_SIZE: &str = "amqp:link:message-size-exceeded";
    pub(crate) const LOCK_LOST: &str = "com.microsoft:message-lock-lost";
    pub(crate) const SESSION_LOCK_LOST: &str = "com.microsoft:session-lock-lost";
    pub(crate) const SESSION_CANNOT_BE_LOCKED: &str = "com.microsoft:session-cannot-be-locked";
    pub(crate) const TIMEOUT: &str = "com.microsoft:timeout";
    pub(crate) const MESSAGE_NOT_FOUND: &str = "com.microsoft:message-not-found";
    pub(crate) const ARGUMENT: &str = "com.microsoft:argument-error";
    pub(crate) const SESSION_FILTER: &str = "com.microsoft:session-filter";
}

/// The AMQP error for a broker refusal.
pub(crate) fn backend_error(e: &BackendError) -> AmqpError {
    let c = match e {
        BackendError::LockLost => cond::LOCK_LOST,
        BackendError::SessionLockLost => cond::SESSION_LOCK_LOST,
        BackendError::SessionCannotBeLocked(_) => cond::SESSION_CANNOT_BE_LOCKED,
        BackendError::EntityNotFound(_) => cond::NOT_FOUND,
        BackendError::MessageNotFound(_) => cond::MESSAGE_NOT_FOUND,
        BackendError::Invalid(_) => cond::ARGUMENT,
        BackendError::MessageSizeExceeded(_) => cond::MESSAGE_SIZE,
        BackendError::Unsupported(_) => cond::NOT_IMPLEMENTED,
        BackendError::Unavailable(_) => cond::INTERNAL,
    };
    AmqpError::new(c, e.to_string())
}

/// The canonical not-found error (JS matches the description's wording).
pub(crate) fn not_found(path: &str) -> AmqpError {
    AmqpError::new(
        cond::NOT_FOUND,
        format!(
            "The messaging entity '{path}' could not be found. To know more visit https://aka.ms/sbResourceMgrExceptions."
        ),
    )
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
#[derive(Clone, Copy, Debug, Default)]
struct PumpCtl {
    credit: u32,
    drain: bool,
    generation: u64,
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

/// Reports from the tasks a connection spawned.
enum Event<S> {
    Batch {
        link: u64,
        generation: u64,
        drain: bool,
        result: Result<Vec<ReceivedMessage>, BackendError>,
    },
    SessionAccepted {
        link: u64,
        result: Result<Option<S>, BackendError>,
    },
    /// Sends of one sender link stored (or refused): delivery id, settled by the client,
    /// message count, outcome.
    Sent {
        channel: u16,
        entity: String,
        results: Vec<(u32, bool, usize, Outcome)>,
    },
}

/// A send waiting for its link's sender task.
struct PendingSend {
    delivery_id: u32,
    settled: bool,
    messages: Vec<twice::Message>,
}

/// A delivery twice sent and the client has not settled.
struct Unsettled<S> {
    link: u64,
    entity: String,
    lock: LockToken,
    session: Option<Arc<S>>,
}

#[derive(Default)]
struct Partial {
    delivery_id: u32,
    format: u32,
    settled: bool,
    buf: Vec<u8>,
    oversize: bool,
}

struct Link<S> {
    id: u64,
    name: String,
    local_handle: u32,
    /// The client receives on this link (twice sends).
    client_receives: bool,
    node: Node,
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
    drain: bool,
    unsettled: u32,
    pump: Option<watch::Sender<PumpCtl>>,
    generation: u64,
    session: Option<Arc<S>>,
    replies: VecDeque<Vec<u8>>,
    // Twice as receiver.
    rx_delivery_count: u32,
    rx_credit: u32,
    partial: Option<Partial>,
    sends: Option<mpsc::UnboundedSender<PendingSend>>,
}

struct Session<S> {
    local_channel: u16,
    next_outgoing_id: u32,
    next_delivery_id: u32,
    next_incoming_id: u32,
    incoming_window: u32,
    frames_since_flow: u32,
    links: HashMap<u32, Link<S>>,
    unsettled: HashMap<u32, Unsettled<S>>,
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
    fn free_handle(&self) -> u32 {
        (0..).find(|h| !self.links.values().any(|l| l.local_handle == *h)).unwrap_or(0)
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

    /// Sends one delivery, split into frames that fit the peer's limit.
    fn transfer<S>(
        &mut self,
        s: &mut Session<S>,
        handle: u32,
        tag: Bytes,
        settled: bool,
        payload: &[u8],
    ) -> u32 {
        let delivery_id = s.next_delivery_id;
        s.next_delivery_id = s.next_delivery_id.wrapping_add(1);
        tracing::trace!(
            channel = s.local_channel,
            handle,
            delivery_id,
            settled,
            bytes = payload.len(),
            "send transfer"
        );
        let max = usize::try_from(self.peer_max_frame).unwrap_or(usize::MAX);
        // Room for the frame header and the largest transfer performative twice writes.
        let room = max.saturating_sub(8 + 64 + tag.len()).max(64);
        let mut chunks = payload.chunks(room).peekable();
        let mut first = true;
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            let more = chunks.peek().is_some();
            let t = Transfer {
                handle,
                delivery_id: first.then_some(delivery_id),
                delivery_tag: first.then(|| tag.clone()),
                message_format: first.then_some(0),
                settled: Some(settled),
                more,
                ..Transfer::default()
            };
            frame::write_frame(
                &mut self.buf,
                frame::TYPE_AMQP,
                s.local_channel,
                &Performative::Transfer(t),
                chunk,
            );
            s.next_outgoing_id = s.next_outgoing_id.wrapping_add(1);
            first = false;
            if !more {
                break;
            }
        }
        delivery_id
    }
}

pub(crate) struct Conn<B: Backend> {
    shared: Arc<Shared<B>>,
    out: Out,
    sessions: HashMap<u16, Session<B::Session>>,
    /// Link id to (remote channel, remote handle).
    links: HashMap<u64, (u16, u32)>,
    next_link_id: u64,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    /// Paths the connection may use (from tokens); `Some("")` is all of them.
    grants: Vec<String>,
    channel_max: u16,
    heard: bool,
}

/// Serves one connection until it closes, the peer goes silent, or `shutdown` fires.
///
/// # Cancel safety
///
/// Dropping the future drops the connection without a close frame; sessions held by its links
/// are released by their pump tasks ending.
pub(crate) async fn serve<B, IO>(
    io: IO,
    shared: Arc<Shared<B>>,
    mut shutdown: watch::Receiver<bool>,
) where
    B: Backend,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (rd, mut wr) = tokio::io::split(io);
    let mut reader = FrameReader::new(rd, shared.options.max_frame_size);
    let sasl_ok =
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut reader, &mut wr, &shared))
            .await
        {
            Ok(Ok(all)) => all,
            Ok(Err(())) | Err(_) => return,
        };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut conn = Conn {
        shared: shared.clone(),
        out: Out { buf: Vec::new(), peer_max_frame: frame::MIN_MAX_FRAME_SIZE },
        sessions: HashMap::new(),
        links: HashMap::new(),
        next_link_id: 0,
        events: tx,
        grants: if sasl_ok { vec![String::new()] } else { Vec::new() },
        channel_max: u16::MAX,
        heard: true,
    };
    // The first frame must be `open`.
    let first = match reader.read_frame().await {
        Ok(f) => f,
        Err(_) => return,
    };
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
    let mut ticker = tokio::time::interval(heartbeat);
    ticker.tick().await;
    let mut silent_ticks = 0u32;
    let end = loop {
        let step = tokio::select! {
            f = reader.read_frame() => match f {
                Ok(f) => {
                    conn.heard = true;
                    conn.on_frame(f).await
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
            Some(ev) = rx.recv() => conn.on_event(ev).await,
            _ = ticker.tick() => {
                if conn.heard {
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
            _ = shutdown.changed() => Err(End::Close(Some(AmqpError::new("amqp:connection:forced", "the server is shutting down")))),
        };
        if !conn.out.buf.is_empty() {
            if wr.write_all(&conn.out.buf).await.is_err() {
                break End::Drop;
            }
            conn.out.buf.clear();
        }
        if let Err(end) = step {
            break end;
        }
    };
    conn.finish(&mut wr, end).await;
}

/// Protocol headers and SASL. Returns whether SASL PLAIN authenticated with a configured key.
async fn handshake<B: Backend, R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut FrameReader<R>,
    wr: &mut W,
    shared: &Shared<B>,
) -> Result<bool, ()> {
    let mut header = reader.read_protocol_header().await.map_err(|_| ())?;
    let mut plain_ok = false;
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
                    (Some(u), Some(p)) if shared.options.keys.get(u) == Some(p) => {
                        plain_ok = true;
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
                channel_max: u16::MAX,
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

    async fn on_frame(&mut self, f: Frame) -> Result<(), End> {
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
            Performative::Begin(b) => {
                self.on_begin(ch, &b);
                Ok(())
            }
            Performative::End(_) => {
                if let Some(local) = self.sessions.get(&ch).map(|s| s.local_channel) {
                    self.drop_session(ch);
                    self.out.send(local, &Performative::End(None));
                }
                Ok(())
            }
            Performative::Attach(a) => self.on_attach(ch, a).await,
            Performative::Detach(d) => {
                self.on_detach(ch, &d);
                Ok(())
            }
            Performative::Flow(fl) => {
                self.on_flow(ch, &fl);
                Ok(())
            }
            Performative::Transfer(t) => {
                let payload = Bytes::copy_from_slice(payload);
                self.on_transfer(ch, t, payload).await;
                Ok(())
            }
            Performative::Disposition(d) => {
                self.on_disposition(ch, d).await;
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

    fn on_begin(&mut self, ch: u16, b: &Begin) {
        if ch > self.channel_max || self.sessions.contains_key(&ch) {
            return;
        }
        let local = (0..=u16::MAX)
            .find(|c| !self.sessions.values().any(|s| s.local_channel == *c))
            .unwrap_or(0);
        self.sessions.insert(
            ch,
            Session {
                local_channel: local,
                next_outgoing_id: 0,
                next_delivery_id: 0,
                next_incoming_id: b.next_outgoing_id,
                incoming_window: SESSION_WINDOW,
                frames_since_flow: 0,
                links: HashMap::new(),
                unsettled: HashMap::new(),
            },
        );
        self.out.send(
            local,
            &Performative::Begin(Begin {
                remote_channel: Some(ch),
                next_outgoing_id: 0,
                incoming_window: SESSION_WINDOW,
                outgoing_window: SESSION_WINDOW,
                handle_max: u32::try_from(self.shared.options.max_links_per_session)
                    .unwrap_or(u32::MAX)
                    .saturating_sub(1),
            }),
        );
    }

    /// Forgets a session and everything its links hold (without sending anything).
    fn drop_session(&mut self, ch: u16) {
        let Some(mut s) = self.sessions.remove(&ch) else { return };
        for (_, link) in s.links.drain() {
            self.links.remove(&link.id);
            release_link(link);
        }
    }

    fn authorized(&self, path: &str) -> bool {
        self.grants.iter().any(|g| g.is_empty() || path == g || path.starts_with(&format!("{g}/")))
    }

    async fn on_attach(&mut self, ch: u16, a: Attach) -> Result<(), End> {
        let max_links = self.shared.options.max_links_per_session;
        let Some(s) = self.sessions.get_mut(&ch) else { return Ok(()) };
        if let Some(old) = s.links.remove(&a.handle) {
            // A reused handle: the client forgot the old link; so does twice.
            self.links.remove(&old.id);
            release_link(old);
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
        let local_handle = s.free_handle();
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
            target_address,
            attach: a.clone(),
            attached: false,
            detached: false,
            mode,
            delivery_count: 0,
            credit: 0,
            drain: false,
            unsettled: 0,
            pump: None,
            generation: 0,
            session: None,
            replies: VecDeque::new(),
            rx_delivery_count: a.initial_delivery_count.unwrap_or(0),
            rx_credit: 0,
            partial: None,
            sends: None,
        };
        let too_many = s.links.len() >= max_links;
        s.links.insert(a.handle, link);
        self.links.insert(id, (ch, a.handle));
        if too_many {
            self.refuse(
                ch,
                a.handle,
                AmqpError::new(
                    cond::RESOURCE_LIMIT,
                    format!("a session may attach at most {max_links} links"),
                ),
            );
            return Ok(());
        }
        // Which entity, and may this connection use it?
        let backend = &self.shared.backend;
        let entity = match &node {
            Node::Cbs => None,
            Node::Management(e) | Node::Entity(e) => Some(e.clone()),
        };
        if let Some(e) = &entity {
            // A token for the entity covers its management node; so does one for the node.
            if !self.authorized(&path) {
                self.refuse(
                    ch,
                    a.handle,
                    AmqpError::new(
                        cond::UNAUTHORIZED,
                        format!("unauthorized access to '{e}': put a valid token to $cbs first"),
                    ),
                );
                return Ok(());
            }
            let kind = backend.entity(e).await;
            let Some(kind) = kind else {
                self.refuse(ch, a.handle, not_found(e));
                return Ok(());
            };
            if let Node::Entity(_) = node {
                let filter = terminus.filter.as_ref();
                let session_filter = filter.and_then(|f| f.as_map()).and_then(|m| {
                    m.iter()
                        .find(|(k, _)| k.as_str() == Some(cond::SESSION_FILTER))
                        .map(|(_, v)| v.undescribed().clone())
                });
                if client_receives {
                    if kind == EntityKind::Topic {
                        self.refuse(ch, a.handle, AmqpError::new(cond::NOT_ALLOWED, format!("cannot receive from topic '{e}'; receive from one of its subscriptions")));
                        return Ok(());
                    }
                    if let Some(want) = session_filter {
                        let want = want.as_str().map(SessionId::new);
                        let wait = a
                            .properties
                            .as_ref()
                            .and_then(|p| p.get("com.microsoft:timeout"))
                            .and_then(Value::as_i64)
                            .and_then(|ms| u64::try_from(ms).ok())
                            .map_or(DEFAULT_SESSION_WAIT, Duration::from_millis);
                        let wait = if want.is_some() { Duration::ZERO } else { wait };
                        let backend = backend.clone();
                        let events = self.events.clone();
                        let e = e.clone();
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
                                result: Ok(Some(s)),
                                ..
                            })) = events.send(Event::SessionAccepted { link: id, result })
                            {
                                s.close().await;
                            }
                        });
                        return Ok(());
                    }
                    if kind.requires_session() {
                        self.refuse(ch, a.handle, AmqpError::new(cond::NOT_ALLOWED, "It is not possible for an entity that requires sessions to create a non-sessionful message receiver."));
                        return Ok(());
                    }
                } else if matches!(kind, EntityKind::Subscription { .. } | EntityKind::DeadLetter) {
                    self.refuse(
                        ch,
                        a.handle,
                        AmqpError::new(cond::NOT_ALLOWED, format!("cannot send to '{e}'")),
                    );
                    return Ok(());
                }
            }
        }
        self.accept_attach(ch, a.handle, None);
        Ok(())
    }

    /// Sends twice's attach for a link, then the credit a client sender needs or the pump a
    /// client receiver needs.
    fn accept_attach(&mut self, ch: u16, handle: u32, session: Option<B::Session>) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
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
            properties = Some(Value::Map(vec![(
                Value::symbol("com.microsoft:locked-until-utc"),
                Value::Long(ticks),
            )]));
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
            max_message_size: Some(self.shared.options.max_message_size),
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
        } else if let Node::Entity(e) = &l.node {
            let source = match &l.session {
                Some(sess) => Source::Session(sess.clone()),
                None => Source::Entity(e.clone()),
            };
            let (tx, rx) = watch::channel(PumpCtl::default());
            l.pump = Some(tx);
            tokio::spawn(pump(
                self.shared.backend.clone(),
                source,
                l.mode,
                rx,
                self.events.clone(),
                l.id,
            ));
        }
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
        let Some(l) = s.links.remove(&d.handle) else { return };
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
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(handle) = f.handle else {
            if f.echo {
                let fl = sflow!(s);
                self.out.send(s.local_channel, &Performative::Flow(fl));
            }
            return;
        };
        let Some(l) = s.links.get_mut(&handle) else { return };
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
            return;
        }
        // Credit per the specification: the receiver's delivery-count plus its credit, less what
        // twice has sent.
        let theirs = f.delivery_count.unwrap_or(0);
        let total = theirs.wrapping_add(f.link_credit.unwrap_or(0));
        l.credit = total.wrapping_sub(l.delivery_count).min(1_000_000);
        if total.wrapping_sub(l.delivery_count) > u32::MAX / 2 {
            l.credit = 0;
        }
        l.drain = f.drain;
        // Replies queued on a management or CBS link go out first.
        loop {
            let Some(l) = s.links.get_mut(&handle) else { return };
            if l.credit == 0 {
                break;
            }
            let Some(payload) = l.replies.pop_front() else { break };
            send_on_link(&mut self.out, s, handle, payload);
        }
        let l = match s.links.get_mut(&handle) {
            Some(l) => l,
            None => return,
        };
        if l.pump.is_some() {
            if l.drain && l.credit == 0 {
                // Nothing left to drain; the specification still asks for the flow state.
                l.drain = false;
                let fl = Flow {
                    handle: Some(l.local_handle),
                    delivery_count: Some(l.delivery_count),
                    link_credit: Some(0),
                    drain: true,
                    ..sflow!(s)
                };
                self.out.send(s.local_channel, &Performative::Flow(fl));
                update_pump(l, max_unsettled);
            } else {
                update_pump(l, max_unsettled);
            }
        } else if l.drain || f.echo {
            if l.drain {
                l.delivery_count = l.delivery_count.wrapping_add(l.credit);
                l.credit = 0;
                l.drain = false;
            }
            let fl = Flow {
                handle: Some(l.local_handle),
                delivery_count: Some(l.delivery_count),
                link_credit: Some(l.credit),
                drain: f.drain,
                ..sflow!(s)
            };
            self.out.send(s.local_channel, &Performative::Flow(fl));
        }
    }

    async fn on_transfer(&mut self, ch: u16, t: Transfer, payload: Bytes) {
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
        let Some(l) = s.links.get_mut(&t.handle) else { return };
        if l.client_receives {
            return;
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
            partial.buf.extend_from_slice(&payload);
        }
        if t.more && !t.aborted {
            return;
        }
        let Some(done) = l.partial.take() else { return };
        if t.aborted {
            return;
        }
        l.rx_delivery_count = l.rx_delivery_count.wrapping_add(1);
        l.rx_credit = l.rx_credit.saturating_sub(1);
        let node = l.node.clone();
        let link_id = l.id;
        let link_name = l.name.clone();
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
                            messages,
                        };
                        self.queue_send(ch, t.handle, e, pending);
                        return self.top_up(ch, t.handle);
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
                    let reply = mgmt::handle(self, e, &link_name, &done.buf).await;
                    // The request is settled before its reply goes out, as a request/response
                    // peer expects.
                    self.settle_request(ch, &done);
                    self.reply(link_id, reply);
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

    /// Gives a client sender more credit when half of it is used.
    fn top_up(&mut self, ch: u16, handle: u32) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        if let Some(l) = s.links.get_mut(&handle) {
            if l.rx_credit < SENDER_CREDIT / 2 {
                l.rx_credit = SENDER_CREDIT;
                let fl = Flow {
                    handle: Some(l.local_handle),
                    delivery_count: Some(l.rx_delivery_count),
                    link_credit: Some(SENDER_CREDIT),
                    ..sflow!(s)
                };
                self.out.send(s.local_channel, &Performative::Flow(fl));
            }
        }
    }

    /// Queues a send on the link's sender task, starting it on first use.
    fn queue_send(&mut self, ch: u16, handle: u32, entity: &str, pending: PendingSend) {
        let Some(l) = self.sessions.get_mut(&ch).and_then(|s| s.links.get_mut(&handle)) else {
            return;
        };
        let tx = l.sends.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let max = usize::try_from(self.shared.options.max_message_size).unwrap_or(usize::MAX);
            tokio::spawn(sender_task(
                self.shared.backend.clone(),
                entity.to_owned(),
                max,
                rx,
                self.events.clone(),
                ch,
            ));
            tx
        });
        let _ = tx.send(pending);
    }

    /// Settles sends the sender task has stored (or failed to).
    fn on_sent(&mut self, ch: u16, entity: &str, results: Vec<(u32, bool, usize, Outcome)>) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        for (delivery_id, settled, n, outcome) in results {
            if outcome == Outcome::Accepted {
                self.shared.metrics.add(entity, Counter::Send, u64::try_from(n).unwrap_or(0));
            }
            if !settled {
                let d = Disposition {
                    role: ROLE_RECEIVER,
                    first: delivery_id,
                    last: None,
                    settled: true,
                    state: Some(outcome.to_value()),
                };
                self.out.send(s.local_channel, &Performative::Disposition(d));
            }
        }
    }

    fn on_cbs(&mut self, payload: &[u8]) -> Option<mgmt::Reply> {
        let now = self.shared.clock.now().as_millis() / 1000;
        let req = mgmt::Request::parse(payload).ok()?;
        let (status, description) = if req.operation() == Some("put-token") {
            let token = req.body.as_str().unwrap_or("");
            match self.shared.options.keys.validate(token, now) {
                Ok(grant) => {
                    self.grants.push(address::normalize(&grant.resource));
                    (202, "Accepted".to_owned())
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
    pub(crate) fn reply(&mut self, request_link: u64, reply: mgmt::Reply) {
        let Some(&(ch, handle)) = self.links.get(&request_link) else { return };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(req) = s.links.get(&handle) else { return };
        let node = req.node.clone();
        let to = reply.to.clone();
        let target = s
            .links
            .iter()
            .filter(|(_, l)| l.client_receives && l.node == node && !l.detached)
            .map(|(h, l)| (*h, l))
            .find(|(_, l)| to.is_some() && (l.target_address == to || Some(&l.name) == to.as_ref()))
            .or_else(|| {
                s.links
                    .iter()
                    .filter(|(_, l)| l.client_receives && l.node == node && !l.detached)
                    .map(|(h, l)| (*h, l))
                    .next()
            })
            .map(|(h, _)| h);
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
            send_on_link(&mut self.out, s, target, payload);
        }
    }

    async fn on_disposition(&mut self, ch: u16, d: Disposition) {
        if d.role != ROLE_RECEIVER {
            return;
        }
        let max_unsettled = self.shared.options.max_unsettled_per_link;
        let outcome = match d.state.as_ref().map(Outcome::from_value) {
            Some(Ok(o)) => o,
            Some(Err(_)) | None => Outcome::Other,
        };
        let last = d.last.unwrap_or(d.first);
        if last.wrapping_sub(d.first) > 10_000 {
            return;
        }
        let mut id = d.first;
        loop {
            let taken = self.sessions.get_mut(&ch).and_then(|s| s.unsettled.remove(&id));
            if let Some(u) = taken {
                let echo = self.settle(&u, &outcome).await;
                if let Some(s) = self.sessions.get_mut(&ch) {
                    if let Some(&(_, handle)) = self.links.get(&u.link) {
                        if let Some(l) = s.links.get_mut(&handle) {
                            l.unsettled = l.unsettled.saturating_sub(1);
                            update_pump(l, max_unsettled);
                        }
                    }
                    if !d.settled {
                        let reply = Disposition {
                            role: ROLE_SENDER,
                            first: id,
                            last: None,
                            settled: true,
                            state: Some(echo.to_value()),
                        };
                        self.out.send(s.local_channel, &Performative::Disposition(reply));
                    }
                }
            }
            if id == last {
                break;
            }
            id = id.wrapping_add(1);
        }
    }

    /// Applies a client's outcome; returns the outcome to echo (research §8.3).
    async fn settle(&self, u: &Unsettled<B::Session>, outcome: &Outcome) -> Outcome {
        let (how, echo) = match outcome {
            Outcome::Accepted => (Settlement::Complete, Outcome::Accepted),
            Outcome::Released => (Settlement::Release, Outcome::Released),
            Outcome::Modified { undeliverable_here: true, message_annotations, .. } => (
                Settlement::Defer(mapping::properties_of(message_annotations.as_ref(), &[])),
                outcome.clone(),
            ),
            Outcome::Modified { message_annotations, .. } => (
                Settlement::Abandon(mapping::properties_of(message_annotations.as_ref(), &[])),
                outcome.clone(),
            ),
            Outcome::Rejected(err) => (dead_letter_of(err.as_ref()), Outcome::Rejected(None)),
            Outcome::Other => return Outcome::Accepted,
        };
        let counter = match &how {
            Settlement::Complete => Some(Counter::Complete),
            Settlement::Abandon(_) => Some(Counter::Abandon),
            Settlement::DeadLetter { .. } => Some(Counter::DeadLetter),
            _ => None,
        };
        let result = match &u.session {
            Some(s) => s.settle(u.lock, how).await,
            None => self.shared.backend.settle(&u.entity, u.lock, how).await,
        };
        match result {
            Ok(()) => {
                if let Some(c) = counter {
                    self.shared.metrics.add(&u.entity, c, 1);
                }
                echo
            }
            Err(e) => {
                self.shared.metrics.add(&u.entity, Counter::LockLost, 1);
                let cond = if u.session.is_some() && e == BackendError::SessionLockLost {
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
        }
    }

    async fn on_event(&mut self, ev: Event<B::Session>) -> Result<(), End> {
        match ev {
            Event::SessionAccepted { link, result } => {
                let Some(&(ch, handle)) = self.links.get(&link) else {
                    if let Ok(Some(s)) = result {
                        s.close().await;
                    }
                    return Ok(());
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
            Event::Sent { channel, entity, results } => self.on_sent(channel, &entity, results),
            Event::Batch { link, generation, drain, result } => {
                self.on_batch(link, generation, drain, result)
            }
        }
        Ok(())
    }

    fn on_batch(
        &mut self,
        link: u64,
        generation: u64,
        drain: bool,
        result: Result<Vec<ReceivedMessage>, BackendError>,
    ) {
        let max_unsettled = self.shared.options.max_unsettled_per_link;
        let messages = match result {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "receive failed");
                if let Some(&(ch, handle)) = self.links.get(&link) {
                    let err = match e {
                        BackendError::SessionLockLost => {
                            AmqpError::new(cond::SESSION_LOCK_LOST, "The session lock has expired.")
                        }
                        other => backend_error(&other),
                    };
                    self.detach_with(ch, handle, err);
                }
                return;
            }
        };
        let Some(&(ch, handle)) = self.links.get(&link) else {
            // The link is gone; its messages come back when their locks expire.
            return;
        };
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        let entity = match &l.node {
            Node::Entity(e) => e.clone(),
            _ => String::new(),
        };
        let mut extra = Vec::new();
        let mut sent = 0u64;
        for m in messages {
            let Some(l) = s.links.get_mut(&handle) else { break };
            if l.credit == 0 || l.detached {
                extra.push(m);
                continue;
            }
            l.credit -= 1;
            l.delivery_count = l.delivery_count.wrapping_add(1);
            let lh = l.local_handle;
            let session = l.session.clone();
            let payload;
            let tag;
            let settled = l.mode == ReceiveMode::ReceiveAndDelete || m.lock_token.is_none();
            if settled {
                payload = mapping::encode_received(&m, Presentation::Unlocked);
                tag = Bytes::copy_from_slice(&Uuid::new_v4().to_bytes_le());
            } else {
                payload = mapping::encode_received(&m, Presentation::Locked);
                tag = Bytes::copy_from_slice(
                    &m.lock_token.map(|t| t.as_uuid().to_bytes_le()).unwrap_or_default(),
                );
                l.unsettled += 1;
            }
            let id = self.out.transfer(s, lh, tag, settled, &payload);
            sent += 1;
            if !settled {
                if let Some(lock) = m.lock_token {
                    s.unsettled
                        .insert(id, Unsettled { link, entity: entity.clone(), lock, session });
                }
            }
        }
        if sent > 0 {
            self.shared.metrics.add(&entity, Counter::Receive, sent);
        }
        let Some(l) = s.links.get_mut(&handle) else { return };
        if l.generation == generation && drain && l.drain {
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
            self.out.send(s.local_channel, &Performative::Flow(fl));
        }
        update_pump(l, max_unsettled);
        if !extra.is_empty() {
            let session = l.session.clone();
            release_all(&self.shared.backend, &entity, session, extra);
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
        if let Some(p) = l.pump.take() {
            drop(p);
        }
        let lh = l.local_handle;
        self.out.send(
            s.local_channel,
            &Performative::Detach(Detach { handle: lh, closed: true, error: Some(error) }),
        );
    }

    // ---- accessors for the management handlers ----

    pub(crate) fn backend(&self) -> &B {
        &self.shared.backend
    }

    pub(crate) fn metrics(&self) -> &crate::metrics::Metrics {
        &self.shared.metrics
    }

    /// The session handle a receiver link of this connection holds for `entity`/`sid`.
    pub(crate) fn held_session(&self, entity: &str, sid: &str) -> Option<Arc<B::Session>> {
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
    pub(crate) fn forget_lock(&mut self, lock: LockToken) {
        for s in self.sessions.values_mut() {
            s.unsettled.retain(|_, u| u.lock != lock);
        }
    }
}

/// Sends a settled reply on a management or CBS receiver link.
fn send_on_link<S>(out: &mut Out, s: &mut Session<S>, handle: u32, payload: Vec<u8>) {
    let Some(l) = s.links.get_mut(&handle) else { return };
    l.credit = l.credit.saturating_sub(1);
    l.delivery_count = l.delivery_count.wrapping_add(1);
    let lh = l.local_handle;
    let tag = Bytes::copy_from_slice(&u64::from(l.delivery_count).to_be_bytes());
    out.transfer(s, lh, tag, true, &payload);
}

/// Tells the pump of a link what it may take now.
fn update_pump<S>(l: &mut Link<S>, max_unsettled: u32) {
    let Some(pump) = &l.pump else { return };
    let room = max_unsettled.saturating_sub(l.unsettled);
    let credit =
        if l.mode == ReceiveMode::ReceiveAndDelete { l.credit } else { l.credit.min(room) };
    l.generation += 1;
    let _ = pump.send(PumpCtl { credit, drain: l.drain, generation: l.generation });
}

/// Ends what a link holds: its pump stops, its session lock is released.
fn release_link<S: BackendSession>(mut l: Link<S>) {
    l.pump.take();
    if let Some(s) = l.session.take() {
        tokio::spawn(async move { s.close().await });
    }
}

/// Unlocks messages a link took but could not deliver.
fn release_all<B: Backend>(
    backend: &B,
    entity: &str,
    session: Option<Arc<B::Session>>,
    messages: Vec<ReceivedMessage>,
) {
    let locks: Vec<LockToken> = messages.iter().filter_map(|m| m.lock_token).collect();
    if locks.is_empty() {
        return;
    }
    let backend = backend.clone();
    let entity = entity.to_owned();
    tokio::spawn(async move {
        for lock in locks {
            let _ = match &session {
                Some(s) => s.settle(lock, Settlement::Release).await,
                None => backend.settle(&entity, lock, Settlement::Release).await,
            };
        }
    });
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

/// A receiver link's pump: waits for messages within the credit and reports them.
async fn pump<B: Backend>(
    backend: B,
    source: Source<B::Session>,
    mode: ReceiveMode,
    mut ctl: watch::Receiver<PumpCtl>,
    events: mpsc::UnboundedSender<Event<B::Session>>,
    link: u64,
) {
    let mut reported: Option<u64> = None;
    loop {
        let c = *ctl.borrow_and_update();
        if c.credit == 0 || reported == Some(c.generation) {
            if ctl.changed().await.is_err() {
                return;
            }
            continue;
        }
        let max = usize::try_from(c.credit).unwrap_or(usize::MAX);
        let wait = if c.drain { Duration::ZERO } else { PUMP_WAIT };
        let receive = async {
            match &source {
                Source::Entity(e) => backend.receive(e, mode, max, wait).await,
                Source::Session(s) => s.receive(mode, max, wait).await,
            }
        };
        let result = if c.drain {
            receive.await
        } else {
            tokio::select! {
                r = receive => r,
                changed = ctl.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
            }
        };
        if matches!(&result, Ok(v) if v.is_empty()) && !c.drain {
            continue;
        }
        let failed = result.is_err();
        reported = Some(c.generation);
        if events
            .send(Event::Batch { link, generation: c.generation, drain: c.drain, result })
            .is_err()
            || failed
        {
            return;
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
    channel: u16,
) {
    fn size(p: &PendingSend) -> usize {
        p.messages.iter().map(|m| m.body.len() + 256).sum()
    }
    while let Some(first) = rx.recv().await {
        let mut group = vec![first];
        while group.len() < 256 {
            match rx.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
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
        if events.send(Event::Sent { channel, entity: entity.clone(), results }).is_err() {
            return;
        }
    }
}
