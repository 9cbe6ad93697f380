//! `cdc-relay backfill`: re-sending rows from the table after a lost slot,
//! the bounds it refuses, `--dry-run`, and a backfill stopped early (the
//! give-up limit, SIGINT) with the `--since` that resumes it.

use std::time::{Duration, Instant};

use harness::app::{self, TEST_SECRET};
use harness::oracle::{self, Ledger};
use harness::{Inbox, Scenario, wait_until};

use crate::sink_failures::{DRAIN, cli, insert_order_event};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_resends_what_a_lost_slot_missed() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Billing).await?;
    insert_order_event(&s.db).await?;
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;
    s.stop_relay().await?;
    let (stack, db, sink_url) = (s.stack.clone(), &s.db, s.inbox_url().to_owned());
    let since: String = db.query_one("SELECT now()::text", &[]).await?.get(0);
    for _ in 0..3 {
        insert_order_event(db).await?;
    }
    // The slot is lost; a new one starts at the current WAL position. (The
    // stopped relay's walsender may hold the slot a moment longer.)
    wait_until("the slot released", DRAIN, || async {
        let row = db
            .query_one(
                "SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&stack.slot],
            )
            .await?;
        anyhow::Ok(row.get::<_, bool>(0))
    })
    .await?;
    db.execute("SELECT pg_drop_replication_slot($1)", &[&stack.slot])
        .await?;
    // setup recreates it and, finding the old slot's progress record, says
    // events may be missing and how to re-send them.
    let setup = app::relay_setup(&stack).await?;
    assert!(
        setup.contains("a previous slot") && setup.contains("cdc-relay backfill --since"),
        "{setup}"
    );
    s.restart_relay(&[]).await?;
    // Everything committed so far is done as far as the new session goes.
    s.settle().await?;
    assert_eq!(
        Ledger::read(&stack).await?.invoices,
        1,
        "the new slot skipped them"
    );

    // A bound without a UTC offset is refused (read in the server's zone it
    // could start hours late and skip events), as is one that is no time.
    let local = since
        .trim_end_matches(|c: char| c != '.')
        .trim_end_matches('.');
    // Each is a configuration mistake: exit 2, naming what to give.
    let range = format!("--until={since}");
    let cases: [(&[&str], &str); 5] = [
        (&["--since", local], "has no UTC offset"),
        (&["--since", "yesterday-ish"], "is not a time"),
        (&["--since", "yesterday"], "'2026-11-30 10:00:00+00'"),
        (
            &["--since", &since, range.as_str()],
            "is not before --until",
        ),
        (
            &["--since", &since, "--time-column", "nope"],
            "--time-column",
        ),
    ];
    for (args, says) in cases {
        let mut argv = vec!["backfill"];
        argv.extend_from_slice(args);
        let out = cli(&stack, &argv, &sink_url).await?;
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.text());
        assert!(
            out.text().contains(says) && !out.text().contains("yesterday+00"),
            "{args:?}: says {says:?}:\n{}",
            out.text()
        );
    }
    let dry = cli(
        &stack,
        &["backfill", "--since", &since, "--dry-run"],
        &sink_url,
    )
    .await?;
    assert!(dry.success(), "{}", dry.text());
    assert!(
        dry.text().contains("3 row(s)") && dry.text().contains("nothing sent"),
        "{}",
        dry.text()
    );
    let json = cli(
        &stack,
        &["backfill", "--since", &since, "--dry-run", "--json"],
        &sink_url,
    )
    .await?;
    let v: serde_json::Value = serde_json::from_str(&json.stdout)?;
    assert_eq!(v["rows"], 3, "{v}");
    let ids: Vec<String> = s
        .db
        .query(
            "SELECT id::text FROM outbox WHERE occurred_at >= $1::text::timestamptz ORDER BY occurred_at, id",
            &[&since],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(v["first_id"], ids[0].as_str(), "{v}");
    assert_eq!(v["last_id"], ids[2].as_str(), "{v}");
    assert!(
        v["first_time"].as_str().is_some_and(|t| t.ends_with("+00")),
        "{v}"
    );
    assert_eq!(
        Ledger::read(&stack).await?.invoices,
        1,
        "a dry run sends nothing"
    );

    let out = cli(&stack, &["backfill", "--since", &since], &sink_url).await?;
    assert!(out.success(), "{}", out.text());
    assert!(out.text().contains("3 delivered"), "{}", out.text());
    let ledger = oracle::wait_ledger_clean(&stack, 4, DRAIN).await?;
    assert_eq!(ledger.invoices, 4);
    // From the beginning: everything again, all absorbed by the inbox.
    let again = cli(&stack, &["backfill", "--since=-infinity"], &sink_url).await?;
    assert!(again.text().contains("4 delivered"), "{}", again.text());
    assert!(Ledger::read(&stack).await?.is_clean());
    Ok(())
}

/// A backfill that cannot finish stops with the exact `--since` to resume
/// from: the time of the first row not done, not of the last row read. Here
/// the third of five rows is refused with 503 while the others are
/// delivered; the give-up limit stops it, the resume command finishes it,
/// and SIGINT stops one whose sink is down, with the same kind of summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_stops_with_the_since_that_resumes_it() -> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    s.stop_relay().await?;
    let (stack, db, sink) = (s.stack.clone(), &s.db, s.sink());
    let since: String = db.query_one("SELECT now()::text", &[]).await?.get(0);
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(insert_order_event(db).await?);
    }
    let time_of = |id: &str| {
        let id = id.to_owned();
        async move {
            let row = db
                .query_one(
                    "SELECT occurred_at::text FROM outbox WHERE id::text = $1",
                    &[&id],
                )
                .await?;
            anyhow::Ok(row.get::<_, String>(0))
        }
    };
    // Same instant, whatever the text's zone: compare in PostgreSQL.
    let same_instant = |a: String, b: String| async move {
        let row = db
            .query_one(
                "SELECT $1::text::timestamptz = $2::text::timestamptz",
                &[&a, &b],
            )
            .await?;
        anyhow::Ok(row.get::<_, bool>(0))
    };

    // A dry run needs no sink: neither URL nor secret.
    let dry = app::relay_command(
        &stack,
        &stack.relay_url,
        &["backfill", "--since", &since, "--dry-run"],
        &[],
    )
    .await?;
    assert!(
        dry.success() && dry.text().contains("5 row(s)"),
        "{}",
        dry.text()
    );

    sink.reject(&ids[2], 503);
    let args = [
        "backfill",
        "--since",
        &since,
        "--give-up-after",
        "2s",
        "--json",
    ];
    let started = Instant::now();
    let out = cli(&stack, &args, &sink.url).await?;
    assert_eq!(out.code(), Some(1), "{}", out.text());
    // The limit is checked every second, not on the 10 s progress line of a
    // stderr that is no terminal.
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "gave up after {:?}",
        started.elapsed()
    );
    let v: serde_json::Value =
        serde_json::from_str(&out.stdout).map_err(|e| anyhow::anyhow!("{e}: {}", out.text()))?;
    assert_eq!(v["complete"], false, "{v}");
    assert!(
        v["stopped_by"]
            .as_str()
            .is_some_and(|r| r.contains("gave up")),
        "{v}"
    );
    assert_eq!(
        (v["rows_total"].as_u64(), v["delivered"].as_u64()),
        (Some(5), Some(4)),
        "{v}"
    );
    let resume = v["resume_since"].as_str().expect("resume_since").to_owned();
    assert!(
        same_instant(resume.clone(), time_of(&ids[2]).await?).await?,
        "resume at the refused row's time: {resume} vs {}",
        time_of(&ids[2]).await?
    );
    assert!(
        v["resume_command"]
            .as_str()
            .is_some_and(|c| c == format!("cdc-relay backfill --since '{resume}'")),
        "{v}"
    );
    assert!(
        out.stderr.contains("backfill stopped: gave up"),
        "{}",
        out.text()
    );

    // The resume command sends the refused row and those after it, and ends.
    sink.clear_rejections();
    let before = sink.received().len();
    let out = cli(&stack, &["backfill", "--since", &resume], &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    assert!(out.text().contains("3 delivered"), "{}", out.text());
    assert!(
        !out.stderr.contains("is streamed by a relay"),
        "no relay streams (stopped seconds ago): {}",
        out.stderr
    );
    // (Each row is its own aggregate here, so they may arrive in any order.)
    let mut resent: Vec<String> = sink.received()[before..].iter().map(|r| r.id()).collect();
    resent.sort();
    let mut expected = ids[2..].to_vec();
    expected.sort();
    assert_eq!(resent, expected, "exactly the rows from the resume point");

    // SIGINT while the sink is down: stopped, with the first row's time.
    sink.set_status(503);
    let mut command = std::process::Command::new(harness::bins::path("cdc-relay"));
    command
        .args(app::relay_globals(&stack))
        .args(["backfill", "--since", &since])
        .env("CDC_RELAY_DATABASE_URL", &stack.relay_url)
        .env("CDC_RELAY_SINK_URL", &sink.url)
        .env("EVENT_SECRET", TEST_SECRET);
    let mut p = harness::ServiceProcess::from_command(command)?;
    p.wait_for_line("5 row(s) in", DRAIN).await?;
    wait_until("a refused attempt", DRAIN, || async {
        Ok(sink.received().len() > before + 3)
    })
    .await?;
    p.sigint();
    let status = p.wait_exit(Duration::from_secs(10)).await?;
    let logs = p.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(
        logs.contains("backfill stopped after") && logs.contains("(SIGINT)"),
        "{logs}"
    );
    let line = logs
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("resume with: cdc-relay backfill --since '")
        })
        .unwrap_or_else(|| panic!("a resume line in:\n{logs}"));
    let resume = line.trim_end_matches('\'').to_owned();
    assert!(
        same_instant(resume, time_of(&ids[0]).await?).await?,
        "{logs}"
    );
    Ok(())
}

/// A backfill beside a relay that streams the slot says so on stderr: the
/// rows it re-sends may reach the sink after newer events of the same
/// aggregates (a tester's receiver saw 800 such), and stopping the relay
/// first keeps the order. It still runs (a publication gap a relay owes is
/// backfilled beside it by design), and the inbox absorbs what it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_beside_a_streaming_relay_warns_of_the_order() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Billing).await?;
    insert_order_event(&s.db).await?;
    oracle::wait_ledger_clean(&s.stack, 1, DRAIN).await?;
    let since: String =
        s.db.query_one("SELECT (now() - interval '1 hour')::text", &[])
            .await?
            .get(0);
    let out = cli(&s.stack, &["backfill", "--since", &since], s.inbox_url()).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.stderr.contains(&format!(
            "warning: slot {} is streamed by a relay",
            s.stack.slot
        )) && out.stderr.contains("stop the relay(s)"),
        "{}",
        out.stderr
    );
    assert!(out.text().contains("1 delivered"), "{}", out.text());
    assert!(
        oracle::wait_ledger_clean(&s.stack, 1, DRAIN)
            .await?
            .is_clean()
    );
    Ok(())
}
