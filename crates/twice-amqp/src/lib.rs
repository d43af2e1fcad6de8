//! AMQP 1.0 as Azure Service Bus speaks it: one layer for twice's server (`twice serve`) and
//! its client, so that both read and write the same bytes with one codec.
//!
//! ```
//! use twice_amqp::codec::{Decoder, Value};
//!
//! let bytes = Value::string("orders").to_bytes();
//! let value = Decoder::new(&bytes).value()?;
//! assert_eq!(value.as_str(), Some("orders"));
//! # Ok::<(), twice_amqp::codec::DecodeError>(())
//! ```
//!
//! The layers, bottom up: [`codec`] (AMQP types; decoding is total: bad input is a typed error,
//! never a panic), [`frame`] (framing, protocol headers, size limits), [`performative`] (typed
//! frame bodies), [`reassembly`] (a delivery from its transfer frames), [`mapping`] (AMQP
//! messages to and from twice's [`twice::Message`]), [`sas`] (shared access signatures: signing
//! and checking tokens), and on top [`servicebus`]: the Service Bus vocabulary (conditions,
//! `$management` operations, settlements) both sides speak.

pub mod codec;
pub mod frame;
pub mod mapping;
pub mod performative;
pub mod reassembly;
pub mod sas;
pub mod servicebus;
