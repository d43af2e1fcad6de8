//! The engine stays a pure state machine: nothing under `src/engine/` (its tests aside) names
//! tokio, files, the network, threads, processes, the environment, a clock or the storage.

use std::path::{Path, PathBuf};

/// What the engine must not name, and why each is banned.
const FORBIDDEN: &[(&str, &str)] = &[
    ("tokio", "an async runtime"),
    ("std::fs", "files"),
    ("std::io", "I/O"),
    ("rustix", "system calls"),
    ("std::net", "the network"),
    ("std::thread", "threads"),
    ("std::process", "processes"),
    ("std::env", "the environment"),
    ("Instant", "a clock"),
    ("SystemTime", "a clock"),
    ("Clock", "a clock"),
    ("clock::", "a clock"),
    ("crate::storage", "the storage"),
    ("super::storage", "the storage"),
    ("crate::runtime", "the runtime"),
];

/// The banned names in the code of `text` (comments are left out, since they may explain what
/// the engine does not do), as `(line number, name, why)`.
fn violations(text: &str) -> Vec<(usize, &'static str, &'static str)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        for &(name, why) in FORBIDDEN {
            if code.contains(name) {
                out.push((i + 1, name, why));
            }
        }
    }
    out
}

/// The engine's source files, without its test directory.
fn engine_sources() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read src/engine")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    files
}

#[test]
fn the_engine_names_no_runtime_file_network_thread_clock_or_storage() {
    let files = engine_sources();
    assert!(files.len() >= 5, "the engine's sources were not found: {files:?}");
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read an engine source");
        // An inline test module may use what the engine may not; it comes last in a file.
        let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or_default();
        for (line, name, why) in violations(code) {
            found.push(format!("{}:{line}: `{name}` ({why})", file.display()));
        }
    }
    assert!(found.is_empty(), "the engine must stay pure:\n{}", found.join("\n"));
}

#[test]
fn the_tidy_check_catches_what_it_bans() {
    let bad = "use tokio::sync::mpsc;\nlet f = std::fs::File::open(p);\n\
               let t = std::time::Instant::now();\nuse crate::storage::Log;\n";
    let names: Vec<_> = violations(bad).into_iter().map(|(_, name, _)| name).collect();
    assert_eq!(names, ["tokio", "std::fs", "Instant", "crate::storage"]);
    assert!(violations("// tokio is not used here\nlet x = 1;\n").is_empty());
}
