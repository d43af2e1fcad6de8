//! The processor's pipeline at its edges, on an in-memory inbox and transport, so that
//! `cargo test -p twice` checks it without a database or a broker; `twice-sqlx` runs the same
//! scenarios against the real stores.

#![allow(missing_docs, unreachable_pub)] // reason: test code, not an API

mod health;
mod locks;
mod memory;
#[cfg(feature = "metrics")]
mod metrics;
mod pipeline;
mod settlement;
mod spans;
