//! TLS for both database connections, following libpq (PostgreSQL docs,
//! "SSL Support" → "Protection Provided in Different Modes", and "libpq —
//! Parameter Key Words"):
//!
//! | sslmode | encryption | certificate chain | host name |
//! |---|---|---|---|
//! | disable | no | — | — |
//! | allow | only if the server refuses a plain connection | checked only when a root certificate is known | not checked |
//! | prefer (default) | if the server offers it; plain text if the handshake fails | checked only when a root certificate is known | not checked |
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
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::{ClientConfig, RootCertStore};

use super::conn::{ClientCert, ConnParams, RootCert, SslMode};

mod names;
mod verify;

use verify::{Names, PathLimit, Unverified, Verify};

use super::conn::tls_params::default_file as tls_params_default;
use crate::reread::Loaded;

/// A TLS file could not be used: `param` names the URL parameter
/// (`sslrootcert`, `sslcert`, `sslkey`), or `env` libpq's environment
/// variable it came from (`PGSSLROOTCERT=/etc/ca.pem: …`).
#[derive(Debug)]
pub struct TlsSetupError {
    param: &'static str,
    env: Option<&'static str>,
    path: String,
    reason: String,
}

impl std::fmt::Display for TlsSetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            param,
            env,
            path,
            reason,
        } = self;
        match env {
            Some(var) => write!(f, "{var}={path} (the environment's {param}): {reason}"),
            None => write!(f, "{param}={path}: {reason}"),
        }
    }
}

impl std::error::Error for TlsSetupError {}

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
                env: None,
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
        env: None,
        param,
        path: path.display().to_string(),
        reason,
    })
}

/// What an `sslrootcert` file gives, read now: its self-signed
/// certificates usable as roots (a chain must end at one, as OpenSSL checks
/// it for libpq: an intermediate alone in the file is no root, nor is an
/// expired one, one that is not a CA, or one whose usage forbids signing
/// certificates), all its self-signed certificates (`own`: one of them
/// presented by the server itself is trusted as libpq trusts it), its
/// other certificates (intermediates a server may leave out), why each
/// self-signed one that is no root is not, and whether any constrains
/// names.
struct Roots {
    store: RootCertStore,
    /// The usable roots that limit the CA certificates below them.
    limits: Vec<PathLimit>,
    own: Vec<CertificateDer<'static>>,
    others: Vec<CertificateDer<'static>>,
    unusable: Vec<String>,
    constrained: bool,
    path: PathBuf,
}

fn root_store(root: &RootCert) -> Result<Roots, TlsSetupError> {
    let path = root_file(root)?;
    let check = |b: &[u8]| {
        if !crate::reread::pem_certs(b)?.iter().any(names::self_signed) {
            return Err(
                "no self-signed CA certificate in the file (a chain is trusted only up \
                        to a self-signed root, as libpq trusts it): add the root CA"
                    .to_owned(),
            );
        }
        Ok(())
    };
    let loaded = load("sslrootcert", &path, check)?;
    let certs = crate::reread::pem_certs(&loaded.bytes).expect("checked when loaded");
    let constrained = certs.iter().any(names::constrains_names);
    let (own, others): (Vec<_>, Vec<_>) = certs.into_iter().partition(names::self_signed);
    let now = UnixTime::now();
    let mut store = RootCertStore::empty();
    let mut unusable = Vec::new();
    let mut limits = Vec::new();
    for cert in &own {
        match names::unusable_as_root(cert, now) {
            None => match webpki::anchor_from_trusted_cert(cert) {
                Ok(anchor) => {
                    if let Some(max) = names::path_len(cert) {
                        limits.push(PathLimit {
                            subject: anchor.subject.to_vec(),
                            spki: anchor.subject_public_key_info.to_vec(),
                            max,
                        });
                    }
                    store.roots.push(anchor.to_owned());
                }
                Err(e) => unusable.push(format!("{e:?}")),
            },
            Some(why) => unusable.push(why),
        }
    }
    Ok(Roots {
        store,
        limits,
        own,
        others,
        unusable,
        constrained,
        path,
    })
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
    let mut cert = load("sslcert", &c.cert, |b| {
        crate::reread::pem_certs(b).map(drop)
    })?;
    let mut key = load("sslkey", &c.key, |b| crate::reread::pem_key(b).map(drop))?;
    let pair_key = (c.cert.clone(), c.key.clone());
    let mut pairs = LAST_PAIR.lock().expect("never poisoned");
    // The key's mode is checked at each load, as libpq checks it at each
    // connection: a rotated key readable by others is not used.
    let verdict = super::conn::tls_params::check_key_file(&c.key)
        .map_err(|e| e.to_string())
        .and_then(|()| keys_match(&cert.bytes, &key.bytes));
    match verdict {
        Ok(()) => {
            pairs.insert(pair_key, (cert.bytes.clone(), key.bytes.clone()));
        }
        Err(reason) => match pairs.get(&pair_key) {
            Some((good_cert, good_key)) => {
                tracing::error!(
                    "sslkey={} cannot be used with sslcert={} ({reason}); new connections keep \
                     using the pair that last loaded until both files are right",
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
                    env: None,
                    param: "sslkey",
                    path: c.key.display().to_string(),
                    reason: format!("does not match sslcert={}: {reason}", c.cert.display()),
                });
            }
        },
    }
    Ok((
        crate::reread::pem_certs(&cert.bytes).expect("checked when loaded"),
        crate::reread::pem_key(&key.bytes).expect("checked when loaded"),
    ))
}

/// Whether the private key in `key` belongs to the certificate in `cert`.
fn keys_match(cert: &[u8], key: &[u8]) -> Result<(), String> {
    let chain = crate::reread::pem_certs(cert)?;
    let key = crate::reread::pem_key(key)?;
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
/// when it goes without TLS (`disable`, a Unix socket). `fallback` asks
/// for the second attempt libpq makes: `allow`'s TLS after the server
/// refused plain text, `prefer`'s plain text after a failed TLS handshake.
/// Errors: a root or client certificate file that does not load and never
/// did.
pub fn client_config(
    conn: &ConnParams,
    fallback: bool,
) -> Result<Option<ClientConfig>, TlsSetupError> {
    let mode = conn.sslmode;
    if mode == SslMode::Disable
        || (mode == SslMode::Allow && !fallback)
        || (mode == SslMode::Prefer && fallback)
        || over_unix_socket(conn)
    {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    verifier(conn, &provider)
        .and_then(|verifier| config_with(conn, provider, verifier))
        .map(Some)
        .map_err(|mut e| {
            e.reason = super::conn::tls_params::name_env(&e.reason, &conn.tls_from_env);
            e.env = conn
                .tls_from_env
                .iter()
                .find(|(param, _)| *param == e.param)
                .map(|(_, var)| *var);
            e
        })
}

/// Loads every TLS file either of libpq's attempts for `conn` would use
/// (`prefer` tries TLS first, `allow` second), so a file that never loads
/// is a configuration error at startup, not a failed connection later.
/// Errors: as [`client_config`].
pub fn check_files(conn: &ConnParams) -> Result<(), TlsSetupError> {
    client_config(conn, false)?;
    client_config(conn, true)?;
    Ok(())
}

/// The verifier `conn`'s sslmode and root certificate ask for.
fn verifier(
    conn: &ConnParams,
    provider: &Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn ServerCertVerifier>, TlsSetupError> {
    let mode = conn.sslmode;
    // libpq's default root, looked for again at each connection.
    let default_root = || tls_params_default("root.crt").map(RootCert::File);
    let root = conn.ssl_root_cert.clone().or_else(default_root);
    Ok(match &root {
        Some(root) if mode.checks_chain(Some(root)) => {
            let roots = root_store(root)?;
            let anchors = roots.store.roots.clone();
            // No usable root: only a server presenting one of the file's
            // own certificates can be trusted.
            let webpki = if roots.store.is_empty() {
                None
            } else {
                Some(
                    WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots.store),
                        Arc::clone(provider),
                    )
                    .build()
                    .map_err(|e| TlsSetupError {
                        env: None,
                        param: "sslrootcert",
                        path: roots.path.display().to_string(),
                        reason: e.to_string(),
                    })? as Arc<dyn ServerCertVerifier>,
                )
            };
            let names = if mode == SslMode::VerifyFull {
                Names::AsLibpq {
                    host: conn.host.clone(),
                }
            } else {
                Names::Ignored
            };
            Arc::new(Verify {
                webpki,
                limits: roots.limits,
                anchors,
                provider: Arc::clone(provider),
                names,
                own: roots.own,
                intermediates: roots.others,
                unusable: roots.unusable,
                constrained: roots.constrained,
            })
        }
        _ => Arc::new(Unverified(Arc::clone(provider))),
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
    let default_client = || {
        Some(ClientCert {
            cert: tls_params_default("postgresql.crt")?,
            key: tls_params_default("postgresql.key")?,
        })
    };
    let client = conn.ssl_client_cert.clone().or_else(default_client);
    Ok(match &client {
        Some(c) => {
            let (chain, key) = client_auth(c)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsSetupError {
                    env: None,
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
