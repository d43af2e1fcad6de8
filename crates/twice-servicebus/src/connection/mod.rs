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
//!
//! This file holds the socket loop and the dispatch of frames and task reports. The rest, each
//! acting on `state` and none on another the other way round: `state` (session and link
//! state, the outgoing queue and its writing within the peer's window, what the link tasks are
//! given and report), `handshake` (protocol headers, SASL, `open`, `$cbs` tokens and what they
//! authorize), `delivery` (credit and drain, the messages a pump took), `links` (the tasks of
//! a link), and, above those, `session` (`begin`/`end`, attach and detach) and `transfer` (the
//! client's transfers, requests and dispositions, and the echoes). The conditions sent live in
//! [`crate::conditions`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::backend::{Backend, BackendSession};
use crate::conditions::{self as cond, backend_error, session_lock_lost};
use crate::frame::{self, Frame, FrameReader, ReadError};
use crate::grants::Grants;
use crate::ids::IdPool;
use crate::metrics::Metrics;
use crate::performative::{AmqpError, Performative};
use crate::shared::Shared;

use handshake::{handshake, refuse};
use state::{Event, Out, Session};

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

// After `sflow`, which they use.
mod delivery;
mod handshake;
mod links;
mod session;
mod state;
mod transfer;

/// Why a connection ends.
#[derive(Debug)]
enum End {
    /// Close with this error (or cleanly).
    Close(Option<AmqpError>),
    /// Drop the socket without a close frame.
    Drop,
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
    pub(crate) handshake: crate::pending::Ticket,
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
    mut admission: Admission,
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
    let opening = tokio::time::timeout(shared.options.handshake_timeout, opening);
    let (sasl_ok, first) = tokio::select! {
        opened = opening => match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(())) | Err(_) => return,
        },
        () = admission.handshake.evicted() => {
            tracing::debug!("connection dropped in its handshake: newer ones need its place");
            return;
        }
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
                    let mut step = conn.on_frame(&f);
                    // The frames that arrived with it are handled before anything is written,
                    // so one write answers them all.
                    while step.is_ok() && conn.bytes_in_flight <= max_in_flight {
                        match reader.buffered_frame() {
                            Some(Ok(f)) => step = conn.on_frame(&f),
                            Some(Err(e)) => step = Err(read_error(e)),
                            None => break,
                        }
                    }
                    step
                }
                Err(e) => Err(read_error(e)),
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

/// How a connection ends when its frames cannot be read.
fn read_error(e: ReadError) -> End {
    match e {
        ReadError::TooLarge { size, max } => End::Close(Some(AmqpError::new(
            cond::FRAME_TOO_LARGE,
            format!("frame of {size} bytes exceeds the maximum frame size {max}"),
        ))),
        ReadError::BadHeader { .. } => {
            End::Close(Some(AmqpError::new(cond::FRAME_TOO_LARGE, "malformed frame header")))
        }
        _ => End::Drop,
    }
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
}
