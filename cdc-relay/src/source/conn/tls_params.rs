//! The TLS parameters of a connection string, resolved as libpq resolves
//! them, from the URL or libpq's environment variables.

use std::path::{Path, PathBuf};

use super::string::query_param;
use super::{BadUrl, ChannelBinding, ClientCert, RootCert, SslMode};

/// The TLS parameters of a connection string, resolved as libpq resolves
/// them (PostgreSQL docs, "libpq — Parameter Key Words" and "SSL
/// Support"): defaults from `~/.postgresql/`, `require` with a root
/// certificate meaning verify-ca, `sslrootcert=system` forcing
/// verify-full. What the relay cannot do on both of its connections is
/// refused here, naming the parameter.
#[derive(Debug)]
pub(super) struct TlsParams {
    pub(super) sslmode: SslMode,
    pub(super) root: Option<RootCert>,
    pub(super) client: Option<ClientCert>,
    pub(super) channel_binding: ChannelBinding,
    /// The parameters taken from libpq's environment (the URL lacks them),
    /// with their variables: messages name the variable, not the URL.
    pub(super) from_env: Vec<(&'static str, &'static str)>,
}

/// The TLS parameters libpq also reads from the environment, and their
/// variables, when `url` lacks them and the variable is set (not empty).
fn from_env(url: &str) -> Vec<(&'static str, &'static str)> {
    [
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "channel_binding",
        "sslnegotiation",
    ]
    .into_iter()
    .filter(|k| query_param(url, k).is_none_or(|v| v.is_empty()))
    .filter_map(|k| env_name(k).map(|var| (k, var)))
    .filter(|(_, var)| std::env::var_os(var).is_some_and(|v| !v.is_empty()))
    .collect()
}

/// `message` with each `param=` written `VAR=` for the parameters in
/// `from_env` (an operator who set `PGSSLROOTCERT` looks for that, not a
/// URL parameter they never wrote).
pub(crate) fn name_env(message: &str, from_env: &[(&'static str, &'static str)]) -> String {
    let mut out = message.to_owned();
    for (param, var) in from_env {
        let said = format!("{param}=");
        // Whole words only: `sslcert=` is not inside `xsslcert=`.
        let mut renamed = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(i) = rest.find(&said) {
            let word_start = rest[..i]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            renamed.push_str(&rest[..i]);
            renamed.push_str(if word_start { var } else { param });
            renamed.push('=');
            rest = &rest[i + said.len()..];
        }
        renamed.push_str(rest);
        out = renamed;
    }
    out
}

impl TlsParams {
    pub(super) fn parse(url: &str, home: Option<PathBuf>) -> Result<TlsParams, BadUrl> {
        let from_env = from_env(url);
        Self::parse_named(url, home, from_env.clone())
            .map_err(|BadUrl(m)| BadUrl(name_env(&m, &from_env)))
    }

    fn parse_named(
        url: &str,
        home: Option<PathBuf>,
        from_env: Vec<(&'static str, &'static str)>,
    ) -> Result<TlsParams, BadUrl> {
        // An empty value is no value, as in libpq (PGSSLROOTCERT= keeps the
        // default root file).
        let param = |k: &str| {
            query_param(url, k)
                .or_else(|| {
                    env_name(k)
                        .and_then(std::env::var_os)
                        .map(|v| v.to_string_lossy().into_owned())
                })
                .filter(|v| !v.is_empty())
        };
        let dot_pg = |name: &str| home.as_ref().map(|h| h.join(".postgresql").join(name));
        let root = match param("sslrootcert").as_deref() {
            Some("system") => Some(RootCert::System),
            Some(path) => Some(RootCert::File(path.into())),
            None => default_in(home.as_deref(), "root.crt").map(RootCert::File),
        };
        let sslmode = match (param("sslmode"), &root) {
            (Some(m), _) => m.parse()?,
            (None, Some(RootCert::System)) => SslMode::VerifyFull,
            (None, _) => SslMode::Prefer,
        };
        if root == Some(RootCert::System) && sslmode != SslMode::VerifyFull {
            return Err(BadUrl(format!(
                "sslrootcert=system with sslmode={sslmode}: a publicly trusted certificate proves \
                 nothing without the host name, so libpq allows only sslmode=verify-full with it \
                 (omit sslmode, or set sslmode=verify-full)"
            )));
        }
        if matches!(sslmode, SslMode::VerifyCa | SslMode::VerifyFull) && root.is_none() {
            return Err(BadUrl(format!(
                "sslmode={sslmode} needs the CA that signed the server's certificate: set \
                 sslrootcert=/path/to/ca.pem (or sslrootcert=system for the system's trusted \
                 roots, or put it in ~/.postgresql/root.crt), or choose an sslmode that does not \
                 verify the server"
            )));
        }
        let client = match (param("sslcert"), param("sslkey")) {
            (Some(cert), key) => {
                let cert = PathBuf::from(cert);
                // libpq: without sslkey, ~/.postgresql/postgresql.key.
                let key = match key {
                    Some(k) => PathBuf::from(k),
                    None => dot_pg("postgresql.key").ok_or_else(|| {
                        BadUrl(format!(
                            "sslcert={} without sslkey, and no home directory for \
                             ~/.postgresql/postgresql.key: set sslkey",
                            cert.display()
                        ))
                    })?,
                };
                if !cert.exists() {
                    return Err(BadUrl(format!(
                        "sslcert={}: no such file (the client certificate to present)",
                        cert.display()
                    )));
                }
                Some(ClientCert { cert, key })
            }
            (None, Some(key)) => match dot_pg("postgresql.crt").filter(|p| p.exists()) {
                Some(cert) => Some(ClientCert {
                    cert,
                    key: key.into(),
                }),
                None => {
                    return Err(BadUrl(format!(
                        "sslkey={key} without a certificate: set sslcert to the client \
                         certificate that goes with the key"
                    )));
                }
            },
            (None, None) => default_in(home.as_deref(), "postgresql.crt")
                .zip(dot_pg("postgresql.key"))
                .map(|(cert, key)| ClientCert { cert, key }),
        };
        if let Some(c) = &client {
            check_key_file(&c.key)?;
        }
        if param("sslpassword").is_some() {
            return Err(BadUrl(
                "sslpassword: encrypted client keys are not supported; store the key \
                 unencrypted with mode 0600 (openssl pkey -in KEY -out KEY.plain) and remove \
                 sslpassword"
                    .into(),
            ));
        }
        for crl in ["sslcrl", "sslcrldir"] {
            if param(crl).is_some_and(|v| !v.is_empty()) {
                return Err(BadUrl(format!(
                    "{crl}: certificate revocation lists are not supported; remove {crl} and \
                     revoke by replacing the CA in sslrootcert"
                )));
            }
        }
        if param("sslsni").is_some_and(|v| v != "1") {
            return Err(BadUrl(
                "sslsni=0: both connections always send the host name (SNI); remove sslsni".into(),
            ));
        }
        if param("requiressl").is_some() {
            return Err(BadUrl(
                "requiressl is obsolete: use sslmode=require (or stronger)".into(),
            ));
        }
        match param("sslnegotiation").as_deref() {
            None | Some("postgres") => {}
            Some("direct") => {
                return Err(BadUrl(
                    "sslnegotiation=direct: the replication connection negotiates TLS the \
                     standard way (SSLRequest first), which every server accepts; remove \
                     sslnegotiation or set it to postgres"
                        .into(),
                ));
            }
            Some(other) => {
                return Err(BadUrl(format!(
                    "sslnegotiation={other}: expected postgres (or direct, which the relay does \
                     not support)"
                )));
            }
        }
        let channel_binding = match param("channel_binding").as_deref() {
            None | Some("prefer") => ChannelBinding::Prefer,
            Some("disable") => ChannelBinding::Disable,
            Some("require") => {
                return Err(BadUrl(
                    "channel_binding=require: the relay's replication connection cannot bind \
                     SCRAM authentication to the TLS channel (no SCRAM-SHA-256-PLUS), and every \
                     URL the relay takes (database, replication, standby) follows one rule, so \
                     it refuses rather than connect without it; remove channel_binding (or set \
                     prefer) and authenticate the server with sslmode=verify-full"
                        .into(),
                ));
            }
            Some(other) => {
                return Err(BadUrl(format!(
                    "channel_binding={other}: expected disable or prefer (require is not \
                     supported)"
                )));
            }
        };
        Ok(TlsParams {
            sslmode,
            root,
            client,
            channel_binding,
            from_env,
        })
    }
}

/// libpq's check of a private key file: owned by us and not readable by
/// group or others (0600), or owned by root and at most group-readable
/// (0640).
pub(crate) fn check_key_file(key: &std::path::Path) -> Result<(), BadUrl> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(key).map_err(|e| {
        BadUrl(format!(
            "sslkey={}: {e} (the private key of the client certificate)",
            key.display()
        ))
    })?;
    let mode = meta.mode() & 0o777;
    // libpq's test (fe-secure-openssl.c): no group or other bits for a
    // file of another owner than root; root's may be group-readable. The
    // owner's own bits do not matter (0700 passes).
    let forbidden = if meta.uid() == 0 { 0o037 } else { 0o077 };
    if mode & forbidden != 0 {
        return Err(BadUrl(format!(
            "sslkey={}: the private key has mode {mode:04o}; it must not be readable by others \
             (chmod 0600, or 0640 when owned by root)",
            key.display()
        )));
    }
    Ok(())
}

/// `~/.postgresql/NAME` when it exists now: libpq's default root
/// (`root.crt`) and client certificate (`postgresql.crt`, `.key`), looked
/// for again at each new connection, as libpq does.
pub(crate) fn default_file(name: &str) -> Option<PathBuf> {
    default_in(std::env::var_os("HOME").map(PathBuf::from).as_deref(), name)
}

/// `HOME/.postgresql/NAME` when it exists.
fn default_in(home: Option<&Path>, name: &str) -> Option<PathBuf> {
    home.map(|h| h.join(".postgresql").join(name))
        .filter(|p| p.exists())
}

/// The environment variable libpq reads for a TLS parameter the URL does
/// not set (PostgreSQL docs, "libpq — Environment Variables").
fn env_name(param: &str) -> Option<&'static str> {
    Some(match param {
        "sslmode" => "PGSSLMODE",
        "sslrootcert" => "PGSSLROOTCERT",
        "sslcert" => "PGSSLCERT",
        "sslkey" => "PGSSLKEY",
        "sslcrl" => "PGSSLCRL",
        "sslcrldir" => "PGSSLCRLDIR",
        "sslsni" => "PGSSLSNI",
        "channel_binding" => "PGCHANNELBINDING",
        "sslnegotiation" => "PGSSLNEGOTIATION",
        "requiressl" => "PGREQUIRESSL",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_key_file_mode_is_judged_as_libpq_judges_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().expect("temp dir");
        let key = dir.path().join("client.key");
        std::fs::write(&key, b"k").expect("write");
        let owner = std::fs::metadata(&key).expect("stat").uid();
        // The owner's own bits never matter; group and others do.
        let cases: &[(u32, bool)] = if owner == 0 {
            &[
                (0o600, true),
                (0o700, true),
                (0o640, true),
                (0o400, true),
                (0o660, false),
                (0o604, false),
                (0o650, false),
            ]
        } else {
            &[
                (0o600, true),
                (0o700, true),
                (0o400, true),
                (0o640, false),
                (0o604, false),
            ]
        };
        for &(mode, ok) in cases {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let got = super::check_key_file(&key);
            assert_eq!(
                got.is_ok(),
                ok,
                "mode {mode:04o} (owner uid {owner}): {got:?}"
            );
        }
    }

    #[test]
    fn a_value_from_the_environment_is_named_by_its_variable() {
        let env = [("sslrootcert", "PGSSLROOTCERT"), ("sslmode", "PGSSLMODE")];
        assert_eq!(
            name_env(
                "sslrootcert=/ca.pem: no such file; set sslrootcert=…",
                &env[..1]
            ),
            "PGSSLROOTCERT=/ca.pem: no such file; set PGSSLROOTCERT=…"
        );
        assert_eq!(
            name_env("sslmode=verify-full needs sslrootcert", &env[1..]),
            "PGSSLMODE=verify-full needs sslrootcert"
        );
        // Whole words only, and nothing from the environment: unchanged.
        assert_eq!(name_env("xsslmode=1", &env), "xsslmode=1");
        assert_eq!(name_env("sslmode=require", &[]), "sslmode=require");
    }
    use std::time::Duration;

    use super::super::ConnParams;
    use super::*;

    /// A private home directory for one test, removed when dropped.
    fn home() -> tempfile::TempDir {
        let h = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(h.path().join(".postgresql")).unwrap();
        h
    }
    fn tls(url: &str, home: &std::path::Path) -> Result<TlsParams, String> {
        TlsParams::parse(url, Some(home.to_owned())).map_err(|e| e.to_string())
    }
    #[test]
    fn tls_parameters_resolve_as_libpq_does() {
        let dir = home();
        let h = dir.path();
        let u = "postgres://u@h/d";
        // Nothing in ~/.postgresql: prefer, no root, no client certificate.
        let t = tls(u, h).unwrap();
        assert_eq!(
            (t.sslmode, &t.root, &t.client),
            (SslMode::Prefer, &None, &None)
        );
        assert!(!t.sslmode.checks_chain(t.root.as_ref()));
        // verify-ca / verify-full need a root certificate.
        for mode in ["verify-ca", "verify-full"] {
            let err = tls(&format!("{u}?sslmode={mode}"), h).unwrap_err();
            assert!(
                err.contains(&format!("sslmode={mode}")) && err.contains("sslrootcert"),
                "{err}"
            );
        }
        // ~/.postgresql/root.crt is the default root, and makes require check the chain.
        std::fs::write(h.join(".postgresql/root.crt"), "x").unwrap();
        let t = tls(&format!("{u}?sslmode=require"), h).unwrap();
        assert_eq!(t.root, Some(RootCert::File(h.join(".postgresql/root.crt"))));
        assert!(t.sslmode.checks_chain(t.root.as_ref()));
        assert!(tls(&format!("{u}?sslmode=verify-ca"), h).is_ok());
        // sslrootcert=system: verify-full by default, nothing weaker.
        let t = tls(&format!("{u}?sslrootcert=system"), h).unwrap();
        assert_eq!(
            (t.sslmode, t.root),
            (SslMode::VerifyFull, Some(RootCert::System))
        );
        for mode in ["require", "verify-ca", "prefer"] {
            let err = tls(&format!("{u}?sslrootcert=system&sslmode={mode}"), h).unwrap_err();
            assert!(
                err.contains("sslrootcert=system") && err.contains("verify-full"),
                "{err}"
            );
        }
        // A percent-encoded path is decoded.
        let t = tls(
            &format!("{u}?sslmode=verify-ca&sslrootcert=%2Fetc%2Fca.pem"),
            h,
        )
        .unwrap();
        assert_eq!(t.root, Some(RootCert::File("/etc/ca.pem".into())));
    }
    #[test]
    fn client_certificates_resolve_and_keys_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = home();
        let h = dir.path();
        let u = "postgres://u@h/d";
        let cert = h.join("c.pem");
        let key = h.join("c.key");
        std::fs::write(&cert, "x").unwrap();
        std::fs::write(&key, "x").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let url = format!("{u}?sslcert={}&sslkey={}", cert.display(), key.display());
        let t = tls(&url, h).unwrap();
        assert_eq!(
            t.client,
            Some(ClientCert {
                cert: cert.clone(),
                key: key.clone()
            })
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = tls(&url, h).unwrap_err();
        assert!(
            err.contains("sslkey=") && err.contains("0644") && err.contains("chmod 0600"),
            "{err}"
        );
        let err = tls(&format!("{u}?sslcert=/nonexistent/c.pem"), h).unwrap_err();
        assert!(err.contains("sslcert=/nonexistent/c.pem"), "{err}");
        // The defaults in ~/.postgresql.
        let dot = h.join(".postgresql");
        std::fs::write(dot.join("postgresql.crt"), "x").unwrap();
        std::fs::write(dot.join("postgresql.key"), "x").unwrap();
        std::fs::set_permissions(
            dot.join("postgresql.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let t = tls(u, h).unwrap();
        assert_eq!(
            t.client,
            Some(ClientCert {
                cert: dot.join("postgresql.crt"),
                key: dot.join("postgresql.key")
            })
        );
    }
    #[test]
    fn what_the_relay_cannot_do_on_both_connections_is_refused_by_name() {
        let dir = home();
        let h = dir.path();
        let u = "postgres://u@h/d?sslmode=require";
        for (param, names) in [
            ("channel_binding=require", "channel_binding=require"),
            ("channel_binding=maybe", "channel_binding=maybe"),
            ("sslnegotiation=direct", "sslnegotiation=direct"),
            ("sslnegotiation=other", "sslnegotiation=other"),
            ("sslpassword=x", "sslpassword"),
            ("sslcrl=/crl.pem", "sslcrl"),
            ("sslcrldir=/crl", "sslcrldir"),
            ("sslsni=0", "sslsni=0"),
            ("requiressl=1", "requiressl"),
        ] {
            let err = tls(&format!("{u}&{param}"), h).unwrap_err();
            assert!(err.contains(names), "{param}: {err}");
            // The same through ConnParams, which leaves naming the flag
            // to its caller (the URL may be --replication-url's).
            let err = ConnParams::parse(&format!("{u}&{param}"), Duration::from_secs(1))
                .unwrap_err()
                .to_string();
            assert!(err.contains(names) && !err.contains("--"), "{err}");
        }
        for ok in [
            "channel_binding=disable",
            "channel_binding=prefer",
            "sslnegotiation=postgres",
            "sslsni=1",
        ] {
            assert!(tls(&format!("{u}&{ok}"), h).is_ok(), "{ok}");
            assert!(
                ConnParams::parse(&format!("{u}&{ok}"), Duration::from_secs(1)).is_ok(),
                "{ok}"
            );
        }
    }
}
