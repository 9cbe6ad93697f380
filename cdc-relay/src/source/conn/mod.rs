//! Where and as whom to connect: a libpq-style URL or key/value string
//! parsed once into [`ConnParams`], used by both the side SQL connection and
//! the replication connection.
//!
//! tokio-postgres parses the string but knows neither `verify-ca` /
//! `verify-full` nor `sslrootcert`; those are read here and applied by
//! [`super::tls`] (PostgreSQL docs, "libpq — Connection Strings" and
//! "SSL Support").

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

mod string;
pub(crate) mod tls_params;

pub use string::is_url;
use string::{gives_port, malformed_query, query_param, repeated_param, strip_own_params};
use tls_params::TlsParams;

/// libpq's `sslmode` (PostgreSQL docs, "SSL Support" → "Protection Provided
/// in Different Modes").
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// Plain first; TLS (unauthenticated) only when the server refuses a
    /// plain connection.
    Allow,
    /// TLS when the server offers it, unauthenticated (libpq's default).
    #[default]
    Prefer,
    /// TLS, the certificate not checked (unless a root cert is given).
    Require,
    /// TLS, the chain checked against the root cert, not the host name.
    VerifyCa,
    /// TLS, chain and host name checked.
    VerifyFull,
}

impl SslMode {
    /// The libpq spelling, e.g. `verify-full`.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl FromStr for SslMode {
    type Err = BadUrl;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(BadUrl(format!(
                    "sslmode={other}: expected disable, allow, prefer, require, verify-ca or verify-full"
                )));
            }
        })
    }
}

impl SslMode {
    /// Whether the server's certificate chain is checked when TLS is used:
    /// verify-ca and verify-full, and `require`, `prefer` and `allow` when
    /// a root certificate is known (libpq verifies against a root CA file
    /// whenever there is one: "require" with it behaves like verify-ca).
    pub fn checks_chain(self, root: Option<&RootCert>) -> bool {
        match self {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require | SslMode::Prefer | SslMode::Allow => root.is_some(),
            SslMode::Disable => false,
        }
    }
}

/// Where the CA certificates that verify the server come from (libpq's
/// `sslrootcert`; PostgreSQL docs, "libpq — Parameter Key Words").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file of one or more CA certificates: the `sslrootcert` given,
    /// or `~/.postgresql/root.crt` when that exists.
    File(PathBuf),
    /// `sslrootcert=system`: the system's trusted roots (`SSL_CERT_FILE`
    /// when set, else the platform's bundle). Forces `verify-full`.
    System,
}

/// A client certificate and its private key (libpq's `sslcert` and
/// `sslkey`, by default `~/.postgresql/postgresql.crt` and `.key`), PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCert {
    /// The certificate (chain), PEM.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1), PEM, unencrypted.
    pub key: PathBuf,
}

/// libpq's `channel_binding`. `require` is refused when the URL is parsed:
/// the replication connection cannot bind SCRAM to the TLS channel.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ChannelBinding {
    /// Never bind.
    Disable,
    /// Bind on the side connection when the server offers
    /// SCRAM-SHA-256-PLUS; the replication connection does not bind.
    #[default]
    Prefer,
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where and as whom to connect.
///
/// A URL may list several hosts (`postgres://h1:5432,h2:5432/db`, or
/// `host=h1,h2 port=5432,5433`): the relay tries them in order on every
/// connect and uses the first that is a primary (not in recovery), for the
/// side connection and the replication connection alike
/// ([`super::connect_primary`]). `host`/`port` are the first candidate, or
/// the one chosen (see [`ConnParams::at`]).
#[derive(Clone)]
pub struct ConnParams {
    /// Host name, IP, or a Unix socket directory (starts with `/`).
    pub host: String,
    /// TCP port (also names the Unix socket file).
    pub port: u16,
    /// Every candidate server, in the URL's order (at least one).
    pub hosts: Vec<(String, u16)>,
    /// Role name.
    pub user: String,
    /// Password ("" for none); see [`ConnParams::password`].
    pub password: String,
    /// `--database-password-file`: read again for each new connection
    /// (the password above is its content at startup, kept while the file
    /// does not load).
    pub password_file: Option<PathBuf>,
    /// Database name.
    pub dbname: String,
    /// TLS mode.
    pub sslmode: SslMode,
    /// The CA certificates for `verify-ca` / `verify-full` (and `require`,
    /// which then behaves like `verify-ca`, as in libpq). Always set for
    /// those two modes.
    pub ssl_root_cert: Option<RootCert>,
    /// The client certificate to present, if any.
    pub ssl_client_cert: Option<ClientCert>,
    /// SCRAM channel binding on the side connection.
    pub channel_binding: ChannelBinding,
    /// Connect timeout (the URL's `connect_timeout` wins over the flag).
    pub connect_timeout: Duration,
    /// The setting the URL came from, for messages, e.g. `--database-url
    /// (CDC_RELAY_DATABASE_URL)` (the default of [`ConnParams::parse`]).
    pub flag: &'static str,
    /// TLS parameters taken from libpq's environment, with their variables
    /// (`("sslrootcert", "PGSSLROOTCERT")`), for messages.
    pub tls_from_env: Vec<(&'static str, &'static str)>,
}

impl fmt::Debug for ConnParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the password.
        write!(f, "{}", self.display())
    }
}

/// A connection URL could not be understood: the reason alone, which the
/// caller prefixes with the setting it came from (`--database-url`,
/// `--replication-url`, `--standby-url`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadUrl(String);

/// Whether the connection string `url` (a URL or a key/value string) gives
/// the parameter `key` a value.
pub fn names_param(url: &str, key: &str) -> bool {
    query_param(url, key).is_some()
}

/// Refuses what libpq would take from its environment and the relay does
/// not read: `PGSERVICE` (a service file's parameters) always, and
/// `PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE` where the string lacks that
/// parameter (libpq would fill it in, the relay would not, and connect
/// elsewhere). `PGHOSTADDR` as `hostaddr`; `PGOPTIONS` and the TLS
/// protocol bounds, which it would ignore; `PGTARGETSESSIONATTRS` and
/// `PGGSSENCMODE=require`, which it cannot honour. The `PGSSL*` variables
/// the relay does read (see `tls_params`).
fn not_read_from_environment(
    no_host: bool,
    no_port: bool,
    no_user: bool,
    no_dbname: bool,
) -> Result<(), BadUrl> {
    let set = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(service) = set("PGSERVICE") {
        return Err(BadUrl(format!(
            "PGSERVICE={service} is set, and the relay does not read connection service files \
             (pg_service.conf): put the service's parameters in the URL and unset PGSERVICE"
        )));
    }
    for name in [
        "PGOPTIONS",
        "PGSSLMINPROTOCOLVERSION",
        "PGSSLMAXPROTOCOLVERSION",
    ] {
        if let Some(value) = set(name) {
            return Err(BadUrl(format!(
                "{name}={value} is set, and the relay does not read it (it sets its own session \
                 options, and speaks TLS 1.2 and 1.3): unset {name}"
            )));
        }
    }
    if let Some(value) = set("PGTARGETSESSIONATTRS")
        .filter(|v| !matches!(v.as_str(), "any" | "read-write" | "primary"))
    {
        return Err(BadUrl(format!(
            "PGTARGETSESSIONATTRS={value} is set: the relay streams only from a primary; unset it \
             (or set primary, read-write, any)"
        )));
    }
    if set("PGGSSENCMODE").is_some_and(|v| v == "require") {
        return Err(BadUrl(
            "PGGSSENCMODE=require is set, and the relay has no GSSAPI encryption: unset it and use \
             TLS (sslmode)"
                .into(),
        ));
    }
    if set("PGHOSTADDR").is_some() {
        return Err(BadUrl(
            "PGHOSTADDR is set, and hostaddr is not supported: put the address in the URL's host \
             and unset PGHOSTADDR"
                .into(),
        ));
    }
    for (missing, name, what) in [
        (no_host, "PGHOST", "host"),
        (no_port, "PGPORT", "port"),
        (no_user, "PGUSER", "user"),
        (no_dbname, "PGDATABASE", "dbname"),
    ] {
        if let Some(value) = set(name).filter(|_| missing) {
            return Err(BadUrl(format!(
                "the connection string gives no {what}, and {name}={value} is set: libpq would \
                 use it, the relay does not read it; put {what}={value} in the URL"
            )));
        }
    }
    Ok(())
}

/// Refuses a TCP host that TLS cannot name the server by: neither a DNS
/// name nor an IP address written in full (`127.1`, `2130706433`,
/// `127.000.000.001`, which libpq reads as `127.0.0.1`); the handshake
/// would fail on the relay's side before reaching the server.
fn named_for_tls(hosts: &[(String, u16)]) -> Result<(), BadUrl> {
    for (host, _) in hosts.iter().filter(|(h, _)| !h.starts_with('/')) {
        if rustls::pki_types::ServerName::try_from(host.as_str()).is_err() {
            return Err(BadUrl(format!(
                "host {host} is neither a DNS name nor an IP address written in full, and TLS \
                 names the server by it: write the address in full (e.g. 127.0.0.1 for 127.1) or \
                 use a host name, or sslmode=disable"
            )));
        }
    }
    Ok(())
}

impl ConnParams {
    /// Parses a libpq connection string or URL; `connect_timeout` applies
    /// unless the string sets its own.
    pub fn parse(url: &str, connect_timeout: Duration) -> Result<Self, BadUrl> {
        if let Some(what) = malformed_query(url) {
            return Err(BadUrl(what));
        }
        if let Some((key, first, last)) = repeated_param(url) {
            let values = if key.contains("password") {
                String::new()
            } else {
                format!(" ({first}, then {last})")
            };
            return Err(BadUrl(format!(
                "{key} is given twice{values}: libpq would take the last, and the relay refuses \
                 to guess; give each parameter once"
            )));
        }
        let cfg = tokio_postgres::Config::from_str(&strip_own_params(url)).map_err(|e| {
            let why = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            BadUrl(format!("{e}{why}"))
        })?;
        for dropped in ["options", "load_balance_hosts"] {
            if query_param(url, dropped).is_some() {
                return Err(BadUrl(format!(
                    "{dropped} is not supported: the relay sets its own session options and \
                     tries hosts in order; remove it (set server parameters on the role instead: \
                     ALTER ROLE … SET …)"
                )));
            }
        }
        if query_param(url, "hostaddr").is_some() {
            return Err(BadUrl(
                "hostaddr is not supported: put the address in host (with sslmode=verify-full \
                 the server's certificate must then carry that IP address)"
                    .into(),
            ));
        }
        let names: Vec<String> = cfg
            .get_hosts()
            .iter()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(h) => h.clone(),
                tokio_postgres::config::Host::Unix(p) => p.to_string_lossy().into_owned(),
            })
            .collect();
        let ports = cfg.get_ports();
        not_read_from_environment(
            names.is_empty(),
            !gives_port(url),
            cfg.get_user().is_none(),
            cfg.get_dbname().is_none(),
        )?;
        if names.is_empty() {
            return Err(BadUrl("no host given".into()));
        }
        if let Some(several) = names.iter().find(|h| h.contains(',')) {
            // The SQL client library reads a URL query's host=a,b as one host.
            return Err(BadUrl(format!(
                "host={several} in the URL's query names several hosts, which the relay would \
                 read as one: put them in the URL's authority (postgres://user@a:5432,b:5432/db) \
                 or use a key/value string (host=a,b port=5432)"
            )));
        }
        if ports.len() > 1 && ports.len() != names.len() {
            return Err(BadUrl(format!(
                "{} ports for {} hosts: give one port for all, or one for each host (libpq \
                 refuses this too)",
                ports.len(),
                names.len()
            )));
        }
        let hosts: Vec<(String, u16)> = names
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                (h, port)
            })
            .collect();
        match query_param(url, "target_session_attrs").as_deref() {
            None | Some("any" | "read-write" | "primary") => {}
            Some(other) => {
                return Err(BadUrl(format!(
                    "target_session_attrs={other}: the relay streams only from a primary; use primary (or read-write, any)"
                )));
            }
        }
        let user = cfg
            .get_user()
            .ok_or_else(|| BadUrl("no user given".into()))?
            .to_owned();
        let password = cfg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let dbname = cfg.get_dbname().unwrap_or(&user).to_owned();
        let tls = TlsParams::parse(url, std::env::var_os("HOME").map(PathBuf::from))?;
        if tls.sslmode != SslMode::Disable {
            named_for_tls(&hosts)?;
        }
        Ok(ConnParams {
            host: hosts[0].0.clone(),
            port: hosts[0].1,
            hosts,
            user,
            password,
            password_file: None,
            dbname,
            sslmode: tls.sslmode,
            ssl_root_cert: tls.root,
            ssl_client_cert: tls.client,
            channel_binding: tls.channel_binding,
            tls_from_env: tls.from_env,
            connect_timeout: cfg
                .get_connect_timeout()
                .copied()
                .unwrap_or(connect_timeout),
            flag: "--database-url (CDC_RELAY_DATABASE_URL)",
        })
    }

    /// `user@host:port/db` (`user@h1:p1,h2:p2/db` for several
    /// candidates), safe to log.
    pub fn display(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        format!("{}@{}/{}", self.user, hosts.join(","), self.dbname)
    }

    /// The password to connect with now: the first line of
    /// `--database-password-file` as it is now (a rotated password is used
    /// by the next connection), or the copy that last loaded while the
    /// file does not load (an ERROR says so); without a file, the flag's
    /// or the URL's.
    pub fn password(&self) -> String {
        let Some(path) = &self.password_file else {
            return self.password.clone();
        };
        match crate::reread::load("--database-password-file", path, |b| {
            crate::reread::first_line(b).map(drop)
        }) {
            Ok(loaded) => crate::reread::first_line(&loaded.bytes).unwrap_or_default(),
            Err(reason) => {
                tracing::error!(
                    "--database-password-file {}: {reason}; connecting with the password read at startup",
                    path.display()
                );
                self.password.clone()
            }
        }
    }

    /// These parameters for candidate `i` alone.
    pub fn at(&self, i: usize) -> ConnParams {
        let (host, port) = self.hosts[i].clone();
        ConnParams {
            host: host.clone(),
            port,
            hosts: vec![(host, port)],
            ..self.clone()
        }
    }

    /// A tokio-postgres config for the side (normal SQL) connection; TLS is
    /// added by [`super::connect_sql`].
    pub fn sql_config(&self, application_name: &str) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        c.host(&self.host)
            .port(self.port)
            .user(&self.user)
            .dbname(&self.dbname)
            .application_name(application_name)
            .connect_timeout(self.connect_timeout);
        let password = self.password();
        if !password.is_empty() {
            c.password(&password);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_without_leaking_passwords() {
        let c = ConnParams::parse(
            "postgres://relay:s3cret@127.0.0.1:5433/orders?sslmode=verify-full&sslrootcert=/ca.pem",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.dbname.as_str()),
            ("127.0.0.1", 5433, "orders")
        );
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.ssl_root_cert, Some(RootCert::File("/ca.pem".into())));
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(ConnParams::parse("not a url at all=", Duration::from_secs(1)).is_err());
        let err = ConnParams::parse("postgres://u@h/d?sslmode=maybe", Duration::from_secs(1));
        assert!(err.unwrap_err().to_string().contains("sslmode=maybe"));
        let kv = ConnParams::parse(
            "host=h user=u dbname=d sslmode=require",
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!((kv.sslmode, kv.dbname.as_str()), (SslMode::Require, "d"));
        let multi = ConnParams::parse(
            "postgres://u@h1:5432,h2:5433/d?target_session_attrs=primary",
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(
            multi.hosts,
            [("h1".to_owned(), 5432), ("h2".to_owned(), 5433)]
        );
        assert_eq!(multi.display(), "u@h1:5432,h2:5433/d");
        assert_eq!(multi.at(1).display(), "u@h2:5433/d");
        let kv = ConnParams::parse("host=a,b port=6000 user=u dbname=d", Duration::from_secs(1))
            .unwrap();
        assert_eq!(kv.hosts, [("a".to_owned(), 6000), ("b".to_owned(), 6000)]);
        let err = ConnParams::parse(
            "postgres://u@h/d?target_session_attrs=standby",
            Duration::from_secs(1),
        );
        assert!(err.unwrap_err().to_string().contains("primary"));
        let default = ConnParams::parse("postgres://u@h/d", Duration::from_secs(1)).unwrap();
        assert_eq!(default.sslmode, SslMode::Prefer);
        let allow =
            ConnParams::parse("postgres://u@h/d?sslmode=allow", Duration::from_secs(1)).unwrap();
        assert_eq!(allow.sslmode, SslMode::Allow);
    }

    #[test]
    fn unsupported_parameters_are_named() {
        let err = ConnParams::parse(
            "postgres://u@h/d?hostaddr=127.0.0.1",
            Duration::from_secs(1),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("hostaddr"), "{err}");
        let err = ConnParams::parse("postgres://u@h/d?service=foo", Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("service"), "{err}");
    }
}
