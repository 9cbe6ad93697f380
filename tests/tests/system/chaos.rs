//! The chaos run of issue 6, compressed for CI: the same fault kinds as the
//! full run (`cargo run --release -p cdc-relay-tests --bin chaos`) over
//! 90 s at 40 orders/s on a cluster of its own (fsync off), then the
//! ledger. Every must-be-zero figure is asserted; the table is printed
//! (`--nocapture`). The seed is fixed so CI is reproducible;
//! `CDC_RELAY_CHAOS_SEED` overrides it.
//!
//! Issue 33: the provider's charges count once per order (0 double
//! charges, 0 invoices never charged after the drain), with Billing and the
//! provider killed between a charge and its record or answer; and the same
//! schedule without the `Idempotency-Key` counts the double charges it
//! prevents.
//!
//! Issue 14, HTTP manners 6: whatever a dead Billing looks like (killed, a
//! 503 burst, the link cut or reset), it sees at most 2 requests per second
//! once the fault's first second is over, per fault kind, relay kills
//! inside the fault included.

//!
//! Issue 31: the same schedule with every relay sending batches
//! (`--batch-max-events 16`): the ledger stays 0/0/0.

use harness::chaos::{self, Config};

/// CI's seed.
const CI_SEED: u64 = 20_250_601;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_compressed_schedule_loses_nothing_and_charges_no_one_twice() -> anyhow::Result<()> {
    compressed(Config::ci(seed())).await
}

/// The same schedule with every relay sending batches
/// (`--batch-max-events 16`, issue 31): the ledger stays clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_compressed_schedule_with_batches_loses_nothing() -> anyhow::Result<()> {
    compressed(Config::ci(seed()).batched()).await
}

fn seed() -> u64 {
    std::env::var("CDC_RELAY_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEED)
}

/// Runs `cfg`'s schedule and asserts every must-be-zero figure.
async fn compressed(cfg: Config) -> anyhow::Result<()> {
    let seed = cfg.seed;
    let report = chaos::run(&cfg).await?;
    let table = report.table();
    eprintln!("{table}");
    let out = std::env::temp_dir().join(format!("cdc-relay-chaos-{}-{seed}.json", cfg.label));
    chaos::write_json(&report, &out)?;
    eprintln!("JSON report: {}", out.display());
    let l = &report.ledger;
    let context = format!(
        "seed {seed} (rerun: CDC_RELAY_CHAOS_SEED={seed} cargo test -p cdc-relay-tests --test system chaos -- --nocapture); logs: {:?}\n{table}",
        report.logs
    );
    assert!(
        report.figures.drain.is_some(),
        "the drain did not finish: {context}"
    );
    assert_eq!(l.lost, 0, "lost events: {context}");
    assert_eq!(l.duplicate_effects, 0, "duplicate effects: {context}");
    assert_eq!(l.phantom, 0, "phantom effects: {context}");
    assert_eq!(l.dead_lettered, 0, "dead-lettered events: {context}");
    assert_eq!(
        l.accepted_not_committed, 0,
        "201s without a committed order: {context}"
    );
    assert_eq!(
        l.sql_committed_missing, 0,
        "SQL commits that vanished: {context}"
    );
    assert_eq!(l.invoices, l.committed_events, "{context}");
    // Issue 33: the charge outside every database, once per order.
    let c = &report.charges;
    assert_eq!(c.twice, 0, "double charges: {context}");
    assert_eq!(c.never, 0, "invoices never charged: {context}");
    assert_eq!(c.orphan + c.mismatched, 0, "stray charges: {context}");
    assert!(c.is_clean(), "charges: {c:?}: {context}");
    assert_eq!(c.invoices, l.invoices, "{context}");
    // The run did what it says: faults applied, load flowed, takeovers happened.
    assert!(report.load.http_accepted > 1000, "{context}");
    assert!(
        report.figures.redelivered_per_relay_kill.len() >= 4,
        "{context}"
    );
    assert!(
        report
            .faults
            .iter()
            .all(|f| f.note.is_none() || f.fault.kind == chaos::schedule::FaultKind::RelayKill),
        "a fault could not be applied: {context}"
    );
    // ≤ 2 requests/s to a dead sink, per fault kind, relay kills inside a
    // fault included: each relay keeps its requests at least 500 ms apart,
    // so a span of `secs` holds at most 2·secs + 1 of them, plus one per
    // relay kill inside it (the relay taking over sends its first request
    // at once; FaultOutcome::sink_requests_allowed).
    let mut measured = std::collections::BTreeMap::new();
    for f in &report.faults {
        let (Some((requests, secs)), Some(allowed)) = (
            f.sink_requests_after_first_second,
            f.sink_requests_allowed(),
        ) else {
            continue;
        };
        let (faults, with_kills) = measured.entry(f.fault.kind).or_insert((0, 0));
        *faults += 1;
        *with_kills += usize::from(f.relay_kills_while_counted > 0);
        assert!(
            requests <= allowed,
            "{} #{}: {requests} requests reached Billing in the {secs:.2} s after its first second \
             ({:.1}/s; {} relay kills inside; at most {allowed} allowed): {context}",
            f.fault.kind,
            f.fault.n,
            requests as f64 / secs,
            f.relay_kills_while_counted
        );
    }
    eprintln!(
        "requests to a dead Billing held to ≤ 2/s (per kind: faults, of which with a relay kill inside): {measured:?}"
    );
    Ok(())
}

/// Issue 33, the comparison: the same compressed schedule (over 30 s of
/// faults, each kind once) with Billing sending no `Idempotency-Key`. The
/// crashes between a charge and its record (Billing's or the provider's)
/// and the answers the provider drops now charge some orders twice: the
/// double charges the key prevents. Everything else must still hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_without_the_idempotency_key_charges_some_orders_twice() -> anyhow::Result<()> {
    let seed = std::env::var("CDC_RELAY_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEED);
    let mut cfg = Config::ci(seed);
    cfg.label = "ci-without-key".into();
    cfg.shape = chaos::schedule::Shape::compressed(std::time::Duration::from_secs(30));
    cfg.idempotency_key = false;
    let report = chaos::run(&cfg).await?;
    let table = report.table();
    eprintln!("{table}");
    let context = format!("seed {seed}; logs: {:?}\n{table}", report.logs);
    assert!(
        report.figures.drain.is_some(),
        "the drain did not finish: {context}"
    );
    let l = &report.ledger;
    assert!(
        l.is_clean(),
        "the inbox ledger holds without the key: {context}"
    );
    let c = &report.charges;
    assert!(c.twice > 0, "no double charge without the key: {context}");
    assert_eq!(c.never, 0, "{context}");
    assert_eq!(c.once + c.twice, c.invoices, "{context}");
    eprintln!(
        "without the Idempotency-Key: {} of {} orders charged twice or more ({} extra charges)",
        c.twice, c.invoices, c.extra_charges
    );
    Ok(())
}

/// Issue 16, the shard chaos compressed for CI: 4 shards × 2 relays (each
/// `--max-shards 4`), a random relay SIGKILLed every 10 s for 90 s and
/// restarted, 50 orders/s plus 5 aggregates/s of 5 events each (fsync off).
/// Nothing lost, no per-aggregate order violation on Billing's received
/// sequence, every shard held again within 5 s of each kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_chaos_relay_kills_lose_nothing_keep_aggregate_order_and_take_over_fast()
-> anyhow::Result<()> {
    let seed = std::env::var("CDC_RELAY_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEED);
    let cfg = chaos::shards::ShardConfig::ci(seed);
    let report = chaos::shards::run(&cfg).await?;
    let table = report.table();
    eprintln!("{table}");
    let out = std::env::temp_dir().join(format!("cdc-relay-shard-chaos-ci-{seed}.json"));
    chaos::write_json(&report, &out)?;
    let context = format!("seed {seed}; logs: {:?}\n{table}", report.logs);
    let l = &report.ledger;
    assert!(
        report.drain.is_some(),
        "the drain did not finish: {context}"
    );
    assert_eq!(l.lost, 0, "lost events: {context}");
    assert_eq!(l.duplicate_effects, 0, "duplicate effects: {context}");
    assert_eq!(l.phantom, 0, "phantom effects: {context}");
    assert_eq!(l.dead_lettered, 0, "dead-lettered events: {context}");
    assert_eq!(l.accepted_not_committed, 0, "{context}");
    assert_eq!(l.sql_committed_missing, 0, "{context}");
    assert_eq!(l.invoices, l.committed_events, "{context}");
    assert_eq!(report.order.violations, 0, "order violations: {context}");
    assert!(report.unexpected_exits.is_empty(), "{context}");
    // The run did what it says: kills of shard holders, load of both kinds.
    assert!(report.kills.len() >= 8, "{context}");
    assert!(
        report.kills.iter().any(|k| k.victim_held > 0),
        "no kill hit a relay holding shards: {context}"
    );
    assert!(report.order.events > 1000, "{context}");
    assert!(report.load.http_accepted > 3000, "{context}");
    for k in &report.kills {
        let t = k.takeover.unwrap_or(f64::INFINITY);
        assert!(
            t <= 5.0,
            "kill #{} of {} (held {}): shards held again after {t:.2} s: {context}",
            k.n,
            k.victim,
            k.victim_held
        );
    }
    Ok(())
}
