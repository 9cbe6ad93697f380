//! TLS for both database connections, following libpq (PostgreSQL docs,
//! "SSL Support" → "Protection Provided in Different Modes", and "libpq —
//! Parameter Key Words"):
//!
//! | sslmode | encryption | certificate chain | host name |
//! |---|---|---|---|
//! | disable | no | — | — |
//! | allow | only if the server refuses a plain connection | not checked | not checked |
//! | prefer (default) | if the server offers it | not checked | not checked |
//! | require | yes | checked only when a root certificate is known | not checked |
//! | verify-ca | yes | checked | not checked |
//! | verify-full | yes | checked | checked, as libpq matches it (below) |
//!
//! Host names (verify-full) are matched as libpq matches them: against the
//! certificate's subjectAltName entries, and, when it has none of the
//! host's type (DNS names for a host name, IP addresses for an IP
//! address), against its common name, where `*.` stands for one leftmost
//! label (`fe-secure-openssl.c`, `fe-secure-common.c`).
//!
//! Roots: `sslrootcert` (a PEM file, or `system`: the system's bundle, and
//! then only verify-full), else `~/.postgresql/root.crt` when it exists;
//! verify-ca and verify-full without either are refused when the URL is
//! parsed. Client certificates: `sslcert`/`sslkey`, else
//! `~/.postgresql/postgresql.crt`/`.key` when they exist.
//!
//! Every file is read again for each new connection, so a rotated CA or
//! client certificate is used without a restart; a file that no longer
//! loads keeps the copy that last loaded, and says so at ERROR.
//!
//! Both connections use the one rustls config of [`client_config`]: the
//! side SQL connection through tokio-postgres, the replication connection
//! through its transport ([`replication_tls`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::conn::{ClientCert, ConnParams, RootCert, SslMode};
use crate::reread::Loaded;

/// A TLS file could not be used: `param` names the URL parameter
/// (`sslrootcert`, `sslcert`, `sslkey`).
#[derive(Debug, thiserror::Error)]
#[error("{param}={path}: {reason}")]
pub struct TlsSetupError {
    param: &'static str,
    path: String,
    reason: String,
}

/// Where the system's trusted roots are looked for when
/// `sslrootcert=system` and `SSL_CERT_FILE` is unset (Debian/Ubuntu,
/// RHEL/Fedora, SUSE, Alpine/others).
const SYSTEM_BUNDLES: [&str; 5] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The PEM file behind `root`: the file itself, or the system bundle.
fn root_file(root: &RootCert) -> Result<PathBuf, TlsSetupError> {
    match root {
        RootCert::File(p) => Ok(p.clone()),
        RootCert::System => std::env::var_os("SSL_CERT_FILE")
            .map(PathBuf::from)
            .or_else(|| {
                SYSTEM_BUNDLES
                    .iter()
                    .map(PathBuf::from)
                    .find(|p| p.exists())
            })
            .ok_or_else(|| TlsSetupError {
                param: "sslrootcert",
                path: "system".into(),
                reason: "no system CA bundle found: install the ca-certificates package or set \
                         SSL_CERT_FILE"
                    .into(),
            }),
    }
}

/// [`crate::reread::load`], failing with a [`TlsSetupError`] naming
/// `param`.
fn load(
    param: &'static str,
    path: &Path,
    check: impl Fn(&[u8]) -> Result<(), String>,
) -> Result<Loaded, TlsSetupError> {
    crate::reread::load(param, path, check).map_err(|reason| TlsSetupError {
        param,
        path: path.display().to_string(),
        reason,
    })
}

fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err("no certificate in the file".into());
    }
    Ok(certs)
}

fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| format!("not an unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"))
}

fn root_store(root: &RootCert) -> Result<(RootCertStore, PathBuf), TlsSetupError> {
    let path = root_file(root)?;
    let check = |b: &[u8]| {
        let mut store = RootCertStore::empty();
        let (added, _) = store.add_parsable_certificates(parse_certs(b)?);
        if added == 0 {
            return Err("no usable CA certificate in the file".to_owned());
        }
        Ok(())
    };
    let loaded = load("sslrootcert", &path, check)?;
    let mut store = RootCertStore::empty();
    store.add_parsable_certificates(parse_certs(&loaded.bytes).expect("checked when loaded"));
    Ok((store, path))
}

type ClientAuth = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// The last certificate and key that loaded and matched, by their paths:
/// a rotation replaces the two files one after the other, and a connection
/// made in between keeps the pair that matched.
static LAST_PAIR: std::sync::LazyLock<Mutex<std::collections::HashMap<PairPaths, PairBytes>>> =
    std::sync::LazyLock::new(Default::default);

/// A certificate's and its key's paths, and their contents.
type PairPaths = (PathBuf, PathBuf);
type PairBytes = (Vec<u8>, Vec<u8>);

fn client_auth(c: &ClientCert) -> Result<ClientAuth, TlsSetupError> {
    let mut cert = load("sslcert", &c.cert, |b| parse_certs(b).map(drop))?;
    let mut key = load("sslkey", &c.key, |b| parse_key(b).map(drop))?;
    let pair_key = (c.cert.clone(), c.key.clone());
    let mut pairs = LAST_PAIR.lock().expect("never poisoned");
    match keys_match(&cert.bytes, &key.bytes) {
        Ok(()) => {
            pairs.insert(pair_key, (cert.bytes.clone(), key.bytes.clone()));
        }
        Err(reason) => match pairs.get(&pair_key) {
            Some((good_cert, good_key)) => {
                tracing::error!(
                    "sslkey={} does not match sslcert={} ({reason}); new connections keep using \
                     the copy that last loaded until both files match",
                    c.key.display(),
                    c.cert.display()
                );
                cert = Loaded {
                    bytes: good_cert.clone(),
                    kept: Some(reason.clone()),
                };
                key = Loaded {
                    bytes: good_key.clone(),
                    kept: Some(reason),
                };
            }
            None => {
                return Err(TlsSetupError {
                    param: "sslkey",
                    path: c.key.display().to_string(),
                    reason: format!("does not match sslcert={}: {reason}", c.cert.display()),
                });
            }
        },
    }
    Ok((
        parse_certs(&cert.bytes).expect("checked when loaded"),
        parse_key(&key.bytes).expect("checked when loaded"),
    ))
}

/// Whether the private key in `key` belongs to the certificate in `cert`.
fn keys_match(cert: &[u8], key: &[u8]) -> Result<(), String> {
    let chain = parse_certs(cert)?;
    let key = parse_key(key)?;
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| e.to_string())?;
    rustls::sign::CertifiedKey::new(chain, signing)
        .keys_match()
        .map_err(|e| match e.to_string() {
            v1 if v1.contains("UnsupportedCertVersion") => "the certificate is X.509 version 1, \
                which the relay's TLS library refuses: reissue it as version 3"
                .to_owned(),
            other => other,
        })
}

/// Whether `conn` is a Unix socket connection (TLS never applies there, as
/// in libpq).
fn over_unix_socket(conn: &ConnParams) -> bool {
    conn.host.starts_with('/')
}

/// A rustls client config for the side connection to `conn`, or `None`
/// when it goes without TLS (`disable`, a Unix socket; `allow` asks for
/// `fallback` to get the config of its second attempt). Errors: a root or
/// client certificate file that does not load and never did.
pub fn client_config(
    conn: &ConnParams,
    fallback: bool,
) -> Result<Option<ClientConfig>, TlsSetupError> {
    let mode = conn.sslmode;
    if mode == SslMode::Disable || (mode == SslMode::Allow && !fallback) || over_unix_socket(conn) {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = verifier(conn, &provider)?;
    config_with(conn, provider, verifier).map(Some)
}

/// The verifier `conn`'s sslmode and root certificate ask for.
fn verifier(
    conn: &ConnParams,
    provider: &Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn ServerCertVerifier>, TlsSetupError> {
    let mode = conn.sslmode;
    Ok(match &conn.ssl_root_cert {
        Some(root) if mode.checks_chain(Some(root)) => {
            let (store, path) = root_store(root)?;
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(store), Arc::clone(provider))
                    .build()
                    .map_err(|e| TlsSetupError {
                        param: "sslrootcert",
                        path: path.display().to_string(),
                        reason: e.to_string(),
                    })?;
            let names = if mode == SslMode::VerifyFull {
                Names::AsLibpq
            } else {
                Names::Ignored
            };
            Arc::new(Verify { webpki, names })
        }
        _ => Arc::new(NoVerification(Arc::clone(provider))),
    })
}

/// A client config with `verifier` and `conn`'s client certificate.
fn config_with(
    conn: &ConnParams,
    provider: Arc<rustls::crypto::CryptoProvider>,
    verifier: Arc<dyn ServerCertVerifier>,
) -> Result<ClientConfig, TlsSetupError> {
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    Ok(match &conn.ssl_client_cert {
        Some(c) => {
            let (chain, key) = client_auth(c)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsSetupError {
                    param: "sslkey",
                    path: c.key.display().to_string(),
                    reason: format!("does not match sslcert={}: {e}", c.cert.display()),
                })?
        }
        None => builder.with_no_client_auth(),
    })
}

/// The replication transport's TLS settings for `conn`: the rustls config
/// of [`client_config`] (`fallback` as there) as it is, so the stream's
/// connection checks certificates exactly as the side connection does.
/// Errors: as [`client_config`].
pub fn replication_tls(
    conn: &ConnParams,
    fallback: bool,
) -> Result<pgwire_replication::TlsConfig, TlsSetupError> {
    use pgwire_replication::TlsConfig;
    let Some(config) = client_config(conn, fallback)? else {
        return Ok(TlsConfig::disabled());
    };
    let mode = match conn.sslmode {
        SslMode::Prefer => pgwire_replication::SslMode::Prefer,
        _ => pgwire_replication::SslMode::Require,
    };
    Ok(TlsConfig {
        mode,
        ..TlsConfig::default()
    }
    .with_rustls_config(Arc::new(config)))
}

/// verify-ca and verify-full: the chain, validity and usage as webpki
/// checks them, and the host name as `names` says.
#[derive(Debug)]
struct Verify {
    webpki: Arc<dyn ServerCertVerifier>,
    names: Names,
}

/// What a certificate webpki finds valid but not for the host's name gets.
#[derive(Debug, Clone, Copy)]
enum Names {
    /// verify-ca: accepted (the chain is what is checked).
    Ignored,
    /// verify-full: accepted when libpq's common-name fallback matches
    /// ([`common_name_matches`]).
    AsLibpq,
}

impl ServerCertVerifier for Verify {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the name last: a name error means the chain,
        // validity and usage were accepted.
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) if match self.names {
                Names::Ignored => true,
                Names::AsLibpq => common_name_matches(end_entity, server_name),
            } =>
            {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// libpq's common-name fallback: whether `cert` has no subjectAltName entry
/// of `host`'s type (an IP address for an IP host, else a DNS name) and
/// its first common name matches `host` (ASCII case-insensitively, a
/// leading `*.` standing for one label). PostgreSQL's
/// `fe-secure-openssl.c`, "If there is no subjectAltName extension of the
/// matching type, check the Common Name".
fn common_name_matches(cert: &CertificateDer<'_>, host: &ServerName<'_>) -> bool {
    use x509_cert::der::Decode;
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    const CN: x509_cert::der::oid::ObjectIdentifier =
        x509_cert::der::oid::ObjectIdentifier::new_unwrap("2.5.4.3");
    let Ok(cert) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return false;
    };
    let by_ip = matches!(host, ServerName::IpAddress(_));
    if let Ok(Some((_, san))) = cert.tbs_certificate.get::<SubjectAltName>() {
        let same_type = |n: &GeneralName| match n {
            GeneralName::IpAddress(_) => by_ip,
            GeneralName::DnsName(_) => !by_ip,
            _ => false,
        };
        if san.0.iter().any(same_type) {
            return false;
        }
    }
    let common_name = cert
        .tbs_certificate
        .subject
        .0
        .iter()
        .flat_map(|rdn| rdn.0.iter())
        .find(|atv| atv.oid == CN)
        .and_then(|atv| std::str::from_utf8(atv.value.value()).ok());
    common_name.is_some_and(|cn| name_matches(cn, &host.to_str()))
}

/// Whether the certificate name `pattern` stands for `host`: equal ignoring
/// ASCII case, or `*.rest` where `host` is one label (no dot) followed by
/// `.rest` (libpq's `wildcard_certificate_match`). A name holding a NUL
/// matches nothing.
fn name_matches(pattern: &str, host: &str) -> bool {
    if pattern.contains('\0') {
        return false;
    }
    if pattern.eq_ignore_ascii_case(host) {
        return true;
    }
    let Some(rest) = pattern.strip_prefix('*') else {
        return false;
    };
    if !rest.starts_with('.') || rest.len() < 2 || host.len() < rest.len() {
        return false;
    }
    let (label, suffix) = host.split_at(host.len() - rest.len());
    suffix.eq_ignore_ascii_case(rest) && !label.is_empty() && !label.contains('.')
}

/// prefer/require: encryption without authentication, as libpq does.
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    #[test]
    fn a_common_name_matches_as_libpq_matches_it() {
        for (pattern, host, want) in [
            ("db.example.com", "db.example.com", true),
            ("DB.Example.com", "db.example.COM", true),
            ("db.example.com", "db2.example.com", false),
            ("127.0.0.1", "127.0.0.1", true),
            ("*.example.com", "db.example.com", true),
            ("*.example.com", "a.db.example.com", false),
            ("*.example.com", "example.com", false),
            ("*.example.com", ".example.com", false),
            ("*example.com", "dbexample.com", false),
            ("*.", "a.", false),
            ("db.example.com\0.evil", "db.example.com", false),
        ] {
            assert_eq!(name_matches(pattern, host), want, "{pattern} for {host}");
        }
    }
}
