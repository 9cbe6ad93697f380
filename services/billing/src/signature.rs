//! `X-Event-Signature`: lowercase hex HMAC-SHA256 of the exact body bytes
//! (`docs/architecture.md#wire-format`), checked against every configured
//! secret so a secret can be
//! rotated without downtime (senders switch while both are accepted).

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::{Choice, ConstantTimeEq};

type HmacSha256 = Hmac<Sha256>;

/// Length of a signature: 32 bytes as lowercase hex.
const SIGNATURE_HEX_LEN: usize = 64;

/// Why no secret set could be built.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Neither source held a non-blank secret.
    #[error(
        "no event secret configured: set EVENT_SECRET (comma-separated list) or --event-secret, \
         or --event-secret-file / EVENT_SECRET_FILE (one secret per line)"
    )]
    Empty,
    /// The secret file could not be read.
    #[error("cannot read --event-secret-file {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The accepted secrets, keyed once at startup.
#[derive(Clone)]
pub struct EventSecrets {
    keys: Vec<HmacSha256>,
}

impl std::fmt::Debug for EventSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventSecrets({} redacted)", self.keys.len())
    }
}

impl EventSecrets {
    /// Secrets from a comma-separated `list` and/or a `file` with one per
    /// line, in that order. Surrounding whitespace is trimmed and blank entries
    /// skipped. Fails when nothing is left: a Billing that accepts no
    /// signature must not start.
    pub fn load(list: Option<&str>, file: Option<&Path>) -> Result<Self, SecretError> {
        let mut secrets: Vec<String> = list
            .into_iter()
            .flat_map(|l| l.split(','))
            .map(|s| s.trim().to_owned())
            .collect();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| SecretError::File {
                path: path.display().to_string(),
                source,
            })?;
            secrets.extend(text.lines().map(|s| s.trim().to_owned()));
        }
        Self::new(secrets.iter().map(String::as_bytes))
    }

    /// Secrets given directly; blank ones are skipped.
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a [u8]>) -> Result<Self, SecretError> {
        let keys: Vec<HmacSha256> = secrets
            .into_iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| HmacSha256::new_from_slice(s).ok())
            .collect();
        if keys.is_empty() {
            Err(SecretError::Empty)
        } else {
            Ok(Self { keys })
        }
    }

    /// How many secrets are accepted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Always false: construction refuses an empty set.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// True when `provided` is the lowercase hex HMAC-SHA256 of `body` under
    /// any secret. Comparison is constant-time per secret and every secret is
    /// tried, so timing reveals neither the expected value nor which secret
    /// matched. Upper-case hex, a prefix, or anything else is refused.
    pub fn verify(&self, body: &[u8], provided: Option<&[u8]>) -> bool {
        let Some(provided) = provided else {
            return false;
        };
        if provided.len() != SIGNATURE_HEX_LEN {
            return false;
        }
        let matched = self.keys.iter().fold(Choice::from(0), |acc, key| {
            let mut expected = [0u8; SIGNATURE_HEX_LEN];
            let tag = key.clone().chain_update(body).finalize().into_bytes();
            // 32 bytes always fit 64 hex digits; on the impossible error the
            // all-zero buffer simply never matches a hex signature.
            let _ = hex::encode_to_slice(tag, &mut expected);
            acc | expected.ct_eq(provided)
        });
        matched.into()
    }
}

/// The signature header value for `body` under `secret` (what a sender puts
/// in `X-Event-Signature`).
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    match HmacSha256::new_from_slice(secret) {
        Ok(key) => hex::encode(key.chain_update(body).finalize().into_bytes()),
        // HMAC accepts keys of any length; unreachable in practice.
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = br#"{"id":"x"}"#;

    #[test]
    fn rfc4231_test_case_2() {
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn accepts_any_configured_secret_only_in_lowercase_full_hex() {
        let secrets = EventSecrets::load(Some("old, new ,"), None).expect("secrets");
        assert_eq!(secrets.len(), 2);
        for secret in ["old", "new"] {
            let sig = sign(secret.as_bytes(), BODY);
            assert!(secrets.verify(BODY, Some(sig.as_bytes())), "{secret}");
            assert!(!secrets.verify(BODY, Some(sig.to_ascii_uppercase().as_bytes())));
            assert!(!secrets.verify(BODY, Some(&sig.as_bytes()[..63])));
            assert!(!secrets.verify(b"{\"id\":\"y\"}", Some(sig.as_bytes())));
        }
        assert!(!secrets.verify(BODY, Some(sign(b"other", BODY).as_bytes())));
        assert!(!secrets.verify(BODY, None));
    }

    #[test]
    fn file_and_list_combine_and_blank_is_refused() {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        std::io::Write::write_all(&mut file, b"\nfrom-file\r\n\n").expect("write");
        let secrets = EventSecrets::load(Some("from-env"), Some(file.path())).expect("secrets");
        assert_eq!(secrets.len(), 2);
        assert!(secrets.verify(BODY, Some(sign(b"from-file", BODY).as_bytes())));
        assert!(matches!(
            EventSecrets::load(Some(" , "), None),
            Err(SecretError::Empty)
        ));
        assert!(matches!(
            EventSecrets::load(None, None),
            Err(SecretError::Empty)
        ));
    }
}
