//! Who sent the event: the signature on the exact body bytes, checked
//! before anything is parsed (`docs/architecture.md#wire-format`).
//!
//! ```text
//! webhook-signature present (and standard accepted)
//!     webhook-id, webhook-timestamp present? timestamp within the tolerance?  else 401 why
//!     any v1 entry = HMAC(key, id.timestamp.body) for an accepted key?        (standardwebhooks crate)
//! else X-Event-Signature present (and legacy accepted)
//!     = lowercase hex HMAC(key, body) for an accepted key?                    (constant time)
//! else 401 naming the headers to send
//! ```
//!
//! The keys are the relay's (`event_secret`: EVENT_SECRET and, during a
//! rotation, EVENT_SECRET_PREVIOUS); every key is tried, whichever matched,
//! so timing tells nothing about the keys. The keys can be replaced while
//! requests run ([`SharedVerifier`], SIGHUP).

use std::sync::{Arc, PoisonError, RwLock};

use axum::http::HeaderMap;
use event_secret::EventKeys;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use standardwebhooks::{Webhook, WebhookError};
use subtle::{Choice, ConstantTimeEq};

type HmacSha256 = Hmac<Sha256>;

/// Length of a legacy signature: 32 bytes as lowercase hex.
const SIGNATURE_HEX_LEN: usize = 64;

/// `X-Event-Signature`: the tutorial's header.
pub const LEGACY_HEADER: &str = "x-event-signature";

/// Which signatures Billing accepts (`--signature-scheme`; with `Both`,
/// `webhook-signature` decides when present); the relay's type.
pub use event_secret::SignatureScheme;

/// Why a request is refused: the error code and a detail for the 401 body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// `invalid_signature` or `timestamp_outside_tolerance`.
    pub code: &'static str,
    /// What is wrong and what to do, for the sender's operator.
    pub detail: String,
}

fn invalid(detail: impl Into<String>) -> Refusal {
    Refusal {
        code: "invalid_signature",
        detail: detail.into(),
    }
}

/// One accepted key, keyed once for each scheme.
struct VerifyKey {
    legacy: HmacSha256,
    standard: Webhook,
}

/// Checks signatures with one set of keys.
pub struct Verifier {
    keys: Vec<VerifyKey>,
    accept: SignatureScheme,
    tolerance_secs: i64,
    described: String,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Verifier({:?}, {}, tolerance {} s)",
            self.accept, self.described, self.tolerance_secs
        )
    }
}

impl Verifier {
    /// Accepts signatures made with any of `keys`, of the kinds `accept`
    /// lists; standard timestamps within `tolerance_secs` of now.
    pub fn new(keys: &EventKeys, accept: SignatureScheme, tolerance_secs: u32) -> Verifier {
        Verifier {
            keys: keys
                .iter()
                .map(|k| VerifyKey {
                    legacy: HmacSha256::new_from_slice(k.as_bytes())
                        .expect("HMAC accepts keys of any length"),
                    standard: Webhook::from_bytes(k.as_bytes().to_vec())
                        .expect("a key of at least 24 bytes"),
                })
                .collect(),
            accept,
            tolerance_secs: i64::from(tolerance_secs),
            described: keys.describe(),
        }
    }

    /// The keys, for logs: `key 1a2b3c4d, previous key 5e6f7a8b`.
    pub fn keys(&self) -> &str {
        &self.described
    }

    /// The accepted schemes.
    pub fn scheme(&self) -> SignatureScheme {
        self.accept
    }

    /// Checks the request's signature over `body`, `now` being the unix
    /// time in seconds. Returns which scheme vouched for it.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: i64,
    ) -> Result<&'static str, Refusal> {
        let standard = headers.contains_key(standardwebhooks::HEADER_WEBHOOK_SIGNATURE);
        let legacy = headers.get(LEGACY_HEADER);
        if standard && self.accept.standard() {
            return self
                .verify_standard(headers, body, now)
                .map(|()| "standard");
        }
        if let Some(signature) = legacy.filter(|_| self.accept.legacy()) {
            return match self.verify_legacy(body, signature.as_bytes()) {
                true => Ok("legacy"),
                false => Err(invalid(
                    "X-Event-Signature is not the lowercase hex HMAC-SHA256 of the body under an \
                     accepted secret",
                )),
            };
        }
        Err(invalid(match (standard, legacy.is_some(), self.accept) {
            (false, true, _) => {
                "X-Event-Signature is not accepted here (--signature-scheme standard): sign with \
                 Standard Webhooks (webhook-id, webhook-timestamp, webhook-signature)"
            }
            (true, false, _) => {
                "webhook-signature is not accepted here (--signature-scheme legacy): send \
                 X-Event-Signature"
            }
            (_, _, SignatureScheme::Standard) => {
                "no signature: send webhook-id, webhook-timestamp and webhook-signature"
            }
            (_, _, SignatureScheme::Legacy) => "no signature: send X-Event-Signature",
            (_, _, SignatureScheme::Both) => {
                "no signature: send webhook-signature (Standard Webhooks) or X-Event-Signature"
            }
        }))
    }

    fn verify_standard(&self, headers: &HeaderMap, body: &[u8], now: i64) -> Result<(), Refusal> {
        if !headers.contains_key(standardwebhooks::HEADER_WEBHOOK_ID) {
            return Err(invalid("webhook-signature without webhook-id"));
        }
        let timestamp = headers
            .get(standardwebhooks::HEADER_WEBHOOK_TIMESTAMP)
            .ok_or_else(|| invalid("webhook-signature without webhook-timestamp"))?
            .to_str()
            .ok()
            .and_then(|t| t.parse::<i64>().ok())
            .ok_or_else(|| invalid("webhook-timestamp is not an integer (unix seconds)"))?;
        self.check_timestamp(timestamp, now)?;
        // Every key is tried: no early exit tells which one matched.
        let outcomes: Vec<Result<(), WebhookError>> = self
            .keys
            .iter()
            .map(|k| k.standard.verify(body, headers))
            .collect();
        if outcomes.iter().any(Result::is_ok) {
            return Ok(());
        }
        // The library checks the time again with its own clock reading
        // (its window, 300 s, is our largest): a request exactly at our
        // limit can age past it between the two checks, by a second.
        if outcomes
            .iter()
            .any(|o| matches!(o, Err(WebhookError::TimestampTooOldError)))
        {
            return Err(self.outside_tolerance(timestamp, now + 1));
        }
        Err(invalid(
            "webhook-signature holds no v1 signature of webhook-id.webhook-timestamp.body made \
             with an accepted secret",
        ))
    }

    fn check_timestamp(&self, timestamp: i64, now: i64) -> Result<(), Refusal> {
        match now.abs_diff(timestamp) > self.tolerance_secs.unsigned_abs() {
            true => Err(self.outside_tolerance(timestamp, now)),
            false => Ok(()),
        }
    }

    fn outside_tolerance(&self, timestamp: i64, now: i64) -> Refusal {
        let (by, when) = match now >= timestamp {
            true => (now.abs_diff(timestamp), "old"),
            false => (now.abs_diff(timestamp), "in the future"),
        };
        Refusal {
            code: "timestamp_outside_tolerance",
            detail: format!(
                "webhook-timestamp {timestamp} is {by} s {when}; accepted: within {} s of this \
                 server's clock (--timestamp-tolerance-secs). A replayed request, or a clock to \
                 fix",
                self.tolerance_secs
            ),
        }
    }

    /// True when `provided` is the lowercase hex HMAC-SHA256 of `body` under
    /// any key. Comparison is constant-time per key and every key is tried,
    /// so timing reveals neither the expected value nor which key matched.
    /// Upper-case hex, a prefix, or anything else is refused.
    fn verify_legacy(&self, body: &[u8], provided: &[u8]) -> bool {
        if provided.len() != SIGNATURE_HEX_LEN {
            return false;
        }
        let matched = self.keys.iter().fold(Choice::from(0), |acc, key| {
            let mut expected = [0u8; SIGNATURE_HEX_LEN];
            let tag = key
                .legacy
                .clone()
                .chain_update(body)
                .finalize()
                .into_bytes();
            // 32 bytes always fit 64 hex digits; on the impossible error the
            // all-zero buffer simply never matches a hex signature.
            let _ = hex::encode_to_slice(tag, &mut expected);
            acc | expected.ct_eq(provided)
        });
        matched.into()
    }
}

/// The verifier in use, shared by every request and replaced whole on a
/// reload; a request keeps the one it read.
#[derive(Clone, Debug)]
pub struct SharedVerifier(Arc<RwLock<Arc<Verifier>>>);

impl SharedVerifier {
    /// A slot holding `verifier`.
    pub fn new(verifier: Verifier) -> SharedVerifier {
        SharedVerifier(Arc::new(RwLock::new(Arc::new(verifier))))
    }

    /// The verifier to use now.
    pub fn current(&self) -> Arc<Verifier> {
        // The lock guards a pointer swap that cannot panic midway.
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Puts `verifier` in place for every request from now on.
    pub fn replace(&self, verifier: Verifier) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(verifier);
    }
}

/// On every SIGHUP from `hangup`, builds a verifier with `load` (which
/// reads the secret files again) and puts it in place; counts each reload
/// in `reloads` by `result` (`ok`, `error`). A secret that does not load
/// changes nothing: the keys in use stay, and the error is logged.
pub async fn reload_on_sighup(
    mut hangup: tokio::signal::unix::Signal,
    load: impl Fn() -> Result<Verifier, event_secret::SecretError>,
    shared: SharedVerifier,
    reloads: prometheus::IntCounterVec,
) {
    while hangup.recv().await.is_some() {
        match load() {
            Ok(verifier) => {
                tracing::info!(keys = %verifier.keys(), "SIGHUP: event secrets reloaded");
                shared.replace(verifier);
                reloads.with_label_values(&["ok"]).inc();
            }
            Err(error) => {
                tracing::error!(
                    %error, keys = %shared.current().keys(),
                    "SIGHUP: event secrets NOT reloaded; still accepting the keys in use"
                );
                reloads.with_label_values(&["error"]).inc();
            }
        }
    }
}

/// The `X-Event-Signature` value for `body` under `secret` (what a legacy
/// sender puts in the header).
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    match HmacSha256::new_from_slice(secret) {
        Ok(key) => hex::encode(key.chain_update(body).finalize().into_bytes()),
        // HMAC accepts keys of any length; unreachable in practice.
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests;
