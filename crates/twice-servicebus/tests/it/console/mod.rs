//! The web console: its JSON API over plain HTTP (who may read and change what, which
//! parameters it takes), and the page in a real headless Chromium.

mod browser;
mod webdriver;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value as Json, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use twice::{Clock, Message, ReceivedMessage, SequenceNumber, SessionId, SystemClock};
use twice_broker::Broker;
use twice_servicebus::sas::{Claims, Keys};
use twice_servicebus::{
    Backend, BackendError, BackendSession, ReceiveMode, ServerOptions, Settlement,
};

use crate::harness::TestServer;

/// An HTTP response: status code, headers (lowercase names) and body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Json {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The `code` of a JSON error body.
    fn code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap_or("").to_owned()
    }
}

/// One request to the server's HTTP port, with `Host: 127.0.0.1:<port>` unless `headers`
/// names another.
pub async fn request(
    http: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut head = format!("{method} {target} HTTP/1.1\r\ncontent-length: {}\r\n", body.len());
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("host: 127.0.0.1:{}\r\n", http.port()));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    let mut s = tokio::net::TcpStream::connect(http).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply { status, headers, body: body.to_owned() }
}

/// A token for the whole namespace signed with `key` under `name`, as the page signs one
/// (the test servers' clocks start at the real time).
pub fn token(http: SocketAddr, name: &str, key: &str) -> String {
    let expiry = SystemClock.now().as_millis() / 1000 + 600;
    let resource = format!("http://127.0.0.1:{}/", http.port());
    twice_servicebus::sas::sign(&resource, name, key, expiry)
}

fn root_token(http: SocketAddr) -> String {
    token(http, "RootManageSharedAccessKey", "SAS_KEY_VALUE")
}

/// Sends a message to `queue`, receives it and dead-letters it with `reason`; returns its
/// sequence number in the dead-letter queue.
pub async fn dead_letter(broker: &Broker, queue: &str, message: Message, reason: &str) -> i64 {
    Backend::send(broker, queue, vec![message]).await.unwrap();
    let got: Vec<ReceivedMessage> =
        Backend::receive(broker, queue, ReceiveMode::PeekLock, 1, Duration::from_secs(5))
            .await
            .unwrap();
    let lock = got[0].lock_token.unwrap();
    let how = Settlement::DeadLetter(
        twice::DeadLetterReason::new(reason, format!("{reason}: the handler gave up")),
        Default::default(),
    );
    Backend::settle(broker, queue, lock, how).await.unwrap();
    let dlq = format!("{queue}/$deadletterqueue");
    let peeked = Backend::peek(broker, &dlq, None, SequenceNumber::new(0), 100).await.unwrap();
    peeked.last().unwrap().sequence_number.get()
}

/// The active and dead-lettered counts of an entity, from `/entities`.
pub async fn counts(http: SocketAddr, entity: &str) -> (u64, u64) {
    let list = request(http, "GET", "/entities", &[], "").await.json();
    let e = list.as_array().unwrap().iter().find(|e| e["path"] == entity).unwrap().clone();
    (e["active"].as_u64().unwrap(), e["dead_letter"].as_u64().unwrap())
}

fn post_json<'a>(auth: &'a str, origin: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![("authorization", auth), ("origin", origin), ("content-type", "application/json")]
}

#[tokio::test]
async fn the_page_and_its_script_are_served_with_a_strict_policy() {
    let server = TestServer::start().await;
    let page = request(server.http, "GET", "/", &[], "").await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains("<title>twice console</title>"));
    assert!(page.body.contains(r#"<script src="/$console/app.js">"#));
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(!csp.contains("unsafe-inline'; connect") && !csp.contains("script-src 'unsafe"));
    let script = request(server.http, "GET", "/$console/app.js", &[], "").await;
    assert_eq!(script.status, 200);
    assert!(script.header("content-type").unwrap().starts_with("text/javascript"));
    assert!(script.body.contains("crypto.subtle.sign"));
    // A path under the prefix that is not the console's is not the administration API's either.
    let missing = request(server.http, "GET", "/$console/nothing", &[], "").await;
    assert_eq!((missing.status, missing.code().as_str()), (404, "not_found"));
}

#[tokio::test]
async fn entities_are_open_and_message_reads_need_a_listen_token() {
    let server = TestServer::start().await;
    let message =
        Message::new("{\"order\":42}").with_message_id("m-42").with_property("tenant", "acme");
    let seq = dead_letter(&server.broker, "q2", message, "MaxDeliveryCountExceeded").await;
    let entities = request(server.http, "GET", "/$console/api/entities", &[], "").await;
    assert_eq!(entities.status, 200);
    let v = entities.json();
    let q2 = v["entities"].as_array().unwrap().iter().find(|e| e["path"] == "q2").unwrap();
    assert_eq!((q2["active"].as_u64(), q2["dead_letter"].as_u64()), (Some(0), Some(1)));
    assert_eq!(v["reads_need_token"], true);
    let sessq = v["entities"].as_array().unwrap().iter().find(|e| e["path"] == "sessq1").unwrap();
    assert_eq!(sessq["requires_session"], true);

    let peek = "/$console/api/peek?entity=q2&dlq=1";
    let anonymous = request(server.http, "GET", peek, &[], "").await;
    assert_eq!((anonymous.status, anonymous.code().as_str()), (401, "unauthorized"));
    let wrong = token(server.http, "RootManageSharedAccessKey", "WRONG");
    let refused = request(server.http, "GET", peek, &[("authorization", &wrong)], "").await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    let good = root_token(server.http);
    let read = request(server.http, "GET", peek, &[("authorization", &good)], "").await;
    assert_eq!(read.status, 200, "{}", read.body);
    let m = &read.json()["messages"][0];
    assert_eq!(m["sequence_number"], seq);
    assert_eq!(m["message_id"], "m-42");
    assert_eq!(m["dead_letter_reason"], "MaxDeliveryCountExceeded");
    assert_eq!(m["dead_letter_description"], "MaxDeliveryCountExceeded: the handler gave up");
    assert_eq!(m["body_preview"], "{\"order\":42}");
    assert_eq!(m["properties"], json!({ "tenant": "acme" }));
    assert_eq!(read.json()["next_from"], seq + 1);
    // The active side of the queue is empty.
    let active = request(
        server.http,
        "GET",
        "/$console/api/peek?entity=q2",
        &[("authorization", &good)],
        "",
    )
    .await;
    assert_eq!(active.json()["messages"], json!([]));
}

#[tokio::test]
async fn entity_totals_count_what_the_amqp_side_did() {
    let server = TestServer::start().await;
    let entities = request(server.http, "GET", "/$console/api/entities", &[], "").await.json();
    let q8 =
        |v: &Json| v["entities"].as_array().unwrap().iter().find(|e| e["path"] == "q8").cloned();
    assert_eq!(q8(&entities).unwrap()["sends"], 0);
    let before = entities["time_ms"].as_i64().unwrap();
    let (_client, _held) = crate::wire::Raw::with_deliveries(server.addr, "q8", 5).await;
    server.clock.advance(Duration::from_secs(2));
    let entities = request(server.http, "GET", "/$console/api/entities", &[], "").await.json();
    let q8 = q8(&entities).unwrap();
    assert_eq!((q8["sends"].as_u64(), q8["receives"].as_u64()), (Some(5), Some(5)), "{q8}");
    assert_eq!(entities["time_ms"].as_i64().unwrap() - before, 2000, "the server's clock");
}

#[tokio::test]
async fn resubmit_sends_the_copy_then_removes_the_dead_lettered_message() {
    let server = TestServer::start().await;
    let message = Message::new("payload").with_message_id("m-1").with_property("k", 7i64);
    let seq = dead_letter(&server.broker, "q3", message, "poison").await;
    assert_eq!(counts(server.http, "q3").await, (0, 1));
    let auth = root_token(server.http);
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let body = json!({ "entity": "q3", "sequence_numbers": [seq] }).to_string();
    let r =
        request(server.http, "POST", "/$console/api/resubmit", &post_json(&auth, &origin), &body)
            .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!((v["done"].clone(), v["missing"].clone()), (json!([seq]), json!([])));
    assert_eq!(counts(server.http, "q3").await, (1, 0));
    let back: Vec<ReceivedMessage> =
        Backend::peek(&server.broker, "q3", None, SequenceNumber::new(0), 10).await.unwrap();
    let copy = &back[0].message;
    assert_eq!(copy.message_id.as_ref().unwrap().as_str(), "m-1");
    assert_eq!(copy.body.as_ref(), b"payload");
    assert_eq!(copy.application_properties.get("k"), Some(&twice::Value::Long(7)));
    assert!(!copy.application_properties.contains_key("DeadLetterReason"));
    // Asking again for the same message finds nothing to do and says so.
    let again =
        request(server.http, "POST", "/$console/api/resubmit", &post_json(&auth, &origin), &body)
            .await;
    assert_eq!(again.json()["missing"], json!([seq]), "{}", again.body);
    assert_eq!(counts(server.http, "q3").await, (1, 0));
}

#[tokio::test]
async fn a_copy_the_target_refuses_leaves_the_message_dead_lettered_and_free() {
    let server = TestServer::start().await;
    let keep = Message::new("keep me").with_message_id("k-1");
    let seq = dead_letter(&server.broker, "q9", keep, "poison").await;
    // Fill `quotaq` (1 MiB) with ever smaller messages until it refuses one of a single byte.
    for size in [100 * 1024, 10 * 1024, 1024, 100, 1] {
        let mut full = false;
        for _ in 0..40 {
            let filler = Message::new(vec![b'x'; size]);
            match Backend::send(&server.broker, "quotaq", vec![filler]).await {
                Ok(_) => {}
                Err(BackendError::QuotaExceeded(_)) => {
                    full = true;
                    break;
                }
                Err(e) => panic!("filling quotaq: {e}"),
            }
        }
        assert!(full, "quotaq took 40 messages of {size} bytes");
    }
    let auth = root_token(server.http);
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let body = json!({ "entity": "q9", "sequence_numbers": [seq], "to": "quotaq" }).to_string();
    let r =
        request(server.http, "POST", "/$console/api/resubmit", &post_json(&auth, &origin), &body)
            .await;
    assert_eq!((r.status, r.code().as_str()), (409, "conflict"), "{}", r.body);
    assert!(r.body.contains("stays dead-lettered"), "{}", r.body);
    // The dead-lettered message was not completed before its copy was stored: it is there,
    // and released at once rather than held until its lock expires.
    assert_eq!(counts(server.http, "q9").await, (0, 1));
    let dlq = "q9/$deadletterqueue";
    let got = Backend::receive(&server.broker, dlq, ReceiveMode::PeekLock, 1, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(got.len(), 1, "the message is still locked by the console");
    assert_eq!(got[0].sequence_number.get(), seq);
    assert_eq!(got[0].message.body.as_ref(), b"keep me");
}

#[tokio::test]
async fn changes_need_a_token_that_may_send_and_listen() {
    let mut keys = Keys::emulator_default();
    keys.insert_with_claims("reader", "READER_KEY", Claims::parse("Listen").unwrap());
    keys.insert_with_claims("worker", "WORKER_KEY", Claims::parse("Send,Listen").unwrap());
    let server = TestServer::start_with(ServerOptions::new().keys(keys), None).await;
    let seq = dead_letter(&server.broker, "q4", Message::new("x"), "poison").await;
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let body = json!({ "entity": "q4", "sequence_numbers": [seq] }).to_string();
    for path in ["/$console/api/resubmit", "/$console/api/purge"] {
        let anonymous = [("origin", origin.as_str()), ("content-type", "application/json")];
        let r = request(server.http, "POST", path, &anonymous, &body).await;
        assert_eq!((r.status, r.code().as_str()), (401, "unauthorized"), "{path}: {}", r.body);
        let wrong = token(server.http, "RootManageSharedAccessKey", "NOT_THE_KEY");
        let r = request(server.http, "POST", path, &post_json(&wrong, &origin), &body).await;
        assert_eq!((r.status, r.code().as_str()), (401, "unauthorized"), "{path}: {}", r.body);
        assert!(r.json()["error"]["message"].as_str().unwrap().contains("signature"));
        let reader = token(server.http, "reader", "READER_KEY");
        let r = request(server.http, "POST", path, &post_json(&reader, &origin), &body).await;
        assert_eq!((r.status, r.code().as_str()), (403, "forbidden"), "{path}: {}", r.body);
        assert_eq!(counts(server.http, "q4").await, (0, 1), "{path} changed nothing");
    }
    // A token for another entity does not cover this one.
    let expiry = server.clock.now().as_millis() / 1000 + 600;
    let other = format!("http://127.0.0.1:{}/q5", server.http.port());
    let narrow =
        twice_servicebus::sas::sign(&other, "RootManageSharedAccessKey", "SAS_KEY_VALUE", expiry);
    let r =
        request(server.http, "POST", "/$console/api/purge", &post_json(&narrow, &origin), &body)
            .await;
    assert_eq!(r.status, 403, "{}", r.body);
    // Send and Listen without Manage are enough.
    let worker = token(server.http, "worker", "WORKER_KEY");
    let r =
        request(server.http, "POST", "/$console/api/purge", &post_json(&worker, &origin), &body)
            .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["done"], json!([seq]));
    assert_eq!(counts(server.http, "q4").await, (0, 0));
}

#[tokio::test]
async fn cross_site_posts_and_foreign_hosts_are_refused() {
    let server = TestServer::start().await;
    let seq = dead_letter(&server.broker, "q6", Message::new("x"), "poison").await;
    let auth = root_token(server.http);
    let body = json!({ "entity": "q6", "sequence_numbers": [seq] }).to_string();
    let path = "/$console/api/resubmit";
    let evil = post_json(&auth, "http://evil.example");
    let r = request(server.http, "POST", path, &evil, &body).await;
    assert_eq!((r.status, r.code().as_str()), (403, "forbidden"), "{}", r.body);
    let null = post_json(&auth, "null");
    assert_eq!(request(server.http, "POST", path, &null, &body).await.status, 403);
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let mut cross = post_json(&auth, &origin);
    cross.push(("sec-fetch-site", "cross-site"));
    assert_eq!(request(server.http, "POST", path, &cross, &body).await.status, 403);
    // A form post (the only cross-site POST a browser sends without asking) is not JSON.
    let form = [("authorization", auth.as_str()), ("content-type", "text/plain")];
    let r = request(server.http, "POST", path, &form, &body).await;
    assert_eq!((r.status, r.code().as_str()), (415, "unsupported_media_type"), "{}", r.body);
    // A page whose own name now points here (DNS rebinding) cannot read even the counts.
    let rebound = [("host", "evil.example:5300")];
    let r = request(server.http, "GET", "/$console/api/entities", &rebound, "").await;
    assert_eq!(r.status, 421, "the HTTP port's host check: {}", r.body);
    assert_eq!(counts(server.http, "q6").await, (0, 1), "nothing changed");
    // The same request from the console's own origin goes through.
    let r = request(server.http, "POST", path, &post_json(&auth, &origin), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(counts(server.http, "q6").await, (1, 0));
}

#[tokio::test]
async fn bad_parameters_get_400_with_a_typed_error() {
    let server = TestServer::start().await;
    let auth = root_token(server.http);
    let reads = [
        ("/$console/api/peek", 400),
        ("/$console/api/peek?entity=", 400),
        ("/$console/api/peek?entity=q1&max=0", 400),
        ("/$console/api/peek?entity=q1&max=101", 400),
        ("/$console/api/peek?entity=q1&from=-1", 400),
        ("/$console/api/peek?entity=q1&from=x", 400),
        ("/$console/api/peek?entity=q1&dlq=yes", 400),
        ("/$console/api/peek?entity=q1&entity=q2", 400),
        ("/$console/api/peek?entity=q1&lock=1", 400),
        ("/$console/api/peek?entity=q1/$deadletterqueue", 400),
        ("/$console/api/peek?entity=%ZZ", 400),
        ("/$console/api/peek?entity=topic1", 400),
        ("/$console/api/peek?entity=nosuchqueue", 404),
        ("/$console/api/sessions?entity=q1", 400),
        ("/$console/api/sessions?entity=sessq1&top=51", 400),
    ];
    for (target, want) in reads {
        let r = request(server.http, "GET", target, &[("authorization", &auth)], "").await;
        let code = if want == 400 { "bad_request" } else { "not_found" };
        assert_eq!((r.status, r.code().as_str()), (want, code), "{target}: {}", r.body);
        assert!(!r.json()["error"]["message"].as_str().unwrap().is_empty());
    }
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let headers = post_json(&auth, &origin);
    let posts = [
        ("not json", 400),
        ("[1]", 400),
        (r#"{"sequence_numbers":[1]}"#, 400),
        (r#"{"entity":"q1"}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[]}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[0]}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":["1"]}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[1],"all":true}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[1],"new_id":"yes"}"#, 400),
        (r#"{"entity":"topic1/subscriptions/sub1","sequence_numbers":[1]}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[1],"to":"topic1/subscriptions/sub1"}"#, 400),
        (r#"{"entity":"q1","sequence_numbers":[1],"to":"nosuchqueue"}"#, 404),
        (r#"{"entity":"nosuchqueue","sequence_numbers":[1]}"#, 404),
    ];
    for (body, want) in posts {
        let r = request(server.http, "POST", "/$console/api/resubmit", &headers, body).await;
        assert_eq!(r.status, want, "{body}: {}", r.body);
    }
    let many: Vec<i64> = (1..=101).collect();
    let body = json!({ "entity": "q1", "sequence_numbers": many }).to_string();
    let r = request(server.http, "POST", "/$console/api/purge", &headers, &body).await;
    assert_eq!((r.status, r.code().as_str()), (400, "bad_request"), "{}", r.body);
    let r = request(server.http, "GET", "/$console/api/resubmit", &[], "").await;
    assert_eq!((r.status, r.code().as_str()), (405, "method_not_allowed"));
    let r = request(server.http, "DELETE", "/", &[], "").await;
    assert_eq!(r.status, 405);
}

#[tokio::test]
async fn a_copy_the_target_would_drop_as_a_duplicate_stays_dead_lettered() {
    let server = TestServer::start().await;
    let seq =
        dead_letter(&server.broker, "dupq", Message::new("x").with_message_id("d-1"), "poison")
            .await;
    let auth = root_token(server.http);
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let headers = post_json(&auth, &origin);
    let body = json!({ "entity": "dupq", "sequence_numbers": [seq] }).to_string();
    let r = request(server.http, "POST", "/$console/api/resubmit", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.json()["done"].clone(), r.json()["kept"].clone()), (json!([]), json!([seq])));
    assert_eq!(counts(server.http, "dupq").await, (0, 1));
    let body = json!({ "entity": "dupq", "sequence_numbers": [seq], "new_id": true }).to_string();
    let r = request(server.http, "POST", "/$console/api/resubmit", &headers, &body).await;
    assert_eq!(r.json()["done"], json!([seq]), "{}", r.body);
    assert_eq!(counts(server.http, "dupq").await, (1, 0));
    let back =
        Backend::peek(&server.broker, "dupq", None, SequenceNumber::new(0), 10).await.unwrap();
    let copy = &back[0].message;
    assert_ne!(copy.message_id.as_ref().unwrap().as_str(), "d-1");
    assert_eq!(
        copy.application_properties.get("OriginalMessageId"),
        Some(&twice::Value::from("d-1"))
    );
}

#[tokio::test]
async fn sessions_show_their_messages_state_and_lock() {
    let server = TestServer::start().await;
    let broker = &server.broker;
    let messages = vec![
        Message::new("a1").with_session_id("alpha"),
        Message::new("a2").with_session_id("alpha"),
        Message::new("b1").with_session_id("beta"),
    ];
    Backend::send(broker, "sessq2", messages).await.unwrap();
    let alpha =
        Backend::accept_session(broker, "sessq2", Some(SessionId::new("alpha")), Duration::ZERO)
            .await
            .unwrap()
            .unwrap();
    alpha.set_state(Some(bytes::Bytes::from_static(b"step 2 of 3"))).await.unwrap();
    alpha.close().await;
    // A receiver holds beta while the console looks.
    let beta =
        Backend::accept_session(broker, "sessq2", Some(SessionId::new("beta")), Duration::ZERO)
            .await
            .unwrap()
            .unwrap();
    let target = "/$console/api/sessions?entity=sessq2";
    assert_eq!(request(server.http, "GET", target, &[], "").await.status, 401);
    let auth = root_token(server.http);
    let r = request(server.http, "GET", target, &[("authorization", &auth)], "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let sessions = r.json()["sessions"].as_array().unwrap().clone();
    let find = |id: &str| sessions.iter().find(|s| s["session_id"] == id).unwrap().clone();
    let a = find("alpha");
    assert_eq!((a["messages"].as_u64(), a["locked"].as_bool()), (Some(2), Some(false)));
    assert_eq!(a["state_preview"], "step 2 of 3");
    let b = find("beta");
    assert_eq!((b["messages"].as_u64(), b["locked"].as_bool()), (Some(1), Some(true)));
    // The console let go of alpha: a receiver can take it at once.
    let again =
        Backend::accept_session(broker, "sessq2", Some(SessionId::new("alpha")), Duration::ZERO)
            .await
            .unwrap();
    assert!(again.is_some());
    beta.close().await;
}

#[tokio::test]
async fn without_keys_reads_are_open_and_changes_refused() {
    let server = TestServer::start_with(ServerOptions::new().keys(Keys::new()), None).await;
    let seq = dead_letter(&server.broker, "q7", Message::new("x"), "poison").await;
    let r = request(server.http, "GET", "/$console/api/peek?entity=q7&dlq=1", &[], "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["messages"][0]["dead_letter_reason"], "poison");
    let entities = request(server.http, "GET", "/$console/api/entities", &[], "").await;
    assert_eq!(entities.json()["reads_need_token"], false);
    let origin = format!("http://127.0.0.1:{}", server.http.port());
    let body = json!({ "entity": "q7", "sequence_numbers": [seq] }).to_string();
    let anonymous = [("origin", origin.as_str()), ("content-type", "application/json")];
    let r = request(server.http, "POST", "/$console/api/purge", &anonymous, &body).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let any = token(server.http, "RootManageSharedAccessKey", "SAS_KEY_VALUE");
    let r =
        request(server.http, "POST", "/$console/api/purge", &post_json(&any, &origin), &body).await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(counts(server.http, "q7").await, (0, 1));
}

/// What the page asks when it signs in: the right key is answered with its name, a wrong key
/// or key name with 401, so the page can say so at once.
#[tokio::test]
async fn signing_in_checks_the_key_against_the_server() {
    let server = TestServer::start().await;
    let key = "/$console/api/key";
    let good = root_token(server.http);
    let ok = request(server.http, "GET", key, &[("authorization", &good)], "").await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["key_name"], "RootManageSharedAccessKey");
    for (name, secret) in [("RootManageSharedAccessKey", "WRONG"), ("NoSuchKey", "SAS_KEY_VALUE")] {
        let wrong = token(server.http, name, secret);
        let refused = request(server.http, "GET", key, &[("authorization", &wrong)], "").await;
        assert_eq!((refused.status, refused.code().as_str()), (401, "unauthorized"), "{name}");
    }
    let anonymous = request(server.http, "GET", key, &[], "").await;
    assert_eq!(anonymous.status, 401);
}
