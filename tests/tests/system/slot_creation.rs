//! Creating a slot waits for every transaction older than it (issue 30,
//! item 4): `setup` and `run --create-slot` say what they wait for, give up
//! after `--slot-create-timeout` leaving no backend behind, and a slot
//! still being created is reported as such, never as existing. On a
//! cluster of the test's own: its open transaction would hold every other
//! test's slot creation.

use std::time::Duration;

use harness::app::{self, CommandOutput};
use harness::sink::ScriptedSink;
use harness::{ClusterOptions, PgCluster, ServiceProcess, Stack, bins, wait_until};
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(30);

/// A transaction left open with a transaction id (an uncommitted insert),
/// as an idle application session leaves it: its backend's pid.
async fn open_transaction(stack: &Stack) -> anyhow::Result<(Client, i32)> {
    let db = harness::connect(&format!(
        "{}?application_name=forgotten-session",
        stack.orders_admin_url
    ))
    .await?;
    let pid: i32 = db.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    db.batch_execute(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES (gen_random_uuid(), 1, 'EUR')",
    )
    .await?;
    Ok((db, pid))
}

/// The slot's row, if any: (active, confirmed_flush_lsn is NULL).
async fn slot_row(db: &Client, slot: &str) -> anyhow::Result<Option<(bool, bool)>> {
    Ok(db
        .query_opt(
            "SELECT active, confirmed_flush_lsn IS NULL FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// Backends still creating a slot for the relay (its own connection's
/// application_name).
async fn creators(db: &Client) -> anyhow::Result<i64> {
    Ok(db
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cdc-relay-create-slot'",
            &[],
        )
        .await?
        .get(0))
}

fn assert_names_the_blocker(what: &str, text: &str, pid: i32) {
    assert!(
        text.contains(&format!("pid {pid} (xid "))
            && text.contains("idle in transaction")
            && text.contains("forgotten-session")
            && text.contains("INSERT INTO orders"),
        "{what} names the open transaction (pid {pid}):\n{text}"
    );
}

/// With a transaction left open: `setup --slot-create-timeout 4s` says
/// within seconds what it waits for, then gives up naming it and the
/// flag, leaving no slot and no backend; a `setup` killed mid-wait leaves
/// no backend creating it either, and while one waits a second `setup`
/// and `status` report "being created by pid N" (non-zero), never
/// "exists"; `run --create-slot` says the same as `setup`. Once the
/// transaction ends, `setup` creates the slot.
///
/// Fails without the fix: `setup` printed nothing and waited as long as
/// the transaction stayed open; killed, it left its backend creating the
/// slot, and a second `setup` answered 0 with "exists: slot …
/// confirmed_flush_lsn -".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_creation_that_waits_says_for_what_and_gives_up_leaving_nothing()
-> anyhow::Result<()> {
    let cluster = PgCluster::start(ClusterOptions::default())?;
    let stack = cluster.create_stack().await?;
    let admin = stack.orders_admin().await?;
    let (blocker, pid) = open_transaction(&stack).await?;

    let bounded = setup(&stack, &["--slot-create-timeout", "4s"]).await?;
    let text = bounded.text();
    assert!(!bounded.success(), "{text}");
    assert!(
        text.contains("creating the slot waits for"),
        "a report while it waits:\n{text}"
    );
    assert!(
        text.contains("gave up after 4s (--slot-create-timeout)")
            && text.contains("No slot was left behind"),
        "{text}"
    );
    assert_names_the_blocker("setup", &text, pid);
    assert_eq!(slot_row(&admin, &stack.slot).await?, None, "no slot left");
    wait_until("no backend creating the slot", WAIT, || async {
        creators(&admin).await.map(|n| n == 0)
    })
    .await?;

    // A setup that waits (the default bound, minutes), seen by another.
    let mut waiting = spawn_setup(&stack)?;
    wait_until("the slot listed, being created", WAIT, || async {
        slot_row(&admin, &stack.slot)
            .await
            .map(|r| r == Some((true, true)))
    })
    .await?;
    let creator: i32 = admin
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&stack.slot],
        )
        .await?
        .get(0);
    let being_created = format!("is being created by pid {creator}");
    let second = setup(&stack, &[]).await?;
    assert_reports_being_created("a second setup", &second, &being_created, pid);
    let status = app::relay_command(&stack, &stack.relay_url, &["status"], &[]).await?;
    assert_reports_being_created("status", &status, &being_created, pid);
    assert_eq!(status.code(), Some(3), "{}", status.text());
    // `run` without --create-slot finds it too: a WARN, and it retries.
    let sink = ScriptedSink::start().await?;
    let mut argv = app::relay_globals(&stack);
    argv.extend(
        [
            "run",
            "--sink-url",
            &sink.url,
            "--admin-listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut early = ServiceProcess::spawn(
        bins::path("cdc-relay"),
        &argv,
        &[
            ("CDC_RELAY_DATABASE_URL", stack.relay_url.as_str()),
            ("EVENT_SECRET", app::TEST_SECRET),
        ],
    )?;
    early
        .wait_for_line_where(
            "run's WARN that the slot is being created",
            |l| l.contains("WARN") && l.contains(&being_created),
            WAIT,
        )
        .await?;
    assert!(
        early.try_status().is_none(),
        "run retries: {}",
        early.logs()
    );
    early.sigkill();
    // The waiting setup repeats its report while the wait lasts.
    wait_until("the waiting setup's second report", WAIT, || async {
        waiting
            .logs()
            .matches("creating the slot waits for")
            .count()
            >= 2
    })
    .await?;
    assert_names_the_blocker("the repeated report", &waiting.logs(), pid);
    waiting.sigkill();
    waiting.wait_exit(WAIT).await?;
    wait_until(
        "the killed setup's backend gone, and its slot",
        WAIT,
        || async {
            let gone =
                creators(&admin).await? == 0 && slot_row(&admin, &stack.slot).await?.is_none();
            Ok::<_, anyhow::Error>(gone)
        },
    )
    .await?;

    // `run --create-slot` waits alike, and says so.
    let mut run = app::start_relay(
        &stack,
        &sink.url,
        &["--create-slot", "--slot-create-timeout", "4s"],
    )
    .await?;
    run.process
        .wait_for_line("creating the slot waits for", WAIT)
        .await?;
    // Alive (/healthz) but not ready while the slot is being created.
    let (ready, why) = run.get("/readyz").await?;
    assert_eq!(ready, 503, "/readyz while creating the slot: {why}");
    let exit = run.process.wait_exit(WAIT).await?;
    let logs = run.process.logs();
    assert!(!exit.success(), "{logs}");
    assert!(
        logs.contains("creating the slot waits for") && logs.contains("--slot-create-timeout"),
        "{logs}"
    );
    assert_names_the_blocker("run --create-slot", &logs, pid);
    wait_until("no backend left by run", WAIT, || async {
        creators(&admin).await.map(|n| n == 0)
    })
    .await?;

    // Cancelled on the server (pg_cancel_backend, or a signal to its
    // backend): said so (it was blamed on --slot-create-timeout, which had
    // not run out).
    let mut cancelled = spawn_setup(&stack)?;
    cancelled
        .wait_for_line("creating the slot waits for", WAIT)
        .await?;
    admin
        .execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'cdc-relay-create-slot'",
            &[],
        )
        .await?;
    let exit = cancelled.wait_exit(WAIT).await?;
    let logs = cancelled.logs();
    assert!(
        !exit.success()
            && logs.contains("was cancelled on the server")
            && !logs.contains("gave up after"),
        "{logs}"
    );

    blocker.batch_execute("COMMIT").await?;
    let done = setup(&stack, &[]).await?;
    assert!(
        done.success() && done.stdout.contains("created: slot"),
        "{}",
        done.text()
    );
    Ok(())
}

fn assert_reports_being_created(
    what: &str,
    out: &CommandOutput,
    being_created: &str,
    blocker: i32,
) {
    let text = out.text();
    assert!(!out.success(), "{what}: {text}");
    assert!(text.contains(being_created), "{what}: {text}");
    assert!(!text.contains("exists: slot"), "{what}: {text}");
    assert_names_the_blocker(what, &text, blocker);
}

/// `cdc-relay setup <args>` as the administrator, run to completion.
async fn setup(stack: &Stack, args: &[&str]) -> anyhow::Result<CommandOutput> {
    let args: Vec<&str> = [&["setup"][..], args].concat();
    app::relay_command(stack, &stack.orders_admin_url, &args, &[]).await
}

/// `cdc-relay setup` as a process of its own, left waiting.
fn spawn_setup(stack: &Stack) -> anyhow::Result<ServiceProcess> {
    let mut argv = app::relay_globals(stack);
    argv.push("setup".into());
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    ServiceProcess::spawn(
        bins::path("cdc-relay"),
        &argv,
        &[("CDC_RELAY_DATABASE_URL", stack.orders_admin_url.as_str())],
    )
}

/// A prepared transaction left behind (two-phase commit, never committed
/// or rolled back) holds its transaction id, so slot creation waits for it;
/// no backend holds it, and `pg_blocking_pids` shows it as pid 0. `setup`
/// names it by its gid, with the command that ends it; once it is rolled
/// back, `setup` creates the slot.
///
/// Failed before: "waits for transactions older than the slot to end
/// (none visible to this role)", even as a superuser.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_prepared_transaction_is_named_by_its_gid() -> anyhow::Result<()> {
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![("max_prepared_transactions".into(), "5".into())],
        ..ClusterOptions::default()
    })?;
    let stack = cluster.create_stack().await?;
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute("BEGIN; SELECT txid_current(); PREPARE TRANSACTION 'forgotten_2pc'")
        .await?;
    let bounded = setup(&stack, &["--slot-create-timeout", "4s"]).await?;
    let text = bounded.text();
    assert!(
        !bounded.success()
            && text.contains("prepared transaction \"forgotten_2pc\"")
            && text.contains("ROLLBACK PREPARED 'forgotten_2pc'")
            && !text.contains("none visible"),
        "{text}"
    );
    admin
        .batch_execute("ROLLBACK PREPARED 'forgotten_2pc'")
        .await?;
    let created = setup(&stack, &[]).await?;
    assert!(created.success(), "{}", created.text());
    Ok(())
}
