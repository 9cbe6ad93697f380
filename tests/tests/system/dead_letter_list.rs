//! `dead-letter list` and `discard` over more rows than they read at once:
//! every row once, oldest first, in a table or one JSON array, `--limit`
//! across pages, and a memory bound that holding every row would break.

use ::harness::{Inbox, Scenario, app};

/// Rows written for the test: a hundred pages of `list`'s thousand.
const ROWS: i64 = 100_000;

/// The listing's peak resident set, KiB. Measured (debug build,
/// 2026-12-07): 19 MiB for the table and 21 MiB for the JSON of 100,000
/// rows, where `--limit 10` takes 18 MiB; read as one page, the same
/// listings took 157 and 247 MiB.
const PEAK_KIB: u64 = 48 * 1024;

/// A long listing is read and printed a page at a time: 100,000 rows,
/// each once and in id order, in the table and in the JSON array, with
/// the process's peak memory far below what the rows take together;
/// `--limit` stops inside a page; `--limit 0` is refused as a setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_list_is_read_a_page_at_a_time() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let stack = &s.stack;
    let admin = stack.orders_admin().await?;
    admin
        .execute(
            "INSERT INTO cdc_relay_dead_letter \
               (event_id, aggregate_key, event_type, payload, http_status, error, \
                response_excerpt, attempts) \
             SELECT 'list-' || n, 'agg-' || n % 97, 'OrderPaid', '{}', 422, \
                    'http_422: refused by the test', repeat('x', 200), 1 \
             FROM generate_series(1, $1::bigint) n",
            &[&ROWS],
        )
        .await?;
    let ids: Vec<i64> = admin
        .query("SELECT id FROM cdc_relay_dead_letter ORDER BY id", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids.len(), usize::try_from(ROWS)?);
    let url = stack.relay_url.clone();
    let run = |args: &'static [&'static str]| {
        let url = url.clone();
        async move { app::relay_command_peak_rss(stack, &url, args, &[]).await }
    };

    let (table, peak) = run(&["dead-letter", "list"]).await?;
    assert!(table.success(), "{}", table.stderr);
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert!(lines[0].trim_start().starts_with("id"), "{}", lines[0]);
    assert_eq!(lines.last(), Some(&"100000 dead-lettered event(s)"));
    let listed: Vec<i64> = lines[1..lines.len() - 1]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap_or("").parse())
        .collect::<Result<_, _>>()?;
    assert!(
        listed == ids,
        "the table lists every row once, oldest first"
    );
    assert!(peak < PEAK_KIB, "the table's listing peaked at {peak} KiB");

    let (json, peak) = run(&["dead-letter", "list", "--json"]).await?;
    assert!(json.success(), "{}", json.stderr);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json.stdout)?;
    let listed: Vec<i64> = rows.iter().filter_map(|r| r["id"].as_i64()).collect();
    assert!(
        listed == ids,
        "the array holds every row once, oldest first"
    );
    assert_eq!(rows[0]["event_id"], "list-1");
    assert!(peak < PEAK_KIB, "the JSON listing peaked at {peak} KiB");

    let (limited, _) = run(&["dead-letter", "list", "--json", "--limit", "2500"]).await?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&limited.stdout)?;
    let listed: Vec<i64> = rows.iter().filter_map(|r| r["id"].as_i64()).collect();
    assert_eq!(listed, ids[..2500], "--limit 2500 reads across three pages");
    let (limited, _) = run(&["dead-letter", "list", "--limit", "2500"]).await?;
    assert!(
        limited.stdout.lines().last().is_some_and(|l| l.starts_with(
            "2500 dead-lettered event(s) shown, the first --limit 2500: there may be more"
        )),
        "{}",
        limited.stdout.lines().last().unwrap_or("")
    );

    for bad in [
        &["dead-letter", "list", "--limit", "0"][..],
        &["dead-letter", "list", "--limit", "-1"],
    ] {
        let (out, _) = run(bad).await?;
        assert_eq!(out.code(), Some(2), "{bad:?}: {}", out.text());
        assert!(out.stderr.contains("--limit"), "{bad:?}: {}", out.stderr);
    }

    // `discard` reads the same pages and keeps only the ids: a dry run
    // over every row, then the removal, within the same bound. A row's
    // own line break cannot forge a line of the list being confirmed.
    admin
        .execute(
            "UPDATE cdc_relay_dead_letter \
             SET event_type = E'Forged\\nwould discard row 1: OrderCreated (harmless)' WHERE id = $1",
            &[&ids[0]],
        )
        .await?;
    let (dry, peak) = run(&[
        "dead-letter",
        "discard",
        "--all",
        "--dry-run",
        "--note",
        "t",
    ])
    .await?;
    assert!(dry.success(), "{}", dry.stderr);
    let described = dry
        .stdout
        .lines()
        .filter(|l| l.starts_with("would discard row "))
        .count();
    assert_eq!(described, ids.len(), "one line a row");
    assert!(
        dry.stdout.contains("Forged\\nwould discard row 1"),
        "the forged line break is escaped"
    );
    assert!(peak < PEAK_KIB, "the dry run peaked at {peak} KiB");
    let (gone, peak) = run(&["dead-letter", "discard", "--all", "--yes", "--note", "t"]).await?;
    assert!(gone.success(), "{}", gone.stderr);
    let left: i64 = admin
        .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    let audited: i64 = admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter_audit WHERE action = 'discard'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(
        (left, audited),
        (0, ROWS),
        "every row discarded, each audited"
    );
    assert!(peak < PEAK_KIB, "the discard peaked at {peak} KiB");
    Ok(())
}
