//! Running one of our binaries under supervision: its stdout and stderr are
//! each written to a log file and kept (the last 100,000 lines) for
//! [`ServiceProcess::wait_for_line`]; it is SIGKILLed on drop, and a guardian
//! SIGKILLs it if this process dies first.
//!
//! Convention every binary of the workspace follows: once its HTTP listener is
//! bound it prints one line `listening on http://<addr>` to stdout, so tests
//! can pass `--listen 127.0.0.1:0` and learn the port from
//! [`ServiceProcess::listen_addr`].

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tempfile::TempDir;
use tokio::sync::watch;

use crate::guardian::{Guardian, has_exited};

/// The start-up line every service prints to stdout once it is bound.
pub const LISTENING: &str = "listening on http://";

/// The line Orders and Billing print to stdout once their admin listener
/// (`/metrics`, `/healthz`, operators' reads) is bound, before [`LISTENING`].
pub const ADMIN_ENDPOINT: &str = "admin endpoint on http://";

/// Lines kept in memory for searching; the log files keep everything.
const RETAINED_LINES: usize = 100_000;

/// Lines of output quoted in errors.
const ERROR_TAIL_LINES: usize = 40;

/// A child process with captured output; SIGKILLed when dropped.
pub struct ServiceProcess {
    name: String,
    child: Child,
    status: Option<ExitStatus>,
    guardian: Guardian,
    output: Arc<Output>,
    log_dir: TempDir,
}

/// Output shared between the reader threads and the owner.
struct Output {
    state: Mutex<Lines>,
    /// Bumped on every new line and when a stream closes.
    changed: watch::Sender<u64>,
    /// stdout and stderr interleaved in arrival order.
    combined: Mutex<File>,
}

struct Lines {
    /// The last [`RETAINED_LINES`] lines.
    retained: VecDeque<String>,
    /// Lines received since the start, retained or not.
    total: usize,
    open_streams: usize,
}

impl ServiceProcess {
    /// Spawns `program` with `args` and extra environment `envs` (the rest
    /// of the environment is inherited).
    pub fn spawn(
        program: impl AsRef<Path>,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<ServiceProcess> {
        let mut command = Command::new(program.as_ref());
        command.args(args).envs(envs.iter().copied());
        ServiceProcess::from_command(command)
    }

    /// Spawns a prepared command; stdin, stdout and stderr are set here.
    /// Orders, Billing, Payments and cdc-relay get a free admin port
    /// (`<SERVICE>_ADMIN_LISTEN=127.0.0.1:0`) unless the command sets one:
    /// their fixed default would collide between tests running at once.
    pub fn from_command(mut command: Command) -> anyhow::Result<ServiceProcess> {
        // A process group of its own: a paused (SIGSTOP) service whose
        // group became orphaned (a bench or test started with nohup in the
        // background, its launching shell gone) is sent SIGHUP and SIGCONT
        // by the kernel when a process of that group exits (POSIX's rule
        // for orphaned groups with stopped members): a frozen sink resumed
        // within 2 s. Its own group has its parent, this process, outside
        // it in the same session, so it is not orphaned while we live.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let program = Path::new(command.get_program()).to_path_buf();
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "process".to_owned());
        for (service, var) in [
            ("orders", "ORDERS_ADMIN_LISTEN"),
            ("billing", "BILLING_ADMIN_LISTEN"),
            ("payments", "PAYMENTS_ADMIN_LISTEN"),
            ("cdc-relay", "CDC_RELAY_ADMIN_LISTEN"),
        ] {
            let set = command.get_envs().any(|(k, _)| k == var);
            if name == service && !set {
                command.env(var, "127.0.0.1:0");
            }
        }
        let log_dir = tempfile::Builder::new()
            .prefix(&format!("cdc-relay-{name}-"))
            .tempdir()
            .context("creating a log directory")?;
        let mut guardian =
            Guardian::spawn("KILL", Some(log_dir.path())).context("spawning the guardian")?;
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawning {}", program.display()))?;
        guardian.watch(child.id());

        let output = Arc::new(Output {
            state: Mutex::new(Lines {
                retained: VecDeque::new(),
                total: 0,
                open_streams: 2,
            }),
            changed: watch::Sender::new(0),
            combined: Mutex::new(File::create(log_dir.path().join("output.log"))?),
        });
        let stdout = child.stdout.take().context("stdout was not piped")?;
        let stderr = child.stderr.take().context("stderr was not piped")?;
        spawn_reader(
            stdout,
            File::create(log_dir.path().join("stdout.log"))?,
            Arc::clone(&output),
        );
        spawn_reader(
            stderr,
            File::create(log_dir.path().join("stderr.log"))?,
            Arc::clone(&output),
        );

        Ok(ServiceProcess {
            name,
            child,
            status: None,
            guardian,
            output,
            log_dir,
        })
    }

    /// The process id (stays valid until the process is reaped).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Directory holding `stdout.log`, `stderr.log` and `output.log` (both
    /// interleaved); removed on drop.
    pub fn log_dir(&self) -> &Path {
        self.log_dir.path()
    }

    /// Everything printed to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read(self.log_dir.path().join("stderr.log"))
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The exit status if the process has exited (reaping it), without waiting.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() && has_exited(self.pid()) {
            self.reap();
        }
        self.status
    }

    /// Everything printed so far, stdout and stderr interleaved in arrival order.
    pub fn logs(&self) -> String {
        fs::read(self.log_dir.path().join("output.log"))
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// Waits for the first line (stdout or stderr, including lines printed
    /// before the call) that contains `pattern` and returns it. Fails at
    /// `timeout`, or as soon as the process closed both streams; the error
    /// names the pattern and quotes the output's tail.
    pub async fn wait_for_line(&self, pattern: &str, timeout: Duration) -> anyhow::Result<String> {
        let what = format!("a line containing {pattern:?}");
        self.wait_for_line_where(&what, |line| line.contains(pattern), timeout)
            .await
    }

    /// [`wait_for_line`](Self::wait_for_line) for the first line `matches`
    /// accepts; `what` describes such a line in the errors.
    pub async fn wait_for_line_where(
        &self,
        what: &str,
        matches: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.output.changed.subscribe();
        // Absolute number of the first line not searched yet, so a chatty
        // process costs one scan per line, not one per line per wake-up.
        let mut next: usize = 0;
        loop {
            changes.borrow_and_update();
            let (found, open_streams) = {
                let lines = self.output.lock();
                let first_retained = lines.total - lines.retained.len();
                let skip = next.saturating_sub(first_retained);
                next = lines.total;
                let found = lines
                    .retained
                    .iter()
                    .skip(skip)
                    .find(|line| matches(line))
                    .cloned();
                (found, lines.open_streams)
            };
            if let Some(line) = found {
                return Ok(line);
            }
            if open_streams == 0 {
                bail!(
                    "{} closed stdout and stderr (exited?) without printing {what}\n{}",
                    self.name,
                    self.tail()
                );
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                bail!(
                    "timed out after {timeout:?} waiting for {} to print {what}\n{}",
                    self.name,
                    self.tail()
                );
            }
        }
    }

    /// Waits for the `listening on http://<addr>` line and returns the base
    /// URL, e.g. `http://127.0.0.1:41234`.
    pub async fn listen_addr(&self, timeout: Duration) -> anyhow::Result<String> {
        let line = self.wait_for_line(LISTENING, timeout).await?;
        let start = line
            .find("http://")
            .context("no URL in the listening line")?;
        let url: String = line[start..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || ":/.[]-_%".contains(*c))
            .collect();
        Ok(url.trim_end_matches('/').to_owned())
    }

    /// The admin URL Orders or Billing printed ([`ADMIN_ENDPOINT`]), once
    /// it is bound; `http://127.0.0.1:PORT`.
    pub async fn admin_addr(&self, timeout: Duration) -> anyhow::Result<String> {
        let line = self.wait_for_line(ADMIN_ENDPOINT, timeout).await?;
        let start = line.find("http://").context("no URL in the admin line")?;
        let url: String = line[start..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || ":/.[]-_%".contains(*c))
            .collect();
        Ok(url.trim_end_matches('/').to_owned())
    }

    /// Sends `sig` unless the process already exited.
    fn send(&self, sig: Signal) {
        if self.status.is_none()
            && !has_exited(self.pid())
            && let Ok(raw) = i32::try_from(self.pid())
        {
            let _ = kill(Pid::from_raw(raw), sig);
        }
    }

    /// Sends SIGTERM (graceful shutdown) unless the process already exited.
    pub fn sigterm(&mut self) {
        self.send(Signal::SIGTERM);
    }

    /// Sends SIGINT (Ctrl-C) unless the process already exited.
    pub fn sigint(&self) {
        self.send(Signal::SIGINT);
    }

    /// Sends SIGHUP (reload its secrets) unless the process already exited.
    pub fn sighup(&self) {
        self.send(Signal::SIGHUP);
    }

    /// Pauses the process (SIGSTOP) until [`Self::resume`]: it runs no
    /// code, its sockets stay open and its timers run late.
    pub fn pause(&self) {
        self.send(Signal::SIGSTOP);
    }

    /// Resumes a [paused](Self::pause) process (SIGCONT).
    pub fn resume(&self) {
        self.send(Signal::SIGCONT);
    }

    /// Sends SIGKILL and reaps the process (blocks until it is gone, which
    /// the kernel makes immediate).
    pub fn sigkill(&mut self) {
        if self.status.is_some() {
            return;
        }
        let _ = self.child.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !has_exited(self.pid()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.reap();
    }

    /// Waits (polling every 10 ms) for the process to exit and returns its
    /// status; the timeout error quotes the output's tail.
    pub async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.status.is_none() {
            if has_exited(self.pid()) {
                self.reap();
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} (pid {}) did not exit within {timeout:?}\n{}",
                    self.name,
                    self.pid(),
                    self.tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // What it printed last may still be in the pipes: the reader
        // threads copy it until both streams close (a test reading `logs()`
        // right after the exit found them empty). Bounded: a child it left
        // behind may hold the pipes open.
        let mut changed = self.output.changed.subscribe();
        let drained = tokio::time::Instant::now() + Duration::from_secs(2);
        while self.output.lock().open_streams > 0 && tokio::time::Instant::now() < drained {
            let _ = tokio::time::timeout_at(drained, changed.changed()).await;
        }
        self.status.context("exit status lost while reaping")
    }

    /// Reaps an exited child, after telling the guardian its pid is free.
    fn reap(&mut self) {
        self.guardian.forget();
        self.status = self.child.wait().ok();
    }

    fn tail(&self) -> String {
        let lines = self.output.lock();
        let from = lines.retained.len().saturating_sub(ERROR_TAIL_LINES);
        let mut tail = format!(
            "--- last output of {} (all of it in {}) ---\n",
            self.name,
            self.log_dir.path().display()
        );
        for line in lines.retained.iter().skip(from) {
            tail.push_str(line);
            tail.push('\n');
        }
        tail
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.sigkill();
    }
}

impl std::fmt::Debug for ServiceProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceProcess")
            .field("name", &self.name)
            .field("pid", &self.child.id())
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Output {
    fn lock(&self) -> MutexGuard<'_, Lines> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn push(&self, line: String) {
        if let Ok(mut combined) = self.combined.lock() {
            let _ = writeln!(combined, "{line}");
        }
        {
            let mut lines = self.lock();
            if lines.retained.len() == RETAINED_LINES {
                lines.retained.pop_front();
            }
            lines.retained.push_back(line);
            lines.total += 1;
        }
        self.changed.send_modify(|n| *n += 1);
    }

    fn close_stream(&self) {
        self.lock().open_streams -= 1;
        self.changed.send_modify(|n| *n += 1);
    }
}

/// Copies one stream, line by line, into its own log file and into `output`.
fn spawn_reader(stream: impl Read + Send + 'static, mut file: File, output: Arc<Output>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let _ = file.write_all(&buf);
            let line = String::from_utf8_lossy(&buf);
            output.push(line.trim_end_matches(['\n', '\r']).to_owned());
        }
        output.close_stream();
    });
}
