//! The `metrics` feature: what the processor records through the `metrics` facade.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Once};
use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use twice::{
    BoxFuture, Context, HandlerError, Message, Outcome, Processor, ProcessorOptions, RetryPolicy,
    handler_fn,
};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx};

/// Every value recorded, by `name{label=value,…}`; a histogram counts its samples.
static VALUES: LazyLock<Arc<Mutex<BTreeMap<String, f64>>>> = LazyLock::new(Arc::default);

/// A recorder that keeps every value in [`VALUES`].
struct Memory;

struct Cell(String);

impl Cell {
    fn add(&self, v: f64) {
        *VALUES.lock().expect("values").entry(self.0.clone()).or_default() += v;
    }
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.add(f64::from(u32::try_from(value).expect("small")));
    }
    fn absolute(&self, value: u64) {
        VALUES
            .lock()
            .expect("values")
            .insert(self.0.clone(), f64::from(u32::try_from(value).expect("small")));
    }
}

impl GaugeFn for Cell {
    /// Also keeps the highest value the gauge reached, under `name{…}#max`.
    fn increment(&self, value: f64) {
        self.add(value);
        let mut values = VALUES.lock().expect("values");
        let now = values.get(&self.0).copied().unwrap_or_default();
        let max = values.entry(format!("{}#max", self.0)).or_default();
        *max = max.max(now);
    }
    fn decrement(&self, value: f64) {
        self.add(-value);
    }
    fn set(&self, value: f64) {
        VALUES.lock().expect("values").insert(self.0.clone(), value);
    }
}

impl HistogramFn for Cell {
    fn record(&self, _: f64) {
        self.add(1.0);
    }
}

fn cell(key: &Key) -> Arc<Cell> {
    let mut labels: Vec<String> =
        key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
    labels.sort();
    Arc::new(Cell(format!("{}{{{}}}", key.name(), labels.join(","))))
}

impl Recorder for Memory {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(cell(key))
    }
}

fn value(name: &str, labels: &str) -> f64 {
    VALUES.lock().expect("values").get(&format!("{name}{{{labels}}}")).copied().unwrap_or(0.0)
}

#[tokio::test]
async fn the_processor_records_its_counts_latencies_and_in_flight_gauge() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| metrics::set_global_recorder(Memory).expect("the only recorder"));
    let transport = Arc::new(MemoryTransport::new());
    let inbox = Arc::new(MemoryInbox::default());
    // One whose lock ran out while it waited (skipped), then a, a copy of a (a duplicate), b
    // (dead-lettered), c (fails once, then completes).
    let mut expired = twice::ReceivedMessage::new(
        Message::new("{}").with_message_id("expired"),
        twice::SequenceNumber::new(100),
        twice::Timestamp::from_millis(0),
    );
    expired.locked_until = Some(twice::Timestamp::from_millis(1));
    transport.push(expired);
    for id in ["a", "a", "b", "c"] {
        transport.send(Message::new("{}").with_message_id(id));
    }
    let c_calls = Arc::new(AtomicUsize::new(0));
    let handler = handler_fn(move |ctx: Context<'_>, _: &mut MemoryTx| {
        let id = ctx.message_id().to_string();
        let first_c = id == "c" && c_calls.fetch_add(1, Ordering::SeqCst) == 0;
        Box::pin(async move {
            match id.as_str() {
                "b" => Ok(Outcome::dead_letter("Refused", "b is refused")),
                "c" if first_c => Err(HandlerError::transient(std::io::Error::other("once"))),
                _ => Ok(Outcome::Complete),
            }
        }) as BoxFuture<'_, _>
    });
    let options = ProcessorOptions::new()
        .consumer("metrics-scenario")
        .max_wait(Duration::from_millis(20))
        .retry(RetryPolicy::new().immediate_retries(1));
    let processor = Processor::from_arcs(transport.clone(), inbox, Arc::new(handler), options);
    let watched = transport.clone();
    let settled = async move {
        while watched.settled().len() < 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), processor.run(settled))
        .await
        .expect("the four messages are settled")
        .expect("run");

    let labels = "consumer=metrics-scenario,entity=orders";
    let count = |name: &str| value(name, labels);
    assert_eq!(count("twice_processor_messages_handled_total"), 4.0);
    assert_eq!(count("twice_processor_committed_total"), 2.0);
    assert_eq!(count("twice_processor_completed_total"), 3.0);
    assert_eq!(count("twice_processor_dead_lettered_total"), 1.0);
    assert_eq!(count("twice_processor_handler_errors_total"), 1.0);
    // The copy of a is received within the millisecond a's claim was made, or after: which of
    // the two reasons it gets depends on the clock, but it gets one.
    let duplicates = |reason: &str| {
        value("twice_processor_duplicates_total", &format!("{labels},reason={reason}"))
    };
    assert_eq!(duplicates("already_processed") + duplicates("concurrent_copy"), 1.0);
    assert_eq!(duplicates("business_key"), 0.0);
    assert_eq!(value("twice_processor_retries_total", &format!("{labels},kind=immediate")), 1.0);
    assert_eq!(count("twice_processor_abandoned_total"), 0.0);
    assert_eq!(count("twice_processor_lock_lost_total"), 0.0);
    assert_eq!(count("twice_processor_expired_in_buffer_total"), 1.0);
    // Five claims (the copy of a claims too, and c claims again on its retry) and four
    // handler runs (c twice; the copy of a runs none).
    assert_eq!(count("twice_processor_claim_duration_seconds"), 5.0);
    assert_eq!(count("twice_processor_handler_duration_seconds"), 4.0);
    let in_flight = "twice_processor_in_flight";
    let highest =
        VALUES.lock().expect("values").get(&format!("{in_flight}{{{labels}}}#max")).copied();
    assert!(
        highest.is_some_and(|h| (1.0..=2.0).contains(&h)),
        "one call and one pending settlement at most: {highest:?}"
    );
    assert_eq!(count(in_flight), 0.0, "every message is done");
}
