//! The console in a real headless Chromium (Debian's `chromium` and `chromium-driver`): the page
//! loads, shows a dead-lettered message's reason, resubmits it with the key typed in, and the
//! counts move; then it peeks the active messages and lists a session queue's sessions. On
//! failure a screenshot is saved to `target/console-failure.png`.
//!
//! With `TWICE_CONSOLE_SCREENSHOT=PATH` the test also saves a picture of the console showing
//! the dead-lettered message (the README's `docs/console.png` is made so).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure};
use tokio::sync::oneshot;
use twice::Message;
use twice_broker::config::Config;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Backend, Server, ServerOptions};

use super::webdriver::{Browser, CHROMEDRIVER, CHROMIUM};
use super::{counts, dead_letter};
use crate::harness::may_skip;

/// A few entities, as a small deployment has them.
const CONFIG: &str = r#"{"UserConfig":{"Namespaces":[{"Name":"sbemulatorns","Queues":[
  {"Name":"orders","Properties":{"LockDuration":"PT1M","MaxDeliveryCount":5}},
  {"Name":"payments","Properties":{"LockDuration":"PT1M"}},
  {"Name":"invoices","Properties":{"RequiresSession":true}}],
  "Topics":[{"Name":"events","Subscriptions":[{"Name":"audit"},{"Name":"billing"}]}]}],
  "Logging":{"Type":"Console"}}}"#;

/// A server on free ports (HTTP, AMQP) over an in-memory broker with [`CONFIG`]; stops when
/// `stop` is sent.
async fn start() -> (SocketAddr, SocketAddr, Broker, oneshot::Sender<()>) {
    let config = Config::from_json(CONFIG).unwrap();
    let broker = Broker::open(BrokerOptions::in_memory().config(config)).await.unwrap();
    let options = ServerOptions::new()
        .amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
        .http_addr(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
    let server = Server::bind(options, broker.clone()).await.unwrap();
    let http = server.http_addr().unwrap();
    let amqp = server.amqp_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));
    (http, amqp, broker, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_dead_lettered_message_and_resubmits_it_in_chromium() {
    if !Path::new(CHROMIUM).exists() || !Path::new(CHROMEDRIVER).exists() {
        may_skip(&format!(
            "{CHROMIUM} or {CHROMEDRIVER} is missing (apt-get install chromium chromium-driver)"
        ));
        return;
    }
    let (http, amqp_addr, broker, stop) = Box::pin(start()).await;
    let body = r#"{"order":1042,"customer":"c-77","amount":"12.50","currency":"EUR"}"#;
    let poisoned = Message::new(body)
        .with_message_id("order-1042")
        .with_content_type("application/json")
        .with_property("tenant", "acme");
    let seq = dead_letter(&broker, "orders", poisoned, "MaxDeliveryCountExceeded").await;
    let others = (1..=3).map(|i| Message::new(format!("{{\"order\":{}}}", 1042 + i)));
    Backend::send(&broker, "orders", others.collect()).await.unwrap();
    Backend::send(&broker, "payments", vec![Message::new("p1"), Message::new("p2")]).await.unwrap();
    let invoice = Message::new("inv-9").with_session_id("customer-77");
    Backend::send(&broker, "invoices", vec![invoice]).await.unwrap();
    Backend::send(&broker, "events", vec![Message::new("created")]).await.unwrap();
    assert_eq!(counts(http, "orders").await, (3, 1));

    // Traffic through AMQP for the rates: a burst every quarter second for at most twenty
    // seconds (stopped when the scenario ends).
    let traffic = tokio::spawn(async move {
        for _ in 0..80 {
            let (_client, _held) =
                crate::wire::Raw::with_deliveries(amqp_addr, "payments", 4).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    let browser = Box::pin(Browser::start()).await.expect("start chromium through chromedriver");
    let result = Box::pin(scenario(&browser, http, seq)).await;
    traffic.abort();
    if let Err(e) = &result {
        let dir = target_dir();
        let path = dir.canonicalize().unwrap_or(dir).join("console-failure.png");
        match browser.screenshot(&path).await {
            Ok(()) => eprintln!("console test failed ({e}); screenshot: {}", path.display()),
            Err(s) => eprintln!("console test failed ({e}); no screenshot: {s}"),
        }
    }
    browser.quit().await;
    result.unwrap();
    assert_eq!(counts(http, "orders").await, (4, 0), "the server agrees with the page");
    let _ = stop.send(());
}

async fn scenario(browser: &Browser, http: SocketAddr, seq: i64) -> anyhow::Result<()> {
    let row = |column: &str| format!(r#"#entities tr[data-path="orders"] td.{column}"#);
    browser.goto(&format!("http://127.0.0.1:{}/", http.port())).await?;
    browser.wait_for(&row("dead_letter"), "one dead-lettered message", |t| t == "1").await?;
    browser.wait_for(&row("active"), "three active messages", |t| t == "3").await?;
    let payments = r#"#entities tr[data-path="payments"] td.send-rate"#;
    browser.wait_for(payments, "a send rate", |t| t.parse::<f64>().is_ok_and(|r| r > 0.0)).await?;
    browser.click(r#"#entities tr[data-path="orders"] button.open"#).await?;
    // Message contents need a key: the page asks for one before showing any.
    browser.wait_for("#note", "the request to sign in", |t| t.contains("Sign in")).await?;
    ensure!(browser.find("#messages tr").await.is_err(), "messages shown before signing in");
    // A wrong key is told at once, and the page does not claim to be signed in.
    browser.type_into("#key-name", "RootManageSharedAccessKey").await?;
    browser.type_into("#key", "NOT_THE_KEY").await?;
    browser.click("#sign-in").await?;
    browser
        .wait_for("#sign-in-error", "the wrong key refused", |t| t == "wrong key or key name")
        .await?;
    let signed_in = browser.text("#signed-in").await.unwrap_or_default();
    ensure!(!signed_in.contains("signed in as"), "signed in with a wrong key: {signed_in}");
    browser.type_into("#key-name", "RootManageSharedAccessKey").await?;
    browser.type_into("#key", "SAS_KEY_VALUE").await?;
    browser.click("#sign-in").await?;
    let reason = format!(r#"#messages tr[data-seq="{seq}"] td.reason"#);
    browser
        .wait_for(&reason, "the dead-letter reason", |t| t == "MaxDeliveryCountExceeded")
        .await?;
    let body = format!(r#"#messages tr[data-seq="{seq}"] td.body"#);
    browser.wait_for(&body, "the body", |t| t.contains("\"order\":1042")).await?;
    if let Some(path) = std::env::var_os("TWICE_CONSOLE_SCREENSHOT") {
        // Some polls on, so the chart of rates has a line to show.
        tokio::time::sleep(Duration::from_secs(8)).await;
        browser.screenshot(Path::new(&path)).await?;
    }
    browser.click(&format!(r#"#messages tr[data-seq="{seq}"] input.pick"#)).await?;
    browser.click("#resubmit").await?;
    let done = browser.wait_for("#result", "the outcome", |t| !t.is_empty()).await?;
    if !done.starts_with("resubmitted 1 of 1") {
        bail!("the page reports: {done}");
    }
    browser.wait_for(&row("dead_letter"), "an empty dead-letter queue", |t| t == "0").await?;
    browser.wait_for(&row("active"), "the message back in the queue", |t| t == "4").await?;
    browser.wait_for("#note", "the empty dead-letter queue", |t| t.contains("empty")).await?;
    // The active messages, peeked: the copy is among them, under a new sequence number.
    browser.click("#tab-active").await?;
    let copy = r#"#messages tr[data-seq] td.body"#;
    browser.wait_for(copy, "an active message's body", |t| t.contains("\"order\":")).await?;
    let ids = browser.text("#messages").await?;
    ensure!(ids.contains("order-1042"), "the resubmitted copy is not listed: {ids}");
    // A session queue lists its sessions.
    browser.click(r#"#entities tr[data-path="invoices"] button.open"#).await?;
    browser.click("#tab-sessions").await?;
    let cell = |n: u8| format!(r#"#messages tr[data-session="customer-77"] td:nth-child({n})"#);
    browser.wait_for(&cell(2), "the session's one message", |t| t == "1").await?;
    browser.wait_for(&cell(3), "that no receiver holds it", |t| t == "no").await?;
    Ok(())
}

/// The workspace's target directory, where a failure's screenshot goes.
fn target_dir() -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => t.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
    }
}
