//! Who delivers: cdc-relay at a `--max-in-flight`, or the polling
//! baseline in one of its variants, as a child process whose CPU and memory
//! are read from `/proc`.

use std::time::Duration;

use harness::ServiceProcess;
use harness::app::{self, Running, TEST_SECRET};
use harness::stack::Stack;

/// Who delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contender {
    /// cdc-relay; `signature` is its `--signature-scheme` (`None`: the
    /// default), for the A/B of the signing cost.
    Ours {
        max_in_flight: u32,
        signature: Option<&'static str>,
        /// Its `--batch-max-events` (1: one request per event).
        batch: u32,
    },
    Baseline {
        workers: usize,
        poll_ms: u64,
    },
}

impl Contender {
    pub(crate) const OURS: Contender = Contender::Ours {
        max_in_flight: 64,
        signature: None,
        batch: 1,
    };
    pub(crate) const BASELINES: [Contender; 3] = [
        Contender::Baseline {
            workers: 1,
            poll_ms: 250,
        },
        Contender::Baseline {
            workers: 1,
            poll_ms: 100,
        },
        Contender::Baseline {
            workers: 4,
            poll_ms: 250,
        },
    ];

    pub(crate) fn all_default() -> Vec<Contender> {
        let mut v = vec![Contender::OURS];
        v.extend(Contender::BASELINES);
        v
    }

    /// Column name in the table.
    pub(crate) fn column(self) -> &'static str {
        match self {
            Contender::Ours { .. } => "ours",
            Contender::Baseline {
                workers: 1,
                poll_ms: 250,
            } => "baseline",
            Contender::Baseline { workers: 1, .. } => "baseline-100ms",
            Contender::Baseline { .. } => "baseline-4w",
        }
    }

    pub(crate) fn is_ours(self) -> bool {
        matches!(self, Contender::Ours { .. })
    }

    /// What a figure's name adds for a chosen signature scheme and batch
    /// size: `, signing legacy`, `, batch 16`, or nothing.
    pub(crate) fn signing(self) -> String {
        match self {
            Contender::Ours {
                signature, batch, ..
            } => {
                let mut tag = signature.map_or(String::new(), |s| format!(", signing {s}"));
                if batch > 1 {
                    tag += &format!(", batch {batch}");
                }
                tag
            }
            _ => String::new(),
        }
    }
}

pub(crate) enum Proc {
    Ours(Running),
    Base(ServiceProcess),
}

impl Proc {
    pub(crate) fn pid(&self) -> u32 {
        match self {
            Proc::Ours(r) => r.process.pid(),
            Proc::Base(p) => p.pid(),
        }
    }

    pub(crate) fn admin_url(&self) -> Option<&str> {
        match self {
            Proc::Ours(r) => Some(&r.url),
            Proc::Base(_) => None,
        }
    }
}

/// `--relay-threads`, set once before any scenario runs.
pub(crate) static RELAY_THREADS: std::sync::OnceLock<u16> = std::sync::OnceLock::new();

pub(crate) async fn start_contender(
    stack: &Stack,
    who: Contender,
    sink_url: &str,
) -> anyhow::Result<Proc> {
    start_contender_with(stack, who, sink_url, &[]).await
}

/// [`start_contender`] with `extra` arguments for ours (e.g.
/// `--otlp-endpoint URL`); the baseline ignores them.
pub(crate) async fn start_contender_with(
    stack: &Stack,
    who: Contender,
    sink_url: &str,
    extra: &[String],
) -> anyhow::Result<Proc> {
    match who {
        Contender::Ours {
            max_in_flight,
            signature,
            batch,
        } => {
            let mif = max_in_flight.to_string();
            // Info level: the harness's default (debug) logs every event.
            let mut args = vec![
                "--max-in-flight".to_owned(),
                mif,
                "--log".to_owned(),
                "info,pgwire_replication=off".to_owned(),
            ];
            if let Some(t) = RELAY_THREADS.get() {
                args.extend(["--worker-threads".to_owned(), t.to_string()]);
            }
            if let Some(s) = signature {
                args.extend(["--signature-scheme".to_owned(), s.to_owned()]);
            }
            if batch > 1 {
                args.extend(["--batch-max-events".to_owned(), batch.to_string()]);
            }
            args.extend(extra.iter().cloned());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let relay = app::start_relay(stack, sink_url, &args).await?;
            app::wait_streaming(&relay).await?;
            Ok(Proc::Ours(relay))
        }
        Contender::Baseline { workers, poll_ms } => {
            let exe = std::env::current_exe()?;
            let workers = workers.to_string();
            let poll = poll_ms.to_string();
            let p = ServiceProcess::spawn(
                exe,
                &[
                    "baseline-worker",
                    "--db-url",
                    &stack.orders_app_url,
                    "--sink-url",
                    sink_url,
                    "--workers",
                    &workers,
                    "--poll-ms",
                    &poll,
                ],
                &[("EVENT_SECRET", TEST_SECRET)],
            )?;
            p.wait_for_line("baseline ready", Duration::from_secs(30))
                .await?;
            Ok(Proc::Base(p))
        }
    }
}

/// `/proc/PID/status` field in kB (VmRSS, VmHWM).
pub(crate) fn proc_kb(pid: u32, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// utime + stime of PID, seconds.
pub(crate) fn proc_cpu_s(pid: u32, clk_tck: f64) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime field 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clk_tck)
}

pub(crate) fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}
