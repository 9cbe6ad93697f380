//! PgBouncer (Debian's package) in front of the database: a URL that
//! reaches a pooler is named for what it is, in `run`, `setup` and
//! `status`, with exit 2, not retried (issue 30, item 3).

use std::time::Duration;

use anyhow::Context;

use harness::app::{self, CommandOutput};
use harness::pooler::{PoolMode, Pooler};
use harness::sink::ScriptedSink;
use harness::{ClusterOptions, PgCluster, Stack, wait_until};

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

/// The side connection through PgBouncer in session mode while the stream
/// goes straight to PostgreSQL (`--replication-url`): `status` does not
/// refuse the pooler, `run` streams and delivers with its SQL session
/// logged in at PgBouncer, and a `--replication-url` that itself reaches
/// the pooler exits 2 naming that flag.
///
/// Fails without the fix: there was no `--replication-url` (exit 2,
/// "unexpected argument"), so a side connection through a pooler could not
/// be paired with a direct stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_side_connection_through_a_session_pooler_and_the_stream_direct_deliver()
-> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let (user, password) = credentials(&stack.relay_url)?;
    let pooler = Pooler::start(cluster, PoolMode::Session, &[(&user, &password)], &[]).await?;
    let side = pooler.url(&stack.relay_url)?;
    let direct = ["--replication-url", stack.relay_url.as_str()];
    let sink = ScriptedSink::start().await?;

    let status =
        app::relay_command(&stack, &side, &[&["status"][..], &direct].concat(), &[]).await?;
    assert!(
        status.code() != Some(2) && !status.text().contains("pooler or proxy"),
        "status with the stream direct: {}",
        status.text()
    );

    let mut pooled = app::start_relay_with_url(
        &stack,
        &side,
        &sink.url,
        &["--replication-url", side.as_str()],
    )
    .await?;
    let exit = pooled.process.wait_exit(EXIT).await?;
    let logs = pooled.process.logs();
    assert_eq!(
        exit.code(),
        Some(2),
        "the stream through the pooler: {logs}"
    );
    assert!(
        logs.contains("pooler or proxy that does not carry replication connections")
            && logs.contains("--replication-url"),
        "{logs}"
    );

    let relay = app::start_relay_with_url(&stack, &side, &sink.url, &direct).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?.to_string();
    wait_until(
        "the event delivered with the side connection pooled",
        EXIT,
        || async { sink.delivered().iter().any(|r| r.id() == event) },
    )
    .await?;
    let seen = pooler.logs();
    assert!(
        seen.contains("login attempt") && seen.contains(&stack.orders_db),
        "PgBouncer did not carry the side connection:\n{seen}"
    );
    Ok(())
}

/// A `--replication-url` that reaches another server than `--database-url`
/// (one with a slot and publication of the same names) is a configuration
/// error: the stream starts there, the side connection's server shows no
/// walsender of this relay holding the slot, and `run` exits 2 naming both
/// flags, before delivering anything.
///
/// Fails without the check: the relay streamed from the other server while
/// it read the slot, wrote its progress and its dead letters on the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_url_reaching_another_server_exits_2() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let other = PgCluster::start(ClusterOptions::default())?;
    let elsewhere = other.create_stack().await?;
    // The other server gets a slot and publication named as this stack's.
    let admin = other.connect_superuser(&elsewhere.orders_db).await?;
    admin
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {0}; CREATE PUBLICATION {0} FOR TABLE outbox",
            stack.publication
        ))
        .await
        .context("a publication named as the stack's on the other server")?;
    admin
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&stack.slot],
        )
        .await
        .context("a slot named as the stack's on the other server")?;
    let sink = ScriptedSink::start().await?;
    let mut relay = app::start_relay(
        &stack,
        &sink.url,
        &["--replication-url", elsewhere.relay_url.as_str()],
    )
    .await?;
    let exit = relay.process.wait_exit(EXIT).await?;
    let logs = relay.process.logs();
    assert_eq!(exit.code(), Some(2), "{logs}");
    assert!(
        logs.contains("reach different servers")
            && logs.contains("--replication-url")
            && logs.contains("--database-url"),
        "{logs}"
    );
    assert!(
        sink.received().is_empty(),
        "delivered from the other server"
    );
    Ok(())
}
