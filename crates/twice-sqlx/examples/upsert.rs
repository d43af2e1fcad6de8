//! Natural idempotency (seed strategy 1): a handler whose work is an upsert keyed on the
//! business identity runs without a claim ([`Mode::NaturallyIdempotent`]); a second run finds
//! the row and changes nothing, so no inbox row is needed.
//!
//! Run it with `cargo run -p twice-sqlx --features sqlite --example upsert`.

use twice::{Context, Message, Mode, Outcome, Processor, ProcessorOptions, json_fn};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, SqlxInbox};

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(
        dir.path().join("orders.db"),
    ))
    .await?;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL)")
        .execute(&pool)
        .await?;
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new()).await?;

    // The seed's MERGE: insert when not matched; a second run matches and does nothing.
    let handler = json_fn(
        |_ctx: Context<'_>,
         order: OrderPlaced,
         tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>| {
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO orders (id, status) VALUES (?1, 'Placed') ON CONFLICT (id) DO NOTHING",
                )
                .bind(order.order_id)
                .execute(&mut **tx)
                .await?;
                Ok(Outcome::Complete)
            })
        },
    );

    let broker = Broker::open(BrokerOptions::in_memory()).await?;
    broker.create_queue("orders", QueueProperties::default()).await?;
    // The same event twice, even under different message ids: the upsert does not care.
    broker.send("orders", Message::new(r#"{"order_id":7}"#).with_message_id("a")).await?;
    broker.send("orders", Message::new(r#"{"order_id":7}"#).with_message_id("b")).await?;

    let processor = Processor::new(
        broker.receiver("orders").await?,
        inbox,
        handler,
        ProcessorOptions::new().mode(Mode::NaturallyIdempotent),
    );
    let counters = processor.counters();
    let done = {
        let counters = counters.clone();
        async move {
            while counters.snapshot().completed < 2 {
                tokio::task::yield_now().await;
            }
        }
    };
    processor.run(done).await?;

    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders").fetch_one(&pool).await?;
    let claims: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM twice_inbox").fetch_one(&pool).await?;
    println!(
        "orders: {rows}, inbox rows: {claims}, messages completed: {}",
        counters.snapshot().completed
    );
    anyhow::ensure!(rows == 1 && claims == 0, "the upsert ran twice with the effect of once");
    Ok(())
}
