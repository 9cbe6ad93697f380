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
