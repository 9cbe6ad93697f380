//! The crate's module import graph: no cycles between top-level modules,
//! and no import pointing up the layers `lib.rs` declares (its
//! `// N. <layer>` comments followed by `pub mod` lines: 1 operator
//! surface, 2 engines, 3 pipeline and policy, 4 shared types). A module may
//! use its own layer or a higher-numbered one, never a lower-numbered one:
//! the pipeline never imports an operator module.
//!
//! Imports are read from the source text: every `crate::<module>` outside
//! a comment, plus `use crate::{a, b}` groups.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Top-level module name → layer number, from `lib.rs`.
fn layers() -> BTreeMap<String, u32> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let mut layer = 0;
    let mut out = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("// ")
            && let Some((n, _)) = rest.split_once(". ")
            && let Ok(n) = n.parse()
        {
            layer = n;
        } else if let Some(name) = line
            .strip_prefix("pub mod ")
            .and_then(|l| l.strip_suffix(';'))
        {
            assert!(
                layer > 0,
                "`pub mod {name}` before any `// N. layer` comment"
            );
            out.insert(name.to_owned(), layer);
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`source/stream.rs` → `source`).
fn owner(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next()?.as_os_str().to_string_lossy();
    let name = first.trim_end_matches(".rs").to_owned();
    (name != "lib" && name != "main").then_some(name)
}

/// Top-level modules `text` refers to as `crate::…`.
fn imports(text: &str, modules: &BTreeMap<String, u32>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
                group
                    .split(['}', ','])
                    .map(|s| s.trim().split("::").next().unwrap_or(""))
                    .collect()
            } else {
                vec![
                    rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                        .next()
                        .unwrap_or(""),
                ]
            };
            for name in names {
                if modules.contains_key(name) {
                    found.insert(name.to_owned());
                }
            }
        }
    }
    found
}

fn graph() -> (BTreeMap<String, BTreeSet<String>>, BTreeMap<String, u32>) {
    let layers = layers();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(from) = owner(&file) else { continue };
        let text = std::fs::read_to_string(&file).unwrap();
        let to = imports(&text, &layers);
        edges
            .entry(from.clone())
            .or_default()
            .extend(to.into_iter().filter(|m| *m != from));
    }
    (edges, layers)
}

#[test]
fn lib_declares_every_module_in_a_layer() {
    let (edges, layers) = graph();
    for module in edges.keys() {
        assert!(
            layers.contains_key(module),
            "{module} has no layer in lib.rs"
        );
    }
    assert_eq!(layers.get("cli"), Some(&1));
    assert_eq!(layers.get("relay"), Some(&2));
    assert_eq!(layers.get("dispatch"), Some(&3));
    assert_eq!(layers.get("lsn"), Some(&4));
}

#[test]
fn no_import_points_up_a_layer() {
    let (edges, layers) = graph();
    let mut upward = Vec::new();
    for (from, tos) in &edges {
        for to in tos {
            if layers[to] < layers[from] {
                upward.push(format!(
                    "{from} (layer {}) imports {to} (layer {})",
                    layers[from], layers[to]
                ));
            }
        }
    }
    assert!(upward.is_empty(), "upward imports:\n{}", upward.join("\n"));
}

#[test]
fn the_module_graph_has_no_cycles() {
    let (edges, _) = graph();
    // Depth-first search; a back edge closes a cycle.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Result<(), String> {
        if let Some(i) = path.iter().position(|n| n == node) {
            return Err(format!("{} -> {node}", path[i..].join(" -> ")));
        }
        if done.contains(node) {
            return Ok(());
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            visit(next, edges, path, done)?;
        }
        path.pop();
        done.insert(node.to_owned());
        Ok(())
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Err(cycle) = visit(node, &edges, &mut Vec::new(), &mut done) {
            panic!("import cycle: {cycle}");
        }
    }
}

#[test]
fn the_reader_sees_imports() {
    let layers = layers();
    let text = "use crate::lsn::Lsn;\nuse crate::{ack, dispatch::Item};\n// crate::cli in a comment\nlet x = crate::db_message(e);";
    let found: Vec<String> = imports(text, &layers).into_iter().collect();
    assert_eq!(found, ["ack", "dispatch", "lsn"]);
}
