//! PgBouncer in front of a test cluster: Debian's `pgbouncer` package
//! (1.18 on Debian 12), installed with apt-get when it is missing and the
//! tests run as root on Debian, the way `tests/run.sh` installs
//! PostgreSQL. Clients authenticate to it with SCRAM, and it logs in to
//! the cluster with the same role and password (plain-text in its
//! `auth_file`).

use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use nix::unistd::{Gid, Uid, User};

use crate::pg::{PgCluster, hand_over};
use crate::process::ServiceProcess;

/// Where Debian's package puts the binary.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// How long PgBouncer may take to listen.
const START: Duration = Duration::from_secs(15);

/// PgBouncer's `pool_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection per client connection, for its whole life.
    Session,
    /// A server connection per transaction: session state (prepared
    /// statements, advisory locks, `SET`) does not survive a transaction.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer; stopped (killed) when dropped.
pub struct Pooler {
    process: ServiceProcess,
    port: u16,
    config: PathBuf,
    mode: PoolMode,
    _dir: tempfile::TempDir,
}

impl Pooler {
    /// Starts PgBouncer in `mode` in front of `cluster`'s TCP port, letting
    /// in each `(role, password)` of `users` (and passing it on to the
    /// cluster), every database. It refuses every startup parameter it
    /// does not know, as by default, except those in `ignored`
    /// (`ignore_startup_parameters`: dropped, the session passed on).
    pub async fn start(
        cluster: &PgCluster,
        mode: PoolMode,
        users: &[(&str, &str)],
        ignored: &[&str],
    ) -> anyhow::Result<Pooler> {
        let binary = installed()?;
        let dir = tempfile::Builder::new()
            .prefix("cdc-relay-pgbouncer-")
            .tempdir()?;
        let run_as = run_as()?;
        let mut auth = String::new();
        for (user, password) in users {
            writeln!(auth, "{user:?} {password:?}")?;
        }
        let auth_file = write(dir.path(), "users.txt", &auth)?;
        let mut last = None;
        for _ in 0..3 {
            let port = free_port()?;
            let ini = format!(
                "[databases]\n* = host={host} port={pg}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
                 listen_port = {port}\nunix_socket_dir =\nauth_type = scram-sha-256\n\
                 auth_file = {auth}\npool_mode = {mode}\nmax_client_conn = 200\n\
                 default_pool_size = 4\nignore_startup_parameters = {ignored}\n",
                host = cluster.host(),
                pg = cluster.port(),
                auth = auth_file.display(),
                mode = mode.as_str(),
                ignored = ignored.join(","),
            );
            let config = write(dir.path(), "pgbouncer.ini", &ini)?;
            for path in [dir.path(), &auth_file, &config] {
                hand_over(path, run_as)?;
            }
            let mut command = Command::new(&binary);
            command.arg(&config);
            if let Some((uid, gid)) = run_as {
                command.uid(uid.as_raw()).gid(gid.as_raw());
            }
            let process = ServiceProcess::from_command(command)?;
            match process.wait_for_line("listening on 127.0.0.1", START).await {
                Ok(_) => {
                    return Ok(Pooler {
                        process,
                        port,
                        config,
                        mode,
                        _dir: dir,
                    });
                }
                Err(e) => last = Some(e.context(process.logs())),
            }
        }
        Err(last.expect("three attempts")).context("starting PgBouncer")
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `url` (a `postgres://` URL to the cluster) through the pooler: the
    /// same role, password, database and parameters, its port.
    pub fn url(&self, url: &str) -> anyhow::Result<String> {
        let mut parsed = reqwest::Url::parse(url).with_context(|| format!("parsing {url:?}"))?;
        parsed
            .set_port(Some(self.port))
            .map_err(|()| anyhow::anyhow!("cannot set a port on {url:?}"))?;
        Ok(parsed.into())
    }

    /// Rewrites its `pool_mode` to `mode` and reloads it (SIGHUP), as an
    /// operator would under running clients; returns once PgBouncer has
    /// logged the reload.
    pub async fn switch_mode(&mut self, mode: PoolMode) -> anyhow::Result<()> {
        let ini = std::fs::read_to_string(&self.config)?;
        let from = format!("pool_mode = {}", self.mode.as_str());
        anyhow::ensure!(ini.contains(&from), "no {from:?} in {ini}");
        let ini = ini.replace(&from, &format!("pool_mode = {}", mode.as_str()));
        std::fs::write(&self.config, ini)?;
        let reloads = self.logs().matches("got SIGHUP").count();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.process.pid())?),
            nix::sys::signal::Signal::SIGHUP,
        )?;
        crate::wait_until("PgBouncer reloaded", START, || async {
            Ok(self.logs().matches("got SIGHUP").count() > reloads)
        })
        .await?;
        self.mode = mode;
        Ok(())
    }

    /// What it logged.
    pub fn logs(&self) -> String {
        self.process.logs()
    }
}

/// The PgBouncer binary, installed from Debian's package when missing.
fn installed() -> anyhow::Result<PathBuf> {
    crate::debian::package_file(PGBOUNCER, "pgbouncer")
}

/// The uid/gid PgBouncer runs as: `postgres` when we are root (it refuses
/// to run as root), else our own.
fn run_as() -> anyhow::Result<Option<(Uid, Gid)>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    let user = User::from_name("postgres")?.context("no `postgres` user to run PgBouncer as")?;
    Ok(Some((user.uid, user.gid)))
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(path)
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
