//! Fuzzes `pgoutput::decode` on arbitrary payloads: it must never panic,
//! and whatever it accepts must re-encode to exactly the input bytes.
#![no_main]

use bytes::Bytes;
use cdc_relay::pgoutput::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    match decode(input.clone()) {
        Ok(msg) => assert_eq!(encode(&msg), input, "accepted input does not round-trip"),
        Err(err) => assert!(err.offset() <= data.len(), "{err:?} points past the input"),
    }
});
