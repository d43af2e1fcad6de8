//! The Python SDK (`azure-servicebus` 7.15 from PyPI) against a running server: the pytest
//! files in `tests/python/`, one test per operation.

use std::time::Duration;

use crate::harness::{TestServer, crate_dir, may_skip, python_env, run_suite};

/// The pytest command for one directory of tests.
fn pytest(python: &std::path::Path, dir: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "--timeout=120"])
        .arg(crate_dir().join(dir));
    cmd
}

fn python_or_skip() -> Option<std::path::PathBuf> {
    match python_env() {
        Ok(p) => Some(p),
        Err(e) => {
            may_skip(&format!("cannot set up the Python SDK: {e}"));
            None
        }
    }
}

/// A durable broker restarted between a send and a receive gives back every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_restart_loses_nothing() {
    let Some(python) = tokio::task::spawn_blocking(python_or_skip).await.unwrap() else { return };
    let dir = tempfile::tempdir().unwrap();
    let server =
        TestServer::start_with(twice_servicebus::ServerOptions::new(), Some(dir.path())).await;
    let mut send = pytest(&python, "tests/python/restart");
    send.env("SB_PHASE", "send");
    let out = run_suite(send, &server, Duration::from_secs(120)).await;
    assert!(out.success, "send phase failed:\n{}", out.text);
    server.stop().await;
    let server =
        TestServer::start_with(twice_servicebus::ServerOptions::new(), Some(dir.path())).await;
    let mut receive = pytest(&python, "tests/python/restart");
    receive.env("SB_PHASE", "receive");
    let out = run_suite(receive, &server, Duration::from_secs(120)).await;
    assert!(out.success, "receive phase failed:\n{}", out.text);
    assert!(out.text.contains("1 passed"), "{}", out.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_suite() {
    let python = match tokio::task::spawn_blocking(python_env).await.unwrap() {
        Ok(p) => p,
        Err(e) => {
            if may_skip(&format!("cannot set up the Python SDK: {e}")) {
                return;
            }
            unreachable!()
        }
    };
    let server = TestServer::start().await;
    let mut cmd = tokio::process::Command::new(python);
    cmd.args([
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "--timeout=120",
        "--ignore",
    ])
    .arg(crate_dir().join("tests/python/restart"))
    .arg("--ignore")
    .arg(crate_dir().join("tests/python/tls"))
    .arg("--ignore")
    .arg(crate_dir().join("tests/python/admin"))
    .arg(crate_dir().join("tests/python"));
    if let Ok(k) = std::env::var("SB_PYTEST_K") {
        cmd.args(["-k", &k]);
    }
    let limit = std::env::var("SB_SUITE_LIMIT").ok().and_then(|s| s.parse().ok()).unwrap_or(600);
    let out = run_suite(cmd, &server, Duration::from_secs(limit)).await;
    println!("{}", out.text);
    assert!(out.success, "pytest failed:\n{}", out.text);
    assert!(out.text.contains(" passed"), "pytest ran no test:\n{}", out.text);
    assert!(!out.text.contains(" failed"), "pytest reported failures:\n{}", out.text);
}
