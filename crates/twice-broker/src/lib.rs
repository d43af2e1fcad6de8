//! An embeddable, durable message broker with Azure Service Bus semantics.
//!
//! Queues, topics with subscriptions and rules, peek-lock with lock expiry and delivery counts,
//! dead-letter queues, duplicate detection, scheduled and deferred messages, and sessions, in
//! the process that uses them. In durable mode a change is acknowledged only once it is on
//! disk, and many concurrent changes share one fsync.
//!
//! ```
//! use std::time::Duration;
//!
//! use twice::Message;
//! use twice_broker::config::QueueProperties;
//! use twice_broker::{Broker, BrokerOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), twice_broker::Error> {
//! let dir = std::env::temp_dir().join(format!("twice-doc-{}", std::process::id()));
//! let broker = Broker::open(BrokerOptions::durable(&dir)).await?;
//! broker.create_queue("orders", QueueProperties::default()).await?;
//!
//! // Acknowledged once it is on disk.
//! broker.send("orders", Message::new("order 17").with_message_id("order-17")).await?;
//!
//! // Peek-lock: the message is invisible to other receivers until settled or its lock expires.
//! let received = broker.receive("orders", 10, Duration::from_secs(1)).await?;
//! assert_eq!(received[0].body().as_ref(), b"order 17");
//! assert_eq!(received[0].delivery_count, 1);
//! broker.complete(received[0].lock_token.expect("peek-lock")).await?;
//!
//! broker.shutdown().await;
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```
//!
//! [`Broker::receiver`] gives a [`twice::Transport`] for the idempotent processor, and
//! [`BrokerOptions::clock`] lets tests move time with a [`twice::ManualClock`].
//! [`Broker::health`] says whether the broker's storage failed (it then acknowledges nothing
//! more until restarted), and [`data`] checks, repairs and exports a data directory without
//! running the broker.

mod broker;
pub mod config;
mod engine;
mod error;
mod options;
mod publish;
mod runtime;
mod session;
pub mod sql;
mod storage;
mod transport;
mod vocabulary;

pub use broker::{
    Broker, DEFAULT_MAX_MESSAGE_SIZE, Health, MessageCounts, Statistics, StorageStatistics,
};
pub use error::Error;
pub use options::BrokerOptions;
pub use session::Session;
pub use storage::data;
pub use transport::Receiver;
/// The dead-letter reasons, the broker's among them ([`dead_letter_reasons::BROKER`]).
pub use twice::dead_letter_reasons;
pub use vocabulary::{ReceiveMode, SendOutcome, Settlement};
