//! twice: message handlers whose effects happen once, although the broker delivers at least
//! once.
//!
//! A [`Processor`] receives messages from a [`Transport`] and runs a [`Handler`] on each inside
//! a transaction of an [`Inbox`] store. The first statement of that transaction claims
//! `(consumer, message id)` with an insert under a primary key, so of two copies of a message,
//! even two at the same instant, only one does the work; the message is completed only after
//! the transaction has committed. The stores live in `twice-sqlx` (SQLite, PostgreSQL,
//! MariaDB/MySQL); this crate depends on no database driver and no broker client.
//!
//! See [`processor`] for what happens to each message, [`Mode`] for the three ways of
//! protecting work, and [`IdempotencyKey`] for work that cannot join the transaction.
//!
//! A handler that sends a follow-up message sends it through its context
//! ([`Context::send`], [`Context::publish`], [`Context::schedule`]): the message becomes a row
//! of the [`outbox`] in the same transaction, sent by a [`Relay`] only once that transaction
//! has committed, under an id fixed when the row was written. So no work that rolls back
//! announces itself, and no work that commits goes unannounced.
//!
//! # Example
//!
//! The seed's shipping handler: one shipment per `OrderPlaced`, with the database as the only
//! judge of which copy wins. The inbox here is a toy store that shows the shape of the trait;
//! `twice-sqlx` provides the real ones, whose `Tx` is a `sqlx::Transaction`.
//!
//! ```
//! use std::collections::BTreeSet;
//! use std::sync::Mutex;
//!
//! use serde::Deserialize;
//! use twice::{json_fn, Claim, Context, ErrorClass, Inbox, MessageId, Outcome, Timestamp};
//!
//! #[derive(Deserialize)]
//! struct OrderPlaced {
//!     order_id: u64,
//! }
//!
//! /// A store that keeps claims and shipments in memory; a transaction is a buffer of both.
//! #[derive(Debug, Default)]
//! struct Memory {
//!     claims: Mutex<BTreeSet<(String, MessageId)>>,
//!     shipments: Mutex<Vec<u64>>,
//! }
//! #[derive(Default)]
//! struct Tx {
//!     claim: Option<(String, MessageId)>,
//!     shipments: Vec<u64>,
//! }
//!
//! impl Inbox for Memory {
//!     type Tx = Tx;
//!     type Error = std::io::Error;
//!     fn retention(&self) -> Option<std::time::Duration> {
//!         None
//!     }
//!     async fn begin(&self) -> Result<Tx, Self::Error> {
//!         Ok(Tx::default())
//!     }
//!     async fn claim<'a>(
//!         &'a self,
//!         tx: &'a mut Tx,
//!         consumer: &'a str,
//!         id: &'a MessageId,
//!         _now: Timestamp,
//!     ) -> Result<Claim, Self::Error> {
//!         // A real store inserts under a primary key and waits for a concurrent claim.
//!         if self.claims.lock().unwrap().contains(&(consumer.to_owned(), id.clone())) {
//!             return Ok(Claim::Duplicate { claimed_at: None });
//!         }
//!         tx.claim = Some((consumer.to_owned(), id.clone()));
//!         Ok(Claim::Claimed)
//!     }
//!     async fn commit(&self, tx: Tx) -> Result<(), Self::Error> {
//!         self.claims.lock().unwrap().extend(tx.claim);
//!         self.shipments.lock().unwrap().extend(tx.shipments);
//!         Ok(())
//!     }
//!     async fn rollback(&self, _tx: Tx) -> Result<(), Self::Error> {
//!         Ok(())
//!     }
//!     // The dedup-only mode's records; this store does not offer the mode.
//!     async fn record<'a>(
//!         &'a self,
//!         _: &'a str,
//!         _: &'a MessageId,
//!         _owner: &'a str,
//!         _: Timestamp,
//!     ) -> Result<Claim, Self::Error> {
//!         Err(std::io::Error::other("dedup-only mode is not supported"))
//!     }
//!     async fn finish<'a>(
//!         &'a self,
//!         _: &'a mut Tx,
//!         _: &'a str,
//!         _: &'a MessageId,
//!         _owner: &'a str,
//!     ) -> Result<bool, Self::Error> {
//!         Ok(false)
//!     }
//!     async fn forget<'a>(&'a self, _: &'a str, _: &'a MessageId, _owner: &'a str) -> Result<bool, Self::Error> {
//!         Ok(false)
//!     }
//!     fn classify(&self, _: &(dyn std::error::Error + 'static)) -> ErrorClass {
//!         ErrorClass::Unknown
//!     }
//! }
//!
//! // The handler: its work goes into the transaction that claimed the message.
//! let handler = json_fn(|ctx: Context<'_>, order: OrderPlaced, tx: &mut Tx| {
//!     Box::pin(async move {
//!         let _charge_key = ctx.idempotency_key("charge"); // for a payment API
//!         tx.shipments.push(order.order_id);
//!         Ok(Outcome::Complete)
//!     })
//! });
//! # let _ = handler;
//! ```
//!
//! A processor then runs it: `Processor::new(transport, inbox, handler,
//! ProcessorOptions::new().max_concurrent_calls(16)).run(shutdown).await`; the `twice-sqlx`
//! crate docs run the same handler end to end against a broker and a database.
//!
//! # Observability
//!
//! - Each message is processed in a `twice.process` span whose fields follow the
//!   OpenTelemetry semantic conventions for messaging (`messaging.system` from
//!   [`Transport::system`], `messaging.destination.name`, `messaging.message.id`,
//!   `messaging.operation.type = "process"`, `messaging.consumer.group.name`, the delivery
//!   count, `otel.kind = "consumer"`), with `twice.outcome` recorded when it is settled and
//!   `trace_parent` when the message carries the sender's W3C trace context
//!   ([`trace_context`]). With the `opentelemetry` feature, that context is the span's
//!   OpenTelemetry parent, so a trace runs from the sender to the handler;
//!   `examples/otlp.rs` (feature `otlp-example`) exports such a trace over OTLP/HTTP.
//! - [`Processor::health_handle`] checks whether the processor is receiving, when it last
//!   completed a message, and whether its inbox answers ([`health`]).
//! - [`Processor::counters`], and with the `metrics` feature the `metrics` facade, count
//!   what happened to the messages.

pub mod clock;
pub mod counters;
pub mod dead_letter;
pub mod dead_letter_reasons;
pub mod error;
pub mod export;
pub mod handler;
pub mod health;
pub mod idempotency;
pub mod identity;
pub mod ids;
pub mod inbox;
pub mod iso_duration;
pub mod message;
pub mod outbox;
pub mod outcome;
pub mod processor;
pub mod retry;
pub mod session;
pub mod trace_context;
pub mod transport;

pub use clock::{Clock, ManualClock, SharedClock, Stopwatch, SystemClock, Timestamp};
pub use counters::{CounterSnapshot, Counters};
pub use error::{
    BoxError, ErrorClass, ErrorSource, HandlerError, HandlerErrorKind, ProcessError,
    ProcessorError, ResultExt,
};
pub use handler::{
    BoxFuture, Context, DESERIALIZATION_FAILED, Handler, HandlerFn, Json, JsonFn, JsonHandler,
    handler_fn, json_fn,
};
pub use health::{Health, HealthHandle};
pub use idempotency::IdempotencyKey;
pub use identity::{MessageIdentity, WhenMissing};
pub use ids::{LockToken, MessageId, SequenceNumber, SessionId};
pub use inbox::{Claim, Inbox};
pub use message::{Message, MessageState, Properties, ReceivedMessage, Value};
pub use outbox::{OutboxError, OutboxStore, OutgoingMessage, Publish, Relay, RelayOptions};
pub use outcome::Outcome;
pub use processor::{
    BusinessKeyDuplicate, HANDLER_FAILED, MISSING_MESSAGE_ID, Mode, Processor, ProcessorOptions,
    redelivery_horizon,
};
pub use retry::{REDELIVERY_COUNT_PROPERTY, RetryPolicy, redelivery_count};
pub use session::{SessionProcessor, SessionProcessorOptions};
pub use transport::{
    DeadLetterReason, Delivery, EntityInfo, Receive, SessionReceiver, SessionTransport, Transport,
    TransportError,
};
