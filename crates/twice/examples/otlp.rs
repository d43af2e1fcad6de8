//! Traces from a sender to a handler, exported over OTLP/HTTP.
//!
//! A sender span puts its W3C trace context into the message (`traceparent` and
//! `Diagnostic-Id`); the processor's span of that message, `twice.process`, takes it as its
//! parent, and the handler's own span sits inside. Every span goes to the OTLP/HTTP endpoint
//! in `OTEL_EXPORTER_OTLP_ENDPOINT` (default `http://localhost:4318`), such as a Jaeger or an
//! OpenTelemetry collector:
//!
//! ```text
//! docker run --rm -p 4318:4318 -p 16686:16686 jaegertracing/jaeger:2.5.0
//! cargo run -p twice --example otlp --features otlp-example
//! ```
//!
//! The broker and the store are in memory here, to keep the example to the tracing; any
//! [`Transport`] and [`Inbox`] give the same spans.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use twice::trace_context::{inject, of_span};
use twice::{
    BoxFuture, Claim, Context, DeadLetterReason, EntityInfo, ErrorClass, Inbox, Message, MessageId,
    Outcome, Processor, ProcessorOptions, Properties, Receive, ReceivedMessage, SequenceNumber,
    SharedClock, Timestamp, Transport, TransportError, handler_fn,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .unwrap_or_else(|_| "http://localhost:4318".to_owned());
    // Built before the async runtime: the blocking HTTP client must not start inside it.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(format!("{endpoint}/v1/traces"))
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name("twice-otlp-example").build())
        .build();
    tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("twice")))
        .init();

    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run())?;
    // Sends the spans still in the batch.
    provider.shutdown()?;
    println!("spans exported to {endpoint}");
    Ok(())
}

async fn run() -> Result<(), twice::ProcessorError> {
    let queue = Arc::new(Queue::default());
    for order in ["order-1", "order-2", "order-1"] {
        let send = tracing::info_span!("send", "otel.kind" = "producer", order);
        let mut message = Message::new("{}").with_message_id(order);
        if let Some(parent) = of_span(&send) {
            inject(&mut message, &parent);
        }
        queue.send(message);
    }
    let handler = handler_fn(|ctx: Context<'_>, claims: &mut Vec<MessageId>| {
        let id = ctx.message_id().clone();
        Box::pin(async move {
            let _work = tracing::info_span!("ship", order = %id).entered();
            claims.push(id);
            Ok(Outcome::Complete)
        }) as BoxFuture<'_, _>
    });
    let processor = Processor::from_arcs(
        Arc::clone(&queue),
        Arc::new(Claims::default()),
        Arc::new(handler),
        // One message at a time: the claims of this store never wait for each other.
        ProcessorOptions::new().max_concurrent_calls(1).max_wait(Duration::from_millis(50)),
    );
    let done = Arc::clone(&queue);
    processor
        .run(async move {
            while done.settled() < 3 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
}

/// A queue in memory that counts settlements; nothing is ever redelivered.
#[derive(Debug, Default)]
struct Queue {
    messages: Mutex<VecDeque<ReceivedMessage>>,
    settled: Mutex<usize>,
    entity: std::sync::OnceLock<EntityInfo>,
}

impl Queue {
    fn send(&self, message: Message) {
        let mut messages = self.messages.lock().expect("queue");
        let n = i64::try_from(messages.len()).unwrap_or(i64::MAX);
        messages.push_back(ReceivedMessage::new(
            message,
            SequenceNumber::new(n),
            SharedClock::system().now(),
        ));
    }

    fn settled(&self) -> usize {
        *self.settled.lock().expect("settled")
    }

    fn settle(&self) -> Result<(), TransportError> {
        *self.settled.lock().expect("settled") += 1;
        Ok(())
    }
}

impl Receive for Queue {
    type Delivery = ReceivedMessage;

    async fn receive(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        let taken: Vec<_> = {
            let mut messages = self.messages.lock().expect("queue");
            let n = max.min(messages.len());
            messages.drain(..n).collect()
        };
        if taken.is_empty() {
            tokio::time::sleep(wait).await;
        }
        Ok(taken)
    }

    async fn complete(&self, _: &ReceivedMessage) -> Result<(), TransportError> {
        self.settle()
    }

    async fn abandon(&self, _: &ReceivedMessage, _: Properties) -> Result<(), TransportError> {
        self.settle()
    }

    async fn dead_letter(
        &self,
        _: &ReceivedMessage,
        _: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.settle()
    }

    async fn defer(&self, _: &ReceivedMessage) -> Result<(), TransportError> {
        self.settle()
    }
}

impl Transport for Queue {
    fn entity(&self) -> &EntityInfo {
        self.entity.get_or_init(|| EntityInfo::new("orders"))
    }

    fn system(&self) -> &'static str {
        "memory"
    }

    async fn release(&self, _: &ReceivedMessage) -> Result<(), TransportError> {
        Ok(())
    }

    async fn renew_lock(&self, _: &ReceivedMessage) -> Result<Timestamp, TransportError> {
        Ok(Timestamp::MAX)
    }
}

/// Claimed ids in memory; a transaction is the list of ids it claims. Unlike a database, a
/// claim does not wait for a concurrent one, so the processor runs one message at a time.
#[derive(Debug, Default)]
struct Claims(Mutex<BTreeSet<MessageId>>);

impl Inbox for Claims {
    type Tx = Vec<MessageId>;
    type Error = std::io::Error;

    fn retention(&self) -> Option<Duration> {
        None
    }

    async fn begin(&self) -> Result<Vec<MessageId>, Self::Error> {
        Ok(Vec::new())
    }

    async fn claim<'a>(
        &'a self,
        _: &'a mut Vec<MessageId>,
        _: &'a str,
        id: &'a MessageId,
        _: Timestamp,
    ) -> Result<Claim, Self::Error> {
        let done = self.0.lock().expect("claims").contains(id);
        Ok(if done { Claim::Duplicate { claimed_at: None } } else { Claim::Claimed })
    }

    async fn commit(&self, tx: Vec<MessageId>) -> Result<(), Self::Error> {
        self.0.lock().expect("claims").extend(tx);
        Ok(())
    }

    async fn rollback(&self, _: Vec<MessageId>) -> Result<(), Self::Error> {
        Ok(())
    }

    async fn record<'a>(
        &'a self,
        _: &'a str,
        _: &'a MessageId,
        _: &'a str,
        _: Timestamp,
    ) -> Result<Claim, Self::Error> {
        Err(std::io::Error::other("this store has no dedup-only mode"))
    }

    async fn finish<'a>(
        &'a self,
        _: &'a mut Vec<MessageId>,
        _: &'a str,
        _: &'a MessageId,
        _: &'a str,
    ) -> Result<bool, Self::Error> {
        Ok(false)
    }

    async fn forget<'a>(
        &'a self,
        _: &'a str,
        _: &'a MessageId,
        _: &'a str,
    ) -> Result<bool, Self::Error> {
        Ok(false)
    }

    fn classify(&self, _: &(dyn std::error::Error + 'static)) -> ErrorClass {
        ErrorClass::Unknown
    }
}
