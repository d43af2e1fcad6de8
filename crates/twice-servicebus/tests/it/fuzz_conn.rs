//! A structure-aware fuzzer over the whole connection state machine: random sequences of
//! protocol headers, SASL, `open`, `begin`, `attach`, `flow`, `transfer`, `disposition`,
//! `detach`, `end` and `close` (with and without a token, well-formed or cut short), each sent
//! on a fresh connection to one running server.
//!
//! It checks that no server task panics, that the server keeps serving, that no message reaches
//! an entity the client had no token for, and it bounds the process's peak memory. A bounded run
//! is part of every test run; `TWICE_FUZZ_CASES` and `TWICE_FUZZ_SECS` make it longer (see
//! SECURITY.md).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use twice::Clock as _;
use twice_servicebus::codec::Value;
use twice_servicebus::frame;
use twice_servicebus::mapping::encode_message;
use twice_servicebus::performative::{
    Attach, Begin, Detach, Disposition, Flow, Open, Outcome, Performative, SaslInit, Transfer,
    described_list,
};

use crate::harness::TestServer;

/// The entity no generated client ever holds a token for.
const GUARDED: &str = "q12";
/// The entity the generated tokens name.
const TOKEN_ENTITY: &str = "q13";

/// One step of a generated client.
#[derive(Clone, Debug)]
enum Op {
    Begin { ch: u16 },
    End { ch: u16 },
    Attach { ch: u16, handle: u32, receiver: bool, address: usize },
    Flow { ch: u16, handle: Option<u32>, credit: u32, drain: bool, window: u32 },
    Transfer { ch: u16, handle: u32, id: u32, more: bool, settled: bool, payload: usize },
    Disposition { ch: u16, first: u32, last: Option<u32>, outcome: usize },
    Detach { ch: u16, handle: u32 },
    PutToken { ch: u16 },
    Garbage(Vec<u8>),
    Close,
}

/// How the generated client starts.
#[derive(Clone, Debug)]
enum Start {
    /// SASL ANONYMOUS, then AMQP.
    Anonymous,
    /// SASL PLAIN with a wrong password.
    WrongPassword,
    /// AMQP without SASL.
    Plain,
    /// Bytes that are not a protocol header.
    Junk(Vec<u8>),
}

const ADDRESSES: [&str; 6] =
    [GUARDED, "q12/$management", "$cbs", TOKEN_ENTITY, "q13/$management", "madeup"];

fn op() -> impl Strategy<Value = Op> {
    // Few channels and handles, so that generated frames often meet the sessions and links
    // generated before them.
    let ch = 0u16..2;
    let handle = 0u32..2;
    prop_oneof![
        2 => ch.clone().prop_map(|ch| Op::Begin { ch }),
        1 => ch.clone().prop_map(|ch| Op::End { ch }),
        4 => (ch.clone(), handle.clone(), any::<bool>(), 0..ADDRESSES.len())
            .prop_map(|(ch, handle, receiver, address)| Op::Attach { ch, handle, receiver, address }),
        2 => (ch.clone(), prop::option::of(handle.clone()), 0u32..2000, any::<bool>(), 0u32..10_000)
            .prop_map(|(ch, handle, credit, drain, window)| Op::Flow { ch, handle, credit, drain, window }),
        6 => (ch.clone(), handle.clone(), 0u32..8, prop::bool::weighted(0.2), any::<bool>(), prop_oneof![3 => Just(0usize), 1 => 1usize..4])
            .prop_map(|(ch, handle, id, more, settled, payload)| Op::Transfer { ch, handle, id, more, settled, payload }),
        2 => (ch.clone(), any::<u32>(), prop::option::of(any::<u32>()), 0usize..4)
            .prop_map(|(ch, first, last, outcome)| Op::Disposition { ch, first, last, outcome }),
        1 => (ch.clone(), handle).prop_map(|(ch, handle)| Op::Detach { ch, handle }),
        1 => ch.prop_map(|ch| Op::PutToken { ch }),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Op::Garbage),
        1 => Just(Op::Close),
        2 => Just(Op::Begin { ch: 0 }),
    ]
}

fn start() -> impl Strategy<Value = Start> {
    prop_oneof![
        6 => Just(Start::Anonymous),
        1 => Just(Start::WrongPassword),
        2 => Just(Start::Plain),
        1 => prop::collection::vec(any::<u8>(), 0..16).prop_map(Start::Junk),
    ]
}

/// The bytes of one generated client; `token` is a valid token for [`TOKEN_ENTITY`].
fn encode(start: &Start, ops: &[Op], token: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let sasl = |out: &mut Vec<u8>, init: SaslInit| {
        out.extend_from_slice(&frame::SASL_HEADER);
        frame::write_frame(out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
    };
    match start {
        Start::Anonymous => sasl(
            &mut out,
            SaslInit { mechanism: "ANONYMOUS".into(), initial_response: None, hostname: None },
        ),
        Start::WrongPassword => sasl(
            &mut out,
            SaslInit {
                mechanism: "PLAIN".into(),
                initial_response: Some(Bytes::from_static(b"\0RootManageSharedAccessKey\0wrong")),
                hostname: None,
            },
        ),
        Start::Plain => {}
        Start::Junk(bytes) => {
            out.extend_from_slice(bytes);
            return out;
        }
    }
    out.extend_from_slice(&frame::AMQP_HEADER);
    let open = Open {
        container_id: "fuzz".into(),
        max_frame_size: 65536,
        channel_max: 8,
        ..Open::default()
    };
    frame::write_frame(&mut out, frame::TYPE_AMQP, 0, &Performative::Open(open), &[]);
    let message = encode_message(&twice::Message::new("fuzz").with_message_id("f"));
    let schedule = crate::hostile::mgmt_request(
        "com.microsoft:schedule-message",
        Value::Map(vec![(Value::string("messages"), Value::List(vec![]))]),
    );
    for op in ops {
        let (ch, p, payload): (u16, Performative, Vec<u8>) = match op.clone() {
            Op::Begin { ch } => (
                ch,
                Performative::Begin(Begin {
                    next_outgoing_id: 0,
                    incoming_window: 100,
                    outgoing_window: 100,
                    ..Begin::default()
                }),
                vec![],
            ),
            Op::End { ch } => (ch, Performative::End(None), vec![]),
            Op::Attach { ch, handle, receiver, address } => {
                let t = |code, a: &str| described_list(code, vec![Value::string(a)]);
                let (source, target) = if receiver {
                    (t(0x28, ADDRESSES[address]), t(0x29, "me"))
                } else {
                    (t(0x28, "me"), t(0x29, ADDRESSES[address]))
                };
                let a = Attach {
                    name: format!("l{handle}"),
                    handle,
                    role: receiver,
                    source: Some(source),
                    target: Some(target),
                    initial_delivery_count: (!receiver).then_some(0),
                    ..Attach::default()
                };
                (ch, Performative::Attach(a), vec![])
            }
            Op::Flow { ch, handle, credit, drain, window } => {
                let f = Flow {
                    next_incoming_id: Some(0),
                    incoming_window: window,
                    next_outgoing_id: 0,
                    outgoing_window: 100,
                    handle,
                    delivery_count: handle.map(|_| 0),
                    link_credit: handle.map(|_| credit),
                    drain,
                    ..Flow::default()
                };
                (ch, Performative::Flow(f), vec![])
            }
            Op::Transfer { ch, handle, id, more, settled, payload } => {
                let body = match payload {
                    0 => message.clone(),
                    1 => schedule.clone(),
                    2 => crate::hostile::mgmt_request("put-token", Value::string(token)),
                    _ => message[..message.len() / 2].to_vec(),
                };
                let t = Transfer {
                    handle,
                    delivery_id: Some(id),
                    delivery_tag: Some(Bytes::from(id.to_be_bytes().to_vec())),
                    message_format: Some(0),
                    settled: Some(settled),
                    more,
                    ..Transfer::default()
                };
                (ch, Performative::Transfer(t), body)
            }
            Op::Disposition { ch, first, last, outcome } => {
                let state =
                    [Outcome::Accepted, Outcome::Released, Outcome::Rejected(None), Outcome::Other]
                        [outcome]
                        .clone();
                let d = Disposition {
                    role: true,
                    first,
                    last,
                    settled: false,
                    state: Some(state.to_value()),
                };
                (ch, Performative::Disposition(d), vec![])
            }
            Op::Detach { ch, handle } => {
                (ch, Performative::Detach(Detach { handle, closed: true, error: None }), vec![])
            }
            Op::PutToken { ch } => {
                let t = Transfer {
                    handle: 0,
                    delivery_id: Some(0),
                    delivery_tag: Some(Bytes::from_static(b"t")),
                    message_format: Some(0),
                    ..Transfer::default()
                };
                (
                    ch,
                    Performative::Transfer(t),
                    crate::hostile::mgmt_request("put-token", Value::string(token)),
                )
            }
            Op::Garbage(bytes) => {
                out.extend_from_slice(&bytes);
                continue;
            }
            Op::Close => (0, Performative::Close(None), vec![]),
        };
        frame::write_frame(&mut out, frame::TYPE_AMQP, ch, &p, &payload);
    }
    out
}

/// Sends one generated client's bytes and reads what comes back until the server closes or
/// falls quiet; returns the bytes sent.
async fn run_client(addr: SocketAddr, bytes: Vec<u8>) -> usize {
    let n = bytes.len();
    let Ok(s) = TcpStream::connect(addr).await else { return n };
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&bytes).await;
        w
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(Duration::from_millis(100), r.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => break,
            Ok(Ok(_)) => {}
        }
    }
    drop(writer.await);
    n
}

/// The process's peak resident memory, in KiB (Linux).
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn random_clients_never_crash_the_server_nor_reach_a_guarded_entity() {
    let cases = u32::try_from(env_number("TWICE_FUZZ_CASES", 800)).unwrap_or(u32::MAX);
    let budget = Duration::from_secs(env_number("TWICE_FUZZ_SECS", 60));
    // The server runs on threads of its own, so a panic in any of its tasks is seen here.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fuzzed-server")
        .enable_all()
        .build()
        .unwrap();
    let panics = Arc::new(AtomicUsize::new(0));
    let previous = std::panic::take_hook();
    {
        let panics = panics.clone();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("fuzzed-server") {
                panics.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    }
    let server = server_rt.block_on(async { tokio::spawn(TestServer::start()).await.unwrap() });
    let addr = server.addr;
    let expiry = server.clock.now().as_millis() / 1000 + 3600;
    let token = twice_servicebus::sas::sign(
        &format!("sb://localhost/{TOKEN_ENTITY}"),
        "RootManageSharedAccessKey",
        "SAS_KEY_VALUE",
        expiry,
    );
    let client_rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let started = twice::clock::Stopwatch::start();
    let sent = std::cell::Cell::new(0usize);
    let ran = std::cell::Cell::new(0u32);
    let mut runner =
        TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let strategy = (start(), prop::collection::vec(op(), 0..40));
    let result = runner.run(&strategy, |(start, ops)| {
        if started.elapsed() > budget {
            // The time bound of this run: the remaining cases pass untried.
            return Ok(());
        }
        ran.set(ran.get() + 1);
        let bytes = encode(&start, &ops, &token);
        sent.set(sent.get() + client_rt.block_on(run_client(addr, bytes)));
        let guarded =
            server_rt.block_on(async { server.broker.counts(GUARDED).await.unwrap() }).active;
        prop_assert_eq!(guarded, 0, "a message reached {} without a token", GUARDED);
        prop_assert_eq!(panics.load(Ordering::SeqCst), 0, "a server task panicked");
        Ok(())
    });
    let _ = std::panic::take_hook();
    result.unwrap();
    // The server still serves a well-behaved client.
    let alive = client_rt.block_on(async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&frame::AMQP_HEADER).await.unwrap();
        let mut h = [0u8; 8];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut h)).await.is_ok()
    });
    assert!(alive, "the server answers after the run");
    let peak = peak_rss_kib().unwrap_or(0);
    println!(
        "fuzzed {} clients, {} bytes, in {} ms; peak resident memory {peak} KiB",
        ran.get(),
        sent.get(),
        started.elapsed().as_millis()
    );
    // A decode bomb or an unbounded buffer would take gigabytes; the whole test binary stays
    // far below one.
    assert!(peak < 1024 * 1024, "peak resident memory {peak} KiB");
    drop(server);
    server_rt.shutdown_timeout(Duration::from_secs(1));
}
