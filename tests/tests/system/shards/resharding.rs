//! Resharding (docs/operations.md#resharding): one slot into four and four
//! shards into two under load through `--stop-at-lsn`, and the guard that
//! keeps two splits of one `--slot` base from streaming at once.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_one_slot_into_four_under_load_loses_nothing_and_keeps_aggregate_order()
-> anyhow::Result<()> {
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let stack = s.stack.clone();
    let slots = shard_names(&stack.slot, 4);
    let aggregates = orders(&s.db, 40).await?;
    let load = Load::start(&stack, aggregates, 1, None).await?;
    load.wait_more(100).await?;

    let setup = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(
        setup.success(),
        "setup --shards 4 under load:\n{}",
        setup.text()
    );
    let start = start_lsn(&setup.stdout)?;
    load.wait_more(50).await?;
    s.stop_relay().await?;
    s.relay = app::start_relay(&stack, s.inbox_url(), &["--stop-at-lsn", &start]).await?;
    let status = s.relay.process.wait_exit(EXIT).await?;
    assert!(
        status.success(),
        "the old relay at --stop-at-lsn {start} exited {status}:\n{}",
        s.relay.process.logs()
    );
    let logs = s.relay.process.logs();
    assert!(
        logs.contains("confirmed at --stop-at-lsn: stopping")
            || logs.contains("at or past --stop-at-lsn: nothing to stream"),
        "the old relay stopped for another reason:\n{logs}"
    );
    let old = slot_position(&s.db, &stack.slot).await?.confirmed;
    assert!(
        old >= lsn_bytes(&start)?,
        "the old slot stopped at {old}, before {start}"
    );

    let mut sharded = start_sharded(&stack, s.inbox_url(), 4, 4, "sharded").await?;
    wait_until("the new relay to stream all 4 shards", CLAIM, || async {
        holders(&s.db, &slots)
            .await
            .map(|h| held_by(&h, "sharded").len() == 4)
    })
    .await?;
    load.wait_more(300).await?;
    let ids = load.stop().await?;
    wait_delivered(s.sink(), &ids).await?;
    assert_in_order(s.sink());
    let received = s.sink().received().len();
    eprintln!(
        "shards: resharded under load: {} events committed, {received} requests ({} repeats from the slots' overlap)",
        ids.len(),
        received - ids.len()
    );
    let metrics = sharded.metrics().await?;
    for k in 0..4 {
        let tag = format!("{k}of4");
        let delivered = metrics
            .value("cdc_relay_events_delivered_total", &[("shard", &tag)])
            .unwrap_or(0.0);
        assert!(delivered > 0.0, "shard {tag} delivered nothing");
    }

    drop_slots(&s.db, std::slice::from_ref(&stack.slot)).await?;
    let status = admin_command(
        &stack,
        &["status", "--shards", "4", "--admin-url", &sharded.admin_url],
    )
    .await?;
    assert_eq!(status.code(), Some(0), "{}", status.text());
    stop(&mut sharded).await?;
    drop_slots(&s.db, &slots).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_four_shards_into_two_stops_every_old_shard_even_idle_ones_and_loses_nothing()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let db = stack.orders_admin().await?;
    let (old_slots, new_slots) = (shard_names(&stack.slot, 4), shard_names(&stack.slot, 2));
    let setup = admin_command(&stack, &["setup", "--shards", "4"]).await?;
    assert!(setup.success(), "{}", setup.text());
    let sink = ScriptedSink::start().await?;
    let mut old = start_sharded(&stack, &sink.url, 4, 4, "old").await?;
    wait_until("the old relay to stream all 4 shards", CLAIM, || async {
        holders(&db, &old_slots)
            .await
            .map(|h| held_by(&h, "old").len() == 4)
    })
    .await?;
    // Every event goes to old shard 0: shards 1-3 see no row after the
    // reshard's LSN, and must stop all the same.
    orders(&db, 40).await?;
    let aggregates: Vec<Uuid> = db
        .query(
            "SELECT id FROM orders WHERE ((uuid_hash(id) & 2147483647) % 4) = 0",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    anyhow::ensure!(!aggregates.is_empty(), "no order in old shard 0 of 40");
    let load = Load::start(&stack, aggregates, 1, None).await?;
    load.wait_more(100).await?;
    let setup = admin_command(&stack, &["setup", "--shards", "2"]).await?;
    assert!(setup.success(), "setup --shards 2:\n{}", setup.text());
    let start = start_lsn(&setup.stdout)?;
    load.wait_more(50).await?;
    stop(&mut old).await?;
    let mut old = app::start_relay(
        &stack,
        &sink.url,
        &[
            "--shards",
            "4",
            "--max-shards",
            "4",
            "--stop-at-lsn",
            &start,
        ],
    )
    .await?;
    let status = old.process.wait_exit(EXIT).await?;
    assert!(
        status.success(),
        "the old relays at --stop-at-lsn {start} exited {status}:\n{}",
        old.process.logs()
    );
    let confirmed = confirmed(&db, &old_slots).await?;
    assert!(
        confirmed
            .iter()
            .all(|&c| c >= lsn_bytes(&start).unwrap_or(u64::MAX)),
        "an old shard stopped before {start}: {confirmed:?}"
    );

    let mut new = start_sharded(&stack, &sink.url, 2, 2, "new").await?;
    wait_until("the new relay to stream both shards", CLAIM, || async {
        holders(&db, &new_slots)
            .await
            .map(|h| held_by(&h, "new").len() == 2)
    })
    .await?;
    load.wait_more(150).await?;
    let ids = load.stop().await?;
    wait_delivered(&sink, &ids).await?;
    assert_in_order(&sink);
    stop(&mut new).await?;
    drop_slots(&db, &[old_slots, new_slots].concat()).await
}

/// Two splits of one `--slot` base never stream at once: a sharded relay
/// started while the old one-slot relay streams waits as a hot standby
/// (and streams nothing), takes its shards once the old relay stops, and
/// from then on a one-slot relay started again waits in its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_split_waits_while_the_old_one_streams_and_starts_once_it_stopped()
-> anyhow::Result<()> {
    const WAITING: &str = "a slot of another split streams";
    let mut s = Scenario::start(Inbox::Scripted).await?;
    let stack = s.stack.clone();
    let slots = shard_names(&stack.slot, 2);
    let setup = admin_command(&stack, &["setup", "--shards", "2"]).await?;
    assert!(setup.success(), "setup --shards 2:\n{}", setup.text());

    let mut new = start_sharded(&stack, s.inbox_url(), 2, 2, "new").await?;
    new.process
        .wait_for_line(WAITING, CLAIM)
        .await
        .context("the new split's relay waits for the old one")?;
    let aggregates = orders(&s.db, 4).await?;
    let mut ids = Vec::new();
    for (seq, aggregate) in aggregates.iter().enumerate() {
        ids.push(insert_seq(&s.db, Some(*aggregate), seq as u64).await?);
    }
    wait_delivered(s.sink(), &ids).await?;
    assert_eq!(
        app::sessions(&new),
        0,
        "the new split streamed while the old one did:\n{}",
        new.process.logs()
    );
    let held = holders(&s.db, &slots).await?;
    assert!(
        held.values().all(Option::is_none),
        "a new shard slot is held while the old split streams: {held:?}"
    );
    // Each shard says it stands by once its own checks ran (a standby runs
    // the configuration checks before it waits: the shards get there one
    // after the other).
    for shard in ["0of2", "1of2"] {
        wait_until(&format!("shard {shard} standing by"), CLAIM, || async {
            anyhow::Ok(
                new.metrics()
                    .await?
                    .value("cdc_relay_standby", &[("shard", shard)])
                    == Some(1.0),
            )
        })
        .await?;
    }

    s.stop_relay().await?;
    let stopped = Instant::now();
    wait_until("the new split to stream both shards", CLAIM, || async {
        holders(&s.db, &slots)
            .await
            .map(|h| held_by(&h, "new").len() == 2)
    })
    .await?;
    eprintln!(
        "shards: the new split streamed {:?} after the old relay stopped",
        stopped.elapsed()
    );
    for (seq, aggregate) in aggregates.iter().enumerate() {
        ids.push(insert_seq(&s.db, Some(*aggregate), 100 + seq as u64).await?);
    }
    wait_delivered(s.sink(), &ids).await?;
    assert_in_order(s.sink());

    // The other way round: the one-slot relay now waits for the split.
    let mut old = app::start_relay(&stack, s.inbox_url(), &[]).await?;
    old.process
        .wait_for_line(WAITING, CLAIM)
        .await
        .context("the one-slot relay waits for the split")?;
    let id = insert_seq(&s.db, Some(aggregates[0]), 200).await?;
    wait_delivered(s.sink(), std::slice::from_ref(&id)).await?;
    assert_eq!(app::sessions(&old), 0, "{}", old.process.logs());
    stop(&mut old).await?;
    stop(&mut new).await?;
    drop_slots(&s.db, &slots).await
}
