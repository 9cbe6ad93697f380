//! TLS for both database connections, following libpq's `sslmode`
//! semantics (PostgreSQL docs, "SSL Support" → "Protection Provided in
//! Different Modes"):
//!
//! | sslmode | encryption | certificate chain | host name |
//! |---|---|---|---|
//! | disable | no | — | — |
//! | prefer (default) | if the server offers it | not checked | not checked |
//! | require | yes | not checked (unless a root cert is given) | not checked |
//! | verify-ca | yes | checked | not checked |
//! | verify-full | yes | checked | checked |
//!
//! Roots: the `sslrootcert` file when given, else the Mozilla roots.
//!
//! The side SQL connection uses [`client_config`] (tokio-postgres over
//! rustls); the replication connection hands the same mode to its transport
//! through [`replication_tls`].

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::conn::{ConnParams, SslMode};

/// The TLS setup could not be built (unreadable or invalid root certificate).
#[derive(Debug, thiserror::Error)]
#[error("sslrootcert {path}: {reason}")]
pub struct TlsSetupError {
    path: String,
    reason: String,
}

/// The replication transport's TLS settings for `conn` (same modes, same
/// root certificate).
pub fn replication_tls(conn: &ConnParams) -> pgwire_replication::TlsConfig {
    use pgwire_replication::TlsConfig;
    let root = conn.ssl_root_cert.clone();
    match conn.sslmode {
        SslMode::Disable => TlsConfig::disabled(),
        SslMode::Prefer => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::require()
        },
        SslMode::Require => TlsConfig::require(),
        SslMode::VerifyCa => TlsConfig::verify_ca(root),
        SslMode::VerifyFull => TlsConfig::verify_full(root),
    }
}

/// A rustls client config for `sslmode`, or `None` for `disable`. Errors:
/// an unreadable root certificate file, or one without a certificate.
pub fn client_config(
    sslmode: SslMode,
    root_cert: Option<&Path>,
) -> Result<Option<ClientConfig>, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    let roots = || roots(root_cert);
    let verifier: Arc<dyn ServerCertVerifier> = match sslmode {
        SslMode::Disable => return Ok(None),
        SslMode::VerifyFull => {
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots()?), Arc::clone(&provider))
                .build()
                .map_err(|e| setup_error(root_cert, e.to_string()))?
        }
        SslMode::VerifyCa => Arc::new(ChainOnly(
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots()?), Arc::clone(&provider))
                .build()
                .map_err(|e| setup_error(root_cert, e.to_string()))?,
        )),
        // libpq: with a root cert given, "require" behaves like verify-ca.
        SslMode::Require if root_cert.is_some() => {
            return client_config(SslMode::VerifyCa, root_cert);
        }
        SslMode::Prefer | SslMode::Require => Arc::new(NoVerification(provider)),
    };
    Ok(Some(
        builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth(),
    ))
}

fn setup_error(path: Option<&Path>, reason: String) -> TlsSetupError {
    TlsSetupError {
        path: path.map_or_else(|| "(system roots)".into(), |p| p.display().to_string()),
        reason,
    }
}

fn roots(path: Option<&Path>) -> Result<RootCertStore, TlsSetupError> {
    let mut store = RootCertStore::empty();
    match path {
        None => store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(p) => {
            let certs = CertificateDer::pem_file_iter(p)
                .map_err(|e| setup_error(path, e.to_string()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| setup_error(path, e.to_string()))?;
            let (added, _) = store.add_parsable_certificates(certs);
            if added == 0 {
                return Err(setup_error(
                    path,
                    "no usable certificate in the file".into(),
                ));
            }
        }
    }
    Ok(store)
}

/// verify-ca: the chain must lead to a trusted root; the name may differ.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_map_to_configs() {
        assert!(client_config(SslMode::Disable, None).unwrap().is_none());
        for mode in [
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert!(client_config(mode, None).unwrap().is_some(), "{mode}");
        }
        let err =
            client_config(SslMode::VerifyFull, Some(Path::new("/nonexistent/ca.pem"))).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }
}
