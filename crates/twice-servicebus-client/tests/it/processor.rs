//! The idempotent processor over the client against `twice serve`, with the inbox in
//! PostgreSQL: the seed's shipping handler, every order sent twice.

use std::time::Duration;

use twice::{
    Context, Message, Outcome, Processor, ProcessorOptions, SessionProcessor,
    SessionProcessorOptions, json_fn,
};
use twice_servicebus_client::{ReceiverOptions, StableIdSender};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::PgDatabase;
use twice_testkit::require_service;

use crate::harness::Serve;

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
}

const ORDERS: i64 = 20;

/// The seed's shipping handler: one row per order, in the transaction that claimed the message.
fn ship<'a>(
    _ctx: Context<'a>,
    order: OrderPlaced,
    tx: &'a mut sqlx::Transaction<'static, sqlx::Postgres>,
) -> futures::future::BoxFuture<'a, Result<Outcome, twice::HandlerError>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
            .bind(order.order_id)
            .execute(&mut **tx)
            .await?;
        Ok(Outcome::Complete)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_ships_each_order_once_over_the_client_with_a_postgres_inbox() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let pool = db.pool(8).await.expect("pool");
    sqlx::query("CREATE TABLE shipments (order_id BIGINT NOT NULL)").execute(&pool).await.unwrap();
    sqlx::query("CREATE UNIQUE INDEX shipments_order_id ON shipments (order_id)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = SqlxInbox::new(
        pool.clone(),
        InboxOptions::new().business_key("shipments", "shipments_order_id"),
    )
    .await
    .unwrap();
    let handler = json_fn(ship);

    let s = Serve::start().await;
    let client = s.client();
    // Every order twice with the same id, as a sender that retried a send would: the queue
    // has no duplicate detection, so the inbox must catch the copy.
    let sender = StableIdSender::new(client.sender("q"));
    for order in 0..ORDERS {
        for _ in 0..2 {
            let body = format!(r#"{{"order_id":{order}}}"#);
            sender
                .send(&format!("order-{order}"), "OrderPlaced", Message::new(body))
                .await
                .unwrap();
        }
    }

    let calls = 4;
    let receiver = client.receiver("q", ReceiverOptions::new().max_concurrent_calls(calls));
    let processor = Processor::new(
        receiver,
        inbox,
        handler,
        ProcessorOptions::new().consumer("shipping").max_concurrent_calls(calls),
    );
    let counters = processor.counters();
    let done = {
        let counters = counters.clone();
        async move {
            while counters.snapshot().completed < u64::try_from(2 * ORDERS).unwrap() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // A bound, so that a hang fails the test instead of the run.
    tokio::time::timeout(Duration::from_secs(120), processor.run(done))
        .await
        .expect("the processor settled every copy")
        .unwrap();

    let shipped: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM shipments").fetch_one(&pool).await.unwrap();
    assert_eq!(shipped, ORDERS);
    let c = counters.snapshot();
    assert_eq!(
        c.duplicates_already_processed + c.duplicates_concurrent_copy,
        u64::try_from(ORDERS).unwrap()
    );
    // Every copy was completed on the broker: nothing is left to receive.
    let check = client.receiver("q", ReceiverOptions::new());
    assert!(check.receive_messages(1, Duration::from_millis(300)).await.unwrap().is_empty());
}

#[derive(serde::Deserialize)]
struct Step {
    customer: String,
    step: i64,
}

/// Sessions through the client: each customer's steps are handled in order, once each, the
/// copy of a step skipped by the inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_processor_keeps_each_session_in_order_over_the_client() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let pool = db.pool(8).await.expect("pool");
    sqlx::query("CREATE TABLE steps (n BIGSERIAL PRIMARY KEY, customer TEXT NOT NULL, step BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new()).await.unwrap();
    let handler = json_fn(
        |_ctx: Context<'_>, s: Step, tx: &mut sqlx::Transaction<'static, sqlx::Postgres>| {
            Box::pin(async move {
                sqlx::query("INSERT INTO steps (customer, step) VALUES ($1, $2)")
                    .bind(s.customer)
                    .bind(s.step)
                    .execute(&mut **tx)
                    .await?;
                Ok(Outcome::Complete)
            })
        },
    );
    let s = Serve::start().await;
    let client = s.client();
    let sender = StableIdSender::new(client.sender("sess"));
    let customers = ["c1", "c2", "c3"];
    let steps = 4;
    for step in 0..steps {
        for c in customers {
            let body = format!(r#"{{"customer":"{c}","step":{step}}}"#);
            let m = Message::new(body).with_session_id(c);
            sender.send(c, &format!("Step{step}"), m.clone()).await.unwrap();
            if step == 1 {
                // A resent step: the same id again.
                sender.send(c, &format!("Step{step}"), m).await.unwrap();
            }
        }
    }
    let total = u64::try_from(customers.len() * (steps + 1)).unwrap();
    let sessions = client.session_receiver("sess", ReceiverOptions::new().prefetch(4));
    let p = SessionProcessor::new(
        sessions,
        inbox,
        handler,
        SessionProcessorOptions::new()
            .consumer("steps")
            .max_concurrent_sessions(2)
            // A finished session is let go soon, so the third customer's gets its turn.
            .session_idle_timeout(Duration::from_millis(500))
            .max_wait(Duration::from_secs(2)),
    )
    .on_error(|e| eprintln!("processor error: {e}"));
    let counters = p.counters();
    let done = {
        let counters = counters.clone();
        async move {
            while counters.snapshot().completed < total {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let run = tokio::time::timeout(Duration::from_secs(60), p.run(done)).await;
    assert!(run.is_ok(), "the processor did not settle every message: {:?}", counters.snapshot());
    for c in customers {
        let seen: Vec<i64> =
            sqlx::query_scalar("SELECT step FROM steps WHERE customer = $1 ORDER BY n")
                .bind(c)
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(seen, (0..i64::try_from(steps).unwrap()).collect::<Vec<_>>(), "{c}");
    }
}

/// The broker's connections are cut while the processor works: the client reconnects, the
/// settlements of the cut links fail with lock-lost, the messages come back when their locks
/// expire, and the inbox makes sure each order is still shipped once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_ships_each_order_once_across_a_broker_restart() {
    let Some(db) = require_service("PostgreSQL", PgDatabase::create("twice_sbc").await) else {
        return;
    };
    let pool = db.pool(8).await.expect("pool");
    // No unique index: a second shipment of an order would show as a second row.
    sqlx::query("CREATE TABLE shipments (order_id BIGINT NOT NULL)").execute(&pool).await.unwrap();
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new()).await.unwrap();
    let handler = json_fn(ship);
    let mut s = Serve::start().await;
    let client = s.client();
    let sender = StableIdSender::new(client.sender("q"));
    let orders = 30;
    for order in 0..orders {
        let body = format!(r#"{{"order_id":{order}}}"#);
        sender.send(&format!("order-{order}"), "OrderPlaced", Message::new(body)).await.unwrap();
    }
    let receiver = client.receiver("q", ReceiverOptions::new().max_concurrent_calls(4));
    let processor = Processor::new(
        receiver,
        inbox,
        handler,
        ProcessorOptions::new().consumer("shipping").max_concurrent_calls(4),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.await;
    }));
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    let bound = tokio::time::timeout(Duration::from_secs(60), async {
        while count("SELECT COUNT(*) FROM shipments").await < 5 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        s.restart().await;
        // The locks of the cut links expire; their messages come back.
        s.clock.advance(Duration::from_secs(31));
        loop {
            let left = s.broker.counts("q").await.unwrap().active;
            if left == 0 && count("SELECT COUNT(DISTINCT order_id) FROM shipments").await == orders
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    assert!(bound.is_ok(), "not every order was shipped and completed");
    assert_eq!(count("SELECT COUNT(*) FROM shipments").await, orders, "an order shipped twice");
    assert_eq!(s.broker.counts("q").await.unwrap().dead_letter, 0);
}
