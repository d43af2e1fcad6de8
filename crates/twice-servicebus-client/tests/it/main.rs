//! The Service Bus client against `twice serve`.

mod client;
mod entity;
mod harness;
mod http_client;
mod long_handlers;
mod processor;
mod scope;
mod tls;
