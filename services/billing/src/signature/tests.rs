//! Both schemes, every refusal and its reason, with requests signed here
//! independently of the relay (HMAC and base64 by hand).

use axum::http::{HeaderMap, HeaderValue};
use base64::Engine as _;
use event_secret::{CURRENT, EventKeys, Key};

use super::*;

const BODY: &[u8] = br#"{"id":"x"}"#;
const NEW: &str = "billing-unit-test-secret-new-0123456";
const OLD: &str = "billing-unit-test-secret-old-0123456";
const OTHER: &str = "billing-unit-test-secret-other-01234";
const NOW: i64 = 1_700_000_000;

fn key(k: &str) -> Key {
    Key::parse(k, "EVENT_SECRET", &CURRENT).unwrap()
}

fn verifier(accept: SignatureScheme, tolerance: u32) -> Verifier {
    Verifier::new(&EventKeys::new(key(NEW), Some(key(OLD))), accept, tolerance)
}

fn v1(secret: &str, id: &str, ts: i64, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{id}.{ts}.").as_bytes());
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
}

fn standard(signature: &str, ts: i64) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("webhook-id", HeaderValue::from_static("x"));
    h.insert("webhook-timestamp", HeaderValue::from(ts));
    h.insert(
        "webhook-signature",
        HeaderValue::from_str(signature).unwrap(),
    );
    h
}

fn legacy(signature: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(LEGACY_HEADER, HeaderValue::from_str(signature).unwrap());
    h
}

/// The Standard Webhooks check reads the real clock; these use now.
fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn rfc4231_test_case_2() {
    assert_eq!(
        sign(b"Jefe", b"what do ya want for nothing?"),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
}

#[test]
fn legacy_accepts_either_key_only_in_lowercase_full_hex() {
    let v = verifier(SignatureScheme::Both, 300);
    for secret in [NEW, OLD] {
        let sig = sign(secret.as_bytes(), BODY);
        assert_eq!(v.verify(&legacy(&sig), BODY, NOW), Ok("legacy"), "{secret}");
        for bad in [sig.to_ascii_uppercase(), sig[..63].to_owned()] {
            assert!(v.verify(&legacy(&bad), BODY, NOW).is_err());
        }
        assert!(v.verify(&legacy(&sig), b"{\"id\":\"y\"}", NOW).is_err());
    }
    let err = v
        .verify(&legacy(&sign(OTHER.as_bytes(), BODY)), BODY, NOW)
        .unwrap_err();
    assert_eq!(err.code, "invalid_signature");
}

#[test]
fn standard_accepts_an_entry_made_with_either_key_among_others() {
    let v = verifier(SignatureScheme::Both, 300);
    let ts = now();
    for secret in [NEW, OLD] {
        let sig = v1(secret, "x", ts, BODY);
        assert_eq!(v.verify(&standard(&sig, ts), BODY, ts), Ok("standard"));
        let listed = format!("{} {sig}", v1(OTHER, "x", ts, BODY));
        assert_eq!(v.verify(&standard(&listed, ts), BODY, ts), Ok("standard"));
    }
    for bad in [
        v1(OTHER, "x", ts, BODY),
        v1(NEW, "y", ts, BODY),
        v1(NEW, "x", ts - 1, BODY),
        v1(NEW, "x", ts, b"{}"),
        v1(NEW, "x", ts, BODY).replace("v1,", "v2,"),
    ] {
        let err = v.verify(&standard(&bad, ts), BODY, ts).unwrap_err();
        assert_eq!(err.code, "invalid_signature", "{bad}");
        assert!(err.detail.contains("no v1 signature"), "{}", err.detail);
    }
}

#[test]
fn timestamps_outside_the_tolerance_are_refused_saying_why() {
    let v = verifier(SignatureScheme::Both, 300);
    let ts = now();
    for (sent, why) in [(ts - 301, "301 s old"), (ts + 400, "400 s in the future")] {
        let sig = v1(NEW, "x", sent, BODY);
        let err = v.verify(&standard(&sig, sent), BODY, ts).unwrap_err();
        assert_eq!(err.code, "timestamp_outside_tolerance");
        assert!(err.detail.contains(why), "{}", err.detail);
        assert!(err.detail.contains("within 300 s"), "{}", err.detail);
    }
    let sig = v1(NEW, "x", ts - 299, BODY);
    assert!(v.verify(&standard(&sig, ts - 299), BODY, ts).is_ok());
    // A narrower window.
    let narrow = verifier(SignatureScheme::Both, 60);
    let err = narrow
        .verify(&standard(&v1(NEW, "x", ts - 61, BODY), ts - 61), BODY, ts)
        .unwrap_err();
    assert_eq!(err.code, "timestamp_outside_tolerance");
    assert!(err.detail.contains("within 60 s"), "{}", err.detail);
}

#[test]
fn incomplete_standard_headers_are_refused_naming_the_header() {
    let v = verifier(SignatureScheme::Both, 300);
    let ts = now();
    let full = standard(&v1(NEW, "x", ts, BODY), ts);
    for (drop, named) in [
        ("webhook-id", "webhook-id"),
        ("webhook-timestamp", "webhook-timestamp"),
    ] {
        let mut h = full.clone();
        h.remove(drop);
        let err = v.verify(&h, BODY, ts).unwrap_err();
        assert!(err.detail.contains(named), "{}", err.detail);
    }
    let mut h = full;
    h.insert("webhook-timestamp", HeaderValue::from_static("soon"));
    let err = v.verify(&h, BODY, ts).unwrap_err();
    assert!(err.detail.contains("not an integer"), "{}", err.detail);
}

#[test]
fn the_scheme_decides_what_is_accepted() {
    let ts = now();
    let good_legacy = sign(NEW.as_bytes(), BODY);
    let good_standard = v1(NEW, "x", ts, BODY);

    let standard_only = verifier(SignatureScheme::Standard, 300);
    let err = standard_only
        .verify(&legacy(&good_legacy), BODY, ts)
        .unwrap_err();
    assert!(
        err.detail.contains("--signature-scheme standard"),
        "{}",
        err.detail
    );
    assert!(
        standard_only
            .verify(&standard(&good_standard, ts), BODY, ts)
            .is_ok()
    );

    let legacy_only = verifier(SignatureScheme::Legacy, 300);
    let err = legacy_only
        .verify(&standard(&good_standard, ts), BODY, ts)
        .unwrap_err();
    assert!(
        err.detail.contains("--signature-scheme legacy"),
        "{}",
        err.detail
    );
    let mut both_headers = standard(&v1(OTHER, "x", ts, BODY), ts);
    both_headers.insert(LEGACY_HEADER, HeaderValue::from_str(&good_legacy).unwrap());
    assert_eq!(legacy_only.verify(&both_headers, BODY, ts), Ok("legacy"));

    // Under both, a present webhook-signature decides: a wrong one is not
    // rescued by a right X-Event-Signature.
    let both = verifier(SignatureScheme::Both, 300);
    assert!(both.verify(&both_headers, BODY, ts).is_err());
    let err = both.verify(&HeaderMap::new(), BODY, ts).unwrap_err();
    assert!(err.detail.starts_with("no signature"), "{}", err.detail);
}

#[test]
fn a_replaced_verifier_serves_the_next_request() {
    let shared = SharedVerifier::new(verifier(SignatureScheme::Both, 300));
    let before = shared.current();
    shared.replace(Verifier::new(
        &EventKeys::new(key(OTHER), None),
        SignatureScheme::Both,
        300,
    ));
    let sig = sign(OTHER.as_bytes(), BODY);
    assert!(before.verify(&legacy(&sig), BODY, NOW).is_err());
    assert!(shared.current().verify(&legacy(&sig), BODY, NOW).is_ok());
}
