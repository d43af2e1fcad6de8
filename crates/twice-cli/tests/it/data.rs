//! `twice data check|repair|export` on real data directories, healthy and damaged.

use std::path::Path;
use std::process::{Command, Output};

use twice::{ManualClock, Message};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Error};

fn twice_data(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_twice"))
        .arg("data")
        .args(args)
        .output()
        .expect("running the twice binary")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn options(dir: &Path) -> BrokerOptions {
    BrokerOptions::durable(dir).clock(ManualClock::default()).segment_size(4096)
}

/// 60 messages of about 300 bytes in queue `q`, over several segments.
async fn fill(dir: &Path) {
    let broker = Broker::open(options(dir)).await.unwrap();
    broker.create_queue("q", QueueProperties::default()).await.unwrap();
    for i in 0..60 {
        let body = format!("order {i:03} {}", "x".repeat(280));
        broker.send("q", Message::new(body).with_message_id(format!("m{i:03}"))).await.unwrap();
    }
    broker.shutdown().await;
}

/// Opens the broker on `dir` once no other process holds its lock. Other tests of this binary
/// start processes: one forked while a broker of this process held the lock holds it too until
/// it execs. Waits for that, a bounded number of times.
async fn open_when_free(dir: &Path) -> Result<Broker, Error> {
    let mut opened = Broker::open(options(dir)).await;
    for _ in 0..50 {
        if !matches!(opened, Err(Error::DirectoryInUse(_))) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        opened = Broker::open(options(dir)).await;
    }
    opened
}

fn segment_path(dir: &Path, id: u64) -> std::path::PathBuf {
    dir.join(format!("{id:020}.seg"))
}

#[tokio::test]
async fn check_reports_segments_entities_and_that_the_broker_opens() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path()).await;
    let out = twice_data(&["check", dir.path().to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("the broker opens this directory"), "{stdout}");
    let q = stdout.lines().find(|l| l.starts_with("q ")).unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(q.split_whitespace().nth(1), Some("60"), "{q}");
    // One line per segment, each with its records.
    let segments = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".seg"))
        .count();
    assert!(segments > 2, "the small segment size makes the log roll");
    let rows = stdout.lines().filter(|l| l.trim_end().ends_with('-')).count();
    assert_eq!(rows, segments, "{stdout}");
}

#[tokio::test]
async fn a_damaged_closed_segment_is_reported_exported_from_and_cut_where_the_operator_says() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path()).await;
    let d = dir.path().to_str().unwrap();
    // Bit rot in the middle of the second segment, which is closed.
    let path = segment_path(dir.path(), 2);
    let mut data = std::fs::read(&path).unwrap();
    let at = data.len() / 2;
    data[at] ^= 0x40;
    std::fs::write(&path, &data).unwrap();
    let opened = open_when_free(dir.path()).await;
    let Err(Error::CorruptLog { segment, offset }) = opened else {
        let files: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        panic!("the broker did not refuse a damaged log: {opened:?}; files {files:?}");
    };
    assert_eq!(segment, 2);
    assert!(offset <= at as u64);

    let out = twice_data(&["check", d]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("refuses"), "{stdout}");
    assert!(stdout.contains(&format!("segment 2 at byte offset {offset}")), "{stdout}");

    // Export rescues the messages before the damage, bodies included.
    let out = twice_data(&["export", d, "--entity", "q"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> =
        text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(!lines.is_empty() && lines.len() < 60, "{} messages exported", lines.len());
    for (i, m) in lines.iter().enumerate() {
        assert_eq!(m["message_id"], format!("m{i:03}"));
        let body = m["body"].as_str().unwrap();
        assert!(body.starts_with(&format!("order {i:03} ")), "{body}");
        assert_eq!(m["body_encoding"], "utf8");
    }

    // A dry run says what a cut at the damage loses, and changes nothing.
    let cut = format!("{segment}:{offset}");
    let out = twice_data(&["repair", d, "--truncate-at", &cut, "--dry-run"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("removing the later segments"), "{stdout}");
    assert!(stdout.contains("nothing changed"), "{stdout}");
    assert_eq!(std::fs::read(&path).unwrap(), data);

    let out = twice_data(&["repair", d, "--truncate-at", &cut]);
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    // The broker opens the cut log with exactly what the export saw.
    let broker = Broker::open(options(dir.path())).await.unwrap();
    assert_eq!(broker.counts("q").await.unwrap().active, lines.len() as u64);
    broker.shutdown().await;
}

#[tokio::test]
async fn a_closed_segment_cut_at_a_block_boundary_is_refused_by_the_broker_and_by_check() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path()).await;
    // Every block of the second segment is gone: what is left scans clean on its own.
    let path = segment_path(dir.path(), 2);
    let data = std::fs::read(&path).unwrap();
    std::fs::write(&path, &data[..40]).unwrap();
    let opened = open_when_free(dir.path()).await;
    assert!(
        matches!(opened, Err(Error::CorruptLog { segment: 2, offset: 40 })),
        "the broker did not refuse a cut segment: {opened:?}"
    );
    let out = twice_data(&["check", dir.path().to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("refuses"), "{stdout}");
    assert!(stdout.contains("segment 2 at byte offset 40"), "{stdout}");
}

#[test]
fn bad_cuts_and_unknown_entities_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(fill(dir.path()));
    let d = dir.path().to_str().unwrap();
    let out = twice_data(&["repair", d, "--truncate-at", "oops"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("SEGMENT:OFFSET"), "{}", text(&out.stderr));
    let out = twice_data(&["repair", d, "--truncate-at", "999:100"]);
    assert!(!out.status.success());
    let out = twice_data(&["export", d, "--entity", "nope"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("nope"), "{}", text(&out.stderr));
}

/// While `twice serve` holds the directory, `data check` says so, with its process id, and
/// does not claim a broker would open the directory now.
#[test]
fn check_names_the_running_broker_that_holds_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let serve = twice_testkit::serve::ServeProcess::start(
        env!("CARGO_BIN_EXE_twice"),
        &["--data-dir", data, "--no-http"],
    );
    let out = twice_data(&["check", data]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("a running broker holds this directory (pid {})", serve.id())),
        "{stdout}"
    );
    assert!(!stdout.contains("the broker opens this directory"), "{stdout}");
    drop(serve);
    // Once it has stopped, the directory is the broker's to open again.
    let out = twice_data(&["check", data]);
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("a running broker holds"), "{stdout}");
    assert!(stdout.contains("the broker opens this directory"), "{stdout}");
}
