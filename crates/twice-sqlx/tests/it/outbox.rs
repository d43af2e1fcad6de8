//! The transactional outbox on every store: a handler's messages commit with its work, are
//! relayed with stable ids, in order per ordering key, by any number of relays.

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::Transaction;
use twice::outbox::{OutboxStore, outgoing_message_id};
use twice::{
    Context, HandlerError, Inbox, Json, JsonHandler, Message, MessageId, Outcome, Processor,
    ProcessorOptions, Publish, Relay, RelayOptions, SequenceNumber, SharedClock, TransportError,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{InboxOptions, OutboxOptions, RowState, SqlxInbox, SqlxOutbox, StoreError};

use crate::on_all_stores;
use crate::processor::{OrderPlaced, order};
use crate::support::{Fixture, Shutdown, create_shipments, shipments, until, until_async};

type Inboxed<F> = SqlxInbox<<F as Fixture>::DB>;
type Outboxed<F> = SqlxOutbox<<F as Fixture>::DB>;

/// Ships the order and announces it through the outbox: `count` messages to `destination`,
/// in a session when `session` is set; fails transiently after sending while `fail_times` is
/// above zero, and returns `outcome_after` instead of completing when set.
struct Announce<F> {
    destination: &'static str,
    count: usize,
    session: Option<&'static str>,
    fail_times: Arc<AtomicUsize>,
    dead_letter: bool,
    /// While true, the handler runs a statement that fails after sending, once, ignores the
    /// error and returns `Complete` (a handler that logs and carries on).
    swallow_error_once: Arc<AtomicBool>,
    runs: Arc<AtomicUsize>,
    _store: PhantomData<fn() -> F>,
}

impl<F> Announce<F> {
    fn new(destination: &'static str, count: usize) -> Self {
        Self {
            destination,
            count,
            session: None,
            fail_times: Arc::default(),
            dead_letter: false,
            swallow_error_once: Arc::default(),
            runs: Arc::default(),
            _store: PhantomData,
        }
    }
}

impl<F: Fixture> JsonHandler<OrderPlaced, Transaction<'static, F::DB>> for Announce<F> {
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        order: OrderPlaced,
        tx: &'a mut Transaction<'static, F::DB>,
    ) -> Result<Outcome, HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        F::insert_shipment(tx, order.order_id, ctx.message_id().as_str()).await?;
        for n in 0..self.count {
            let body = format!(r#"{{"order_id":{},"n":{n}}}"#, order.order_id);
            let mut message = Message::new(body);
            if let Some(session) = self.session {
                message = message.with_session_id(session);
            }
            ctx.send(self.destination, message)?;
        }
        if self.swallow_error_once.swap(false, Ordering::SeqCst) {
            let failed = F::try_exec(tx, "INSERT INTO no_such_table (x) VALUES (1)").await;
            assert!(failed.is_err(), "the statement must fail");
        }
        let fail = self
            .fail_times
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(HandlerError::transient(std::io::Error::other("downstream unavailable")));
        }
        if self.dead_letter {
            return Ok(Outcome::dead_letter("Refused", "this order is refused"));
        }
        Ok(Outcome::Complete)
    }
}

/// An embedded broker with `orders` (the incoming queue) and `shipped` (where the handler's
/// messages go: no duplicate detection, so every send the relay makes shows).
async fn broker() -> Broker {
    let broker = Broker::open(BrokerOptions::in_memory().max_message_size(64 * 1024))
        .await
        .expect("open broker");
    for queue in ["orders", "shipped"] {
        broker
            .create_queue(
                queue,
                QueueProperties::default().with_lock_duration(Duration::from_secs(30)),
            )
            .await
            .expect("create queue");
    }
    broker
}

async fn processor<F: Fixture>(
    broker: &Broker,
    inbox: Arc<Inboxed<F>>,
    handler: Announce<F>,
) -> Processor<twice_broker::Receiver, Inboxed<F>, Json<Announce<F>, OrderPlaced>>
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let receiver = Arc::new(broker.receiver("orders").await.expect("receiver"));
    Processor::from_arcs(
        receiver,
        inbox,
        Arc::new(Json::new(handler)),
        ProcessorOptions::new().consumer("shipping").max_concurrent_calls(4),
    )
    .on_error(|e| eprintln!("{} processor: {e}", F::NAME))
}

fn relay_options() -> RelayOptions {
    RelayOptions::new()
        .poll_interval(Duration::from_millis(20))
        .lease_duration(Duration::from_secs(30))
        .backoff(Duration::from_millis(5), Duration::from_millis(50))
}

/// Every message in `queue`, peeked in order.
async fn peek_all(broker: &Broker, queue: &str) -> Vec<twice::ReceivedMessage> {
    broker.peek(queue, SequenceNumber::new(0), 10_000).await.expect("peek")
}

async fn outbox_rows<F: Fixture>(f: &F, table: &str) -> i64 {
    f.count(&format!("SELECT COUNT(*) FROM {table}")).await
}

/// Work that rolls back leaves no row and sends nothing; work that commits has its rows, with
/// the ids derived from the incoming message, and the relay sends exactly those.
async fn rollback_leaves_no_message_commit_always_has_its_rows<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    create_shipments(&f, false).await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_rb")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_rb")).await.with_outbox(outbox.clone());
    let inbox = Arc::new(inbox);
    let broker = broker().await;
    let shutdown = Shutdown::default();

    // Order 1 fails twice after sending (both attempts roll back), then commits; order 2 is
    // refused after sending (rolled back, dead-lettered).
    let handler = Announce::<F>::new("shipped", 2);
    handler.fail_times.store(2, Ordering::SeqCst);
    let runs = handler.runs.clone();
    let p = processor::<F>(&broker, inbox.clone(), handler).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    broker.send("orders", order("order-1-placed", 1)).await.expect("send");
    until("order 1 committed", || counters.snapshot().completed == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    assert_eq!(runs.load(Ordering::SeqCst), 3, "two rolled-back runs and one that committed");
    assert_eq!(outbox_rows(&f, "outbox_rb").await, 2, "{}: only the committed run's rows", F::NAME);

    let shutdown = Shutdown::default();
    let mut refusing = Announce::<F>::new("shipped", 2);
    refusing.dead_letter = true;
    let p = processor::<F>(&broker, inbox.clone(), refusing).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    broker.send("orders", order("order-2-placed", 2)).await.expect("send");
    until("order 2 dead-lettered", || counters.snapshot().dead_lettered == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    assert_eq!(outbox_rows(&f, "outbox_rb").await, 2, "{}: a refused run leaves no row", F::NAME);
    assert_eq!(shipments(&f).await, 1);

    // The store's stage joins the transaction: staged, then rolled back, nothing is left.
    let staged = twice::outbox::Outgoing::for_message(
        "shipping",
        &MessageId::new("order-3-placed"),
        None,
        twice::Timestamp::UNIX_EPOCH,
    );
    staged.push("shipped", Message::new("ghost")).expect("valid");
    let mut tx = inbox.begin().await.expect("begin");
    let now = twice::Timestamp::UNIX_EPOCH;
    inbox.claim(&mut tx, "shipping", &MessageId::new("order-3-placed"), now).await.expect("claim");
    let written = inbox.stage(&mut tx, &staged.take()).await.expect("stage");
    assert!(written.wrote());
    inbox.rollback(tx).await.expect("rollback");
    drop(written);
    assert_eq!(outbox_rows(&f, "outbox_rb").await, 2, "{}: staged and rolled back", F::NAME);

    // Nothing was sent before the relay runs: the rows wait for it.
    assert!(peek_all(&broker, "shipped").await.is_empty());
    let relay = Relay::new(outbox.clone(), broker.clone(), relay_options());
    let sent = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    until("two sent", || sent.snapshot().sent == 2).await;
    until_async("the rows deleted", || async { outbox_rows(&f, "outbox_rb").await == 0 }).await;
    shutdown.trigger();
    task.await.expect("join");

    let shipped = peek_all(&broker, "shipped").await;
    let ids: Vec<MessageId> = shipped.iter().map(|m| m.message_id().clone()).collect();
    let incoming = MessageId::new("order-1-placed");
    assert_eq!(
        ids,
        [
            outgoing_message_id("shipping", &incoming, 0),
            outgoing_message_id("shipping", &incoming, 1)
        ],
        "{}: the committed run's messages, in order, with derived ids",
        F::NAME
    );
    assert_eq!(&shipped[1].body()[..], br#"{"order_id":1,"n":1}"#);
}
on_all_stores!(rollback_leaves_no_message_commit_always_has_its_rows);

/// A handler that sends, then swallows a failed statement and returns `Complete`: on
/// PostgreSQL the failure aborted the transaction, and the outbox's insert (the only check
/// before the commit once rows are staged) finds it, so the attempt is the handler's failure
/// and the second attempt commits the work with its rows. (On MariaDB and SQLite a failed
/// statement leaves the transaction usable, and the first attempt commits.) Either way the
/// rows are exactly the committed run's.
async fn an_aborted_transaction_stages_nothing_and_is_retried<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    create_shipments(&f, false).await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_ab")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_ab")).await.with_outbox(outbox.clone());
    let broker = broker().await;
    let shutdown = Shutdown::default();
    let handler = Announce::<F>::new("shipped", 2);
    handler.swallow_error_once.store(true, Ordering::SeqCst);
    let runs = handler.runs.clone();
    let p = processor::<F>(&broker, Arc::new(inbox), handler).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    broker.send("orders", order("order-5-placed", 5)).await.expect("send");
    until("order 5 committed", || counters.snapshot().completed == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");

    let s = counters.snapshot();
    let expected_runs = if F::NAME == "postgres" { 2 } else { 1 };
    assert_eq!(runs.load(Ordering::SeqCst), expected_runs, "{}: {s:?}", F::NAME);
    assert_eq!(s.handler_errors, u64::try_from(expected_runs - 1).unwrap_or(0), "{s:?}");
    assert_eq!(s.committed, 1, "{}: {s:?}", F::NAME);
    assert_eq!(shipments(&f).await, 1, "{}: the completed message has its work", F::NAME);
    assert_eq!(outbox_rows(&f, "outbox_ab").await, 2, "{}: and its two rows", F::NAME);
}
on_all_stores!(an_aborted_transaction_stages_nothing_and_is_retried);

/// A process that committed and stopped before any relay ran (no relay in it at all) leaves
/// its rows; a relay started later, elsewhere, sends them once.
async fn committed_rows_wait_for_a_relay_started_later<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    create_shipments(&f, false).await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_late")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_late")).await.with_outbox(outbox.clone());
    let broker = broker().await;
    let shutdown = Shutdown::default();
    let p = processor::<F>(&broker, Arc::new(inbox), Announce::new("shipped", 1)).await;
    let counters = p.counters();
    let task = tokio::spawn(p.run(shutdown.wait()));
    for i in 0..20 {
        broker.send("orders", order(&format!("order-{i}-placed"), i)).await.expect("send");
    }
    until("all committed", || counters.snapshot().completed == 20).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    drop(outbox);

    // Another instance: a relay on a fresh handle to the same table, never woken by a commit.
    let later = f.outbox(OutboxOptions::new().table("outbox_late")).await.expect("outbox");
    let stats = later.stats().await.expect("stats");
    assert_eq!(stats.pending, 20, "{}: {stats:?}", F::NAME);
    let relay = Relay::new(later, broker.clone(), relay_options());
    let sent = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    until("twenty sent", || sent.snapshot().sent == 20).await;
    shutdown.trigger();
    task.await.expect("join");
    let shipped = peek_all(&broker, "shipped").await;
    let distinct: HashSet<&MessageId> = shipped.iter().map(|m| m.message_id()).collect();
    assert_eq!((shipped.len(), distinct.len()), (20, 20), "{}", F::NAME);
}
on_all_stores!(committed_rows_wait_for_a_relay_started_later);

/// A relay that dies between the broker's acknowledgement and the deletion of its rows: a
/// second relay sends the same rows again, with the same ids, once the leases end. A queue
/// with duplicate detection drops the copies; a twice processor downstream of a queue without
/// it handles each message once.
async fn a_relay_dying_after_the_ack_resends_the_same_ids<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const N: i64 = 10;
    create_shipments(&f, false).await;
    let broker = broker().await;
    broker
        .create_queue(
            "shipped-dedup",
            QueueProperties::default().with_duplicate_detection(Duration::from_secs(600)),
        )
        .await
        .expect("queue");
    let outbox = f.outbox(OutboxOptions::new().table("outbox_ack")).await.expect("outbox");
    for i in 0..N {
        f.ship_and_announce(&outbox, i, "shipped", order(&format!("points-{i}"), i), true).await;
        f.ship_and_announce(&outbox, i, "shipped-dedup", Message::new("audit"), true).await;
    }
    let lease = Duration::from_millis(300);

    // The first relay stops right after the acknowledgement of its first batch, as a crash
    // would: it runs until then with no shutdown signal at all.
    let died = Arc::new(AtomicBool::new(false));
    let first = Relay::new(outbox.clone(), broker.clone(), relay_options().lease_duration(lease))
        .on_acknowledged({
            let died = died.clone();
            move |_| {
                died.store(true, Ordering::SeqCst);
                std::ops::ControlFlow::Break(())
            }
        });
    first.run(std::future::pending()).await;
    assert!(died.load(Ordering::SeqCst));
    assert_eq!(outbox_rows(&f, "outbox_ack").await, 2 * N, "{}: no row was deleted", F::NAME);

    let second = Relay::new(outbox.clone(), broker.clone(), relay_options().lease_duration(lease));
    let sent = second.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(second.run(shutdown.wait()));
    until("every row sent again", || sent.snapshot().sent == u64::try_from(2 * N).unwrap_or(0))
        .await;
    until_async("rows deleted", || async { outbox_rows(&f, "outbox_ack").await == 0 }).await;
    shutdown.trigger();
    task.await.expect("join");

    // The queue without duplicate detection holds both copies of each, under one id.
    let shipped = peek_all(&broker, "shipped").await;
    let mut copies: HashMap<MessageId, usize> = HashMap::new();
    for m in &shipped {
        *copies.entry(m.message_id().clone()).or_default() += 1;
    }
    assert_eq!(copies.len(), 10, "{}: ten ids", F::NAME);
    assert!(copies.values().all(|&c| c == 2), "{}: each sent twice, same id: {copies:?}", F::NAME);
    // Duplicate detection dropped the re-sends.
    assert_eq!(peek_all(&broker, "shipped-dedup").await.len(), 10, "{}", F::NAME);

    // Downstream, a twice processor handles each message once.
    let points = f.inbox(InboxOptions::new().table("inbox_points")).await;
    f.exec("CREATE TABLE points (order_id BIGINT NOT NULL)").await;
    let receiver = broker.receiver("shipped").await.expect("receiver");
    let handler = twice::json_fn(
        |_ctx: Context<'_>, o: OrderPlaced, tx: &mut Transaction<'static, F::DB>| {
            Box::pin(async move {
                F::try_exec(tx, &format!("INSERT INTO points (order_id) VALUES ({})", o.order_id))
                    .await?;
                Ok(Outcome::Complete)
            })
        },
    );
    let p = Processor::new(receiver, points, handler, ProcessorOptions::new().consumer("loyalty"));
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    until("every copy settled", || counters.snapshot().completed == 20).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    assert_eq!(f.count("SELECT COUNT(*) FROM points").await, N, "{}: once each", F::NAME);
    let c = counters.snapshot();
    assert_eq!(c.duplicates_already_processed + c.duplicates_concurrent_copy, 10, "{c:?}");
}
on_all_stores!(a_relay_dying_after_the_ack_resends_the_same_ids);

/// Two relays on one table at once: every row is sent exactly once.
async fn two_relays_on_one_table_send_each_row_once<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const N: usize = 300;
    create_shipments(&f, false).await;
    let broker = broker().await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_two")).await.expect("outbox");
    // Each row its own ordering key, so that both relays have work.
    for i in 0..N {
        let order_id = i64::try_from(i).expect("small");
        f.ship_and_announce(&outbox, order_id, "shipped", Message::new(format!("{i}")), true).await;
    }
    let options = relay_options().batch_size(10);
    let a = Relay::new(outbox.clone(), broker.clone(), options.clone());
    let b = Relay::new(outbox.clone(), broker.clone(), options);
    let (ca, cb) = (a.counters(), b.counters());
    let shutdown = Shutdown::default();
    let ta = tokio::spawn(a.run(shutdown.wait()));
    let tb = tokio::spawn(b.run(shutdown.wait()));
    until("all sent", || ca.snapshot().sent + cb.snapshot().sent >= N as u64).await;
    until_async("rows deleted", || async { outbox_rows(&f, "outbox_two").await == 0 }).await;
    shutdown.trigger();
    ta.await.expect("join");
    tb.await.expect("join");
    let (sa, sb) = (ca.snapshot(), cb.snapshot());
    assert_eq!(sa.sent + sb.sent, N as u64, "{}: {sa:?} {sb:?}", F::NAME);
    let shipped = peek_all(&broker, "shipped").await;
    let distinct: HashSet<&MessageId> = shipped.iter().map(|m| m.message_id()).collect();
    assert_eq!((shipped.len(), distinct.len()), (N, N), "{}: each row sent once", F::NAME);
    println!("{}: relay a sent {}, relay b sent {}", F::NAME, sa.sent, sb.sent);
}
on_all_stores!(two_relays_on_one_table_send_each_row_once);

/// A relay running in the process that commits is handed the rows of each commit, written
/// already leased to it: it sends them without leasing anything from the table.
async fn rows_committed_beside_a_running_relay_are_handed_over_without_a_lease<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const N: i64 = 20;
    create_shipments(&f, false).await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_hand")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_hand")).await.with_outbox(outbox.clone());
    let broker = broker().await;
    let relay = Relay::new(outbox.clone(), broker.clone(), relay_options());
    let sent = relay.counters();
    let shutdown = Shutdown::default();
    let relaying = tokio::spawn(relay.run(shutdown.wait()));
    let p = processor::<F>(&broker, Arc::new(inbox), Announce::new("shipped", 2)).await;
    let counters = p.counters();
    let processing = tokio::spawn(p.run(shutdown.wait()));
    for i in 0..N {
        broker.send("orders", order(&format!("order-{i}-placed"), i)).await.expect("send");
    }
    until("all handled", || counters.snapshot().completed == N as u64).await;
    until("all sent", || sent.snapshot().sent == 2 * N as u64).await;
    until_async("the rows deleted", || async { outbox_rows(&f, "outbox_hand").await == 0 }).await;
    shutdown.trigger();
    processing.await.expect("join").expect("run");
    relaying.await.expect("join");
    let s = sent.snapshot();
    assert!(s.adopted > 0, "{}: {s:?}", F::NAME);
    assert_eq!(s.leases, 0, "{}: no row needed a lease: {s:?}", F::NAME);
    let shipped = peek_all(&broker, "shipped").await;
    let distinct: HashSet<&MessageId> = shipped.iter().map(|m| m.message_id()).collect();
    assert_eq!((shipped.len(), distinct.len()), (40, 40), "{}: each once", F::NAME);
}
on_all_stores!(rows_committed_beside_a_running_relay_are_handed_over_without_a_lease);

/// A publisher whose sends never end, and that says when the first began.
#[derive(Debug, Default)]
struct Stuck {
    entered: AtomicBool,
}

impl Publish for Stuck {
    async fn publish(&self, _destination: &str, _message: Message) -> Result<(), TransportError> {
        self.entered.store(true, Ordering::SeqCst);
        std::future::pending().await
    }
}

/// Rows handed to a relay that stops before sending them (its broker hangs, then it is shut
/// down) are not lost: they stay leased to it in the table, and another relay sends each once
/// their leases end.
async fn rows_handed_to_a_relay_that_stops_go_out_once_their_lease_ends<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const N: i64 = 10;
    create_shipments(&f, false).await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_lost")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_lost")).await.with_outbox(outbox.clone());
    let broker = broker().await;
    let lease = Duration::from_millis(300);
    let stuck = Arc::new(Stuck::default());
    let first = Relay::from_arcs(
        Arc::new(outbox.clone()),
        stuck.clone(),
        relay_options().lease_duration(lease),
    );
    let first_counters = first.counters();
    let stop_first = Shutdown::default();
    let relaying = tokio::spawn(first.run(stop_first.wait()));
    let shutdown = Shutdown::default();
    let p = processor::<F>(&broker, Arc::new(inbox), Announce::new("shipped", 1)).await;
    let counters = p.counters();
    let processing = tokio::spawn(p.run(shutdown.wait()));
    for i in 0..N {
        broker.send("orders", order(&format!("order-{i}-placed"), i)).await.expect("send");
    }
    until("all handled", || counters.snapshot().completed == N as u64).await;
    until("the first relay's send began", || stuck.entered.load(Ordering::SeqCst)).await;
    stop_first.trigger();
    relaying.await.expect("join");
    let s = first_counters.snapshot();
    assert!(s.adopted > 0 && s.sent == 0, "{}: handed rows, none sent: {s:?}", F::NAME);
    assert_eq!(outbox_rows(&f, "outbox_lost").await, N, "{}", F::NAME);

    let second = Relay::new(outbox.clone(), broker.clone(), relay_options().lease_duration(lease));
    let sent = second.counters();
    let relaying = tokio::spawn(second.run(shutdown.wait()));
    until("every row sent", || sent.snapshot().sent == N as u64).await;
    until_async("the rows deleted", || async { outbox_rows(&f, "outbox_lost").await == 0 }).await;
    shutdown.trigger();
    processing.await.expect("join").expect("run");
    relaying.await.expect("join");
    let shipped = peek_all(&broker, "shipped").await;
    let distinct: HashSet<&MessageId> = shipped.iter().map(|m| m.message_id()).collect();
    assert_eq!((shipped.len(), distinct.len()), (10, 10), "{}: each once", F::NAME);
}
on_all_stores!(rows_handed_to_a_relay_that_stops_go_out_once_their_lease_ends);

/// A publisher that fails every third send for now.
#[derive(Debug)]
struct Flaky {
    inner: Broker,
    calls: AtomicUsize,
    failures: AtomicUsize,
}

impl Publish for Flaky {
    async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) % 3 == 2 {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Err(TransportError::Other {
                message: "the broker is busy".to_owned(),
                transient: true,
                source: None,
            });
        }
        self.inner.publish(destination, message).await
    }
}

/// A session's messages reach the broker in the order they were committed, across handler
/// runs, with two relays and a broker that fails every third send.
async fn a_sessions_messages_keep_their_order<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const RUNS: i64 = 30;
    create_shipments(&f, false).await;
    let broker = broker().await;
    broker
        .create_queue("events", QueueProperties::default().with_requires_session(true))
        .await
        .expect("queue");
    let outbox = f.outbox(OutboxOptions::new().table("outbox_order")).await.expect("outbox");
    let inbox = f.inbox(InboxOptions::new().table("inbox_order")).await.with_outbox(outbox.clone());
    let mut handler = Announce::<F>::new("events", 3);
    handler.session = Some("customer-7");
    let receiver = Arc::new(broker.receiver("orders").await.expect("receiver"));
    // One call at a time, so that the commit order is the order the messages were sent in.
    let p = Processor::from_arcs(
        receiver,
        Arc::new(inbox),
        Arc::new(Json::new(handler)),
        ProcessorOptions::new().consumer("shipping").max_concurrent_calls(1).prefetch_count(0),
    );
    let counters = p.counters();
    let publisher = Arc::new(Flaky {
        inner: broker.clone(),
        calls: AtomicUsize::new(0),
        failures: AtomicUsize::new(0),
    });
    let options = relay_options().batch_size(4);
    let a = Relay::from_arcs(Arc::new(outbox.clone()), publisher.clone(), options.clone());
    let b = Relay::from_arcs(Arc::new(outbox.clone()), publisher.clone(), options);
    let (ca, cb) = (a.counters(), b.counters());
    let shutdown = Shutdown::default();
    let tasks = [tokio::spawn(a.run(shutdown.wait())), tokio::spawn(b.run(shutdown.wait()))];
    let processing = tokio::spawn(p.run(shutdown.wait()));
    for i in 0..RUNS {
        broker.send("orders", order(&format!("order-{i}-placed"), i)).await.expect("send");
    }
    until("all handled", || counters.snapshot().completed == RUNS as u64).await;
    until_async("all relayed", || async { outbox_rows(&f, "outbox_order").await == 0 }).await;
    shutdown.trigger();
    processing.await.expect("join").expect("run");
    for t in tasks {
        t.await.expect("join");
    }
    assert!(publisher.failures.load(Ordering::SeqCst) > 0, "the broker failed some sends");
    // One relay was handed the rows of this process's commits, the other leased from the
    // table: both paths ran.
    let (sa, sb) = (ca.snapshot(), cb.snapshot());
    assert!(sa.adopted + sb.adopted > 0, "{}: rows were handed over: {sa:?} {sb:?}", F::NAME);

    let session = broker
        .accept_session("events", &twice::SessionId::new("customer-7"))
        .await
        .expect("accept");
    let mut bodies = Vec::new();
    loop {
        let got = session.receive(100, Duration::ZERO).await.expect("receive");
        if got.is_empty() {
            break;
        }
        for m in &got {
            bodies.push(String::from_utf8(m.body().to_vec()).expect("utf-8"));
            session.complete(m.lock_token.expect("locked")).await.expect("complete");
        }
    }
    let expected: Vec<String> = (0..RUNS)
        .flat_map(|i| (0..3).map(move |n| format!(r#"{{"order_id":{i},"n":{n}}}"#)))
        .collect();
    assert_eq!(bodies, expected, "{}: in commit order, each once", F::NAME);
}
on_all_stores!(a_sessions_messages_keep_their_order);

/// What the broker refuses for good is parked with its reason (an entity that does not
/// exist, a message over the size limit), the rows after it go on, and an operator can retry
/// or discard parked rows.
async fn refused_messages_are_parked_and_the_rest_go_on<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    create_shipments(&f, false).await;
    let broker = broker().await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_park")).await.expect("outbox");
    f.write_all(
        &outbox,
        vec![
            ("no-such-queue", Message::new("lost?")),
            ("shipped", Message::new(vec![b'x'; 100 * 1024])),
            ("shipped", Message::new("after the refused ones")),
        ],
    )
    .await;

    let relay = Relay::new(outbox.clone(), broker.clone(), relay_options());
    let counters = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    until("one sent, two parked", || {
        let s = counters.snapshot();
        s.sent == 1 && s.parked == 2
    })
    .await;
    let parked = F::rows(&outbox, RowState::Parked).await;
    assert_eq!(parked.len(), 2, "{}", F::NAME);
    let reasons: Vec<&str> = parked.iter().map(|r| r.last_error.as_deref().unwrap_or("")).collect();
    assert!(reasons[0].contains("not found"), "{}: {reasons:?}", F::NAME);
    assert!(reasons[1].contains("exceeds"), "{}: {reasons:?}", F::NAME);
    // Counted at the acknowledgement; its row is deleted just after.
    until_async("the sent row deleted", || async {
        outbox.stats().await.expect("stats").pending == 0
    })
    .await;
    let stats = outbox.stats().await.expect("stats");
    assert_eq!((stats.pending, stats.parked), (0, 2), "{stats:?}");
    let shipped = peek_all(&broker, "shipped").await;
    assert_eq!(shipped.len(), 1);
    assert_eq!(&shipped[0].body()[..], b"after the refused ones");

    // The operator creates the queue and retries that row, and discards the oversized one.
    broker.create_queue("no-such-queue", QueueProperties::default()).await.expect("queue");
    assert_eq!(F::retry_parked(&outbox, vec![parked[0].seq]).await, 1);
    until("the retried row sent", || counters.snapshot().sent == 2).await;
    assert_eq!(peek_all(&broker, "no-such-queue").await.len(), 1);
    assert_eq!(F::discard_parked(&outbox).await, 1);
    until_async("the retried row deleted", || async { outbox_rows(&f, "outbox_park").await == 0 })
        .await;
    shutdown.trigger();
    task.await.expect("join");
}
on_all_stores!(refused_messages_are_parked_and_the_rest_go_on);

/// Outside a handler: an HTTP handler's own transaction writes an order and publishes
/// `OrderPlaced`; rolled back, nothing is sent; committed, it is sent at once (the commit
/// wakes the relay, whose poll is an hour).
async fn a_producers_own_transaction_publishes_with_its_work<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    create_shipments(&f, false).await;
    let broker = broker().await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_http")).await.expect("outbox");
    let relay = Relay::new(
        outbox.clone(),
        broker.clone(),
        relay_options()
            .poll_interval(Duration::from_secs(3600))
            .stats_interval(Duration::from_secs(3600)),
    );
    let counters = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    f.ship_and_announce(&outbox, 1, "shipped", Message::new("placed 1"), false).await;
    assert_eq!(outbox_rows(&f, "outbox_http").await, 0, "{}: rolled back, no row", F::NAME);
    assert_eq!(shipments(&f).await, 0);
    let id = f.ship_and_announce(&outbox, 2, "shipped", Message::new("placed 2"), true).await;
    until("sent at once", || counters.snapshot().sent == 1).await;
    let shipped = peek_all(&broker, "shipped").await;
    assert_eq!(shipped.len(), 1);
    assert_eq!(shipped[0].message_id(), &id);
    assert_eq!(&shipped[0].body()[..], b"placed 2");
    shutdown.trigger();
    task.await.expect("join");
}
on_all_stores!(a_producers_own_transaction_publishes_with_its_work);

/// Bad configuration is one clear error: a table that was never migrated names the migration;
/// a handler that sends through an inbox without an outbox is dead-lettered at once with
/// `OutboxNotConfigured`, nothing written.
async fn a_missing_outbox_is_one_clear_error<F: Fixture>(f: F)
where
    Inboxed<F>: Inbox<Tx = Transaction<'static, F::DB>, Error = StoreError>,
{
    let missing = f.outbox(OutboxOptions::new().table("never_made").migrate(false)).await;
    let error = missing.expect_err("no table").to_string();
    assert!(
        error.contains("\"never_made\" does not exist") && error.contains("migration 1"),
        "{error}"
    );

    create_shipments(&f, false).await;
    let inbox = Arc::new(f.inbox(InboxOptions::new().table("inbox_no_outbox")).await);
    let broker = broker().await;
    let p = processor::<F>(&broker, inbox, Announce::new("shipped", 1)).await;
    let counters = p.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(p.run(shutdown.wait()));
    broker.send("orders", order("order-9-placed", 9)).await.expect("send");
    until("dead-lettered", || counters.snapshot().dead_lettered == 1).await;
    shutdown.trigger();
    task.await.expect("join").expect("run");
    let dead = peek_all(&broker, "orders/$DeadLetterQueue").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].dead_letter_reason.as_deref(), Some("OutboxNotConfigured"));
    assert_eq!(dead[0].delivery_count, 1, "at once, not after MaxDeliveryCount");
    assert_eq!(shipments(&f).await, 0, "{}: the work rolled back", F::NAME);
}
on_all_stores!(a_missing_outbox_is_one_clear_error);

/// A message scheduled for later, on a broker that cannot hold it: the relay keeps the row
/// until it is due, without holding back the run's other messages.
async fn a_scheduled_message_waits_in_the_outbox_where_the_broker_cannot_hold_it<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    /// When each body went out.
    type Times = Arc<std::sync::Mutex<Vec<(Vec<u8>, twice::Timestamp)>>>;
    /// A broker that cannot schedule, and notes when each body went out.
    #[derive(Debug)]
    struct NoSchedules(Broker, Arc<AtomicBool>, Times);
    impl Publish for NoSchedules {
        async fn publish(&self, destination: &str, message: Message) -> Result<(), TransportError> {
            if message.scheduled_enqueue_time.is_some() {
                self.1.store(true, Ordering::SeqCst);
                return Err(TransportError::Unsupported("scheduled messages"));
            }
            let now = SharedClock::system().now();
            self.2.lock().expect("lock").push((message.body.to_vec(), now));
            self.0.publish(destination, message).await
        }
    }
    create_shipments(&f, false).await;
    let broker = broker().await;
    let outbox = f.outbox(OutboxOptions::new().table("outbox_sched")).await.expect("outbox");
    let clock = SharedClock::system();
    let at = clock.now().saturating_add(Duration::from_millis(400));
    f.write_all(
        &outbox,
        vec![
            ("shipped", Message::new("later").with_scheduled_enqueue_time(at)),
            ("shipped", Message::new("now")),
        ],
    )
    .await;
    let refused = Arc::new(AtomicBool::new(false));
    let times = Arc::default();
    let publisher = NoSchedules(broker.clone(), refused.clone(), Arc::clone(&times));
    let relay = Relay::new(outbox.clone(), publisher, relay_options());
    let counters = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    until("both sent", || counters.snapshot().sent == 2).await;
    shutdown.trigger();
    task.await.expect("join");
    let times = times.lock().expect("lock").clone();
    let later = times.iter().find(|(body, _)| body == b"later").expect("sent");
    assert!(later.1 >= at, "{}: sent at {:?}, due at {at:?}", F::NAME, later.1);
    assert!(!refused.load(Ordering::SeqCst), "never sent with a schedule the broker lacks");
    let bodies: Vec<Vec<u8>> =
        peek_all(&broker, "shipped").await.iter().map(|m| m.body().to_vec()).collect();
    assert_eq!(bodies, [b"now".to_vec(), b"later".to_vec()], "{}", F::NAME);
}
on_all_stores!(a_scheduled_message_waits_in_the_outbox_where_the_broker_cannot_hold_it);

/// With a retention, sent rows are kept (marked sent) and then purged in bounded batches by the
/// relay's housekeeping; without one they are deleted at once.
async fn sent_rows_are_kept_for_the_retention_then_purged<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    const N: u64 = 7;
    create_shipments(&f, false).await;
    let broker = broker().await;
    let options = OutboxOptions::new()
        .table("outbox_kept")
        .sent_retention(Some(Duration::from_secs(2)))
        .purge_batch_size(2);
    let outbox = f.outbox(options).await.expect("outbox");
    let messages = (0..N).map(|i| ("shipped", Message::new(format!("{i}")))).collect();
    f.write_all(&outbox, messages).await;
    // Housekeeping only after the rows were sent and seen kept: a first round at start, the
    // next ones every 100 ms.
    let relay = Relay::new(
        outbox.clone(),
        broker.clone(),
        relay_options().stats_interval(Duration::from_millis(100)),
    );
    let counters = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    until("all sent", || counters.snapshot().sent == N).await;
    // Kept, marked sent, for the retention (two seconds: the poll sees them long before).
    until_async("all marked sent", || async { outbox.stats().await.expect("stats").sent == N })
        .await;
    until_async("purged", || async { outbox_rows(&f, "outbox_kept").await == 0 }).await;
    shutdown.trigger();
    task.await.expect("join");
    assert_eq!(peek_all(&broker, "shipped").await.len(), 7);
}
on_all_stores!(sent_rows_are_kept_for_the_retention_then_purged);

/// The rows the broker acknowledged wait for their deletion, so that one statement covers
/// many turns: five rows sent in five turns are all still in the table (leased, so no other
/// relay takes them) until the relay shuts down, which deletes them. A session's rows are
/// deleted before the relay next reads the table, where they would hold back the session's
/// later rows.
async fn sent_rows_wait_for_their_deletion_across_turns<F: Fixture>(f: F)
where
    Outboxed<F>: OutboxStore<Error = StoreError>,
{
    let outbox = f.outbox(OutboxOptions::new().table("outbox_marks")).await.expect("outbox");
    let broker = broker().await;
    let hour = Duration::from_secs(3600);
    let options = relay_options().lease_duration(hour).mark_delay(hour);
    assert_eq!(options.get_mark_delay(), hour / 4, "within a quarter of the lease");
    let relay = Relay::new(outbox.clone(), broker.clone(), options);
    let counters = relay.counters();
    let shutdown = Shutdown::default();
    let task = tokio::spawn(relay.run(shutdown.wait()));
    for i in 0..5 {
        // Each row commits after the one before was acknowledged: a turn of its own.
        f.write_all(&outbox, vec![("shipped", Message::new(format!("m-{i}")))]).await;
        until_async("sent", || async { peek_all(&broker, "shipped").await.len() == i + 1 }).await;
    }
    assert_eq!(counters.snapshot().sent, 5, "{}", F::NAME);
    let waiting = F::rows(&outbox, RowState::Pending).await;
    assert_eq!(waiting.len(), 5, "{}: sent and not yet deleted", F::NAME);

    // A session's row is deleted before the next read of the table.
    let in_session =
        |body: &'static str| vec![("shipped", Message::new(body).with_session_id("s-1"))];
    f.write_all(&outbox, in_session("first")).await;
    until_async("sent", || async { peek_all(&broker, "shipped").await.len() == 6 }).await;
    f.write_all(&outbox, in_session("second")).await;
    until_async("sent", || async { peek_all(&broker, "shipped").await.len() == 7 }).await;
    let left: Vec<String> = F::rows(&outbox, RowState::Pending)
        .await
        .iter()
        .map(|r| String::from_utf8_lossy(&r.message.body).into_owned())
        .collect();
    assert!(!left.iter().any(|b| b == "first"), "{}: the session's first row is deleted", F::NAME);
    assert!(left.iter().all(|b| b.starts_with("m-") || b == "second"), "{}: {left:?}", F::NAME);

    shutdown.trigger();
    task.await.expect("join");
    assert!(
        F::rows(&outbox, RowState::Pending).await.is_empty(),
        "{}: deleted at shutdown",
        F::NAME
    );
    let shipped = peek_all(&broker, "shipped").await;
    let distinct: HashSet<&MessageId> = shipped.iter().map(|m| m.message_id()).collect();
    assert_eq!((shipped.len(), distinct.len()), (7, 7), "{}: each sent once", F::NAME);
}
on_all_stores!(sent_rows_wait_for_their_deletion_across_turns);
