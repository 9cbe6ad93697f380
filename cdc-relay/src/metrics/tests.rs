//! Tests of the registry: names, labels and priming.

use super::*;

#[test]
fn a_sharded_exposition_labels_each_shard_once_per_family() {
    let process = Metrics::new();
    let shards = [Metrics::for_shard("0of2"), Metrics::for_shard("1of2")];
    shards[0].events_delivered.inc_by(3);
    shards[1].events_delivered.inc_by(5);
    process.secret_reloads.with_label_values(&["ok"]).inc();
    let text = render_merged(&process, &shards);
    assert!(
        text.contains("cdc_relay_events_delivered_total{shard=\"0of2\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("cdc_relay_events_delivered_total{shard=\"1of2\"} 5"),
        "{text}"
    );
    assert_eq!(
        text.matches("# TYPE cdc_relay_events_delivered_total ")
            .count(),
        1,
        "one family, both shards' series: {text}"
    );
    // Process families come once, unlabelled; the shards' copies are
    // left out.
    assert!(
        text.contains("cdc_relay_secret_reloads_total{result=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        !text.contains("cdc_relay_secret_reloads_total{result=\"ok\",shard="),
        "{text}"
    );
    assert_eq!(text.matches("cdc_relay_build_info{").count(), 1, "{text}");
    // Every other series carries a shard.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let process_family = PROCESS_FAMILIES.iter().any(|f| line.starts_with(f));
        assert_eq!(!process_family, line.contains("shard=\""), "{line}");
    }
}

#[test]
fn renders_the_documented_names() {
    let m = Metrics::new();
    m.delivery_attempts
        .with_label_values(&["delivered", "2xx"])
        .inc();
    m.reconnects.with_label_values(&["io"]).inc();
    m.retries.with_label_values(&["http_5xx"]).inc();
    m.slot_wal_status.with_label_values(&["reserved"]).set(1);
    let text = m.render();
    for name in [
        "cdc_relay_events_received_total",
        "cdc_relay_events_delivered_total",
        "cdc_relay_events_dead_lettered_total",
        "cdc_relay_delivery_attempts_total{outcome=\"delivered\",status_class=\"2xx\"} 1",
        "cdc_relay_request_duration_seconds_bucket",
        "cdc_relay_commit_to_delivery_seconds_bucket{le=\"0.0005\"}",
        "cdc_relay_in_flight",
        "cdc_relay_received_lsn",
        "cdc_relay_confirmed_lsn",
        "cdc_relay_server_wal_lsn",
        "cdc_relay_slot_lag_bytes",
        "cdc_relay_retained_wal_bytes",
        "cdc_relay_retained_wal_budget_bytes",
        "cdc_relay_oldest_unconfirmed_event_age_seconds",
        "cdc_relay_circuit_state",
        "cdc_relay_reconnects_total{cause=\"io\"} 1",
        "cdc_relay_standby",
        "cdc_relay_slot_wal_status{status=\"reserved\"} 1",
        "cdc_relay_slot_safe_wal_size_bytes",
        "cdc_relay_status_updates_total{cause=\"interval\"} 0",
        "cdc_relay_status_updates_total{cause=\"keepalive_reply\"} 0",
        "cdc_relay_publication_includes_outbox 0",
        "cdc_relay_publication_gaps_total 0",
        "cdc_relay_seconds_since_server_message 0",
        "cdc_relay_retries_total{reason=\"http_5xx\"} 1",
        "cdc_relay_secret_reloads_total{result=\"ok\"} 0",
        "cdc_relay_secret_reloads_total{result=\"error\"} 0",
        "cdc_relay_sink_pauses_total 0",
        "cdc_relay_sink_fresh_connection_retries_total 0",
        "cdc_relay_sink_connection_events_total 0",
        "cdc_relay_pruned_rows_total 0",
        "cdc_relay_outbox_table_size_bytes 0",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}
