//! Business keys name a table and a key: a violation is a business-key duplicate only when it
//! is the registered key of the registered table.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::Transaction;
use twice::{Context, HandlerError, Inbox, Json, JsonHandler, Outcome, Processor, SharedClock};
use twice_sqlx::{InboxOptions, SqlxInbox, StoreError};

use crate::on_all_stores;
use crate::processor::{OrderPlaced, order};
use crate::support::{Fixture, Shutdown, create_shipments, queue, until};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;

/// Gives `shipments` a unique key `uq_order` on its order id, and makes a second table,
/// `returns`, with a unique key of the same name; returns the second table's name as a handler
/// writes it. PostgreSQL names indexes once per schema, so there the second table is
/// `other.shipments`: the same table name, in another schema.
async fn same_named_keys<F: Fixture>(f: &F) -> &'static str {
    create_shipments(f, false).await;
    match F::NAME {
        "postgres" => {
            f.exec("ALTER TABLE shipments ADD CONSTRAINT uq_order UNIQUE (order_id)").await;
            f.exec("CREATE SCHEMA other").await;
            f.exec(
                "CREATE TABLE other.shipments (order_id BIGINT NOT NULL, \
                 CONSTRAINT uq_order UNIQUE (order_id))",
            )
            .await;
            "other.shipments"
        }
        "mariadb" => {
            f.exec("ALTER TABLE shipments ADD UNIQUE KEY uq_order (order_id)").await;
            f.exec(
                "CREATE TABLE returns (order_id BIGINT NOT NULL, UNIQUE KEY uq_order (order_id)) \
                 ENGINE = InnoDB",
            )
            .await;
            "returns"
        }
        _ => {
            // SQLite names indexes once per database; a table constraint may carry the name.
            f.exec("CREATE UNIQUE INDEX uq_order ON shipments (order_id)").await;
            f.exec(
                "CREATE TABLE returns (order_id INTEGER NOT NULL, \
                 CONSTRAINT uq_order UNIQUE (order_id))",
            )
            .await;
            "returns"
        }
    }
}

/// Writes the order into `table` (not the registered one).
struct WriteTo<F> {
    table: &'static str,
    calls: Arc<AtomicUsize>,
    _store: PhantomData<fn() -> F>,
}

impl<F: Fixture> JsonHandler<OrderPlaced, Transaction<'static, F::DB>> for WriteTo<F> {
    async fn handle<'a>(
        &'a self,
        _ctx: Context<'a>,
        order: OrderPlaced,
        tx: &'a mut Transaction<'static, F::DB>,
    ) -> Result<Outcome, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let sql = format!("INSERT INTO {} (order_id) VALUES ({})", self.table, order.order_id);
        F::try_exec(tx, &sql).await?;
        Ok(Outcome::Complete)
    }
}

/// Two tables have a unique key of the same name; the inbox registers the one on
/// `shipments`. A message whose work violates the other table's key is not completed as a
/// business-key duplicate: its error is the handler's, retried and left to the broker. On
/// MariaDB, whose error names only the key, the inbox refuses the ambiguous configuration.
async fn a_same_named_key_on_another_table_is_not_a_business_key<F: Fixture>(f: F)
where
    F::DB: twice_sqlx::Backend,
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let other = same_named_keys(&f).await;
    let options =
        InboxOptions::new().table("inbox_same_name").business_key("shipments", "uq_order");
    let inbox = match SqlxInbox::new(f.pool().clone(), options).await {
        Ok(inbox) => inbox,
        // MariaDB's error names only the key, which here names two tables' keys: the
        // configuration is refused at start, so no violation can be taken for the other one.
        Err(StoreError::AmbiguousBusinessKey { key, tables }) if F::NAME == "mariadb" => {
            assert_eq!(key, "uq_order");
            assert_eq!(tables, ["returns", "shipments"]);
            return;
        }
        Err(e) => panic!("{}: {e}", F::NAME),
    };
    let (queue, clock) = queue("orders").await;
    let handler = WriteTo::<F> { table: other, calls: Arc::default(), _store: PhantomData };
    let calls = Arc::clone(&handler.calls);
    let receiver = Arc::new(queue.receiver().await);
    let options =
        twice::ProcessorOptions::new().consumer("returns").clock(SharedClock::from(clock.clone()));
    let p = Processor::from_arcs(receiver, Arc::new(inbox), Arc::new(Json::new(handler)), options);
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    queue.send(order("order-5-returned-a", 5)).await;
    until("the first message completed", || counters.snapshot().completed == 1).await;
    queue.send(order("order-5-returned-b", 5)).await;
    until("the second message settled", || {
        let s = counters.snapshot();
        s.completed + s.abandoned + s.dead_lettered >= 2
    })
    .await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    assert_eq!(s.duplicates_business_key, 0, "{}: not the registered key: {s:?}", F::NAME);
    assert_eq!((s.committed, s.completed), (1, 1), "{}: {s:?}", F::NAME);
    assert!(s.abandoned >= 1 && s.handler_errors >= 1, "{}: {s:?}", F::NAME);
    assert!(calls.load(Ordering::SeqCst) >= 2);
    assert_eq!(f.count(&format!("SELECT COUNT(*) FROM {other}")).await, 1);
    assert_eq!(queue.active_count().await, 1, "the second message waits for a redelivery");
}
on_all_stores!(a_same_named_key_on_another_table_is_not_a_business_key);
