//! TLS to https sinks: the webpki roots plus `--sink-ca-file`, and an
//! optional client certificate (`--sink-client-cert`, `--sink-client-key`)
//! for receivers that ask for one (mutual TLS). Both files are read again
//! for each new connection ([`crate::reread`]): a rotated CA or client
//! certificate is used without a restart, and a file that no longer loads
//! keeps the copy that last loaded (ERROR in the log). The OTLP
//! collector's CA (`--otlp-certificate`) is trusted the same way
//! ([`roots_config`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rustls::client::ResolvesClientCert;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::SinkError;
use crate::reread;

/// The TLS files of the https sinks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SinkTls {
    /// Extra CA certificate(s), PEM, trusted besides the webpki roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM chain) and its unencrypted PEM key.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

const CA_FLAG: &str = "--sink-ca-file";
const CERT_FLAG: &str = "--sink-client-cert";
const KEY_FLAG: &str = "--sink-client-key";

impl SinkTls {
    /// Loads every file once: an error names the flag and the file.
    pub fn check(&self) -> Result<(), String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        if let Some(path) = &self.ca_file {
            let loaded = reread::load(CA_FLAG, path, check_roots)
                .map_err(|r| format!("{CA_FLAG} {}: {r}", path.display()))?;
            verifier(&provider, &loaded.bytes)
                .map_err(|r| format!("{CA_FLAG} {}: {r}", path.display()))?;
        }
        if let Some((cert, key)) = &self.client_cert {
            ClientCert::new(&provider, cert.clone(), key.clone())?;
        }
        Ok(())
    }

    /// The rustls config for the sink's connections.
    pub fn client_config(&self) -> Result<ClientConfig, SinkError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| SinkError::Client(e.to_string()))?;
        let builder = match &self.ca_file {
            None => builder.with_root_certificates(webpki_roots_store()),
            Some(path) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(
                    ReloadingRoots::new(CA_FLAG, path, &provider).map_err(SinkError::BadCaCert)?,
                )),
        };
        let mut config = match &self.client_cert {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => builder.with_client_cert_resolver(Arc::new(
                ClientCert::new(&provider, cert.clone(), key.clone())
                    .map_err(SinkError::BadClientCert)?,
            )),
        };
        if self.ca_file.is_some() || self.client_cert.is_some() {
            // A resumed TLS session skips both the server's certificate
            // check and the client certificate: a rotated (or removed) CA
            // or client certificate would not apply to new connections
            // while the receiver accepts the old session tickets.
            config.resumption = rustls::client::Resumption::disabled();
        }
        Ok(config)
    }
}

/// A rustls config trusting the webpki roots plus the CA certificate(s) in
/// `path`, read again for each new connection (TLS session resumption off,
/// so a rotated file applies); `setting` names the file in messages.
///
/// # Errors
/// The file does not load now (the message names `setting` and the file).
pub fn roots_config(setting: &'static str, path: &std::path::Path) -> Result<ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = ReloadingRoots::new(setting, path, &provider)?;
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(roots))
        .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

fn webpki_roots_store() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    roots
}

fn check_roots(pem: &[u8]) -> Result<(), String> {
    let mut store = RootCertStore::empty();
    if store.add_parsable_certificates(reread::pem_certs(pem)?).0 == 0 {
        return Err("no usable certificate in the file".into());
    }
    Ok(())
}

/// A verifier trusting the webpki roots and the certificates in `pem`.
fn verifier(
    provider: &Arc<CryptoProvider>,
    pem: &[u8],
) -> Result<Arc<WebPkiServerVerifier>, String> {
    let mut roots = webpki_roots_store();
    roots.add_parsable_certificates(reread::pem_certs(pem)?);
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
        .build()
        .map_err(|e| e.to_string())
}

/// The webpki roots plus a CA file read again for each handshake (a
/// handshake is a new connection: pooled ones are reused).
#[derive(Debug)]
struct ReloadingRoots {
    /// The flag naming the file, for messages.
    setting: &'static str,
    path: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The file's bytes and the verifier built from them.
    current: Mutex<(Vec<u8>, Arc<WebPkiServerVerifier>)>,
}

impl ReloadingRoots {
    /// Loads `path` once (an error names `setting` and the file).
    fn new(
        setting: &'static str,
        path: &std::path::Path,
        provider: &Arc<CryptoProvider>,
    ) -> Result<Self, String> {
        let loaded = reread::load(setting, path, check_roots)
            .map_err(|r| format!("{setting} {}: {r}", path.display()))?;
        let current = verifier(provider, &loaded.bytes)
            .map_err(|r| format!("{setting} {}: {r}", path.display()))?;
        Ok(ReloadingRoots {
            setting,
            path: path.to_owned(),
            provider: Arc::clone(provider),
            current: Mutex::new((loaded.bytes, current)),
        })
    }

    fn verifier(&self) -> Arc<WebPkiServerVerifier> {
        let mut current = self.current.lock().expect("never poisoned");
        if let Ok(loaded) = reread::load(self.setting, &self.path, check_roots)
            && loaded.bytes != current.0
        {
            match verifier(&self.provider, &loaded.bytes) {
                Ok(v) => *current = (loaded.bytes, v),
                Err(reason) => tracing::error!(
                    "{} {}: {reason}; new connections keep the certificates that last loaded",
                    self.setting,
                    self.path.display()
                ),
            }
        }
        Arc::clone(&current.1)
    }
}

impl ServerCertVerifier for ReloadingRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verifier()
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
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
            &self.provider.signature_verification_algorithms,
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
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client certificate and key read again for each handshake.
#[derive(Debug)]
struct ClientCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The two files' bytes and the key pair built from them.
    current: Mutex<(Vec<u8>, Vec<u8>, Arc<CertifiedKey>)>,
}

impl ClientCert {
    fn new(provider: &Arc<CryptoProvider>, cert: PathBuf, key: PathBuf) -> Result<Self, String> {
        let (c, k) = load_pair(&cert, &key)?;
        let certified = certified(provider, &c, &k).map_err(|r| {
            format!(
                "{CERT_FLAG} {} / {KEY_FLAG} {}: {r}",
                cert.display(),
                key.display()
            )
        })?;
        Ok(ClientCert {
            cert,
            key,
            provider: Arc::clone(provider),
            current: Mutex::new((c, k, certified)),
        })
    }

    fn current(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().expect("never poisoned");
        if let Ok((c, k)) = load_pair(&self.cert, &self.key)
            && (c != current.0 || k != current.1)
        {
            match certified(&self.provider, &c, &k) {
                Ok(ck) => *current = (c, k, ck),
                Err(reason) => tracing::error!(
                    "{CERT_FLAG} {} / {KEY_FLAG} {}: {reason}; new connections keep the pair that last loaded",
                    self.cert.display(),
                    self.key.display()
                ),
            }
        }
        Arc::clone(&current.2)
    }
}

fn load_pair(cert: &std::path::Path, key: &std::path::Path) -> Result<(Vec<u8>, Vec<u8>), String> {
    let c = reread::load(CERT_FLAG, cert, |b| reread::pem_certs(b).map(drop))
        .map_err(|r| format!("{CERT_FLAG} {}: {r}", cert.display()))?;
    let k = reread::load(KEY_FLAG, key, |b| reread::pem_key(b).map(drop))
        .map_err(|r| format!("{KEY_FLAG} {}: {r}", key.display()))?;
    Ok((c.bytes, k.bytes))
}

fn certified(
    provider: &CryptoProvider,
    cert: &[u8],
    key: &[u8],
) -> Result<Arc<CertifiedKey>, String> {
    let chain = reread::pem_certs(cert)?;
    let key = reread::pem_key(key)?;
    let key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| e.to_string())?;
    let pair = CertifiedKey::new(chain, key);
    pair.keys_match()
        .map_err(|e| format!("the key does not match the certificate: {e}"))?;
    Ok(Arc::new(pair))
}

impl ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}
