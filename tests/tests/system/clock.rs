//! The relay's clock stepped against the database's (issue 30, item 5), as
//! an NTP step or a resumed VM leaves it: the relay runs under libfaketime
//! (Debian's `libfaketime`, installed when missing) ten minutes ahead or
//! behind, against a server on the true time.
//!
//! Before: the hint for Billing's 401 ("timestamp outside tolerance")
//! said to check the event secret, nothing measured or named the skew,
//! and `cdc_relay_commit_to_delivery_seconds` summed to 0 for 20 events
//! (clock behind, each clamped at 0) or about 12,000 s (clock ahead, 600 s
//! each).

use std::time::Duration;

use anyhow::Context;

use ::harness::app::{self, TEST_SECRET};
use ::harness::oracle::{self, Ledger};
use ::harness::sink::ScriptedSink;
use ::harness::{PgCluster, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// libfaketime's preload library, from Debian's package.
fn faketime() -> anyhow::Result<String> {
    Ok(::harness::debian::libfaketime()?.display().to_string())
}

/// The environment that runs the relay `offset` off the true time
/// (`+10m`, `-10m`): a constant offset on the wall clock only.
fn stepped(lib: &str, offset: &str) -> Vec<(String, String)> {
    vec![
        ("EVENT_SECRET".into(), TEST_SECRET.into()),
        ("LD_PRELOAD".into(), lib.into()),
        ("FAKETIME".into(), offset.into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ]
}

/// A relay ten minutes ahead, then one ten minutes behind: the skew is
/// measured (the gauge within a few seconds of ±600) and named at WARN,
/// and the latency of 20 delivered events is their true few milliseconds
/// each, neither 600 s nor 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stepped_clock_is_measured_named_and_does_not_skew_delivery_latency() -> anyhow::Result<()>
{
    let lib = faketime()?;
    for (offset, sign) in [("+10m", 1.0), ("-10m", -1.0)] {
        let stack = PgCluster::shared().create_stack().await?;
        app::relay_setup(&stack).await?;
        let sink = ScriptedSink::start().await?;
        let env = stepped(&lib, offset);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let relay =
            app::start_relay_with_env(&stack, &stack.relay_url, &sink.url, &[], &env).await?;
        app::wait_streaming(&relay).await?;
        let db = stack.orders_admin().await?;
        for _ in 0..20 {
            app::insert_order_event(&db).await?;
        }
        wait_until("20 events delivered", WAIT, || async { sink.count() >= 20 }).await?;
        let skew_near = |m: &::harness::prom::Exposition| {
            m.value("cdc_relay_clock_skew_seconds", &[])
                .is_some_and(|s| (s - sign * 600.0).abs() < 30.0)
        };
        wait_until("the skew measured", WAIT, || async {
            anyhow::Ok(skew_near(&relay.metrics().await?))
        })
        .await?;
        let m = relay.metrics().await?;
        let skew = m
            .value("cdc_relay_clock_skew_seconds", &[])
            .unwrap_or(f64::NAN);
        let count = m.sum("cdc_relay_commit_to_delivery_seconds_count");
        let sum = m.sum("cdc_relay_commit_to_delivery_seconds_sum");
        eprintln!("{offset}: skew {skew:.1} s; {count} deliveries, latency sum {sum:.3} s");
        assert!(count >= 20.0, "{count}");
        assert!(
            sum > 0.0 && sum / count < 5.0,
            "{offset}: the mean commit-to-delivery latency is {:.3} s over {count} events: the step shows",
            sum / count
        );
        // The WARN needs samples spanning a few seconds (a burst of
        // messages that waited reads as skew too): one more event later.
        tokio::time::sleep(Duration::from_secs(6)).await;
        app::insert_order_event(&db).await?;
        let way = if sign > 0.0 { "ahead of" } else { "behind" };
        relay
            .process
            .wait_for_line(&format!("s {way} the database server's"), WAIT)
            .await
            .with_context(|| format!("{offset}: the skew is not named at WARN"))?;
        drop(relay);
    }
    Ok(())
}

/// Billing refuses a relay ten minutes ahead (401, its Standard Webhooks
/// verifier: "timestamp outside tolerance"): the relay's hint names the
/// clock, not the secret; the events stay pending (no dead letter, no
/// invoice), and a relay on the true time delivers them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_refusing_a_stepped_clock_gets_the_clock_hint_and_loses_nothing()
-> anyhow::Result<()> {
    let lib = faketime()?;
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let env = stepped(&lib, "+10m");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let relay =
        app::start_relay_with_env(&stack, &stack.relay_url, &billing.inbox(), &[], &env).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    for _ in 0..5 {
        app::insert_order_event(&db).await?;
    }
    let line = circuit_opened(&relay).await?;
    assert!(
        line.contains("clock") && !line.contains("check the event secret"),
        "the hint must name the clock: {line}"
    );
    let m = relay.metrics().await?;
    assert_eq!(
        m.sum("cdc_relay_events_dead_lettered_total"),
        0.0,
        "none dead-lettered"
    );
    assert_eq!(
        m.sum("cdc_relay_events_delivered_total"),
        0.0,
        "none delivered"
    );
    drop(relay);

    // On the true time, the same events go through, once each.
    let relay = app::start_relay(&stack, &billing.inbox(), &[]).await?;
    app::wait_streaming(&relay).await?;
    let ledger = oracle::wait_ledger_clean(&stack, 5, WAIT).await?;
    assert_eq!(
        ledger,
        Ledger {
            committed: 5,
            invoices: 5,
            ..Ledger::default()
        }
    );
    Ok(())
}

/// The relay's clock stepped while it runs, as an NTP step does: started
/// on the true time, stepped ten minutes ahead, then back. After each step
/// the 20 events delivered have their true latency (a mean under 5 s),
/// never 600 s or 0, and the gauge follows the step within seconds.
///
/// Fails without the steady timeline: after the forward step the 20
/// events' mean commit-to-delivery latency was about 600 s (the skew
/// estimate, the least sample of the last minute, kept the value from
/// before the step for up to a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_while_the_relay_runs_does_not_skew_delivery_latency() -> anyhow::Result<()>
{
    let lib = faketime()?;
    let dir = tempfile::tempdir()?;
    let spec = dir.path().join("faketime");
    std::fs::write(&spec, "+0\n")?;
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let spec_path = spec.display().to_string();
    let env = [
        ("EVENT_SECRET", TEST_SECRET),
        ("LD_PRELOAD", lib.as_str()),
        // libfaketime reads the offset from the file at most a second old.
        ("FAKETIME_TIMESTAMP_FILE", spec_path.as_str()),
        ("FAKETIME_CACHE_DURATION", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let relay = app::start_relay_with_env(&stack, &stack.relay_url, &sink.url, &[], &env).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    for (offset, sign) in [("+10m", 1.0), ("+0", 0.0)] {
        let before = relay.metrics().await?;
        let (count0, sum0) = (
            before.sum("cdc_relay_commit_to_delivery_seconds_count"),
            before.sum("cdc_relay_commit_to_delivery_seconds_sum"),
        );
        std::fs::write(&spec, format!("{offset}\n"))?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        for _ in 0..20 {
            app::insert_order_event(&db).await?;
        }
        // Counted by the relay once it read each 2xx (the sink counts a
        // request before it answers).
        wait_until("20 more deliveries measured", WAIT, || async {
            anyhow::Ok(
                relay
                    .metrics()
                    .await?
                    .sum("cdc_relay_commit_to_delivery_seconds_count")
                    >= count0 + 20.0,
            )
        })
        .await?;
        let m = relay.metrics().await?;
        let count = m.sum("cdc_relay_commit_to_delivery_seconds_count") - count0;
        let sum = m.sum("cdc_relay_commit_to_delivery_seconds_sum") - sum0;
        let skew = m
            .value("cdc_relay_clock_skew_seconds", &[])
            .unwrap_or(f64::NAN);
        eprintln!(
            "stepped to {offset}: skew {skew:.1} s; {count} deliveries, latency sum {sum:.3} s"
        );
        assert!(count >= 20.0, "{count}");
        assert!(
            sum > 0.0 && sum / count < 5.0,
            "stepped to {offset}: the mean commit-to-delivery latency is {:.3} s over {count} events: the step shows",
            sum / count
        );
        assert!(
            (skew - sign * 600.0).abs() < 30.0,
            "stepped to {offset}: the skew gauge reads {skew:.1} s"
        );
    }
    Ok(())
}

/// `cdc-relay status` on a host whose clock is stepped ten minutes ahead,
/// then behind: it reads the server's clock over its side connection and
/// warns, naming the clock, the direction and NTP, in text and in
/// `--json`'s `warnings`; on the true time it says nothing of the clock.
///
/// Before, only a running relay (its gauge and WARN) and the 401 hint
/// named a stepped clock; `status` said "healthy" or named other things.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_a_clock_stepped_against_the_servers() -> anyhow::Result<()> {
    let lib = faketime()?;
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let status = |args: &'static [&'static str], env: Vec<(String, String)>| {
        let stack = &stack;
        async move {
            let env: Vec<(&str, &str)> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            app::relay_command(stack, &stack.relay_url, args, &env).await
        }
    };
    for (offset, way) in [("+10m", "ahead of"), ("-10m", "behind")] {
        let out = status(&["status"], stepped(&lib, offset)).await?;
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with("warning: this machine's clock is"))
            .unwrap_or_default();
        assert!(
            line.contains(&format!(" s {way} the database server's")) && line.contains("NTP"),
            "{offset}: {}",
            out.text()
        );
        let json = status(&["status", "--json"], stepped(&lib, offset)).await?;
        let v: serde_json::Value = serde_json::from_str(&json.stdout)
            .with_context(|| format!("status --json: {}", json.text()))?;
        let warned = v["warnings"].as_array().is_some_and(|w| {
            w.iter().any(|w| {
                w.as_str()
                    .is_some_and(|w| w.contains(&format!(" s {way} the database server's")))
            })
        });
        assert!(warned, "{offset}: {}", json.stdout);
    }
    let out = status(&["status", "--json"], Vec::new()).await?;
    assert!(
        !out.stdout.contains("machine's clock"),
        "on the true time: {}",
        out.text()
    );
    Ok(())
}

/// The other half of the rule: Billing refusing a wrong event secret on
/// the true time (its answer names the `webhook-timestamp` it signed
/// over, without refusing it) gets the secret hint, not the clock's.
/// (The hint said "check this machine's clock …, not the event secret".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_refusing_a_wrong_secret_gets_the_secret_hint() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let billing = app::start_billing(&stack, TEST_SECRET).await?;
    let wrong = "another-secret-of-thirty-two-bytes-or-more";
    let relay = app::start_relay_with_env(
        &stack,
        &stack.relay_url,
        &billing.inbox(),
        &[],
        &[("EVENT_SECRET", wrong)],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    app::insert_order_event(&db).await?;
    let line = circuit_opened(&relay).await?;
    assert!(
        line.contains("check the event secret") && !line.contains("clock"),
        "the hint must name the secret: {line}"
    );
    Ok(())
}

/// The relay's log line that says the circuit opened on a refusal of the
/// relay itself (a 401), once it is there.
async fn circuit_opened(relay: &app::Running) -> anyhow::Result<String> {
    const OPENED: &str = "circuit opened: the sink rejects the relay itself";
    wait_until("the circuit opened on the 401", WAIT, || async {
        relay.process.logs().contains(OPENED)
    })
    .await?;
    let logs = relay.process.logs();
    Ok(logs
        .lines()
        .find(|l| l.contains(OPENED))
        .expect("found above")
        .to_owned())
}
