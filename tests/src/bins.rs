//! The workspace binaries (`orders`, `billing`, `payments`, `cdc-relay`), built once per
//! process with the profile of the running test executable, so a test never
//! runs a stale binary. Under the whole suite (`tests/run.sh` without a
//! package or target selection sets [`EVERY_TARGET_ENV`]) a test builds every target of the
//! workspace, which `cargo test --workspace` has just built with the same
//! features, so nothing is compiled; otherwise (a filtered run, the demo,
//! the bench) it builds the four binaries alone.
//!
//! The target directory comes from the executable's own path
//! (`<target>/<profile-dir>/deps/<test>-<hash>`), or `CARGO_TARGET_DIR`.
//! `CDC_RELAY_SKIP_BUILD=1` skips the build (e.g. when CI built them already).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Binaries [`path`] builds.
pub const WORKSPACE_BINS: [&str; 4] = ["orders", "billing", "payments", "cdc-relay"];

/// Set to `1` to use whatever binaries are in the target directory.
pub const SKIP_BUILD_ENV: &str = "CDC_RELAY_SKIP_BUILD";

/// Set to `1` (by `tests/run.sh` given no package or target selection) when the outer
/// `cargo test --workspace` builds every target: the nested build asks for
/// the same (`--workspace --all-targets`, the binaries with the features
/// unified over the dev-dependencies: tokio's `test-util`, reqwest's `json`)
/// and finds it done. The binaries alone (`--bins`) resolve features
/// without the dev-dependencies: a second copy of tokio and everything
/// above it, two minutes on 2 vCPUs from a fresh clone.
pub const EVERY_TARGET_ENV: &str = "CDC_RELAY_BUILD_EVERY_TARGET";

/// Where the binaries of the current profile are, and how to build them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    /// `--target-dir` for cargo.
    target_dir: PathBuf,
    /// `--profile` for cargo (`dev` for the `debug` directory).
    profile: String,
    /// `<target_dir>/<profile-dir>`, where cargo puts the binaries.
    out_dir: PathBuf,
    /// The running executable is a test harness (in `deps/`, built by
    /// `cargo test`) of the `dev` profile, not a binary such as the demo
    /// or the bench.
    test_harness: bool,
}

/// Path of workspace binary `name` (one of [`WORKSPACE_BINS`]), building all
/// of them first on the first call in this process. Panics with cargo's
/// output if the build fails, or if the binary is missing.
pub fn path(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<Layout, String>> = OnceLock::new();
    let layout = match BUILT.get_or_init(build) {
        Ok(layout) => layout,
        Err(err) => panic!("{err}"),
    };
    let path = layout.out_dir.join(name);
    assert!(
        path.is_file(),
        "{} does not exist (known workspace binaries: {WORKSPACE_BINS:?}; {SKIP_BUILD_ENV} is {:?})",
        path.display(),
        std::env::var(SKIP_BUILD_ENV).ok()
    );
    path
}

fn build() -> Result<Layout, String> {
    let exe =
        std::env::current_exe().map_err(|err| format!("locating the test executable: {err}"))?;
    let target_env = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from);
    let layout = layout(&exe, target_env.as_deref())?;
    if std::env::var(SKIP_BUILD_ENV).as_deref() == Ok("1") {
        return Ok(layout);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_outer_cargo) {
            command.env_remove(name);
        }
    }
    command
        .current_dir(&workspace)
        .args(["build", "--profile", &layout.profile])
        .arg("--target-dir")
        .arg(&layout.target_dir);
    let every_target = layout.test_harness && std::env::var(EVERY_TARGET_ENV).as_deref() == Ok("1");
    if every_target {
        command.args(["--workspace", "--all-targets"]);
    } else {
        command.arg("--bins");
        for bin in WORKSPACE_BINS {
            command.args(["-p", bin]);
        }
    }
    // On the terminal, not in the test's captured output: a first run
    // sits here for minutes.
    let _ = writeln!(
        std::io::stderr(),
        "harness: building {} ({} profile)",
        if every_target {
            "every workspace target".to_owned()
        } else {
            format!("{WORKSPACE_BINS:?}")
        },
        layout.profile
    );
    let output = command
        .output()
        .map_err(|err| format!("running cargo: {err}"))?;
    if !output.status.success() {
        return Err(format!(
            "building the workspace binaries failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(layout)
}

/// Whether `name` is a variable cargo sets for the process it runs
/// (`cargo test`, `cargo run`; "Environment variables Cargo sets for
/// crates" in the Cargo book). Cargo decides whether to rerun a build script
/// that watches a variable (`rerun-if-env-changed`; ring's watches
/// `CARGO_MANIFEST_DIR` and `CARGO_PKG_*`) against its own environment: a
/// nested cargo that inherited them would rerun it, and a plain `cargo
/// build` afterwards would rerun it back, each time rebuilding ring, rustls
/// and every crate above them.
fn set_by_outer_cargo(name: &str) -> bool {
    const PREFIXES: [&str; 4] = [
        "CARGO_PKG_",
        "CARGO_BIN_EXE_",
        "CARGO_CFG_",
        "CARGO_FEATURE_",
    ];
    matches!(
        name,
        "CARGO"
            | "CARGO_MANIFEST_DIR"
            | "CARGO_MANIFEST_PATH"
            | "CARGO_MANIFEST_LINKS"
            | "CARGO_CRATE_NAME"
            | "CARGO_BIN_NAME"
            | "CARGO_PRIMARY_PACKAGE"
            | "CARGO_TARGET_TMPDIR"
            | "CARGO_RUSTC_CURRENT_DIR"
            | "OUT_DIR"
    ) || PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Derives the layout from the executable's path: its directory is `deps/`,
/// `examples/` or the profile directory itself.
fn layout(exe: &Path, cargo_target_dir: Option<&Path>) -> Result<Layout, String> {
    let parent = exe
        .parent()
        .ok_or_else(|| format!("{} has no parent", exe.display()))?;
    let in_deps = parent.file_name().and_then(|n| n.to_str()) == Some("deps");
    let profile_dir = match parent.file_name().and_then(|n| n.to_str()) {
        Some("deps" | "examples") => parent.parent().unwrap_or(parent),
        _ => parent,
    };
    let dir_name = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("cannot tell the profile from {}", exe.display()))?;
    let target_dir = match cargo_target_dir {
        Some(dir) => dir.to_path_buf(),
        None => profile_dir
            .parent()
            .ok_or_else(|| format!("cannot tell the target directory from {}", exe.display()))?
            .to_path_buf(),
    };
    let profile = if dir_name == "debug" { "dev" } else { dir_name };
    Ok(Layout {
        out_dir: target_dir.join(dir_name),
        profile: profile.to_owned(),
        target_dir,
        test_harness: in_deps && profile == "dev",
    })
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::{Layout, layout, set_by_outer_cargo};

    #[test]
    fn the_nested_build_drops_what_the_outer_cargo_set_and_keeps_the_users_settings() {
        for outer in [
            "CARGO",
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_BIN_EXE_demo",
            "CARGO_CRATE_NAME",
            "OUT_DIR",
        ] {
            assert!(set_by_outer_cargo(outer), "{outer}");
        }
        for user in [
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_NET_OFFLINE",
            "CARGO_BUILD_JOBS",
            "CARGO_INCREMENTAL",
            "PATH",
            "RUSTFLAGS",
        ] {
            assert!(!set_by_outer_cargo(user), "{user}");
        }
    }

    #[test]
    fn test_executable_in_debug_deps_builds_the_dev_profile() {
        let got = layout(Path::new("/w/target/debug/deps/system-0123abcd"), None).unwrap();
        assert_eq!(
            got,
            Layout {
                target_dir: PathBuf::from("/w/target"),
                profile: "dev".to_owned(),
                out_dir: PathBuf::from("/w/target/debug"),
                test_harness: true,
            }
        );
    }

    #[test]
    fn only_a_dev_test_harness_builds_every_target() {
        let demo = layout(Path::new("/w/target/debug/demo"), None).unwrap();
        assert!(!demo.test_harness, "the demo builds the binaries alone");
        let release = layout(Path::new("/w/target/release/deps/system-0123abcd"), None).unwrap();
        assert!(
            !release.test_harness,
            "a release test builds the binaries alone"
        );
    }

    #[test]
    fn release_example_and_cargo_target_dir_are_honoured() {
        let got = layout(
            Path::new("/w/target/release/examples/demo"),
            Some(Path::new("/elsewhere")),
        )
        .unwrap();
        assert_eq!(got.profile, "release");
        assert_eq!(got.target_dir, PathBuf::from("/elsewhere"));
        assert_eq!(got.out_dir, PathBuf::from("/elsewhere/release"));
    }

    #[test]
    fn a_binary_in_the_profile_directory_works_too() {
        let got = layout(Path::new("/w/target/bench/throwaway-pg"), None).unwrap();
        assert_eq!(got.profile, "bench");
        assert_eq!(got.out_dir, PathBuf::from("/w/target/bench"));
        assert!(!got.test_harness);
    }
}
