//! Tests of status's rendering.

use super::render::human_bytes;

#[test]
fn sizes_are_shown_in_binary_units() {
    assert_eq!(human_bytes(0), "0 bytes");
    assert_eq!(human_bytes(1023), "1023 bytes");
    assert_eq!(human_bytes(1024), "1.0 KiB");
    assert_eq!(human_bytes(1536), "1.5 KiB");
    assert_eq!(human_bytes(16 * 1024 * 1024), "16.0 MiB");
    assert_eq!(human_bytes(3_435_973_837), "3.2 GiB");
    assert_eq!(human_bytes(5 << 40), "5.0 TiB");
    assert_eq!(human_bytes(-2048), "-2.0 KiB");
}

#[test]
fn each_endpoints_circuit_is_read_from_metrics_the_worst_over_shards() {
    let text = "\
# HELP cdc_relay_endpoint_circuit_state Circuit breaker of an endpoint
cdc_relay_endpoint_circuit_state{endpoint=\"billing\"} 0
cdc_relay_endpoint_circuit_state{endpoint=\"shipping\",shard=\"0\"} 2
cdc_relay_endpoint_circuit_state{endpoint=\"shipping\",shard=\"1\"} 1
cdc_relay_endpoint_circuit_state{endpoint=\"audit\",shard=\"0\"} 1
cdc_relay_endpoint_circuit_state{endpoint=\"audit\",shard=\"1\"} 0
cdc_relay_endpoint_circuit_state_other{endpoint=\"x\"} 1
cdc_relay_circuit_state 0
";
    let got: Vec<(String, f64)> = super::relays::endpoint_circuits(text).into_iter().collect();
    assert_eq!(
        got,
        vec![
            ("audit".to_owned(), 1.0),
            ("billing".to_owned(), 0.0),
            ("shipping".to_owned(), 1.0),
        ]
    );
}
