//! Hash-sharded slots (issue 16): `setup --shards N` makes N filtered
//! publications and N slots and proves their filters cover every row once;
//! `status --shards` and `run --shards` refuse a split that would lose or
//! double rows, and a relay whose shard filter is changed while it streams
//! stops confirming that shard and names the backfill; `run --shards N
//! --max-shards K` spreads the shards over
//! processes, a spare takes over a SIGKILLed holder's shards, and each
//! aggregate's events keep their order; resharding from one slot to four
//! under load through `--stop-at-lsn` loses nothing and keeps that order.
//!
//! Order is judged on what the sink received: no event arrives for the
//! FIRST time after a later event (by the `seq` in its payload) of its
//! aggregate arrived. Repeats are allowed: a takeover or a reshard re-sends.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use harness::app::{self, CommandOutput, Running, TEST_SECRET};
use harness::oracle::slot_position;
use harness::sink::{Received, ScriptedSink};
use harness::{Inbox, PgCluster, Scenario, Stack, wait_until};
use tokio_postgres::Client;
use uuid::Uuid;

mod coverage;
mod resharding;

/// Bound for every committed event to reach the sink.
const DELIVER: Duration = Duration::from_secs(60);
/// Bound for relays to claim their shards' slots.
const CLAIM: Duration = Duration::from_secs(30);
/// What a spare may take to stream a SIGKILLed relay's shards (the brief's
/// promise: a standby polls every 250-750 ms).
const TAKEOVER_BOUND: Duration = Duration::from_secs(5);
/// Bound for a `cdc-relay run` that must refuse to start.
const REFUSAL: Duration = Duration::from_secs(30);
/// Bound for a relay to exit after SIGTERM or at `--stop-at-lsn`.
const EXIT: Duration = Duration::from_secs(30);

/// `<base>_<k>of<n>` for every shard, in shard order.
fn shard_names(base: &str, n: u32) -> Vec<String> {
    (0..n).map(|k| format!("{base}_{k}of{n}")).collect()
}

/// `cdc-relay <args>` as the superuser (setup, status).
async fn admin_command(stack: &Stack, args: &[&str]) -> anyhow::Result<CommandOutput> {
    app::relay_command(stack, &stack.orders_admin_url, args, &[]).await
}

/// `cdc-relay run --sink-url <unreachable> <args>` as the relay role, which
/// must exit within [`REFUSAL`].
async fn refused_run(stack: &Stack, args: &[&str]) -> anyhow::Result<CommandOutput> {
    tokio::time::timeout(
        REFUSAL,
        app::refused_run(
            stack,
            &stack.relay_url,
            args,
            &[("EVENT_SECRET", TEST_SECRET)],
        ),
    )
    .await
    .with_context(|| {
        format!("cdc-relay run {args:?} still runs after {REFUSAL:?}: it did not refuse")
    })?
}

/// The LSN of setup's `start: the N shard slots stream every transaction
/// that commits after <LSN>. ...` line.
fn start_lsn(setup: &str) -> anyhow::Result<String> {
    let line = setup
        .lines()
        .find(|l| l.starts_with("start: "))
        .with_context(|| format!("no `start:` line in setup's report:\n{setup}"))?;
    let lsn = line
        .split("commits after ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|w| w.trim_end_matches('.'))
        .with_context(|| format!("no LSN in {line:?}"))?;
    lsn_bytes(lsn).with_context(|| format!("{lsn:?} in {line:?} is not an LSN"))?;
    Ok(lsn.to_owned())
}

/// `X/Y` (hex) as a byte position.
fn lsn_bytes(lsn: &str) -> anyhow::Result<u64> {
    let (hi, lo) = lsn.split_once('/').context("no '/'")?;
    Ok((u64::from_str_radix(hi, 16)? << 32) + u64::from_str_radix(lo, 16)?)
}

/// Who streams each of `slots`: the `application_name` of the walsender's
/// client (`None`: nobody).
async fn holders(
    db: &Client,
    slots: &[String],
) -> anyhow::Result<BTreeMap<String, Option<String>>> {
    let rows = db
        .query(
            "SELECT s.slot_name::text, a.application_name FROM pg_replication_slots s \
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
             WHERE s.slot_name::text = ANY($1::text[])",
            &[&slots],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// How many of `slots` the relay named `app` streams.
fn held_by(holders: &BTreeMap<String, Option<String>>, app: &str) -> Vec<String> {
    holders
        .iter()
        .filter(|(_, h)| h.as_deref() == Some(app))
        .map(|(s, _)| s.clone())
        .collect()
}

/// Creates the pgoutput slot `slot` by hand (after its publication, in a
/// transaction of its own: a slot cannot follow writes).
async fn create_slot(db: &Client, slot: &str) -> anyhow::Result<()> {
    db.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&slot],
    )
    .await?;
    Ok(())
}

/// Each slot's confirmed position.
async fn confirmed(db: &Client, slots: &[String]) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for s in slots {
        out.push(slot_position(db, s).await?.confirmed);
    }
    Ok(out)
}

/// Drops `slots` once their walsenders let go.
async fn drop_slots(db: &Client, slots: &[String]) -> anyhow::Result<()> {
    for slot in slots {
        wait_until(
            &format!("slot {slot} to be dropped"),
            Duration::from_secs(10),
            || async {
                db.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                    .await
                    .map(|_| true)
                    .map_err(anyhow::Error::from)
            },
        )
        .await?;
    }
    Ok(())
}

/// Stops `relay` with SIGTERM; it must exit 0.
async fn stop(relay: &mut Running) -> anyhow::Result<()> {
    relay.process.sigterm();
    let status = relay.process.wait_exit(EXIT).await?;
    anyhow::ensure!(
        status.success(),
        "relay exited {status} after SIGTERM:\n{}",
        relay.process.logs()
    );
    Ok(())
}

/// Starts a sharded relay named `name` (its `application_name`).
async fn start_sharded(
    stack: &Stack,
    sink: &str,
    shards: u32,
    max: u32,
    name: &str,
) -> anyhow::Result<Running> {
    let (shards, max) = (shards.to_string(), max.to_string());
    app::start_relay(
        stack,
        sink,
        &[
            "--shards",
            &shards,
            "--max-shards",
            &max,
            "--application-name",
            name,
        ],
    )
    .await
}

/// `n` orders, to be the aggregates of outbox rows (the foreign key).
async fn orders(db: &Client, n: usize) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(harness::oracle::expected::insert_order(db).await?);
    }
    Ok(ids)
}

/// Commits one event of `aggregate` (`None`: NULL) with `seq` in its
/// payload, in a transaction of its own; returns its id.
async fn insert_seq(db: &Client, aggregate: Option<Uuid>, seq: u64) -> anyhow::Result<String> {
    let agg = aggregate.map_or("null".to_owned(), |a| format!("\"{a}\""));
    let payload = format!(r#"{{"agg":{agg},"seq":{seq}}}"#);
    let row = db
        .query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), $1, 'Sequenced', $2::text::jsonb) RETURNING id::text",
            &[&aggregate, &payload],
        )
        .await?;
    Ok(row.get(0))
}

/// Events inserted in the background, ~100 per second, round-robin over
/// `aggregates` with increasing `seq`, and every `null_every`-th with a NULL
/// aggregate key.
struct Load {
    stop: Arc<AtomicBool>,
    ids: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Load {
    async fn start(
        stack: &Stack,
        aggregates: Vec<Uuid>,
        first_seq: u64,
        null_every: Option<usize>,
    ) -> anyhow::Result<Load> {
        let db = stack.orders_admin().await?;
        let stop = Arc::new(AtomicBool::new(false));
        let ids = Arc::new(Mutex::new(Vec::new()));
        let (stop_flag, sink) = (Arc::clone(&stop), Arc::clone(&ids));
        let task = tokio::spawn(async move {
            let mut n: usize = 0;
            while !stop_flag.load(Ordering::SeqCst) {
                let aggregate = match null_every {
                    Some(k) if n % k == k - 1 => None,
                    _ => Some(aggregates[n % aggregates.len()]),
                };
                let seq = first_seq + (n / aggregates.len()) as u64;
                let id = insert_seq(&db, aggregate, seq).await?;
                sink.lock().expect("load lock").push(id);
                n += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(())
        });
        Ok(Load { stop, ids, task })
    }

    fn count(&self) -> usize {
        self.ids.lock().expect("load lock").len()
    }

    /// Waits until `more` further events were committed.
    async fn wait_more(&self, more: usize) -> anyhow::Result<()> {
        let target = self.count() + more;
        wait_until(
            &format!("the load to commit {more} more events"),
            Duration::from_secs(30),
            || async { self.count() >= target },
        )
        .await
    }

    /// Stops and returns every id committed.
    async fn stop(self) -> anyhow::Result<Vec<String>> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await??;
        Ok(self.ids.lock().expect("load lock").clone())
    }
}

/// Waits until the sink took (2xx) every one of `ids`.
async fn wait_delivered(sink: &ScriptedSink, ids: &[String]) -> anyhow::Result<()> {
    let missing = || {
        let got: HashSet<String> = harness::oracle::arrival_ids(&sink.delivered())
            .into_iter()
            .collect();
        ids.iter()
            .filter(|id| !got.contains(*id))
            .cloned()
            .collect::<Vec<_>>()
    };
    let waited = wait_until(
        &format!("all {} events at the sink", ids.len()),
        DELIVER,
        || async { missing().is_empty() },
    )
    .await;
    if let Err(e) = waited {
        let missing = missing();
        anyhow::bail!(
            "{e}: {} never arrived, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
    }
    Ok(())
}

/// The events (by id) that the sink received for the first time after a
/// later event of the same aggregate, with what came before them.
fn order_violations(received: &[Received]) -> Vec<String> {
    let mut latest: HashMap<String, i64> = HashMap::new();
    let mut seen = HashSet::new();
    let mut violations = Vec::new();
    for r in received.iter().filter(|r| (200..300).contains(&r.status)) {
        let body = r.json();
        let (Some(agg), Some(seq)) = (body["data"]["agg"].as_str(), body["data"]["seq"].as_i64())
        else {
            continue;
        };
        let first = seen.insert(r.id());
        let max = latest.entry(agg.to_owned()).or_insert(seq);
        if first && seq < *max {
            violations.push(format!(
                "{} (aggregate {agg} seq {seq}) first arrived after seq {max}",
                r.id()
            ));
        }
        *max = (*max).max(seq);
    }
    violations
}

fn assert_in_order(sink: &ScriptedSink) {
    let received = sink.received();
    let violations = order_violations(&received);
    assert!(
        violations.is_empty(),
        "{} of {} requests broke their aggregate's order, e.g. {:?}",
        violations.len(),
        received.len(),
        &violations[..violations.len().min(5)]
    );
}

/// How many of `ids`' rows each filter of `filters` matches, then how many
/// rows match none and how many several: evaluated by the server on the
/// table, independently of the relay's own proof.
async fn filter_hits(
    db: &Client,
    table: &str,
    filters: &[String],
) -> anyhow::Result<(Vec<i64>, i64, i64)> {
    let per: Vec<String> = filters
        .iter()
        .map(|f| format!("count(*) FILTER (WHERE coalesce(({f}), false))"))
        .collect();
    let hits = filters
        .iter()
        .map(|f| format!("coalesce(({f}), false)::int"))
        .collect::<Vec<_>>()
        .join(" + ");
    let sql = format!(
        "SELECT {}, count(*) FILTER (WHERE ({hits}) = 0), count(*) FILTER (WHERE ({hits}) > 1) FROM {table}",
        per.join(", ")
    );
    let row = db.query_one(&sql, &[]).await?;
    let n = filters.len();
    Ok((
        (0..n).map(|i| row.get::<_, i64>(i)).collect(),
        row.get(n),
        row.get(n + 1),
    ))
}

/// Each publication's row filter on `table`, in the order of `publications`.
async fn row_filters(
    db: &Client,
    publications: &[String],
    table: &str,
) -> anyhow::Result<Vec<String>> {
    let mut filters = Vec::new();
    for p in publications {
        let row = db
            .query_opt(
                "SELECT rowfilter FROM pg_publication_tables WHERE pubname = $1 AND tablename = $2",
                &[p, &table],
            )
            .await?
            .with_context(|| format!("publication {p} does not list {table}"))?;
        let filter: Option<String> = row.get(0);
        filters.push(filter.with_context(|| format!("publication {p} has no row filter"))?);
    }
    Ok(filters)
}

/// `"<n> are in no shard"` and `"<n> in several"` from a coverage refusal.
fn lost_and_doubled(text: &str) -> Option<(i64, i64)> {
    let number_before = |marker: &str| {
        let head = &text[..text.find(marker)?];
        head.split_whitespace().last()?.parse::<i64>().ok()
    };
    Some((
        number_before(" are in no shard")?,
        number_before(" in several")?,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_with_4_shards_creates_4_filtered_publications_and_slots_and_status_shows_each()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    let publications = shard_names(&stack.publication, 4);
    let slots = shard_names(&stack.slot, 4);

    let setup = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(
        setup.success(),
        "setup --shards 4 failed:\n{}",
        setup.text()
    );
    assert!(
        setup
            .stdout
            .contains("ok: the 4 shard row filters put each of")
            && setup.stdout.contains("in exactly one shard"),
        "no coverage line:\n{}",
        setup.stdout
    );
    let start = start_lsn(&setup.stdout)?;

    let rows = db
        .query(
            "SELECT p.pubname::text, p.pubinsert, p.pubupdate OR p.pubdelete OR p.pubtruncate \
             FROM pg_publication p WHERE p.pubname::text LIKE $1 ORDER BY 1",
            &[&format!("{}\\_%", stack.publication)],
        )
        .await?;
    let found: Vec<(String, bool, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        found,
        publications
            .iter()
            .map(|p| (p.clone(), true, false))
            .collect::<Vec<_>>(),
        "4 insert-only shard publications"
    );
    let filters = row_filters(&db, &publications, "outbox").await?;

    let rows = db
        .query(
            "SELECT slot_name::text, plugin::text, database::text, confirmed_flush_lsn::text \
             FROM pg_replication_slots WHERE slot_name::text = ANY($1::text[]) ORDER BY 1",
            &[&slots],
        )
        .await?;
    let found: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        found,
        slots
            .iter()
            .map(|s| (s.clone(), "pgoutput".to_owned(), stack.orders_db.clone()))
            .collect::<Vec<_>>(),
        "4 pgoutput slots in the orders database"
    );
    let newest = rows
        .iter()
        .map(|r| lsn_bytes(&r.get::<_, String>(3)))
        .collect::<anyhow::Result<Vec<_>>>()?
        .into_iter()
        .max();
    assert_eq!(
        newest,
        Some(lsn_bytes(&start)?),
        "the start LSN is the newest slot's"
    );

    // The filters in the catalog, judged by the server on real rows: each
    // row in exactly one shard, every shard used.
    let aggregates = orders(&db, 40).await?;
    for a in &aggregates {
        insert_seq(&db, Some(*a), 1).await?;
    }
    let (per, none, several) = filter_hits(&db, "outbox", &filters).await?;
    assert_eq!((none, several), (0, 0), "rows per shard {per:?}");
    assert!(
        per.iter().all(|&n| n > 0),
        "some shard got no row of 40 aggregates: {per:?}"
    );

    let status = admin_command(&stack, &["status", "--shards", "4", "--json"]).await?;
    assert_eq!(status.code(), Some(8), "no relay runs:\n{}", status.text());
    let json: serde_json::Value = serde_json::from_str(&status.stdout)
        .with_context(|| format!("status --json:\n{}", status.stdout))?;
    assert_eq!(json["shards"], 4);
    assert!(
        json["coverage_probes"].as_i64().is_some_and(|n| n > 0),
        "{json}"
    );
    let listed: Vec<&str> = json["slots"]
        .as_array()
        .context("slots")?
        .iter()
        .filter_map(|s| s["slot"].as_str())
        .collect();
    assert_eq!(listed, slots.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(json["problems"][0]["code"], 8, "{json}");

    let again = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(again.success(), "setup again:\n{}", again.text());
    for name in publications.iter().chain(&slots) {
        assert!(
            again
                .stdout
                .lines()
                .any(|l| l.starts_with("exists:") && l.contains(&format!("\"{name}\""))),
            "no `exists:` line for {name}:\n{}",
            again.stdout
        );
    }
    assert!(
        !again.stdout.contains("created:") && !again.stdout.contains("start:"),
        "setup again created something:\n{}",
        again.stdout
    );
    drop_slots(&db, &slots).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_shards_over_two_relays_keep_aggregate_order_and_a_spare_takes_over_a_killed_relays_shards()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute("ALTER TABLE outbox ALTER aggregate_id DROP NOT NULL")
        .await?;
    let slots = shard_names(&stack.slot, 4);
    let setup = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(setup.success(), "{}", setup.text());
    let sink = ScriptedSink::start().await?;

    let relay_a = start_sharded(&stack, &sink.url, 4, 2, "relay_a").await?;
    wait_until("relay_a to stream 2 shards", CLAIM, || async {
        holders(&db, &slots)
            .await
            .map(|h| held_by(&h, "relay_a").len() == 2)
    })
    .await?;
    let mut relay_b = start_sharded(&stack, &sink.url, 4, 2, "relay_b").await?;
    wait_until("relay_b to stream the other 2 shards", CLAIM, || async {
        holders(&db, &slots)
            .await
            .map(|h| held_by(&h, "relay_b").len() == 2)
    })
    .await?;
    let spare = start_sharded(&stack, &sink.url, 4, 4, "spare").await?;
    wait_until("the spare to stand by on all 4 shards", CLAIM, || async {
        spare
            .process
            .logs()
            .matches("waiting as hot standby")
            .count()
            >= 4
    })
    .await?;
    let (code, body) = spare.get("/readyz").await?;
    assert_eq!(code, 503, "the spare holds nothing: {body}");
    assert!(body.contains("not streaming from any shard"), "{body}");

    let aggregates = orders(&db, 50).await?;
    let mut ids = Vec::new();
    for seq in 1..=6 {
        for a in &aggregates {
            ids.push(insert_seq(&db, Some(*a), seq).await?);
        }
        for _ in 0..4 {
            ids.push(insert_seq(&db, None, seq).await?);
        }
    }
    wait_delivered(&sink, &ids).await?;
    assert_in_order(&sink);
    let before = holders(&db, &slots).await?;
    let metrics = relay_a.metrics().await?;
    let tags: BTreeSet<String> = (0..4).map(|k| format!("{k}of4")).collect();
    assert_eq!(
        metrics.label_values("cdc_relay_events_delivered_total", "shard"),
        tags,
        "relay_a's metrics carry every shard's label"
    );
    for (slot, holder) in &before {
        let tag = slot.rsplit('_').next().unwrap_or_default();
        let delivered = metrics
            .value("cdc_relay_events_delivered_total", &[("shard", tag)])
            .unwrap_or(0.0);
        assert_eq!(
            delivered > 0.0,
            holder.as_deref() == Some("relay_a"),
            "relay_a delivered {delivered} on shard {tag} held by {holder:?}"
        );
    }
    let build_info: Vec<_> = metrics
        .samples()
        .iter()
        .filter(|s| s.name == "cdc_relay_build_info")
        .collect();
    assert!(
        build_info.len() == 1 && build_info[0].label("shard").is_none(),
        "a process family stays one unlabelled series: {build_info:?}"
    );
    let (code, body) = spare.get("/readyz").await?;
    assert_eq!(code, 503, "still standing by: {body}");
    let standby = spare.metrics().await?;
    for tag in &tags {
        assert_eq!(
            standby.value("cdc_relay_standby", &[("shard", tag)]),
            Some(1.0),
            "the spare stands by on shard {tag}"
        );
    }

    let load = Load::start(&stack, aggregates.clone(), 100, Some(10)).await?;
    load.wait_more(50).await?;
    let b_shards = held_by(&before, "relay_b");
    let killed = Instant::now();
    relay_b.process.sigkill();
    wait_until("the spare to stream relay_b's 2 shards", CLAIM, || async {
        holders(&db, &slots).await.map(|h| {
            b_shards
                .iter()
                .all(|s| h.get(s).and_then(Option::as_deref) == Some("spare"))
        })
    })
    .await?;
    let took_over = killed.elapsed();
    eprintln!(
        "shards: the spare streams relay_b's shards {took_over:?} after its SIGKILL (bound {TAKEOVER_BOUND:?})"
    );
    load.wait_more(100).await?;
    let loaded = load.stop().await?;
    ids.extend(loaded);
    wait_delivered(&sink, &ids).await?;
    assert_in_order(&sink);
    let after = holders(&db, &slots).await?;
    assert_eq!(
        held_by(&after, "relay_a"),
        held_by(&before, "relay_a"),
        "relay_a kept its shards"
    );
    assert_eq!(
        held_by(&after, "spare"),
        b_shards,
        "the spare took exactly relay_b's"
    );
    let (code, body) = spare.get("/readyz").await?;
    assert_eq!(code, 200, "the spare streams now: {body}");
    let standby = spare.metrics().await?;
    for (slot, holder) in &after {
        let tag = slot.rsplit('_').next().unwrap_or_default();
        let expected = if holder.as_deref() == Some("spare") {
            0.0
        } else {
            1.0
        };
        assert_eq!(
            standby.value("cdc_relay_standby", &[("shard", tag)]),
            Some(expected),
            "the spare's standby gauge on shard {tag}, held by {holder:?}"
        );
    }
    assert!(
        took_over <= TAKEOVER_BOUND,
        "the spare took over {took_over:?} after the SIGKILL"
    );
    for mut relay in [relay_a, spare] {
        stop(&mut relay).await?;
    }
    drop_slots(&db, &slots).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_run_refuses_flags_it_cannot_honour_with_exit_2_naming_them() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    for (args, named) in [
        (
            &["--shards", "4", "--on-slot-loss", "recreate-and-backfill"][..],
            "--on-slot-loss",
        ),
        (&["--max-shards", "2"], "--max-shards"),
        (&["--shards", "2", "--publication", "a,b"], "--publication"),
    ] {
        let out = refused_run(&stack, args).await?;
        assert_eq!(out.code(), Some(2), "{args:?}:\n{}", out.text());
        assert!(
            out.stderr.contains(named),
            "{args:?} names {named}:\n{}",
            out.stderr
        );
    }
    Ok(())
}

/// The order oracle itself: a first arrival after a later event of its
/// aggregate is a violation, a repeat is not, other aggregates and NULL
/// keys do not interfere.
#[test]
fn the_order_oracle_flags_a_late_first_arrival_and_allows_repeats() {
    let at = Instant::now();
    let request = |id: &str, agg: Option<&str>, seq: i64| Received {
        body: serde_json::to_vec(&serde_json::json!({
            "id": id, "type": "Sequenced", "data": {"agg": agg, "seq": seq}
        }))
        .expect("json")
        .into(),
        signature: None,
        idempotency_key: None,
        webhook: None,
        content_type: None,
        authorization: None,
        traceparent: None,
        tracestate: None,
        target: "/inbox".into(),
        status: 204,
        at,
        arrived: at,
        peer: ([127, 0, 0, 1], 1).into(),
    };
    let repeats = [
        request("e1", Some("a"), 1),
        request("e2", Some("a"), 2),
        request("x1", Some("b"), 5),
        request("e1", Some("a"), 1),
        request("n1", None, 9),
        request("e3", Some("a"), 3),
    ];
    assert_eq!(order_violations(&repeats), Vec::<String>::new());
    let late = [
        request("e1", Some("a"), 1),
        request("e3", Some("a"), 3),
        request("e2", Some("a"), 2),
    ];
    assert_eq!(
        order_violations(&late).len(),
        1,
        "{:?}",
        order_violations(&late)
    );
}
