//! Records the git commit the binary is built from, for `--version` and the
//! `cdc_relay_build_info` metric: `CDC_RELAY_GIT_COMMIT` when set (a build
//! from a source tarball), else `git rev-parse --short=12 HEAD`, else
//! `unknown`.
//!
//! Only paths that exist are watched: cargo treats a watched path that is
//! missing as changed, so watching `packed-refs` in a repository that has
//! none (or a branch ref that only lives in `packed-refs`) rebuilt the crate
//! on every build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `path` if it exists, else its nearest existing ancestor directory (a
/// watched directory counts as changed when any file in it does, so a loose
/// ref created later under it is still seen).
fn existing(path: &Path) -> Option<PathBuf> {
    path.ancestors()
        .find(|p| !p.as_os_str().is_empty() && p.exists())
        .map(Path::to_path_buf)
}

fn watch(git_path: &str) {
    if let Some(p) =
        git(&["rev-parse", "--git-path", git_path]).and_then(|p| existing(Path::new(&p)))
    {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=CDC_RELAY_GIT_COMMIT");
    let commit = std::env::var("CDC_RELAY_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // Rebuild when HEAD moves: a checkout (HEAD), a commit (the branch's
    // loose ref, or its directory before the ref is written loose), a fetch
    // into packed refs.
    watch("HEAD");
    if Path::new(&git(&["rev-parse", "--git-path", "packed-refs"]).unwrap_or_default()).exists() {
        watch("packed-refs");
    }
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&r);
    }
    println!("cargo:rustc-env=CDC_RELAY_GIT_COMMIT={commit}");
}
