//! Raw AMQP against the server: robustness (bad headers, malformed, oversized and unknown
//! frames close only their connection), credit and drain, multi-frame transfers both ways,
//! heartbeats, `released`, and pipelined frames.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use twice_servicebus::ServerOptions;
use twice_servicebus::codec::Value;
use twice_servicebus::frame::{self, Frame, FrameReader};
use twice_servicebus::mapping::{Sections, encode_message};
use twice_servicebus::performative::{
    Attach, Begin, Disposition, Flow, Open, Outcome, Performative, SaslInit, Transfer,
    described_list,
};

use crate::harness::TestServer;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);

/// A bare AMQP client: frames in, frames out.
pub(crate) struct Raw {
    pub(crate) reader: FrameReader<OwnedReadHalf>,
    pub(crate) writer: tokio::net::tcp::OwnedWriteHalf,
}

impl Raw {
    pub(crate) async fn connect(addr: SocketAddr) -> Self {
        let s = TcpStream::connect(addr).await.unwrap();
        let (r, w) = s.into_split();
        Self { reader: FrameReader::new(r, 16 * 1024 * 1024), writer: w }
    }

    /// SASL PLAIN with the server's key (which authorises every entity), then `open` and
    /// `begin` on channel 0.
    pub(crate) async fn open(addr: SocketAddr, max_frame_size: u32) -> Self {
        let begin = Begin {
            next_outgoing_id: 0,
            incoming_window: 10_000,
            outgoing_window: 10_000,
            ..Begin::default()
        };
        Self::hello(addr, max_frame_size, Some(begin)).await
    }

    /// SASL PLAIN and `open`, then `begin` when given: everything pipelined in one write, as
    /// the SDKs do; returns once the server has answered each.
    pub(crate) async fn hello(addr: SocketAddr, max_frame_size: u32, begin: Option<Begin>) -> Self {
        let mut c = Self::connect(addr).await;
        let mut out = frame::SASL_HEADER.to_vec();
        let init = SaslInit {
            mechanism: "PLAIN".into(),
            initial_response: Some(Bytes::from_static(
                b"\0RootManageSharedAccessKey\0SAS_KEY_VALUE",
            )),
            hostname: None,
        };
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
        out.extend_from_slice(&frame::AMQP_HEADER);
        let open =
            Open { container_id: "raw".into(), max_frame_size, channel_max: 9, ..Open::default() };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
        let begins = begin.is_some();
        if let Some(begin) = begin {
            frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Begin(begin), &[]);
        }
        c.writer.write_all(&out).await.unwrap();
        assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::SASL_HEADER);
        assert!(matches!(c.next().await.0, Performative::SaslMechanisms(_)));
        assert_eq!(c.next().await.0, Performative::SaslOutcome(0));
        assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::AMQP_HEADER);
        assert!(matches!(c.next().await.0, Performative::Open(_)));
        if begins {
            assert!(matches!(c.next().await.0, Performative::Begin(_)));
        }
        c
    }

    pub(crate) async fn send(&mut self, p: Performative, payload: &[u8]) {
        let mut out = Vec::new();
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &p, payload);
        self.writer.write_all(&out).await.unwrap();
    }

    pub(crate) async fn frame(&mut self) -> Frame {
        loop {
            let f = tokio::time::timeout(TIMEOUT, self.reader.read_frame())
                .await
                .expect("a frame in time")
                .expect("a frame");
            if !f.body.is_empty() {
                return f;
            }
        }
    }

    pub(crate) async fn next(&mut self) -> (Performative, Bytes) {
        let f = self.frame().await;
        let (p, payload) = Performative::decode(&f.body).unwrap();
        let payload = Bytes::copy_from_slice(payload);
        (p, payload)
    }

    /// Reads until the connection closes; returns the close frame's error condition, if any.
    pub(crate) async fn closed_with(&mut self) -> Option<String> {
        let mut condition = None;
        loop {
            match tokio::time::timeout(TIMEOUT, self.reader.read_frame())
                .await
                .expect("closed in time")
            {
                Ok(f) if f.body.is_empty() => {}
                Ok(f) => {
                    if let Ok((Performative::Close(e), _)) = Performative::decode(&f.body) {
                        condition = e.map(|e| e.condition);
                    }
                }
                Err(_) => return condition,
            }
        }
    }

    pub(crate) async fn attach(
        &mut self,
        name: &str,
        handle: u32,
        client_receives: bool,
        address: &str,
        snd_settle_mode: u8,
    ) {
        let a = Attach {
            snd_settle_mode: Some(snd_settle_mode),
            rcv_settle_mode: Some(if client_receives { 1 } else { 0 }),
            ..attach_of(name, handle, client_receives, address)
        };
        self.send(Performative::Attach(a), &[]).await;
        match self.next().await.0 {
            Performative::Attach(reply) => assert_eq!(reply.name, name),
            other => panic!("expected attach, got {other:?}"),
        }
        if !client_receives {
            assert!(matches!(self.next().await.0, Performative::Flow(_)), "credit for a sender");
        }
    }

    pub(crate) async fn flow(
        &mut self,
        handle: u32,
        delivery_count: u32,
        credit: u32,
        drain: bool,
    ) {
        let f = Flow {
            next_incoming_id: Some(0),
            incoming_window: 10_000,
            next_outgoing_id: 0,
            outgoing_window: 10_000,
            handle: Some(handle),
            delivery_count: Some(delivery_count),
            link_credit: Some(credit),
            drain,
            ..Flow::default()
        };
        self.send(Performative::Flow(f), &[]).await;
    }

    /// Sends a message on a sender link, split into frames of at most `chunk` payload bytes.
    pub(crate) async fn transfer(
        &mut self,
        handle: u32,
        delivery_id: u32,
        payload: &[u8],
        chunk: usize,
    ) {
        let chunks: Vec<&[u8]> = payload.chunks(chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let t = Transfer {
                handle,
                delivery_id: (i == 0).then_some(delivery_id),
                delivery_tag: (i == 0).then(|| Bytes::from(delivery_id.to_be_bytes().to_vec())),
                message_format: (i == 0).then_some(0),
                settled: Some(false),
                more: i + 1 < chunks.len(),
                ..Transfer::default()
            };
            self.send(Performative::Transfer(t), c).await;
        }
    }
}

/// An attach of a link to or from `address` (the other terminus is "me").
pub(crate) fn attach_of(name: &str, handle: u32, client_receives: bool, address: &str) -> Attach {
    let terminus = |code, addr: &str| described_list(code, vec![Value::string(addr)]);
    let (source, target) = if client_receives {
        (terminus(0x28, address), terminus(0x29, "me"))
    } else {
        (terminus(0x28, "me"), terminus(0x29, address))
    };
    Attach {
        name: name.into(),
        handle,
        role: client_receives,
        snd_settle_mode: Some(0),
        rcv_settle_mode: Some(0),
        source: Some(source),
        target: Some(target),
        initial_delivery_count: (!client_receives).then_some(0),
        ..Attach::default()
    }
}

#[tokio::test]
async fn wrong_protocol_header_gets_ours_and_a_close_while_others_keep_working() {
    let server = TestServer::start().await;
    let mut good = Raw::open(server.addr, 65536).await;
    let mut bad = Raw::connect(server.addr).await;
    bad.writer.write_all(b"HTTP/1.1 GET /\r\n\r\n").await.unwrap();
    let mut header = [0u8; 8];
    bad.reader_header(&mut header).await;
    assert_eq!(header, frame::AMQP_HEADER);
    // The good connection is unaffected.
    good.attach("s", 0, false, "q1", 0).await;
}

impl Raw {
    /// Reads the server's protocol header, then expects the connection to end.
    pub(crate) async fn reader_header(&mut self, out: &mut [u8; 8]) {
        *out = tokio::time::timeout(TIMEOUT, self.reader.read_protocol_header())
            .await
            .unwrap()
            .unwrap();
        let next = tokio::time::timeout(TIMEOUT, self.reader.read_frame()).await.unwrap();
        assert!(
            matches!(next, Err(frame::ReadError::Closed)),
            "the server closes after its header"
        );
    }
}

#[tokio::test]
async fn malformed_oversized_unknown_and_truncated_frames_close_only_their_connection() {
    let server = TestServer::start_with(ServerOptions::new().max_frame_size(4096), None).await;
    let mut good = Raw::open(server.addr, 4096).await;

    // A frame body that is not AMQP.
    let mut c = Raw::open(server.addr, 4096).await;
    c.writer.write_all(&[0, 0, 0, 12, 2, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).await.unwrap();
    assert_eq!(c.closed_with().await.as_deref(), Some("amqp:decode-error"));

    // A frame larger than the limit.
    let mut c = Raw::open(server.addr, 4096).await;
    c.writer.write_all(&[0, 1, 0, 0, 2, 0, 0, 0]).await.unwrap();
    assert_eq!(c.closed_with().await.as_deref(), Some("amqp:connection:framing-error"));

    // A header whose data offset points past the frame.
    let mut c = Raw::open(server.addr, 4096).await;
    c.writer.write_all(&[0, 0, 0, 8, 9, 0, 0, 0]).await.unwrap();
    assert_eq!(c.closed_with().await.as_deref(), Some("amqp:connection:framing-error"));

    // An unknown performative.
    let mut c = Raw::open(server.addr, 4096).await;
    let mut out = Vec::new();
    let body = described_list(0x99, vec![Value::Uint(1)]).to_bytes();
    out.extend_from_slice(&u32::try_from(8 + body.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&[2, 0, 0, 0]);
    out.extend_from_slice(&body);
    c.writer.write_all(&out).await.unwrap();
    assert_eq!(c.closed_with().await.as_deref(), Some("amqp:not-implemented"));

    // A truncated frame, then the peer goes away.
    let mut c = Raw::open(server.addr, 4096).await;
    c.writer.write_all(&[0, 0, 0, 100, 2, 0, 0, 0, 0x00, 0x53]).await.unwrap();
    drop(c);

    // The first connection still works, and so does a new one.
    good.attach("s", 0, false, "q1", 0).await;
    let mut fresh = Raw::open(server.addr, 4096).await;
    fresh.attach("s", 0, false, "q2", 0).await;
}

#[tokio::test]
async fn multi_frame_transfers_both_ways_and_drain() {
    let server = TestServer::start().await;
    // The client accepts 512-byte frames only, so a 3 KiB message comes back in pieces.
    let mut c = Raw::open(server.addr, 512).await;
    c.attach("send", 0, false, "q3", 0).await;
    let body = vec![b'x'; 3000];
    let payload = encode_message(&twice::Message::new(body.clone()).with_message_id("big"));
    c.transfer(0, 0, &payload, 400).await;
    match c.next().await.0 {
        Performative::Disposition(d) => {
            assert_eq!(d.first, 0);
            assert!(d.settled);
            assert_eq!(Outcome::from_value(d.state.as_ref().unwrap()).unwrap(), Outcome::Accepted);
        }
        other => panic!("expected disposition, got {other:?}"),
    }

    c.attach("recv", 1, true, "q3", 0).await;
    c.flow(1, 0, 5, false).await;
    let mut assembled = Vec::new();
    let mut frames = 0;
    let delivery_id = loop {
        let f = c.frame().await;
        assert!(f.body.len() + 8 <= 512, "frames respect the peer's maximum");
        let (p, payload) = Performative::decode(&f.body).unwrap();
        let Performative::Transfer(t) = p else { panic!("expected transfer, got {p:?}") };
        frames += 1;
        assembled.extend_from_slice(payload);
        if !t.more {
            break t.delivery_id;
        }
    };
    assert!(frames > 5, "split into {frames} frames");
    let message = Sections::parse(&assembled).unwrap().to_message();
    assert_eq!(&message.body[..], &body[..]);
    assert_eq!(message.message_id.unwrap().as_str(), "big");

    // Drain with the queue empty: the server uses up the credit and says so.
    c.flow(1, 1, 4, true).await;
    match c.next().await.0 {
        Performative::Flow(f) => {
            assert!(f.drain);
            assert_eq!(f.link_credit, Some(0));
            assert_eq!(f.delivery_count, Some(5));
        }
        other => panic!("expected flow, got {other:?}"),
    }

    // `released` unlocks without counting a delivery: it comes back with the same count.
    let released = Disposition {
        role: true,
        first: delivery_id.unwrap_or(0),
        last: None,
        settled: false,
        state: Some(Outcome::Released.to_value()),
    };
    c.send(Performative::Disposition(released), &[]).await;
    match c.next().await.0 {
        Performative::Disposition(d) => {
            assert!(d.settled);
            assert_eq!(Outcome::from_value(d.state.as_ref().unwrap()).unwrap(), Outcome::Released);
        }
        other => panic!("expected the released echo, got {other:?}"),
    }
    c.flow(1, 5, 1, false).await;
    let mut again = Vec::new();
    loop {
        let (p, payload) = c.next().await;
        let Performative::Transfer(t) = p else { panic!("expected transfer") };
        again.extend_from_slice(&payload);
        if !t.more {
            break;
        }
    }
    let header = Sections::parse(&again).unwrap().header;
    assert_eq!(header.get(4), Some(&Value::Uint(0)), "released does not count a delivery");
}

#[tokio::test]
async fn heartbeats_keep_an_idle_connection_open() {
    let server = TestServer::start().await;
    let mut c = Raw::connect(server.addr).await;
    let mut out = frame::AMQP_HEADER.to_vec();
    // A peer that wants to hear from the server every 400 ms.
    let open = Open {
        container_id: "raw".into(),
        max_frame_size: 65536,
        channel_max: 1,
        idle_time_out: Some(400),
        ..Open::default()
    };
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    c.writer.write_all(&out).await.unwrap();
    assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::AMQP_HEADER);
    let f = c.reader.read_frame().await.unwrap();
    assert!(matches!(Performative::decode(&f.body).unwrap().0, Performative::Open(_)));
    let mut empty = 0;
    while empty < 3 {
        let f = tokio::time::timeout(Duration::from_secs(2), c.reader.read_frame())
            .await
            .expect("a heartbeat")
            .unwrap();
        assert!(f.body.is_empty(), "only heartbeats on an idle connection");
        empty += 1;
    }
}

impl Raw {
    /// SASL PLAIN and `open`, without a session: returns once the server's `open` is read.
    pub(crate) async fn opened(addr: SocketAddr) -> Self {
        Self::hello(addr, 65536, None).await
    }

    /// A session on channel 0 whose incoming window is `window` transfer frames.
    pub(crate) async fn begin(&mut self, window: u32) {
        let begin = Begin {
            next_outgoing_id: 0,
            incoming_window: window,
            outgoing_window: 10_000,
            ..Begin::default()
        };
        self.send(Performative::Begin(begin), &[]).await;
        assert!(matches!(self.next().await.0, Performative::Begin(_)));
    }

    /// Sends `n` messages on sender link `handle` and reads the server's acceptances.
    pub(crate) async fn send_messages(&mut self, handle: u32, n: u32) {
        for i in 0..n {
            let m = twice::Message::new(format!("m{i}")).with_message_id(format!("m{i}"));
            self.transfer(handle, i, &encode_message(&m), 65536).await;
        }
        let mut accepted = 0;
        while accepted < n {
            let Performative::Disposition(d) = self.next().await.0 else {
                panic!("expected dispositions for the sends")
            };
            assert_eq!(Outcome::from_value(d.state.as_ref().unwrap()).unwrap(), Outcome::Accepted);
            accepted += d.last.unwrap_or(d.first) - d.first + 1;
        }
        assert_eq!(accepted, n);
    }

    /// A client that sent `n` messages to `queue` on link 0 and holds them, unsettled, on
    /// receiver link 1; returns it with their delivery ids.
    pub(crate) async fn with_deliveries(addr: SocketAddr, queue: &str, n: u32) -> (Self, Vec<u32>) {
        let mut c = Raw::open(addr, 65536).await;
        c.attach("send", 0, false, queue, 0).await;
        c.send_messages(0, n).await;
        c.attach("recv", 1, true, queue, 0).await;
        c.flow(1, 0, n, false).await;
        let ids = c.transfers(n as usize).await;
        (c, ids)
    }

    /// Reads `n` complete single-frame transfers; returns their delivery ids.
    pub(crate) async fn transfers(&mut self, n: usize) -> Vec<u32> {
        let mut ids = Vec::new();
        while ids.len() < n {
            match self.next().await.0 {
                Performative::Transfer(t) => {
                    assert!(!t.more, "small messages come in one frame");
                    ids.push(t.delivery_id.expect("a delivery id"));
                }
                other => panic!("expected a transfer, got {other:?}"),
            }
        }
        ids
    }

    /// A session-level flow: the client's window is `window` frames from `next_incoming_id`.
    pub(crate) async fn session_flow(&mut self, next_incoming_id: u32, window: u32, echo: bool) {
        let f = Flow {
            next_incoming_id: Some(next_incoming_id),
            incoming_window: window,
            next_outgoing_id: 0,
            outgoing_window: 10_000,
            echo,
            ..Flow::default()
        };
        self.send(Performative::Flow(f), &[]).await;
    }
}

#[tokio::test]
async fn a_connection_over_the_limit_is_closed_with_resource_limit_exceeded() {
    let server = TestServer::start_with(ServerOptions::new().max_connections(1), None).await;
    let mut first = Raw::open(server.addr, 65536).await;
    let mut second = Raw::opened(server.addr).await;
    assert_eq!(second.closed_with().await.as_deref(), Some("amqp:resource-limit-exceeded"));
    // The connection within the limit is unaffected.
    first.attach("s", 0, false, "q1", 0).await;
}

#[tokio::test]
async fn a_receiver_holds_at_most_the_unsettled_limit() {
    let server = TestServer::start_with(ServerOptions::new().max_unsettled_per_link(2), None).await;
    let mut c = Raw::open(server.addr, 65536).await;
    c.attach("send", 0, false, "q4", 0).await;
    c.send_messages(0, 5).await;
    c.attach("recv", 1, true, "q4", 0).await;
    c.flow(1, 0, 10, false).await;
    let ids = c.transfers(2).await;
    // A drain is answered with what may be sent: nothing more while two are unsettled.
    c.flow(1, 2, 8, true).await;
    match c.next().await.0 {
        Performative::Flow(f) => {
            assert!(f.drain);
            assert_eq!((f.delivery_count, f.link_credit), (Some(10), Some(0)));
        }
        other => panic!("expected the drain answer and no transfer, got {other:?}"),
    }
    // Settling one makes room for one.
    let done = Disposition {
        role: true,
        first: ids[0],
        last: None,
        settled: false,
        state: Some(Outcome::Accepted.to_value()),
    };
    c.send(Performative::Disposition(done), &[]).await;
    match c.next().await.0 {
        Performative::Disposition(d) => assert_eq!((d.first, d.settled), (ids[0], true)),
        other => panic!("expected the echo, got {other:?}"),
    }
    c.flow(1, 10, 5, false).await;
    c.transfers(1).await;
    c.flow(1, 11, 4, true).await;
    match c.next().await.0 {
        Performative::Flow(f) => assert_eq!((f.delivery_count, f.link_credit), (Some(15), Some(0))),
        other => panic!("expected the drain answer and no transfer, got {other:?}"),
    }
    let counts = server.broker.counts("q4").await.unwrap();
    assert_eq!((counts.active, counts.locked), (4, 2));
}

#[tokio::test]
async fn transfers_wait_for_the_clients_session_window() {
    let server = TestServer::start().await;
    let mut c = Raw::opened(server.addr).await;
    // The client takes two transfer frames until it says otherwise.
    c.begin(2).await;
    c.attach("send", 0, false, "q5", 0).await;
    c.send_messages(0, 5).await;
    c.attach("recv", 1, true, "q5", 0).await;
    let f = Flow {
        next_incoming_id: Some(0),
        incoming_window: 2,
        next_outgoing_id: 0,
        outgoing_window: 10_000,
        handle: Some(1),
        delivery_count: Some(0),
        link_credit: Some(5),
        ..Flow::default()
    };
    c.send(Performative::Flow(f), &[]).await;
    c.transfers(2).await;
    // A closed window: the echo of the session state comes, no transfer.
    c.session_flow(2, 0, true).await;
    match c.next().await.0 {
        Performative::Flow(f) => assert_eq!(f.handle, None),
        other => panic!("expected the session flow and no transfer, got {other:?}"),
    }
    c.session_flow(2, 100, false).await;
    c.transfers(3).await;
}

#[tokio::test]
async fn settlements_are_applied_and_echoed_in_ranges() {
    let server = TestServer::start().await;
    let (mut c, ids) = Raw::with_deliveries(server.addr, "q6", 20).await;
    let all = Disposition {
        role: true,
        first: ids[0],
        last: Some(ids[19]),
        settled: false,
        state: Some(Outcome::Accepted.to_value()),
    };
    c.send(Performative::Disposition(all), &[]).await;
    let mut echoed = Vec::new();
    while echoed.len() < 20 {
        let Performative::Disposition(d) = c.next().await.0 else { panic!("expected echoes") };
        assert!(d.settled && !d.role, "the server settles as the sender");
        assert_eq!(Outcome::from_value(d.state.as_ref().unwrap()).unwrap(), Outcome::Accepted);
        echoed.extend(d.first..=d.last.unwrap_or(d.first));
    }
    assert_eq!(echoed, ids);
    // Each echo follows the broker's answer: the messages are gone.
    let counts = server.broker.counts("q6").await.unwrap();
    assert_eq!(counts.active, 0);
}

#[tokio::test]
async fn an_idle_session_receiver_is_detached_when_its_session_lock_expires() {
    let server = TestServer::start().await;
    let m = twice::Message::new("s").with_session_id("idle");
    server.broker.send("sessq2", m).await.unwrap();
    let mut c = Raw::open(server.addr, 65536).await;
    let filter =
        Value::Map(vec![(Value::symbol("com.microsoft:session-filter"), Value::string("idle"))]);
    let mut source = vec![Value::string("sessq2")];
    source.extend(std::iter::repeat_n(Value::Null, 6));
    source.push(filter);
    let a = Attach {
        name: "session".into(),
        handle: 0,
        role: true,
        snd_settle_mode: Some(0),
        rcv_settle_mode: Some(1),
        source: Some(described_list(0x28, source)),
        target: Some(described_list(0x29, vec![Value::string("me")])),
        ..Attach::default()
    };
    c.send(Performative::Attach(a), &[]).await;
    match c.next().await.0 {
        Performative::Attach(reply) => assert!(reply.source.is_some(), "the session is locked"),
        other => panic!("expected attach, got {other:?}"),
    }
    // No credit, no receive: only the lock's own deadline can notice. LockDuration is 1 min.
    server.clock.advance(Duration::from_secs(61));
    match c.next().await.0 {
        Performative::Detach(d) => {
            assert!(d.closed);
            assert_eq!(d.error.unwrap().condition, "com.microsoft:session-lock-lost");
        }
        other => panic!("expected a detach, got {other:?}"),
    }
    // The session is free again.
    let again = server.broker.accept_session("sessq2", &"idle".into()).await;
    assert!(again.is_ok(), "{again:?}");
}
