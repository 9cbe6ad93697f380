//! The CPU cost of one signature of each kind, in isolation: a million
//! signatures of a typical 200-byte event body with one key, then with two
//! (a rotation). The whole-pipeline A/B is `bench --signature-schemes
//! legacy,both` (docs/benchmarks.md).
//!
//! ```text
//! cargo run --release -p cdc-relay --example signing_cost
//! ```

use std::time::Instant;

use cdc_relay::sink::{SignatureScheme, Signer};
use event_secret::{CURRENT, EventKeys, Key};

const ID: &str = "0b7c6f0e-6f1e-4d8a-9d0b-2f8a7c1e5b3d";
const BODY: &[u8] = br#"{"id":"0b7c6f0e-6f1e-4d8a-9d0b-2f8a7c1e5b3d","type":"OrderCreated","data":{"currency": "EUR", "order_id": "5c1b2a3e-8f7d-4e6c-9b0a-1d2e3f4a5b6c", "amount_cents": 2599}}"#;
const N: u32 = 1_000_000;

fn key(secret: &str) -> Key {
    Key::parse(secret, "EVENT_SECRET", &CURRENT).expect("a valid secret")
}

fn main() {
    let current = key("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oDtZ1I4/hDygAJ");
    let previous = key("whsec_dHdlbnR5LWZvdXItYnl0ZS1rZXktYWJjZGVmZ2hp");
    for (keys, label) in [
        (EventKeys::new(current.clone(), None), "one key"),
        (EventKeys::new(current, Some(previous)), "two keys"),
    ] {
        let legacy = Signer::new(SignatureScheme::Legacy, &keys);
        let standard = Signer::new(SignatureScheme::Standard, &keys);
        let started = Instant::now();
        let mut bytes = 0;
        for _ in 0..N {
            bytes += legacy.legacy(BODY).map_or(0, |v| v.len());
        }
        let per_legacy = started.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let started = Instant::now();
        for i in 0..N {
            let ts = 1_700_000_000 + u64::from(i);
            bytes += standard.standard(ID, ts, BODY).map_or(0, |v| v.len());
        }
        let per_standard = started.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        println!(
            "{label}: X-Event-Signature {per_legacy:.3} µs, webhook-signature {per_standard:.3} µs \
             per {}-byte body ({bytes} header bytes made)",
            BODY.len()
        );
    }
}
