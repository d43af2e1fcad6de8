//! The Service Bus client against `twice serve`.

mod client;
mod harness;
mod processor;
mod tls;
