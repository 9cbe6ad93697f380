//! Observability as an operator meets it: the relay's `/metrics` names every
//! documented series in valid Prometheus text, `/readyz` follows progress,
//! no process logs a secret, a password or a payload, and the dashboard and
//! alert rules in `deploy/` reference only metrics that exist.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use cdc_relay::metrics::OUTCOMES;
use cdc_relay::sink::{REASONS, STATUS_CLASSES};
use harness::app::{self, CommandOutput};
use harness::oracle::{self, Ledger};
use harness::prom::{Exposition, is_metric_name};
use harness::proxy::Mode;
use harness::sink::ScriptedSink;
use harness::{Inbox, PgCluster, Scenario, ServiceProcess, Stack, bins};

const WAIT: Duration = Duration::from_secs(30);

/// Log filter for every process in the no-leak test: everything at debug,
/// except `tokio_postgres::query`, which logs each statement's parameters
/// at debug (the relay's dead-letter insert carries the payload, the
/// services' inserts the order). The processes should clamp that module
/// themselves whatever the filter says; until they do, the test does.
const DEBUG_FILTER: &str = "debug";

/// Every relay metric the issue names, with its Prometheus type, so docs,
/// dashboards and alerts can rely on them.
/// The per-endpoint families (`cdc-relay/src/endpoint_metrics.rs`),
/// present with `--sink-url` too under `endpoint="default"`.
const DOCUMENTED_PER_ENDPOINT: [(&str, &str); 8] = [
    ("cdc_relay_endpoint_events_delivered_total", "counter"),
    ("cdc_relay_endpoint_events_dead_lettered_total", "counter"),
    ("cdc_relay_endpoint_retries_total", "counter"),
    ("cdc_relay_endpoint_in_flight", "gauge"),
    ("cdc_relay_endpoint_pending_events", "gauge"),
    (
        "cdc_relay_endpoint_oldest_pending_event_age_seconds",
        "gauge",
    ),
    ("cdc_relay_endpoint_circuit_state", "gauge"),
    ("cdc_relay_endpoint_retired", "gauge"),
];

const DOCUMENTED: [(&str, &str); 30] = [
    ("cdc_relay_events_received_total", "counter"),
    ("cdc_relay_events_delivered_total", "counter"),
    ("cdc_relay_events_dead_lettered_total", "counter"),
    ("cdc_relay_delivery_attempts_total", "counter"),
    ("cdc_relay_request_duration_seconds", "histogram"),
    ("cdc_relay_commit_to_delivery_seconds", "histogram"),
    ("cdc_relay_in_flight", "gauge"),
    ("cdc_relay_received_lsn", "gauge"),
    ("cdc_relay_confirmed_lsn", "gauge"),
    ("cdc_relay_server_wal_lsn", "gauge"),
    ("cdc_relay_slot_lag_bytes", "gauge"),
    ("cdc_relay_slot_safe_wal_size_bytes", "gauge"),
    ("cdc_relay_slot_wal_status", "gauge"),
    ("cdc_relay_oldest_unconfirmed_event_age_seconds", "gauge"),
    ("cdc_relay_circuit_state", "gauge"),
    ("cdc_relay_reconnects_total", "counter"),
    ("cdc_relay_standby", "gauge"),
    ("cdc_relay_status_updates_total", "counter"),
    ("cdc_relay_pending_events", "gauge"),
    // Issue 12: publication membership and the stream's silence.
    ("cdc_relay_publication_includes_outbox", "gauge"),
    ("cdc_relay_publication_gaps_total", "counter"),
    ("cdc_relay_seconds_since_server_message", "gauge"),
    // Issue 14: secret reloads on SIGHUP.
    ("cdc_relay_secret_reloads_total", "counter"),
    // Issue 19: which build runs; dead letters waiting.
    ("cdc_relay_build_info", "gauge"),
    ("cdc_relay_dead_letters_waiting", "gauge"),
    // Issue 17: retention (0 unless run --prune-older-than).
    ("cdc_relay_pruned_rows_total", "counter"),
    ("cdc_relay_outbox_table_size_bytes", "gauge"),
    // Issue 30: this machine's clock against the server's.
    ("cdc_relay_clock_skew_seconds", "gauge"),
    // Issue 30: a server that withholds the stream.
    ("cdc_relay_stream_withheld", "gauge"),
    // Issue 30: publication gaps healed (--on-gap backfill).
    ("cdc_relay_gaps_healed_total", "counter"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_delivery_name_every_documented_series() -> anyhow::Result<()> {
    let s = Scenario::plan(Inbox::ScriptedBilling)
        .orders()
        .start()
        .await?;
    let (stack, relay, orders, billing) = (&s.stack, &s.relay, s.orders(), s.billing());
    // Billing behind a scripted proxy: one 503 first, so retry series exist.
    let proxy = s.sink();
    proxy.set_status(503);

    let http = reqwest::Client::new();
    app::post_order(&http, &orders.url, 2599).await?;
    harness::wait_until("a refused first attempt", WAIT, || async {
        proxy.count() >= 1
    })
    .await?;
    proxy.set_status(204);
    oracle::wait_ledger_clean(stack, 1, WAIT).await?;

    // A reconnect, so the cause-labelled counter has a series to show.
    terminate_walsender(stack).await?;
    harness::wait_until("a counted reconnect", WAIT, || async {
        Ok::<_, anyhow::Error>(relay.metrics().await?.sum("cdc_relay_reconnects_total") >= 1.0)
    })
    .await?;
    harness::wait_until("periodic status updates counted", WAIT, || async {
        let m = relay.metrics().await?;
        Ok::<_, anyhow::Error>(
            m.value("cdc_relay_status_updates_total", &[("cause", "interval")])
                .is_some_and(|v| v >= 1.0),
        )
    })
    .await?;

    let resp = http.get(format!("{}/metrics", relay.url)).send().await?;
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let m = Exposition::parse(&resp.text().await?)?;
    for (name, kind) in DOCUMENTED {
        assert_eq!(m.kind(name), Some(kind), "{name} missing or not a {kind}");
        assert!(m.has_samples(name), "{name} has no samples");
    }
    for (name, kind) in DOCUMENTED_PER_ENDPOINT {
        assert_eq!(m.kind(name), Some(kind), "{name} missing or not a {kind}");
        assert_eq!(
            m.label_values(name, "endpoint"),
            BTreeSet::from(["default".to_owned()]),
            "{name}: one endpoint, `default`, with --sink-url"
        );
    }
    assert_eq!(
        m.value(
            "cdc_relay_endpoint_events_delivered_total",
            &[("endpoint", "default")]
        ),
        Some(m.sum("cdc_relay_events_delivered_total")),
        "with one endpoint its series is the relay-wide one"
    );
    assert!(m.sum("cdc_relay_events_received_total") >= 1.0);
    assert!(m.sum("cdc_relay_events_delivered_total") >= 1.0);
    let commits = m.label_values("cdc_relay_build_info", "commit");
    assert_eq!(commits.len(), 1, "one build: {commits:?}");
    assert!(
        commits
            .iter()
            .all(|c| c.len() == 12 && c.chars().all(|c| c.is_ascii_hexdigit())),
        "the build's git commit: {commits:?}"
    );
    assert!(
        m.value(
            "cdc_relay_delivery_attempts_total",
            &[("outcome", "delivered"), ("status_class", "2xx")]
        )
        .is_some_and(|v| v >= 1.0)
    );
    assert!(
        m.value(
            "cdc_relay_delivery_attempts_total",
            &[("outcome", "retry"), ("status_class", "5xx")]
        )
        .is_some_and(|v| v >= 1.0)
    );
    // The 503 counts under its class (the exact status is in the logs).
    assert!(
        m.value("cdc_relay_retries_total", &[("reason", "http_5xx")])
            .is_some_and(|v| v >= 1.0)
    );
    for status in ["reserved", "extended", "unreserved", "lost"] {
        assert!(
            m.value("cdc_relay_slot_wal_status", &[("status", status)])
                .is_some(),
            "wal_status {status}"
        );
    }
    assert_eq!(
        m.value("cdc_relay_slot_wal_status", &[("status", "reserved")]),
        Some(1.0)
    );
    assert!(
        m.value(
            "cdc_relay_status_updates_total",
            &[("cause", "keepalive_reply")]
        )
        .is_some()
    );
    // Buckets 0.5 ms … 60 s, as the issue asks.
    let les = m.label_values("cdc_relay_commit_to_delivery_seconds_bucket", "le");
    for le in ["0.0005", "60", "+Inf"] {
        assert!(les.contains(le), "bucket le={le} in {les:?}");
    }
    assert!(m.sum("cdc_relay_commit_to_delivery_seconds_count") >= 1.0);

    // The services expose their own request counters and latency histograms.
    for (svc, running) in [("orders", &orders), ("billing", &billing)] {
        let s = running.metrics().await?;
        for (suffix, kind) in [
            ("http_requests_total", "counter"),
            ("http_request_duration_seconds", "histogram"),
        ] {
            let name = format!("{svc}_{suffix}");
            assert_eq!(s.kind(&name), Some(kind), "{name}");
        }
    }

    // Every metric the dashboard and the alert rules use is exposed for real.
    let mut exposed: BTreeSet<String> = m.families().map(str::to_owned).collect();
    for running in [&orders, &billing] {
        exposed.extend(running.metrics().await?.families().map(str::to_owned));
    }
    // `cdc_relay_halted` has a series only in a halted relay:
    // infra_faults::invalidated_slot_exits_with_code_4_and_recovery_steps
    // checks it there, against the series the alert tests feed.
    for (file, name) in deploy_metric_references()? {
        assert!(
            exposed.contains(&name) || name == "cdc_relay_halted",
            "{file} uses {name}, which no process exposes"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_ready_while_streaming_and_not_while_events_are_stuck() -> anyhow::Result<()> {
    // A circuit that never opens: readiness must fail on progress alone.
    let s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--ready-window", "2s", "--failure-threshold", "1000000"])
        .start()
        .await?;
    let (sink, relay) = (s.sink(), &s.relay);
    let http = reqwest::Client::new();
    let probe = |path: &'static str| {
        let http = http.clone();
        let url = format!("{}{path}", relay.url);
        async move {
            let r = http.get(url).send().await?;
            Ok::<_, anyhow::Error>((r.status().as_u16(), r.text().await?))
        }
    };
    harness::wait_until("/readyz 200 while streaming", WAIT, || async {
        probe("/readyz").await.map(|(s, _)| s == 200)
    })
    .await?;
    // Time is the subject: idle for longer than the 2 s ready window, and
    // still ready, because nothing pending counts as progress.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(probe("/readyz").await?.0, 200, "an idle relay is ready");

    sink.set_status(503);
    let event = insert_event(&s.db, serde_json::json!({})).await?;
    harness::wait_until("the sink sees the event", WAIT, || async {
        sink.count() >= 1
    })
    .await?;
    harness::wait_until("/readyz 503 with the event stuck", WAIT, || async {
        probe("/readyz").await.map(|(s, _)| s == 503)
    })
    .await?;
    let (_, why) = probe("/readyz").await?;
    assert!(why.contains("ready window"), "{why}");
    assert_eq!(probe("/healthz").await?.0, 200, "stuck is still alive");
    assert_eq!(
        relay.metrics().await?.value("cdc_relay_circuit_state", &[]),
        Some(0.0),
        "not ready because of progress, not the circuit: {why}"
    );
    // The age gauge is refreshed every second.
    harness::wait_until("the stuck event's age past the window", WAIT, || async {
        let m = relay.metrics().await?;
        Ok::<_, anyhow::Error>(
            m.value("cdc_relay_oldest_unconfirmed_event_age_seconds", &[])
                .is_some_and(|age| age >= 2.0),
        )
    })
    .await?;

    sink.set_status(204);
    harness::wait_until("/readyz 200 after the event went out", WAIT, || async {
        probe("/readyz").await.map(|(s, _)| s == 200)
    })
    .await?;
    assert!(sink.delivered().iter().any(|r| r.id() == event.to_string()));
    harness::wait_until("the age gauge back to 0", WAIT, || async {
        let m = relay.metrics().await?;
        Ok::<_, anyhow::Error>(
            m.value("cdc_relay_oldest_unconfirmed_event_age_seconds", &[]) == Some(0.0),
        )
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_process_logs_a_secret_a_password_or_a_payload() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    let marker = format!("payload-marker-{}", uuid::Uuid::new_v4().simple());
    let secret = format!("event-secret-{}", uuid::Uuid::new_v4().simple());
    let mut forbidden = vec![secret.clone(), cluster.superuser_password().to_owned()];
    for url in [
        &stack.orders_app_url,
        &stack.billing_app_url,
        &stack.relay_url,
        &stack.orders_admin_url,
    ] {
        let password = reqwest::Url::parse(url)?
            .password()
            .context("stack URLs carry a password")?
            .to_owned();
        forbidden.push(password);
    }

    // Secrets as systemd hands them over: files, named by *_FILE variables.
    let dir = tempfile::tempdir()?;
    let secret_file = write_private(dir.path(), "event-secret", &secret)?;
    let relay_password = reqwest::Url::parse(&stack.relay_url)?
        .password()
        .context("relay URL password")?
        .to_owned();
    let password_file = write_private(dir.path(), "db-password", &relay_password)?;
    let mut relay_url = reqwest::Url::parse(&stack.relay_url)?;
    relay_url
        .set_password(None)
        .map_err(|()| anyhow::anyhow!("cannot strip the password"))?;

    let mut outputs: Vec<(String, String)> = Vec::new();
    let setup = relay_command(&stack, &stack.orders_admin_url, &["setup"]).await?;
    anyhow::ensure!(setup.success(), "setup: {setup:?}");
    outputs.push(("cdc-relay setup".into(), setup.text()));

    let json = ["--log-format", "json"];
    let mut billing = ServiceProcess::spawn(
        bins::path("billing"),
        &[&["--listen", "127.0.0.1:0"][..], &json].concat(),
        &[
            ("BILLING_DATABASE_URL", stack.billing_app_url.as_str()),
            ("EVENT_SECRET_FILE", path_str(&secret_file)?),
            ("RUST_LOG", DEBUG_FILTER),
        ],
    )?;
    let billing_url = billing.listen_addr(WAIT).await?;
    let mut orders = ServiceProcess::spawn(
        bins::path("orders"),
        &[&["--listen", "127.0.0.1:0"][..], &json].concat(),
        &[
            ("ORDERS_DATABASE_URL", stack.orders_app_url.as_str()),
            ("RUST_LOG", DEBUG_FILTER),
        ],
    )?;
    let orders_url = orders.listen_addr(WAIT).await?;
    let mut argv = app::relay_globals(&stack);
    let sink_url = format!("{billing_url}/inbox");
    argv.extend(
        [
            "--log-format",
            "json",
            "--log",
            DEBUG_FILTER,
            "run",
            "--sink-url",
            &sink_url,
            "--admin-listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut relay = ServiceProcess::spawn(
        bins::path("cdc-relay"),
        &argv,
        &[
            ("CDC_RELAY_DATABASE_URL", relay_url.as_str()),
            (
                "CDC_RELAY_DATABASE_PASSWORD_FILE",
                path_str(&password_file)?,
            ),
            ("EVENT_SECRET_FILE", path_str(&secret_file)?),
        ],
    )?;
    let admin_url = relay.listen_addr(WAIT).await?;
    relay.wait_for_line("streaming", WAIT).await?;

    // One order through the API, one event carrying the marker that Billing
    // accepts (it ignores unknown keys), one that it refuses as poison.
    let http = reqwest::Client::new();
    app::post_order(&http, &orders_url, 1234).await?;
    let db = stack.orders_admin().await?;
    let delivered = insert_event(&db, serde_json::json!({ "note": marker })).await?;
    let poison = insert_event(
        &db,
        serde_json::json!({ "note": marker, "amount_cents": -1 }),
    )
    .await?;
    harness::wait_until(
        "two invoices, the poison event not invoiced",
        WAIT,
        || async {
            let l = Ledger::read(&stack).await?;
            Ok::<_, anyhow::Error>(
                l.committed == 3
                    && l.invoices == 2
                    && l.lost == 1
                    && l.duplicate_effects == 0
                    && l.phantom == 0,
            )
        },
    )
    .await?;
    harness::wait_until("the poison event dead-lettered", WAIT, || async {
        let m = harness::prom::scrape(&http, &admin_url).await?;
        Ok::<_, anyhow::Error>(m.sum("cdc_relay_events_dead_lettered_total") >= 1.0)
    })
    .await?;

    // A failed login must not print the password it tried either.
    let wrong = format!("wrong-password-{}", uuid::Uuid::new_v4().simple());
    forbidden.push(wrong.clone());
    let mut wrong_url = reqwest::Url::parse(&stack.relay_url)?;
    wrong_url
        .set_password(Some(&wrong))
        .map_err(|()| anyhow::anyhow!("cannot set a password"))?;
    let status = relay_command(&stack, wrong_url.as_str(), &["status"]).await?;
    anyhow::ensure!(!status.success(), "status with a wrong password");
    outputs.push(("cdc-relay status".into(), status.text()));

    for p in [&mut relay, &mut orders, &mut billing] {
        p.sigterm();
        p.wait_exit(WAIT).await?;
    }
    let relay_log = relay.logs();
    assert!(
        relay_log.contains(&delivered.to_string()) && relay_log.contains(&poison.to_string()),
        "the relay logs event ids (so this test looks at real logs)\n{relay_log}"
    );
    for (name, p) in [
        ("cdc-relay run", &relay),
        ("orders", &orders),
        ("billing", &billing),
    ] {
        assert_json_lines(name, &fs_read(&p.log_dir().join("stderr.log"))?);
        outputs.push((name.to_owned(), p.logs()));
    }
    // Stdout (the `listening on` and `admin endpoint on` lines) is in the
    // format too.
    for (name, p) in [
        ("cdc-relay run", &relay),
        ("orders", &orders),
        ("billing", &billing),
    ] {
        assert_json_lines(
            &format!("{name} (stdout)"),
            &fs_read(&p.log_dir().join("stdout.log"))?,
        );
    }
    for (name, text) in &outputs {
        for needle in forbidden.iter().chain([&marker]) {
            assert!(
                !text.contains(needle.as_str()),
                "{name} logged {needle:?}:\n{text}"
            );
        }
    }
    Ok(())
}

/// The dashboard and the alert rules name only metrics the relay registers
/// (or the services' documented ones); a static check that needs no server.
#[test]
fn deploy_files_reference_only_registered_metrics() -> anyhow::Result<()> {
    let source = fs_read(&repo().join("cdc-relay/src/metrics.rs"))?
        + &fs_read(&repo().join("cdc-relay/src/endpoint_metrics.rs"))?;
    let mut registered: BTreeSet<String> = BTreeSet::new();
    for token in source.split('"') {
        if is_metric_name(token) && token.starts_with("cdc_relay_") {
            registered.insert(token.to_owned());
        }
    }
    for (name, _) in DOCUMENTED.iter().chain(&DOCUMENTED_PER_ENDPOINT) {
        assert!(registered.contains(*name), "metrics.rs registers {name}");
    }
    let services = ["orders", "billing"].into_iter().flat_map(|svc| {
        [
            format!("{svc}_http_requests_total"),
            format!("{svc}_http_request_duration_seconds"),
        ]
    });
    registered.extend(services);
    registered.extend([
        "orders_created_total".into(),
        "billing_invoices_created_total".into(),
    ]);
    registered.insert("billing_duplicates_absorbed_total".into());
    // The trace export's counters, registered under each process's prefix.
    let export = fs_read(&repo().join("trace-context/src/export.rs"))?;
    for token in export.split('"') {
        if let Some(rest) = token.strip_prefix("{prefix}_trace_") {
            for prefix in ["cdc_relay", "orders", "billing"] {
                registered.insert(format!("{prefix}_trace_{rest}"));
            }
        }
    }
    let refs = deploy_metric_references()?;
    assert!(
        refs.iter().any(|(f, _)| f.ends_with(".json")),
        "the dashboard references metrics"
    );
    for (file, name) in refs {
        assert!(
            registered.contains(&name),
            "{file} uses {name}, which is not registered"
        );
    }
    Ok(())
}

/// Issue 14, HTTP manners 5: a sink that answers each event with its own
/// status — all hundred 5xx, a few 4xx, 3xx and statuses above 599 — adds
/// no series per status. Each event fails once with its status, then gets a
/// 204; `cdc_relay_retries_total` then counts exactly one retry per event
/// under the class label of its status, `cdc_relay_delivery_attempts_total`
/// keeps to its outcome and class values, and the exact statuses are in
/// the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_distinct_error_statuses_add_no_series_per_status() -> anyhow::Result<()> {
    let s = Scenario::plan(Inbox::Scripted)
        .relay_args(&["--failure-threshold", "1000", "--probe-interval", "50ms"])
        .start()
        .await?;
    let statuses: Vec<u16> = (500..=599)
        .chain([
            // 410 retires the endpoint (probed once a minute): its own
            // test is in http_manners.rs.
            402, 408, 409, 411, 418, 425, 451, 429, 301, 302, 307, 600, 799, 999,
        ])
        .collect();
    let ids: Vec<uuid::Uuid> = statuses.iter().map(|_| uuid::Uuid::new_v4()).collect();
    for (id, status) in ids.iter().zip(&statuses) {
        s.sink().reject_times(&id.to_string(), *status, 1);
    }
    s.db.batch_execute("BEGIN").await?;
    for id in &ids {
        // One order per event: events of one aggregate would go one by one.
        let order = uuid::Uuid::new_v4();
        s.db.execute(
            "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 100, 'EUR')",
            &[&order],
        )
        .await?;
        s.db.execute(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES ($1, $2, 'OrderCreated', '{}')",
            &[id, &order],
        )
        .await?;
    }
    s.db.batch_execute("COMMIT").await?;
    harness::wait_until(
        "every event delivered after its one failure",
        WAIT,
        || async { s.sink().delivered().len() >= ids.len() },
    )
    .await?;

    let m = s.relay.metrics().await?;
    let reasons = m.label_values("cdc_relay_retries_total", "reason");
    let expected: BTreeSet<String> = ["http_5xx", "http_4xx", "http_429", "http_3xx", "http_other"]
        .map(String::from)
        .into();
    assert_eq!(reasons, expected, "one series per class, none per status");
    assert!(reasons.iter().all(|r| REASONS.contains(&r.as_str())));
    for (reason, n) in [
        ("http_5xx", 100.0),
        ("http_4xx", 7.0),
        ("http_429", 1.0),
        ("http_3xx", 3.0),
        ("http_other", 3.0),
    ] {
        assert_eq!(
            m.value("cdc_relay_retries_total", &[("reason", reason)]),
            Some(n),
            "{reason}"
        );
    }
    let outcomes = m.label_values("cdc_relay_delivery_attempts_total", "outcome");
    let classes = m.label_values("cdc_relay_delivery_attempts_total", "status_class");
    for o in &outcomes {
        assert!(OUTCOMES.contains(&o.as_str()), "{o}");
    }
    for c in &classes {
        assert!(STATUS_CLASSES.contains(&c.as_str()), "{c}");
    }
    let series = m
        .samples()
        .iter()
        .filter(|x| x.name == "cdc_relay_delivery_attempts_total")
        .count();
    assert!(
        series <= OUTCOMES.len() * STATUS_CLASSES.len(),
        "{series} delivery-attempt series"
    );
    assert_eq!(
        m.value(
            "cdc_relay_delivery_attempts_total",
            &[("outcome", "config_fault"), ("status_class", "other")]
        ),
        Some(3.0),
        "600, 799 and 999"
    );
    // The exact statuses are in the log, one warning per event.
    let logs = s.relay.process.logs();
    for status in &statuses {
        assert!(
            logs.contains(&format!("http_{status}")),
            "http_{status} not logged"
        );
    }
    s.assert_balanced().await?;
    Ok(())
}

// ---- helpers ----

/// Inserts an order and its `OrderCreated` event; `extra` keys are merged
/// into the payload (over the valid defaults). Returns the event id.
async fn insert_event(
    db: &tokio_postgres::Client,
    extra: serde_json::Value,
) -> anyhow::Result<uuid::Uuid> {
    let order = uuid::Uuid::new_v4();
    let event = uuid::Uuid::new_v4();
    let mut payload = serde_json::json!({
        "order_id": order, "amount_cents": 100, "currency": "EUR"
    });
    if let (Some(p), Some(e)) = (payload.as_object_mut(), extra.as_object()) {
        p.extend(e.clone());
    }
    db.batch_execute("BEGIN").await?;
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 100, 'EUR')",
        &[&order],
    )
    .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
         VALUES ($1, $2, 'OrderCreated', $3)",
        &[&event, &order, &payload],
    )
    .await?;
    db.batch_execute("COMMIT").await?;
    Ok(event)
}

/// Ends the walsender serving the stack's slot (the relay reconnects).
async fn terminate_walsender(stack: &Stack) -> anyhow::Result<()> {
    let db = stack.orders_admin().await?;
    let ended: Option<bool> = db
        .query_one(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1",
            &[&stack.slot],
        )
        .await?
        .get(0);
    anyhow::ensure!(ended == Some(true), "no walsender held {}", stack.slot);
    Ok(())
}

/// Runs `cdc-relay <args>` with JSON debug logs against `url`.
async fn relay_command(stack: &Stack, url: &str, args: &[&str]) -> anyhow::Result<CommandOutput> {
    let json_debug = ["--log-format", "json", "--log", DEBUG_FILTER];
    app::relay_command(stack, url, &[&json_debug[..], args].concat(), &[]).await
}

/// Every non-empty line is one JSON object.
fn assert_json_lines(name: &str, text: &str) {
    let mut lines = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{name}: not a JSON log line ({e}): {line:?}"));
        assert!(v.is_object(), "{name}: not a JSON object: {line:?}");
        // Flattened: the message and the event's fields at the top level.
        assert!(
            v.get("fields").is_none() && v.get("message").is_some(),
            "{name}: fields not flattened: {line:?}"
        );
        lines += 1;
    }
    assert!(lines > 0, "{name} logged nothing");
}

fn write_private(dir: &Path, name: &str, content: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    std::io::Write::write_all(&mut f, format!("{content}\n").as_bytes())?;
    Ok(path)
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str().context("a UTF-8 path")
}

fn fs_read(p: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `(file, metric family)` for every `cdc_relay_*`, `orders_*` and
/// `billing_*` metric named in the Grafana dashboard and the Prometheus
/// rules; histogram suffixes are folded into their family.
fn deploy_metric_references() -> anyhow::Result<Vec<(String, String)>> {
    let deploy = repo().join("deploy");
    let files = [
        "grafana/cdc-relay.json",
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
    ];
    let mut refs = BTreeSet::new();
    for file in files {
        let text = fs_read(&deploy.join(file))?;
        let mut token = String::new();
        for c in text.chars().chain([' ']) {
            if c.is_ascii_alphanumeric() || c == '_' {
                token.push(c);
                continue;
            }
            let t = std::mem::take(&mut token);
            if !["cdc_relay_", "orders_", "billing_"]
                .iter()
                .any(|p| t.starts_with(p))
                || !t.ends_with(|c: char| c.is_ascii_alphabetic())
            {
                continue;
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| t.strip_suffix(s).filter(|f| f.ends_with("_seconds")))
                .unwrap_or(&t)
                .to_owned();
            refs.insert((file.to_owned(), family));
        }
    }
    Ok(refs.into_iter().collect())
}

/// `cdc_relay_pending_events` ("events received and not yet done") and
/// `cdc_relay_in_flight` are the real state at every checked point, across
/// sessions that end with an event pending: 0; 1 while the sink refuses
/// it; still 1 (the same event, redelivered by the new session) after the
/// walsender was terminated; 0 for both while no session can start (the
/// relay↔PostgreSQL link resets every connection: nothing is received);
/// 1 again once a session streams; exactly 0 once it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_and_in_flight_gauges_follow_the_real_state_across_sessions() -> anyhow::Result<()>
{
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let (proxy, db_url) = app::proxied(&stack.relay_url).await?;
    let relay = app::start_relay_with_url(&stack, &db_url, &sink.url, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let gauges = || async {
        let m = relay.metrics().await?;
        let value = |name| m.value(name, &[]).unwrap_or(f64::NAN);
        anyhow::Ok((
            value("cdc_relay_pending_events"),
            value("cdc_relay_in_flight"),
        ))
    };
    let at = |pending: f64, in_flight_at_most: f64, what: &str| {
        let what = format!("cdc_relay_pending_events {pending} ({what})");
        async move {
            let reached = harness::wait_until(&what, WAIT, || async {
                let (p, f) = gauges().await?;
                anyhow::ensure!(f <= in_flight_at_most, "in flight {f}");
                anyhow::Ok(p == pending)
            })
            .await;
            let now = gauges().await?;
            reached.with_context(|| format!("now (pending, in flight) = {now:?}"))
        }
    };
    // A new request from the relay: evidence that a session holds the event.
    let sink = &sink;
    let next_request = || {
        let seen = sink.arrivals();
        harness::wait_until("the event sent (again)", WAIT, move || async move {
            sink.arrivals() > seen
        })
    };
    at(0.0, 0.0, "nothing committed").await?;

    sink.set_status(503);
    let event = insert_event(&db, serde_json::json!({})).await?.to_string();
    next_request().await?;
    at(1.0, 1.0, "one event refused").await?;

    let before = app::sessions(&relay);
    terminate_walsender(&stack).await?;
    app::wait_new_session(&relay, before, WAIT).await?;
    next_request().await?;
    at(1.0, 1.0, "the same event, held by the new session").await?;

    let before = app::sessions(&relay);
    proxy.set_mode(Mode::Reset);
    at(0.0, 0.0, "no session: the link resets every connection").await?;
    assert_eq!(
        app::sessions(&relay),
        before,
        "no session started meanwhile"
    );
    proxy.set_mode(Mode::Pass);
    app::wait_new_session(&relay, before, WAIT).await?;
    next_request().await?;
    at(
        1.0,
        1.0,
        "the same event, held by the session after the link healed",
    )
    .await?;

    sink.set_status(204);
    harness::wait_until("the event delivered", WAIT, || async {
        oracle::arrival_ids(&sink.delivered()).contains(&event)
    })
    .await?;
    oracle::settle(&db, &stack.slot).await?;
    at(0.0, 0.0, "delivered").await?;
    oracle::Accounting::read(&db, &["outbox"], oracle::arrival_ids(&sink.delivered()))
        .await?
        .assert_balanced();
    Ok(())
}
