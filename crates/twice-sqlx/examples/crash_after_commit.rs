//! A processor that stops dead between commit and complete: the child process of the crash
//! test. It processes one `OrderPlaced` message (id `order-1-placed`) with the shipping
//! handler, and when the inbox transaction has committed it prints `committed <id>` and waits
//! to be killed (the test sends SIGKILL), so the message is never completed.
//!
//! The broker is the embedded one, durable in `<broker dir>`, so the parent test reopens it
//! after the kill and gets the message redelivered.
//!
//! With a batch size `n` (the fifth argument) it sends orders 1 to `n` and processes them as
//! one batch: the first `committed <id>` comes after the batch's one commit, and none of the
//! `n` messages is completed.
//!
//! Usage: `crash_after_commit <sqlite|postgres|mariadb> <url or file> <inbox table> <broker dir>
//! [batch size]`

use std::io::Write as _;
use std::time::Duration;

use twice::{Context, Message, Outcome, Processor, ProcessorOptions, json_fn};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Receiver};
use twice_sqlx::{InboxOptions, SqlxInbox};

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
}

/// The durable broker in `dir` with `orders` messages `OrderPlaced` in queue `orders`.
async fn queue(dir: &str, orders: usize) -> anyhow::Result<Receiver> {
    let broker = Broker::open(BrokerOptions::durable(dir)).await?;
    broker
        .create_queue(
            "orders",
            QueueProperties::default().with_lock_duration(Duration::from_secs(30)),
        )
        .await?;
    for n in 1..=orders {
        let body = format!(r#"{{"order_id":{n}}}"#);
        broker
            .send("orders", Message::new(body).with_message_id(format!("order-{n}-placed")))
            .await?;
    }
    Ok(broker.receiver("orders").await?)
}

/// After the commit: tell the parent, then hang until killed.
fn die_here(message: &twice::ReceivedMessage) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "committed {}", message.message_id());
    let _ = out.flush();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

macro_rules! run {
    ($db:ty, $pool:expr, $table:expr, $dir:expr, $batch:expr, $sql:expr) => {{
        let inbox = SqlxInbox::<$db>::new($pool, InboxOptions::new().table($table)).await?;
        let handler = json_fn(
            |ctx: Context<'_>, order: OrderPlaced, tx: &mut sqlx::Transaction<'static, $db>| {
                Box::pin(async move {
                    sqlx::query($sql)
                        .bind(order.order_id)
                        .bind(ctx.message_id().as_str())
                        .execute(&mut **tx)
                        .await?;
                    Ok(Outcome::Complete)
                })
            },
        );
        Processor::new(
            queue($dir, $batch).await?,
            inbox,
            handler,
            ProcessorOptions::new().consumer("shipping").batch_size($batch),
        )
        .on_committed(die_here)
        .run(std::future::pending())
        .await?;
    }};
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (store, url, table, dir, batch) = match args.as_slice() {
        [_, store, url, table, dir] => (store, url, table, dir, 1),
        [_, store, url, table, dir, batch] => (store, url, table, dir, batch.parse()?),
        _ => anyhow::bail!(
            "usage: crash_after_commit <sqlite|postgres|mariadb> <url or file> <table> \
             <broker dir> [batch size]"
        ),
    };
    let table = table.clone();
    match store.as_str() {
        "sqlite" => {
            let pool =
                sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(url)).await?;
            run!(
                sqlx::Sqlite,
                pool,
                table,
                dir,
                batch,
                "INSERT INTO shipments (order_id, message_id) VALUES (?1, ?2)"
            );
        }
        "postgres" => {
            let pool = sqlx::PgPool::connect(url).await?;
            run!(
                sqlx::Postgres,
                pool,
                table,
                dir,
                batch,
                "INSERT INTO shipments (order_id, message_id) VALUES ($1, $2)"
            );
        }
        "mariadb" => {
            let pool = sqlx::MySqlPool::connect(url).await?;
            run!(
                sqlx::MySql,
                pool,
                table,
                dir,
                batch,
                "INSERT INTO shipments (order_id, message_id) VALUES (?, ?)"
            );
        }
        other => anyhow::bail!("unknown store {other}"),
    }
    Ok(())
}
