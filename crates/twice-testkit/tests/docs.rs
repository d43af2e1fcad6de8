//! `ARCHITECTURE.md` names only files that exist.
//!
//! Every backticked `crates/…` path in it (a file, or a directory when it ends in `/`; `*`
//! stands for any one name) is in the repository. Every Rust file it names by a shorter path
//! (`engine/timers.rs`, `settle.rs`) is a file of the crate whose section (`### `crates/…``)
//! names it, or of the repository outside those sections. A file moved, split or renamed
//! without the map following it fails here.

use std::path::{Path, PathBuf};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The backticked spans of a markdown text outside fenced code blocks, each with the crate
/// directory of the section it is in (`None` outside a crate's section). A span that goes on
/// to the next line is joined with a space, as markdown renders it.
fn spans(text: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    let mut section: Option<String> = None;
    let mut fenced = false;
    let mut open: Option<String> = None;
    for line in text.lines() {
        if open.is_none() {
            if line.starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if fenced {
                continue;
            }
            if line.starts_with("## ") || line.starts_with("### ") {
                section = line
                    .strip_prefix("### `")
                    .and_then(|h| h.strip_suffix('`'))
                    .filter(|c| c.starts_with("crates/"))
                    .map(str::to_owned);
            }
        }
        for (i, piece) in line.split('`').enumerate() {
            if i > 0 {
                match open.take() {
                    Some(span) => out.push((section.clone(), span)),
                    None => open = Some(String::new()),
                }
            }
            if let Some(span) = &mut open {
                if i == 0 {
                    span.push(' ');
                }
                span.push_str(piece);
            }
        }
    }
    out
}

/// Whether `path`, relative to `root` and with `*` standing for any one name, names something
/// that exists (a directory, when it ends in `/`).
fn exists(root: &Path, path: &str) -> bool {
    let mut found = vec![root.to_path_buf()];
    for part in path.trim_end_matches('/').split('/') {
        found = found
            .into_iter()
            .flat_map(|dir| -> Vec<PathBuf> {
                if part == "*" {
                    std::fs::read_dir(&dir)
                        .into_iter()
                        .flatten()
                        .flatten()
                        .map(|e| e.path())
                        .collect()
                } else {
                    let p = dir.join(part);
                    if p.exists() { vec![p] } else { Vec::new() }
                }
            })
            .collect();
    }
    found.iter().any(|p| !path.ends_with('/') || p.is_dir())
}

/// The `crates/…` paths of `text` that name nothing under `root`, and how many it names.
fn missing_crate_paths(text: &str, root: &Path) -> (Vec<String>, usize) {
    let paths: Vec<String> =
        spans(text).into_iter().map(|(_, s)| s).filter(|s| s.starts_with("crates/")).collect();
    let missing = paths.iter().filter(|p| !exists(root, p)).cloned().collect();
    (missing, paths.len())
}

/// The files under `dir`, as paths relative to `root` with `/` between names; build output,
/// installed packages and hidden directories left out.
fn files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "node_modules") {
                files(root, &path, out);
            }
        } else if let Ok(rel) = path.strip_prefix(root) {
            let parts: Vec<_> = rel.components().map(|c| c.as_os_str().to_string_lossy()).collect();
            out.push(parts.join("/"));
        }
    }
}

/// Whether a span is a path to a Rust file (`settle.rs`, `engine/timers.rs`).
fn is_rust_path(span: &str) -> bool {
    span.ends_with(".rs")
        && span.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        && !span.starts_with('/')
}

/// The Rust files `text` names by a path not starting with `crates/` that no file under
/// `root` has (within its section's crate), and how many it names.
fn missing_rust_files(text: &str, root: &Path) -> (Vec<String>, usize) {
    let mut all = Vec::new();
    files(root, root, &mut all);
    let named: Vec<(Option<String>, String)> = spans(text)
        .into_iter()
        .filter(|(_, s)| is_rust_path(s) && !s.starts_with("crates/"))
        .collect();
    let missing = named
        .iter()
        .filter(|(section, name)| {
            let within = section.as_ref().map(|c| format!("{c}/")).unwrap_or_default();
            !all.iter()
                .any(|f| f.starts_with(&within) && format!("/{f}").ends_with(&format!("/{name}")))
        })
        .map(|(section, name)| match section {
            Some(c) => format!("{name} (in the section of {c})"),
            None => name.clone(),
        })
        .collect();
    (missing, named.len())
}

fn architecture() -> String {
    std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("read ARCHITECTURE.md")
}

#[test]
fn every_crates_path_in_the_architecture_exists() {
    let (missing, named) = missing_crate_paths(&architecture(), &root());
    assert!(named >= 10, "the crates/ paths of ARCHITECTURE.md were not found: {named}");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_rust_file_the_architecture_names_exists_in_its_crate() {
    let (missing, named) = missing_rust_files(&architecture(), &root());
    assert!(named >= 50, "the Rust files of ARCHITECTURE.md were not found: {named}");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names Rust files that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_checks_find_what_is_missing() {
    let text = "Intro `crates/twice-cli/src/serve.rs` and `crates/twice-cli/src/gone.rs`,\n\
                a directory `crates/twice-broker/src/engine/`, not a file `crates/twice-broker/src/lib.rs/`,\n\
                a glob `crates/*/src`, `crates/*/nowhere`, and a span `twice data\n\
                export` over two lines.\n\
                ```\n`crates/in/a/fence.rs`\n```\n\
                ### `crates/twice-broker`\n\
                - `engine/timers.rs`, `settle.rs`, `internals.rs`, `serve.rs` (the CLI's)\n\
                #### A subsection keeps its crate: `lookups.rs`, `gone.rs`\n\
                ## Cross-cutting\n\
                `serve.rs` anywhere, `engine/nowhere.rs`\n";
    let (missing, named) = missing_crate_paths(text, &root());
    assert_eq!(named, 7, "with the heading");
    assert_eq!(
        missing,
        ["crates/twice-cli/src/gone.rs", "crates/twice-broker/src/lib.rs/", "crates/*/nowhere"]
    );
    let (missing, named) = missing_rust_files(text, &root());
    assert_eq!(named, 8);
    assert_eq!(
        missing,
        [
            "internals.rs (in the section of crates/twice-broker)",
            "serve.rs (in the section of crates/twice-broker)",
            "gone.rs (in the section of crates/twice-broker)",
            "engine/nowhere.rs"
        ]
    );
}
