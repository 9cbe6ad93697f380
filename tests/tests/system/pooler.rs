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

/// `setup` (as `admin`: its URL and extra flags), then `status` and `run`
/// (as `relay`) each exit 2, and `said(command, output)` checks what each
/// printed; returns `run`'s log.
async fn each_command_exits_2(
    stack: &Stack,
    admin: (&str, &[&str]),
    relay: (&str, &[&str]),
    sink_url: &str,
    said: impl Fn(&str, &str),
) -> anyhow::Result<String> {
    for (command, (url, extra)) in [("setup", admin), ("status", relay)] {
        let out = app::relay_command(stack, url, &[&[command][..], extra].concat(), &[]).await?;
        assert_eq!(out.code(), Some(2), "{command}: {}", out.text());
        said(command, &out.text());
    }
    let mut run = app::start_relay_with_url(stack, relay.0, sink_url, relay.1).await?;
    let exit = run.process.wait_exit(EXIT).await?;
    let logs = run.process.logs();
    assert_eq!(exit.code(), Some(2), "run: {logs}");
    said("run", &logs);
    Ok(logs)
}

/// `url` with `database` as its path, or `password` as its password.
fn with_database(url: &str, database: &str) -> anyhow::Result<String> {
    let mut u = reqwest::Url::parse(url)?;
    u.set_path(&format!("/{database}"));
    Ok(u.into())
}

fn with_password(url: &str, password: &str) -> anyhow::Result<String> {
    let mut u = reqwest::Url::parse(url)?;
    u.set_password(Some(password))
        .map_err(|()| anyhow::anyhow!("cannot set a password on {url:?}"))?;
    Ok(u.into())
}

/// The side connection through PgBouncer in transaction mode, the stream
/// direct: `setup`, `status` and `run` each exit 2 saying the pool is in
/// transaction mode (two of the relay's connections were one server
/// backend), `run` before streaming and without a reconnect. A wrong
/// password through the pooler (PgBouncer answers 08P01, not 28P01) ends
/// `run` with the hint about the password and the pooler's auth file,
/// naming the flag whose URL was refused (with `--replication-url` set,
/// there are two),
/// not a reconnect loop.
///
/// Fails without the fix: with no other clients `run` streamed silently
/// through the transaction pool (and under load exited 1 at random with
/// `prepared statement "s2" does not exist`), and the wrong password was
/// retried at WARN as a "replication session failed" until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pool_and_a_password_it_refuses_are_named_not_retried() -> anyhow::Result<()>
{
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let (relay_user, relay_password) = credentials(&stack.relay_url)?;
    let (admin_user, admin_password) = credentials(&stack.orders_admin_url)?;
    let users = [
        (relay_user.as_str(), relay_password.as_str()),
        (admin_user.as_str(), admin_password.as_str()),
    ];
    let pooler = Pooler::start(cluster, PoolMode::Transaction, &users, &[]).await?;
    let sink = ScriptedSink::start().await?;
    let said = |what: &str, out: &str| {
        assert!(
            // The evidence is the probe's sighting, or a statement
            // prepared by an earlier client gone missing on a shared
            // backend: either names the mode and the fix.
            out.contains("transaction or statement mode")
                && (out.contains("one server backend") || out.contains("prepared statement"))
                && out.contains("pool_mode = session"),
            "{what}: {out}"
        );
    };

    let side = pooler.url(&stack.relay_url)?;
    let direct = ["--replication-url", stack.relay_url.as_str()];
    let logs = each_command_exits_2(
        &stack,
        (
            &pooler.url(&stack.orders_admin_url)?,
            &["--replication-url", stack.orders_admin_url.as_str()],
        ),
        (&side, &direct),
        &sink.url,
        said,
    )
    .await?;
    assert!(
        !logs.contains("reconnecting") && !logs.lines().any(app::is_session_start),
        "run: {logs}"
    );

    let wrong = with_password(&side, "not-the-password")?;
    let mut run = app::start_relay_with_url(&stack, &wrong, &sink.url, &direct).await?;
    let exit = run.process.wait_exit(EXIT).await?;
    let logs = run.process.logs();
    assert_eq!(exit.code(), Some(1), "run with a wrong password: {logs}");
    assert!(
        logs.contains("authentication failed")
            && logs.contains("auth_file")
            && logs.contains("(--database-url (CDC_RELAY_DATABASE_URL))")
            && !logs.contains("reconnecting"),
        "run with a wrong password: {logs}"
    );
    assert!(sink.received().is_empty(), "delivered through the pool");
    Ok(())
}

/// A `--replication-url` naming another database of the same server, or
/// with a password the server refuses: `setup`, `status` and `run` say so
/// naming the flag (exit 2 for the other database, read from the server's
/// own answers), instead of a raw error, a misleading "slot does not
/// exist" (exit 3), or a slot made in one database and streamed from
/// another.
///
/// Fails without the check: `status` and `setup` never opened the
/// replication URL (a wrong password passed; setup created the slot in
/// the side connection's database), and `run` exited 1 or 3 with the
/// server's raw words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_url_to_another_database_or_with_a_bad_password_is_named()
-> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    // Another database on the same server that the relay's role may enter.
    let other = format!("{}_other", stack.orders_db);
    let (relay_user, _) = credentials(&stack.relay_url)?;
    let superuser = cluster.connect_superuser("postgres").await?;
    superuser
        .batch_execute(&format!("CREATE DATABASE {other}"))
        .await?;
    superuser
        .batch_execute(&format!(
            "GRANT CONNECT ON DATABASE {other} TO {relay_user}"
        ))
        .await?;
    let other_db = with_database(&stack.relay_url, &other)?;
    let admin_other_db = with_database(&stack.orders_admin_url, &other)?;
    let differ = |what: &str, out: &str| {
        assert!(
            out.contains("reach different servers or databases")
                && out.contains(&format!("database {other} "))
                && out.contains(&format!("database {}", stack.orders_db)),
            "{what}: {out}"
        );
    };

    each_command_exits_2(
        &stack,
        (
            &stack.orders_admin_url,
            &["--replication-url", admin_other_db.as_str()],
        ),
        (&stack.relay_url, &["--replication-url", other_db.as_str()]),
        &sink.url,
        differ,
    )
    .await?;

    let refused = with_password(&stack.relay_url, "not-the-password")?;
    let status = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--replication-url", refused.as_str()],
        &[],
    )
    .await?;
    let text = status.text();
    assert!(
        status.code() != Some(0)
            && text.contains("--replication-url")
            && text.contains("password authentication failed")
            && !text.contains("not-the-password"),
        "status: {text}"
    );
    assert!(
        sink.received().is_empty(),
        "delivered from the other database"
    );
    Ok(())
}

/// `status` through a session-mode pool whose server connections are all
/// taken (PgBouncer queues the newcomer) answers within twice the connect
/// timeout, saying the login did not complete and what makes a server or a
/// pooler do that, instead of hanging with nothing printed.
///
/// Fails without the bound: `status` printed nothing for 40 s (until
/// PgBouncer's `query_wait_timeout`, 120 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_through_a_full_pool_says_why_it_cannot_answer() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let (user, password) = credentials(&stack.relay_url)?;
    let pooler = Pooler::start(cluster, PoolMode::Session, &[(&user, &password)], &[]).await?;
    let side = pooler.url(&stack.relay_url)?;
    // The pool's four server connections, each held by a session.
    let mut held = Vec::new();
    for _ in 0..4 {
        let (client, connection) = tokio_postgres::connect(&side, tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        client.batch_execute("SELECT 1").await?;
        held.push(client);
    }
    let started = std::time::Instant::now();
    let status = app::relay_command(
        &stack,
        &side,
        &[
            "status",
            "--replication-url",
            stack.relay_url.as_str(),
            "--connect-timeout",
            "2s",
        ],
        &[],
    )
    .await?;
    let took = started.elapsed();
    let text = status.text();
    assert!(
        status.code() == Some(1)
            && text.contains("did not complete within 4s")
            && text.contains("pooler with no free server connection"),
        "{text}"
    );
    assert!(
        took < Duration::from_secs(30),
        "status took {took:?}: {text}"
    );
    drop(held);
    Ok(())
}

/// `--replication-url` naming a copy of the server: the same system
/// identifier and database names, so those cannot tell them apart.
///
/// - A promoted standby is on a later timeline: `setup`, `status` and
///   `run` each exit 2 at start saying the URLs reach different servers,
///   one a promoted or restored copy of the other, and no slot is made on
///   the copy. (`status` answered from the copy's slots, exit 0 or 8.)
/// - A copy started on its own from a base backup (no promotion: the same
///   timeline) passes that check; `setup` creates the slot there, then
///   finds it missing on `--database-url`'s server and exits 2 with the
///   slot to drop. (setup answered 0, "created: slot …", while the slot
///   was only on the copy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_url_to_a_copy_of_the_server_exits_2() -> anyhow::Result<()> {
    let primary = PgCluster::start(ClusterOptions::default())?;
    let stack = primary.create_stack().await?;
    app::relay_setup(&stack).await?;
    let on = |url: &str, port: u16| -> anyhow::Result<String> {
        let mut u = reqwest::Url::parse(url)?;
        u.set_port(Some(port))
            .map_err(|()| anyhow::anyhow!("a port"))?;
        Ok(u.into())
    };

    let promoted = primary.start_standby(harness::standby::StandbyOptions::default())?;
    promoted.catch_up(&primary).await?;
    promoted.promote()?;
    let (admin_there, relay_there) = (
        on(&stack.orders_admin_url, promoted.port())?,
        on(&stack.relay_url, promoted.port())?,
    );
    let sink = ScriptedSink::start().await?;
    each_command_exits_2(
        &stack,
        (
            &stack.orders_admin_url,
            &[
                "--slot",
                "made_on_the_copy",
                "--replication-url",
                &admin_there,
            ],
        ),
        (&stack.relay_url, &["--replication-url", &relay_there]),
        &sink.url,
        |command, text| {
            assert!(
                text.contains("reach different servers")
                    && text.contains("promoted or restored copy"),
                "{command}: {text}"
            );
        },
    )
    .await?;
    let made = promoted.psql(
        &stack.orders_db,
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'made_on_the_copy'",
    )?;
    assert_eq!(made, "0", "no slot is made on the promoted copy");

    let copy = primary.start_standby(harness::standby::StandbyOptions::default())?;
    copy.catch_up(&primary).await?;
    copy.stop(harness::StopMode::Fast)?;
    std::fs::remove_file(copy.data_dir().join("standby.signal"))?;
    copy.start_again()?;
    let to_copy = on(&stack.orders_admin_url, copy.port())?;
    let slot = "made_on_the_copy";
    let setup = app::relay_command(
        &stack,
        &stack.orders_admin_url,
        &["setup", "--slot", slot, "--replication-url", &to_copy],
        &[],
    )
    .await?;
    let text = setup.text();
    assert!(
        setup.code() == Some(2)
            && text.contains("reach different servers")
            && text.contains("pg_drop_replication_slot('made_on_the_copy')"),
        "{text}"
    );
    Ok(())
}

/// A pool switched from session to transaction mode (PgBouncer reloaded)
/// under a running relay whose side connection goes through it: once other
/// clients share the pool's backends, the relay's statements land on
/// another backend, and the relay ends with exit 2 naming the switch
/// (`pool_mode = session`), instead of running on with its session state
/// (prepared statements, `lock_timeout`) gone.
///
/// Fails without the check: the relay ran on until a statement it had
/// prepared went missing (exit 2 by that symptom, at random under load),
/// or silently while no statement broke.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_switched_to_transaction_mode_under_the_relay_exits_2() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let (user, password) = credentials(&stack.relay_url)?;
    let mut pooler = Pooler::start(cluster, PoolMode::Session, &[(&user, &password)], &[]).await?;
    let side = pooler.url(&stack.relay_url)?;
    let sink = ScriptedSink::start().await?;
    let mut relay = app::start_relay_with_url(
        &stack,
        &side,
        &sink.url,
        &[
            "--replication-url",
            stack.relay_url.as_str(),
            "--slot-stats-interval",
            "1s",
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?.to_string();
    wait_until("the event delivered", EXIT, || async {
        sink.delivered().iter().any(|r| r.id() == event)
    })
    .await?;

    pooler.switch_mode(PoolMode::Transaction).await?;
    // Other clients of the same pool, each a tight loop of one-statement
    // transactions: a backend the relay's side connection released is the
    // most recently released one, which PgBouncer hands to the next of
    // them, so the relay's next statement lands on another backend.
    let mut others = Vec::new();
    for _ in 0..2 {
        let (client, connection) = tokio_postgres::connect(&side, tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        others.push(tokio::spawn(async move {
            while client.simple_query("SELECT 1").await.is_ok() {}
        }));
    }
    let exit = relay.process.wait_exit(EXIT).await;
    others.iter().for_each(tokio::task::JoinHandle::abort);
    let exit = exit?;
    let logs = relay.process.logs();
    assert_eq!(exit.code(), Some(2), "{logs}");
    assert!(
        // The monitor's sighting, or its statement gone missing between
        // its prepare and its run: both name the mode and the fix.
        (logs.contains("two server backends") || logs.contains("prepared statement"))
            && logs.contains("transaction or statement mode")
            && logs.contains("pool_mode = session"),
        "{logs}"
    );
    Ok(())
}
