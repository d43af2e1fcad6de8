//! An Azure Service Bus client over AMQP 1.0 that runs twice's processor against Service Bus,
//! the Service Bus emulator or `twice serve`, with the same code.
//!
//! ```no_run
//! use std::time::Duration;
//! use twice::Message;
//! use twice_servicebus_client::{ReceiverOptions, ServiceBusClient, StableIdSender};
//!
//! # async fn run() -> Result<(), twice_servicebus_client::Error> {
//! let client = ServiceBusClient::from_connection_string(
//!     "Endpoint=sb://localhost:5673;SharedAccessKeyName=RootManageSharedAccessKey;\
//!      SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true",
//! )?;
//! let sender = StableIdSender::new(client.sender("orders"));
//! sender.send("order-42", "OrderPlaced", Message::new(r#"{"order_id":42}"#)).await?;
//!
//! let receiver = client.receiver("orders", ReceiverOptions::new().max_concurrent_calls(4));
//! for delivery in receiver.receive_messages(10, Duration::from_secs(5)).await? {
//!     println!("{:?}", delivery.message().message_id());
//!     receiver.complete_message(&delivery).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! A [`Receiver`] implements [`twice::Transport`] and a [`SessionClient`]
//! [`twice::SessionTransport`], so `twice::Processor::new(receiver, inbox, handler, options)`
//! runs a handler exactly once per message id against Service Bus.
//!
//! # What it does
//!
//! - Connection strings as the SDKs accept them ([`ConnectionString`]); credentials from a
//!   [`TokenProvider`]: a SAS key, a SAS signature, or Entra ID (see [`token`]).
//! - TLS (amqps, port 5671) with rustls and the webpki roots for Azure, or a custom CA
//!   ([`TlsOptions`]); plain AMQP for the emulator (`UseDevelopmentEmulator=true`).
//! - Claims-based security: a token is put to `$cbs` for an entity before the first link to
//!   it, and a fresh one before the old one expires.
//! - One connection per client, made on first use and made again after any loss, with
//!   exponential backoff and jitter ([`RetryOptions`]); receivers and senders attach again on
//!   their next call. A message received on a link that died cannot be settled any more: its
//!   settlement fails with lock-lost, which the processor expects (the message comes back).
//! - Receive in peek-lock with credit on demand (a call for `n` messages opens credit for
//!   `n`, so no message is locked before a handler is free to take it; see
//!   [`ReceiverOptions`]) or a prefetch, or receive-and-delete; complete, abandon with properties, dead-letter with reason and
//!   description, defer, receive deferred messages, renew locks through `$management`;
//!   peek without locking (queues, subscriptions and their dead-letter queues);
//!   sessions (accept next or named, renew the session lock, get and set state).
//! - Send single messages, batches, scheduled messages and cancel them; [`StableIdSender`]
//!   derives message ids from a business key and an event type and resends with the same id.
//! - Entity properties from the namespace's administration API, over [`http`]: a small HTTP
//!   client on hyper (one request per connection, or a connection kept open), with typed
//!   errors, which twice's tools use too.
//!
//! # Why its own AMQP layer
//!
//! The client speaks AMQP through `twice-amqp`, the codec `twice serve` already uses, rather
//! than `azservicebus` or `fe2o3-amqp`. The `azservicebus` 0.25 sender has a race (documented
//! in `twice-servicebus`): when the service's `accepted` disposition arrives before the
//! sender has registered the delivery, the send never returns — on a fast loopback to
//! `twice serve` this happens, and a transport that hangs is not acceptable. Here the session
//! task registers a delivery before its transfer is written, so an early disposition always
//! finds it. One codec for both sides also means one set of wire tests and no second copy of
//! the Service Bus message mapping; and the crate depends on no broker (`twice-broker` is not
//! a dependency), so a user who wants only a Service Bus client gets only that.
//!
//! # What was tested where
//!
//! The tests run against `twice serve` in process (plain and TLS with a certificate made in
//! the test), with the processor and a PostgreSQL inbox; the conformance kit
//! (`twice-testkit`) runs a [`Receiver`] against `twice serve` with each inbox store and
//! restarts the server under it. Against Azure itself nothing runs in
//! CI: the TLS roots, Entra ID tokens and Azure's own replies are exercised only through the
//! same code paths against `twice serve` and unit tests of the requests.

mod admin;
pub mod atom;
mod client;
mod connstr;
mod endpoint;
mod engine;
mod error;
pub mod http;
mod options;
mod publish;
mod receiver;
mod sender;
mod session;
mod tls;
pub mod token;

pub use client::{ClientOptions, RetryOptions, ServiceBusClient};
pub use connstr::ConnectionString;
pub use endpoint::AdminEndpoint;
pub use error::{Error, condition};
pub use options::{ReceiveMode, ReceiverOptions};
pub use publish::Publisher;
pub use receiver::{Receiver, ServiceBusDelivery};
pub use sender::{MAX_MESSAGE_ID_LEN, Sender, StableIdSender, stable_message_id};
pub use session::{SessionClient, SessionReceiver};
pub use tls::TlsOptions;
pub use token::{AccessToken, SasKeyProvider, SasSignatureProvider, TokenProvider, TokenType};

/// A receiver and a sender on one entity, from a connection string: what `twice demo
/// --broker <connection string>` needs. `max_concurrent_calls` bounds the receiver's credit.
pub fn connect(
    connection_string: &str,
    entity: &str,
    max_concurrent_calls: usize,
) -> Result<(Receiver, Sender), Error> {
    let client = ServiceBusClient::from_connection_string(connection_string)?;
    let receiver =
        client.receiver(entity, ReceiverOptions::new().max_concurrent_calls(max_concurrent_calls));
    Ok((receiver, client.sender(entity)))
}
