//! The house's shape: no import circle among the core's modules (a folder is one
//! module) or among the binding crate's files, and no core file over 700 lines. The graphs are
//! read from the sources: every `crate::<name>` a file names outside comments is an edge from
//! its module to `<name>`. tests/test_structure.py checks the Python package the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The names `text` reaches through `crate::<name>` (comments skipped).
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + "crate::".len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue; // `$crate::`, `kvpool_crate::`
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name.chars().next().is_some_and(|c| c.is_lowercase()) {
                names.insert(name);
            }
            // `crate::{a, b}`: every name in the braces.
            if let Some(braced) = rest.strip_prefix('{') {
                let inner: String = braced.chars().take_while(|&c| c != '}').collect();
                for part in inner.split(',') {
                    let name = part
                        .trim()
                        .split("::")
                        .next()
                        .unwrap_or("")
                        .trim()
                        .to_owned();
                    if !name.is_empty() && name.chars().next().is_some_and(|c| c.is_lowercase()) {
                        names.insert(name);
                    }
                }
            }
        }
    }
    names
}

/// A circle in `graph`, if any, as the list of its nodes.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(node) {
            Some(2) => return None,
            Some(1) => {
                let from = path.iter().position(|n| n == node).unwrap_or(0);
                let mut circle = path[from..].to_vec();
                circle.push(node.to_owned());
                return Some(circle);
            }
            _ => {}
        }
        state.insert(node.to_owned(), 1);
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, state, path) {
                return Some(circle);
            }
        }
        path.pop();
        state.insert(node.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if let Some(circle) = visit(node, graph, &mut state, &mut Vec::new()) {
            return Some(circle);
        }
    }
    None
}

/// The graph of a crate rooted at `src`: nodes are top-level modules (`folders`) or files.
fn graph(src: &Path, folders: bool) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in sources(src) {
        let relative = file.strip_prefix(src).unwrap();
        let mut parts = relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned());
        let first = parts.next().unwrap();
        let module = match (folders, relative.components().count()) {
            (true, n) if n > 1 => first,
            _ => first.trim_end_matches(".rs").to_owned(),
        };
        if module == "lib" {
            continue; // the root declares every module
        }
        let text = fs::read_to_string(&file).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        for name in crate_refs(&text) {
            if name != module {
                edges.insert(name);
            }
        }
    }
    graph
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

#[test]
fn no_import_circle_among_the_cores_modules() {
    let g = graph(&root().join("src"), true);
    assert!(
        g.contains_key("pool") && g["pool"].contains("groups"),
        "{g:?}"
    );
    if let Some(circle) = find_circle(&g) {
        panic!("import circle in the core: {}", circle.join(" -> "));
    }
}

#[test]
fn no_import_circle_among_the_bindings_files() {
    let src = root().join("../kvpool-py/src");
    let g = graph(&src, false);
    assert!(g.len() > 5, "{g:?}");
    if let Some(circle) = find_circle(&g) {
        panic!("import circle in the bindings: {}", circle.join(" -> "));
    }
}

#[test]
fn the_circle_finder_finds_circles() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert!(find_circle(&g).is_none());
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(find_circle(&g).unwrap(), ["a", "b", "c", "a"]);
    let refs = crate_refs(
        "use crate::{pool::X, groups};\n// crate::nope\nlet _ = $crate::x; crate::tiers::y",
    );
    assert_eq!(
        refs.into_iter().collect::<Vec<_>>(),
        ["groups", "pool", "tiers"]
    );
}

#[test]
fn no_core_file_over_700_lines() {
    for file in sources(&root().join("src")) {
        let lines = fs::read_to_string(&file).unwrap().lines().count();
        assert!(lines <= 700, "{} has {lines} lines", file.display());
    }
}
