//! Debian packages a test needs beyond PostgreSQL (PgBouncer, libfaketime):
//! found where the package puts them, else installed with apt-get when the
//! tests run as root on Debian or Ubuntu, the way `tests/run.sh` installs
//! the server; otherwise an error naming the install command.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use nix::unistd::Uid;

/// `file`, which Debian's package `package` installs: at once when it is
/// there, else after `apt-get install package` (as root on Debian/Ubuntu).
pub fn package_file(file: &str, package: &str) -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(file);
    if path.exists() {
        return Ok(path);
    }
    let apt = Path::new("/usr/bin/apt-get").exists();
    anyhow::ensure!(
        Uid::effective().is_root() && apt,
        "{file} is missing: `sudo apt-get install {package}` (Debian/Ubuntu), then run the tests again"
    );
    // Concurrent tests may all find it missing: one installs, under a lock.
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if !path.exists() {
        for args in [&["update", "-qq"][..], &["install", "-y", "-qq", package]] {
            let status = Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .context("running apt-get")?;
            anyhow::ensure!(status.success(), "apt-get {args:?} failed: {status}");
        }
    }
    anyhow::ensure!(path.exists(), "apt-get install {package} left no {file}");
    Ok(path)
}

/// libfaketime's preload library (Debian's `libfaketime`), installed when
/// missing as [`package_file`] does.
pub fn libfaketime() -> anyhow::Result<PathBuf> {
    package_file(
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "libfaketime",
    )
}
