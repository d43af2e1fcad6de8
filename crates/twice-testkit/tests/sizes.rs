//! No source file of a crate outgrows one room: every `.rs` file under `crates/*/src` has at
//! most 1,000 lines. A file that grows past it is split by concern, as `connection/`,
//! `config/`, `runtime/` and `storage/` are.

use std::path::{Path, PathBuf};

/// The most lines a source file may have.
const MAX_LINES: usize = 1_000;

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
    let mut over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).expect("read a source file").lines().count();
            let name = f.strip_prefix(&crates).unwrap_or(f).display().to_string();
            (lines > MAX_LINES).then(|| format!("{name}: {lines} lines"))
        })
        .collect();
    over.sort();
    assert!(over.is_empty(), "split these by concern:\n{}", over.join("\n"));
}
