//! Test support shared by twice's crates: server harnesses and fixtures.
//!
//! - [`db`]: a fresh PostgreSQL database, MariaDB database or SQLite file per test, dropped
//!   when the harness is dropped, so tests run in parallel without sharing tables.
//! - [`require_service`]: the rule for tests whose server is down: fail when `CI` is set,
//!   skip with a printed reason otherwise.
//! - [`process`]: child processes for crash tests: an example binary that is never stale, and
//!   a child killed with SIGKILL; [`process::ServerRestart`] restarts a server of the machine.
//! - [`prove`]: a kit that proves a user's own handler has its effects once under every
//!   fault: concurrent copies, crashes, lock loss, transient errors, resubmits.
//! - [`conformance`]: the suite every transport passes with each inbox store.
//! - [`serve`]: `twice serve` as a child process on free ports, ready when it returns.
//! - [`sdk`]: the official Service Bus SDKs for Python and Node, installed once per machine.
//! - [`proxy`]: a TCP proxy whose connections a test can cut.
//! - [`rabbitmq`]: a RabbitMQ queue per test, deleted on drop.
//! - [`nats`]: a NATS JetStream stream per test, deleted on drop.
//! - [`tls`]: a CA and a `localhost` certificate made for the test.
//!
//! Its doc tests also compile the Rust snippets of the repository's `README.md`
//! and of `docs/prove.md` (`cargo test -p twice-testkit --doc`), so what a reader copies
//! builds.

pub mod conformance;
pub mod db;
pub mod nats;
pub mod process;
pub mod prove;
pub mod proxy;
pub mod rabbitmq;
pub mod sdk;
pub mod serve;
pub mod tls;

/// The repository's README, whose Rust snippets are compiled here as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// The page `docs/prove.md`, whose example is run here as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/prove.md")]
pub struct ProveDoctests;

/// Runs an async clean-up step on a thread of its own, so `Drop` works inside and outside a
/// runtime; failures are printed, since a leftover test queue or stream is harmless.
pub(crate) fn run_cleanup<F, Fut, E>(what: &'static str, f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let joined = std::thread::spawn(move || {
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => {
                if let Err(e) = rt.block_on(f()) {
                    eprintln!("{what} clean-up failed: {e}");
                }
            }
            Err(e) => eprintln!("{what} clean-up failed: {e}"),
        }
    })
    .join();
    if joined.is_err() {
        eprintln!("{what} clean-up panicked");
    }
}

/// What a test does when the server it needs is unreachable: with `CI` set it panics (the test
/// fails); otherwise it prints why it skips and returns `None`.
///
/// # Panics
///
/// When `CI` is set and the service is unreachable.
pub fn require_service<T, E: std::fmt::Display>(name: &str, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(t) => Some(t),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{name} is required (CI is set) but unreachable: {e}")
        }
        Err(e) => {
            eprintln!("skipping: {name} is unreachable ({e}); set CI=1 to make this a failure");
            None
        }
    }
}
