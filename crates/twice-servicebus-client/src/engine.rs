//! One AMQP connection with one session: a task that owns the session state and its links,
//! driven by commands from the client and by frames from the peer.
//!
//! The connection is three tasks: a reader that turns bytes into frames, a writer that owns
//! the write half (so the engine never blocks on a slow socket), and the engine itself. When
//! the engine stops (the peer closed, the socket broke, the peer fell silent) every pending
//! operation's reply is dropped, which callers see as [`Error::ConnectionLost`], and every
//! receiver link's channel closes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use twice_amqp::frame::{self, Frame, FrameReader};
use twice_amqp::performative::{
    AmqpError, Attach, Begin, Detach, Disposition, Flow, Open, Outcome, Performative,
    ROLE_RECEIVER, ROLE_SENDER, SaslInit, Transfer,
};
use twice_amqp::reassembly::{Partial, Step, reassemble};

use crate::error::Error;

/// A byte stream the connection runs over: TCP, or TLS over TCP.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// The largest frame the client accepts.
const MAX_FRAME: u32 = 1024 * 1024;
/// The session window the client offers, in transfer frames.
const SESSION_WINDOW: u32 = 5000;
/// The idle timeout the client announces: the peer must send something this often.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// What the peer sent for a receiver link.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// A whole message.
    Delivery(Incoming),
    /// The peer detached the link, with its error.
    Detached(Option<AmqpError>),
}

/// One delivery, reassembled from its transfer frames.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub(crate) delivery_id: u32,
    pub(crate) tag: Bytes,
    pub(crate) settled: bool,
    pub(crate) payload: Bytes,
}

/// What to attach.
#[derive(Debug, Clone)]
pub(crate) struct LinkSpec {
    pub(crate) name: String,
    /// The client's role: [`ROLE_SENDER`] or [`ROLE_RECEIVER`].
    pub(crate) role: bool,
    pub(crate) snd_settle_mode: Option<u8>,
    pub(crate) rcv_settle_mode: Option<u8>,
    pub(crate) source: Option<twice_amqp::codec::Value>,
    pub(crate) target: Option<twice_amqp::codec::Value>,
    pub(crate) properties: Option<twice_amqp::codec::Value>,
    /// For receivers: credit granted on attach.
    pub(crate) initial_credit: u32,
    /// For receivers: keep the credit topped up to this (request/response reply links).
    pub(crate) auto_credit: bool,
}

/// An attached link.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) handle: u32,
    pub(crate) id: u64,
    /// The peer's attach (its source carries the session filter, its properties the session
    /// lock).
    pub(crate) remote: Attach,
    /// For receivers: deliveries and the detach.
    pub(crate) events: Option<mpsc::UnboundedReceiver<LinkEvent>>,
    /// True while the link is attached: cleared the moment either side detaches it or the
    /// connection stops, so that what needs the link (a delivery's lock) can tell at once.
    pub(crate) attached: Arc<AtomicBool>,
}

type Reply<T> = oneshot::Sender<Result<T, Error>>;

enum Cmd {
    Attach(LinkSpec, Reply<Link>),
    Flow {
        handle: u32,
        id: u64,
        add: u32,
    },
    StopCredit {
        handle: u32,
        id: u64,
    },
    Send {
        handle: u32,
        id: u64,
        payload: Vec<u8>,
        format: u32,
        settled: bool,
        reply: Reply<Outcome>,
    },
    Dispose {
        handle: u32,
        id: u64,
        delivery_id: u32,
        outcome: Outcome,
        reply: Reply<Outcome>,
    },
    Detach {
        handle: u32,
        id: u64,
    },
    Close,
}

/// A handle to a running connection; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Engine {
    cmds: mpsc::UnboundedSender<Cmd>,
    id: u64,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Attach(..) => "Attach",
            Cmd::Flow { .. } => "Flow",
            Cmd::StopCredit { .. } => "StopCredit",
            Cmd::Send { .. } => "Send",
            Cmd::Dispose { .. } => "Dispose",
            Cmd::Detach { .. } => "Detach",
            Cmd::Close => "Close",
        })
    }
}

impl Engine {
    /// Runs the handshake (SASL ANONYMOUS, open, begin) on `io` and starts the connection.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the stream before the connection starts.
    pub(crate) async fn start(io: impl Stream, hostname: &str) -> Result<Self, Error> {
        let (rd, mut wr) = tokio::io::split(io);
        let mut reader = FrameReader::new(rd, MAX_FRAME);
        let hs = |e: &dyn std::fmt::Display| Error::Handshake(e.to_string());
        let io_err = |e: std::io::Error| Error::Handshake(e.to_string());
        wr.write_all(&frame::SASL_HEADER).await.map_err(io_err)?;
        if reader.read_protocol_header().await.map_err(|e| hs(&e))? != frame::SASL_HEADER {
            return Err(Error::Handshake("the peer does not offer SASL".into()));
        }
        let f = reader.read_frame().await.map_err(|e| hs(&e))?;
        match Performative::decode(&f.body) {
            Ok((Performative::SaslMechanisms(m), _)) if m.iter().any(|m| m == "ANONYMOUS") => {}
            Ok((Performative::SaslMechanisms(m), _)) => {
                return Err(Error::Handshake(format!("no ANONYMOUS mechanism among {m:?}")));
            }
            _ => return Err(Error::Handshake("expected sasl-mechanisms".into())),
        }
        let mut out = Vec::new();
        let init = SaslInit {
            mechanism: "ANONYMOUS".into(),
            initial_response: None,
            hostname: Some(hostname.to_owned()),
        };
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
        wr.write_all(&out).await.map_err(io_err)?;
        let f = reader.read_frame().await.map_err(|e| hs(&e))?;
        match Performative::decode(&f.body) {
            Ok((Performative::SaslOutcome(0), _)) => {}
            Ok((Performative::SaslOutcome(code), _)) => {
                return Err(Error::Handshake(format!("sasl outcome {code}")));
            }
            _ => return Err(Error::Handshake("expected sasl-outcome".into())),
        }
        let id = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
        let mut out = frame::AMQP_HEADER.to_vec();
        let open = Open {
            container_id: format!("twice-{}", uuid::Uuid::new_v4().simple()),
            hostname: Some(hostname.to_owned()),
            max_frame_size: MAX_FRAME,
            channel_max: 0,
            idle_time_out: u32::try_from(IDLE_TIMEOUT.as_millis()).ok(),
            properties: None,
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
        let begin = Begin {
            remote_channel: None,
            next_outgoing_id: 0,
            incoming_window: SESSION_WINDOW,
            outgoing_window: SESSION_WINDOW,
            handle_max: 255,
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Begin(begin), &[]);
        wr.write_all(&out).await.map_err(io_err)?;
        if reader.read_protocol_header().await.map_err(|e| hs(&e))? != frame::AMQP_HEADER {
            return Err(Error::Handshake("the peer does not speak AMQP 1.0".into()));
        }
        let (mut peer_max_frame, mut peer_idle, mut window) = (frame::MIN_MAX_FRAME_SIZE, None, 0);
        let mut begun = false;
        while !begun {
            let f = reader.read_frame().await.map_err(|e| hs(&e))?;
            if f.body.is_empty() {
                continue;
            }
            match Performative::decode(&f.body).map_err(|e| hs(&e))?.0 {
                Performative::Open(o) => {
                    peer_max_frame = o.max_frame_size.max(frame::MIN_MAX_FRAME_SIZE);
                    peer_idle = o.idle_time_out.filter(|ms| *ms > 0);
                }
                Performative::Begin(b) => {
                    window = b.incoming_window;
                    begun = true;
                }
                Performative::Close(e) => {
                    return Err(e.as_ref().map_or(Error::ConnectionLost, Error::from_amqp));
                }
                other => {
                    return Err(Error::Handshake(format!("unexpected {}", other.name())));
                }
            }
        }
        reader.set_max_frame_size(MAX_FRAME);
        let (frames_tx, frames_rx) = mpsc::channel(1024);
        let reader_task = tokio::spawn(async move {
            loop {
                let r = reader.read_frame().await;
                let stop = r.is_err();
                if frames_tx.send(r.map_err(|e| e.to_string())).await.is_err() || stop {
                    break;
                }
            }
        });
        let (bytes_tx, mut bytes_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            while let Some(b) = bytes_rx.recv().await {
                if wr.write_all(&b).await.is_err() || wr.flush().await.is_err() {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        let (cmds, cmd_rx) = mpsc::unbounded_channel();
        let beat = peer_idle
            .map_or(Duration::from_secs(10), |ms| Duration::from_millis(u64::from(ms) / 2))
            .clamp(Duration::from_millis(100), Duration::from_secs(10));
        let actor = Actor {
            writer: bytes_tx,
            buf: Vec::new(),
            peer_max_frame,
            next_outgoing_id: 0,
            next_delivery_id: 0,
            remote_incoming_window: window,
            next_incoming_id: 0,
            incoming_seen: false,
            frames_since_flow: 0,
            links: HashMap::new(),
            by_remote: HashMap::new(),
            next_link_id: 1,
            sends: HashMap::new(),
            disposes: HashMap::new(),
            sessions_lost: VecDeque::new(),
        };
        tokio::spawn(async move {
            actor.run(cmd_rx, frames_rx, beat).await;
            reader_task.abort();
        });
        Ok(Self { cmds, id })
    }

    /// A number that tells connections apart (links of an older connection are dead).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether the connection has stopped.
    pub(crate) fn is_closed(&self) -> bool {
        self.cmds.is_closed()
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, Error> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(make(tx)).map_err(|_| Error::ConnectionLost)?;
        rx.await.map_err(|_| Error::ConnectionLost)?
    }

    /// Attaches a link and waits for the peer's attach; a refusal comes back as the error
    /// of the peer's detach.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a link attached after the future is dropped stays attached (and
    /// unused) until the connection closes.
    pub(crate) async fn attach(&self, spec: LinkSpec) -> Result<Link, Error> {
        self.call(|r| Cmd::Attach(spec, r)).await
    }

    /// Grants a receiver link `add` more credit.
    pub(crate) fn flow(&self, handle: u32, id: u64, add: u32) {
        let _ = self.cmds.send(Cmd::Flow { handle, id, add });
    }

    /// Takes back a receiver link's credit: the peer sends nothing more on it (beyond what was
    /// already on its way).
    pub(crate) fn stop_credit(&self, handle: u32, id: u64) {
        let _ = self.cmds.send(Cmd::StopCredit { handle, id });
    }

    /// Sends a message on a sender link; waits for the peer's outcome unless `settled`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the message may be sent after the future is dropped.
    pub(crate) async fn send(
        &self,
        handle: u32,
        id: u64,
        payload: Vec<u8>,
        format: u32,
        settled: bool,
    ) -> Result<Outcome, Error> {
        self.call(|reply| Cmd::Send { handle, id, payload, format, settled, reply }).await
    }

    /// Settles a delivery of a receiver link and waits for the peer's echo.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the settlement may reach the peer after the future is dropped.
    pub(crate) async fn dispose(
        &self,
        handle: u32,
        id: u64,
        delivery_id: u32,
        outcome: Outcome,
    ) -> Result<Outcome, Error> {
        self.call(|reply| Cmd::Dispose { handle, id, delivery_id, outcome, reply }).await
    }

    /// Detaches a link (closing it).
    pub(crate) fn detach(&self, handle: u32, id: u64) {
        let _ = self.cmds.send(Cmd::Detach { handle, id });
    }

    /// Closes the connection.
    pub(crate) fn close(&self) {
        let _ = self.cmds.send(Cmd::Close);
    }
}

struct PendingSend {
    payload: Vec<u8>,
    format: u32,
    settled: bool,
    reply: Reply<Outcome>,
}

struct LinkState {
    id: u64,
    name: String,
    role: bool,
    remote_handle: Option<u32>,
    attach_reply: Option<Reply<Link>>,
    events_tx: Option<mpsc::UnboundedSender<LinkEvent>>,
    events_rx: Option<mpsc::UnboundedReceiver<LinkEvent>>,
    attached: Arc<AtomicBool>,
    delivery_count: u32,
    credit: u32,
    initial_credit: u32,
    auto_credit: bool,
    queued: VecDeque<PendingSend>,
    partial: Option<Partial>,
    detach_sent: bool,
}

struct Actor {
    writer: mpsc::UnboundedSender<Vec<u8>>,
    buf: Vec<u8>,
    peer_max_frame: u32,
    next_outgoing_id: u32,
    next_delivery_id: u32,
    remote_incoming_window: u32,
    next_incoming_id: u32,
    incoming_seen: bool,
    frames_since_flow: u32,
    links: HashMap<u32, LinkState>,
    by_remote: HashMap<u32, u32>,
    next_link_id: u64,
    /// Our unsettled sends, by delivery id: the link handle and who waits.
    sends: HashMap<u32, (u32, Reply<Outcome>)>,
    /// Our settlements waiting for the peer's echo, by the peer's delivery id.
    disposes: HashMap<u32, (u32, Reply<Outcome>)>,
    /// Links the peer detached with a session-lock-lost error, by link id, so a later
    /// settlement of one of their messages says that the session lock is gone.
    sessions_lost: VecDeque<u64>,
}

/// Why the engine stopped.
enum Stop {
    Closed,
    Lost(String),
}

impl Actor {
    async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        mut frames: mpsc::Receiver<Result<Frame, String>>,
        beat: Duration,
    ) {
        let mut tick = tokio::time::interval(beat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut silent = Duration::ZERO;
        let mut wrote = false;
        let stop = loop {
            let step = tokio::select! {
                cmd = cmds.recv() => match cmd {
                    Some(cmd) => self.on_cmd(cmd),
                    // Every handle is gone: nobody can use the connection any more.
                    None => { self.send(0, &Performative::Close(None)); Err(Stop::Closed) }
                },
                f = frames.recv() => match f {
                    Some(Ok(f)) => { silent = Duration::ZERO; self.on_frame(&f) }
                    Some(Err(e)) => Err(Stop::Lost(e)),
                    None => Err(Stop::Lost("reader stopped".into())),
                },
                _ = tick.tick() => {
                    silent += beat;
                    if silent > IDLE_TIMEOUT * 2 {
                        Err(Stop::Lost("the peer fell silent".into()))
                    } else {
                        if !wrote { self.buf.extend_from_slice(&frame::HEARTBEAT); }
                        wrote = false;
                        Ok(())
                    }
                }
            };
            if !self.buf.is_empty() {
                wrote = true;
                if self.writer.send(std::mem::take(&mut self.buf)).is_err() {
                    break Stop::Lost("writer stopped".into());
                }
            }
            if let Err(stop) = step {
                break stop;
            }
        };
        for l in self.links.values() {
            l.attached.store(false, Ordering::Release);
        }
        match stop {
            Stop::Closed => tracing::debug!("connection closed"),
            Stop::Lost(why) => tracing::debug!(%why, "connection lost"),
        }
    }

    fn send(&mut self, channel: u16, p: &Performative) {
        tracing::trace!(frame = ?p, "send");
        frame::write_frame(&mut self.buf, frame::TYPE_AMQP, channel, p, &[]);
    }

    fn session_flow(&self) -> Flow {
        Flow {
            next_incoming_id: self.incoming_seen.then_some(self.next_incoming_id),
            incoming_window: SESSION_WINDOW,
            next_outgoing_id: self.next_outgoing_id,
            outgoing_window: SESSION_WINDOW,
            ..Flow::default()
        }
    }

    fn link_flow(&mut self, handle: u32) {
        let Some(l) = self.links.get(&handle) else { return };
        let f = Flow {
            handle: Some(handle),
            delivery_count: Some(l.delivery_count),
            link_credit: Some(l.credit),
            ..self.session_flow()
        };
        self.frames_since_flow = 0;
        self.send(0, &Performative::Flow(f));
    }

    fn on_cmd(&mut self, cmd: Cmd) -> Result<(), Stop> {
        match cmd {
            Cmd::Attach(spec, reply) => self.attach(spec, reply),
            Cmd::Flow { handle, id, add } => {
                if let Some(l) =
                    self.links.get_mut(&handle).filter(|l| l.id == id && !l.detach_sent)
                {
                    l.credit = l.credit.saturating_add(add);
                    self.link_flow(handle);
                }
            }
            Cmd::StopCredit { handle, id } => {
                if let Some(l) =
                    self.links.get_mut(&handle).filter(|l| l.id == id && !l.detach_sent)
                {
                    l.credit = 0;
                    self.link_flow(handle);
                }
            }
            Cmd::Send { handle, id, payload, format, settled, reply } => {
                match self.links.get_mut(&handle).filter(|l| l.id == id && !l.detach_sent) {
                    Some(l) => l.queued.push_back(PendingSend { payload, format, settled, reply }),
                    None => {
                        let _ = reply.send(Err(link_gone()));
                    }
                }
                self.pump(handle);
            }
            Cmd::Dispose { handle, id, delivery_id, outcome, reply } => {
                if !self.links.get(&handle).is_some_and(|l| l.id == id && !l.detach_sent) {
                    let e =
                        if self.sessions_lost.contains(&id) { session_lost() } else { lock_lost() };
                    let _ = reply.send(Err(e));
                    return Ok(());
                }
                let d = Disposition {
                    role: ROLE_RECEIVER,
                    first: delivery_id,
                    last: None,
                    settled: false,
                    state: Some(outcome.to_value()),
                };
                self.send(0, &Performative::Disposition(d));
                self.disposes.insert(delivery_id, (handle, reply));
            }
            Cmd::Detach { handle, id } => {
                if let Some(l) =
                    self.links.get_mut(&handle).filter(|l| l.id == id && !l.detach_sent)
                {
                    l.detach_sent = true;
                    let d = Detach { handle, closed: true, error: None };
                    self.send(0, &Performative::Detach(d));
                    self.fail_link(handle, None);
                }
            }
            Cmd::Close => {
                self.send(0, &Performative::Close(None));
                return Err(Stop::Closed);
            }
        }
        Ok(())
    }

    fn attach(&mut self, spec: LinkSpec, reply: Reply<Link>) {
        let Some(handle) = (0..=255u32).find(|h| !self.links.contains_key(h)) else {
            let _ = reply.send(Err(Error::Invalid("too many links on one connection".into())));
            return;
        };
        let id = self.next_link_id;
        self.next_link_id += 1;
        let a = Attach {
            name: spec.name.clone(),
            handle,
            role: spec.role,
            snd_settle_mode: spec.snd_settle_mode,
            rcv_settle_mode: spec.rcv_settle_mode,
            source: spec.source,
            target: spec.target,
            initial_delivery_count: (spec.role == ROLE_SENDER).then_some(0),
            max_message_size: None,
            properties: spec.properties,
        };
        self.send(0, &Performative::Attach(a));
        let (events_tx, events_rx) = if spec.role == ROLE_RECEIVER {
            let (t, r) = mpsc::unbounded_channel();
            (Some(t), Some(r))
        } else {
            (None, None)
        };
        self.links.insert(
            handle,
            LinkState {
                id,
                name: spec.name,
                role: spec.role,
                remote_handle: None,
                attach_reply: Some(reply),
                events_tx,
                events_rx,
                attached: Arc::new(AtomicBool::new(true)),
                delivery_count: 0,
                credit: 0,
                initial_credit: spec.initial_credit,
                auto_credit: spec.auto_credit,
                queued: VecDeque::new(),
                partial: None,
                detach_sent: false,
            },
        );
    }

    fn on_frame(&mut self, f: &Frame) -> Result<(), Stop> {
        if f.body.is_empty() {
            return Ok(());
        }
        let (p, payload) =
            Performative::decode(&f.body).map_err(|e| Stop::Lost(format!("bad frame: {e}")))?;
        tracing::trace!(frame = ?p, payload = payload.len(), "recv");
        match p {
            Performative::Attach(a) => self.on_attach(a),
            Performative::Detach(d) => self.on_detach(d),
            Performative::Flow(fl) => self.on_flow(&fl),
            Performative::Transfer(t) => self.on_transfer(t, payload),
            Performative::Disposition(d) => self.on_disposition(&d),
            Performative::End(e) | Performative::Close(e) => {
                let why = e.map_or_else(
                    || "closed by the peer".to_owned(),
                    |e| format!("{}: {}", e.condition, e.description.unwrap_or_default()),
                );
                self.send(0, &Performative::Close(None));
                return Err(Stop::Lost(why));
            }
            Performative::Open(_)
            | Performative::Begin(_)
            | Performative::SaslMechanisms(_)
            | Performative::SaslInit(_)
            | Performative::SaslOutcome(_) => {}
        }
        Ok(())
    }

    fn on_attach(&mut self, a: Attach) {
        let Some((&handle, l)) =
            self.links.iter_mut().find(|(_, l)| l.name == a.name && l.remote_handle.is_none())
        else {
            return;
        };
        l.remote_handle = Some(a.handle);
        self.by_remote.insert(a.handle, handle);
        // A refusal is an attach without the terminus, followed by a detach with the error.
        let refused = if l.role == ROLE_RECEIVER { a.source.is_none() } else { a.target.is_none() };
        if refused {
            return;
        }
        if l.role == ROLE_RECEIVER {
            l.delivery_count = a.initial_delivery_count.unwrap_or(0);
            l.credit = l.initial_credit;
        }
        let events = l.events_rx.take();
        let id = l.id;
        let attached = Arc::clone(&l.attached);
        let reply = l.attach_reply.take();
        let grant = l.role == ROLE_RECEIVER && l.credit > 0;
        if let Some(reply) = reply
            && reply.send(Ok(Link { handle, id, remote: a, events, attached })).is_err()
        {
            // The caller gave up waiting: close the link again.
            if let Some(l) = self.links.get_mut(&handle) {
                l.detach_sent = true;
            }
            self.send(0, &Performative::Detach(Detach { handle, closed: true, error: None }));
            return;
        }
        if grant {
            self.link_flow(handle);
        }
    }

    fn on_detach(&mut self, d: Detach) {
        let Some(handle) = self.by_remote.remove(&d.handle) else { return };
        let Some(l) = self.links.get_mut(&handle) else { return };
        if let Some(reply) = l.attach_reply.take() {
            let e = d.error.as_ref().map_or(link_gone(), Error::from_amqp);
            let _ = reply.send(Err(e));
        }
        if !l.detach_sent {
            l.detach_sent = true;
            self.send(0, &Performative::Detach(Detach { handle, closed: true, error: None }));
        }
        self.fail_link(handle, d.error);
        self.links.remove(&handle);
    }

    /// Fails everything waiting on a link that is going away.
    fn fail_link(&mut self, handle: u32, error: Option<AmqpError>) {
        let Some(l) = self.links.get_mut(&handle) else { return };
        l.attached.store(false, Ordering::Release);
        let gone = || error.as_ref().map_or_else(link_gone, Error::from_amqp);
        for p in l.queued.drain(..) {
            let _ = p.reply.send(Err(gone()));
        }
        if let Some(tx) = l.events_tx.take() {
            let _ = tx.send(LinkEvent::Detached(error.clone()));
        }
        let session_lost = error
            .as_ref()
            .is_some_and(|e| e.condition == crate::error::condition::SESSION_LOCK_LOST);
        if session_lost {
            // A short memory is enough: settlements follow the detach closely.
            if self.sessions_lost.len() >= 64 {
                self.sessions_lost.pop_front();
            }
            self.sessions_lost.push_back(l.id);
        }
        let sends: Vec<u32> =
            self.sends.iter().filter(|(_, (h, _))| *h == handle).map(|(id, _)| *id).collect();
        for id in sends {
            if let Some((_, reply)) = self.sends.remove(&id) {
                let _ = reply.send(Err(gone()));
            }
        }
        let disposes: Vec<u32> =
            self.disposes.iter().filter(|(_, (h, _))| *h == handle).map(|(id, _)| *id).collect();
        for id in disposes {
            if let Some((_, reply)) = self.disposes.remove(&id) {
                let e = if session_lost { gone() } else { lock_lost() };
                let _ = reply.send(Err(e));
            }
        }
    }

    fn on_flow(&mut self, f: &Flow) {
        let limit = f.next_incoming_id.unwrap_or(0).wrapping_add(f.incoming_window);
        let window = limit.wrapping_sub(self.next_outgoing_id);
        self.remote_incoming_window = if window > u32::MAX / 2 { 0 } else { window };
        let Some(handle) = f.handle.and_then(|h| self.by_remote.get(&h).copied()) else {
            let handles: Vec<u32> = self.links.keys().copied().collect();
            for h in handles {
                self.pump(h);
            }
            return;
        };
        let Some(l) = self.links.get_mut(&handle) else { return };
        if l.role == ROLE_SENDER {
            let total = f.delivery_count.unwrap_or(0).wrapping_add(f.link_credit.unwrap_or(0));
            let credit = total.wrapping_sub(l.delivery_count);
            l.credit = if credit > u32::MAX / 2 { 0 } else { credit };
            if f.drain && l.queued.is_empty() {
                l.delivery_count = l.delivery_count.wrapping_add(l.credit);
                l.credit = 0;
                self.link_flow(handle);
            }
            self.pump(handle);
        } else if f.echo {
            self.link_flow(handle);
        }
    }

    /// Sends what a sender link has queued while it has credit and the session has room.
    fn pump(&mut self, handle: u32) {
        let max = usize::try_from(self.peer_max_frame).unwrap_or(usize::MAX);
        loop {
            let Some(l) = self.links.get_mut(&handle) else { return };
            if l.role != ROLE_SENDER || l.credit == 0 || self.remote_incoming_window == 0 {
                return;
            }
            let Some(p) = l.queued.pop_front() else { return };
            l.credit -= 1;
            l.delivery_count = l.delivery_count.wrapping_add(1);
            let delivery_id = self.next_delivery_id;
            self.next_delivery_id = self.next_delivery_id.wrapping_add(1);
            let tag = Bytes::copy_from_slice(&delivery_id.to_be_bytes());
            let room = max.saturating_sub(8 + 64 + tag.len()).max(64);
            let mut written = 0;
            loop {
                let end = p.payload.len().min(written + room);
                let more = end < p.payload.len();
                let first = written == 0;
                let t = Transfer {
                    handle,
                    delivery_id: first.then_some(delivery_id),
                    delivery_tag: first.then(|| tag.clone()),
                    message_format: first.then_some(p.format),
                    settled: Some(p.settled),
                    more,
                    ..Transfer::default()
                };
                frame::write_frame(
                    &mut self.buf,
                    frame::TYPE_AMQP,
                    0,
                    &Performative::Transfer(t),
                    p.payload.get(written..end).unwrap_or(&[]),
                );
                self.next_outgoing_id = self.next_outgoing_id.wrapping_add(1);
                self.remote_incoming_window = self.remote_incoming_window.saturating_sub(1);
                written = end;
                if !more {
                    break;
                }
            }
            if p.settled {
                let _ = p.reply.send(Ok(Outcome::Accepted));
            } else {
                self.sends.insert(delivery_id, (handle, p.reply));
            }
        }
    }

    fn on_transfer(&mut self, t: Transfer, payload: &[u8]) {
        self.next_incoming_id = self.next_incoming_id.wrapping_add(1);
        self.incoming_seen = true;
        self.frames_since_flow += 1;
        if self.frames_since_flow >= SESSION_WINDOW / 2 {
            self.frames_since_flow = 0;
            let f = self.session_flow();
            self.send(0, &Performative::Flow(f));
        }
        let Some(&handle) = self.by_remote.get(&t.handle) else { return };
        let Some(l) = self.links.get_mut(&handle) else { return };
        if l.partial.is_none() && t.delivery_id.is_none() {
            // A delivery's first frame names its id; without one there is no delivery.
            return;
        }
        let done = match reassemble(&mut l.partial, &t, payload, usize::MAX) {
            Step::More | Step::Aborted => return,
            Step::Done(done) => done,
        };
        l.delivery_count = l.delivery_count.wrapping_add(1);
        l.credit = l.credit.saturating_sub(1);
        let incoming = Incoming {
            delivery_id: done.delivery_id,
            tag: done.tag,
            settled: done.settled,
            payload: done.payload.freeze(),
        };
        if let Some(tx) = &l.events_tx {
            let _ = tx.send(LinkEvent::Delivery(incoming));
        }
        if l.auto_credit && l.credit <= l.initial_credit / 2 {
            l.credit = l.initial_credit;
            self.link_flow(handle);
        }
    }

    fn on_disposition(&mut self, d: &Disposition) {
        let outcome =
            d.state.as_ref().and_then(|s| Outcome::from_value(s).ok()).unwrap_or(Outcome::Accepted);
        let last = d.last.unwrap_or(d.first);
        let mut id = d.first;
        // A range is at most what this client can have in flight; a wider one is bogus.
        let last = if last.wrapping_sub(d.first) > 1 << 20 { d.first } else { last };
        loop {
            let waiting = if d.role == ROLE_RECEIVER {
                self.sends.remove(&id)
            } else {
                self.disposes.remove(&id)
            };
            if let Some((_, reply)) = waiting {
                let _ = reply.send(Ok(outcome.clone()));
            }
            if id == last {
                break;
            }
            id = id.wrapping_add(1);
        }
    }
}

fn link_gone() -> Error {
    Error::Amqp {
        condition: crate::error::condition::DETACH_FORCED.into(),
        description: Some("the link was detached".into()),
    }
}

fn session_lost() -> Error {
    Error::Amqp {
        condition: crate::error::condition::SESSION_LOCK_LOST.into(),
        description: Some("the session link was detached: its lock is gone".into()),
    }
}

fn lock_lost() -> Error {
    Error::Amqp {
        condition: crate::error::condition::MESSAGE_LOCK_LOST.into(),
        description: Some("the link the message came on is gone".into()),
    }
}
