//! What libpq asks of the server's certificate itself: its names against
//! the URL's host for `sslmode=verify-full`, and its purpose where webpki's
//! check is skipped ([`usable_by_a_server`]). Names (PostgreSQL's `fe-secure-common.c` and
//! `fe-secure-openssl.c`, "verify_peer_name_matches_certificate"):
//!
//! - every subjectAltName DNS name is compared with the host's text
//!   (also when the host is an IP address), ASCII case-insensitively, a
//!   leading `*.` standing for one label;
//! - every subjectAltName IP address is compared, as an address, with the
//!   host parsed as one (`0:0:0:0:0:0:0:1` is `::1`);
//! - only when the certificate has no subjectAltName entry of the host's
//!   type (IP addresses for an IP host, DNS names otherwise) is its first
//!   common name compared, as text, like a DNS name.
//!
//! The host is the URL's text, not a normalised name: `db.example.` is not
//! `db.example`, as in libpq.

use std::net::IpAddr;

use rustls::pki_types::{CertificateDer, UnixTime};
use x509_cert::der::Decode;
use x509_cert::ext::pkix::SubjectAltName;
use x509_cert::ext::pkix::name::GeneralName;

/// The serverAuth extended key usage (RFC 5280, `id-kp-serverAuth`).
const SERVER_AUTH: x509_cert::der::oid::ObjectIdentifier =
    x509_cert::der::oid::ObjectIdentifier::new_unwrap("1.3.6.1.5.5.7.3.1");

/// Any extended key usage (RFC 5280, `anyExtendedKeyUsage`).
const ANY_PURPOSE: x509_cert::der::oid::ObjectIdentifier =
    x509_cert::der::oid::ObjectIdentifier::new_unwrap("2.5.29.37.0");

/// The common name attribute (X.520 `id-at-commonName`).
const COMMON_NAME: x509_cert::der::oid::ObjectIdentifier =
    x509_cert::der::oid::ObjectIdentifier::new_unwrap("2.5.4.3");

/// Whether `cert` carries `host` as libpq reads it; when it does not, the
/// names it was compared with (DNS names, IP addresses, `common name X`),
/// for the error.
pub(super) fn check(
    cert: &CertificateDer<'_>,
    host: &str,
    common_name_allowed: bool,
) -> Result<(), Vec<String>> {
    let Ok(cert) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return Err(Vec::new());
    };
    let host_ip: Option<IpAddr> = host.parse().ok();
    let mut presented = Vec::new();
    let mut check_cn = true;
    let san = match cert.tbs_certificate.get::<SubjectAltName>() {
        Ok(san) => san.map(|(_, san)| san),
        // libpq stops at a subjectAltName it cannot read: no match, and
        // no common name either.
        Err(_) => return Err(vec!["an unreadable subjectAltName".into()]),
    };
    if let Some(san) = san {
        for name in &san.0 {
            match name {
                GeneralName::DnsName(dns) => {
                    let dns = dns.as_str();
                    presented.push(dns.to_owned());
                    check_cn &= host_ip.is_some();
                    // libpq stops at a name with a NUL in it: no match.
                    if dns.contains('\0') {
                        return Err(presented);
                    }
                    if name_matches(dns, host) {
                        return Ok(());
                    }
                }
                GeneralName::IpAddress(octets) => {
                    let ip = address(octets.as_bytes());
                    presented.push(
                        ip.map_or_else(|| "an unreadable IP address".into(), |a| a.to_string()),
                    );
                    check_cn &= host_ip.is_none();
                    if ip.is_some() && ip == host_ip {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
    }
    if check_cn && !common_name_allowed {
        presented.push(
            "its common name, not compared: a CA of the chain constrains names, which the common \
             name would escape"
                .into(),
        );
    } else if check_cn {
        let common_name = cert
            .tbs_certificate
            .subject
            .0
            .iter()
            .flat_map(|rdn| rdn.0.iter())
            .find(|atv| atv.oid == COMMON_NAME)
            .map(|atv| String::from_utf8_lossy(atv.value.value()).into_owned());
        if let Some(cn) = common_name {
            if name_matches(&cn, host) {
                return Ok(());
            }
            presented.push(format!("common name {cn}"));
        }
    }
    Err(presented)
}

/// An IPv4 (4 bytes) or IPv6 (16 bytes) address.
fn address(octets: &[u8]) -> Option<IpAddr> {
    match octets.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(octets).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(octets).ok()?)),
        _ => None,
    }
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

/// Whether `cert` may serve as a TLS server's certificate, as OpenSSL's
/// `sslserver` purpose checks it for libpq: a keyUsage, when present,
/// allows digital signatures, key encipherment or key agreement, and an
/// extendedKeyUsage, when present, names serverAuth (or any purpose). A
/// certificate that does not parse may not. Used where webpki's own usage
/// checks are skipped: a server presenting the root file's own
/// certificate.
pub(super) fn usable_by_a_server(cert: &CertificateDer<'_>) -> bool {
    use x509_cert::ext::pkix::{ExtendedKeyUsage, KeyUsage};
    let Ok(cert) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return false;
    };
    let tbs = &cert.tbs_certificate;
    let key_usage_allows = match tbs.get::<KeyUsage>() {
        Ok(None) => true,
        Ok(Some((_, ku))) => ku.digital_signature() || ku.key_encipherment() || ku.key_agreement(),
        Err(_) => false,
    };
    let purpose_allows = match tbs.get::<ExtendedKeyUsage>() {
        Ok(None) => true,
        Ok(Some((_, eku))) => eku.0.iter().any(|p| *p == SERVER_AUTH || *p == ANY_PURPOSE),
        Err(_) => false,
    };
    key_usage_allows && purpose_allows
}

/// Whether `cert` is its own issuer, as OpenSSL's `X509_check_issued(x,
/// x)` decides it: its subject is its issuer and, when it carries both, its
/// authority key identifier is its subject key identifier (a certificate
/// that only names itself, signed by another key, is not); a certificate
/// that does not parse is not.
pub(super) fn self_signed(cert: &CertificateDer<'_>) -> bool {
    use x509_cert::ext::pkix::{AuthorityKeyIdentifier, SubjectKeyIdentifier};
    let Ok(c) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return false;
    };
    let tbs = &c.tbs_certificate;
    let akid = tbs
        .get::<AuthorityKeyIdentifier>()
        .ok()
        .flatten()
        .and_then(|(_, a)| a.key_identifier);
    let skid = tbs
        .get::<SubjectKeyIdentifier>()
        .ok()
        .flatten()
        .map(|(_, s)| s.0);
    tbs.subject == tbs.issuer
        && match (akid, skid) {
            (Some(a), Some(s)) => a == s,
            _ => true,
        }
}

/// Why `cert`, a self-signed certificate of the root file, cannot be a
/// root at `now`, as OpenSSL checks the top of a chain for libpq: outside
/// its validity, not a CA (basicConstraints), a keyUsage without
/// keyCertSign, or an extendedKeyUsage without serverAuth. `None` when it
/// can.
pub(super) fn unusable_as_root(cert: &CertificateDer<'_>, now: UnixTime) -> Option<String> {
    use x509_cert::ext::pkix::{BasicConstraints, ExtendedKeyUsage, KeyUsage};
    let Ok(c) = x509_cert::Certificate::from_der(cert.as_ref()) else {
        return Some("does not parse".into());
    };
    let tbs = &c.tbs_certificate;
    let subject = tbs.subject.to_string();
    if let Some(why) = outside_validity(&c, now) {
        return Some(format!("{subject}: {why}"));
    }
    if let Some(key) = unsupported_key(&tbs.subject_public_key_info) {
        return Some(format!(
            "{subject}: its {key} key is one the relay's TLS library cannot verify with (RSA, \
             ECDSA P-256/P-384 and Ed25519 it can)"
        ));
    }
    let is_ca = matches!(tbs.get::<BasicConstraints>(), Ok(Some((_, bc))) if bc.ca);
    if !is_ca {
        return Some(format!(
            "{subject}: not a CA (basicConstraints CA:TRUE missing)"
        ));
    }
    if let Ok(Some((_, ku))) = tbs.get::<KeyUsage>()
        && !ku.key_cert_sign()
    {
        return Some(format!("{subject}: its keyUsage lacks keyCertSign"));
    }
    if let Ok(Some((_, eku))) = tbs.get::<ExtendedKeyUsage>()
        && !eku.0.iter().any(|p| *p == SERVER_AUTH || *p == ANY_PURPOSE)
    {
        return Some(format!("{subject}: its extendedKeyUsage lacks serverAuth"));
    }
    None
}

/// The pathLenConstraint of `cert`'s basicConstraints: how many CA
/// certificates may follow it down a chain (RFC 5280, 4.2.1.9), `None`
/// when unlimited or unreadable.
pub(super) fn path_len(cert: &CertificateDer<'_>) -> Option<u8> {
    use x509_cert::ext::pkix::BasicConstraints;
    let c = x509_cert::Certificate::from_der(cert.as_ref()).ok()?;
    match c.tbs_certificate.get::<BasicConstraints>() {
        Ok(Some((_, bc))) if bc.ca => bc.path_len_constraint,
        _ => None,
    }
}

/// The name of a public key type OpenSSL verifies with and webpki does
/// not (P-521, Ed448), or `None`.
fn unsupported_key(spki: &x509_cert::spki::SubjectPublicKeyInfoOwned) -> Option<&'static str> {
    use x509_cert::der::oid::ObjectIdentifier as Oid;
    const EC_PUBLIC_KEY: Oid = Oid::new_unwrap("1.2.840.10045.2.1");
    const SECP521R1: Oid = Oid::new_unwrap("1.3.132.0.35");
    const ED448: Oid = Oid::new_unwrap("1.3.101.113");
    let alg = &spki.algorithm;
    if alg.oid == ED448 {
        return Some("Ed448");
    }
    let curve = alg
        .parameters
        .as_ref()
        .and_then(|p| p.decode_as::<Oid>().ok());
    (alg.oid == EC_PUBLIC_KEY && curve == Some(SECP521R1)).then_some("P-521")
}

/// Why `cert` is not valid at `now` (expired, not valid yet), or `None`.
fn outside_validity(cert: &x509_cert::Certificate, now: UnixTime) -> Option<String> {
    let validity = &cert.tbs_certificate.validity;
    let now = std::time::Duration::from_secs(now.as_secs());
    if now < validity.not_before.to_unix_duration() {
        return Some(format!("not valid before {}", validity.not_before));
    }
    if now > validity.not_after.to_unix_duration() {
        return Some(format!("expired on {}", validity.not_after));
    }
    None
}

/// Whether `cert` is valid at `now` (a certificate that does not parse is
/// not).
pub(super) fn valid_at(cert: &CertificateDer<'_>, now: UnixTime) -> bool {
    x509_cert::Certificate::from_der(cert.as_ref())
        .is_ok_and(|c| outside_validity(&c, now).is_none())
}

/// Whether `cert` constrains the names below it (a nameConstraints
/// extension); one that does not parse is taken to.
pub(super) fn constrains_names(cert: &CertificateDer<'_>) -> bool {
    use x509_cert::ext::pkix::NameConstraints;
    x509_cert::Certificate::from_der(cert.as_ref()).map_or(true, |c| {
        !matches!(c.tbs_certificate.get::<NameConstraints>(), Ok(None))
    })
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    /// A self-signed CA certificate made by `openssl` with `key` (`-newkey`
    /// argument) and `opt` (`-pkeyopt`, if any), as DER.
    fn openssl_ca(key: &str, opt: Option<&str>) -> rustls::pki_types::CertificateDer<'static> {
        let dir = tempfile::tempdir().expect("temp dir");
        let (pem, k) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
        let mut args = vec!["req", "-x509", "-nodes", "-days", "2", "-subj", "/CN=ca"];
        args.extend(["-newkey", key]);
        if let Some(o) = opt {
            args.extend(["-pkeyopt", o]);
        }
        let (pem_s, k_s) = (pem.to_str().expect("utf-8"), k.to_str().expect("utf-8"));
        args.extend(["-keyout", k_s, "-out", pem_s, "-outform", "DER"]);
        let made = std::process::Command::new("openssl")
            .args(&args)
            .output()
            .expect("openssl runs");
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let der = std::fs::read(&pem).expect("read");
        rustls::pki_types::CertificateDer::from(der)
    }

    #[test]
    fn a_root_with_a_key_webpki_cannot_use_is_no_root() {
        let p521 = openssl_ca("ec", Some("ec_paramgen_curve:P-521"));
        let ed448 = openssl_ca("ed448", None);
        let p256 = openssl_ca("ec", Some("ec_paramgen_curve:P-256"));
        // After the certificates are made: each is valid from the second it
        // was made in (read before, `now` could precede it).
        let now = rustls::pki_types::UnixTime::now();
        let why = super::unusable_as_root(&p521, now).expect("P-521 is no root here");
        assert!(why.contains("P-521"), "{why}");
        let why = super::unusable_as_root(&ed448, now).expect("Ed448 is no root here");
        assert!(why.contains("Ed448"), "{why}");
        assert_eq!(super::unusable_as_root(&p256, now), None);
    }

    #[test]
    fn a_name_matches_as_libpq_matches_it() {
        for (pattern, host, want) in [
            ("db.example.com", "db.example.com", true),
            ("DB.Example.com", "db.example.COM", true),
            ("db.example.com", "db2.example.com", false),
            ("db.example.com", "db.example.com.", false),
            ("db.example.com.", "db.example.com.", true),
            ("127.0.0.1", "127.0.0.1", true),
            ("::1", "0:0:0:0:0:0:0:1", false),
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
