//! A watchdog process that ends a child of ours when this process dies.
//!
//! `Drop` cannot run when a test binary is SIGKILLed, and a `static` shared
//! cluster is never dropped at all. So every long-lived child (postmaster,
//! service) gets a tiny `sh` guardian whose stdin is a pipe from us: the
//! kernel closes our end whenever this process ends, however it ends, and the
//! guardian's `read` returns EOF at once. It then signals the pid it was last
//! told about and removes the temporary directory it was given.
//!
//! The pipe is created close-on-exec, so no other child inherits the write
//! end and keeps the guardian waiting. Owners tell the guardian `none` before
//! they reap their child, so it never signals a pid the kernel has reused.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;

/// Reads `pid N` / `none` lines; on EOF signals the last pid (escalating to
/// KILL after 5 s) and removes `$2` when non-empty.
const SCRIPT: &str = r#"
trap '' INT TERM HUP
sig=$1; dir=$2; pid=
while IFS= read -r line; do
  case $line in
    "pid "*) pid=${line#pid } ;;
    none) pid= ;;
  esac
done
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  kill -s "$sig" "$pid" 2>/dev/null
  n=0
  while [ "$n" -lt 100 ] && kill -0 "$pid" 2>/dev/null; do
    case $(cat "/proc/$pid/stat" 2>/dev/null) in *") Z "*) break ;; esac
    sleep 0.05
    n=$((n + 1))
  done
  kill -s KILL "$pid" 2>/dev/null
fi
if [ -n "$dir" ]; then rm -rf -- "$dir"; fi
"#;

/// How long `Drop` waits for the guardian to finish its cleanup.
const EXIT_BOUND: Duration = Duration::from_secs(10);

/// Handle on a running guardian; dropping it lets the guardian finish (it
/// signals nothing if told `none`, then removes its directory).
pub(crate) struct Guardian {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Guardian {
    /// Starts a guardian that sends `signal` (a `kill -s` name such as `QUIT`
    /// or `KILL`) and removes `cleanup_dir` (if any) once this process is gone.
    pub(crate) fn spawn(signal: &str, cleanup_dir: Option<&Path>) -> std::io::Result<Guardian> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("cdc-relay-guardian")
            .arg(signal)
            .arg(cleanup_dir.map(Path::as_os_str).unwrap_or_default())
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take();
        Ok(Guardian { child, stdin })
    }

    /// From now on, `pid` is the process to end if we die.
    pub(crate) fn watch(&mut self, pid: u32) {
        self.send(&format!("pid {pid}"));
    }

    /// The watched process is gone (about to be reaped): end nothing.
    pub(crate) fn forget(&mut self) {
        self.send("none");
    }

    fn send(&mut self, line: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            // A dead guardian cannot be helped from here; the owner's own
            // cleanup still runs.
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + EXIT_BOUND;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// True once the child with `pid` has exited, without reaping it, so its pid
/// cannot be reused until the owner has told its guardian to [`Guardian::forget`] it.
pub(crate) fn has_exited(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return true;
    };
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    // ECHILD (already reaped, or not our child) counts as exited.
    !matches!(
        waitid(Id::Pid(Pid::from_raw(raw)), flags),
        Ok(WaitStatus::StillAlive)
    )
}
