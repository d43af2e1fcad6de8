//! Claim latency on PostgreSQL as the inbox grows: an empty table, then 1 million and 10
//! million claimed ids. At each size it runs `samples` transactions of (begin, claim, commit)
//! one after another and prints the mean, median and 99th percentile, and the WAL written per
//! claim, for random message ids (the worst case for the key's B-tree) and for time-ordered
//! ones ([`MessageId::time_ordered`]).
//!
//! Usage: `bench_claim_latency <samples> <sizes, comma separated>` against database `test` on
//! 127.0.0.1:5432, e.g. `bench_claim_latency 5000 0,1000000,10000000`. The table is dropped at
//! the end. With `--json` it also prints, last, one line of JSON with every point (for
//! `twice-bench`).

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use twice::{Inbox, MessageId, Stopwatch, Timestamp};
use twice_sqlx::{InboxOptions, SqlxInbox};

async fn wal_lsn(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(pool)
        .await?)
}

/// One measurement: the human line and its JSON.
struct Point {
    line: String,
    json: serde_json::Value,
}

async fn measure(
    inbox: &SqlxInbox<sqlx::Postgres>,
    pool: &sqlx::PgPool,
    samples: usize,
    ordered: bool,
) -> anyhow::Result<Point> {
    let mut latencies = Vec::with_capacity(samples);
    let wal_before = wal_lsn(pool).await?;
    for _ in 0..samples {
        let id = if ordered { MessageId::time_ordered() } else { MessageId::random() };
        let mut tx = inbox.begin().await?;
        let watch = Stopwatch::start();
        inbox.claim(&mut tx, "shipping", &id, Timestamp::from_millis(1)).await?;
        latencies.push(watch.elapsed());
        inbox.commit(tx).await?;
    }
    let wal = wal_lsn(pool).await? - wal_before;
    latencies.sort();
    let total: Duration = latencies.iter().sum();
    let n = u32::try_from(latencies.len()).unwrap_or(u32::MAX).max(1);
    let pick = |q: usize| latencies.get(latencies.len() * q / 100).copied().unwrap_or_default();
    let ids = if ordered { "time-ordered" } else { "random" };
    let (mean, p50, p99) = ((total / n).as_micros(), pick(50).as_micros(), pick(99).as_micros());
    let wal_per_claim = wal / i64::from(n);
    Ok(Point {
        line: format!(
            "ids={ids} mean_us={mean} p50_us={p50} p99_us={p99} wal_bytes_per_claim={wal_per_claim}"
        ),
        json: serde_json::json!({
            "ids": ids,
            "mean_us": u64::try_from(mean).unwrap_or(u64::MAX),
            "p50_us": u64::try_from(p50).unwrap_or(u64::MAX),
            "p99_us": u64::try_from(p99).unwrap_or(u64::MAX),
            "wal_bytes_per_claim": wal_per_claim,
        }),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    args.retain(|a| a != "--json");
    let [_, samples, sizes] = args.as_slice() else {
        anyhow::bail!("usage: bench_claim_latency <samples> <sizes, comma separated> [--json]");
    };
    let samples: usize = samples.parse()?;
    let sizes: Vec<i64> = sizes.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect("postgres://postgres@127.0.0.1:5432/test")
        .await?;
    let table = format!("bench_claims_{}", std::process::id());
    let inbox = SqlxInbox::new(pool.clone(), InboxOptions::new().table(&table)).await?;
    let mut rows: i64 = 0;
    let mut points = Vec::new();
    for size in sizes {
        if size > rows {
            // Random-looking ids (md5), as a broker that assigns random ids produces.
            let watch = Stopwatch::start();
            let mut from = rows;
            while from < size {
                let to = (from + 1_000_000).min(size);
                sqlx::query(&format!(
                    "INSERT INTO {table} (consumer, message_id, processed_at_ms) \
                     SELECT 'shipping', md5(i::text), i FROM generate_series($1::bigint, $2::bigint) i"
                ))
                .bind(from + 1)
                .bind(to)
                .execute(&pool)
                .await?;
                from = to;
            }
            sqlx::query(&format!("VACUUM ANALYZE {table}")).execute(&pool).await?;
            eprintln!("filled to {size} rows in {:.0} s", watch.elapsed().as_secs_f64());
        }
        let count: i64 =
            sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&pool).await?;
        for ordered in [false, true] {
            let mut point = measure(&inbox, &pool, samples, ordered).await?;
            println!("rows_before={count} samples={samples} {}", point.line);
            point.json["rows_before"] = count.into();
            points.push(point.json);
        }
        rows =
            sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(&pool).await?;
    }
    sqlx::query(&format!("DROP TABLE {table}")).execute(&pool).await?;
    sqlx::query(&format!("DROP TABLE {table}_migrations")).execute(&pool).await?;
    if json {
        let line = serde_json::json!({
            "bench": "bench_claim_latency",
            "samples": samples,
            "points": points,
        });
        println!("{line}");
    }
    Ok(())
}
