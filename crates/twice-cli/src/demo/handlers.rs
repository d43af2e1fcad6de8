//! The two handlers of the seed's shipping example, run under the same faults: the naive one
//! ("Where it goes wrong": charge and email with no guard) and the twice one (claim in the
//! transaction, the shipment's unique business key, idempotency keys for payments and mail).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use sqlx::{Pool, Transaction};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use twice::{
    Context, Delivery as _, HandlerError, Message, MessageId, Outcome, Properties, Receive,
    ReceivedMessage, ResultExt, SharedClock,
};

use super::broker::{DemoDelivery, DemoTransport};
use super::db::DemoDb;
use super::faults::{FaultTable, FaultyReceiver};
use super::services::Client;

/// The destination name the twice handler sends `OrderShipped` to; the relay's publisher maps
/// it to the run's queue.
pub(crate) const SHIPPED: &str = "shipped";

/// The message body.
#[derive(Debug, Deserialize)]
pub(crate) struct OrderPlaced {
    pub(crate) order_id: u64,
    pub(crate) amount_cents: i64,
    pub(crate) email: String,
}

/// What both handlers share: the services they call and the faults they meet.
#[derive(Debug)]
pub(crate) struct Shop {
    pub(crate) payments: Client,
    pub(crate) mail: Client,
    pub(crate) faults: Arc<FaultTable>,
    /// How long a slow handler stalls: longer than the lock.
    pub(crate) stall: Duration,
    pub(crate) clock: SharedClock,
}

impl Shop {
    fn charge_body(order: &OrderPlaced) -> Vec<u8> {
        format!(r#"{{"order_id":{},"amount_cents":{}}}"#, order.order_id, order.amount_cents)
            .into_bytes()
    }

    fn email_body(order: &OrderPlaced) -> Vec<u8> {
        format!(r#"{{"order_id":{},"to":{:?}}}"#, order.order_id, order.email).into_bytes()
    }

    /// Stalls past the lock when this is the slow first delivery of its message.
    async fn maybe_stall(&self, message: &ReceivedMessage) {
        if message.delivery_count == 1 && self.faults.get(message.message_id()).slow {
            self.clock.sleep(self.stall).await;
        }
    }

    /// Whether this delivery fails with the planned transient error.
    fn transient_failure(&self, message: &ReceivedMessage) -> bool {
        message.delivery_count <= self.faults.get(message.message_id()).transient_failures
    }
}

/// The error of a rejected order.
#[derive(Debug, thiserror::Error)]
#[error("order {0} has a negative amount")]
pub(crate) struct Rejected(u64);

/// The error of the planned transient failure.
#[derive(Debug, thiserror::Error)]
#[error("the mail service timed out")]
pub(crate) struct MailTimeout;

/// Counters of the naive consumer.
#[derive(Debug, Default)]
pub(crate) struct NaiveCounters {
    pub(crate) deliveries: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    /// `OrderShipped` events it sent.
    pub(crate) published: AtomicU64,
    /// Of those, the ones sent by an attempt whose transaction then rolled back.
    pub(crate) ghosts: AtomicU64,
}

/// The `OrderShipped` event both handlers send, and the loyalty service consumes.
#[derive(Debug, serde::Serialize, Deserialize)]
pub(crate) struct OrderShipped {
    pub(crate) order_id: u64,
    pub(crate) points: i64,
}

impl OrderShipped {
    fn of(order: &OrderPlaced) -> Self {
        Self { order_id: order.order_id, points: order.amount_cents / 100 }
    }

    fn body(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The naive consumer: receive, do the work, complete; an error abandons. No claim, no keys,
/// no lock renewal: what a handler written from the SDK's quick start does. Its shipment is
/// written in a transaction, and it sends `OrderShipped` straight to the broker in the middle
/// of it, as code that publishes "where the work happens" does.
#[derive(Debug)]
pub(crate) struct Naive<DB: DemoDb> {
    pub(crate) receiver: Arc<FaultyReceiver>,
    pub(crate) pool: Pool<DB>,
    pub(crate) table: String,
    pub(crate) shop: Arc<Shop>,
    pub(crate) counters: Arc<NaiveCounters>,
    pub(crate) concurrency: usize,
    /// The queue its `OrderShipped` events go to.
    pub(crate) events: Arc<DemoTransport>,
}

impl<DB: DemoDb> Naive<DB> {
    /// Runs until `stop` resolves, then waits for the handlers in flight.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future aborts the handlers in flight, as a crash would: their messages come
    /// back when their locks expire.
    pub(crate) async fn run(self: Arc<Self>, stop: impl std::future::Future<Output = ()>) {
        let semaphore = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        let mut stop = std::pin::pin!(stop);
        loop {
            while tasks.try_join_next().is_some() {}
            let free = semaphore.available_permits().max(1);
            let received = tokio::select! {
                () = &mut stop => break,
                r = self.receiver.receive(free, Duration::from_millis(200)) => r,
            };
            let Ok(messages) = received else { continue };
            for message in messages {
                let Ok(permit) = Arc::clone(&semaphore).acquire_owned().await else { break };
                let this = Arc::clone(&self);
                tasks.spawn(async move {
                    this.handle(message).await;
                    drop(permit);
                });
            }
        }
        while tasks.join_next().await.is_some() {}
    }

    async fn handle(&self, delivery: DemoDelivery) {
        self.counters.deliveries.fetch_add(1, Ordering::Relaxed);
        if self.work(delivery.message()).await.is_err() {
            self.counters.abandoned.fetch_add(1, Ordering::Relaxed);
            let _ = self.receiver.abandon(&delivery, Properties::new()).await;
            return;
        }
        // A completion refused because the lock was lost is ignored, as quick starts do.
        let _ = self.receiver.complete(&delivery).await;
    }

    pub(super) async fn work(&self, message: &ReceivedMessage) -> anyhow::Result<()> {
        let order: OrderPlaced = serde_json::from_slice(message.body())?;
        if order.amount_cents < 0 {
            return Err(Rejected(order.order_id).into());
        }
        let order_id = i64::try_from(order.order_id)?;
        let mut tx = self.pool.begin().await?;
        DB::insert_shipment(&mut tx, &self.table, order_id, order.amount_cents).await?;
        // Sent to the broker at once, with a new id each time, whatever becomes of the
        // transaction.
        let event = Message::new(OrderShipped::of(&order).body())
            .with_message_id(MessageId::random())
            .with_content_type("application/json");
        self.events.send(event).await?;
        self.counters.published.fetch_add(1, Ordering::Relaxed);
        let rest = async {
            self.shop.payments.post("/charges", None, &Shop::charge_body(&order)).await?;
            self.shop.maybe_stall(message).await;
            if self.shop.transient_failure(message) {
                return Err(MailTimeout.into());
            }
            self.shop.mail.post("/emails", None, &Shop::email_body(&order)).await?;
            anyhow::Ok(())
        };
        let done = match rest.await {
            Ok(()) => tx.commit().await.map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        if done.is_err() {
            // The shipment rolled back; the event is out.
            self.counters.ghosts.fetch_add(1, Ordering::Relaxed);
        }
        done
    }
}

/// The twice handler: its shipment joins the transaction that claimed the message; payments
/// and mail get keys derived from the message id.
pub(crate) async fn handle_twice<DB: DemoDb>(
    shop: &Shop,
    table: &str,
    ctx: Context<'_>,
    order: OrderPlaced,
    tx: &mut Transaction<'static, DB>,
) -> Result<Outcome, HandlerError> {
    if order.amount_cents < 0 {
        return Err(HandlerError::permanent("OrderRejected", Rejected(order.order_id)));
    }
    let order_id = i64::try_from(order.order_id).permanent("OrderRejected")?;
    // A second order with the same id violates the unique business key: the processor rolls
    // back and completes the message.
    DB::insert_shipment(tx, table, order_id, order.amount_cents).await?;
    // Through the outbox: a row in this transaction, sent by the relay only if it commits,
    // with an id derived from this message's, so a re-send is a duplicate downstream.
    let event = Message::new(OrderShipped::of(&order).body()).with_content_type("application/json");
    ctx.send(SHIPPED, event)?;
    // The keys come from the order, not from the message id: the same order published under
    // two message ids passes the business key only once, but a first copy that charged and
    // then rolled back (a transient error, a lost lock, a crash) leaves the charge made, and
    // the second copy must present the same key for the payment service to recognise it.
    let order_key = format!("order-{}", order.order_id);
    let charge_key = ctx.business_idempotency_key(&order_key, "charge");
    shop.payments
        .post("/charges", Some(charge_key.as_str()), &Shop::charge_body(&order))
        .await
        .map_err(|e| HandlerError::transient(e.into_boxed_dyn_error()))?;
    shop.maybe_stall(ctx.message()).await;
    if shop.transient_failure(ctx.message()) {
        return Err(HandlerError::transient(MailTimeout));
    }
    let email_key = ctx.business_idempotency_key(&order_key, "email");
    shop.mail
        .post("/emails", Some(email_key.as_str()), &Shop::email_body(&order))
        .await
        .map_err(|e| HandlerError::transient(e.into_boxed_dyn_error()))?;
    Ok(Outcome::Complete)
}
