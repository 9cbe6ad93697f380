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
//! | verify-full | yes | checked | checked (DNS name or IP address SAN) |
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
//! The side SQL connection uses [`client_config`] (tokio-postgres over
//! rustls). The replication connection hands the same policy to its
//! transport through [`replication_tls`]; the transport checks host names
//! only, so for verify-ca (and `require` with a root) the relay first looks
//! at the certificate the server presents, checking its chain with its own
//! verifier, and then asks the transport to verify the chain against a name
//! that certificate carries: the chain is checked twice, the name never
//! against the URL's host.

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

fn root_store(root: &RootCert) -> Result<(RootCertStore, Loaded, PathBuf), TlsSetupError> {
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
    Ok((store, loaded, path))
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

fn client_auth(c: &ClientCert) -> Result<(ClientAuth, Loaded, Loaded), TlsSetupError> {
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
    let auth = (
        parse_certs(&cert.bytes).expect("checked when loaded"),
        parse_key(&key.bytes).expect("checked when loaded"),
    );
    Ok((auth, cert, key))
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
            let (store, _, path) = root_store(root)?;
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(store), Arc::clone(provider))
                    .build()
                    .map_err(|e| TlsSetupError {
                        param: "sslrootcert",
                        path: path.display().to_string(),
                        reason: e.to_string(),
                    })?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
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
            let ((chain, key), _, _) = client_auth(c)?;
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

/// What the replication transport's TLS needs from the relay: `Plain`,
/// or a config ready to use.
pub enum ReplicationTls {
    /// No TLS on this attempt.
    Plain,
    /// This transport config.
    Tls(pgwire_replication::TlsConfig),
}

/// The replication transport's TLS settings for `conn` (the same policy as
/// [`client_config`]; `fallback` as there). For verify-ca this connects
/// once to read the name on the server's certificate (see the module
/// docs). Errors: as [`client_config`], and a verify-ca probe that fails
/// (the server refused TLS, or its chain is not trusted), as text.
pub async fn replication_tls(conn: &ConnParams, fallback: bool) -> Result<ReplicationTls, String> {
    use pgwire_replication::TlsConfig;
    let mode = conn.sslmode;
    if mode == SslMode::Disable || (mode == SslMode::Allow && !fallback) || over_unix_socket(conn) {
        return Ok(ReplicationTls::Plain);
    }
    let mut tls = match &conn.ssl_root_cert {
        Some(root) if mode.checks_chain(Some(root)) => {
            let (_, loaded, path) = root_store(root).map_err(|e| e.to_string())?;
            let ca = usable_path(&path, &loaded)?;
            let name = if mode == SslMode::VerifyFull {
                conn.host.clone()
            } else {
                presented_name(conn).await?
            };
            TlsConfig::verify_full(Some(ca)).with_sni_hostname(name)
        }
        _ if mode == SslMode::Prefer => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::require()
        },
        _ => TlsConfig::require(),
    };
    if let Some(c) = &conn.ssl_client_cert {
        let (_, cert, key) = client_auth(c).map_err(|e| e.to_string())?;
        tls = tls.with_client_cert(usable_path(&c.cert, &cert)?, usable_path(&c.key, &key)?);
    }
    Ok(ReplicationTls::Tls(tls))
}

/// The path the transport should read for `loaded`: the file itself, or,
/// when it no longer loads, a private copy of the one that last did.
fn usable_path(path: &Path, loaded: &Loaded) -> Result<PathBuf, String> {
    if loaded.kept.is_none() {
        return Ok(path.to_owned());
    }
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = std::env::temp_dir().join(format!("cdc-relay-{}-tls", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let name = path
        .to_string_lossy()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "_");
    let copy = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&copy)
        .map_err(|e| format!("{}: {e}", copy.display()))?;
    f.write_all(&loaded.bytes)
        .map_err(|e| format!("{}: {e}", copy.display()))?;
    Ok(copy)
}

/// Connects to `conn`, negotiates TLS checking the server's chain and
/// returns a name its certificate carries: the first DNS name (a
/// wildcard's first label made concrete) or IP address of its
/// subjectAltName.
async fn presented_name(conn: &ConnParams) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let seen = Arc::new(Mutex::new(None));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let capture = Capture {
        inner: verifier(conn, &provider).map_err(|e| e.to_string())?,
        seen: Arc::clone(&seen),
    };
    let config = config_with(conn, provider, Arc::new(capture)).map_err(|e| e.to_string())?;
    let probe = async {
        let mut tcp = tokio::net::TcpStream::connect((conn.host.as_str(), conn.port))
            .await
            .map_err(|e| format!("connecting to {}:{}: {e}", conn.host, conn.port))?;
        // SSLRequest (PostgreSQL docs, "Message Formats").
        tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
            .await
            .map_err(|e| e.to_string())?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .await
            .map_err(|e| e.to_string())?;
        if answer[0] != b'S' {
            return Err("server does not support TLS (SSLRequest refused)".to_owned());
        }
        let server_name = ServerName::try_from(conn.host.clone())
            .unwrap_or_else(|_| ServerName::try_from("localhost").expect("a valid name"));
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name, tcp)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        let _ = tls.shutdown().await;
        Ok(())
    };
    tokio::time::timeout(conn.connect_timeout, probe)
        .await
        .map_err(|_| {
            format!(
                "no TLS handshake with {}:{} within {:?}",
                conn.host, conn.port, conn.connect_timeout
            )
        })??;
    let cert = seen
        .lock()
        .expect("never poisoned")
        .take()
        .ok_or("the server presented no certificate")?;
    certificate_name(&cert).ok_or_else(|| {
        "the server's certificate has no subjectAltName (DNS name or IP address); the relay \
         checks names only there: reissue the certificate with one"
            .to_owned()
    })
}

/// The first DNS name or IP address in `cert`'s subjectAltName, usable as
/// a server name that the certificate is valid for.
fn certificate_name(cert: &CertificateDer<'_>) -> Option<String> {
    use x509_cert::der::Decode;
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let cert = x509_cert::Certificate::from_der(cert.as_ref()).ok()?;
    let (_, san) = cert.tbs_certificate.get::<SubjectAltName>().ok()??;
    san.0.iter().find_map(|name| match name {
        GeneralName::DnsName(n) => {
            let n = n.as_str();
            Some(match n.strip_prefix("*.") {
                Some(rest) => format!("relay.{rest}"),
                None => n.to_owned(),
            })
        }
        GeneralName::IpAddress(octets) => {
            let b = octets.as_bytes();
            match b.len() {
                4 => Some(std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string()),
                16 => {
                    let a: [u8; 16] = b.try_into().ok()?;
                    Some(std::net::Ipv6Addr::from(a).to_string())
                }
                _ => None,
            }
        }
        _ => None,
    })
}

/// Records the end-entity certificate `inner` was asked to verify.
#[derive(Debug)]
struct Capture {
    inner: Arc<dyn ServerCertVerifier>,
    seen: Arc<Mutex<Option<CertificateDer<'static>>>>,
}

impl ServerCertVerifier for Capture {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock().expect("never poisoned") = Some(end_entity.clone().into_owned());
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// verify-ca: the chain must lead to a trusted root; the name may differ.
#[derive(Debug)]
struct ChainOnly(Arc<dyn ServerCertVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
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
