//! Records the git commit the binary is built from, for `--version` and the
//! `cdc_relay_build_info` metric: `CDC_RELAY_GIT_COMMIT` when set (a build
//! from a source tarball), else `git rev-parse --short=12 HEAD`, else
//! `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=CDC_RELAY_GIT_COMMIT");
    let commit = std::env::var("CDC_RELAY_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // Rebuild when HEAD moves: a commit, a checkout, a fetch into packed refs.
    for path in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(p) =
        git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r]))
    {
        println!("cargo:rerun-if-changed={p}");
    }
    println!("cargo:rustc-env=CDC_RELAY_GIT_COMMIT={commit}");
}
