//! The Service Bus client against `twice serve`.

mod client;
mod entity;
mod harness;
mod long_handlers;
mod processor;
mod scope;
mod tls;
