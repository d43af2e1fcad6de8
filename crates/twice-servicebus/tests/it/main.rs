//! Integration tests of the Service Bus front end: raw AMQP against the wire rules, and the
//! official SDKs (Python, JavaScript, Rust) against a running server.

#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: tests fail loudly on setup errors
#![allow(unreachable_pub, missing_docs)] // reason: test modules are not a public API
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // reason: small test counts

mod admin_sdk;
mod backend;
mod console;
mod fuzz;
mod fuzz_conn;
mod gated;
mod harness;
mod hostile;
mod http_hostile;
mod http_port;
mod js_sdk;
mod logs;
mod python_sdk;
mod rust_sdk;
mod tls_sdks;
mod wire;
