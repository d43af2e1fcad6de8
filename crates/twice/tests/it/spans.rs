//! The span of each message: its OpenTelemetry messaging fields, the sender's trace context
//! and the outcome.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Subscriber, subscriber};
use tracing_subscriber::layer::{Context as LayerContext, Layer, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use twice::trace_context::{TraceParent, inject};
use twice::{BoxFuture, Context, Message, Outcome, Processor, ProcessorOptions, handler_fn};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx};

/// A span's name (under `name`) and fields, as text.
type Fields = BTreeMap<String, String>;

/// A layer that keeps the fields of every span, recorded late or not, once it closes.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Fields>>>);

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        let mut fields = Fields::from([("name".to_owned(), attrs.metadata().name().to_owned())]);
        attrs.record(&mut Visitor(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: LayerContext<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
        {
            values.record(&mut Visitor(fields));
        }
    }
    fn on_close(&self, id: Id, ctx: LayerContext<'_, S>) {
        if let Some(fields) = ctx.span(&id).and_then(|s| s.extensions_mut().remove::<Fields>()) {
            self.0.lock().expect("spans").push(fields);
        }
    }
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Set in the process that runs one of these tests alone.
const ALONE: &str = "TWICE_SPANS_TEST_ALONE";

/// Whether this process runs the test `name` itself. Within the whole test run it runs `name`
/// in a child process of its own, asserts that it passed there, and returns false: which
/// subscribers see a span's callsite is decided once for the whole process, and a callsite
/// that another test's thread registers while this test's subscriber is being set up can stay
/// silenced for it (the capture then holds no span).
fn alone(name: &str) -> bool {
    if std::env::var_os(ALONE).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", &format!("spans::{name}"), "--test-threads=1", "--nocapture"])
        .env(ALONE, "1")
        .output()
        .expect("running the test in a process of its own");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the test did not run:\n{text}");
    false
}

/// Processes `messages` to their settlement with a handler that completes each, under a
/// subscriber that captures spans; returns the `twice.process` spans.
async fn process(messages: Vec<Message>) -> Vec<Fields> {
    let capture = Capture::default();
    // A current-thread runtime runs every task on this thread, under this default.
    let _default = subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let transport = Arc::new(MemoryTransport::new());
    let count = messages.len();
    for m in messages {
        transport.send(m);
    }
    let handler = handler_fn(|_: Context<'_>, _: &mut MemoryTx| {
        Box::pin(async { Ok(Outcome::Complete) }) as BoxFuture<'_, _>
    });
    let processor = Processor::from_arcs(
        Arc::clone(&transport),
        Arc::new(MemoryInbox::default()),
        Arc::new(handler),
        ProcessorOptions::new().max_wait(Duration::from_millis(10)).consumer("billing"),
    );
    let t = Arc::clone(&transport);
    let settled = async move {
        while t.settled().len() < count {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), processor.run(settled))
        .await
        .expect("settled in time")
        .expect("run");
    let spans = capture.0.lock().expect("spans").clone();
    spans.into_iter().filter(|f| f["name"] == "twice.process").collect()
}

/// The outcomes of the spans of message `id`, sorted.
fn outcomes(spans: &[Fields], id: &str) -> Vec<String> {
    let mut outcomes: Vec<String> = spans
        .iter()
        .filter(|f| f["messaging.message.id"] == id)
        .map(|f| f.get("twice.outcome").cloned().unwrap_or_default())
        .collect();
    outcomes.sort();
    outcomes
}

#[tokio::test]
async fn a_processed_message_has_a_span_with_the_messaging_fields_and_its_senders_trace_context() {
    if !alone(
        "a_processed_message_has_a_span_with_the_messaging_fields_and_its_senders_trace_context",
    ) {
        return;
    }
    let mut sent = Message::new("{}").with_message_id("order-1");
    inject(&mut sent, &PARENT.parse::<TraceParent>().expect("valid"));
    let spans = process(vec![sent]).await;
    assert_eq!(spans.len(), 1, "{spans:?}");
    let fields = &spans[0];
    let expected = [
        ("otel.name", "process orders"),
        ("otel.kind", "consumer"),
        ("messaging.system", "memory"),
        ("messaging.operation.type", "process"),
        ("messaging.destination.name", "orders"),
        ("messaging.consumer.group.name", "billing"),
        ("messaging.message.id", "order-1"),
        ("messaging.servicebus.message.delivery_count", "1"),
        ("trace_parent", PARENT),
        ("twice.outcome", "completed"),
    ];
    for (name, value) in expected {
        assert_eq!(fields.get(name).map(String::as_str), Some(value), "{name} in {fields:?}");
    }
}

#[tokio::test]
async fn a_duplicate_is_recorded_as_one_and_a_bad_trace_context_is_ignored() {
    if !alone("a_duplicate_is_recorded_as_one_and_a_bad_trace_context_is_ignored") {
        return;
    }
    let spans = process(vec![
        Message::new("{}").with_message_id("order-2"),
        Message::new("{}").with_message_id("order-2"),
        Message::new("{}").with_message_id("order-3").with_property("traceparent", "00-junk"),
    ])
    .await;
    assert_eq!(spans.len(), 3, "one span per delivery: {spans:?}");
    assert_eq!(outcomes(&spans, "order-2"), ["completed", "duplicate"]);
    assert_eq!(outcomes(&spans, "order-3"), ["completed"]);
    let order_3 = spans.iter().find(|f| f["messaging.message.id"] == "order-3").expect("span");
    assert_eq!(order_3.get("trace_parent"), None, "a bad traceparent is ignored: {order_3:?}");
}

/// With the `opentelemetry` feature the sender's span is the OpenTelemetry parent of the
/// message's span, and so of the handler's work.
#[cfg(feature = "opentelemetry")]
#[tokio::test]
async fn the_sender_is_the_opentelemetry_parent_of_the_message_span() {
    if !alone("the_sender_is_the_opentelemetry_parent_of_the_message_span") {
        return;
    }
    use opentelemetry::trace::{TraceContextExt as _, noop::NoopTracer};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let layer = tracing_opentelemetry::layer().with_tracer(NoopTracer::new());
    let _default = subscriber::set_default(tracing_subscriber::registry().with(layer));
    let transport = Arc::new(MemoryTransport::new());
    let mut sent = Message::new("{}").with_message_id("order-5");
    inject(&mut sent, &PARENT.parse::<TraceParent>().expect("valid"));
    transport.send(sent);
    let seen = Arc::new(Mutex::new(None));
    let seen_in_handler = Arc::clone(&seen);
    let handler = handler_fn(move |_: Context<'_>, _: &mut MemoryTx| {
        // The handler runs inside the message's span; a no-op tracer's context is its parent's.
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let ids = (span.span_context().trace_id().to_string(), span.span_context().span_id());
        *seen_in_handler.lock().expect("seen") = Some(ids);
        Box::pin(async { Ok(Outcome::Complete) }) as BoxFuture<'_, _>
    });
    let processor = Processor::from_arcs(
        Arc::clone(&transport),
        Arc::new(MemoryInbox::default()),
        Arc::new(handler),
        ProcessorOptions::new().max_wait(Duration::from_millis(10)),
    );
    let t = Arc::clone(&transport);
    let settled = async move {
        while t.settled().is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), processor.run(settled))
        .await
        .expect("settled in time")
        .expect("run");
    let (trace_id, span_id) = seen.lock().expect("seen").clone().expect("the handler ran");
    assert_eq!(trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(span_id.to_string(), "00f067aa0ba902b7");
}

/// A publisher that keeps what it was given.
#[derive(Debug, Default)]
struct Kept(Mutex<Vec<(String, Message)>>);

impl twice::Publish for Kept {
    async fn publish(
        &self,
        destination: &str,
        message: Message,
    ) -> Result<(), twice::TransportError> {
        self.0.lock().expect("kept").push((destination.to_owned(), message));
        Ok(())
    }
}

/// A handler's message sent through the outbox carries the incoming message's trace, and the
/// relay's `twice.publish` span names it: the trace runs from the incoming message to the send.
#[tokio::test]
async fn the_relays_send_span_is_linked_to_the_incoming_messages_trace() {
    if !alone("the_relays_send_span_is_linked_to_the_incoming_messages_trace") {
        return;
    }
    let capture = Capture::default();
    let _default = subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let transport = Arc::new(MemoryTransport::new());
    let mut sent = Message::new("{}").with_message_id("order-7");
    inject(&mut sent, &PARENT.parse::<TraceParent>().expect("valid"));
    transport.send(sent);
    let outbox = Arc::new(crate::memory::MemoryOutbox::default());
    let mut inbox = MemoryInbox::default();
    inbox.outbox = Some(Arc::clone(&outbox));
    let handler = handler_fn(|ctx: Context<'_>, _: &mut MemoryTx| {
        Box::pin(async move {
            ctx.send("shipped", Message::new("order 7 shipped"))?;
            Ok(Outcome::Complete)
        }) as BoxFuture<'_, _>
    });
    let processor = Processor::from_arcs(
        Arc::clone(&transport),
        Arc::new(inbox),
        Arc::new(handler),
        ProcessorOptions::new().max_wait(Duration::from_millis(10)).consumer("shipping"),
    );
    let kept = Arc::new(Kept::default());
    let relay =
        twice::Relay::from_arcs(Arc::clone(&outbox), Arc::clone(&kept), twice::RelayOptions::new());
    let k = Arc::clone(&kept);
    let done = async move {
        while k.0.lock().expect("kept").is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let (relayed, processed) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(10), relay.run(done)),
        tokio::time::timeout(
            Duration::from_secs(10),
            processor.run(async {
                while transport.settled().is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        ),
    );
    relayed.expect("relayed in time");
    processed.expect("processed in time").expect("run");
    let kept = kept.0.lock().expect("kept").clone();
    assert_eq!(kept.len(), 1);
    let id = kept[0].1.message_id.clone().expect("an id");
    let spans = capture.0.lock().expect("spans").clone();
    let publish: Vec<&Fields> = spans.iter().filter(|f| f["name"] == "twice.publish").collect();
    assert_eq!(publish.len(), 1, "{spans:?}");
    let span = publish[0];
    assert_eq!(span["trace_parent"], PARENT, "{span:?}");
    assert_eq!(span["messaging.destination.name"], "shipped");
    assert_eq!(span["messaging.message.id"], id.as_str());
    assert_eq!(span["otel.kind"], "producer");
    assert_eq!(
        twice::trace_context::extract(&kept[0].1).map(|p| p.to_string()).as_deref(),
        Some(PARENT),
        "the message carries the trace downstream"
    );
}
