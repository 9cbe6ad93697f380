//! `cdc-relay` as a CLI command run to its exit: its output and exit
//! status, a `run` that must refuse, and a command's peak memory.

use std::process::ExitStatus;
use std::time::Duration;

use anyhow::Context;

use super::relay_globals;
use crate::bins;
use crate::stack::Stack;

/// Bound for a `cdc-relay` CLI command: creating a slot waits for every
/// transaction in progress on the cluster, and other tests share it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// `cdc-relay <stack's --slot and --publication> <args>` against `db_url`,
/// without the test's own `EVENT_SECRET`, with `env` added; killed if
/// dropped.
fn cli(
    stack: &Stack,
    db_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(bins::path("cdc-relay"));
    command
        .args(relay_globals(stack))
        .args(args)
        .env("CDC_RELAY_DATABASE_URL", db_url)
        // Tests run side by side: a `run` binds an ephemeral admin port,
        // and `status` asks no relay by default (port 0 answers nothing),
        // never whatever another test's relay has at 127.0.0.1:9187.
        // (Broken before: a test's `status` read "not streaming" from
        // another test's refused `run` in its preflight on that port.)
        .env("CDC_RELAY_ADMIN_LISTEN", "127.0.0.1:0")
        .env_remove("EVENT_SECRET")
        .envs(env.iter().copied())
        .kill_on_drop(true);
    command
}

/// What a `cdc-relay` command run to completion printed, and how it exited.
#[derive(Debug)]
pub struct CommandOutput {
    /// The exit status.
    pub status: ExitStatus,
    /// Standard output (lossily decoded).
    pub stdout: String,
    /// Standard error (lossily decoded).
    pub stderr: String,
}

impl From<std::process::Output> for CommandOutput {
    fn from(out: std::process::Output) -> Self {
        CommandOutput {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl CommandOutput {
    /// Whether it exited 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// The exit code (`None` if a signal ended it).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Standard output then standard error, for assertions and messages.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// `cdc-relay run <args>` as a command against `db_url`, delivering to a
/// sink nobody listens on (`http://127.0.0.1:9/inbox`) with an ephemeral
/// admin port, until it exits: for a start that must refuse (its exit code
/// and words). `env` as for [`relay_command`] (the secret included).
pub async fn refused_run(
    stack: &Stack,
    db_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<CommandOutput> {
    let mut argv = vec![
        "run",
        "--sink-url",
        "http://127.0.0.1:9/inbox",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    argv.extend_from_slice(args);
    relay_command(stack, db_url, &argv, env).await
}

/// Runs `cdc-relay <stack's --slot and --publication> <args>` as a CLI
/// command against `db_url` and waits (bounded) for it to exit. The test's
/// own `EVENT_SECRET` is not passed on; `env` adds variables (the secret,
/// `CDC_RELAY_SINK_URL`, ...).
pub async fn relay_command(
    stack: &Stack,
    db_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<CommandOutput> {
    let out = tokio::time::timeout(COMMAND_TIMEOUT, cli(stack, db_url, args, env).output())
        .await
        .with_context(|| format!("cdc-relay {args:?} still running after {COMMAND_TIMEOUT:?}"))?
        .with_context(|| format!("running cdc-relay {args:?}"))?;
    Ok(out.into())
}

/// [`relay_command`], and the command's peak resident set in KiB: the
/// largest `VmHWM` its `/proc/<pid>/status` showed, read every 5 ms
/// while it ran. `VmHWM` is the process's own high-water mark since its
/// `exec` (a child's `ru_maxrss` from `wait4` is not: it starts from the
/// parent's), and it only grows, so a late read still sees an early peak;
/// only growth in the last milliseconds before the exit can be missed.
/// For a test that bounds what a command holds in memory (a count, not a
/// time).
pub async fn relay_command_peak_rss(
    stack: &Stack,
    db_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(CommandOutput, u64)> {
    let child = cli(stack, db_url, args, env)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running cdc-relay {args:?}"))?;
    let status_file = format!("/proc/{}/status", child.id().context("no pid")?);
    let mut peak = 0;
    let output = child.wait_with_output();
    tokio::pin!(output);
    let out = tokio::time::timeout(COMMAND_TIMEOUT, async {
        loop {
            if let Ok(status) = std::fs::read_to_string(&status_file) {
                peak = peak.max(high_water_kib(&status).unwrap_or(0));
            }
            tokio::select! {
                out = &mut output => return out,
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
    })
    .await
    .with_context(|| format!("cdc-relay {args:?} still running after {COMMAND_TIMEOUT:?}"))?
    .with_context(|| format!("running cdc-relay {args:?}"))?;
    anyhow::ensure!(
        peak > 0,
        "cdc-relay {args:?}: no VmHWM read from {status_file}"
    );
    Ok((out.into(), peak))
}

/// The `VmHWM` (peak resident set, KiB) of a `/proc/<pid>/status` text.
fn high_water_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}
