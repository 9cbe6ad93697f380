//! The crate's source files, for the tests that hold its layout to the
//! rules written down for it (`module_graph`, `module_map`).

use std::path::{Path, PathBuf};

/// `cdc-relay/src`.
pub fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/`, relative to it, sorted.
pub fn files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(src()).unwrap().to_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&src(), &mut out);
    out.sort();
    out
}
