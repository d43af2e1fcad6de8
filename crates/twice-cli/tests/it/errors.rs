//! Errors as a user meets them: one line, `error: ` first, and every cause in it once.

use std::process::{Command, Stdio};

/// Runs `twice ARGS` to a failure; returns its stderr, which must be one `error: ` line.
fn fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_twice"))
        .args(args)
        .env_remove("TWICE_STORE")
        .env_remove("TWICE_CONNECTION_STRING")
        .env_remove("TWICE_ADMIN_URL")
        .stdin(Stdio::null())
        .output()
        .expect("running the twice binary");
    assert!(!out.status.success(), "expected a failure: {}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    let error: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("hint: ")).collect();
    assert_eq!(error.len(), 1, "one line of error: {stderr}");
    assert!(error[0].starts_with("error: "), "{stderr}");
    error[0].to_owned()
}

/// Asserts that `cause` is in `line` exactly once.
fn once(line: &str, cause: &str) {
    assert_eq!(line.matches(cause).count(), 1, "{cause:?} once in: {line}");
}

#[test]
fn wrong_credentials_print_their_cause_once() {
    // The MariaDB of the test machine has root without a password: any password is wrong.
    let line = fails(&["outbox", "status", "--store", "mysql://root:wrong@127.0.0.1:3306/test"]);
    once(&line, "Access denied");
}

#[test]
fn an_unreachable_server_prints_its_cause_once() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let line = fails(&[
        "demo",
        "--orders",
        "1",
        "--broker",
        &format!(
            "Endpoint=sb://127.0.0.1:{port};SharedAccessKeyName=k;SharedAccessKey=a2V5;UseDevelopmentEmulator=true"
        ),
    ]);
    once(&line, "Connection refused");
}

#[test]
fn a_bad_file_argument_prints_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("Config.json");
    let line = fails(&[
        "serve",
        "--in-memory",
        "--no-http",
        "--amqp",
        "127.0.0.1:0",
        "--config",
        missing.to_str().unwrap(),
    ]);
    once(&line, "No such file or directory");
    assert!(line.contains("Config.json"), "the error names the file: {line}");
}
