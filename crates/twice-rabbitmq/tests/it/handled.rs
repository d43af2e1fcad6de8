//! A processor on a SQLite inbox that records what its handler ran on, for the tests of what a
//! user sees end to end.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::Sqlite;
use twice::{HandlerError, Outcome, Processor, ProcessorOptions, Transport, handler_fn};
use twice_sqlx::{InboxOptions, SqlxInbox};
use twice_testkit::db::SqliteDatabase;

/// An inbox that outlives the processors run on it.
pub(crate) struct Inbox {
    pub(crate) inbox: Arc<SqlxInbox<Sqlite>>,
    _db: SqliteDatabase,
}

impl Inbox {
    pub(crate) async fn new() -> Self {
        let db = SqliteDatabase::create().expect("a SQLite file");
        let pool = db.pool(4).await.expect("a pool");
        let inbox = SqlxInbox::<Sqlite>::new(pool, InboxOptions::new()).await.expect("the inbox");
        Self { inbox: Arc::new(inbox), _db: db }
    }
}

/// What one processor run saw: the bodies its handler ran on.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub(crate) handled: Vec<String>,
}

/// Runs a processor (consumer `consumer`) on `transport` until its counters say `done`, or for
/// at most `bound`; returns what its handler ran on.
pub(crate) async fn run_until<T: Transport>(
    transport: T,
    inbox: &Inbox,
    consumer: &str,
    bound: Duration,
    done: impl Fn(&twice::CounterSnapshot) -> bool,
) -> Seen {
    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = Arc::clone(&handled);
    let handler = handler_fn::<sqlx::Transaction<'static, Sqlite>, _>(move |ctx, _tx| {
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            let body = String::from_utf8_lossy(ctx.message().body()).into_owned();
            seen.lock().unwrap().push(body);
            Ok::<_, HandlerError>(Outcome::Complete)
        })
    });
    let options = ProcessorOptions::new()
        .consumer(consumer)
        .max_concurrent_calls(2)
        .max_wait(Duration::from_millis(200));
    let processor = Processor::from_arcs(
        Arc::new(transport),
        Arc::clone(&inbox.inbox),
        Arc::new(handler),
        options,
    )
    .on_error(|_| {});
    let counters = processor.counters();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(processor.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let clock = twice::SharedClock::system();
    let until = clock.now() + bound;
    while !done(&counters.snapshot()) && clock.now() < until {
        clock.sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(true);
    task.await.expect("the processor task").expect("the processor");
    let handled = handled.lock().unwrap().clone();
    Seen { handled }
}
