//! Claim scope: Service Bus entity names are case-insensitive, so every spelling of one
//! entity claims in one scope, and a dead-letter queue in a scope of its own.

use std::time::Duration;

use twice::{Message, Outcome, Processor, ProcessorOptions, Transport as _};
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::require_service;

use crate::harness::Serve;

#[test]
fn the_scope_is_the_path_in_lower_case_and_a_dead_letter_queue_its_own() {
    let client = ServiceBusClient::from_connection_string(
        "Endpoint=sb://localhost;SharedAccessKeyName=k;SharedAccessKey=s;UseDevelopmentEmulator=true",
    )
    .expect("connection string");
    let scope = |path: &str| client.receiver(path, ReceiverOptions::new()).claim_scope().to_owned();
    assert_eq!(scope("Orders"), "orders");
    assert_eq!(scope("orders"), "orders");
    assert_eq!(scope("Events/Subscriptions/Billing"), "events/subscriptions/billing");
    assert_eq!(scope("Orders/$DeadLetterQueue"), "orders/$deadletterqueue");
    assert_eq!(scope("orders/$deadletterqueue"), "orders/$deadletterqueue");
    assert_ne!(scope("orders/$DeadLetterQueue"), scope("orders"));
}

/// Runs a processor on `path` (with no consumer name) until it has completed `n` messages;
/// the handler ships one row per call.
async fn process(client: &ServiceBusClient, path: &str, inbox: SqlxInbox<sqlx::Postgres>, n: u64) {
    let handler = twice::handler_fn(
        |_: twice::Context<'_>, tx: &mut sqlx::Transaction<'static, sqlx::Postgres>| {
            Box::pin(async move {
                sqlx::query("INSERT INTO shipments (n) VALUES (1)").execute(&mut **tx).await?;
                Ok(Outcome::Complete)
            }) as twice::BoxFuture<'_, _>
        },
    );
    let p = Processor::new(
        client.receiver(path, ReceiverOptions::new()),
        inbox,
        handler,
        ProcessorOptions::new().max_wait(Duration::from_secs(1)),
    )
    .on_error(|e| eprintln!("processor: {e}"));
    let counters = p.counters();
    let done = {
        let counters = counters.clone();
        async move {
            while counters.snapshot().completed < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), p.run(done))
        .await
        .expect("completed in time")
        .expect("run");
}

/// The same message sent twice to one queue, each copy taken by a processor that names the
/// queue with another case: the second copy meets the first one's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_spellings_of_one_queue_share_their_claims() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let pool = db.pool(4).await.expect("pool");
    sqlx::query("CREATE TABLE shipments (n INT NOT NULL)").execute(&pool).await.unwrap();
    let inbox = || async { SqlxInbox::new(pool.clone(), InboxOptions::new()).await.unwrap() };
    let s = Serve::start().await;
    let client = s.client();
    let copy = || Message::new("{}").with_message_id("order-1");
    client.sender("q").send_message(copy()).await.unwrap();
    process(&client, "Q", inbox().await, 1).await;
    client.sender("q").send_message(copy()).await.unwrap();
    process(&client, "q", inbox().await, 1).await;

    let shipped: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM shipments").fetch_one(&pool).await.unwrap();
    assert_eq!(shipped, 1, "the copy taken through another spelling was handled again");
    let scopes: Vec<String> =
        sqlx::query_scalar("SELECT consumer FROM twice_inbox").fetch_all(&pool).await.unwrap();
    assert_eq!(scopes, ["q"]);
}
