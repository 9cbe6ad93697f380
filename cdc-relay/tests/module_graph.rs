//! The crate's module import graph, at two levels.
//!
//! - Top level: no cycles between the modules `lib.rs` declares, and no
//!   import pointing up the layers it declares (its `// N. <layer>`
//!   comments followed by `pub mod` lines: 1 operator surface, 2 engines,
//!   3 pipeline and policy, 4 shared types). A module may use its own layer
//!   or a higher-numbered one, never a lower-numbered one: the pipeline
//!   never imports an operator module.
//! - One level down, in the directories of [`NESTED`]: no cycles between
//!   the modules of one directory (`source/catalog` and `source/failover`,
//!   say). The directory's own `mod.rs` is its root, as `lib.rs` is the
//!   crate's: it declares and assembles its modules and is no node of the
//!   graph. An item a module takes from it that it re-exports from a
//!   sibling (`super::Window` in `dispatch/`) counts as an import of that
//!   sibling.
//!
//! Imports are read from the source text, comments and literals left out:
//! every path that starts with `crate::`, `super::` or `self::`, or with a
//! module's own name relative to where it is written (`tls::…` in
//! `source/mod.rs`), `use` groups (`{a, b::c}`, over several lines)
//! included, each resolved from the module it is written in (an inline
//! `mod tests { use super::*; }` is inside its file's module). The modules
//! of a directory are its files and subdirectories, whatever they are.

mod source_tree;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use source_tree::src;

/// The directories whose modules must not import each other in a circle,
/// as module paths from the crate root.
const NESTED: &[&[&str]] = &[&["source"], &["dispatch"]];

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

/// The library's files with their module paths (`source/catalog/mod.rs` →
/// `["source", "catalog"]`, `lib.rs` → `[]`); `main.rs` is another crate.
fn library_files() -> Vec<(Vec<String>, String)> {
    source_tree::files()
        .into_iter()
        .filter_map(|rel| {
            if rel == Path::new("main.rs") {
                return None;
            }
            let mut path: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let last = path.pop().unwrap();
            let stem = last.trim_end_matches(".rs");
            if stem != "mod" && !(path.is_empty() && stem == "lib") {
                path.push(stem.to_owned());
            }
            Some((path, std::fs::read_to_string(src().join(&rel)).unwrap()))
        })
        .collect()
}

/// A path written in the code.
#[derive(Debug, Clone, PartialEq)]
struct Written {
    /// The module it is written in, from the crate root (inline modules
    /// included).
    at: Vec<String>,
    /// Its segments as written (`super`, `crate`, names; `*` for a glob),
    /// one path per member of a `use` group.
    segments: Vec<String>,
    /// The name a `use` binds (its last segment, or the name after `as`);
    /// `None` outside a `use`.
    binds: Option<String>,
}

/// The code's tokens: identifiers, `::`, and single punctuation
/// characters; comments, strings and character literals left out.
fn tokens(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime.
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            if matches!(word.as_str(), "r" | "br") && matches!(at(i), '"' | '#') {
                // A raw string: r"…", r#"…"#.
                let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
                if at(i + hashes) == '"' {
                    i += hashes + 1;
                    let close: Vec<char> = std::iter::once('"')
                        .chain(std::iter::repeat_n('#', hashes))
                        .collect();
                    while i < c.len() && !c[i..].starts_with(&close) {
                        i += 1;
                    }
                    i += close.len();
                    continue;
                }
            }
            if word == "b" && matches!(at(i), '"' | '\'') {
                continue;
            }
            out.push(word);
        } else if ch == ':' && at(i + 1) == ':' {
            out.push("::".to_owned());
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(ch.to_string());
            }
            i += 1;
        }
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// A path's segments and the name a `use` of it would bind.
type Member = (Vec<String>, Option<String>);

/// The paths starting at `tokens[i]` (a name after `::` or `{`): one, or
/// one per member of a group, and the index after them.
fn path_at(tokens: &[String], mut i: usize) -> (Vec<Member>, usize) {
    let mut segments = vec![tokens[i].clone()];
    i += 1;
    loop {
        if tokens.get(i).map(String::as_str) != Some("::") {
            break;
        }
        match tokens.get(i + 1).map(String::as_str) {
            Some("{") => {
                let mut all = Vec::new();
                i += 2;
                while i < tokens.len() && tokens[i] != "}" {
                    if is_ident(&tokens[i]) || tokens[i] == "*" {
                        let (members, next) = path_at(tokens, i);
                        for (tail, binds) in members {
                            let mut full = segments.clone();
                            full.extend(tail);
                            // `a::{self}` binds `a`.
                            let binds = binds.or_else(|| segments.last().cloned());
                            all.push((full, binds));
                        }
                        i = next;
                    } else {
                        i += 1;
                    }
                }
                return (all, i + 1);
            }
            Some(t) if is_ident(t) || t == "*" => {
                segments.push(t.to_owned());
                i += 2;
            }
            _ => break,
        }
    }
    let binds = if tokens.get(i).map(String::as_str) == Some("as") {
        i += 2;
        tokens.get(i - 1).cloned()
    } else {
        segments.last().filter(|s| *s != "self").cloned()
    };
    (vec![(segments, binds)], i)
}

/// Every path of two segments or more in a file of module `file_at`.
fn written(text: &str, file_at: &[String]) -> Vec<Written> {
    let tokens = tokens(text);
    let mut out = Vec::new();
    let mut at = file_at.to_vec();
    // Depth of braces, and the depth at which each open inline module began.
    let mut depth = 0usize;
    let mut inline: Vec<usize> = Vec::new();
    let mut in_use = false;
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        match t {
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if inline.last() == Some(&depth) {
                    inline.pop();
                    at.pop();
                }
            }
            ";" => in_use = false,
            "use" => in_use = true,
            "mod"
                if is_ident(tokens.get(i + 1).map_or("", String::as_str))
                    && tokens.get(i + 2).map(String::as_str) == Some("{") =>
            {
                at.push(tokens[i + 1].clone());
                inline.push(depth);
                depth += 1;
                i += 3;
                continue;
            }
            _ if is_ident(t) && (i == 0 || tokens[i - 1] != "::") => {
                let (paths, next) = path_at(&tokens, i);
                for (segments, binds) in paths {
                    if segments.len() > 1 {
                        out.push(Written {
                            at: at.clone(),
                            segments,
                            binds: binds.filter(|_| in_use),
                        });
                    }
                }
                i = next;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Where a written path leads, from the crate root.
fn resolve(w: &Written) -> Vec<String> {
    let mut segments = w.segments.iter().peekable();
    let mut out = match segments.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segments.next();
            Vec::new()
        }
        Some("self") => {
            segments.next();
            w.at.clone()
        }
        _ => w.at.clone(),
    };
    while segments.peek().map(|s| s.as_str()) == Some("super") {
        segments.next();
        out.pop();
    }
    out.extend(segments.filter(|s| *s != "self").cloned());
    out
}

/// The import graph between the modules of directory `dir` (a module path
/// from the crate root; `[]` for the top level): module → the modules of
/// the same directory it imports.
fn edges(dir: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    edges_in(&library_files(), dir)
}

/// [`edges`] over `files` (module path, text).
fn edges_in(files: &[(Vec<String>, String)], dir: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let inside = |path: &[String]| {
        (path.len() > dir.len() && path.iter().zip(dir).all(|(a, b)| a == b))
            .then(|| path[dir.len()].clone())
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| inside(p)).collect();
    let mut reads = Vec::new();
    for (path, text) in files {
        reads.extend(written(text, path));
    }
    // What the directory's root binds by `use` from one of its modules.
    let mut aliases = BTreeMap::new();
    for w in &reads {
        if w.at == dir
            && let Some(name) = &w.binds
            && let Some(module) = inside(&resolve(w))
            && modules.contains(&module)
        {
            aliases.insert(name.clone(), module);
        }
    }
    let module_of = |path: &[String]| {
        let name = inside(path)?;
        if modules.contains(&name) {
            Some(name)
        } else {
            aliases.get(&name).cloned()
        }
    };
    let mut out: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for w in &reads {
        let Some(from) = inside(&w.at).filter(|m| modules.contains(m)) else {
            continue;
        };
        if let Some(to) = module_of(&resolve(w))
            && to != from
        {
            out.get_mut(&from).unwrap().insert(to);
        }
    }
    out
}

/// The first import cycle found, as `a -> b -> a`.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
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
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done).err())
}

#[test]
fn lib_declares_every_module_in_a_layer() {
    let layers = layers();
    for module in edges(&[]).keys() {
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
    let layers = layers();
    let mut upward = Vec::new();
    for (from, tos) in &edges(&[]) {
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
    if let Some(cycle) = cycle(&edges(&[])) {
        panic!("import cycle: {cycle}");
    }
}

#[test]
fn no_cycles_one_level_down() {
    let mut found = Vec::new();
    for dir in NESTED {
        let edges = edges(dir);
        assert!(
            edges.len() > 1,
            "{} has no modules to check: is NESTED stale?",
            dir.join("/")
        );
        if let Some(cycle) = cycle(&edges) {
            found.push(format!("in {}/: {cycle}", dir.join("/")));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

fn names(paths: &[Written]) -> Vec<String> {
    paths.iter().map(|w| resolve(w).join("::")).collect()
}

#[test]
fn the_reader_sees_imports() {
    let text = "use crate::lsn::Lsn;\nuse crate::{ack, dispatch::Item};\n// crate::cli in a comment\nlet x = crate::db_message(e);";
    assert_eq!(
        names(&written(text, &["outbox".to_owned()])),
        ["lsn::Lsn", "ack", "dispatch::Item", "db_message"]
    );
}

#[test]
fn the_reader_resolves_super_self_and_relative_paths() {
    let at = ["source".to_owned(), "stream".to_owned()];
    let text = r#"
        use super::catalog::{self, SlotInfo};
        use super::{
            error::SourceError as E,
            transport::Transport,
        };
        /* super::failover in a block comment */
        let s = "super::watchdog in a string";
        let c = '{';
        fn f<'a>(x: &'a str) -> Vec<_> { x.split(':').collect::<Vec<_>>() }
        mod tests {
            use super::*;
            use super::super::membership::Change;
        }
        let t = super::tls::client_config();
        let u = crate::source::conn::ConnParams::default();
    "#;
    let found = written(text, &at);
    assert_eq!(
        names(&found),
        [
            "source::catalog",
            "source::catalog::SlotInfo",
            "source::error::SourceError",
            "source::transport::Transport",
            "source::stream::*",
            "source::membership::Change",
            "source::tls::client_config",
            "source::conn::ConnParams::default",
        ]
    );
    assert_eq!(found[0].binds.as_deref(), Some("catalog"));
    assert_eq!(found[2].binds.as_deref(), Some("E"));
    assert_eq!(found[6].binds, None);
}

fn file(path: &str, text: &str) -> (Vec<String>, String) {
    let path = path.split('/').filter(|s| !s.is_empty()).map(str::to_owned);
    (path.collect(), text.to_owned())
}

#[test]
fn a_circle_through_a_root_re_export_is_found() {
    // `d/mod.rs` re-exports `Window` from `window`; `window` imports
    // `park` by its crate path, `park` takes `super::Window`: a circle.
    let files = [
        file(
            "d",
            "pub mod park;\npub mod window;\npub use window::{Window, WindowPermit};",
        ),
        file("d/park", "use super::Window;\nfn f() {}"),
        file("d/window", "fn g() { crate::d::park::f() }"),
    ];
    let edges = edges_in(&files, &["d"]);
    assert_eq!(edges["park"], BTreeSet::from(["window".to_owned()]));
    assert_eq!(cycle(&edges).as_deref(), Some("park -> window -> park"));
    // An item of the root itself is no module's: no circle.
    let files = [
        file(
            "d",
            "pub mod park;\npub mod window;\npub struct Job;\nuse window::Window;",
        ),
        file("d/park", "use super::Job;"),
        file("d/window", "use super::park;\npub struct Window;"),
    ];
    assert_eq!(cycle(&edges_in(&files, &["d"])), None);
}

#[test]
fn a_nested_module_belongs_to_its_directory_module() {
    // `d/a/inner.rs` is part of `a`: its `super::super::b` is `a -> b`.
    let files = [
        file("d", "mod a;\nmod b;"),
        file("d/a", "mod inner;"),
        file("d/a/inner", "use super::super::b::B;"),
        file("d/b", "use super::a::inner;"),
    ];
    let edges = edges_in(&files, &["d"]);
    assert_eq!(cycle(&edges).as_deref(), Some("a -> b -> a"));
}
