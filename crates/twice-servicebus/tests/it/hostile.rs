//! Raw AMQP clients that try to get around authorization, exhaust the server or feed it decode
//! bombs: each test is one attack, and checks that it gains nothing and that the server keeps
//! serving others.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use twice::Clock as _;
use twice_servicebus::ServerOptions;
use twice_servicebus::codec::Value;
use twice_servicebus::frame::{self, FrameReader};
use twice_servicebus::mapping::encode_message;
use twice_servicebus::performative::{
    Attach, Begin, Open, Performative, SaslInit, Transfer, described_list,
};

use crate::harness::TestServer;
use crate::wire::Raw;

impl Raw {
    /// SASL ANONYMOUS (no key), `open` and `begin` on channel 0: a client that holds no token.
    pub(crate) async fn anonymous(addr: SocketAddr) -> Self {
        let s = TcpStream::connect(addr).await.unwrap();
        let (r, w) = s.into_split();
        let mut c = Self { reader: FrameReader::new(r, 16 * 1024 * 1024), writer: w };
        let mut out = frame::SASL_HEADER.to_vec();
        let init =
            SaslInit { mechanism: "ANONYMOUS".into(), initial_response: None, hostname: None };
        frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
        out.extend_from_slice(&frame::AMQP_HEADER);
        let open = Open {
            container_id: "anonymous".into(),
            max_frame_size: 65536,
            channel_max: u16::MAX,
            ..Open::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
        let begin = Begin {
            next_outgoing_id: 0,
            incoming_window: 10_000,
            outgoing_window: 10_000,
            ..Begin::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Begin(begin), &[]);
        c.writer.write_all(&out).await.unwrap();
        assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::SASL_HEADER);
        assert!(matches!(c.next().await.0, Performative::SaslMechanisms(_)));
        assert_eq!(c.next().await.0, Performative::SaslOutcome(0));
        assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::AMQP_HEADER);
        assert!(matches!(c.next().await.0, Performative::Open(_)));
        assert!(matches!(c.next().await.0, Performative::Begin(_)));
        c
    }

    /// Sends an attach and returns the server's answer: the attach, and the detach's error
    /// condition when the link was refused.
    pub(crate) async fn try_attach(
        &mut self,
        name: &str,
        handle: u32,
        client_receives: bool,
        address: &str,
    ) -> Option<String> {
        let a = crate::wire::attach_of(name, handle, client_receives, address);
        self.send(Performative::Attach(a), &[]).await;
        match self.next().await.0 {
            Performative::Attach(reply) => assert_eq!(reply.name, name),
            other => panic!("expected attach, got {other:?}"),
        }
        match self.next().await.0 {
            Performative::Detach(d) => Some(d.error.expect("a refusal says why").condition),
            Performative::Flow(_) if !client_receives => None,
            other => panic!("expected a detach or credit, got {other:?}"),
        }
    }

    /// Reads until the session on channel 0 ends; returns the end's error condition.
    pub(crate) async fn session_ended_with(&mut self) -> Option<String> {
        loop {
            match self.next().await.0 {
                Performative::End(e) => return e.map(|e| e.condition),
                Performative::Close(e) => {
                    panic!("expected the session to end, the connection closed: {e:?}")
                }
                _ => {}
            }
        }
    }
}

/// An `amqp-value` management request with an `operation` application property.
pub(crate) fn mgmt_request(operation: &str, body: Value) -> Vec<u8> {
    let mut out = Vec::new();
    described_list(
        0x73,
        vec![Value::string("req-1"), Value::Null, Value::Null, Value::Null, Value::string("me")],
    )
    .encode(&mut out);
    Value::described(
        0x74,
        Value::Map(vec![(Value::string("operation"), Value::string(operation))]),
    )
    .encode(&mut out);
    Value::described(0x77, body).encode(&mut out);
    out
}

/// `GET path` on the server's HTTP port; returns the body.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).await.unwrap();
    response
}

#[tokio::test]
async fn a_client_without_a_token_cannot_send_through_a_refused_link() {
    let server = TestServer::start().await;
    let mut c = Raw::anonymous(server.addr).await;
    let refused = c.try_attach("s", 0, false, "q1").await;
    assert_eq!(refused.as_deref(), Some("amqp:unauthorized-access"));
    // The client sends on the refused link as if it had been attached.
    let m = encode_message(&twice::Message::new("sneaked").with_message_id("x"));
    c.transfer(0, 0, &m, 65536).await;
    assert_eq!(c.session_ended_with().await.as_deref(), Some("amqp:session:unattached-handle"));
    assert_eq!(server.broker.counts("q1").await.unwrap().active, 0, "nothing reached q1");
}

#[tokio::test]
async fn a_client_without_a_token_cannot_run_management_operations() {
    let server = TestServer::start().await;
    server.broker.send("q2", twice::Message::new("kept").with_message_id("k")).await.unwrap();
    let mut c = Raw::anonymous(server.addr).await;
    let refused = c.try_attach("m", 0, false, "q2/$management").await;
    assert_eq!(refused.as_deref(), Some("amqp:unauthorized-access"));
    // Receive-by-sequence-number in receive-and-delete mode would take the message away.
    let body = Value::Map(vec![
        (
            Value::string("sequence-numbers"),
            Value::Array(twice_servicebus::codec::Array {
                code: 0x81,
                items: vec![Value::Long(1)],
            }),
        ),
        (Value::string("receiver-settle-mode"), Value::Uint(0)),
    ]);
    let request = mgmt_request("com.microsoft:receive-by-sequence-number", body);
    c.transfer(0, 0, &request, 65536).await;
    assert_eq!(c.session_ended_with().await.as_deref(), Some("amqp:session:unattached-handle"));
    assert_eq!(server.broker.counts("q2").await.unwrap().active, 1, "the message is still there");
}

#[tokio::test]
async fn made_up_entity_names_leave_no_trace_in_the_metrics() {
    let server = TestServer::start().await;
    for i in 0..3 {
        let mut c = Raw::anonymous(server.addr).await;
        let address = format!("madeup{i}/$management");
        assert!(c.try_attach("m", 0, false, &address).await.is_some(), "refused");
        let body = Value::Map(vec![
            (
                Value::string("lock-tokens"),
                Value::Array(twice_servicebus::codec::Array {
                    code: 0x98,
                    items: vec![Value::Uuid(uuid::Uuid::new_v4())],
                }),
            ),
            (Value::string("disposition-status"), Value::string("completed")),
        ]);
        let request = mgmt_request("com.microsoft:update-disposition", body);
        c.transfer(0, 0, &request, 65536).await;
        assert_eq!(c.session_ended_with().await.as_deref(), Some("amqp:session:unattached-handle"));
    }
    let metrics = http_get(server.http, "/metrics").await;
    assert!(metrics.contains("HTTP/1.1 200"), "{metrics}");
    assert!(!metrics.contains("madeup"), "{metrics}");
}

#[tokio::test]
async fn deleted_entities_leave_the_metrics_and_stay_gone() {
    let server = TestServer::start().await;
    let expiry = std::time::SystemTime::UNIX_EPOCH
        + Duration::from_millis(u64::try_from(server.clock.now().as_millis()).unwrap())
        + Duration::from_secs(600);
    let admin = token(&format!("https://localhost:{}/", server.http.port()), expiry);
    let auth = [("authorization", admin.as_str())];
    let queue = "<entry xmlns='http://www.w3.org/2005/Atom'><content type='application/xml'>\
        <QueueDescription xmlns='http://schemas.microsoft.com/netservices/2010/10/servicebus/connect'/>\
        </content></entry>";
    let topic = "<entry xmlns='http://www.w3.org/2005/Atom'><content type='application/xml'>\
        <TopicDescription xmlns='http://schemas.microsoft.com/netservices/2010/10/servicebus/connect'/>\
        </content></entry>";
    let sub = "<entry xmlns='http://www.w3.org/2005/Atom'><content type='application/xml'>\
        <SubscriptionDescription xmlns='http://schemas.microsoft.com/netservices/2010/10/servicebus/connect'/>\
        </content></entry>";
    for (path, body) in [("/goneq", queue), ("/gonet", topic), ("/gonet/subscriptions/s", sub)] {
        let reply = crate::console::request(server.http, "PUT", path, &auth, body).await;
        assert_eq!(reply.status, 201, "{path}: {}", reply.body);
    }
    let mut c = Raw::open(server.addr, 65536).await;
    c.attach("q", 0, false, "goneq", 0).await;
    c.send_messages(0, 1).await;
    c.attach("t", 1, false, "gonet", 0).await;
    c.send_messages(1, 1).await;
    c.attach("r", 2, true, "gonet/subscriptions/s", 0).await;
    c.flow(2, 0, 1, false).await;
    let locked = c.transfers(1).await;
    let metrics = http_get(server.http, "/metrics").await;
    for entity in ["goneq", "gonet", "gonet/subscriptions/s"] {
        assert!(metrics.contains(&format!("entity=\"{entity}\"")), "{entity}: {metrics}");
    }
    for path in ["/goneq", "/gonet"] {
        let reply = crate::console::request(server.http, "DELETE", path, &auth, "").await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
    let metrics = http_get(server.http, "/metrics").await;
    assert!(metrics.contains("HTTP/1.1 200"), "{metrics}");
    assert!(!metrics.contains("gone"), "deleted entities are still counted: {metrics}");
    // The links to them are still attached: a send through one and the settlement of a
    // message received before are refused, and count nothing.
    let m = twice::Message::new("late").with_message_id("late");
    c.transfer(0, 1, &encode_message(&m), 65536).await;
    let settle = twice_servicebus::performative::Disposition {
        role: true,
        first: locked[0],
        last: None,
        settled: false,
        state: Some(twice_servicebus::performative::Outcome::Accepted.to_value()),
    };
    c.send(Performative::Disposition(settle), &[]).await;
    let mut answered = (false, false);
    while answered != (true, true) {
        match c.next().await.0 {
            Performative::Disposition(d) if d.role => answered.0 = true,
            Performative::Disposition(_) => answered.1 = true,
            Performative::Detach(_) => {}
            other => panic!("expected dispositions, got {other:?}"),
        }
    }
    let metrics = http_get(server.http, "/metrics").await;
    assert!(!metrics.contains("gone"), "a deleted entity came back: {metrics}");
}

#[tokio::test]
async fn entity_and_rule_caps_are_answered_as_quota_exceeded() {
    // The standard configuration holds 39 queues and topics; `topic1` has two subscriptions,
    // each with its `$Default` rule.
    let broker = twice_broker::Broker::open(
        twice_broker::BrokerOptions::in_memory()
            .config(crate::harness::standard_config())
            .max_entities(39)
            .max_subscriptions_per_topic(2)
            .max_rules_per_subscription(1),
    )
    .await
    .unwrap();
    let options = ServerOptions::new()
        .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
    let server = twice_servicebus::Server::bind(options, broker.clone()).await.unwrap();
    let (addr, http) = (server.amqp_addr(), server.http_addr().unwrap());
    tokio::spawn(server.run(std::future::pending()));

    let now = twice::SystemClock.now().as_millis();
    let expiry = std::time::UNIX_EPOCH
        + Duration::from_millis(u64::try_from(now).unwrap())
        + Duration::from_secs(600);
    let admin = token(&format!("https://localhost:{}/", http.port()), expiry);
    let auth = [("authorization", admin.as_str())];
    let ns = "http://schemas.microsoft.com/netservices/2010/10/servicebus/connect";
    for (path, kind) in [
        ("/one-too-many", "QueueDescription"),
        ("/topic1/subscriptions/s3", "SubscriptionDescription"),
    ] {
        let body = format!(
            "<entry xmlns='http://www.w3.org/2005/Atom'><content type='application/xml'><{kind} xmlns='{ns}'/></content></entry>"
        );
        let reply = crate::console::request(http, "PUT", path, &auth, &body).await;
        assert_eq!(reply.status, 403, "{path}: {}", reply.body);
        assert!(reply.body.contains("QuotaExceeded"), "{}", reply.body);
        assert!(reply.body.contains("its limit of"), "{}", reply.body);
    }
    assert!(broker.get_queue("one-too-many").await.is_err());

    // `$management` add-rule on a subscription that has as many rules as it may.
    let mut c = Raw::open(addr, 65536).await;
    c.attach("m", 0, false, "topic1/subscriptions/sub1/$management", 0).await;
    c.attach("r", 1, true, "topic1/subscriptions/sub1/$management", 0).await;
    c.flow(1, 0, 10, false).await;
    let description = Value::Map(vec![(
        Value::string("sql-filter"),
        Value::Map(vec![(Value::string("expression"), Value::string("color = 'red'"))]),
    )]);
    let body = Value::Map(vec![
        (Value::string("rule-name"), Value::string("reds")),
        (Value::string("rule-description"), description),
    ]);
    c.transfer(0, 0, &mgmt_request("com.microsoft:add-rule", body), 65536).await;
    let reply = loop {
        if let (Performative::Transfer(_), payload) = c.next().await {
            break twice_servicebus::mapping::Sections::parse(&payload).unwrap();
        }
    };
    let property = |name: &str| {
        reply
            .application_properties
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(property("statusCode").and_then(|v| v.as_i64()), Some(403));
    let condition = property("errorCondition");
    assert_eq!(condition.as_ref().and_then(|v| v.as_str()), Some("amqp:resource-limit-exceeded"));
    assert_eq!(broker.get_rules("topic1", "sub1").await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_transfer_on_a_handle_never_attached_ends_the_session() {
    let server = TestServer::start().await;
    let mut c = Raw::open(server.addr, 65536).await;
    let t = Transfer {
        handle: 7,
        delivery_id: Some(0),
        delivery_tag: Some(Bytes::from_static(b"t")),
        message_format: Some(0),
        ..Transfer::default()
    };
    c.send(Performative::Transfer(t), &encode_message(&twice::Message::new("x"))).await;
    assert_eq!(c.session_ended_with().await.as_deref(), Some("amqp:session:unattached-handle"));
    // The connection is still good: a new session works.
    c.begin(100).await;
}

#[tokio::test]
async fn frames_before_open_are_limited_to_512_bytes() {
    let server = TestServer::start().await;
    let mut c = Raw::connect(server.addr).await;
    let mut out = frame::SASL_HEADER.to_vec();
    // The right key, in a sasl-init padded past the 512 bytes allowed before `open`.
    let init = SaslInit {
        mechanism: "PLAIN".into(),
        initial_response: Some(Bytes::from_static(b"\0RootManageSharedAccessKey\0SAS_KEY_VALUE")),
        hostname: Some("h".repeat(600)),
    };
    frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
    assert!(out.len() > 8 + 512);
    c.writer.write_all(&out).await.unwrap();
    assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::SASL_HEADER);
    assert!(matches!(c.next().await.0, Performative::SaslMechanisms(_)));
    let next = tokio::time::timeout(crate::wire::TIMEOUT, c.reader.read_frame()).await.unwrap();
    assert!(next.is_err(), "the connection ends without an outcome: {next:?}");
}

#[tokio::test]
async fn a_decode_bomb_before_authentication_leaves_the_server_serving() {
    let server = TestServer::start().await;
    // A sasl-init whose initial response is an array of 4096 values, each described by an
    // array of 4096 values, each described by an array of 4096 nulls.
    let zero_width = {
        let mut b = vec![0xf0];
        b.extend_from_slice(&5u32.to_be_bytes());
        b.extend_from_slice(&4096u32.to_be_bytes());
        b.push(0x40);
        b
    };
    let described = |descriptor: &[u8]| {
        let mut b = vec![0xf0];
        b.extend_from_slice(&u32::try_from(6 + descriptor.len()).unwrap().to_be_bytes());
        b.extend_from_slice(&4096u32.to_be_bytes());
        b.push(0x00);
        b.extend_from_slice(descriptor);
        b.push(0x40);
        b
    };
    let bomb = described(&described(&zero_width));
    let mut fields = vec![0xa3, 5];
    fields.extend_from_slice(b"PLAIN");
    fields.extend_from_slice(&bomb);
    let mut body = vec![0x00, 0x53, 0x41, 0xc0, u8::try_from(fields.len() + 1).unwrap(), 2];
    body.extend_from_slice(&fields);
    let mut out = frame::SASL_HEADER.to_vec();
    out.extend_from_slice(&u32::try_from(8 + body.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&[2, frame::TYPE_SASL, 0, 0]);
    out.extend_from_slice(&body);
    let mut c = Raw::connect(server.addr).await;
    c.writer.write_all(&out).await.unwrap();
    assert_eq!(c.reader.read_protocol_header().await.unwrap(), frame::SASL_HEADER);
    assert!(matches!(c.next().await.0, Performative::SaslMechanisms(_)));
    let next = tokio::time::timeout(crate::wire::TIMEOUT, c.reader.read_frame()).await.unwrap();
    assert!(next.is_err(), "the bomb ends its connection: {next:?}");
    // Others are served as before.
    let mut good = Raw::open(server.addr, 65536).await;
    good.attach("s", 0, false, "q1", 0).await;
}

#[tokio::test]
async fn half_open_connections_do_not_lock_out_real_clients() {
    let server = TestServer::start_with(ServerOptions::new().max_connections(2), None).await;
    // Sockets that complete the protocol header and never send `open`.
    let mut idle = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        s.write_all(&frame::AMQP_HEADER).await.unwrap();
        let mut header = [0u8; 8];
        s.read_exact(&mut header).await.unwrap();
        idle.push(s);
    }
    // A real client still gets in.
    let mut c = Raw::open(server.addr, 65536).await;
    c.attach("s", 0, false, "q1", 0).await;
    drop(idle);
}

/// More idle sockets in their handshake than the server keeps (256): each new connection
/// evicts the oldest, so a real client still gets in.
#[tokio::test]
async fn idle_sockets_beyond_the_handshake_places_do_not_lock_out_a_real_client() {
    let server = TestServer::start().await;
    let mut idle = Vec::new();
    let mut answered = 0;
    for _ in 0..300 {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        // The header is answered once the server has taken the connection in; then it waits
        // for `open`, which never comes.
        s.write_all(&frame::AMQP_HEADER).await.unwrap();
        let mut header = [0u8; 8];
        if s.read_exact(&mut header).await.is_ok() {
            answered += 1;
        }
        idle.push(s);
    }
    assert_eq!(answered, 300, "each was taken in, evicting the oldest");
    let mut c = Raw::open(server.addr, 65536).await;
    c.attach("s", 0, false, "q1", 0).await;
    drop(idle);
}

#[tokio::test]
async fn a_client_that_never_sends_open_is_disconnected() {
    let options = ServerOptions::new().handshake_timeout(Duration::from_millis(200));
    let server = TestServer::start_with(options, None).await;
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&frame::AMQP_HEADER).await.unwrap();
    let mut header = [0u8; 8];
    s.read_exact(&mut header).await.unwrap();
    assert_eq!(header, frame::AMQP_HEADER);
    // The server ends the connection; nothing else comes.
    let mut rest = Vec::new();
    let n = tokio::time::timeout(crate::wire::TIMEOUT, s.read_to_end(&mut rest))
        .await
        .expect("disconnected in time")
        .unwrap_or(0);
    assert_eq!(n, 0, "nothing but the end: {rest:?}");
}

#[tokio::test]
async fn a_disposition_over_a_huge_range_settles_what_is_in_it() {
    let server = TestServer::start().await;
    let (mut c, ids) = Raw::with_deliveries(server.addr, "q7", 3).await;
    // One disposition for half the id space: only the three deliveries in it are work.
    let all = twice_servicebus::performative::Disposition {
        role: true,
        first: ids[0],
        last: Some(ids[0].wrapping_add(u32::MAX / 2)),
        settled: false,
        state: Some(twice_servicebus::performative::Outcome::Accepted.to_value()),
    };
    c.send(Performative::Disposition(all), &[]).await;
    let mut echoed = Vec::new();
    while echoed.len() < 3 {
        let Performative::Disposition(d) = c.next().await.0 else { panic!("expected echoes") };
        echoed.extend(d.first..=d.last.unwrap_or(d.first));
    }
    assert_eq!(echoed, ids);
    assert_eq!(server.broker.counts("q7").await.unwrap().active, 0);
}

#[tokio::test]
async fn begins_beyond_the_session_limit_close_the_connection_and_cost_little() {
    let server = TestServer::start().await;
    let s = TcpStream::connect(server.addr).await.unwrap();
    let (r, mut w) = s.into_split();
    let mut c_reader = FrameReader::new(r, 16 * 1024 * 1024);
    let mut out = frame::AMQP_HEADER.to_vec();
    let open = Open {
        container_id: "many".into(),
        max_frame_size: 65536,
        channel_max: u16::MAX,
        ..Open::default()
    };
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    for ch in 0..u16::MAX {
        let begin = Begin {
            next_outgoing_id: 0,
            incoming_window: 10,
            outgoing_window: 10,
            ..Begin::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, ch, &Performative::Begin(begin), &[]);
    }
    // The server may stop reading before all of it is written.
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&out).await;
        w
    });
    assert_eq!(c_reader.read_protocol_header().await.unwrap(), frame::AMQP_HEADER);
    let mut begun = 0usize;
    let closed = loop {
        let f = tokio::time::timeout(crate::wire::TIMEOUT, c_reader.read_frame())
            .await
            .expect("the server keeps answering")
            .expect("a frame");
        if f.body.is_empty() {
            continue;
        }
        match Performative::decode(&f.body).unwrap().0 {
            Performative::Begin(_) => begun += 1,
            Performative::Close(e) => break e.map(|e| e.condition),
            Performative::Open(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(begun, ServerOptions::new().get_max_sessions_per_connection());
    assert_eq!(closed.as_deref(), Some("amqp:connection:framing-error"));
    drop(writer.await);
    // Others are served as before.
    let mut good = Raw::open(server.addr, 65536).await;
    good.attach("s", 0, false, "q1", 0).await;
}

#[tokio::test]
async fn an_attach_beyond_handle_max_closes_the_connection() {
    let server = TestServer::start_with(ServerOptions::new().max_links_per_session(4), None).await;
    let mut c = Raw::open(server.addr, 65536).await;
    let terminus = |code, addr: &str| described_list(code, vec![Value::string(addr)]);
    let mut out = Vec::new();
    for handle in 0..4000 {
        let a = Attach {
            name: format!("l{handle}"),
            handle,
            role: false,
            source: Some(terminus(0x28, "me")),
            target: Some(terminus(0x29, "q1")),
            initial_delivery_count: Some(0),
            ..Attach::default()
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Attach(a), &[]);
    }
    // The server may stop reading before all of it is written.
    let _ = c.writer.write_all(&out).await;
    let mut attached = 0;
    let closed = loop {
        match c.next().await.0 {
            Performative::Attach(_) => attached += 1,
            Performative::Close(e) => break e.map(|e| e.condition),
            _ => {}
        }
    };
    // Handles 0 to 3 (handle-max 3) may be answered before the close; no more.
    assert!(attached <= 4, "{attached} attaches answered");
    assert_eq!(closed.as_deref(), Some("amqp:connection:framing-error"));
}

#[tokio::test]
async fn a_sender_gets_credit_back_only_as_its_sends_are_stored() {
    let broker = twice_broker::Broker::open(
        twice_broker::BrokerOptions::in_memory().config(crate::harness::standard_config()),
    )
    .await
    .unwrap();
    let (gate, closed) = tokio::sync::watch::channel(false);
    let backend = crate::gated::Gated { inner: broker.clone(), gate: closed };
    let options =
        ServerOptions::new().amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0))).http_addr(None);
    let server = twice_servicebus::Server::bind(options, backend).await.unwrap();
    let addr = server.amqp_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));

    let mut c = Raw::open(addr, 65536).await;
    c.attach("send", 0, false, "q8", 0).await;
    // The 1000 credits of the attach, and one transfer more, while nothing can be stored.
    let mut out = Vec::new();
    for id in 0..1001u32 {
        let t = Transfer {
            handle: 0,
            delivery_id: Some(id),
            delivery_tag: Some(Bytes::from(id.to_be_bytes().to_vec())),
            message_format: Some(0),
            ..Transfer::default()
        };
        let m = encode_message(&twice::Message::new("m").with_message_id(id.to_string()));
        frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Transfer(t), &m);
    }
    c.writer.write_all(&out).await.unwrap();
    let detached = loop {
        match c.next().await.0 {
            Performative::Detach(d) => break d.error.map(|e| e.condition),
            Performative::Flow(f) => {
                assert!(f.link_credit.is_none(), "no credit while nothing is stored: {f:?}")
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(detached.as_deref(), Some("amqp:link:transfer-limit-exceeded"));
    // Once the broker stores them, the 1000 within the credit are accepted.
    gate.send(true).unwrap();
    let mut accepted = 0;
    while accepted < 1000 {
        if let Performative::Disposition(d) = c.next().await.0 {
            accepted += d.last.unwrap_or(d.first) - d.first + 1;
        }
    }
    assert_eq!(broker.counts("q8").await.unwrap().active, 1000);
    let _ = stop.send(());
    let _ = running.await;
}

/// The server's count of open AMQP connections, from `/metrics`.
async fn open_connections(http: SocketAddr) -> u64 {
    let metrics = http_get(http, "/metrics").await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("twice_servicebus_connections "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the connections gauge")
}

#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected() {
    let options = ServerOptions::new().write_timeout(Duration::from_millis(200));
    let server = TestServer::start_with(options, None).await;
    for i in 0..100 {
        let m = twice::Message::new(vec![b'x'; 250_000]).with_message_id(format!("big{i}"));
        server.broker.send("q9", m).await.unwrap();
    }
    let mut c = Raw::open(server.addr, 65536).await;
    c.attach("recv", 0, true, "q9", 0).await;
    assert_eq!(open_connections(server.http).await, 1);
    // Credit for 25 MB, more than the socket buffers hold, and the client never reads again.
    c.flow(0, 0, 100, false).await;
    let mut open = 1;
    for _ in 0..100 {
        open = open_connections(server.http).await;
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open, 0, "the server gave up on the client");
    drop(c);
}

impl Raw {
    /// Puts a token to `$cbs` on links 0 (requests) and 1 (replies); returns the status code.
    pub(crate) async fn put_token(&mut self, token: &str) -> i32 {
        assert_eq!(self.try_attach("cbs-requests", 0, false, "$cbs").await, None);
        let a = Attach {
            name: "cbs-replies".into(),
            handle: 1,
            role: true,
            source: Some(described_list(0x28, vec![Value::string("$cbs")])),
            target: Some(described_list(0x29, vec![Value::string("me")])),
            ..Attach::default()
        };
        self.send(Performative::Attach(a), &[]).await;
        assert!(matches!(self.next().await.0, Performative::Attach(_)));
        self.flow(1, 0, 10, false).await;
        self.transfer(0, 0, &mgmt_request("put-token", Value::string(token)), 65536).await;
        loop {
            let (p, payload) = self.next().await;
            if let Performative::Transfer(_) = p {
                let reply = twice_servicebus::mapping::Sections::parse(&payload).unwrap();
                let status = reply
                    .application_properties
                    .iter()
                    .find(|(k, _)| k.as_str() == Some("status-code"))
                    .and_then(|(_, v)| v.as_i64())
                    .expect("a status code");
                return i32::try_from(status).unwrap();
            }
        }
    }
}

/// A token for `resource` signed with the server's default key, valid until `expiry`.
fn token(resource: &str, expiry: std::time::SystemTime) -> String {
    let secs = expiry.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    twice_servicebus::sas::sign(
        resource,
        "RootManageSharedAccessKey",
        "SAS_KEY_VALUE",
        i64::try_from(secs).unwrap(),
    )
}

#[tokio::test]
async fn an_expired_token_no_longer_authorizes_its_links() {
    let server = TestServer::start().await;
    let now = std::time::SystemTime::UNIX_EPOCH
        + Duration::from_millis(u64::try_from(server.clock.now().as_millis()).unwrap());
    let mut c = Raw::anonymous(server.addr).await;
    let status = c.put_token(&token("sb://localhost/q10", now + Duration::from_secs(60))).await;
    assert_eq!(status, 202);
    assert_eq!(c.try_attach("s", 2, false, "q10").await, None, "authorized while the token holds");
    c.send_messages(2, 1).await;
    // The token expires and is not renewed.
    server.clock.advance(Duration::from_secs(120));
    let m = encode_message(&twice::Message::new("late").with_message_id("late"));
    c.transfer(2, 1, &m, 65536).await;
    let error = loop {
        if let Performative::Detach(d) = c.next().await.0 {
            break d.error.map(|e| e.condition);
        }
    };
    assert_eq!(error.as_deref(), Some("amqp:unauthorized-access"));
    assert_eq!(server.broker.counts("q10").await.unwrap().active, 1, "only the first send");
}

#[tokio::test]
async fn a_token_for_another_host_is_refused() {
    let server = TestServer::start().await;
    let now = std::time::SystemTime::UNIX_EPOCH
        + Duration::from_millis(u64::try_from(server.clock.now().as_millis()).unwrap());
    let mut c = Raw::anonymous(server.addr).await;
    let forged = token("sb://another-namespace.example.com/q11", now + Duration::from_secs(600));
    assert_eq!(c.put_token(&forged).await, 401);
    let refused = c.try_attach("s", 2, false, "q11").await;
    assert_eq!(refused.as_deref(), Some("amqp:unauthorized-access"));
}

#[tokio::test]
async fn a_token_whose_authority_hides_another_host_is_refused() {
    // `sb://localhost:1@evil.example/`: the host is `evil.example`, `localhost:1` is userinfo.
    let server = TestServer::start().await;
    let now = std::time::SystemTime::UNIX_EPOCH
        + Duration::from_millis(u64::try_from(server.clock.now().as_millis()).unwrap());
    let expiry = now + Duration::from_secs(600);
    let mut c = Raw::anonymous(server.addr).await;
    for audience in [
        "sb://localhost:1@evil.example/q11",
        "sb://localhost%2eevil.example/q11",
        "sb://evil.example#@localhost/q11",
        "ftp://localhost/q11",
    ] {
        assert_eq!(c.put_token(&token(audience, expiry)).await, 401, "{audience}");
    }
    let refused = c.try_attach("s", 2, false, "q11").await;
    assert_eq!(refused.as_deref(), Some("amqp:unauthorized-access"));
    // The administration API: the same audience over HTTP.
    let forged = token("https://localhost:1@evil.example/", expiry);
    let reply =
        crate::console::request(server.http, "GET", "/q11", &[("authorization", &forged)], "")
            .await;
    assert_eq!(reply.status, 401, "{}", reply.body);
    // The same server takes an honest token for itself.
    let honest = token("sb://localhost/q11", expiry);
    assert_eq!(c.put_token(&honest).await, 202);
    let honest = token(&format!("https://localhost:{}/", server.http.port()), expiry);
    let reply =
        crate::console::request(server.http, "GET", "/q11", &[("authorization", &honest)], "")
            .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}

#[tokio::test]
async fn a_key_with_only_the_send_claim_cannot_receive_or_manage() {
    let mut keys = twice_servicebus::sas::Keys::emulator_default();
    let send_only = twice_servicebus::sas::Claims::parse("Send").unwrap();
    keys.insert_with_claims("sender", "sender-key", send_only);
    let server = TestServer::start_with(ServerOptions::new().keys(keys), None).await;
    server.broker.send("q14", twice::Message::new("kept").with_message_id("k")).await.unwrap();
    let now = server.clock.now().as_millis() / 1000;
    let token =
        twice_servicebus::sas::sign("sb://localhost/q14", "sender", "sender-key", now + 600);
    let mut c = Raw::anonymous(server.addr).await;
    assert_eq!(c.put_token(&token).await, 202);
    assert_eq!(c.try_attach("s", 2, false, "q14").await, None, "sending is allowed");
    let refused = c.try_attach("r", 3, true, "q14").await;
    assert_eq!(refused.as_deref(), Some("amqp:unauthorized-access"), "receiving is not");
    assert_eq!(server.broker.counts("q14").await.unwrap().active, 1);
}

/// Sends `count` messages of 250 KB on a new sender link to `q10` of a server whose broker
/// stores nothing until `gate` opens; returns whether all of them were written to the socket
/// within `wait`, and the client (with its writes done, once the gate is open).
async fn flood_a_closed_gate(
    max_bytes_in_flight: usize,
    count: u32,
    wait: Duration,
) -> (bool, twice_broker::Broker, tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<Raw>) {
    let broker = twice_broker::Broker::open(
        twice_broker::BrokerOptions::in_memory().config(crate::harness::standard_config()),
    )
    .await
    .unwrap();
    let (gate, closed) = tokio::sync::watch::channel(false);
    let backend = crate::gated::Gated { inner: broker.clone(), gate: closed };
    let options = ServerOptions::new()
        .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(None)
        .max_bytes_in_flight(max_bytes_in_flight);
    let server = twice_servicebus::Server::bind(options, backend).await.unwrap();
    let addr = server.amqp_addr();
    tokio::spawn(server.run(std::future::pending()));
    let mut c = Raw::open(addr, 65536).await;
    c.attach("send", 0, false, "q10", 0).await;
    let writing = tokio::spawn(async move {
        for id in 0..count {
            let m = twice::Message::new(vec![b'x'; 250_000]).with_message_id(id.to_string());
            c.transfer(0, id, &encode_message(&m), 60_000).await;
        }
        c
    });
    let done = tokio::time::timeout(wait, async {
        while !writing.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok();
    (done, broker, gate, writing)
}

#[tokio::test]
async fn a_connection_stops_reading_once_its_bytes_in_flight_pass_the_bound() {
    // 64 MB of sends, far more than the loopback socket buffers hold, while the broker stores
    // nothing: the server stops reading past 1 MiB, so the client cannot write them all.
    let (done, broker, gate, writing) =
        flood_a_closed_gate(1 << 20, 256, Duration::from_secs(2)).await;
    assert!(!done, "the server kept reading past its bound of bytes in flight");
    // Once the broker stores again, reading resumes and every send is accepted.
    gate.send(true).unwrap();
    let mut c = tokio::time::timeout(Duration::from_secs(60), writing).await.unwrap().unwrap();
    let mut accepted = 0;
    while accepted < 256 {
        if let Performative::Disposition(d) = c.next().await.0 {
            accepted += d.last.unwrap_or(d.first) - d.first + 1;
        }
    }
    assert_eq!(broker.counts("q10").await.unwrap().active, 256);

    // The same flood with no bound is read whole into memory: what the bound prevents.
    let (done, _broker, _gate, _writing) =
        flood_a_closed_gate(usize::MAX, 256, Duration::from_secs(30)).await;
    assert!(done, "without a bound the server reads everything while nothing is stored");
}
