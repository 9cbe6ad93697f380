//! A service that cannot start on its settings says which one, and
//! exits without listening.

use std::time::Duration;

use ::harness::{ServiceProcess, Stack, bins};

use super::stack;

/// Billing started on `stack`'s database with `env`, waited for until it
/// exits (it must, within 20 s).
async fn billing_exited(
    stack: &Stack,
    env: &[(&str, &str)],
) -> (ServiceProcess, std::process::ExitStatus) {
    let mut process = ServiceProcess::spawn(
        bins::path("billing"),
        &[
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &stack.billing_app_url,
        ],
        env,
    )
    .unwrap();
    let status = process.wait_exit(Duration::from_secs(20)).await.unwrap();
    (process, status)
}

#[tokio::test]
async fn billing_refuses_to_start_without_a_secret_naming_the_setting() {
    let stack = stack().await;
    let (process, status) = billing_exited(&stack, &[("EVENT_SECRET", "  ")]).await;
    assert!(!status.success(), "{status:?}");
    let line = process
        .wait_for_line("no event secret configured", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(line.contains("EVENT_SECRET"), "{line}");
    let logs = process.logs();
    assert!(!logs.contains(::harness::process::LISTENING), "{logs}");
}

/// A bad value from the environment (`BILLING_POOL_SIZE=abc` in an env
/// file) is named by its variable: clap names only the flag, which the
/// command line never had. Exit 2.
#[tokio::test]
async fn a_bad_value_from_the_environment_is_named_by_its_variable() {
    let stack = stack().await;
    let (process, status) = billing_exited(
        &stack,
        &[
            ("EVENT_SECRET", "a-secret-of-some-length"),
            ("BILLING_POOL_SIZE", "abc"),
        ],
    )
    .await;
    assert_eq!(status.code(), Some(2), "{status:?}");
    let line = process
        .wait_for_line("BILLING_POOL_SIZE", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        line.contains(
            "the value came from the environment variable BILLING_POOL_SIZE (--pool-size was not given)"
        ),
        "{}",
        process.logs()
    );
}
