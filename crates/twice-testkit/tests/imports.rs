//! No two files of a crate import each other in a circle.
//!
//! Within each crate's `src`, a file may name items of other files through `crate::…`,
//! `super::…` and `self::…` paths. Between files that are not each other's ancestor (two
//! siblings, or cousins), those references must form no cycle: a file that another file builds
//! on does not build on it in turn. A module's own files and its `mod.rs` (the module's
//! declaration and façade) are exempt from each other: children implement what their parent
//! declares.
//!
//! The check reads the source text: paths in comments are left out, and so are inline test
//! modules, which may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path within a crate: `[]` is the crate root, `["connection", "state"]` is
/// `connection/state.rs`.
type Module = Vec<String>;

/// The module files of one crate's `src`.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src").with_extension("");
            let mut module: Module =
                rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            if module == ["lib"] || module == ["main"] {
                module.clear();
            }
            if module.iter().any(|m| m == "tests") {
                continue;
            }
            out.insert(module, path);
        }
    }
    out
}

/// The code of a file: inline test modules and comments removed.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or_default();
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths named in `code` that start with `crate::`, `super::` or `self::`, each as its
/// segments; a `use` group (`a::{b, c::d}`) gives one path per member.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let at_start = i == 0 || !is_ident(chars[i - 1]) && chars[i - 1] != ':';
        let rest: String = chars[i..chars.len().min(i + 8)].iter().collect();
        if at_start && ["crate::", "super::", "self::"].iter().any(|p| rest.starts_with(p)) {
            let (found, end) = path_at(&chars, i);
            out.extend(found);
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// The paths of the path expression starting at `i`, and where it ends.
fn path_at(chars: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut segments = Vec::new();
    loop {
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        if i > start {
            segments.push(chars[start..i].iter().collect::<String>());
        }
        if chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':') {
            i += 2;
            if chars.get(i) == Some(&'{') {
                let (members, end) = group_at(chars, i + 1);
                let found = members
                    .into_iter()
                    .map(|m| segments.iter().cloned().chain(m).collect())
                    .collect();
                return (found, end);
            }
            continue;
        }
        return (vec![segments], i);
    }
}

/// The members of a `use` group whose `{` is just before `i`, and the index after its `}`.
fn group_at(chars: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut members = Vec::new();
    loop {
        while i < chars.len() && (chars[i].is_whitespace() || chars[i] == ',') {
            i += 1;
        }
        match chars.get(i) {
            None => return (members, i),
            Some('}') => return (members, i + 1),
            Some(_) => {}
        }
        let (found, end) = path_at(chars, i);
        members.extend(found.into_iter().filter(|p: &Vec<String>| !p.is_empty()));
        i = end;
        // Skip what follows a member up to the next one: `as name`, a glob.
        while i < chars.len() && !matches!(chars[i], ',' | '}') {
            i += 1;
        }
    }
}

/// The module file a path from `from` names: the longest prefix of the resolved path that is
/// a module file.
fn resolve(modules: &BTreeMap<Module, PathBuf>, from: &Module, path: &[String]) -> Option<Module> {
    let mut segments = path.iter().peekable();
    let mut at: Module = match segments.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segments.next();
            Vec::new()
        }
        _ => from.clone(),
    };
    while let Some(s) = segments.peek() {
        match s.as_str() {
            "self" => {}
            "super" => {
                at.pop();
            }
            _ => break,
        }
        segments.next();
    }
    at.extend(segments.cloned());
    (0..=at.len()).rev().map(|n| at[..n].to_vec()).find(|m| modules.contains_key(m))
}

fn is_ancestor(a: &Module, b: &Module) -> bool {
    a.len() < b.len() && b.starts_with(a)
}

/// The file-to-file references of one crate, ancestors and descendants left out.
fn edges(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let modules = modules(src);
    let mut out: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).expect("read a source file");
        for path in paths(&code(&text)) {
            let Some(target) = resolve(&modules, module, &path) else { continue };
            if target != *module && !is_ancestor(&target, module) && !is_ancestor(module, &target) {
                out.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    out
}

/// One cycle of the graph, as the modules along it, if there is any.
fn cycle(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Option<Vec<Module>> {
    fn visit(
        node: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        done: &mut BTreeSet<Module>,
        stack: &mut Vec<Module>,
    ) -> Option<Vec<Module>> {
        if let Some(at) = stack.iter().position(|m| m == node) {
            let mut found = stack[at..].to_vec();
            found.push(node.clone());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, edges, done, stack) {
                return Some(found);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|start| visit(start, edges, &mut done, &mut Vec::new()))
}

fn name(m: &Module) -> String {
    if m.is_empty() { "lib".to_owned() } else { m.join("::") }
}

#[test]
fn no_two_files_of_a_crate_import_each_other_in_a_circle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the crates directory");
    let mut checked = 0;
    let mut found = Vec::new();
    let mut dirs: Vec<_> = std::fs::read_dir(crates).expect("read crates").flatten().collect();
    dirs.sort_by_key(std::fs::DirEntry::file_name);
    for dir in dirs {
        let src = dir.path().join("src");
        if !src.is_dir() {
            continue;
        }
        checked += 1;
        if let Some(c) = cycle(&edges(&src)) {
            let names: Vec<_> = c.iter().map(name).collect();
            found.push(format!("{}: {}", dir.file_name().to_string_lossy(), names.join(" → ")));
        }
    }
    assert!(checked >= 9, "the crates were not found under {}", crates.display());
    assert!(found.is_empty(), "files import each other in a circle:\n{}", found.join("\n"));
}

#[test]
fn the_check_sees_a_circle_between_siblings_and_none_through_a_parent() {
    let dir = tempfile_dir();
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("conn")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod conn;\npub(crate) use conn::Thing;\n").unwrap();
    std::fs::write(
        src.join("conn/mod.rs"),
        "mod a;\nmod b;\npub(crate) struct Thing;\nuse self::a::f;\n",
    )
    .unwrap();
    // a uses its parent and b; b uses a through the crate root, inside a group.
    std::fs::write(src.join("conn/a.rs"), "use super::{Thing, b::g};\npub(crate) fn f() {}\n")
        .unwrap();
    std::fs::write(
        src.join("conn/b.rs"),
        "// use crate::conn::a::f; (a comment)\npub(crate) fn g() {}\n",
    )
    .unwrap();
    assert_eq!(cycle(&edges(&src)), None, "a parent and its children are no circle");
    std::fs::write(
        src.join("conn/b.rs"),
        "use crate::{conn::{a::f as h}, Thing};\npub(crate) fn g() {}\n",
    )
    .unwrap();
    let c = cycle(&edges(&src)).expect("a → b → a");
    let names: Vec<_> = c.iter().map(name).collect();
    assert!(names == ["conn::a", "conn::b", "conn::a"], "{names:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh directory of this test's own.
fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("twice-imports-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
