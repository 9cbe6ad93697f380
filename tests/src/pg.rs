//! One throwaway PostgreSQL cluster: `initdb` into a temporary directory,
//! settings for logical replication, a postmaster started as our direct
//! child, and no way for it to outlive us.
//!
//! Lifetime rules, strongest last:
//! - [`PgCluster::stop`] / `Drop` (fast shutdown, then immediate after a bound);
//!   unwinding from a panic runs `Drop` too.
//! - a guardian process (see `guardian.rs`) sends SIGQUIT (immediate shutdown)
//!   to the postmaster within milliseconds of this process dying, even by
//!   SIGKILL, and deletes the directory. This is what covers [`PgCluster::shared`],
//!   which lives in a `static` and is never dropped.
//!
//! PostgreSQL refuses to run as root, and CI runs as root: then the directory
//! is handed to the `postgres` user and `initdb`/`postgres` run under its
//! uid/gid (no sudo involved).
//!
//! Every server program is started through [`PgBin::command`] (the library
//! path rule of `pgbin.rs`); `pgfiles.rs` writes the configuration files; a
//! streaming standby of a cluster is in `standby.rs`.

use std::fs::{self, OpenOptions};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Gid, Pid, Uid, User, chown};
use rand::Rng;
use rand::distr::Alphanumeric;
use tempfile::TempDir;

use crate::guardian::{Guardian, has_exited};
use crate::pgbin::PgBin;
pub use crate::pgbin::{BINDIR_ENV, find_bin_dir};
use crate::pgfiles::{initdb, write_hba, write_settings};
use crate::stack::StackState;

/// The superuser `initdb` creates.
pub const SUPERUSER: &str = "postgres";

/// How long [`PgCluster::start`] waits for the server to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How many times a start is retried when another process grabbed our port.
const PORT_ATTEMPTS: usize = 3;

/// Lines of server log quoted in errors.
const ERROR_LOG_LINES: usize = 40;

/// Server log lines that tell why a server went into crash recovery.
const CRASH_MARKS: &[&str] = &[
    "PANIC:",
    "terminated by signal",
    "exited with exit code",
    "No space left",
    "was interrupted",
    "not properly shut down",
    "all server processes terminated",
];

/// How many of those [`PgCluster::health_report`] quotes.
const CRASH_LINES: usize = 12;

/// Settings of a cluster to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Durable writes (`fsync`, `full_page_writes`). Off by default: tests
    /// simulate process crashes, which the kernel's page cache survives, not
    /// machine crashes. Benchmarks turn it on to measure real commit latency.
    ///
    /// `synchronous_commit` stays `on` either way: with it off, an immediate
    /// shutdown loses acknowledged commits (their WAL is still in shared
    /// memory), and logical decoding only sees a commit once its WAL is
    /// flushed, which would add up to `wal_writer_delay` (200 ms) of latency.
    pub fsync: bool,
    /// `wal_sender_timeout`, a PostgreSQL interval such as `"60s"` or `"500ms"`.
    pub wal_sender_timeout: String,
    /// `max_slot_wal_keep_size` (e.g. `"64MB"`); `None` keeps the default (unlimited).
    pub max_slot_wal_keep_size: Option<String>,
    /// Further `postgresql.conf` settings as (name, value); values are quoted for you.
    pub extra_settings: Vec<(String, String)>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            fsync: false,
            wal_sender_timeout: "60s".to_owned(),
            max_slot_wal_keep_size: None,
            extra_settings: Vec::new(),
        }
    }
}

/// How to stop the postmaster (the three shutdown modes of `pg_ctl stop`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// SIGTERM: wait for every client to disconnect.
    Smart,
    /// SIGINT: abort transactions, disconnect clients, checkpoint.
    Fast,
    /// SIGQUIT: exit at once; the next start runs crash recovery.
    Immediate,
}

impl StopMode {
    fn signal(self) -> Signal {
        match self {
            StopMode::Smart => Signal::SIGTERM,
            StopMode::Fast => Signal::SIGINT,
            StopMode::Immediate => Signal::SIGQUIT,
        }
    }

    /// How long to wait for the postmaster to exit in this mode.
    fn bound(self) -> Duration {
        match self {
            StopMode::Smart => Duration::from_secs(60),
            StopMode::Fast => Duration::from_secs(30),
            StopMode::Immediate => Duration::from_secs(10),
        }
    }
}

/// The running postmaster (if any) and the guardian watching it.
struct Postmaster {
    child: Option<Child>,
    guardian: Guardian,
}

/// A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1 (SCRAM)
/// and on a unix socket in that directory (trust). Stopped and deleted on drop.
pub struct PgCluster {
    root: TempDir,
    data_dir: PathBuf,
    bin: PgBin,
    log_path: PathBuf,
    port: u16,
    password: String,
    run_as: Option<(Uid, Gid)>,
    opts: ClusterOptions,
    /// Physical slots of standbys listed in `synchronized_standby_slots`.
    standby_slots: Mutex<Vec<String>>,
    postmaster: Mutex<Postmaster>,
    pub(crate) stacks: StackState,
}

/// Where a new cluster's files go, for the step that fills its data directory.
pub(crate) struct NewCluster<'a> {
    /// The binaries in use.
    pub(crate) bin: &'a PgBin,
    /// The private directory (socket, log), owned by the server's user.
    pub(crate) root: &'a Path,
    /// `<root>/data`, not yet created.
    pub(crate) data_dir: &'a Path,
    /// The server's uid/gid when we are root.
    pub(crate) run_as: Option<(Uid, Gid)>,
}

impl NewCluster<'_> {
    /// A command for `tool` that runs as the server's user in the cluster's directory.
    pub(crate) fn command(&self, tool: &str) -> Command {
        let mut command = self.bin.command(tool);
        command.current_dir(self.root).stdin(Stdio::null());
        as_user(&mut command, self.run_as);
        command
    }
}

impl PgCluster {
    /// Runs `initdb` and starts a postmaster; blocks until it accepts
    /// connections (at most 30 s). Errors carry the server log tail.
    pub fn start(opts: ClusterOptions) -> anyhow::Result<PgCluster> {
        PgCluster::start_with(PgBin::discover()?, opts)
    }

    /// [`start`](Self::start) with the binaries `bin` (e.g. the ones
    /// [`pgbin::fetch`](crate::pgbin::fetch) installed).
    pub fn start_with(bin: PgBin, opts: ClusterOptions) -> anyhow::Result<PgCluster> {
        let password = random_token(32);
        PgCluster::create(bin, password.clone(), opts, None, |new| {
            initdb(new, &password)?;
            write_hba(new.data_dir)
        })
    }

    /// Makes a private directory, lets `fill` create the data directory in it
    /// (`initdb`, `pg_basebackup`), then starts a postmaster on `port` (a
    /// free one when `None`) with the harness settings and `opts`.
    pub(crate) fn create(
        bin: PgBin,
        password: String,
        opts: ClusterOptions,
        port: Option<u16>,
        fill: impl FnOnce(&NewCluster<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<PgCluster> {
        let run_as = postgres_user_if_root()?;
        let root = tempfile::Builder::new()
            .prefix("cdc-relay-pg-")
            .tempdir_in("/tmp")
            .context("creating the cluster's temporary directory under /tmp")?;
        // The socket and log live here; only the server's user needs it.
        fs::set_permissions(root.path(), fs::Permissions::from_mode(0o700))?;
        hand_over(root.path(), run_as)?;

        let data_dir = root.path().join("data");
        let log_path = root.path().join("postgres.log");
        // Guard the directory from the first moment on, before any server runs.
        let guardian =
            Guardian::spawn("QUIT", Some(root.path())).context("spawning the guardian")?;
        fill(&NewCluster {
            bin: &bin,
            root: root.path(),
            data_dir: &data_dir,
            run_as,
        })
        .with_context(|| free_space(root.path()))?;

        let mut cluster = PgCluster {
            data_dir,
            bin,
            log_path,
            port: 0,
            password,
            run_as,
            opts,
            standby_slots: Mutex::new(Vec::new()),
            postmaster: Mutex::new(Postmaster {
                child: None,
                guardian,
            }),
            stacks: StackState::default(),
            root,
        };
        let started = match port {
            None => cluster.start_on_free_port(),
            Some(port) => {
                cluster.port = port;
                cluster
                    .write_settings()
                    .and_then(|()| cluster.start_again())
            }
        };
        started.with_context(|| free_space(cluster.root.path()))?;
        Ok(cluster)
    }

    /// The cluster shared by every test of this process (default options),
    /// started on first use. Panics with the reason if it cannot start.
    ///
    /// Tests run in parallel against it: never stop, restart or reconfigure
    /// it; start a cluster of your own for that.
    pub fn shared() -> &'static PgCluster {
        static SHARED: OnceLock<PgCluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            PgCluster::start(ClusterOptions::default())
                .unwrap_or_else(|err| panic!("cannot start the shared PostgreSQL cluster: {err:#}"))
        })
    }

    /// Address the server listens on: always `127.0.0.1`.
    pub fn host(&self) -> &str {
        "127.0.0.1"
    }

    /// TCP port (also the number in the unix socket's name).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Directory holding the unix socket `.s.PGSQL.<port>`.
    pub fn socket_dir(&self) -> &Path {
        self.root.path()
    }

    /// The cluster's data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Directory of the server binaries in use (`postgres`, `initdb`, usually `psql`).
    /// Start them with [`command`](Self::command), which sets the library path.
    pub fn bin_dir(&self) -> &Path {
        self.bin.dir()
    }

    /// The server binaries in use and their version.
    pub fn bin(&self) -> &PgBin {
        &self.bin
    }

    /// The server's major version (15, 16, 17, 18, ...), for assertions on
    /// behaviour that differs between versions.
    pub fn major_version(&self) -> u32 {
        self.bin.major()
    }

    /// A command running `tool` (`psql`, `pg_dump`, ...) from [`bin_dir`](Self::bin_dir)
    /// with the installation's `lib` first on `LD_LIBRARY_PATH`, as this
    /// process's user.
    pub fn command(&self, tool: &str) -> Command {
        self.bin.command(tool)
    }

    /// The options this cluster was started with.
    pub fn options(&self) -> &ClusterOptions {
        &self.opts
    }

    /// Password of the superuser `postgres` over TCP.
    pub fn superuser_password(&self) -> &str {
        &self.password
    }

    /// `postgres://user:password@127.0.0.1:port/db`, user and password percent-encoded.
    pub fn url(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "postgres://{}:{}@{}:{}/{}",
            percent_encode(user),
            percent_encode(password),
            self.host(),
            self.port,
            percent_encode(db)
        )
    }

    /// URL of the superuser over TCP (SCRAM) to database `db`.
    pub fn superuser_url(&self, db: &str) -> String {
        self.url(SUPERUSER, &self.password, db)
    }

    /// Connects as the superuser through the unix socket (trust, no SCRAM
    /// round trips); the connection task is spawned on the current runtime.
    pub async fn connect_superuser(&self, db: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, connection) = tokio_postgres::Config::new()
            .host_path(self.socket_dir())
            .port(self.port)
            .user(SUPERUSER)
            .dbname(db)
            .connect_timeout(Duration::from_secs(10))
            .connect(tokio_postgres::NoTls)
            .await
            .with_context(|| {
                format!(
                    "connecting as {SUPERUSER} to database {db} via {}\n{}",
                    self.socket_dir().display(),
                    self.health_report()
                )
            })?;
        tokio::spawn(async move {
            // The error, if any, surfaces to the client's next call.
            let _ = connection.await;
        });
        Ok(client)
    }

    /// Pid of the running postmaster; `None` while stopped.
    pub fn postmaster_pid(&self) -> Option<u32> {
        self.lock().child.as_ref().map(Child::id)
    }

    /// Stops the server in `mode` and waits for the postmaster to exit
    /// (bounded: 60 s smart, 30 s fast, 10 s immediate). Stopping a stopped
    /// cluster is a no-op.
    pub fn stop(&self, mode: StopMode) -> anyhow::Result<()> {
        let mut pm = self.lock();
        let Some(child) = pm.child.as_mut() else {
            return Ok(());
        };
        let pid = child.id();
        signal(pid, mode.signal())?;
        let deadline = Instant::now() + mode.bound();
        while !has_exited(pid) {
            if Instant::now() >= deadline {
                bail!(
                    "postmaster {pid} did not stop ({mode:?}) within {:?}\n{}",
                    mode.bound(),
                    self.log_tail(ERROR_LOG_LINES)
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        pm.guardian.forget();
        if let Some(mut child) = pm.child.take() {
            child.wait().context("reaping the postmaster")?;
        }
        Ok(())
    }

    /// As if the machine died: stops the postmaster (SIGSTOP, so it starts
    /// nothing more), SIGKILLs every process it started, then the postmaster
    /// itself, and waits (at most 10 s) until all are gone. Clients see their
    /// connections reset; the next [`start_again`](Self::start_again) runs
    /// crash recovery. Killing a stopped cluster is a no-op.
    pub fn kill(&self) -> anyhow::Result<()> {
        let mut pm = self.lock();
        let Some(child) = pm.child.as_mut() else {
            return Ok(());
        };
        let pid = child.id();
        signal(pid, Signal::SIGSTOP)?;
        let children = children_of(pid);
        for &backend in &children {
            // One may have exited since the listing: nothing to do for it.
            let _ = signal(backend, Signal::SIGKILL);
        }
        signal(pid, Signal::SIGKILL)?;
        let deadline = Instant::now() + StopMode::Immediate.bound();
        while !has_exited(pid) || children.iter().any(|&c| running(c)) {
            if Instant::now() >= deadline {
                bail!("postmaster {pid} or one of its processes {children:?} survived SIGKILL");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        pm.guardian.forget();
        if let Some(mut child) = pm.child.take() {
            child.wait().context("reaping the postmaster")?;
        }
        Ok(())
    }

    /// Runs `sql` with `psql` as the superuser over the unix socket, stopping
    /// at the first error; returns its unaligned, tuples-only output, trimmed
    /// (one line per row, `|` between columns). For the harness's own
    /// blocking steps; tests usually prefer [`connect_superuser`](Self::connect_superuser).
    pub fn psql(&self, db: &str, sql: &str) -> anyhow::Result<String> {
        let output = self
            .command("psql")
            .arg("-h")
            .arg(self.socket_dir())
            .args(["-p", &self.port.to_string(), "-U", SUPERUSER, "-d", db])
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {}", self.bin.path("psql").display()))?;
        if !output.status.success() {
            bail!(
                "psql on port {} failed ({}) running {sql:?}: {}",
                self.port,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    /// Starts the stopped server again: same data directory, same port.
    pub fn start_again(&self) -> anyhow::Result<()> {
        let mut pm = self.lock();
        if pm.child.is_some() {
            bail!("the cluster is already running");
        }
        let child = self.spawn_postmaster()?;
        let pid = child.id();
        pm.guardian.watch(pid);
        pm.child = Some(child);
        self.wait_status(&mut pm, &["ready", "standby"])
    }

    /// [`stop`](Self::stop) in `mode`, then [`start_again`](Self::start_again).
    pub fn restart(&self, mode: StopMode) -> anyhow::Result<()> {
        self.stop(mode)?;
        self.start_again()
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        let contents = self.log_contents();
        let all: Vec<&str> = contents.lines().collect();
        let from = all.len().saturating_sub(lines);
        let mut tail = format!(
            "--- last {} lines of {} ---\n",
            all.len() - from,
            self.log_path.display()
        );
        for line in &all[from..] {
            tail.push_str(line);
            tail.push('\n');
        }
        tail
    }

    /// Why the server may be refusing connections, for an error message:
    /// the free space where its files are, the log lines that tell of a
    /// crash or a full disk (the last `CRASH_LINES`), then the log's last
    /// lines.
    pub fn health_report(&self) -> String {
        let contents = self.log_contents();
        let crashes: Vec<&str> = contents
            .lines()
            .filter(|line| CRASH_MARKS.iter().any(|mark| line.contains(mark)))
            .collect();
        let from = crashes.len().saturating_sub(CRASH_LINES);
        let mut report = format!("{}\n", free_space(self.root.path()));
        report.push_str(&format!(
            "--- {} crash lines in {} (the last {}) ---\n",
            crashes.len(),
            self.log_path.display(),
            crashes.len() - from
        ));
        for line in &crashes[from..] {
            report.push_str(line);
            report.push('\n');
        }
        report.push_str(&self.log_tail(ERROR_LOG_LINES / 4));
        report
    }

    /// The whole server log (stderr of the postmaster and its children).
    pub fn log_contents(&self) -> String {
        fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    fn lock(&self) -> MutexGuard<'_, Postmaster> {
        // A panic while holding the lock leaves the state consistent enough
        // to stop the server, which is all Drop needs.
        self.postmaster
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn start_on_free_port(&mut self) -> anyhow::Result<()> {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            self.port = free_port()?;
            self.write_settings()?;
            match self.start_again() {
                Ok(()) => return Ok(()),
                Err(err) if self.log_contents().contains("could not bind") => {
                    self.stop(StopMode::Immediate)?;
                    last_error = Some(err);
                }
                Err(err) => return Err(err),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("no port attempt made")))
    }

    /// Changes the list of standby slots in `synchronized_standby_slots`
    /// with `change`, rewrites the settings and reloads them.
    pub(crate) fn change_standby_slots(
        &self,
        change: impl FnOnce(&mut Vec<String>),
    ) -> anyhow::Result<String> {
        let mut slots = self
            .standby_slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        change(&mut slots);
        let value = slots.join(",");
        drop(slots);
        self.write_settings()?;
        self.psql("postgres", "SELECT pg_reload_conf()")?;
        Ok(value)
    }

    /// Writes `harness.conf` from the options, port and standby slots.
    fn write_settings(&self) -> anyhow::Result<()> {
        let standby_slots = self
            .standby_slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .join(",");
        write_settings(
            &self.data_dir,
            self.root.path(),
            self.port,
            &self.opts,
            &self.bin,
            &standby_slots,
        )
    }

    /// A command running `tool` as the server's user in the cluster's
    /// directory (`pg_ctl` refuses root).
    pub(crate) fn server_command(&self, tool: &str) -> Command {
        let mut command = self.bin.command(tool);
        command.current_dir(self.root.path()).stdin(Stdio::null());
        as_user(&mut command, self.run_as);
        command
    }

    fn spawn_postmaster(&self) -> anyhow::Result<Child> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening {}", self.log_path.display()))?;
        let mut command = self.bin.command("postgres");
        command
            .arg("-D")
            .arg(&self.data_dir)
            .current_dir(self.root.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        as_user(&mut command, self.run_as);
        command
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.path("postgres").display()))
    }

    /// Waits (at most 30 s) until `postmaster.pid` reports `status`: `ready`
    /// once a primary accepts connections (also once a promotion is done),
    /// `standby` once a hot standby accepts read-only ones.
    pub(crate) fn wait_until_status(&self, status: &str) -> anyhow::Result<()> {
        let mut pm = self.lock();
        self.wait_status(&mut pm, &[status])
    }

    /// Polls `postmaster.pid` until the server reports one of `statuses`,
    /// then checks that the TCP port answers.
    fn wait_status(&self, pm: &mut Postmaster, statuses: &[&str]) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let pid = pm
            .child
            .as_ref()
            .map(Child::id)
            .context("no postmaster to wait for")?;
        loop {
            if has_exited(pid) {
                pm.guardian.forget();
                let status = pm.child.take().map(|mut child| child.wait());
                bail!(
                    "postgres exited during startup ({status:?})\n{}",
                    self.log_tail(ERROR_LOG_LINES)
                );
            }
            if self.reports_status(pid, statuses)
                && TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "postgres (pid {pid}) not {statuses:?} within {READY_TIMEOUT:?}\n{}",
                    self.log_tail(ERROR_LOG_LINES)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Line 1 of `postmaster.pid` is the pid, line 8 the status pg_ctl reads.
    fn reports_status(&self, pid: u32, statuses: &[&str]) -> bool {
        let Ok(contents) = fs::read_to_string(self.data_dir.join("postmaster.pid")) else {
            return false;
        };
        let lines: Vec<&str> = contents.lines().collect();
        lines.first().map(|l| l.trim()) == Some(pid.to_string().as_str())
            && lines
                .get(7)
                .is_some_and(|status| statuses.contains(&status.trim()))
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.stop(StopMode::Fast).is_err() && self.stop(StopMode::Immediate).is_err() {
            let mut pm = self.lock();
            if let Some(mut child) = pm.child.take() {
                let _ = child.kill();
                pm.guardian.forget();
                let _ = child.wait();
            }
        }
        // Dropping the guardian (with the Postmaster) then removes the
        // directory; TempDir's own removal finds it gone, which is fine.
    }
}

impl std::fmt::Debug for PgCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgCluster")
            .field("port", &self.port)
            .field("data_dir", &self.data_dir)
            .field("postmaster_pid", &self.postmaster_pid())
            .finish_non_exhaustive()
    }
}

/// When we are root, the uid/gid of `postgres`, the user the server runs as.
fn postgres_user_if_root() -> anyhow::Result<Option<(Uid, Gid)>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    let user = User::from_name(SUPERUSER)
        .context("looking up the `postgres` user")?
        .context(
            "running as root, PostgreSQL must run as another user, and there is no `postgres` \
             user: `apt-get install postgresql` creates it (or run the tests as a normal user)",
        )?;
    Ok(Some((user.uid, user.gid)))
}

pub(crate) fn hand_over(path: &Path, run_as: Option<(Uid, Gid)>) -> anyhow::Result<()> {
    if let Some((uid, gid)) = run_as {
        chown(path, Some(uid), Some(gid))
            .with_context(|| format!("chown {} to postgres", path.display()))?;
    }
    Ok(())
}

fn as_user(command: &mut Command, run_as: Option<(Uid, Gid)>) {
    if let Some((uid, gid)) = run_as {
        command.uid(uid.as_raw()).gid(gid.as_raw());
    }
}

/// A port the kernel just handed out; the small race with other processes is
/// handled by retrying the start.
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Pids whose parent is `pid` (a postmaster's backends and workers).
fn children_of(pid: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the command's closing parenthesis: state, ppid, ...
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        if after.split_whitespace().nth(1) == Some(pid.to_string().as_str()) {
            children.push(child);
        }
    }
    children
}

/// Whether `pid` exists and is not a zombie (an orphan PID 1 may never reap).
fn running(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

fn signal(pid: u32, sig: Signal) -> anyhow::Result<()> {
    let raw = i32::try_from(pid).context("pid out of range")?;
    kill(Pid::from_raw(raw), sig).with_context(|| format!("sending {sig} to {pid}"))
}

/// A random alphanumeric string of `len` characters (passwords, names).
pub(crate) fn random_token(len: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `free space on <filesystem of path>: N MiB of M MiB`, or why it is unknown.
pub fn free_space(path: &Path) -> String {
    match nix::sys::statvfs::statvfs(path) {
        Ok(fs) => {
            let block = fs.fragment_size();
            let mib = |blocks: u64| blocks * block / (1024 * 1024);
            format!(
                "free space where {} is: {} MiB of {} MiB",
                path.display(),
                mib(fs.blocks_available()),
                mib(fs.blocks())
            )
        }
        Err(err) => format!("free space where {} is: unknown ({err})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::percent_encode;

    #[test]
    fn percent_encode_keeps_unreserved_and_escapes_the_rest() {
        assert_eq!(percent_encode("orders_app-1.~"), "orders_app-1.~");
        assert_eq!(percent_encode("p@ss:w/rd"), "p%40ss%3Aw%2Frd");
    }
}
