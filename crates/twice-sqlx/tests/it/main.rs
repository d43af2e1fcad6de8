//! Integration tests of the inbox stores and the processor, each on SQLite, PostgreSQL and
//! MariaDB.

#![cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#![allow(missing_docs, unreachable_pub)] // reason: test code, not an API

mod support;

mod batch;
mod business_keys;
mod classify;
mod crash;
mod dedup;
mod edges;
mod failover;
mod isolation;
mod outbox;
mod processor;
mod sessions;
mod store;
