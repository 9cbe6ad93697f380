//! Bounded polling: every wait in the tests goes through [`wait_until`], so
//! none can hang and each timeout says what it was waiting for.

use std::future::Future;
use std::time::Duration;

use anyhow::bail;

/// How often [`wait_until`] polls.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What a polled condition may return: a plain `bool`, or an
/// `anyhow::Result<bool>` whose errors count as "not yet" (the last one is
/// quoted if the wait times out).
pub trait Condition {
    /// `Ok(true)` when the condition holds.
    fn into_result(self) -> anyhow::Result<bool>;
}

impl Condition for bool {
    fn into_result(self) -> anyhow::Result<bool> {
        Ok(self)
    }
}

impl Condition for anyhow::Result<bool> {
    fn into_result(self) -> anyhow::Result<bool> {
        self
    }
}

/// Calls `f` every 20 ms until it yields true; after `timeout` fails with an
/// error naming `what` (and the last error `f` returned, if any).
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Condition,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match f().await.into_result() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(err) => last_error = Some(err),
        }
        if tokio::time::Instant::now() >= deadline {
            match last_error {
                Some(err) => {
                    bail!("timed out after {timeout:?} waiting for {what} (last error: {err:#})")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::wait_until;

    #[tokio::test]
    async fn timeout_error_names_what_it_waited_for() {
        let err = wait_until(
            "the moon to turn blue",
            Duration::from_millis(50),
            || async { false },
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("the moon to turn blue"), "{err}");
    }

    #[tokio::test]
    async fn returns_once_the_condition_holds_and_quotes_errors() {
        let mut calls = 0;
        wait_until("three calls", Duration::from_secs(1), || {
            calls += 1;
            let done = calls >= 3;
            async move { Ok::<bool, anyhow::Error>(done) }
        })
        .await
        .unwrap();
        assert_eq!(calls, 3);

        let err = wait_until("a failing probe", Duration::from_millis(100), || async {
            Err::<bool, _>(anyhow::anyhow!("connection refused"))
        })
        .await
        .unwrap_err();
        assert!(err.to_string().contains("connection refused"), "{err}");
    }
}
