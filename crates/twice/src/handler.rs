//! Handlers: the user's code that runs once per message.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::clock::Timestamp;
use crate::error::HandlerError;
use crate::idempotency::IdempotencyKey;
use crate::ids::MessageId;
use crate::message::{Message, ReceivedMessage};
use crate::outbox::{OutboxError, Outgoing};
use crate::outcome::Outcome;

/// A boxed future, as returned by closures given to [`handler_fn`] and [`json_fn`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The message a handler is given, with what it needs to act on it once.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    message: &'a ReceivedMessage,
    consumer: &'a str,
    outgoing: Option<&'a Outgoing>,
}

impl<'a> Context<'a> {
    /// A context for `message` handled by `consumer`, without an outbox: its
    /// [`send`](Context::send) fails with [`OutboxError::NotConfigured`].
    pub fn new(message: &'a ReceivedMessage, consumer: &'a str) -> Self {
        Self { message, consumer, outgoing: None }
    }

    /// A context whose sends go to `outgoing`, which the processor writes into the outbox in
    /// the handler's transaction before its commit.
    pub fn with_outgoing(
        message: &'a ReceivedMessage,
        consumer: &'a str,
        outgoing: &'a Outgoing,
    ) -> Self {
        Self { message, consumer, outgoing: Some(outgoing) }
    }

    /// Sends `message` to `destination` (a queue, or a topic; on RabbitMQ a queue, on NATS a
    /// subject) through the outbox: it becomes a row in the handler's own transaction, so it
    /// is sent if and only if the handler's work commits. Returns its message id: the one it
    /// carries, or one derived from this consumer, the incoming message id and the message's
    /// index among this run's sends, the same on every run for this message (see
    /// [`outbox`](crate::outbox)). The session id, properties, body and scheduled enqueue time
    /// are the message's own.
    ///
    /// # Errors
    ///
    /// [`OutboxError::NotConfigured`] when the inbox store has no outbox (the processor then
    /// dead-letters the message with reason `OutboxNotConfigured`: no retry would help), or a
    /// destination or field out of range.
    pub fn send(&self, destination: &str, message: Message) -> Result<MessageId, OutboxError> {
        self.outgoing.ok_or(OutboxError::NotConfigured)?.push(destination, message)
    }

    /// Publishes `message` to the topic `topic` through the outbox; the same as
    /// [`send`](Context::send), named for events.
    ///
    /// # Errors
    ///
    /// As [`send`](Context::send).
    pub fn publish(&self, topic: &str, message: Message) -> Result<MessageId, OutboxError> {
        self.send(topic, message)
    }

    /// Sends `message` to `destination` through the outbox to become visible at `at` (its
    /// scheduled enqueue time). Where the broker cannot hold a message until then (RabbitMQ,
    /// NATS), the relay keeps its row until it is due.
    ///
    /// # Errors
    ///
    /// As [`send`](Context::send).
    pub fn schedule(
        &self,
        destination: &str,
        message: Message,
        at: Timestamp,
    ) -> Result<MessageId, OutboxError> {
        self.send(destination, message.with_scheduled_enqueue_time(at))
    }

    /// The received message.
    pub fn message(&self) -> &'a ReceivedMessage {
        self.message
    }

    /// The message id: the inbox key together with the consumer.
    pub fn message_id(&self) -> &'a MessageId {
        self.message.message_id()
    }

    /// The body bytes.
    pub fn body(&self) -> &'a Bytes {
        self.message.body()
    }

    /// Which delivery this is (1 on the first).
    pub fn delivery_count(&self) -> u32 {
        self.message.delivery_count
    }

    /// The consumer name: the scope of the inbox key.
    pub fn consumer(&self) -> &'a str {
        self.consumer
    }

    /// A stable key for `step` of this message's work, the same on every redelivery: pass it to
    /// APIs that cannot join the transaction (payments, e-mail).
    pub fn idempotency_key(&self, step: &str) -> IdempotencyKey {
        IdempotencyKey::derive(self.consumer, self.message_id(), step)
    }

    /// A stable key for `step` of the work on a business entity (say, `order-42`), the same
    /// for every message that carries that entity: see
    /// [`IdempotencyKey::for_business_key`].
    pub fn business_idempotency_key(&self, business_key: &str, step: &str) -> IdempotencyKey {
        IdempotencyKey::for_business_key(self.consumer, business_key, step)
    }

    /// The body parsed as JSON.
    ///
    /// # Errors
    ///
    /// The parse error, when the body is not a `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(self.body())
    }
}

/// A message handler whose work runs in the transaction `Tx` that claimed the message.
///
/// The processor commits `tx` only when the handler returns [`Outcome::Complete`]; for every
/// other outcome, every error, a panic or a lost lock it rolls `tx` back.
pub trait Handler<Tx>: Send + Sync + 'static {
    /// Handles one message.
    fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        tx: &'a mut Tx,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send + 'a;
}

/// A [`Handler`] made from a closure; see [`handler_fn`].
pub struct HandlerFn<F> {
    f: F,
}

impl<F> std::fmt::Debug for HandlerFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandlerFn")
    }
}

/// A handler from a closure returning a boxed future:
/// `handler_fn(|ctx, tx| Box::pin(async move { ...; Ok(Outcome::Complete) }))`.
pub fn handler_fn<Tx, F>(f: F) -> HandlerFn<F>
where
    F: for<'a> Fn(Context<'a>, &'a mut Tx) -> BoxFuture<'a, Result<Outcome, HandlerError>>
        + Send
        + Sync
        + 'static,
{
    HandlerFn { f }
}

impl<Tx, F> Handler<Tx> for HandlerFn<F>
where
    Tx: Send + 'static,
    F: for<'a> Fn(Context<'a>, &'a mut Tx) -> BoxFuture<'a, Result<Outcome, HandlerError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        tx: &'a mut Tx,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send + 'a {
        (self.f)(ctx, tx)
    }
}

/// A handler of messages whose body is JSON for a `T`.
pub trait JsonHandler<T, Tx>: Send + Sync + 'static {
    /// Handles one message whose body parsed as `body`.
    fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        body: T,
        tx: &'a mut Tx,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send + 'a;
}

pub use crate::dead_letter_reasons::DESERIALIZATION_FAILED;

/// Adapts a [`JsonHandler`] into a [`Handler`]: a body that does not parse as `T` is
/// dead-lettered at once with reason [`DESERIALIZATION_FAILED`] and the parse error as its
/// description, since no retry can make it parse.
pub struct Json<H, T> {
    inner: H,
    _body: PhantomData<fn() -> T>,
}

impl<H, T> Json<H, T> {
    /// Wraps a typed handler.
    pub fn new(inner: H) -> Self {
        Self { inner, _body: PhantomData }
    }
}

impl<H, T> std::fmt::Debug for Json<H, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Json<{}>", std::any::type_name::<T>())
    }
}

impl<H, T, Tx> Handler<Tx> for Json<H, T>
where
    H: JsonHandler<T, Tx>,
    T: DeserializeOwned + Send + 'static,
    Tx: Send + 'static,
{
    async fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        tx: &'a mut Tx,
    ) -> Result<Outcome, HandlerError> {
        match ctx.json::<T>() {
            Ok(body) => self.inner.handle(ctx, body, tx).await,
            Err(e) => Ok(Outcome::dead_letter(DESERIALIZATION_FAILED, e.to_string())),
        }
    }
}

/// A [`JsonHandler`] made from a closure; see [`json_fn`].
pub struct JsonFn<F> {
    f: F,
}

impl<F> std::fmt::Debug for JsonFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JsonFn")
    }
}

impl<T, Tx, F> JsonHandler<T, Tx> for JsonFn<F>
where
    T: Send + 'static,
    Tx: Send + 'static,
    F: for<'a> Fn(Context<'a>, T, &'a mut Tx) -> BoxFuture<'a, Result<Outcome, HandlerError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        ctx: Context<'a>,
        body: T,
        tx: &'a mut Tx,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send + 'a {
        (self.f)(ctx, body, tx)
    }
}

/// A JSON handler from a closure: `json_fn(|ctx, order: OrderPlaced, tx| Box::pin(async move
/// { ... }))`. Bodies that do not parse as `T` are dead-lettered with
/// [`DESERIALIZATION_FAILED`].
pub fn json_fn<T, Tx, F>(f: F) -> Json<JsonFn<F>, T>
where
    T: DeserializeOwned + Send + 'static,
    Tx: Send + 'static,
    F: for<'a> Fn(Context<'a>, T, &'a mut Tx) -> BoxFuture<'a, Result<Outcome, HandlerError>>
        + Send
        + Sync
        + 'static,
{
    Json::new(JsonFn { f })
}
