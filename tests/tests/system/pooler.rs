//! PgBouncer (Debian's package) in front of the database: a URL that
//! reaches a pooler is named for what it is, in `run`, `setup` and
//! `status`, with exit 2, not retried (issue 30, item 3).

use std::time::Duration;

use harness::app::{self, CommandOutput};
use harness::pooler::{PoolMode, Pooler};
use harness::sink::ScriptedSink;
use harness::{PgCluster, Stack, wait_until};

/// Bound for `run` to give up on a pooler: its first replication connect.
const EXIT: Duration = Duration::from_secs(30);

/// The role and password of a stack URL.
fn credentials(url: &str) -> anyhow::Result<(String, String)> {
    let u = reqwest::Url::parse(url)?;
    let password = u.password().unwrap_or_default().to_owned();
    Ok((u.username().to_owned(), password))
}

/// What every refusal says: the pooler, and that the relay must reach
/// PostgreSQL itself, with the flag to change.
fn assert_names_the_pooler(what: &str, out: &CommandOutput) {
    let text = out.text();
    assert_eq!(out.code(), Some(2), "{what}: {text}");
    assert!(
        text.contains("pooler or proxy that does not carry replication connections")
            && text.contains("PostgreSQL itself")
            && text.contains("--database-url"),
        "{what}: {text}"
    );
}

/// Through PgBouncer in session and transaction mode (refusing the
/// `replication` startup parameter, as by default), and through one that
/// drops the parameter and passes a normal session on (the server then
/// refuses the replication command as SQL): `setup` as the administrator,
/// `status` and `run` as the relay role each exit 2 naming the pooler;
/// `run` without a single reconnect. The same stack straight to
/// PostgreSQL delivers.
///
/// Fails without the fix: `run` reconnected at WARN with
/// "unsupported startup parameter: replication" (cause transient) until
/// killed, and `setup` answered 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_in_front_is_named_with_exit_2_never_retried() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let (relay_user, relay_password) = credentials(&stack.relay_url)?;
    let (admin_user, admin_password) = credentials(&stack.orders_admin_url)?;
    let users = [
        (relay_user.as_str(), relay_password.as_str()),
        (admin_user.as_str(), admin_password.as_str()),
    ];
    let sink = ScriptedSink::start().await?;
    for (mode, ignored) in [
        (PoolMode::Session, &[][..]),
        (PoolMode::Transaction, &[][..]),
        (PoolMode::Session, &["replication"][..]),
    ] {
        let pooler = Pooler::start(cluster, mode, &users, ignored).await?;
        let what =
            |command: &str| format!("{command} through PgBouncer ({mode:?}, ignoring {ignored:?})");
        let setup = app::relay_command(
            &stack,
            &pooler.url(&stack.orders_admin_url)?,
            &["setup"],
            &[],
        )
        .await?;
        assert_names_the_pooler(&what("setup"), &setup);
        let relay_url = pooler.url(&stack.relay_url)?;
        for args in [&["status"][..], &["status", "--json"]] {
            let status = app::relay_command(&stack, &relay_url, args, &[]).await?;
            assert_names_the_pooler(&what("status"), &status);
        }
        let mut run = app::start_relay_with_url(&stack, &relay_url, &sink.url, &[]).await?;
        let exit = run.process.wait_exit(EXIT).await?;
        let logs = run.process.logs();
        assert_eq!(exit.code(), Some(2), "{}: {logs}", what("run"));
        assert!(
            logs.contains("pooler or proxy that does not carry replication connections"),
            "{}: {logs}",
            what("run")
        );
        assert!(
            !logs.contains("reconnecting"),
            "{}: retried\n{logs}",
            what("run")
        );
        assert!(
            pooler.logs().contains("replication") || !ignored.is_empty(),
            "PgBouncer saw the replication connection:\n{}",
            pooler.logs()
        );
    }
    delivers_direct(&stack, &sink).await
}

/// The relay straight to PostgreSQL streams and delivers an event.
async fn delivers_direct(stack: &Stack, sink: &ScriptedSink) -> anyhow::Result<()> {
    let relay = app::start_relay(stack, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?.to_string();
    wait_until(
        "the event delivered straight from PostgreSQL",
        EXIT,
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await
}
