//! No credential reaches the logs, even at the most detailed level: SASL PLAIN passwords (right
//! and wrong) and the shared access signatures the SDKs put to `$cbs`.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use azservicebus::authorization::AzureNamedKeyCredential;
use azservicebus::{ServiceBusClient, ServiceBusClientOptions, ServiceBusMessage};
use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use twice_servicebus::ServerOptions;
use twice_servicebus::frame::{self, FrameReader};
use twice_servicebus::performative::{Performative, SaslInit};
use twice_servicebus::sas::Keys;

use crate::harness::{TestServer, latency_proxy};
use crate::rust_sdk::on_sdk_runtime;

const KEY_NAME: &str = "app";
const SECRET: &str = "Zm9vYmFyLXNlY3JldC1rZXktdmFsdWU9";
const WRONG_SECRET: &str = "d3Jvbmctc2VjcmV0LWtleS12YWx1ZT0=";

/// Everything the server's threads log, at every level.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// SASL PLAIN with `password`; whether the server accepted it.
async fn sasl_plain(addr: std::net::SocketAddr, password: &str) -> bool {
    let s = TcpStream::connect(addr).await.unwrap();
    let (r, mut w) = s.into_split();
    let mut reader = FrameReader::new(r, 1 << 20);
    let mut out = frame::SASL_HEADER.to_vec();
    let init = SaslInit {
        mechanism: "PLAIN".into(),
        initial_response: Some(Bytes::from(format!("\0{KEY_NAME}\0{password}"))),
        hostname: None,
    };
    frame::write_frame(&mut out, frame::TYPE_SASL, 0, &Performative::SaslInit(init), &[]);
    w.write_all(&out).await.unwrap();
    assert_eq!(reader.read_protocol_header().await.unwrap(), frame::SASL_HEADER);
    loop {
        let f = reader.read_frame().await.unwrap();
        match Performative::decode(&f.body).unwrap().0 {
            Performative::SaslOutcome(code) => return code == 0,
            _ => continue,
        }
    }
}

/// Set in the process that runs the test below alone.
const ALONE: &str = "TWICE_LOGS_TEST_ALONE";

#[test]
fn no_credential_appears_in_the_logs_even_at_trace_level() {
    // The test runs in a process of its own: which callsites a subscriber sees is decided
    // process-wide, and a callsite that another test's thread registers while the capture's
    // dispatcher is being set up can stay silenced for it (the log then misses a line).
    if std::env::var_os(ALONE).is_none() {
        let name = "logs::no_credential_appears_in_the_logs_even_at_trace_level";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(ALONE, "1")
            .output()
            .expect("running the test in a process of its own");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "the test did not run:\n{text}");
        return;
    }
    let captured = Captured::default();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer({
                let c = captured.clone();
                move || c.clone()
            })
            .finish(),
    );
    // Every thread of the server's runtime logs to the capture (and nothing else does).
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_start({
            let dispatch = dispatch.clone();
            move || std::mem::forget(tracing::dispatcher::set_default(&dispatch))
        })
        .build()
        .unwrap();
    let mut keys = Keys::new();
    keys.insert(KEY_NAME, SECRET);
    let server = server_rt.block_on(async {
        tokio::spawn(TestServer::start_with(ServerOptions::new().keys(keys), None)).await.unwrap()
    });
    let addr = server.addr;
    let port = server_rt.block_on(async {
        tokio::spawn(latency_proxy(addr, Duration::from_millis(1))).await.unwrap()
    });

    // Other tests of this binary may have been registering the server's callsites while the
    // capture's dispatcher was being created; one registered in that instant keeps the interest
    // of a process without a subscriber (`never`). Recompute every callsite's interest now that
    // the dispatcher has long been in place.
    tracing::callsite::rebuild_interest_cache();

    // SASL PLAIN, right and wrong.
    let client_rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    assert!(client_rt.block_on(sasl_plain(addr, SECRET)), "the right password is accepted");
    assert!(!client_rt.block_on(sasl_plain(addr, WRONG_SECRET)), "a wrong one is refused");

    // The Rust SDK: a token signed with the key put to `$cbs`, then a send and a receive.
    let body = on_sdk_runtime(async move {
        let mut client = ServiceBusClient::unsecured()
            .new_from_named_key_credential(
                format!("localhost:{port}"),
                AzureNamedKeyCredential::new(KEY_NAME, SECRET),
                ServiceBusClientOptions::default(),
            )
            .await
            .expect("connect");
        let mut sender = client.create_sender("q18", Default::default()).await.unwrap();
        sender.send_message(ServiceBusMessage::new("logged?")).await.unwrap();
        let mut receiver =
            client.create_receiver_for_queue("q18", Default::default()).await.unwrap();
        let m = receiver
            .receive_message_with_max_wait_time(Some(Duration::from_secs(5)))
            .await
            .unwrap()
            .expect("a message");
        receiver.complete_message(&m).await.unwrap();
        m.body().unwrap().to_vec()
    });
    assert_eq!(body, b"logged?");
    server_rt.block_on(server.stop());
    server_rt.shutdown_timeout(Duration::from_secs(1));

    let log = captured.text();
    // The capture really saw the traffic, frame by frame.
    assert!(log.contains("sasl authentication failed"), "the refused login is logged");
    assert!(log.contains("Attach"), "frames are traced:\n{log}");
    for secret in [SECRET, WRONG_SECRET, "SharedAccessSignature", "sig="] {
        assert!(!log.contains(secret), "the log holds {secret:?}:\n{log}");
    }
}
