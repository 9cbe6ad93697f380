//! Signatures on the wire (issue 14) and the secret syntax (issue 18): the
//! real relay signing for a scripted sink that checks every header against
//! the specification (HMACs computed here), the real Billing verifying, both
//! reloading their secrets on SIGHUP, and both refusing the same bad
//! secrets at startup. The official verifiers' view is in `interop.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use harness::app::{self, Running, TEST_SECRET};
use harness::sink::{Received, ScriptedSink, new_whsec, sign, sign_key, sign_standard, whsec_key};
use harness::{PgCluster, ServiceProcess, Stack, bins, wait_until};
use reqwest::StatusCode;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

/// A plain secret (its bytes are the key) of 40 bytes.
const PLAIN: &str = "plain-event-secret-5b8e2f0c7d1a9e4b6c3f";

mod reload;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path)
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str().context("non-UTF-8 temp path")
}

/// A fresh stack with its slot, and a scripted sink.
async fn stack_and_sink() -> anyhow::Result<(Stack, ScriptedSink)> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    Ok((stack, ScriptedSink::start().await?))
}

/// The relay streaming into `sink` with the secret settings `secrets`.
async fn relay(
    stack: &Stack,
    sink: &ScriptedSink,
    args: &[&str],
    secrets: &[(&str, &str)],
) -> anyhow::Result<Running> {
    let relay =
        app::start_relay_with_env(stack, &stack.relay_url, &sink.url, args, secrets).await?;
    app::wait_streaming(&relay).await?;
    Ok(relay)
}

/// Every request the sink got for event `id`, in arrival order.
fn requests_for(sink: &ScriptedSink, id: Uuid) -> Vec<Received> {
    let id = id.to_string();
    sink.received()
        .into_iter()
        .filter(|r| r.id() == id)
        .collect()
}

async fn wait_delivered(sink: &ScriptedSink, id: Uuid) -> anyhow::Result<Received> {
    let what = format!("event {id} delivered");
    wait_until(&what, WAIT, || async {
        requests_for(sink, id)
            .iter()
            .any(|r| (200..300).contains(&r.status))
    })
    .await?;
    requests_for(sink, id)
        .into_iter()
        .find(|r| (200..300).contains(&r.status))
        .context("delivered")
}

async fn reloads(relay: &Running, result: &str) -> anyhow::Result<f64> {
    Ok(relay
        .metrics()
        .await?
        .value("cdc_relay_secret_reloads_total", &[("result", result)])
        .unwrap_or(0.0))
}

async fn wait_reloads(relay: &Running, result: &str, n: f64) -> anyhow::Result<()> {
    let what = format!("{n} secret reload(s) with result {result}");
    wait_until(&what, WAIT, || async {
        reloads(relay, result).await.map(|v| v >= n)
    })
    .await
}

/// The `webhook-signature` entries of `r` each key makes, in order: e.g.
/// `[Some(0), Some(1)]` when the first key signed entry 0 and the second
/// entry 1. Also checks the entry count.
fn signed_by(r: &Received, keys: &[&[u8]]) -> Vec<Vec<usize>> {
    keys.iter().map(|k| r.standard_matches(k)).collect()
}

/// With the current secret in the Standard Webhooks form and the previous
/// one plain, every request carries X-Event-Signature under the current key
/// and webhook-id (= the body's id = Idempotency-Key), webhook-timestamp
/// (the attempt's time) and one webhook-signature entry per key, current
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_signed_both_ways_and_during_a_rotation_by_both_keys() -> anyhow::Result<()>
{
    let (stack, sink) = stack_and_sink().await?;
    let current = new_whsec();
    let relay = relay(
        &stack,
        &sink,
        &[],
        &[("EVENT_SECRET", &current), ("EVENT_SECRET_PREVIOUS", PLAIN)],
    )
    .await?;
    let db = stack.orders_admin().await?;
    let before = unix_now();
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(app::insert_order_event(&db).await?);
    }
    let mut delivered = Vec::new();
    for id in &ids {
        delivered.push(wait_delivered(&sink, *id).await?);
    }
    let after = unix_now();
    let key = whsec_key(&current);
    for (id, r) in ids.iter().zip(&delivered) {
        let w = r.webhook.as_ref().context("webhook headers")?;
        assert_eq!(w.id, id.to_string());
        assert_eq!(r.idempotency_key.as_deref(), Some(w.id.as_str()));
        let ts = w.unix_seconds().context("webhook-timestamp in seconds")?;
        assert!(
            (before..=after).contains(&ts),
            "{ts} not in {before}..={after}"
        );
        assert_eq!(w.entries().count(), 2, "{}", w.signature);
        assert_eq!(
            signed_by(r, &[&key, PLAIN.as_bytes()]),
            [vec![0], vec![1]],
            "{}",
            w.signature
        );
        assert_eq!(
            r.signature.as_deref(),
            Some(sign_key(&key, &r.body).as_str())
        );
    }
    drop(relay);
    Ok(())
}

/// A retry is a new attempt: the same body bytes and the same legacy
/// signature, but a fresh webhook-timestamp and a webhook-signature made
/// over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_carries_a_fresh_timestamp_and_signature_over_the_same_body() -> anyhow::Result<()>
{
    let (stack, sink) = stack_and_sink().await?;
    let _relay = relay(&stack, &sink, &[], &[("EVENT_SECRET", TEST_SECRET)]).await?;
    let db = stack.orders_admin().await?;
    let id = Uuid::new_v4();
    sink.reject(&id.to_string(), 503);
    app::insert_order_event_with_id(&db, id).await?;
    wait_until("a first, refused attempt", WAIT, || async {
        !requests_for(&sink, id).is_empty()
    })
    .await?;
    let first = requests_for(&sink, id)[0].clone();
    let first_ts = first
        .webhook
        .as_ref()
        .and_then(|w| w.unix_seconds())
        .context("timestamp")?;
    // Time is the subject: let the clock pass the first attempt's second.
    while unix_now() <= first_ts {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sink.clear_rejections();
    let last = wait_delivered(&sink, id).await?;
    let all = requests_for(&sink, id);
    assert!(all.len() >= 2, "{} attempts", all.len());
    for r in &all {
        assert_eq!(r.body, first.body, "the body is built once");
        assert_eq!(r.signature, first.signature, "the legacy signature too");
        assert_eq!(
            r.standard_matches(TEST_SECRET.as_bytes()),
            [0],
            "each attempt signed over its own timestamp: {:?}",
            r.webhook
        );
    }
    let last_w = last.webhook.as_ref().context("webhook headers")?;
    assert!(
        last_w.unix_seconds() > Some(first_ts),
        "{} then {}",
        first_ts,
        last_w.timestamp
    );
    assert_ne!(
        last_w.signature,
        first.webhook.as_ref().context("webhook")?.signature
    );
    Ok(())
}

/// `--signature-scheme legacy` sends only X-Event-Signature;
/// `--signature-scheme standard` only the Standard Webhooks headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_signature_scheme_sends_only_its_headers() -> anyhow::Result<()> {
    let (stack, sink) = stack_and_sink().await?;
    let db = stack.orders_admin().await?;
    let secret = [("EVENT_SECRET", TEST_SECRET)];
    for scheme in ["legacy", "standard"] {
        let mut relay = relay(&stack, &sink, &["--signature-scheme", scheme], &secret).await?;
        let id = app::insert_order_event(&db).await?;
        let r = wait_delivered(&sink, id).await?;
        match scheme {
            "legacy" => {
                assert!(r.signature_valid(TEST_SECRET), "{r:?}");
                assert!(r.webhook.is_none(), "{r:?}");
            }
            _ => {
                assert!(r.signature.is_none(), "{r:?}");
                assert_eq!(r.standard_matches(TEST_SECRET.as_bytes()), [0], "{r:?}");
            }
        }
        relay.process.sigterm();
        relay.process.wait_exit(WAIT).await?;
    }
    Ok(())
}

/// Issue 18, items 5 and 6: the relay and Billing read the secret settings
/// with one syntax, so they refuse the same inputs at startup, with the
/// same message naming the setting, and exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_billing_refuse_the_same_bad_secrets_naming_the_setting() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let dir = tempfile::tempdir()?;
    let two_lines = write(dir.path(), "two", &format!("{PLAIN}\n{TEST_SECRET}\n"))?;
    let one_line = write(dir.path(), "one", PLAIN)?;
    let list = format!("{PLAIN},{TEST_SECRET}");
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("EVENT_SECRET", "a")],
            "EVENT_SECRET is 1 bytes long; a secret needs at least 32",
        ),
        (
            vec![("EVENT_SECRET", &list)],
            "EVENT_SECRET contains a comma",
        ),
        (
            vec![("EVENT_SECRET", "whsec_MDEyMzQ1Njc4OWFiY2RlZg==")],
            "EVENT_SECRET: the whsec_ key decodes to 16 bytes; the Standard Webhooks specification requires at least 24",
        ),
        (
            vec![("EVENT_SECRET", "whsec_MDEyMzQ1Njc4OWFiY2RlZg")],
            "EVENT_SECRET starts with whsec_ but the rest is not padded standard base64",
        ),
        (
            vec![("EVENT_SECRET_FILE", path_str(&two_lines)?)],
            "has 2 lines of text: it holds exactly one secret",
        ),
        (
            vec![
                ("EVENT_SECRET", PLAIN),
                ("EVENT_SECRET_FILE", path_str(&one_line)?),
            ],
            "EVENT_SECRET and EVENT_SECRET_FILE are both set",
        ),
        (
            vec![("EVENT_SECRET", PLAIN), ("EVENT_SECRET_PREVIOUS", PLAIN)],
            "EVENT_SECRET_PREVIOUS is the same key as EVENT_SECRET",
        ),
        (
            vec![("EVENT_SECRET_PREVIOUS", PLAIN)],
            "no event secret configured: set EVENT_SECRET or EVENT_SECRET_FILE",
        ),
        (
            vec![
                ("EVENT_SECRET", TEST_SECRET),
                ("EVENT_SECRET_PREVIOUS", "b,c"),
            ],
            "EVENT_SECRET_PREVIOUS contains a comma",
        ),
    ];
    for (env, message) in cases {
        let relay = app::refused_run(&stack, &stack.relay_url, &[], &env).await?;
        assert_eq!(
            relay.code(),
            Some(2),
            "relay: a configuration error, {env:?}: {}",
            relay.text()
        );
        assert!(
            relay.stderr.contains(message),
            "relay, {env:?}: {}",
            relay.text()
        );

        let mut command = std::process::Command::new(bins::path("billing"));
        command
            .args([
                "--listen",
                "127.0.0.1:0",
                "--database-url",
                &stack.billing_app_url,
            ])
            .env_remove("EVENT_SECRET")
            .envs(env.iter().copied());
        let mut billing = ServiceProcess::from_command(command)?;
        let status = billing.wait_exit(WAIT).await?;
        assert_eq!(
            status.code(),
            Some(2),
            "billing, {env:?}: {}",
            billing.logs()
        );
        billing
            .wait_for_line(message, Duration::from_secs(5))
            .await?;
        assert!(!billing.logs().contains(::harness::process::LISTENING));
    }
    Ok(())
}

/// Billing end to end on the Standard Webhooks scheme alone: the relay's
/// requests are invoiced; a request signed with the right key but a
/// timestamp outside `--timestamp-tolerance-secs` is refused with 401
/// `timestamp_outside_tolerance` saying by how much; one signed only the
/// legacy way is refused saying which headers to send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_on_standard_only_invoices_the_relays_events_and_refuses_stale_ones_saying_why()
-> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let secret = new_whsec();
    let key = whsec_key(&secret);
    let billing = app::start_billing_with(
        &stack,
        &[
            "--signature-scheme",
            "standard",
            "--timestamp-tolerance-secs",
            "120",
        ],
        &[("EVENT_SECRET", &secret)],
    )
    .await?;
    let relay = app::start_relay_with_env(
        &stack,
        &stack.relay_url,
        &billing.inbox(),
        &["--signature-scheme", "standard"],
        &[("EVENT_SECRET", &secret)],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    for _ in 0..10 {
        app::insert_order_event(&db).await?;
    }
    let billing_db = stack.billing_admin().await?;
    wait_until("10 invoices", WAIT, || async {
        billing_db
            .query_one("SELECT count(*) FROM invoices", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 10)
            .unwrap_or(false)
    })
    .await?;
    let verified = billing.metrics().await?;
    assert_eq!(
        verified.value(
            "billing_signatures_verified_total",
            &[("scheme", "standard")]
        ),
        Some(10.0)
    );

    let http = reqwest::Client::new();
    let post = |ts: u64, standard: bool| {
        let id = Uuid::new_v4().to_string();
        let body = serde_json::json!({
            "id": id, "type": "OrderCreated",
            "data": {"order_id": Uuid::new_v4(), "amount_cents": 100, "currency": "EUR"}
        })
        .to_string();
        let mut request = http
            .post(billing.inbox())
            .header("content-type", "application/json")
            .header("x-event-signature", sign_key(&key, body.as_bytes()));
        if standard {
            let ts = ts.to_string();
            request = request
                .header("webhook-id", &id)
                .header("webhook-timestamp", &ts)
                .header(
                    "webhook-signature",
                    sign_standard(&key, &id, &ts, body.as_bytes()),
                );
        }
        request.body(body).send()
    };
    let now = unix_now();
    assert_eq!(post(now - 60, true).await?.status(), StatusCode::NO_CONTENT);
    // 200 s: inside the library's own 300 s window, outside Billing's 120.
    for (ts, why) in [(now - 200, "s old"), (now + 200, "s in the future")] {
        let response = post(ts, true).await?;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let body: serde_json::Value = response.json().await?;
        assert_eq!(body["error"], "timestamp_outside_tolerance", "{body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains(why) && detail.contains("within 120 s"),
            "{detail}"
        );
    }
    let response = post(now, false).await?;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let body: serde_json::Value = response.json().await?;
    assert_eq!(body["error"], "invalid_signature");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("--signature-scheme standard"),
        "{body}"
    );
    Ok(())
}
