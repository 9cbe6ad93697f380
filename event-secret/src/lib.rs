//! The event secret: one syntax for the relay (which signs) and Billing
//! (which verifies), so the two sides cannot read the same setting
//! differently (`docs/architecture.md#wire-format`).
//!
//! ```text
//! EVENT_SECRET          | EVENT_SECRET_FILE            the current secret (required)
//! EVENT_SECRET_PREVIOUS | EVENT_SECRET_PREVIOUS_FILE   the secret being retired (only during a rotation)
//!        │
//!        ▼  one secret per setting, trimmed
//! whsec_<base64>  ─▶ key = the decoded bytes   (Standard Webhooks form; ≥ 24 bytes, the spec's minimum)
//! anything else   ─▶ key = its UTF-8 bytes     (plain form; ≥ 32 bytes)
//! ```
//!
//! The key is the same for both signature headers: `X-Event-Signature` is
//! the hex HMAC-SHA256 of the body under it, `webhook-signature` the base64
//! HMAC-SHA256 of `id.timestamp.body`. So `whsec_` + base64(plain) is the
//! same key as the plain secret, and can be handed to a Standard Webhooks
//! verifier while a legacy receiver keeps the plain form.
//!
//! Anything that could be read two ways is refused, naming the setting: a
//! comma or whitespace inside a secret (a list?), a second line in a
//! secret file, both a value and a file for one setting, a `WHSEC_` prefix
//! in another case, a previous secret equal to the current one.

use std::fmt;
use std::path::Path;

use base64::Engine as _;
use sha2::{Digest, Sha256};

/// The prefix of a secret in the Standard Webhooks serialization.
pub const WHSEC_PREFIX: &str = "whsec_";

/// Shortest plain secret, in bytes.
pub const MIN_PLAIN_BYTES: usize = 32;

/// Shortest `whsec_` key, in decoded bytes: the Standard Webhooks
/// specification's minimum ("between 24 bytes (192 bits) and 64 bytes").
/// Its text is then at least 32 base64 characters, as random as a 32-byte
/// plain secret made of base64 characters.
pub const MIN_WHSEC_BYTES: usize = 24;

/// One secret setting and the names an operator knows it by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The environment variable holding the secret itself.
    pub env: &'static str,
    /// The environment variable naming a file that holds it.
    pub file_env: &'static str,
    /// The command-line flag for the value.
    pub flag: &'static str,
    /// The command-line flag for the file.
    pub file_flag: &'static str,
}

/// The current secret: signs, and is accepted.
pub const CURRENT: Setting = Setting {
    env: "EVENT_SECRET",
    file_env: "EVENT_SECRET_FILE",
    flag: "--event-secret",
    file_flag: "--event-secret-file",
};

/// The secret being retired during a rotation: the relay adds a standard
/// signature with it, Billing still accepts it.
pub const PREVIOUS: Setting = Setting {
    env: "EVENT_SECRET_PREVIOUS",
    file_env: "EVENT_SECRET_PREVIOUS_FILE",
    flag: "--event-secret-previous",
    file_flag: "--event-secret-previous-file",
};

/// Where one setting's secret comes from: the value (flag or environment)
/// or a file. Files are read on every [`EventKeys::load`], so a reload
/// (SIGHUP) sees new contents.
#[derive(Clone, Copy, Debug, Default)]
pub struct Source<'a> {
    /// The value of the flag or variable.
    pub value: Option<&'a str>,
    /// The file of the `_FILE` flag or variable.
    pub file: Option<&'a Path>,
}

/// A secret that cannot be used, with the setting to fix and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SecretError(String);

/// A signing key: the bytes HMAC-SHA256 is keyed with.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    bytes: Box<[u8]>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} bytes, id {})", self.bytes.len(), self.id())
    }
}

/// A key's public fingerprint for logs: the first 4 bytes of SHA-256 of
/// the key, in hex. Tells which key a process holds (the same on both
/// sides) without revealing anything usable about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyId([u8; 4]);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl Key {
    /// Parses one secret's text (already trimmed) for `setting`, the name
    /// errors use (`EVENT_SECRET`, `--event-secret-file / EVENT_SECRET_FILE (/path)`).
    pub fn parse(text: &str, setting: &str, which: &Setting) -> Result<Key, SecretError> {
        if text.contains(',') {
            return Err(list_error(format!("{setting} contains a comma"), which));
        }
        if text.chars().any(char::is_whitespace) {
            return Err(list_error(format!("{setting} contains whitespace"), which));
        }
        let head = text.get(..WHSEC_PREFIX.len()).unwrap_or("");
        if head.eq_ignore_ascii_case(WHSEC_PREFIX) && head != WHSEC_PREFIX {
            return Err(SecretError(format!(
                "{setting} starts with {head:?}: the Standard Webhooks prefix is lower-case \
                 {WHSEC_PREFIX}"
            )));
        }
        let bytes = match text.strip_prefix(WHSEC_PREFIX) {
            Some(encoded) => {
                let key = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|e| {
                        SecretError(format!(
                            "{setting} starts with {WHSEC_PREFIX} but the rest is not padded \
                             standard base64 (A-Z a-z 0-9 + /, then = to a multiple of 4): {e}"
                        ))
                    })?;
                if key.len() < MIN_WHSEC_BYTES {
                    return Err(SecretError(format!(
                        "{setting}: the {WHSEC_PREFIX} key decodes to {} bytes; the Standard \
                         Webhooks specification requires at least {MIN_WHSEC_BYTES} (make one \
                         with: echo {WHSEC_PREFIX}$(openssl rand -base64 32))",
                        key.len()
                    )));
                }
                key
            }
            None => {
                if text.len() < MIN_PLAIN_BYTES {
                    return Err(SecretError(format!(
                        "{setting} is {} bytes long; a secret needs at least {MIN_PLAIN_BYTES} \
                         (make one with: openssl rand -base64 32), or a {WHSEC_PREFIX} secret of \
                         at least {MIN_WHSEC_BYTES} decoded bytes",
                        text.len()
                    )));
                }
                text.as_bytes().to_vec()
            }
        };
        Ok(Key {
            bytes: bytes.into_boxed_slice(),
        })
    }

    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The key's fingerprint for logs.
    pub fn id(&self) -> KeyId {
        let digest = Sha256::digest(&self.bytes);
        KeyId([digest[0], digest[1], digest[2], digest[3]])
    }
}

/// `problem` (which names the setting) says the text looks like a list.
fn list_error(problem: String, which: &Setting) -> SecretError {
    let instead = if which.env == CURRENT.env {
        format!(
            "during a rotation the secret being retired goes in {} (or {})",
            PREVIOUS.env, PREVIOUS.file_env
        )
    } else {
        format!(
            "the new secret goes in {} (or {})",
            CURRENT.env, CURRENT.file_env
        )
    };
    SecretError(format!(
        "{problem}: it holds exactly one secret, not a list; {instead}"
    ))
}

/// The keys a process signs or verifies with: the current one and, during
/// a rotation, the one being retired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventKeys {
    current: Key,
    previous: Option<Key>,
}

impl EventKeys {
    /// Reads both settings. The current secret is required; the previous
    /// one is optional (an unset or blank value, or an empty file, means
    /// none: emptying the file ends a rotation).
    pub fn load(current: Source<'_>, previous: Source<'_>) -> Result<EventKeys, SecretError> {
        let cur = read(current, &CURRENT)?.ok_or_else(|| {
            SecretError(format!(
                "no event secret configured: set {} or {} ({}, {})",
                CURRENT.env, CURRENT.file_env, CURRENT.flag, CURRENT.file_flag
            ))
        })?;
        let prev = read(previous, &PREVIOUS)?;
        if prev.as_ref() == Some(&cur) {
            return Err(SecretError(format!(
                "{} is the same key as {}: set it only during a rotation, to the secret being \
                 retired",
                PREVIOUS.env, CURRENT.env
            )));
        }
        Ok(EventKeys {
            current: cur,
            previous: prev,
        })
    }

    /// Keys given directly (tests, benchmarks).
    pub fn new(current: Key, previous: Option<Key>) -> EventKeys {
        EventKeys { current, previous }
    }

    /// The current key.
    pub fn current(&self) -> &Key {
        &self.current
    }

    /// The key being retired, during a rotation.
    pub fn previous(&self) -> Option<&Key> {
        self.previous.as_ref()
    }

    /// Every key, the current one first.
    pub fn iter(&self) -> impl Iterator<Item = &Key> {
        std::iter::once(&self.current).chain(self.previous.as_ref())
    }

    /// For logs: `key 1a2b3c4d` or `key 1a2b3c4d, previous key 5e6f7a8b`.
    pub fn describe(&self) -> String {
        match &self.previous {
            Some(p) => format!("key {}, previous key {}", self.current.id(), p.id()),
            None => format!("key {}", self.current.id()),
        }
    }
}

/// One setting's key, if it holds one.
fn read(source: Source<'_>, which: &Setting) -> Result<Option<Key>, SecretError> {
    let (text, setting) = match (source.value, source.file) {
        (Some(_), Some(_)) => {
            return Err(SecretError(format!(
                "{} and {} are both set: give the secret one way",
                which.env, which.file_env
            )));
        }
        (Some(value), None) => (value.trim().to_owned(), which.env.to_owned()),
        (None, Some(path)) => {
            // Both names: the operator used one of them.
            let setting = format!(
                "{} / {} ({})",
                which.file_flag,
                which.file_env,
                path.display()
            );
            let text = std::fs::read_to_string(path)
                .map_err(|e| SecretError(format!("{setting}: {e}")))?;
            let lines: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            if lines.len() > 1 {
                return Err(list_error(
                    format!("{setting} has {} lines of text", lines.len()),
                    which,
                ));
            }
            (lines.first().copied().unwrap_or("").to_owned(), setting)
        }
        (None, None) => return Ok(None),
    };
    if text.is_empty() {
        return match which.env == CURRENT.env {
            true => Err(SecretError(format!(
                "no event secret configured: {setting} is blank; set {} or {}",
                CURRENT.env, CURRENT.file_env
            ))),
            false => Ok(None),
        };
    }
    Key::parse(&text, &setting, which).map(Some)
}

/// Which signature headers a request carries (the relay's
/// `--signature-scheme`) or a receiver accepts (Billing's).
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SignatureScheme {
    /// Standard Webhooks: `webhook-id`, `webhook-timestamp` and
    /// `webhook-signature` (a receiver then requires a recent timestamp).
    Standard,
    /// `X-Event-Signature` only (the tutorial's receivers).
    Legacy,
    /// Both.
    Both,
}

/// The flag's value: `standard`, `legacy`, `both`.
impl std::fmt::Display for SignatureScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SignatureScheme::Standard => "standard",
            SignatureScheme::Legacy => "legacy",
            SignatureScheme::Both => "both",
        })
    }
}

impl SignatureScheme {
    /// Whether the Standard Webhooks headers are in use.
    pub fn standard(self) -> bool {
        matches!(self, SignatureScheme::Standard | SignatureScheme::Both)
    }

    /// Whether `X-Event-Signature` is in use.
    pub fn legacy(self) -> bool {
        matches!(self, SignatureScheme::Legacy | SignatureScheme::Both)
    }
}

#[cfg(test)]
mod tests;
