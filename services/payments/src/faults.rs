//! Fault injection, for tests only (every hook is off by default and logs
//! a warning when on): the ways a real provider fails a client.
//!
//! | hook | when | what the client sees | charged? |
//! |---|---|---|---|
//! | `--fault-fail-ratio R` | before anything | 503 `fault_injected` | no |
//! | `--fault-delay D` | after the commit, before answering | a slow answer (its timeout, maybe) | yes |
//! | `--fault-drop-after-commit-ratio R` | after the commit | the connection closed, no status line | yes |
//! | `--fault-exit-after-commit` | after the first new charge commits | the process gone, no answer | yes |
//!
//! The last three are the answer lost after the effect happened: only an
//! `Idempotency-Key` lets the client's retry find the first charge instead
//! of making a second one.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;

/// Exit status of `--fault-exit-after-commit`.
pub const EXIT_AFTER_COMMIT_STATUS: i32 = 86;

/// The hooks as flags (`PAYMENTS_FAULT_*` variables too).
#[derive(Debug, Clone, clap::Args)]
pub struct FaultArgs {
    /// TEST HOOK: this share of `POST /charges` (0 to 1) is answered 503
    /// `fault_injected` before anything is charged.
    #[arg(long, default_value_t = 0.0, value_parser = ratio)]
    pub fault_fail_ratio: f64,
    /// TEST HOOK: this share of answers (0 to 1) is never sent: the charge
    /// is committed (or replayed), then the connection is closed.
    #[arg(long, default_value_t = 0.0, value_parser = ratio)]
    pub fault_drop_after_commit_ratio: f64,
    /// TEST HOOK: wait this long after the commit before answering.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub fault_delay: Duration,
    /// TEST HOOK: exit (status 86) right after the first new charge
    /// commits, before answering: the provider killed between its charge
    /// and its answer.
    #[arg(long, action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub fault_exit_after_commit: bool,
}

fn ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{text:?} is not a ratio between 0 and 1")),
    }
}

/// The hooks in force.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    fail_ratio: f64,
    drop_ratio: f64,
    delay: Duration,
    exit_after_commit: bool,
}

/// What to do with an answer after the commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Send it.
    Answer,
    /// Close the connection instead.
    Drop,
    /// Exit the process.
    Exit,
}

impl Faults {
    /// The hooks the flags ask for.
    pub fn new(args: &FaultArgs) -> Faults {
        Faults {
            fail_ratio: args.fault_fail_ratio,
            drop_ratio: args.fault_drop_after_commit_ratio,
            delay: args.fault_delay,
            exit_after_commit: args.fault_exit_after_commit,
        }
    }

    /// No hook is on.
    pub fn is_off(&self) -> bool {
        self.fail_ratio == 0.0
            && self.drop_ratio == 0.0
            && self.delay.is_zero()
            && !self.exit_after_commit
    }

    /// Whether this request fails before anything happens.
    pub fn fail_before(&self) -> bool {
        hit(self.fail_ratio)
    }

    /// After the commit (`fresh`: a new charge, not a replay): waits
    /// `--fault-delay`, then says what becomes of the answer.
    pub async fn after(&self, fresh: bool) -> After {
        if fresh && self.exit_after_commit {
            return After::Exit;
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        match hit(self.drop_ratio) {
            true => After::Drop,
            false => After::Answer,
        }
    }
}

fn hit(ratio: f64) -> bool {
    ratio > 0.0 && rand::random::<f64>() < ratio
}

/// A response that closes the connection without a status line: its body
/// fails before its first byte, and hyper then drops the connection with
/// the head still unsent.
pub fn dropped_connection() -> Response {
    let failing = futures::stream::once(async {
        Err::<bytes::Bytes, _>(std::io::Error::other(
            "test hook: the answer is dropped after the commit",
        ))
    });
    Response::new(Body::from_stream(failing))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults(fail: f64, drop: f64, exit: bool) -> Faults {
        Faults::new(&FaultArgs {
            fault_fail_ratio: fail,
            fault_drop_after_commit_ratio: drop,
            fault_delay: Duration::ZERO,
            fault_exit_after_commit: exit,
        })
    }

    #[tokio::test]
    async fn ratios_of_zero_and_one_never_and_always_hit() {
        let never = faults(0.0, 0.0, false);
        let always = faults(1.0, 1.0, false);
        for _ in 0..100 {
            assert!(!never.fail_before());
            assert!(always.fail_before());
            assert_eq!(never.after(true).await, After::Answer);
            assert_eq!(always.after(true).await, After::Drop);
        }
    }

    #[tokio::test]
    async fn exit_only_after_a_new_charge() {
        let exit = faults(0.0, 0.0, true);
        assert_eq!(exit.after(true).await, After::Exit);
        assert_eq!(exit.after(false).await, After::Answer);
    }
}
