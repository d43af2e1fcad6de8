//! The twice broker served over AMQP 1.0 to the Azure Service Bus SDKs.
//!
//! ```
//! use twice_broker::{Broker, BrokerOptions};
//! use twice_servicebus::{Server, ServerOptions};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let broker = Broker::open(BrokerOptions::in_memory()).await?;
//! let options = ServerOptions::new()
//!     .amqp_addr("127.0.0.1:0".parse()?) // port 0: any free port
//!     .http_addr(None);
//! let server = Server::bind(options, broker).await?;
//! // Endpoint=sb://localhost:<port>;SharedAccessKeyName=RootManageSharedAccessKey;...
//! let connection_string = server.connection_string();
//! assert!(connection_string.contains("UseDevelopmentEmulator=true"));
//! // Serves until the shutdown future resolves (here: at once).
//! server.run(async {}).await?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! The official SDKs (Python `azure-servicebus`, JavaScript `@azure/service-bus`, the Rust
//! `azservicebus` crate) connect with an emulator connection string, which
//! [`Server::connection_string`] returns:
//!
//! ```text
//! Endpoint=sb://localhost:5673;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;
//! ```
//!
//! [`Server::bind`] opens the AMQP port (and an HTTP port with `/health`, `/metrics` and
//! `/entities`); [`Server::run`] serves a [`Backend`] (a `twice_broker::Broker`, or anything
//! else that implements the trait) until the shutdown future resolves. [`serve`] does both.
//!
//! The layers, bottom up: [`codec`] (AMQP types), [`frame`] (framing and protocol headers),
//! [`performative`] (typed frame bodies), the connection engine (sessions, links, credit, drain,
//! settlement echoes, `$cbs` with [`sas`] validation, `$management`), [`mapping`] (AMQP messages
//! to twice's), and [`backend`] (the boundary to the broker, wired to `twice-broker` in one
//! module).

pub mod address;
pub mod backend;
mod broker;
pub mod codec;
mod connection;
pub mod frame;
mod http;
pub mod mapping;
pub mod metrics;
mod mgmt;
mod options;
pub mod performative;
pub mod sas;
mod server;

pub use backend::{
    Backend, BackendError, BackendSession, EntityKind, EntityStats, ReceiveMode, Rule, RuleFilter,
    SessionLock, Settlement,
};
pub use broker::{BrokerSession, serve};
pub use options::ServerOptions;
pub use server::{Server, ServerError};
