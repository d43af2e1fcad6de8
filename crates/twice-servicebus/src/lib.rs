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
//! [`Server::bind`] opens the AMQP port (and an HTTP port with `/health`, `/metrics`,
//! `/entities` and the Service Bus administration API, ATOM over HTTP, that
//! `ServiceBusAdministrationClient` speaks); [`Server::run`] serves a [`Backend`] (a `twice_broker::Broker`, or anything
//! else that implements the trait) until the shutdown future resolves. [`serve`] does both.
//!
//! With [`ServerOptions::tls_pem`] the server speaks amqps (TLS, as Azure does on port 5671)
//! and its connection string leaves out `UseDevelopmentEmulator`, so clients use TLS.
//!
//! # Durability and flow
//!
//! A send is accepted, and a settlement echoed, only once the broker has made it durable. A
//! connection never waits for that itself: each link has a task that calls the broker, so the
//! sends, settlements and receives of every link stay in flight together and the broker writes
//! them in groups. A settlement is echoed with the outcome type the client sent (without
//! the dead-letter error a `rejected` carried, which the SDKs would take for a failure), or
//! with `com.microsoft:message-lock-lost` when the lock was gone. Receive-and-delete
//! messages are completed once they are written to the socket, so a message taken for a link
//! that closes first goes back to the queue.
//!
//! Outgoing transfers keep within the link credit, the client's session incoming window and
//! [`ServerOptions::max_unsettled_per_link`]. A session receiver whose session lock expires is
//! detached with `com.microsoft:session-lock-lost` even while it idles. A connection over
//! [`ServerOptions::max_connections`] is answered with `open` and a `close` carrying
//! `amqp:resource-limit-exceeded` (the SDKs' quota error). Sessions and links are bounded by
//! the `channel-max` and `handle-max` the server announces
//! ([`ServerOptions::max_sessions_per_connection`], [`ServerOptions::max_links_per_session`]).
//!
//! # Hostile clients
//!
//! A link is used only once it is attached and authorized: a transfer on a refused, detached or
//! unknown handle ends its session with `amqp:session:unattached-handle`, and a token holds
//! only until it expires. A client sender gets link credit back only as its sends become
//! durable, and a connection stops reading its socket while more than
//! [`ServerOptions::max_bytes_in_flight`] of its sends wait for the broker. Handshakes time out
//! ([`ServerOptions::handshake_timeout`]) and count apart from the connection limit; frames
//! before `open` are at most 512 bytes; writes to a client that stops reading time out. See
//! `SECURITY.md` for the threat model and every limit.
//!
//! # Known client issues
//!
//! The Rust `azservicebus` crate (0.25, on `fe2o3-amqp` 0.14) has a race in its sender: it
//! registers a delivery as unsettled only after handing the transfer to its session task
//! (`SenderLink::send_payload_with_transfer`). When the server's `accepted` disposition arrives
//! before that, the client drops it and `send_message` never returns. Across a network the
//! disposition cannot arrive that fast; on loopback against an in-memory broker it sometimes
//! does. If you test with `azservicebus` against a local server, put a little latency between
//! them (this crate's tests use a proxy that delays the server's bytes by 1 ms), or bound each
//! send with a timeout and resend (with duplicate detection on the queue the resend is
//! harmless). The Python and JavaScript SDKs are not affected.
//!
//! # Layers
//!
//! The layers, bottom up (the first three and [`mapping`] and [`sas`] are re-exported from
//! `twice-amqp`, which the client shares): [`codec`] (AMQP types), [`frame`] (framing and protocol headers),
//! [`performative`] (typed frame bodies), the connection engine (sessions, links, credit, drain,
//! settlement echoes, `$cbs` with [`sas`] validation, `$management`), [`mapping`] (AMQP messages
//! to twice's), and [`backend`] (the boundary to the broker, wired to `twice-broker` in one
//! module).

pub mod address;
mod admin;
pub mod backend;
mod broker;
mod conditions;
mod connection;
mod console;
pub mod dev_tls;
mod grants;
mod hint;
mod http;
mod ids;
pub mod metrics;
mod mgmt;
mod options;
mod pending;
mod request;
mod server;
mod settle;
mod shared;

// The AMQP layer lives in `twice-amqp`, shared with the client; re-exported so paths keep working.
pub use twice_amqp::{codec, frame, mapping, performative, sas};

pub use backend::{
    Backend, BackendError, BackendSession, EntityKind, EntityStats, ReceiveMode, Rule, Settlement,
};
pub use broker::{BrokerSession, serve};
pub use options::{ServerOptions, TlsError};
pub use server::{Server, ServerError};
