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
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::conn::{ClientCert, ConnParams, RootCert, SslMode};

mod names;

use super::conn::tls_params::default_file as tls_params_default;
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
    own: Vec<CertificateDer<'static>>,
    others: Vec<CertificateDer<'static>>,
    unusable: Vec<String>,
    constrained: bool,
    path: PathBuf,
}

fn root_store(root: &RootCert) -> Result<Roots, TlsSetupError> {
    let path = root_file(root)?;
    let check = |b: &[u8]| {
        if !parse_certs(b)?.iter().any(names::self_signed) {
            return Err(
                "no self-signed CA certificate in the file (a chain is trusted only up \
                        to a self-signed root, as libpq trusts it): add the root CA"
                    .to_owned(),
            );
        }
        Ok(())
    };
    let loaded = load("sslrootcert", &path, check)?;
    let certs = parse_certs(&loaded.bytes).expect("checked when loaded");
    let constrained = certs.iter().any(names::constrains_names);
    let (own, others): (Vec<_>, Vec<_>) = certs.into_iter().partition(names::self_signed);
    let now = UnixTime::now();
    let mut store = RootCertStore::empty();
    let mut unusable = Vec::new();
    for cert in &own {
        match names::unusable_as_root(cert, now) {
            None => {
                if let Err(e) = store.add(cert.clone()) {
                    unusable.push(e.to_string());
                }
            }
            Some(why) => unusable.push(why),
        }
    }
    Ok(Roots {
        store,
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
    let mut cert = load("sslcert", &c.cert, |b| parse_certs(b).map(drop))?;
    let mut key = load("sslkey", &c.key, |b| parse_key(b).map(drop))?;
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
    let verifier = verifier(conn, &provider)?;
    config_with(conn, provider, verifier).map(Some)
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
                signatures: NoVerification(Arc::clone(provider)),
                names,
                own: roots.own,
                intermediates: roots.others,
                unusable: roots.unusable,
                constrained: roots.constrained,
            })
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

/// A chain checked against `sslrootcert` (verify-ca, verify-full, and
/// the weaker modes when a root is known, as libpq does): the chain,
/// validity and extended key usage as webpki checks them, with the file's
/// other certificates as intermediates; the server certificate's key
/// usage as OpenSSL's `sslserver` purpose checks it; and the host name as
/// `names` says. A server presenting one of the file's own self-signed
/// certificates (PostgreSQL's documented `openssl req -x509` recipe) is
/// trusted as libpq trusts it, within its validity, where webpki refuses a
/// CA as an end entity or finds no root for it.
#[derive(Debug)]
struct Verify {
    /// webpki over the usable roots; `None` when the file has none.
    webpki: Option<Arc<dyn ServerCertVerifier>>,
    /// The handshake signatures, checked with the presented key.
    signatures: NoVerification,
    names: Names,
    own: Vec<CertificateDer<'static>>,
    intermediates: Vec<CertificateDer<'static>>,
    /// Why the file's self-signed certificates that are no root are not.
    unusable: Vec<String>,
    /// A certificate of the file constrains names (the common name, which
    /// name constraints do not cover, is then not compared).
    constrained: bool,
}

/// How the host name is checked.
#[derive(Debug)]
enum Names {
    /// Not at all (the chain is what is checked).
    Ignored,
    /// verify-full: as libpq matches `host`, the text of the URL's host
    /// ([`names::check`]).
    AsLibpq { host: String },
}

impl Verify {
    /// The chain as webpki and OpenSSL check it, the name aside.
    fn chain(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        use rustls::CertificateError::{
            NotValidForName, NotValidForNameContext, Other, UnknownIssuer,
        };
        let own = || {
            self.own.iter().any(|c| c.as_ref() == end_entity.as_ref())
                && names::valid_at(end_entity, now)
        };
        let Some(webpki) = &self.webpki else {
            return if own() { Ok(()) } else { Err(self.no_root()) };
        };
        let with_file: Vec<CertificateDer<'_>>;
        let intermediates = if self.intermediates.is_empty() {
            intermediates
        } else {
            with_file = intermediates
                .iter()
                .chain(&self.intermediates)
                .cloned()
                .collect();
            &with_file
        };
        // webpki checks the name last (after the chain, validity and
        // usage) and a CA as an end entity after its validity: a name
        // error means what libpq checks of the chain has passed.
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Ok(_) => Ok(()),
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => Ok(()),
            Err(rustls::Error::InvalidCertificate(Other(e)))
                if matches!(
                    e.0.downcast_ref::<webpki::Error>(),
                    Some(webpki::Error::CaUsedAsEndEntity)
                ) && own() =>
            {
                Ok(())
            }
            Err(rustls::Error::InvalidCertificate(UnknownIssuer)) if own() => Ok(()),
            Err(rustls::Error::InvalidCertificate(UnknownIssuer)) if !self.unusable.is_empty() => {
                Err(self.no_root())
            }
            Err(e) => Err(e),
        }
    }

    /// No usable root for the presented chain, naming the file's
    /// self-signed certificates that are no root and why.
    fn no_root(&self) -> rustls::Error {
        rustls::Error::General(format!(
            "invalid peer certificate: UnknownIssuer (sslrootcert's self-signed certificates \
             that cannot be roots: {})",
            if self.unusable.is_empty() {
                "none".to_owned()
            } else {
                self.unusable.join("; ")
            }
        ))
    }
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
        self.chain(end_entity, intermediates, server_name, ocsp, now)?;
        if !names::usable_by_a_server(end_entity) {
            return Err(rustls::Error::General(
                "invalid peer certificate: its keyUsage or extendedKeyUsage does not allow a TLS \
                 server's use (keyUsage digitalSignature, keyEncipherment or keyAgreement; \
                 extendedKeyUsage serverAuth)"
                    .into(),
            ));
        }
        let Names::AsLibpq { host } = &self.names else {
            return Ok(ServerCertVerified::assertion());
        };
        let common_name_allowed =
            !self.constrained && !intermediates.iter().any(names::constrains_names);
        match names::check(end_entity, host, common_name_allowed) {
            Ok(()) => Ok(ServerCertVerified::assertion()),
            Err(presented) => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext {
                    expected: ServerName::try_from(host.clone())
                        .unwrap_or_else(|_| server_name.to_owned()),
                    presented,
                },
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.signatures.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.signatures.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.signatures.supported_verify_schemes()
    }
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
