//! An order service on RabbitMQ and PostgreSQL.
//!
//! - `rabbitmq-postgres send 1 2 3` sends one `OrderPlaced` per order id, each with a message
//!   id derived from the order (`order-42:OrderPlaced`), confirmed by RabbitMQ. RabbitMQ has no
//!   duplicate detection: a send that is retried, or run again, is delivered again, and the
//!   service's inbox is what drops the copy.
//! - `rabbitmq-postgres run` ships each order exactly once: the processor claims the message id
//!   in PostgreSQL and inserts the shipment in the same transaction, writes an `OrderShipped`
//!   event to the outbox table in that transaction too, and acknowledges the message after the
//!   commit. A relay publishes the committed events. `GET /health` answers 200 while the
//!   processor receives and its database answers. Ctrl-C or SIGTERM stops it: the handlers in
//!   flight finish, then it prints what it did and exits 0.
//!
//! Every setting is a flag or an environment variable; the defaults fit a local RabbitMQ and
//! PostgreSQL.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use std::sync::Arc;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;

use twice::outbox::RelayCounters;
use twice::{Context, Counters, HealthHandle, Message, Outcome, Processor, ProcessorOptions};
use twice::{Relay, RelayOptions, json_fn};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport};
use twice_sqlx::{InboxOptions, OutboxOptions, SqlxInbox, SqlxOutbox};

/// Handlers that run at once (and RabbitMQ's prefetch); the database pool has this many
/// connections and two more.
const MAX_CONCURRENT_CALLS: usize = 8;

#[derive(Debug, Parser)]
#[command(about = "An order service on RabbitMQ and PostgreSQL, exactly once with twice.")]
struct Cli {
    /// The RabbitMQ server (`amqp://user:password@host:port/vhost`).
    #[arg(long, env = "RABBITMQ_URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    rabbitmq_url: String,
    /// The queue of `OrderPlaced` messages (a quorum queue, declared where it is missing).
    #[arg(long, env = "ORDERS_QUEUE", default_value = "orders")]
    orders_queue: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Send one OrderPlaced message per order id.
    Send {
        /// The order ids.
        #[arg(required = true)]
        order_ids: Vec<i64>,
    },
    /// Ship the orders until Ctrl-C or SIGTERM.
    Run {
        /// The PostgreSQL database of the shipments, the inbox and the outbox.
        #[arg(
            long,
            env = "DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/test"
        )]
        database_url: String,
        /// The queue the `OrderShipped` events go to (declared where it is missing).
        #[arg(long, env = "SHIPPED_QUEUE", default_value = "order-shipped")]
        shipped_queue: String,
        /// The address of `GET /health` (port 0: any free port; the address is printed).
        #[arg(long, env = "HEALTH_ADDR", default_value = "127.0.0.1:8080")]
        health_addr: SocketAddr,
    },
}

#[derive(Debug, serde::Deserialize)]
struct OrderPlaced {
    order_id: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Warnings and errors on stderr (`RUST_LOG` says otherwise). lapin logs every channel
    // RabbitMQ closes as an error, the transport's look for a queue that is not there yet
    // included; what matters reaches the transport's own log lines and the errors returned.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,lapin::channel=off".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Send { order_ids } => send(&cli.rabbitmq_url, &cli.orders_queue, &order_ids).await,
        Command::Run { database_url, shipped_queue, health_addr } => {
            run(&cli.rabbitmq_url, &cli.orders_queue, &shipped_queue, &database_url, health_addr)
                .await
        }
    }
}

/// Connects to `queue`, declaring it where it is missing.
async fn connect(url: &str, queue: &str, calls: usize) -> anyhow::Result<RabbitMqTransport> {
    RabbitMqTransport::connect(RabbitMqOptions::new(url, queue).max_concurrent_calls(calls))
        .await
        .with_context(|| format!("connecting to --rabbitmq-url (RABBITMQ_URL), queue {queue}"))
}

/// Sends `OrderPlaced` for each order, with the id `order-<id>:OrderPlaced`.
async fn send(url: &str, queue: &str, order_ids: &[i64]) -> anyhow::Result<()> {
    let orders = connect(url, queue, 1).await?;
    for order_id in order_ids {
        let body = serde_json::json!({ "order_id": order_id }).to_string();
        // An id of the order, not a random one: the inbox recognises a copy only by its id.
        let message = Message::new(body).with_message_id(format!("order-{order_id}:OrderPlaced"));
        // Confirmed by RabbitMQ when it returns; an unconfirmed publish is tried again with
        // the same id.
        let id = orders
            .send(message)
            .await
            .with_context(|| format!("sending order {order_id} to the queue {queue}"))?;
        println!("sent order {order_id} as message {}", id.as_str());
    }
    orders.close().await;
    Ok(())
}

/// Runs the processor, the outbox relay and the health endpoint until Ctrl-C or SIGTERM.
async fn run(
    url: &str,
    orders_queue: &str,
    shipped_queue: &str,
    database_url: &str,
    health_addr: SocketAddr,
) -> anyhow::Result<()> {
    // Installed first, so that a signal from now on stops the service cleanly.
    let shutdown = shutdown_signal()?;

    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(MAX_CONCURRENT_CALLS + 2)?)
        .connect(database_url)
        .await
        .with_context(|| format!("connecting to --database-url (DATABASE_URL) {database_url}"))?;
    create_tables(&pool).await?;

    // The outbox table and the inbox table (created by their migrations), in the same database.
    let outbox = SqlxOutbox::new(pool.clone(), OutboxOptions::new()).await?;
    let inbox = SqlxInbox::new(
        pool.clone(),
        // The same order under another message id violates this key: completed, not shipped twice.
        InboxOptions::new().business_key("shipments", "shipments_pkey"),
    )
    .await?
    .with_outbox(outbox.clone());

    let shipped = shipped_queue.to_owned();
    let handler = json_fn(
        move |ctx: Context<'_>,
              order: OrderPlaced,
              tx: &mut sqlx::Transaction<'static, sqlx::Postgres>| {
            let shipped = shipped.clone();
            Box::pin(async move {
                // The same transaction as the claim of the message id.
                sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
                    .bind(order.order_id)
                    .execute(&mut **tx)
                    .await?;
                // A row of the outbox in this transaction: published once it commits, never
                // for work that rolled back.
                let event = serde_json::json!({ "order_id": order.order_id }).to_string();
                ctx.send(&shipped, Message::new(event))?;
                Ok(Outcome::Complete)
            })
        },
    );

    let orders = connect(url, orders_queue, MAX_CONCURRENT_CALLS).await?;
    // The relay publishes on a connection of its own; connecting declares the queue.
    let events = connect(url, shipped_queue, 1).await?;
    let processor = Processor::new(
        orders.clone(),
        inbox,
        handler,
        ProcessorOptions::new().consumer("shipping").max_concurrent_calls(MAX_CONCURRENT_CALLS),
    );
    let counters = processor.counters();
    let health = processor.health_handle();

    let relay = Relay::new(outbox, events.clone(), RelayOptions::new());
    let relayed = relay.counters();
    // The relay stops after the processor, so that it sends what the last handlers wrote.
    let (stop_relay, relay_stopped) = watch::channel(false);
    let relay = tokio::spawn(relay.run(stopped(relay_stopped)));

    let listener = TcpListener::bind(health_addr)
        .await
        .with_context(|| format!("binding --health-addr (HEALTH_ADDR) {health_addr}"))?;
    println!("health: http://{}/health", listener.local_addr()?);
    let health_task =
        tokio::spawn(serve_health(listener, health, counters.clone(), relayed.clone()));

    println!("shipping orders from {orders_queue}; Ctrl-C stops");
    let ran = processor.run(shutdown).await;
    let _ = stop_relay.send(true);
    let _ = relay.await;
    health_task.abort();
    // Deliveries taken but not handled (none after a clean stop) go back to the queue.
    let unsettled = orders.unsettled();
    orders.close().await;
    events.close().await;
    ran.context("the processor stopped")?;

    let c = counters.snapshot();
    let r = relayed.snapshot();
    println!(
        "stopped: received {}, completed {}, duplicates {} by the inbox and {} by business key, \
         abandoned {}, dead-lettered {}, events sent {}, unsettled {unsettled}",
        c.received,
        c.completed,
        c.duplicates_already_processed + c.duplicates_concurrent_copy,
        c.duplicates_business_key,
        c.abandoned,
        c.dead_lettered,
        r.sent,
    );
    Ok(())
}

/// The shop's own table: one row per shipped order.
async fn create_tables(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS shipments (
             order_id BIGINT PRIMARY KEY,
             shipped_at TIMESTAMPTZ NOT NULL DEFAULT now()
         )",
    )
    .execute(pool)
    .await
    .context("creating the table shipments")?;
    Ok(())
}

/// A future that ends at the first SIGINT (Ctrl-C) or SIGTERM.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()> + Send> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// A future that ends once `rx` holds `true`.
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Reads a request's head (up to its blank line) into `buf`, however the client's writes
/// arrive; returns how many bytes it read (as many as fit when the head is longer, 0 on an
/// error).
async fn read_head(stream: &mut tokio::net::TcpStream, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(read) => n += read,
        }
    }
    n
}

/// Answers `GET /health`: 200 while the processor receives and the database answers, 503
/// otherwise, with what the processor and the relay did so far as JSON. A plain HTTP/1.1
/// responder, one request per connection.
async fn serve_health(
    listener: TcpListener,
    health: HealthHandle,
    counters: Arc<Counters>,
    relayed: Arc<RelayCounters>,
) {
    loop {
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors, say: wait a moment rather than spin.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (health, counters, relayed) = (health.clone(), counters.clone(), relayed.clone());
        tokio::spawn(async move {
            let mut request = [0_u8; 1024];
            let n =
                tokio::time::timeout(Duration::from_secs(5), read_head(&mut stream, &mut request))
                    .await
                    .unwrap_or(0);
            let (status, content_type, body) = if request[..n].starts_with(b"GET /health ") {
                let report = health.check().await;
                let healthy = report.is_healthy();
                let (c, r) = (counters.snapshot(), relayed.snapshot());
                let body = serde_json::json!({
                    "healthy": healthy,
                    "receiving": report.receiving,
                    "database": report.inbox_reachable.err().unwrap_or_else(|| "ok".to_owned()),
                    "received": c.received,
                    "completed": c.completed,
                    "duplicates_by_inbox": c.duplicates_already_processed + c.duplicates_concurrent_copy,
                    "duplicates_by_business_key": c.duplicates_business_key,
                    "abandoned": c.abandoned,
                    "dead_lettered": c.dead_lettered,
                    "events_sent": r.sent,
                });
                let status = if healthy { "200 OK" } else { "503 Service Unavailable" };
                (status, "application/json", format!("{body}\n"))
            } else {
                ("404 Not Found", "text/plain", "not found\n".to_owned())
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}
