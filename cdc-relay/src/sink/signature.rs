//! Signing a request (`docs/architecture.md#wire-format`): the tutorial's
//! `X-Event-Signature` and the Standard Webhooks `webhook-signature`.
//!
//! ```text
//! X-Event-Signature: hex(HMAC-SHA256(current key, body))                       once per event
//! webhook-signature: v1,base64(HMAC-SHA256(key, "<id>.<timestamp>.<body>"))    per attempt, one
//!                    entry per key (current first, then previous), space-separated
//! ```
//!
//! Keys come from `event_secret` (the syntax both sides share). The legacy
//! header carries one value, so it is signed with the current key only; a
//! legacy receiver must accept the new key before the relay switches to it
//! (docs/operations.md, secret rotation). A Standard Webhooks receiver may
//! switch at any moment while the relay sends both signatures.
//!
//! The keys can be replaced while deliveries run (SIGHUP): [`Signing`] is a
//! shared slot read once per attempt, so an attempt in flight finishes with
//! the signer it started with and the next attempt uses the new one.

use std::sync::{Arc, PoisonError, RwLock};

use base64::Engine as _;
use event_secret::EventKeys;
use hmac::{Hmac, Mac};
use http::HeaderValue;
use sha2::Sha256;

/// Which signature headers the relay sends (`--signature-scheme`); the
/// same type Billing accepts by.
pub use event_secret::SignatureScheme;

/// HMAC-SHA256 keyed once: cloning the keyed state per message skips the
/// key schedule.
type KeyedMac = Hmac<Sha256>;

/// Signs requests with one set of keys under one scheme.
pub struct Signer {
    scheme: SignatureScheme,
    /// Current key first, then the previous one during a rotation.
    macs: Vec<KeyedMac>,
    keys: String,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({:?}, {})", self.scheme, self.keys)
    }
}

/// Length of one `v1,<base64 of 32 bytes>` entry.
const V1_ENTRY_LEN: usize = 3 + 44;

impl Signer {
    /// A signer for `keys` sending the headers of `scheme`.
    pub fn new(scheme: SignatureScheme, keys: &EventKeys) -> Signer {
        Signer {
            scheme,
            macs: keys
                .iter()
                .map(|k| {
                    KeyedMac::new_from_slice(k.as_bytes()).expect("HMAC accepts keys of any length")
                })
                .collect(),
            keys: keys.describe(),
        }
    }

    /// The scheme.
    pub fn scheme(&self) -> SignatureScheme {
        self.scheme
    }

    /// The keys, for logs: `key 1a2b3c4d, previous key 5e6f7a8b`.
    pub fn keys(&self) -> &str {
        &self.keys
    }

    /// `X-Event-Signature` for `body`: lowercase hex HMAC-SHA256 under the
    /// current key; `None` under the standard scheme.
    pub fn legacy(&self, body: &[u8]) -> Option<HeaderValue> {
        if !self.scheme.legacy() {
            return None;
        }
        let mut mac = self.macs[0].clone();
        mac.update(body);
        let mut hex = [0u8; 64];
        hex::encode_to_slice(mac.finalize().into_bytes(), &mut hex)
            .expect("a SHA-256 MAC is 32 bytes: 64 hex digits");
        Some(HeaderValue::from_bytes(&hex).expect("hex is a valid header value"))
    }

    /// `webhook-signature` for the message `id.timestamp.body`: one
    /// `v1,<base64>` entry per key, space-separated; `None` under the legacy
    /// scheme. `id` is exactly the `webhook-id` header value and
    /// `timestamp` the `webhook-timestamp` one (unix seconds).
    pub fn standard(&self, id: &str, timestamp: u64, body: &[u8]) -> Option<HeaderValue> {
        if !self.scheme.standard() {
            return None;
        }
        let mut digits = [0u8; 20];
        let timestamp = decimal(timestamp, &mut digits);
        let mut value = String::with_capacity(self.macs.len() * (V1_ENTRY_LEN + 1));
        for mac in &self.macs {
            let mut mac = mac.clone();
            mac.update(id.as_bytes());
            mac.update(b".");
            mac.update(timestamp);
            mac.update(b".");
            mac.update(body);
            if !value.is_empty() {
                value.push(' ');
            }
            value.push_str("v1,");
            base64::engine::general_purpose::STANDARD
                .encode_string(mac.finalize().into_bytes(), &mut value);
        }
        // Its bytes become the header value as they are (no copy).
        Some(
            HeaderValue::from_maybe_shared(bytes::Bytes::from(value))
                .expect("base64 is a valid header value"),
        )
    }
}

/// The signer in use, shared by every delivery and replaced whole on a
/// reload. Read once per attempt: an attempt keeps the `Arc` it read.
#[derive(Clone, Debug)]
pub struct Signing(Arc<RwLock<Arc<Signer>>>);

impl Signing {
    /// A slot holding `signer`.
    pub fn new(signer: Signer) -> Signing {
        Signing(Arc::new(RwLock::new(Arc::new(signer))))
    }

    /// The signer to use now.
    pub fn current(&self) -> Arc<Signer> {
        // The lock guards a pointer swap that cannot panic midway.
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Puts `signer` in place for every attempt from now on.
    pub fn replace(&self, signer: Signer) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(signer);
    }
}

/// `n` in decimal ASCII, written into `buf` (no allocation): the
/// `webhook-timestamp` as signed.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_writes_every_u64() {
        let mut buf = [0u8; 20];
        for n in [0, 9, 10, 1_733_212_345, u64::MAX] {
            assert_eq!(decimal(n, &mut buf), n.to_string().as_bytes());
        }
    }
    use event_secret::{CURRENT, Key};

    fn key(text: &str) -> Key {
        Key::parse(text, "EVENT_SECRET", &CURRENT).unwrap()
    }

    fn whsec(bytes: &[u8]) -> Key {
        key(&format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        ))
    }

    const ID: &str = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk";
    const TS: u64 = 1649367553;
    const BODY: &[u8] = br#"{"email":"test@example.com","username":"test_user"}"#;

    /// The vector of the Standard Webhooks reference libraries' own tests
    /// (`test_sign`): the message layout and the encoding match theirs.
    #[test]
    fn standard_signature_matches_the_reference_vector() {
        let keys = EventKeys::new(key("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"), None);
        let signer = Signer::new(SignatureScheme::Standard, &keys);
        assert_eq!(
            signer.standard(ID, TS, BODY).unwrap(),
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
        );
        assert_eq!(signer.legacy(BODY), None);
    }

    /// RFC 4231 test case 6 (a 131-byte key, hashed first).
    #[test]
    fn legacy_signature_is_hex_hmac_of_the_body_under_the_current_key() {
        let keys = EventKeys::new(whsec(&[0xaa; 131]), Some(whsec(&[0xbb; 32])));
        let signer = Signer::new(SignatureScheme::Legacy, &keys);
        assert_eq!(
            signer
                .legacy(b"Test Using Larger Than Block-Size Key - Hash Key First")
                .unwrap(),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
        assert_eq!(signer.standard(ID, TS, BODY), None);
    }

    #[test]
    fn during_a_rotation_each_key_signs_current_first() {
        let (new, old) = (whsec(&[1; 32]), whsec(&[2; 32]));
        let both = Signer::new(
            SignatureScheme::Both,
            &EventKeys::new(new.clone(), Some(old.clone())),
        );
        let alone = |k: &Key| {
            Signer::new(SignatureScheme::Both, &EventKeys::new(k.clone(), None))
                .standard(ID, TS, BODY)
                .unwrap()
        };
        let header = both.standard(ID, TS, BODY).unwrap();
        let entries: Vec<&str> = header.to_str().unwrap().split(' ').collect();
        assert_eq!(entries, [alone(&new), alone(&old)]);
        assert_eq!(entries[0].len(), V1_ENTRY_LEN);
        // The legacy header carries the current key's signature only.
        let current_only = Signer::new(SignatureScheme::Both, &EventKeys::new(new, None));
        assert_eq!(both.legacy(BODY), current_only.legacy(BODY));
        // A different timestamp or id is a different signature.
        assert_ne!(both.standard(ID, TS + 1, BODY), Some(header.clone()));
        assert_ne!(both.standard("msg_other", TS, BODY), Some(header));
    }

    #[test]
    fn a_replaced_signer_serves_the_next_read_and_the_old_one_lives_on() {
        let first = EventKeys::new(whsec(&[1; 32]), None);
        let second = EventKeys::new(whsec(&[2; 32]), None);
        let signing = Signing::new(Signer::new(SignatureScheme::Both, &first));
        let in_flight = signing.current();
        signing.replace(Signer::new(SignatureScheme::Both, &second));
        assert_eq!(in_flight.keys(), first.describe());
        assert_eq!(signing.current().keys(), second.describe());
        assert!(!Arc::ptr_eq(&in_flight, &signing.current()));
    }
}
