//! Test support shared by twice's crates: server harnesses and fixtures.
//!
//! - [`db`]: a fresh PostgreSQL database, MariaDB database or SQLite file per test, dropped
//!   when the harness is dropped, so tests run in parallel without sharing tables.
//! - [`require_service`]: the rule for tests whose server is down: fail when `CI` is set,
//!   skip with a printed reason otherwise.
//! - [`process`]: child processes for crash tests: an example binary that is never stale, and
//!   a child killed with SIGKILL.

pub mod db;
pub mod process;

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
