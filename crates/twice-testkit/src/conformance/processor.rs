//! The processor scenarios: the processor with an SQLite, a PostgreSQL and a MariaDB inbox on
//! the harness's transport, one message per transaction or in batches; each must end with the
//! work committed once per message.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{MySql, Postgres, Sqlite};
use twice::{
    CounterSnapshot, DeadLetterReason, Delivery, EntityInfo, HandlerError, Inbox, Message,
    MessageId, Outcome, Processor, ProcessorOptions, Properties, Receive, Timestamp, Transport,
    TransportError, handler_fn,
};
use twice_sqlx::{InboxOptions, SqlxInbox};

use super::Entity as _;
use super::{
    BOUND, EntitySettings, Harness, LONG_HANDLER, P_CRASH, P_LOCK_LOST, P_POISON, P_TWO_COPIES,
    YES, create, fail, nothing_comes, scenarios, send, take_dead_letters_until, unique,
};
use crate::db::{MariaDatabase, PgDatabase, SqliteDatabase};

/// The processor scenarios' cells: `yes`, or what each store measured.
pub(super) async fn processor_cells<H: Harness>(
    harness: &H,
    batch: Batch,
) -> Option<BTreeMap<&'static str, String>> {
    let mut cells = BTreeMap::new();
    for (capability, by_store) in processor_scenarios(harness, batch).await? {
        let cell = if by_store.values().all(|c| c == YES) {
            YES.to_owned()
        } else {
            by_store.iter().map(|(s, c)| format!("{s}: {c}")).collect::<Vec<_>>().join("; ")
        };
        cells.insert(capability, cell);
    }
    Some(cells)
}

/// A store, a column group of the processor scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Store {
    Sqlite,
    Postgres,
    MariaDb,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::Sqlite => "SQLite",
            Store::Postgres => "PostgreSQL",
            Store::MariaDb => "MariaDB",
        }
    }
}

type ByStore = BTreeMap<&'static str, BTreeMap<&'static str, String>>;

async fn processor_scenarios<H: Harness>(h: &H, batch: Batch) -> Option<ByStore> {
    let mut out: ByStore = BTreeMap::new();
    for store in [Store::Sqlite, Store::Postgres, Store::MariaDb] {
        let cells = match store {
            Store::Sqlite => {
                let db = crate::require_service("SQLite", SqliteDatabase::create())?;
                let pool = crate::require_service("SQLite", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "SQLite",
                    SqlxInbox::<Sqlite>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox), batch).await?
            }
            Store::Postgres => {
                let db =
                    crate::require_service("PostgreSQL", PgDatabase::create("twice_kit").await)?;
                let pool = crate::require_service("PostgreSQL", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "PostgreSQL",
                    SqlxInbox::<Postgres>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox), batch).await?
            }
            Store::MariaDb => {
                let db =
                    crate::require_service("MariaDB", MariaDatabase::create("twice_kit").await)?;
                let pool = crate::require_service("MariaDB", db.pool(16).await)?;
                let inbox = crate::require_service(
                    "MariaDB",
                    SqlxInbox::<MySql>::new(pool, InboxOptions::new()).await,
                )?;
                processor_with(h, Arc::new(inbox), batch).await?
            }
        };
        for (capability, cell) in cells {
            out.entry(capability).or_default().insert(store.name(), cell);
        }
    }
    Some(out)
}

async fn processor_with<H: Harness, I: Inbox>(
    h: &H,
    inbox: Arc<I>,
    batch: Batch,
) -> Option<Vec<(&'static str, String)>> {
    Some(vec![
        (P_POISON, poison(h, &inbox, batch).await?),
        (P_CRASH, crash_after_commit(h, &inbox, batch).await?),
        (P_TWO_COPIES, two_copies(h, &inbox, batch).await?),
        (P_LOCK_LOST, lock_lost(h, &inbox, batch).await?),
        (LONG_HANDLER, scenarios::long_handler(h, &inbox, batch).await?),
    ])
}

/// How the processor scenarios run the processor: one message per transaction, or batches
/// of up to `n` ([`ProcessorOptions::batch_size`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Batch(pub(crate) Option<usize>);

impl Batch {
    /// One message per transaction.
    pub(crate) fn one() -> Self {
        Self(None)
    }
}

/// What the test handler does, from the body: `{"sleep_first_ms": n}` sleeps on a first
/// delivery, `{"sleep_ms": n}` on every one; anything that is not JSON is poison.
#[derive(serde::Deserialize, Default)]
struct Script {
    #[serde(default)]
    sleep_ms: u64,
    #[serde(default)]
    sleep_first_ms: u64,
}

/// Commits per message id, from the processor's commit hook.
type Commits = Arc<Mutex<HashMap<MessageId, u32>>>;

/// A running processor and what it has committed.
pub(crate) struct Running {
    commits: Commits,
    counters: Arc<twice::Counters>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), twice::ProcessorError>>,
}

impl Running {
    pub(crate) fn commits_of(&self, id: &str) -> u32 {
        let commits = self.commits.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        commits.get(&MessageId::new(id)).copied().unwrap_or(0)
    }

    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// Waits until `done` holds, or fails the scenario at the bound.
    pub(crate) async fn wait(&self, s: &str, done: impl Fn(&Self) -> bool) {
        let clock = twice::SharedClock::system();
        let until = clock.now() + BOUND;
        while !done(self) {
            if clock.now() >= until {
                fail(s, format!("not done within the bound; counters {:?}", self.snapshot()));
            }
            clock.sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the processor and waits for its run to return, or fails the scenario at the
    /// bound: a run that never returns (a settlement that never ends) is a failure that names
    /// its scenario, not a hang of the whole suite.
    pub(crate) async fn stop(self, s: &str) {
        let _ = self.stop.send(true);
        let counters = Arc::clone(&self.counters);
        match tokio::time::timeout(BOUND, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => fail(s, format!("the processor stopped with {e}")),
            Ok(Err(e)) => fail(s, format!("the processor task failed: {e}")),
            Err(_) => fail(
                s,
                format!(
                    "the processor did not stop within the bound after its shutdown; counters {:?}",
                    counters.snapshot()
                ),
            ),
        }
    }
}

pub(crate) fn start<T: Transport, I: Inbox>(
    transport: Arc<T>,
    inbox: &Arc<I>,
    options: ProcessorOptions,
) -> Running {
    let commits: Commits = Arc::default();
    let handler = handler_fn::<I::Tx, _>(|ctx, _tx| {
        Box::pin(async move {
            let Ok(script) = ctx.json::<Script>() else {
                return Ok(Outcome::dead_letter(twice::DESERIALIZATION_FAILED, "not JSON"));
            };
            let sleep = if ctx.delivery_count() == 1 {
                script.sleep_ms.max(script.sleep_first_ms)
            } else {
                script.sleep_ms
            };
            if sleep > 0 {
                twice::SharedClock::system().sleep(Duration::from_millis(sleep)).await;
            }
            Ok::<_, HandlerError>(Outcome::Complete)
        })
    });
    let processor = Processor::from_arcs(transport, Arc::clone(inbox), Arc::new(handler), options)
        .on_error(|_| {});
    let seen = Arc::clone(&commits);
    let processor = processor.on_committed(move |m| {
        let mut c = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *c.entry(m.message_id().clone()).or_default() += 1;
    });
    let counters = processor.counters();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    Running { commits, counters, stop, task }
}

pub(crate) fn options(consumer: &str, batch: Batch) -> ProcessorOptions {
    let options = ProcessorOptions::new()
        .consumer(consumer)
        .max_concurrent_calls(4)
        .max_wait(Duration::from_millis(200));
    match batch.0 {
        Some(n) => options.batch_size(n),
        None => options,
    }
}

async fn poison<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>, batch: Batch) -> Option<String> {
    const S: &str = "processor: poison";
    let e = create(h, EntitySettings::default()).await?;
    let id = unique("poison");
    send(&e, Message::new("not json").with_message_id(id.as_str()), S).await;
    let p = start(e.transport(), inbox, options(&unique("kit"), batch));
    p.wait(S, |p| p.snapshot().dead_lettered >= 1).await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    let dead = take_dead_letters_until(&e, 1, S).await;
    let reason = dead
        .iter()
        .find(|m| m.message_id().as_str() == id)
        .and_then(|m| m.dead_letter_reason.clone());
    Some(match (commits, reason.as_deref()) {
        (0, Some(twice::DESERIALIZATION_FAILED)) => YES.into(),
        (0, other) => format!("dead-lettered with reason {other:?}"),
        (n, _) => fail(S, format!("poison work committed {n} times")),
    })
}

/// A transport that loses the first completion of every message: the process "crashed" after
/// the commit, before the complete reached the broker, so the message comes back when its lock
/// runs out.
#[derive(Debug)]
struct LoseFirstCompletion<T> {
    inner: Arc<T>,
    // A std Mutex: a set lookup, never held across an await.
    lost: Mutex<std::collections::HashSet<MessageId>>,
}

impl<T: Transport> Receive for LoseFirstCompletion<T> {
    type Delivery = T::Delivery;

    async fn receive(&self, n: usize, wait: Duration) -> Result<Vec<T::Delivery>, TransportError> {
        self.inner.receive(n, wait).await
    }

    async fn complete(&self, d: &T::Delivery) -> Result<(), TransportError> {
        let first = self
            .lost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(d.message().message_id().clone());
        if first {
            return Err(TransportError::Other {
                message: "the process crashed before the completion".into(),
                transient: true,
                source: None,
            });
        }
        self.inner.complete(d).await
    }

    async fn abandon(&self, d: &T::Delivery, p: Properties) -> Result<(), TransportError> {
        self.inner.abandon(d, p).await
    }

    async fn dead_letter(
        &self,
        d: &T::Delivery,
        r: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.inner.dead_letter(d, r).await
    }

    async fn defer(&self, d: &T::Delivery) -> Result<(), TransportError> {
        self.inner.defer(d).await
    }
}

impl<T: Transport> Transport for LoseFirstCompletion<T> {
    fn entity(&self) -> &EntityInfo {
        self.inner.entity()
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
}

async fn crash_after_commit<H: Harness, I: Inbox>(
    h: &H,
    inbox: &Arc<I>,
    batch: Batch,
) -> Option<String> {
    const S: &str = "processor: crash after commit";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("crash");
    send(&e, Message::new("{}").with_message_id(id.as_str()), S).await;
    let crashy = Arc::new(LoseFirstCompletion { inner: e.transport(), lost: Mutex::default() });
    let p = start(crashy, inbox, options(&unique("kit"), batch));
    p.wait(S, |p| p.snapshot().duplicates_already_processed >= 1 && p.snapshot().completed >= 1)
        .await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    if !nothing_comes(e.transport().as_ref()).await {
        fail(S, "the message is still there after its duplicate was completed");
    }
    Some(if commits == 1 { YES.into() } else { fail(S, format!("work committed {commits} times")) })
}

async fn two_copies<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>, batch: Batch) -> Option<String> {
    const S: &str = "processor: two copies";
    let settings = EntitySettings { duplicate_detection: false, ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("twin");
    for _ in 0..2 {
        send(&e, Message::new(r#"{"sleep_ms":300}"#).with_message_id(id.as_str()), S).await;
        // Further apart than the shortest duplicate window a broker that cannot turn detection
        // off accepts (JetStream: 100 ms).
        twice::SharedClock::system().sleep(Duration::from_millis(250)).await;
    }
    let p = start(e.transport(), inbox, options(&unique("kit"), batch));
    p.wait(S, |p| p.snapshot().completed >= 2).await;
    let commits = p.commits_of(&id);
    let s = p.snapshot();
    p.stop(S).await;
    if commits != 1 {
        fail(S, format!("work committed {commits} times"));
    }
    Some(if s.duplicates_concurrent_copy + s.duplicates_already_processed >= 1 {
        YES.into()
    } else {
        fail(S, format!("two completions without a duplicate: {s:?}"))
    })
}

async fn lock_lost<H: Harness, I: Inbox>(h: &H, inbox: &Arc<I>, batch: Batch) -> Option<String> {
    const S: &str = "processor: lock lost";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("slow");
    let sleep = settings.lock_duration + Duration::from_millis(1500);
    let body = format!(r#"{{"sleep_first_ms":{}}}"#, sleep.as_millis());
    send(&e, Message::new(body).with_message_id(id.as_str()), S).await;
    // No renewal: the first handler outlives its lock and a second copy runs.
    let options = options(&unique("kit"), batch).max_auto_lock_renewal_duration(Duration::ZERO);
    let p = start(e.transport(), inbox, options);
    p.wait(S, |p| p.snapshot().completed >= 1 && p.snapshot().lock_lost >= 1).await;
    let commits = p.commits_of(&id);
    p.stop(S).await;
    if !nothing_comes(e.transport().as_ref()).await {
        fail(S, "the message is still there after it was completed");
    }
    Some(if commits == 1 { YES.into() } else { fail(S, format!("work committed {commits} times")) })
}
