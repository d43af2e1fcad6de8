//! The JavaScript SDK (`@azure/service-bus` 7.9 from npm) against a running server: the
//! `node --test` files in `tests/js/`.

use std::time::Duration;

use crate::harness::{TestServer, may_skip, node_env, run_suite};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk_suite() {
    let dir =
        match tokio::task::spawn_blocking(|| node_env(&["servicebus.test.mjs"])).await.unwrap() {
            Ok(d) => d,
            Err(e) => {
                may_skip(&format!("cannot set up the JavaScript SDK: {e}"));
                return;
            }
        };
    // The test file is beside a link to `node_modules`, so its imports resolve.
    let test_file = dir.path().join("servicebus.test.mjs");
    let server = TestServer::start().await;
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg("--test").arg("--test-concurrency=1").arg(&test_file).current_dir(dir.path());
    let out = run_suite(cmd, &server, Duration::from_secs(300)).await;
    println!("{}", out.text);
    assert!(out.success, "node --test failed:\n{}", out.text);
    assert!(out.text.contains("# fail 0"), "{}", out.text);
    assert!(!out.text.contains("# pass 0"), "node ran no test:\n{}", out.text);
}
