//! Credential and trust files read again for each new connection: the
//! database password file, the database's `sslrootcert`/`sslcert`/`sslkey`,
//! the sinks' CA file and client certificate, the OTLP collector's CA. A
//! rotated file is used by the next connection without a restart or a
//! signal (SIGHUP, which re-reads
//! the event secrets, needs nothing more for these). A file that no longer
//! loads (missing, empty, not PEM) keeps the copy that last loaded, logged
//! at ERROR each time it is read, so a rotation that goes wrong does not
//! take the relay down; connections already open keep what they used.
//! [`pem_certs`] and [`pem_key`] read the PEM files, for the database and
//! the sinks alike.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A file's contents as loaded.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The bytes: from the file now, or the copy that last loaded.
    pub bytes: Vec<u8>,
    /// Why the file itself did not load, when `bytes` is the kept copy.
    pub kept: Option<String>,
}

/// The last good contents of each file, by path.
static LAST_GOOD: LazyLock<Mutex<HashMap<PathBuf, Vec<u8>>>> = LazyLock::new(Default::default);

/// Reads `path` and checks it with `check`; when either fails, falls back
/// to the copy that last passed (logging the failure at ERROR, naming
/// `setting`), or, when none did, returns the reason.
pub fn load(
    setting: &str,
    path: &Path,
    check: impl Fn(&[u8]) -> Result<(), String>,
) -> Result<Loaded, String> {
    let fresh = std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| check(&b).map(|()| b));
    let mut last = LAST_GOOD.lock().expect("the file cache is never poisoned");
    match fresh {
        Ok(bytes) => {
            last.insert(path.to_owned(), bytes.clone());
            Ok(Loaded { bytes, kept: None })
        }
        Err(reason) => match last.get(path) {
            Some(bytes) => {
                tracing::error!(
                    "{setting} {}: {reason}; new connections keep using the copy that last \
                     loaded until the file is fixed",
                    path.display()
                );
                Ok(Loaded {
                    bytes: bytes.clone(),
                    kept: Some(reason),
                })
            }
            None => Err(reason),
        },
    }
}

/// The first line of a secret file (a password), without its line end;
/// an empty one is an error.
pub fn first_line(bytes: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_owned())?;
    let first = text.lines().next().unwrap_or("").trim_end_matches('\r');
    if first.is_empty() {
        return Err("the file is empty (its first line is the password)".into());
    }
    Ok(first.to_owned())
}

/// The certificates of a PEM file (a chain, a CA bundle), in file order.
/// Errors, in words: not PEM (naming the fault), no certificate.
pub fn pem_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = without_bom(pem);
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM certificate file: {}", pem_problem(&e)))?;
    if certs.is_empty() {
        return Err("no certificate in the file".into());
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1). Errors, in
/// words: encrypted (the relay takes no passphrase), not PEM, no key.
pub fn pem_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    let pem = without_bom(pem);
    let text = String::from_utf8_lossy(pem);
    if text.contains("ENCRYPTED PRIVATE KEY") || text.contains("Proc-Type: 4,ENCRYPTED") {
        return Err(
            "the private key is encrypted with a passphrase, which the relay does not \
                    take (nor libpq's sslpassword): store it decrypted, readable by the \
                    relay's user only (openssl pkey -in KEY -out PLAIN; chmod 600 PLAIN)"
                .into(),
        );
    }
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| {
        format!(
            "not an unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1): {}",
            pem_problem(&e)
        )
    })
}

/// `pem` without a leading UTF-8 byte order mark, which editors on some
/// systems write and OpenSSL (so libpq) reads past; the PEM parser would
/// skip the first section behind it.
fn without_bom(pem: &[u8]) -> &[u8] {
    pem.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(pem)
}

/// What is wrong with a PEM file, in words (rustls's own show the markers
/// as byte arrays).
fn pem_problem(e: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match e {
        Error::MissingSectionEnd { end_marker } => format!(
            "a section has no -----END {}----- line (is the file cut short?)",
            text(end_marker)
        ),
        Error::IllegalSectionStart { line } => {
            format!("a malformed -----BEGIN line: {}", text(line))
        }
        Error::NoItemsFound => "no PEM section of that kind in the file".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_stops_loading_keeps_its_last_good_copy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let check = |b: &[u8]| first_line(b).map(drop);
        // Never loaded: the error.
        assert!(load("--x", &path, check).is_err());
        std::fs::write(&path, "one\n").unwrap();
        let l = load("--x", &path, check).unwrap();
        assert_eq!((l.bytes.as_slice(), l.kept), (&b"one\n"[..], None));
        // Rotated: the new one.
        std::fs::write(&path, "two\n").unwrap();
        assert_eq!(load("--x", &path, check).unwrap().bytes, b"two\n");
        // Broken, then gone: the last good copy, and why.
        std::fs::write(&path, "\n").unwrap();
        let l = load("--x", &path, check).unwrap();
        assert_eq!(l.bytes, b"two\n");
        assert!(l.kept.unwrap().contains("empty"));
        std::fs::remove_file(&path).unwrap();
        let l = load("--x", &path, check).unwrap();
        assert_eq!(l.bytes, b"two\n");
        assert!(l.kept.is_some());
        assert_eq!(first_line(b"pw\r\nrest").unwrap(), "pw");
    }

    #[test]
    fn pem_faults_are_said_in_words() {
        let cut = b"-----BEGIN CERTIFICATE-----\nMIIB\n";
        let err = pem_certs(cut).unwrap_err();
        assert!(err.contains("no -----END CERTIFICATE----- line"), "{err}");
        assert_eq!(pem_certs(b"").unwrap_err(), "no certificate in the file");
        // A leading byte order mark hides no section (OpenSSL reads past it).
        let one = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let bom = [&b"\xEF\xBB\xBF"[..], one.as_bytes(), one.as_bytes()].concat();
        assert_eq!(pem_certs(&bom).map(|c| c.len()), Ok(2));
        for encrypted in [
            &b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n"[..],
            b"-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00\n\nMIIB\n-----END EC PRIVATE KEY-----\n",
        ] {
            let err = pem_key(encrypted).unwrap_err();
            assert!(err.contains("encrypted with a passphrase"), "{err}");
        }
        let err =
            pem_key(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").unwrap_err();
        assert!(err.contains("no PEM section of that kind"), "{err}");
    }
}
