//! The broker against the limits of its process: running out of file descriptors never stops
//! it (what its storage needs is reserved before a client can ask for anything), and a disk
//! that refuses writes stops it acknowledging, says so, and loses nothing it acknowledged.

use std::process::Command;

use crate::support::example_bin;

/// Runs `broker_child MODE DIR` under the shell limits `limits` (shell commands run before
/// it); returns its output, after checking it succeeded.
fn child_with_limits(limits: &str, mode: &str, dir: &std::path::Path) -> String {
    let out = Command::new("sh")
        .args(["-c", &format!("{limits} && exec \"$0\" \"$@\"")])
        .arg(example_bin("broker_child"))
        .args([mode, dir.to_str().unwrap()])
        .output()
        .expect("run broker_child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn a_broker_with_no_file_descriptor_left_keeps_sending_and_receiving() {
    let dir = tempfile::tempdir().unwrap();
    // A low limit, so that the child can take every descriptor quickly.
    let stdout = child_with_limits("ulimit -n 256", "no-fds", dir.path());
    assert!(stdout.contains("sent 300\n"), "{stdout}");
    assert!(stdout.contains("completed 300\n"), "{stdout}");
    assert!(stdout.contains("health Healthy\n"), "{stdout}");
}

#[tokio::test]
async fn a_full_disk_stops_acknowledging_reports_the_failure_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    // A file size limit makes the kernel refuse writes past it (EFBIG), as a full disk
    // refuses them; the signal it would send is ignored, as a real ENOSPC sends none.
    let stdout = child_with_limits("trap '' XFSZ; ulimit -f 128", "no-space", dir.path());
    let acked: Vec<&str> = stdout.lines().filter_map(|l| l.strip_prefix("acked ")).collect();
    assert!(acked.len() > 10, "{stdout}");
    assert!(stdout.contains("health StorageFailed\n"), "{stdout}");
    assert!(stdout.contains("late send refused\n"), "{stdout}");
    // With space again, every acknowledged message is there.
    let broker = crate::support::open(dir.path(), &twice::ManualClock::default()).await;
    let ids: Vec<String> = crate::support::peek_all(&broker, "q")
        .await
        .iter()
        .map(|m| m.message_id().to_string())
        .collect();
    for id in &acked {
        assert!(ids.iter().any(|i| i == id), "acknowledged {id} is lost");
    }
    assert!(!ids.iter().any(|i| i == "late"));
    broker.shutdown().await;
}
