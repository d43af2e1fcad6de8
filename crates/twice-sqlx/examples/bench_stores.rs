//! Throughput of the processor on the embedded broker, with the inbox claim and without it
//! (the same handler in [`Mode::NaturallyIdempotent`]), on SQLite and PostgreSQL.
//!
//! Usage: `bench_stores <sqlite|postgres|mariadb> <messages> <max concurrent calls>
//! <claim|noclaim> [batch size]` (PostgreSQL and MariaDB: database `test` on their usual
//! ports). Prints one line of results.

use std::time::Duration;

use twice::{Context, Message, Mode, Outcome, Processor, ProcessorOptions, Stopwatch, json_fn};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, SqlxInbox};

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
}

macro_rules! bench {
    ($db:ty, $pool:expr, $sql:expr, $n:expr, $calls:expr, $mode:expr, $batch:expr) => {{
        let pool = $pool;
        let table = format!("bench_inbox_{}", std::process::id());
        let shipments = format!("bench_shipments_{}", std::process::id());
        sqlx::query(&format!("CREATE TABLE {shipments} (order_id BIGINT NOT NULL, message_id TEXT NOT NULL)"))
            .execute(&pool)
            .await?;
        let inbox = SqlxInbox::<$db>::new(pool.clone(), InboxOptions::new().table(&table)).await?;
        let sql: &'static str = Box::leak($sql.replace("{s}", &shipments).into_boxed_str());
        let handler = json_fn(
            move |ctx: Context<'_>, order: OrderPlaced, tx: &mut sqlx::Transaction<'static, $db>| {
                Box::pin(async move {
                    sqlx::query(sql)
                        .bind(order.order_id)
                        .bind(ctx.message_id().as_str())
                        .execute(&mut **tx)
                        .await?;
                    Ok(Outcome::Complete)
                })
            },
        );
        let broker = Broker::open(BrokerOptions::in_memory()).await?;
        broker.create_queue("orders", QueueProperties::default()).await?;
        for i in 0..$n {
            let m = Message::new(format!(r#"{{"order_id":{i}}}"#)).with_message_id(format!("order-{i}"));
            broker.send("orders", m).await?;
        }
        let receiver = broker.receiver("orders").await?;
        let p = Processor::new(
            receiver,
            inbox,
            handler,
            ProcessorOptions::new()
                .max_concurrent_calls($calls)
                .prefetch_count($calls * 2)
                .batch_size($batch)
                .mode($mode),
        );
        let counters = p.counters();
        let done = {
            let broker = broker.clone();
            async move {
                loop {
                    let s = broker.statistics("orders").await.map(|s| s.completed).unwrap_or(0);
                    if s >= $n {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let watch = Stopwatch::start();
        p.run(done).await?;
        let secs = watch.elapsed().as_secs_f64();
        let s = counters.snapshot();
        let mean_claim_us = if s.claims > 0 {
            s.claim_latency_total.as_micros() / u128::from(s.claims)
        } else {
            0
        };
        println!(
            "messages={} calls={} batch={} mode={:?} seconds={secs:.2} msgs_per_s={:.0} committed={} claim_mean_us={mean_claim_us} claim_max_us={}",
            $n, $calls, $batch, $mode, f64::from(u32::try_from($n).unwrap_or(u32::MAX)) / secs, s.committed, s.claim_latency_max.as_micros()
        );
        sqlx::query(&format!("DROP TABLE {shipments}")).execute(&pool).await?;
        sqlx::query(&format!("DROP TABLE {table}")).execute(&pool).await?;
        sqlx::query(&format!("DROP TABLE {table}_migrations")).execute(&pool).await?;
    }};
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (store, n, calls, mode, batch) = match args.as_slice() {
        [_, store, n, calls, mode] => (store, n, calls, mode, 1),
        [_, store, n, calls, mode, batch] => (store, n, calls, mode, batch.parse()?),
        _ => anyhow::bail!(
            "usage: bench_stores <sqlite|postgres|mariadb> <messages> <calls> <claim|noclaim> \
             [batch size]"
        ),
    };
    let n: u64 = n.parse()?;
    let calls: usize = calls.parse()?;
    let mode = if mode == "claim" { Mode::Claim } else { Mode::NaturallyIdempotent };
    match store.as_str() {
        "sqlite" => {
            let dir = tempfile::tempdir()?;
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(u32::try_from(calls).unwrap_or(16))
                .connect_with(twice_sqlx::sqlite::connect_options(dir.path().join("bench.db")))
                .await?;
            bench!(
                sqlx::Sqlite,
                pool,
                "INSERT INTO {s} (order_id, message_id) VALUES (?1, ?2)",
                n,
                calls,
                mode,
                batch
            );
        }
        "postgres" => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(u32::try_from(calls).unwrap_or(16))
                .connect("postgres://postgres@127.0.0.1:5432/test")
                .await?;
            bench!(
                sqlx::Postgres,
                pool,
                "INSERT INTO {s} (order_id, message_id) VALUES ($1, $2)",
                n,
                calls,
                mode,
                batch
            );
        }
        "mariadb" => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(u32::try_from(calls).unwrap_or(16))
                .connect("mysql://root@127.0.0.1:3306/test")
                .await?;
            bench!(
                sqlx::MySql,
                pool,
                "INSERT INTO {s} (order_id, message_id) VALUES (?, ?)",
                n,
                calls,
                mode,
                batch
            );
        }
        other => anyhow::bail!("unknown store {other}"),
    }
    Ok(())
}
