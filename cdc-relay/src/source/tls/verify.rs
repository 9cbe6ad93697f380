//! The certificate verifiers the rustls config of [`super::client_config`]
//! holds: [`Verify`] where a root is known (the chain as webpki checks it,
//! the rest as libpq does), [`Unverified`] where libpq checks nothing.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::names;

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
pub(super) struct Verify {
    /// webpki over the usable roots; `None` when the file has none.
    pub(super) webpki: Option<Arc<dyn ServerCertVerifier>>,
    /// The usable roots, for [`Verify::path_lengths`].
    pub(super) anchors: Vec<TrustAnchor<'static>>,
    /// The roots whose pathLenConstraint webpki does not apply (it reads
    /// none from a trust anchor; OpenSSL does).
    pub(super) limits: Vec<PathLimit>,
    /// Its signature algorithms check the handshake's signature with the
    /// presented key (and webpki's paths, for [`Verify::path_lengths`]).
    pub(super) provider: Arc<rustls::crypto::CryptoProvider>,
    pub(super) names: Names,
    pub(super) own: Vec<CertificateDer<'static>>,
    pub(super) intermediates: Vec<CertificateDer<'static>>,
    /// Why the file's self-signed certificates that are no root are not.
    pub(super) unusable: Vec<String>,
    /// A certificate of the file constrains names (the common name, which
    /// name constraints do not cover, is then not compared).
    pub(super) constrained: bool,
}

/// A root's pathLenConstraint, the root named by its subject and public
/// key as webpki's trust anchor holds them (DER contents).
#[derive(Debug)]
pub(super) struct PathLimit {
    pub(super) subject: Vec<u8>,
    pub(super) spki: Vec<u8>,
    /// CA certificates allowed below the root.
    pub(super) max: u8,
}

/// How the host name is checked.
#[derive(Debug)]
pub(super) enum Names {
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
            UnsupportedSignatureAlgorithmContext, UnsupportedSignatureAlgorithmForPublicKeyContext,
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
            Ok(_)
            | Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => self.path_lengths(end_entity, intermediates, now),
            Err(rustls::Error::InvalidCertificate(Other(e)))
                if matches!(
                    e.0.downcast_ref::<webpki::Error>(),
                    Some(webpki::Error::CaUsedAsEndEntity)
                ) && own() =>
            {
                Ok(())
            }
            Err(rustls::Error::InvalidCertificate(
                UnsupportedSignatureAlgorithmContext { .. }
                | UnsupportedSignatureAlgorithmForPublicKeyContext { .. },
            )) => Err(rustls::Error::General(
                "invalid peer certificate: UnsupportedSignatureAlgorithm (a certificate of the \
                 chain is signed with an algorithm, or by a key, the relay's TLS library does \
                 not accept: SHA-1, RSA below 2048 bits, P-521 or Ed448)"
                    .into(),
            )),
            Err(rustls::Error::InvalidCertificate(UnknownIssuer)) if own() => Ok(()),
            Err(rustls::Error::InvalidCertificate(UnknownIssuer)) if !self.unusable.is_empty() => {
                Err(self.no_root())
            }
            Err(e) => Err(e),
        }
    }

    /// Refuses a chain webpki accepted when every path it finds passes
    /// more CA certificates below a root than the root's pathLenConstraint
    /// allows (`pathlen:0` above an intermediate), as OpenSSL, and so
    /// libpq, refuses it. Runs only when a root has such a limit.
    fn path_lengths(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        if self.limits.is_empty() {
            return Ok(());
        }
        let Ok(cert) = webpki::EndEntityCert::try_from(end_entity) else {
            return Ok(()); // webpki parsed it a moment ago
        };
        let exceeded = std::cell::Cell::new(None);
        let within = |path: &webpki::VerifiedPath<'_>| {
            let below = path.intermediate_certificates().count();
            let anchor = path.anchor();
            match self.limits.iter().find(|l| {
                l.subject == anchor.subject.as_ref()
                    && l.spki == anchor.subject_public_key_info.as_ref()
            }) {
                Some(l) if below > usize::from(l.max) => {
                    exceeded.set(Some((l.max, below)));
                    Err(webpki::Error::PathLenConstraintViolated)
                }
                _ => Ok(()),
            }
        };
        let verified = cert.verify_for_usage(
            self.provider.signature_verification_algorithms.all,
            &self.anchors,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            None,
            Some(&within),
        );
        match (verified, exceeded.get()) {
            (Err(_), Some((max, below))) => Err(rustls::Error::General(format!(
                "invalid peer certificate: PathLenConstraintViolated (sslrootcert's root allows \
                 {max} CA certificate(s) below it, pathlen:{max}; the server's chain has {below})"
            ))),
            _ => Ok(()),
        }
    }

    /// No usable root for the presented chain, naming the file's
    /// self-signed certificates that are no root and why (the first few):
    /// the file has no usable root at all, or none of its roots issued
    /// the chain.
    fn no_root(&self) -> rustls::Error {
        const SHOWN: usize = 3;
        let mut why = self
            .unusable
            .iter()
            .take(SHOWN)
            .cloned()
            .collect::<Vec<_>>();
        if self.unusable.len() > SHOWN {
            why.push(format!("and {} more", self.unusable.len() - SHOWN));
        }
        let why = if why.is_empty() {
            "none".to_owned()
        } else {
            why.join("; ")
        };
        rustls::Error::General(if self.anchors.is_empty() {
            format!(
                "invalid peer certificate: UnknownIssuer (sslrootcert has no usable root: its \
                 self-signed certificates cannot be roots: {why})"
            )
        } else {
            format!(
                "invalid peer certificate: UnknownIssuer (none of sslrootcert's {} usable roots \
                 issued the server's chain; its self-signed certificates that cannot be roots: \
                 {why})",
                self.anchors.len()
            )
        })
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

/// No root known (prefer, allow, require without `sslrootcert`):
/// encryption without authentication, as libpq does. Nothing of the
/// server's certificate is checked, nor the handshake signature made with
/// its key: an unauthenticated key proves nothing, and checking it would
/// refuse keys and certificates libpq takes here (RSA below 2048 bits, an
/// unknown critical extension, a curve the TLS library lacks), which under
/// `prefer` sent the stream in plain text where libpq encrypts it.
#[derive(Debug)]
pub(super) struct Unverified(pub(super) Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
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
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
