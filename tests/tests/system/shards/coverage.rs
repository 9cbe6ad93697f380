//! The coverage proof catches the loss kinds: a shard filter changed by
//! hand (before or while streaming), a hand-made split that loses NULL keys,
//! one that doubles rows; `setup --shards` covers NULL and empty text keys.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_filter_changed_by_hand_makes_status_and_run_refuse_with_exit_3()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    let slots = shard_names(&stack.slot, 4);
    let setup = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(setup.success(), "{}", setup.text());
    // Shard 1 now keeps bucket 1 of 8: bucket 5's rows are in no shard.
    db.batch_execute(&format!(
        "ALTER PUBLICATION {}_1of4 SET TABLE outbox WHERE \
         (((coalesce(uuid_hash(aggregate_id), uuid_hash(id), 0) & 2147483647) % 8) = 1)",
        stack.publication
    ))
    .await?;

    let status = admin_command(&stack, &["status", "--shards", "4"]).await?;
    assert_eq!(status.code(), Some(3), "{}", status.text());
    let (lost, doubled) = lost_and_doubled(&status.stdout)
        .with_context(|| format!("no coverage problem:\n{}", status.text()))?;
    assert!(lost > 0 && doubled == 0, "{}", status.stdout);

    let sink = ScriptedSink::start().await?;
    app::insert_order_event(&db).await?;
    let before = confirmed(&db, &slots).await?;
    let run = refused_run(&stack, &["--shards", "4", "--max-shards", "4"]).await?;
    assert_eq!(run.code(), Some(3), "{}", run.text());
    assert!(
        run.stderr.contains("in no shard"),
        "the refusal names the lost rows:\n{}",
        run.stderr
    );
    assert_eq!(sink.arrivals(), 0, "a refused split delivered something");
    assert_eq!(
        confirmed(&db, &slots).await?,
        before,
        "a refused split moved a slot"
    );
    drop_slots(&db, &slots).await
}

/// A second outbox keyed by text, with a nullable aggregate key, readable
/// by the relay role.
async fn text_outbox(db: &Client) -> anyhow::Result<()> {
    db.batch_execute(
        "CREATE TABLE outbox_text (id text PRIMARY KEY, event_type text NOT NULL, \
           payload jsonb NOT NULL, aggregate_id text); \
         GRANT SELECT ON outbox_text TO cdc_relay; \
         INSERT INTO outbox_text \
           SELECT 'e' || g, 'T', '{}', CASE g % 3 WHEN 0 THEN NULL WHEN 1 THEN '' ELSE 'a' || (g % 17) END \
           FROM generate_series(1, 300) g",
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_split_that_loses_null_keys_is_refused_and_setup_covers_them()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    text_outbox(&db).await?;
    let slots = shard_names(&stack.slot, 2);
    for (k, (publication, slot)) in shard_names(&stack.publication, 2)
        .iter()
        .zip(&slots)
        .enumerate()
    {
        db.batch_execute(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE outbox_text \
               WHERE (((hashtext(aggregate_id) & 2147483647) % 2) = {k}) WITH (publish = 'insert')"
        ))
        .await?;
        create_slot(&db, slot).await?;
    }
    let table = ["--table", "public.outbox_text"];
    // status exits 3 (needs setup); setup, like any failed setup, exits 1.
    for (command, code) in [
        (&["status", "--shards", "2"][..], 3),
        (&["setup", "--shards", "2"], 1),
    ] {
        let out = admin_command(&stack, &[command, &table[..]].concat()).await?;
        assert_eq!(out.code(), Some(code), "{command:?}:\n{}", out.text());
        let (lost, doubled) = lost_and_doubled(&out.text())
            .with_context(|| format!("{command:?} names no lost rows:\n{}", out.text()))?;
        assert!(lost > 0 && doubled == 0, "{command:?}:\n{}", out.text());
    }

    let three = admin_command(&stack, &["setup", "--shards", "3", table[0], table[1]]).await?;
    assert!(three.success(), "setup --shards 3:\n{}", three.text());
    let filters = row_filters(&db, &shard_names(&stack.publication, 3), "outbox_text").await?;
    let (per, none, several) = filter_hits(&db, "outbox_text", &filters).await?;
    assert_eq!(
        (none, several),
        (0, 0),
        "NULL and empty keys in exactly one shard; per shard {per:?}"
    );
    let status = admin_command(&stack, &["status", "--shards", "3", table[0], table[1]]).await?;
    assert_eq!(
        status.code(),
        Some(8),
        "covered, nobody streams:\n{}",
        status.text()
    );
    drop_slots(&db, &[slots, shard_names(&stack.slot, 3)].concat()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_split_that_doubles_rows_is_refused() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    let slots = shard_names(&stack.slot, 2);
    for (publication, slot) in shard_names(&stack.publication, 2).iter().zip(&slots) {
        db.batch_execute(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE outbox \
               WHERE (id IS NULL OR id IS NOT NULL) WITH (publish = 'insert')"
        ))
        .await?;
        create_slot(&db, slot).await?;
    }
    let status = admin_command(&stack, &["status", "--shards", "2"]).await?;
    assert_eq!(status.code(), Some(3), "{}", status.text());
    let (lost, doubled) = lost_and_doubled(&status.text())
        .with_context(|| format!("no coverage problem:\n{}", status.text()))?;
    assert!(lost == 0 && doubled > 0, "{}", status.text());
    let run = refused_run(&stack, &["--shards", "2", "--max-shards", "2"]).await?;
    assert_eq!(run.code(), Some(3), "{}", run.text());
    drop_slots(&db, &slots).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_filter_changed_while_streaming_fails_readiness_names_the_backfill_and_holds_that_shard()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    let slots = shard_names(&stack.slot, 2);
    let setup = admin_command(&stack, &["setup", "--shards", "2"]).await?;
    assert!(setup.success(), "{}", setup.text());
    let sink = ScriptedSink::start().await?;
    let mut relay = start_sharded(&stack, &sink.url, 2, 2, "relay").await?;
    wait_until("the relay to stream both shards", CLAIM, || async {
        holders(&db, &slots)
            .await
            .map(|h| held_by(&h, "relay").len() == 2)
    })
    .await?;
    orders(&db, 40).await?;
    let bucket = |b: i32| {
        let db = &db;
        async move {
            let row = db
                .query_one(
                    "SELECT id FROM orders WHERE ((uuid_hash(id) & 2147483647) % 4) = $1 LIMIT 1",
                    &[&b],
                )
                .await?;
            anyhow::Ok(row.get::<_, Uuid>(0))
        }
    };
    let (kept, lost) = (bucket(1).await?, bucket(3).await?);
    let first = vec![insert_seq(&db, Some(kept), 1).await?];
    wait_delivered(&sink, &first).await?;

    // Shard 1 of 2 (buckets 1 and 3 of 4) now keeps bucket 1 only: an
    // event of bucket 3 is never streamed (pgoutput decodes with the
    // catalog of its time; holding the slot cannot bring it back). The
    // relay must notice at its next monitor reading (15 s), fail
    // readiness, name the filter and the backfill that re-sends the event,
    // and confirm nothing further on that shard.
    db.batch_execute(&format!(
        "ALTER PUBLICATION {}_1of2 SET TABLE outbox WHERE \
         (((coalesce(uuid_hash(aggregate_id), uuid_hash(id), 0) & 2147483647) % 4) = 1)",
        stack.publication
    ))
    .await?;
    let dropped = insert_seq(&db, Some(lost), 1).await?;
    wait_until(
        "the relay to fail /readyz after shard 1's filter changed",
        Duration::from_secs(40),
        || async { relay.get("/readyz").await.map(|(code, _)| code == 503) },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\nthe relay's log:\n{}", relay.process.logs()))?;
    // Readiness fails as the line is written: the log, read from the
    // relay's stderr by another task, may be a moment behind.
    wait_until(
        "the relay to name the changed filter",
        Duration::from_secs(10),
        || async { relay.process.logs().contains("not this shard's") },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\nthe relay's log:\n{}", relay.process.logs()))?;
    let logs = relay.process.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("not this shard's"))
        .with_context(|| format!("the relay names the changed filter:\n{logs}"))?;
    let since = line
        .split("backfill --since '")
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .with_context(|| format!("no backfill --since in {line:?}"))?;
    let covered: bool = db
        .query_one(
            "SELECT $1::text::timestamptz <= occurred_at FROM outbox WHERE id::text = $2",
            &[&since, &dropped],
        )
        .await?
        .get(0);
    assert!(
        covered,
        "backfill --since {since} misses the event left out ({dropped})"
    );

    // Whatever the relay confirmed before it noticed may still reach the
    // server (status updates go out every second), but nothing it reads
    // from now on: the slot stays before this position.
    let noticed = harness::oracle::wal_position(&db).await?;
    let later = vec![
        insert_seq(&db, Some(kept), 2).await?,
        insert_seq(&db, Some(bucket(0).await?), 1).await?,
    ];
    wait_delivered(&sink, &later).await?;
    harness::oracle::settle(&db, &slots[0]).await?;
    let confirmed = slot_position(&db, &slots[1]).await?.confirmed;
    assert!(
        confirmed <= noticed,
        "shard 1 confirms nothing further while its filter is wrong: confirmed at {confirmed}, past {noticed}"
    );
    assert!(
        !harness::oracle::arrival_ids(&sink.delivered()).contains(&dropped),
        "the event the changed filter left out cannot have been streamed"
    );
    relay.process.sigterm();
    relay.process.wait_exit(EXIT).await?;
    drop_slots(&db, &slots).await
}
