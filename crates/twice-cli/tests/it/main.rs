//! Tests of the `twice` binary, run as a user runs it.

mod admin_sdks;
mod data;
mod demo;
mod dlq;
mod dlq_brokers;
mod errors;
mod outbox;
mod serve;
