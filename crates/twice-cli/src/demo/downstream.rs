//! The producing half of the demo: each column's shipping handler announces `OrderShipped`
//! (the naive one straight to the broker, the twice one through its outbox and a relay), and a
//! loyalty service (a twice processor in both columns, so that only the producing side
//! differs) awards points per event it handles. What the loyalty tables end with says whether
//! each valid order's event arrived exactly once and no event came from work that rolled back.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::Transaction;
use twice::outbox::outgoing_message_id;
use twice::{
    Context, Inbox, Message, MessageId, Outcome, Processor, ProcessorOptions, Publish, SharedClock,
    Transport as _, TransportError, json_fn,
};
use twice_sqlx::{InboxOptions, SqlxInbox};

use super::broker::DemoTransport;
use super::db::DemoDb;
use super::handlers::{OrderShipped, SHIPPED};
use super::plan::{OrderKind, Plan};
use super::report::Events;

/// The relay's publisher: the handler's destination `shipped` is the run's queue.
#[derive(Debug)]
pub(crate) struct DemoPublisher {
    pub(crate) shipped: Arc<DemoTransport>,
    /// Re-sent events the broker said it dropped (where it says so).
    pub(crate) duplicates: AtomicU64,
}

impl Publish for DemoPublisher {
    fn system(&self) -> &'static str {
        self.shipped.system()
    }

    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        if destination != SHIPPED {
            return Err(TransportError::EntityNotFound(destination.to_owned()));
        }
        match self.shipped.send(message).await {
            Ok(duplicate) => {
                if duplicate {
                    self.duplicates.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
            Err(e) => Err(match e.downcast::<TransportError>() {
                Ok(e) => e,
                Err(e) => TransportError::Other {
                    message: crate::errors::render(&e),
                    transient: true,
                    source: None,
                },
            }),
        }
    }
}

/// The loyalty service of one column: a twice processor on its `OrderShipped` queue that
/// writes a points row per event it handles, with the event's id.
pub(crate) async fn loyalty<DB>(
    queue: Arc<DemoTransport>,
    pool: sqlx::Pool<DB>,
    inbox_table: &str,
    points_table: &str,
    concurrency: usize,
    clock: SharedClock,
) -> anyhow::Result<
    Processor<DemoTransport, SqlxInbox<DB>, impl twice::Handler<Transaction<'static, DB>>>,
>
where
    DB: DemoDb,
    SqlxInbox<DB>: Inbox<Tx = Transaction<'static, DB>>,
{
    let inbox = SqlxInbox::<DB>::new(pool, InboxOptions::new().table(inbox_table)).await?;
    let table: Arc<str> = points_table.into();
    let handler =
        json_fn(move |ctx: Context<'_>, event: OrderShipped, tx: &mut Transaction<'static, DB>| {
            let table = Arc::clone(&table);
            Box::pin(async move {
                let order_id = i64::try_from(event.order_id).unwrap_or(i64::MAX);
                DB::insert_points(tx, &table, order_id, ctx.message_id().as_str()).await?;
                Ok(Outcome::Complete)
            })
        });
    let options = ProcessorOptions::new()
        .consumer("loyalty")
        .max_concurrent_calls(concurrency)
        .max_wait(Duration::from_millis(200))
        .clock(clock);
    Ok(Processor::from_arcs(queue, Arc::new(inbox), Arc::new(handler), options))
}

/// What the loyalty table of a column says about its events. `committed_ids`, for the twice
/// column, are the incoming message ids whose handler committed (its inbox): an event whose id
/// is not derived from one of them came from work that rolled back.
pub(crate) fn events(
    plan: &Plan,
    points_by_order: &HashMap<u64, u64>,
    event_ids: &[String],
    committed_ids: Option<&[String]>,
) -> Events {
    let mut e = Events { points: points_by_order.values().sum(), ..Events::default() };
    for o in &plan.orders {
        let n = points_by_order.get(&o.order_id).copied().unwrap_or(0);
        match o.kind {
            OrderKind::Valid if n == 0 => e.lost += 1,
            OrderKind::Valid if n > 1 => e.repeated += 1,
            OrderKind::Valid => {}
            OrderKind::BadJson | OrderKind::Rejected => e.for_unshipped_orders += n,
        }
    }
    if let Some(committed) = committed_ids {
        let expected: HashSet<String> = committed
            .iter()
            .map(|id| outgoing_message_id("shipping", &MessageId::new(id), 0).into_string())
            .collect();
        let seen: HashSet<&String> = event_ids.iter().collect();
        e.for_rolled_back_work = seen.iter().filter(|id| !expected.contains(**id)).count() as u64;
    }
    e
}
