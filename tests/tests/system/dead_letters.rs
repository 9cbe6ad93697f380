//! `dead-letter replay` and its rows: it runs aggregates concurrently
//! while keeping each one's order (the filters, `--rate` and the stop at a
//! failing sink are in `sink_failures`), splits a refused batch down to
//! the refused row, and says "removed" only once the removal committed.
//! The store that writes the rows is tested in `dead_letter_store`.

use std::collections::HashSet;
use std::time::Duration;

use ::harness::{Inbox, Scenario, wait_until};

/// Writes dead letters straight into the table (as a relay would after a
/// 4xx): `per` events for each of `aggregates` aggregates, one aggregate
/// after the other (a1 a2 a3 ... b1 b2 b3 ...), so a replay that ignored
/// the aggregates would send an aggregate's events at once. Returns each
/// aggregate's event ids, oldest first.
async fn dead_letter_rows(
    db: &tokio_postgres::Client,
    aggregates: usize,
    per: usize,
) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let keys: Vec<String> = (0..aggregates)
        .map(|_| uuid::Uuid::new_v4().to_string())
        .collect();
    let mut ids = vec![Vec::new(); aggregates];
    for (k, key) in keys.iter().enumerate() {
        for n in 0..per {
            let id = uuid::Uuid::new_v4().to_string();
            db.execute(
                "INSERT INTO cdc_relay_dead_letter \
                   (event_id, aggregate_key, event_type, payload, http_status, error, attempts) \
                 VALUES ($1, $2, 'OrderPaid', $3, 400, 'http_400: test', 1)",
                &[&id, key, &format!("{{\"n\":{n}}}")],
            )
            .await?;
            ids[k].push(id);
        }
    }
    Ok(keys.into_iter().zip(ids).collect())
}

/// What `dead-letter replay --json` (`stdout`) said of the refused
/// aggregate's rows: the first delivered, the second refused again, the
/// rest not attempted; 21 of the 24 rows delivered in all.
fn said_refused_first_second(stdout: &str, refused: &[String]) -> anyhow::Result<()> {
    let v: serde_json::Value = serde_json::from_str(stdout)?;
    let outcome = |id: &str| {
        v["rows"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["event_id"] == id))
            .map(|r| r["outcome"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(outcome(&refused[0]).as_deref(), Some("delivered"), "{v}");
    assert_eq!(outcome(&refused[1]).as_deref(), Some("rejected"), "{v}");
    for later in &refused[2..] {
        assert_eq!(outcome(later).as_deref(), Some("not_attempted"), "{v}");
    }
    assert_eq!(v["delivered"], 21, "{v}");
    Ok(())
}

/// The dead-letter table holds the refused aggregate's rows from the
/// refused one on, and nothing else.
async fn only_the_refused_rest_stays(
    admin: &tokio_postgres::Client,
    refused: &[String],
) -> anyhow::Result<()> {
    let left: Vec<String> = admin
        .query(
            "SELECT event_id FROM cdc_relay_dead_letter ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        refused[1..].to_vec(),
        "only the refused aggregate's rest stays"
    );
    Ok(())
}

/// `replay` sends several aggregates at once but each aggregate's events
/// one at a time, oldest first; an aggregate whose earlier event is
/// refused again is skipped from there (its later events are not attempted
/// and stay), while the other aggregates go on to the end. Every row
/// delivered leaves exactly one audit row, and no more requests are in
/// flight than `--max-in-flight`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replay_keeps_each_aggregates_order_and_skips_one_refused_again()
-> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let rows = dead_letter_rows(&admin, 6, 4).await?;
    let (refused_key, refused) = &rows[0];
    // The first aggregate's second event is refused again.
    sink.reject(&refused[1], 422);
    sink.set_delay(Duration::from_millis(40));
    let before = sink.received().len();

    // How many requests the sink holds at once, sampled while replaying.
    let replay = crate::sink_failures::cli(
        stack,
        &[
            "dead-letter",
            "replay",
            "--all",
            "--json",
            "--max-in-flight",
            "4",
        ],
        &sink.url,
    );
    tokio::pin!(replay);
    let mut most = 0;
    let out = loop {
        tokio::select! {
            out = &mut replay => break out?,
            () = tokio::time::sleep(Duration::from_millis(2)) => most = most.max(sink.in_progress()),
        }
    };
    assert!(!out.success(), "three rows were kept: {}", out.text());
    said_refused_first_second(&out.stdout, refused)?;

    // Each aggregate's events arrived oldest first, each only after the
    // one before it was answered; the skipped ones never arrived.
    let sent: Vec<String> = sink.received_from(before).iter().map(|r| r.id()).collect();
    for (key, ids) in &rows {
        let got: Vec<&String> = sent.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = if key == refused_key {
            ids[..2].iter().collect()
        } else {
            ids.iter().collect()
        };
        assert_eq!(got, expected, "aggregate {key}: {sent:?}");
    }
    assert!(
        (2..=4).contains(&most),
        "aggregates in parallel, at most --max-in-flight: {most} at once"
    );

    only_the_refused_rest_stays(&admin, refused).await?;
    // The row refused again records this refusal: its status, its error,
    // one attempt more (it kept the old ones).
    let row = admin
        .query_one(
            "SELECT http_status, error, attempts, last_attempt_at IS NOT NULL \
             FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&refused[1]],
        )
        .await?;
    assert_eq!(row.get::<_, Option<i32>>(0), Some(422));
    assert!(row.get::<_, String>(1).starts_with("http_422"), "{row:?}");
    assert_eq!(row.get::<_, i32>(2), 2);
    assert!(row.get::<_, bool>(3));
    let audited: Vec<String> = admin
        .query(
            "SELECT event_id FROM cdc_relay_dead_letter_audit WHERE action = 'replay'",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let unique: HashSet<&String> = audited.iter().collect();
    assert!(
        audited.len() == 21 && unique.len() == 21 && !unique.contains(&refused[1]),
        "one audit row per delivered row: {audited:?}"
    );

    // Once accepted, the skipped aggregate's events follow in order.
    sink.clear_rejections();
    let from = sink.received().len();
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    let sent: Vec<String> = sink.received_from(from).iter().map(|r| r.id()).collect();
    assert_eq!(sent, refused[1..].to_vec());
    Ok(())
}

/// `replay --batch-max-events` sends rows in batches (one row per
/// aggregate in a request, as the live pipeline does); a batch the sink
/// refuses whole is split down to the refused row, which is kept with the
/// rest of its aggregate, while every other row is delivered, in each
/// aggregate's order, and removed with its audit row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_in_batches_splits_a_refused_batch_down_to_the_refused_row() -> anyhow::Result<()>
{
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let rows = dead_letter_rows(&admin, 6, 4).await?;
    let (refused_key, refused) = &rows[0];
    sink.reject(&refused[1], 422);
    let before = sink.received().len();
    let args = [
        "dead-letter",
        "replay",
        "--all",
        "--json",
        "--max-in-flight",
        "2",
        "--batch-max-events",
        "8",
    ];
    let out = crate::sink_failures::cli(stack, &args, &sink.url).await?;
    assert!(!out.success(), "three rows were kept: {}", out.text());
    said_refused_first_second(&out.stdout, refused)?;

    let requests = sink.received_from(before);
    let largest = requests.iter().map(|r| r.ids().len()).max().unwrap_or(0);
    assert!(
        largest > 1,
        "rows went in batches: {:?}",
        requests.iter().map(|r| r.ids()).collect::<Vec<_>>()
    );
    for r in &requests {
        let ids = r.ids();
        let keys: HashSet<&str> = ids
            .iter()
            .filter_map(|id| rows.iter().find(|(_, ids)| ids.contains(id)))
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            keys.len(),
            ids.len(),
            "one row per aggregate in a request: {ids:?}"
        );
        assert!(
            !ids.iter().any(|id| refused[2..].contains(id)),
            "the rows behind the refused one were not sent: {ids:?}"
        );
    }
    // Each aggregate's delivered rows, in the order the sink took them.
    let accepted: Vec<String> = requests
        .iter()
        .filter(|r| (200..300).contains(&r.status))
        .flat_map(|r| r.ids())
        .collect();
    for (key, ids) in &rows {
        let got: Vec<&String> = accepted.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = if key == refused_key {
            ids[..1].iter().collect()
        } else {
            ids.iter().collect()
        };
        assert_eq!(got, expected, "aggregate {key}: {accepted:?}");
    }
    only_the_refused_rest_stays(&admin, refused).await?;
    let audit = admin
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM cdc_relay_dead_letter_audit \
             WHERE action = 'replay'",
            &[],
        )
        .await?;
    let (audited, unique): (i64, i64) = (audit.get(0), audit.get(1));
    assert_eq!(
        (audited, unique),
        (21, 21),
        "one audit row per delivered row"
    );
    Ok(())
}

/// A dead letter whose payload cannot be sent is not replayed; it stays,
/// nothing is sent, and the replay says why (exit 1):
/// - not UTF-8 (kept in `payload_bytes`): sent, its data would be null,
///   and a 2xx would remove the event's only copy. Broken on purpose once:
///   without the check, the sink got `"data":null` and the row was removed.
/// - text that is not JSON (an unreadable row kept as read): it would go
///   into the body as the event's `data` and make the body invalid. (It
///   was POSTed, and the receiver answered 400 invalid_json.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_cannot_be_sent_is_never_replayed() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    for (id, values, said) in [
        (
            "e-bytes",
            "NULL, '\\xff7b7d'::bytea, 'unreadable: not UTF-8'",
            "not UTF-8",
        ),
        (
            "e-text",
            "'{not json at all', NULL, 'unreadable: holds text that is not JSON'",
            "not JSON",
        ),
    ] {
        admin
            .batch_execute(&format!(
                "INSERT INTO cdc_relay_dead_letter \
                   (event_id, event_type, payload, payload_bytes, error, attempts) \
                 VALUES ('{id}', 'OrderPaid', {values}, 0)"
            ))
            .await?;
        let before = sink.received().len();
        let out = crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url)
            .await?;
        assert!(!out.success(), "{id}: {}", out.text());
        assert!(out.text().contains(said), "{id}: {}", out.text());
        assert_eq!(sink.received().len(), before, "{id}: nothing sent");
        assert_eq!(rows_of(&admin, id).await?, 1, "{id}: the row stays");
        admin
            .execute(
                "DELETE FROM cdc_relay_dead_letter WHERE event_id = $1",
                &[&id],
            )
            .await?;
    }
    Ok(())
}

/// The dead-letter rows of `event_id`.
async fn rows_of(admin: &tokio_postgres::Client, event_id: &str) -> anyhow::Result<i64> {
    Ok(admin
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&event_id],
        )
        .await?
        .get(0))
}

/// A replay whose removal cannot commit (a lock held on the dead-letter
/// table) says so: the row's line says "delivered", never "removed", the
/// command fails naming the lock's holder and the rows that stay, and
/// they do stay; a later replay removes them. (The row line said
/// "delivered (204); removed" before the DELETE had committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_says_removed_only_once_the_removal_committed() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    admin
        .execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, error, attempts) \
             VALUES ('e-locked', 'OrderPaid', '{\"n\":1}', 'refused', 1)",
            &[],
        )
        .await?;
    let mut locker = stack.orders_admin().await?;
    let tx = locker.transaction().await?;
    tx.batch_execute(
        "SET application_name = 'removal-blocker'; LOCK TABLE cdc_relay_dead_letter IN SHARE MODE",
    )
    .await?;
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    let text = out.text();
    assert!(!out.success(), "{text}");
    assert!(out.stdout.contains(": delivered (204)"), "{text}");
    assert!(!out.stdout.contains("removed"), "{text}");
    assert!(
        text.contains("removal-blocker") && text.contains("stay in the table"),
        "{text}"
    );
    tx.rollback().await?;
    assert_eq!(rows_of(&admin, "e-locked").await?, 1, "the row stays");
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    assert!(
        out.stdout.contains("1 delivered and removed"),
        "{}",
        out.text()
    );
    assert_eq!(
        rows_of(&admin, "e-locked").await?,
        0,
        "removed once the lock is gone"
    );
    Ok(())
}

/// Without `--routes`, `dead-letter replay` sends to `--sink-url` only the
/// rows a `--sink-url` relay dead-lettered: a row a routes file's endpoint
/// dead-lettered is kept and named (its receiver is another), unless the
/// operator names that endpoint on purpose. (`replay --all --sink-url`
/// sent shipping's row to Billing and removed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_to_the_sink_url_leaves_a_routed_endpoints_rows_alone() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    admin
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, error, attempts, endpoint) \
             VALUES ('e-shipping', 'OrderPaid', '{\"n\":1}', 'refused', 1, 'shipping'), \
                    ('e-default', 'OrderPaid', '{\"n\":2}', 'refused', 1, NULL)",
        )
        .await?;
    let before = sink.received().len();
    let out =
        crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url).await?;
    let text = out.text();
    let sent: Vec<String> = sink.received_from(before).iter().map(|r| r.id()).collect();
    assert_eq!(sent, vec!["e-default".to_owned()], "{text}");
    assert!(
        !out.success() && text.contains("dead-lettered by endpoint shipping"),
        "{text}"
    );
    assert_eq!(
        rows_of(&admin, "e-shipping").await?,
        1,
        "shipping's row stays"
    );
    // Named on purpose, it goes to --sink-url.
    let named = crate::sink_failures::cli(
        stack,
        &["dead-letter", "replay", "--all", "--endpoint", "shipping"],
        &sink.url,
    )
    .await?;
    assert!(named.success(), "{}", named.text());
    assert_eq!(
        rows_of(&admin, "e-shipping").await?,
        0,
        "replayed when named"
    );
    Ok(())
}

/// An event dead-lettered by a relay that stopped before confirming its
/// transaction streams again at the next start; delivered then, its
/// dead-letter row goes (with an audit row saying why), so it is not both
/// delivered and waiting for a replay that would send it again. (Broken
/// before: the row stayed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_whose_event_is_delivered_when_streamed_again_is_removed()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let (refused, held) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    // One transaction: `refused` is dead-lettered at once, `held` keeps
    // failing, so the transaction is not confirmed.
    s.sink().reject(&refused.to_string(), 422);
    s.sink().reject(&held.to_string(), 503);
    let order = uuid::Uuid::new_v4();
    s.db.batch_execute(&format!(
        "BEGIN; INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 7, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES \
           ('{refused}', '{order}', 'OrderCreated', '{{}}'), \
           ('{held}', '{order}', 'OrderCreated', '{{}}'); COMMIT"
    ))
    .await?;
    let db = s.stack.orders_admin().await?;
    let id = refused.to_string();
    let rows = || async {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM cdc_relay_dead_letter WHERE event_id = $1",
                &[&id],
            )
            .await?
            .get(0);
        anyhow::Ok(n)
    };
    ::harness::wait_until(
        "the refused event dead-lettered",
        Duration::from_secs(30),
        || async { rows().await.map(|n| n == 1) },
    )
    .await?;
    s.stop_relay().await?;

    s.sink().clear_rejections();
    s.restart_relay(&[]).await?;
    s.settle().await?;
    ::harness::wait_until("its row removed", Duration::from_secs(30), || async {
        rows().await.map(|n| n == 0)
    })
    .await?;
    let audit: Vec<(String, String)> =
        s.db.query(
            "SELECT action, reason FROM cdc_relay_dead_letter_audit WHERE event_id = $1",
            &[&refused.to_string()],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        audit.len() == 1 && audit[0].0 == "replay" && audit[0].1.contains("streamed it again"),
        "{audit:?}"
    );
    let taken = s
        .sink()
        .delivered()
        .iter()
        .filter(|r| r.json()["id"] == refused.to_string().as_str())
        .count();
    assert_eq!(taken, 1, "delivered once, when streamed again");
    Ok(())
}

/// Ten dead letters (two aggregates of five) and a sink answering each
/// request after 150 ms, so a replay of them holds its lock for about a
/// second; returns the rows and how many requests the sink had before.
async fn rows_for_a_slow_replay(
    s: &Scenario,
) -> anyhow::Result<(Vec<(String, Vec<String>)>, usize)> {
    let rows = dead_letter_rows(&s.stack.orders_admin().await?, 2, 5).await?;
    s.sink().set_delay(Duration::from_millis(150));
    Ok((rows, s.sink().received().len()))
}

/// Every row of `rows` reached the sink once after its `before`th request.
fn each_row_sent_once(s: &Scenario, before: usize, rows: &[(String, Vec<String>)]) {
    let mut sent: Vec<String> = s
        .sink()
        .received_from(before)
        .iter()
        .map(|r| r.id())
        .collect();
    sent.sort();
    let mut expected: Vec<String> = rows.iter().flat_map(|(_, ids)| ids.clone()).collect();
    expected.sort();
    assert_eq!(sent, expected, "each row sent once");
}

/// Two `dead-letter replay --all` started together over the same rows:
/// one replays them, the other is refused at once (exit 1, saying why)
/// and sends nothing, so every row reaches the sink once. Before, both
/// sent every row (tester's case: 20,000 rows, 40,000 requests, stale
/// events of an aggregate after newer ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replays_at_once_send_each_row_once() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let (rows, before) = rows_for_a_slow_replay(&s).await?;
    let replay =
        || crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url);
    let (a, b) = tokio::join!(replay(), replay());
    let (a, b) = (a?, b?);
    assert!(
        a.success() != b.success(),
        "exactly one replay runs:\n{}\n---\n{}",
        a.text(),
        b.text()
    );
    let refused = if a.success() { &b } else { &a };
    assert_eq!(refused.code(), Some(1), "{}", refused.text());
    assert!(
        refused
            .text()
            .contains("another `cdc-relay dead-letter replay` runs against this database"),
        "{}",
        refused.text()
    );
    each_row_sent_once(&s, before, &rows);
    Ok(())
}

/// Several row ids, given newest first: every one is replayed, and each
/// aggregate's rows reach the sink oldest first (a replay of named rows
/// took one id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_several_ids_sends_each_aggregate_oldest_first() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let rows = dead_letter_rows(&admin, 2, 3).await?;
    let before = sink.received().len();
    let mut ids: Vec<String> = admin
        .query(
            "SELECT id::text FROM cdc_relay_dead_letter ORDER BY id DESC",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.truncate(5); // one row stays
    let mut argv = vec!["dead-letter", "replay"];
    argv.extend(ids.iter().map(String::as_str));
    let out = crate::sink_failures::cli(stack, &argv, &sink.url).await?;
    assert!(out.success(), "{}", out.text());
    let sent: Vec<String> = sink.received_from(before).iter().map(|r| r.id()).collect();
    assert_eq!(sent.len(), 5, "{sent:?}");
    for (_, events) in &rows {
        let order: Vec<usize> = sent
            .iter()
            .filter_map(|id| events.iter().position(|e| e == id))
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "{order:?} of {events:?}"
        );
    }
    let left: i64 = admin
        .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    assert_eq!(left, 1);
    Ok(())
}

/// Rows deleted by a statement while a replay sends them: the replay
/// delivers them and says that they were already removed, instead of
/// counting them as removed by it. (Before: "10 delivered and removed"
/// for rows another session had deleted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_names_rows_removed_meanwhile_by_another_session() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let (_rows, before) = rows_for_a_slow_replay(&s).await?;
    let replay = crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url);
    let delete = async {
        wait_until(
            "the replay's first request",
            Duration::from_secs(20),
            || async { Ok(sink.received().len() > before) },
        )
        .await?;
        admin
            .execute("DELETE FROM cdc_relay_dead_letter", &[])
            .await?;
        anyhow::Ok(())
    };
    let (replayed, deleted) = tokio::join!(replay, delete);
    let replayed = replayed?;
    deleted?;
    assert!(replayed.success(), "{}", replayed.text());
    assert!(
        replayed
            .text()
            .contains("of them already removed meanwhile, by another command or statement"),
        "{}",
        replayed.text()
    );
    Ok(())
}

/// `dead-letter discard` while `dead-letter replay` runs over the same
/// rows: the discard is refused (exit 1, nothing discarded, saying what
/// runs), and the replay sends and removes every row, each audited once as
/// replayed. Before, the discard committed over rows the replay had read:
/// a tester's 30 rows audited "discard" all reached the sink, 27 of them
/// after the discard, and the replay counted them as removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discard_while_a_replay_runs_over_its_rows_is_refused() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let (stack, sink) = (&s.stack, s.sink());
    let admin = stack.orders_admin().await?;
    let (rows, before) = rows_for_a_slow_replay(&s).await?;
    let replay = crate::sink_failures::cli(stack, &["dead-letter", "replay", "--all"], &sink.url);
    let discard = async {
        wait_until(
            "the replay's first request",
            Duration::from_secs(20),
            || async { Ok(sink.received().len() > before) },
        )
        .await?;
        crate::sink_failures::cli(
            stack,
            &["dead-letter", "discard", "--all", "--yes", "--note", "race"],
            &sink.url,
        )
        .await
    };
    let (replayed, discarded) = tokio::join!(replay, discard);
    let (replayed, discarded) = (replayed?, discarded?);
    assert!(replayed.success(), "{}", replayed.text());
    assert_eq!(discarded.code(), Some(1), "{}", discarded.text());
    for words in [
        "`cdc-relay dead-letter replay` is running over these rows",
        "nothing was discarded",
    ] {
        assert!(
            discarded.text().contains(words),
            "{words:?}: {}",
            discarded.text()
        );
    }
    let actions: Vec<String> = admin
        .query("SELECT action FROM cdc_relay_dead_letter_audit", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let expected: Vec<String> = rows.iter().flat_map(|(_, ids)| ids.clone()).collect();
    assert_eq!(actions.len(), expected.len(), "{actions:?}");
    assert!(actions.iter().all(|a| a == "replay"), "{actions:?}");
    let left: i64 = admin
        .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
        .await?
        .get(0);
    assert_eq!(left, 0);
    each_row_sent_once(&s, before, &rows);

    // The same for a replay of one endpoint's parked rows (a relay
    // resuming it holds this lock on its session): an endpoint's row is
    // not discarded while it is held, and is once it is free.
    admin
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, error, attempts, endpoint) \
             VALUES ('e-parked', 'OrderPaid', '{}', 'parked: test', 0, 'audit')",
        )
        .await?;
    let resuming = stack.orders_admin().await?;
    resuming
        .batch_execute(
            "SELECT pg_advisory_lock(hashtextextended('cdc_relay_resume:' || 'audit', 0))",
        )
        .await?;
    let discard = || {
        crate::sink_failures::cli(
            stack,
            &["dead-letter", "discard", "--all", "--yes", "--note", "race"],
            &sink.url,
        )
    };
    let held = discard().await?;
    assert_eq!(held.code(), Some(1), "{}", held.text());
    assert!(
        held.text()
            .contains("a replay of endpoint audit's parked rows"),
        "{}",
        held.text()
    );
    resuming
        .batch_execute(
            "SELECT pg_advisory_unlock(hashtextextended('cdc_relay_resume:' || 'audit', 0))",
        )
        .await?;
    let free = discard().await?;
    assert!(free.success(), "{}", free.text());
    Ok(())
}
