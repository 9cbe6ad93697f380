//! The module map of `docs/architecture.md` ("Module map") names every
//! source file under `cdc-relay/src`, and nothing that is gone.
//!
//! The map is a code block of entries: a line indented by two spaces
//! starts one, its left column (up to the first run of spaces) names
//! top-level files and directories (`ack.rs`, `source/`, several joined
//! by `, `), the rest and the lines indented further below it describe
//! them. A file is named when
//!
//! - at the top level, its name (`ack.rs`) is in a left column;
//! - inside a directory, the directory (`source/`) is in a left column and
//!   its entry's text has each module name of the file's path below it as
//!   a word (`catalog` and `slots` for `source/catalog/slots.rs`; a
//!   `mod.rs` is its directory).
//!
//! Every name in a left column must exist.

mod source_tree;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

/// The map's entries: each left-column name (`ack.rs`, `source/`) →
/// its entry's text.
fn map_in(doc: &str) -> BTreeMap<String, String> {
    let section = doc
        .split_once("\n## Module map\n")
        .expect("docs/architecture.md has a \"## Module map\" section")
        .1;
    let block = section
        .split_once("```\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .expect("the module map is a code block")
        .0;
    let mut entries: Vec<(Vec<String>, String)> = Vec::new();
    for line in block
        .lines()
        .skip_while(|l| !l.starts_with("cdc-relay/src/"))
        .skip(1)
    {
        let indent = line.len() - line.trim_start().len();
        if indent == 2 {
            let (left, text) = line
                .trim_start()
                .split_once("  ")
                .unwrap_or((line.trim(), ""));
            let names = left.split(", ").map(|n| n.trim().to_owned()).collect();
            entries.push((names, text.trim().to_owned()));
        } else if let Some((_, text)) = entries.last_mut() {
            text.push(' ');
            text.push_str(line.trim());
        }
    }
    let mut out = BTreeMap::new();
    for (names, text) in entries {
        for name in names {
            out.insert(name, text.clone());
        }
    }
    out
}

fn words(text: &str) -> BTreeSet<&str> {
    text.split(|c: char| !c.is_alphanumeric() && c != '_')
        .filter(|w| !w.is_empty())
        .collect()
}

/// What the map fails to name among `files` (relative to `src/`), and the
/// names it has that `files` lack.
fn problems(map: &BTreeMap<String, String>, files: &[&Path]) -> Vec<String> {
    let mut out = Vec::new();
    let mut present = BTreeSet::new();
    for file in files {
        let parts: Vec<String> = file
            .components()
            .map(|c| match c {
                Component::Normal(s) => s.to_string_lossy().into_owned(),
                other => panic!("unexpected path component {other:?}"),
            })
            .collect();
        if parts.len() == 1 {
            present.insert(parts[0].clone());
            if !map.contains_key(&parts[0]) {
                out.push(format!("{} (no entry)", file.display()));
            }
            continue;
        }
        let dir = format!("{}/", parts[0]);
        present.insert(dir.clone());
        let Some(text) = map.get(&dir) else {
            out.push(format!("{} (no entry for {dir})", file.display()));
            continue;
        };
        let words = words(text);
        let missing: Vec<&str> = parts[1..]
            .iter()
            .map(|p| p.trim_end_matches(".rs"))
            .filter(|m| *m != "mod" && !words.contains(m))
            .collect();
        if !missing.is_empty() {
            out.push(format!(
                "{} ({dir}'s entry does not say {})",
                file.display(),
                missing.join(", ")
            ));
        }
    }
    for name in map.keys() {
        if !present.contains(name) {
            out.push(format!("{name} is in the map but not in cdc-relay/src"));
        }
    }
    out
}

#[test]
fn the_module_map_names_every_source_file() {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/architecture.md");
    let map = map_in(&std::fs::read_to_string(doc).unwrap());
    let files = source_tree::files();
    let files: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    let problems = problems(&map, &files);
    assert!(
        problems.is_empty(),
        "docs/architecture.md's module map is out of date:\n{}",
        problems.join("\n")
    );
}

#[test]
fn a_file_the_map_does_not_name_is_found() {
    let doc = "x\n## Module map\n\n```\ncdc-relay/src/\n  ack.rs, lsn.rs   shared\n  source/          conn (URL),\n                   catalog (slots)\n  gone.rs          removed\n```\n";
    let map = map_in(doc);
    assert_eq!(map["source/"], "conn (URL), catalog (slots)");
    let files = [
        "ack.rs",
        "lsn.rs",
        "new.rs",
        "source/mod.rs",
        "source/conn.rs",
        "source/catalog/mod.rs",
        "source/catalog/slots.rs",
        "source/catalog/monitor.rs",
        "sink/mod.rs",
    ];
    let files: Vec<&Path> = files.iter().map(Path::new).collect();
    assert_eq!(
        problems(&map, &files),
        [
            "new.rs (no entry)",
            "source/catalog/monitor.rs (source/'s entry does not say monitor)",
            "sink/mod.rs (no entry for sink/)",
            "gone.rs is in the map but not in cdc-relay/src",
        ]
    );
}
