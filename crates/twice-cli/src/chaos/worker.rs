//! `twice chaos-worker`: one processor process of a chaos run. It runs `twice::Processor`
//! with the PostgreSQL inbox and the shipping handler on the run's broker (`twice serve`
//! through the Service Bus client, RabbitMQ or NATS JetStream), and prints every delivery,
//! handler run and settlement as a line the controller records:
//!
//! ```text
//! EV <millis since the epoch> <D|H|C|F|L|A> <message id> [<delivery count> <locked until>]
//! ```
//!
//! With `--abort-after-commit P` it calls `abort()` right after a transaction commits, before
//! the completion, with probability P: the crash between commit and complete.
//!
//! The handler sends `OrderShipped` through the outbox (to the events' queue), and the
//! worker also runs a relay of that outbox and the loyalty processor that consumes the queue,
//! so a kill of the worker kills a relay too. With `--relay-abort-after-ack P` it calls
//! `abort()` after the broker acknowledged a relay's turn, before the relay deleted its rows,
//! with probability P per turn.

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rand::{Rng as _, SeedableRng as _};
use serde::Deserialize;
use sqlx::Postgres;
use twice::{
    DeadLetterReason, Delivery, EntityInfo, HandlerError, Message, Outcome, Processor,
    ProcessorOptions, Properties, Publish, Receive, Relay, RelayOptions, ResultExt as _,
    SharedClock, Timestamp, Transport, TransportError, json_fn,
};
use twice_nats::NatsTransport;
use twice_rabbitmq::RabbitMqTransport;
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};
use twice_sqlx::{InboxOptions, OutboxOptions, SqlxInbox, SqlxOutbox};

use super::broker::{BrokerKind, nats_options, rabbitmq_options};
use crate::demo::db::{DemoDb as _, Tables};
use crate::demo::services::Client;

/// Options of `twice chaos-worker` (started by `twice chaos`, not by hand).
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    /// A Service Bus connection string (`twice serve`), an `amqp://` URI or a `nats://` URL.
    #[arg(long)]
    broker: String,
    /// The orders' queue or stream.
    #[arg(long)]
    queue: String,
    /// The events' queue or stream.
    #[arg(long)]
    shipped: String,
    #[arg(long)]
    store: String,
    /// The run id the table names carry.
    #[arg(long)]
    run_id: String,
    #[arg(long)]
    payments: SocketAddr,
    #[arg(long)]
    mail: SocketAddr,
    #[arg(long, default_value_t = 0.0)]
    abort_after_commit: f64,
    #[arg(long, default_value_t = 0.0)]
    relay_abort_after_ack: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Orders per transaction (`ProcessorOptions::batch_size`).
    #[arg(long, default_value_t = 1)]
    batch: usize,
}

/// The message body of the chaos run's orders.
#[derive(Debug, Deserialize)]
pub(crate) struct Order {
    pub(crate) order_id: u64,
    pub(crate) amount_cents: i64,
}

/// Prints one event line. Standard output is line-buffered, and each line is written whole
/// with one call, so a kill loses at most the line being written.
fn emit(clock: &SharedClock, kind: char, id: &str, extra: Option<String>) {
    let at = clock.now().as_millis();
    let line = match extra {
        Some(more) => format!("EV {at} {kind} {id} {more}\n"),
        None => format!("EV {at} {kind} {id}\n"),
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// A transport that records each delivery and settlement.
#[derive(Debug)]
struct Recording<T> {
    inner: T,
    clock: SharedClock,
}

fn id_of(d: &impl Delivery) -> &str {
    d.message().message_id().as_str()
}

impl<T: Transport> Receive for Recording<T> {
    type Delivery = T::Delivery;

    async fn receive(&self, n: usize, wait: Duration) -> Result<Vec<T::Delivery>, TransportError> {
        let got = self.inner.receive(n, wait).await?;
        for d in &got {
            let m = d.message();
            let until = m.locked_until.map_or(i64::MAX, Timestamp::as_millis);
            emit(&self.clock, 'D', id_of(d), Some(format!("{} {until}", m.delivery_count)));
        }
        Ok(got)
    }

    async fn complete(&self, d: &T::Delivery) -> Result<(), TransportError> {
        let r = self.inner.complete(d).await;
        emit(&self.clock, if r.is_ok() { 'C' } else { 'F' }, id_of(d), None);
        r
    }

    async fn abandon(&self, d: &T::Delivery, p: Properties) -> Result<(), TransportError> {
        self.inner.abandon(d, p).await
    }

    async fn dead_letter(
        &self,
        d: &T::Delivery,
        r: DeadLetterReason,
    ) -> Result<(), TransportError> {
        let result = self.inner.dead_letter(d, r).await;
        if result.is_ok() {
            emit(&self.clock, 'L', id_of(d), None);
        }
        result
    }

    async fn defer(&self, d: &T::Delivery) -> Result<(), TransportError> {
        self.inner.defer(d).await
    }
}

impl<T: Transport> Transport for Recording<T> {
    fn entity(&self) -> &EntityInfo {
        self.inner.entity()
    }

    fn claim_scope(&self) -> &str {
        self.inner.claim_scope()
    }

    async fn read_entity(&self) -> Result<EntityInfo, TransportError> {
        self.inner.read_entity().await
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    async fn release(&self, d: &T::Delivery) -> Result<(), TransportError> {
        self.inner.release(d).await
    }

    async fn renew_lock(&self, d: &T::Delivery) -> Result<Timestamp, TransportError> {
        self.inner.renew_lock(d).await
    }

    async fn redeliver_later(
        &self,
        d: &T::Delivery,
        delay: Duration,
        p: Properties,
    ) -> Result<(), TransportError> {
        self.inner.redeliver_later(d, delay, p).await
    }
}

/// The error of a rejected order.
#[derive(Debug, thiserror::Error)]
#[error("order {0} has a negative amount")]
struct Rejected(u64);

/// Runs the processor until SIGTERM or a kill.
pub(crate) async fn run(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    // An abort leaves no core file behind.
    let _ = rlimit::setrlimit(rlimit::Resource::CORE, 0, 0);
    let clock = SharedClock::system();
    // A batch takes that many messages per call: the transports' windows grow with it.
    let calls = args.concurrency * args.batch.max(1);
    let kind = if args.broker.to_ascii_lowercase().starts_with("endpoint=") {
        None
    } else {
        Some(BrokerKind::parse(&args.broker).map_err(anyhow::Error::msg)?)
    };
    match kind {
        None => {
            let client = ServiceBusClient::from_connection_string(&args.broker)?;
            let orders =
                client.receiver(&args.queue, ReceiverOptions::new().max_concurrent_calls(calls));
            let shipped =
                client.receiver(&args.shipped, ReceiverOptions::new().max_concurrent_calls(calls));
            let destination = args.shipped.clone();
            run_on(&args, clock, orders, client.publisher(), shipped, destination).await
        }
        Some(BrokerKind::RabbitMq(url)) => {
            // Heartbeats every 2 s: a processor held with SIGSTOP loses its connection, and
            // RabbitMQ hands its messages to another one, as a lock that runs out would.
            let url = format!("{url}{}heartbeat=2", if url.contains('?') { '&' } else { '?' });
            let open = |queue: &str| {
                let options =
                    rabbitmq_options(&url, queue).max_concurrent_calls(calls).clock(clock.clone());
                async move {
                    RabbitMqTransport::connect(options).await.context("connecting to RabbitMQ")
                }
            };
            let (orders, shipped) = (open(&args.queue).await?, open(&args.shipped).await?);
            // The relay publishes to the events' queue on a connection of its own.
            let publisher = open(&args.shipped).await?;
            let destination = args.shipped.clone();
            run_on(&args, clock, orders, publisher, shipped, destination).await
        }
        Some(BrokerKind::Nats(url)) => {
            let open = |stream: &str| {
                let options = nats_options(&url, stream).clock(clock.clone());
                async move { NatsTransport::connect(options).await.context("connecting to NATS") }
            };
            let (orders, shipped) = (open(&args.queue).await?, open(&args.shipped).await?);
            // The events' stream stores its name in lower case as its subject.
            let destination = args.shipped.to_lowercase();
            let publisher = shipped.clone();
            run_on(&args, clock, orders, publisher, shipped, destination).await
        }
        Some(BrokerKind::Serve) => anyhow::bail!("a worker is given the broker's address"),
    }
}

/// Runs the shipping processor on `orders`, the relay of its outbox on `publisher` (to
/// `destination`) and the loyalty processor on `shipped`, until SIGTERM or a kill.
#[allow(clippy::too_many_lines)] // reason: one linear story: stores, the three parts, run
async fn run_on<O, P, S>(
    args: &WorkerArgs,
    clock: SharedClock,
    orders: O,
    publisher: P,
    shipped: S,
    destination: String,
) -> anyhow::Result<ExitCode>
where
    O: Transport,
    P: Publish,
    S: Transport,
{
    let pool = sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(u32::try_from(args.concurrency).unwrap_or(8) + 2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&args.store)
        .await
        .context("connecting to PostgreSQL")?;
    let tables = Tables::new(&args.run_id);
    // The tables were made by the controller: the processes do not race to migrate.
    let outbox = SqlxOutbox::<Postgres>::new(
        pool.clone(),
        OutboxOptions::new().table(tables.outbox.clone()).migrate(false),
    )
    .await
    .context("opening the outbox")?;
    let inbox = SqlxInbox::<Postgres>::new(
        pool.clone(),
        InboxOptions::new()
            .table(tables.inbox.clone())
            .business_key(tables.shipments.clone(), tables.shipments_key.clone())
            .migrate(false),
    )
    .await
    .context("opening the inbox")?
    .with_outbox(outbox.clone());
    let receiver = Recording { inner: orders, clock: clock.clone() };
    let payments = Arc::new(Client::new(args.payments));
    let mail = Arc::new(Client::new(args.mail));
    let table: Arc<str> = tables.shipments.clone().into();
    let destination: Arc<str> = destination.into();
    let handler_clock = clock.clone();
    let handler =
        json_fn(move |ctx, order: Order, tx: &mut sqlx::Transaction<'static, Postgres>| {
            let (payments, mail, table) =
                (Arc::clone(&payments), Arc::clone(&mail), Arc::clone(&table));
            let destination = Arc::clone(&destination);
            let clock = handler_clock.clone();
            Box::pin(async move {
                emit(&clock, 'H', ctx.message().message_id().as_str(), None);
                if order.amount_cents < 0 {
                    return Err(HandlerError::permanent("OrderRejected", Rejected(order.order_id)));
                }
                let order_id = i64::try_from(order.order_id).permanent("OrderRejected")?;
                Postgres::insert_shipment(tx, &table, order_id, order.amount_cents).await?;
                let shipped = format!(r#"{{"order_id":{}}}"#, order.order_id);
                ctx.send(&destination, Message::new(shipped))?;
                let key = format!("order-{}", order.order_id);
                let charge = format!(
                    r#"{{"order_id":{},"amount_cents":{}}}"#,
                    order.order_id, order.amount_cents
                );
                payments
                    .post(
                        "/charges",
                        Some(ctx.business_idempotency_key(&key, "charge").as_str()),
                        charge.as_bytes(),
                    )
                    .await
                    .map_err(|e| HandlerError::transient(e.into_boxed_dyn_error()))?;
                let email = format!(r#"{{"order_id":{}}}"#, order.order_id);
                mail.post(
                    "/emails",
                    Some(ctx.business_idempotency_key(&key, "email").as_str()),
                    email.as_bytes(),
                )
                .await
                .map_err(|e| HandlerError::transient(e.into_boxed_dyn_error()))?;
                Ok(Outcome::Complete)
            })
        });
    let options = ProcessorOptions::new()
        .consumer("shipping")
        .max_concurrent_calls(args.concurrency)
        .batch_size(args.batch)
        .max_wait(Duration::from_millis(200))
        .clock(clock.clone());
    let rate = args.abort_after_commit;
    let rng = std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(args.seed));
    let abort_clock = clock.clone();
    let processor = Processor::new(receiver, inbox, handler, options)
        .on_committed(move |m| {
            let hit =
                rng.lock().unwrap_or_else(std::sync::PoisonError::into_inner).random_bool(rate);
            if hit {
                emit(&abort_clock, 'A', m.message_id().as_str(), None);
                std::process::abort();
            }
        })
        .on_error(|e| eprintln!("{e}"));

    // The relay of the outbox, on the same broker.
    let relay_rate = args.relay_abort_after_ack;
    let relay_rng =
        std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(args.seed.wrapping_add(1)));
    let relay_clock = clock.clone();
    let relay = Relay::new(
        outbox,
        publisher,
        RelayOptions::new().lease_duration(super::LOCK).clock(clock.clone()),
    )
    .on_acknowledged(move |seqs| {
        let hit = relay_rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .random_bool(relay_rate);
        if hit {
            let first = seqs.first().map_or_else(String::new, ToString::to_string);
            emit(&relay_clock, 'R', &first, None);
            std::process::abort();
        }
        std::ops::ControlFlow::Continue(())
    });

    // The loyalty service downstream: one points row per event it handles.
    let loyalty_inbox = SqlxInbox::<Postgres>::new(
        pool.clone(),
        InboxOptions::new().table(tables.loyalty_inbox.clone()).migrate(false),
    )
    .await
    .context("opening the loyalty inbox")?;
    let points: Arc<str> = tables.points.clone().into();
    let loyalty_handler =
        json_fn(move |ctx, event: Shipped, tx: &mut sqlx::Transaction<'static, Postgres>| {
            let points = Arc::clone(&points);
            Box::pin(async move {
                let order_id = i64::try_from(event.order_id).permanent("InvalidEvent")?;
                Postgres::insert_points(tx, &points, order_id, ctx.message_id().as_str()).await?;
                Ok(Outcome::Complete)
            })
        });
    let loyalty = Processor::new(
        shipped,
        loyalty_inbox,
        loyalty_handler,
        ProcessorOptions::new()
            .consumer("loyalty")
            .max_concurrent_calls(args.concurrency)
            .batch_size(args.batch)
            .max_wait(Duration::from_millis(200))
            .clock(clock.clone()),
    )
    .on_error(|e| eprintln!("loyalty: {e}"));

    println!("ready");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        crate::serve::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let (processed, (), handled) = tokio::join!(
        processor.run(stopped(stop_rx.clone())),
        relay.run(stopped(stop_rx.clone())),
        loyalty.run(stopped(stop_rx.clone())),
    );
    processed.context("the processor stopped")?;
    handled.context("the loyalty processor stopped")?;
    Ok(ExitCode::SUCCESS)
}

/// The `OrderShipped` event of the chaos run.
#[derive(Debug, Deserialize)]
struct Shipped {
    order_id: u64,
}
