//! No source file of a crate outgrows one room: every `.rs` file under `crates/*/src` has at
//! most 1,000 lines. A file that grows past it is split by concern, as `connection/`,
//! `config/`, `runtime/` and `storage/` are. The broker's engine is held to 700 lines a file:
//! it is split by concept (lookups, send, deliver, waiters, settle, sessions, timers, ...), and
//! a concept that outgrows that is two.

use std::path::{Path, PathBuf};

/// The most lines a source file may have.
const MAX_LINES: usize = 1_000;

/// The most lines a file of the broker's engine (`crates/twice-broker/src/engine/`, its tests
/// included) may have.
const MAX_ENGINE_LINES: usize = 700;

/// The files of `files` longer than `max` lines, named relative to `base`, sorted.
fn longer_than(files: &[PathBuf], max: usize, base: &Path) -> Vec<String> {
    let mut over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).expect("read a source file").lines().count();
            let name = f.strip_prefix(base).unwrap_or(f).display().to_string();
            (lines > max).then(|| format!("{name}: {lines} lines"))
        })
        .collect();
    over.sort();
    over
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_has_more_than_a_thousand_lines() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in std::fs::read_dir(&crates).expect("read crates/") {
        let src = krate.expect("a directory entry").path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 100, "the source files were not found: {}", files.len());
    let over = longer_than(&files, MAX_LINES, &crates);
    assert!(over.is_empty(), "split these by concern:\n{}", over.join("\n"));
}

#[test]
fn no_broker_engine_file_has_more_than_seven_hundred_lines() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let engine = crates.join("twice-broker/src/engine");
    let mut files = Vec::new();
    rust_files(&engine, &mut files);
    assert!(
        files.len() > 10 && files.iter().any(|f| f.ends_with("engine/mod.rs")),
        "the engine's files were not found under {}",
        engine.display()
    );
    let over = longer_than(&files, MAX_ENGINE_LINES, &crates);
    assert!(over.is_empty(), "split these by concept:\n{}", over.join("\n"));
}
