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

/// libpq's `sslmode` (PostgreSQL docs, "SSL Support" → "Protection Provided
/// in Different Modes"). `allow` is read as `prefer`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
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
            "allow" | "prefer" => SslMode::Prefer,
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
    /// Password ("" for none).
    pub password: String,
    /// Database name.
    pub dbname: String,
    /// TLS mode.
    pub sslmode: SslMode,
    /// CA certificate file for `verify-ca` / `verify-full` (and `require`,
    /// which then behaves like `verify-ca`, as in libpq).
    pub ssl_root_cert: Option<PathBuf>,
    /// Connect timeout (the URL's `connect_timeout` wins over the flag).
    pub connect_timeout: Duration,
}

impl fmt::Debug for ConnParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the password.
        write!(f, "{}", self.display())
    }
}

/// The database URL could not be understood.
#[derive(Debug, thiserror::Error)]
#[error("invalid --database-url (CDC_RELAY_DATABASE_URL): {0}")]
pub struct BadUrl(String);

impl ConnParams {
    /// Parses a libpq connection string or URL; `connect_timeout` applies
    /// unless the string sets its own.
    pub fn parse(url: &str, connect_timeout: Duration) -> Result<Self, BadUrl> {
        let cfg = tokio_postgres::Config::from_str(&strip_own_params(url))
            .map_err(|e| BadUrl(e.to_string()))?;
        let names: Vec<String> = cfg
            .get_hosts()
            .iter()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(h) => h.clone(),
                tokio_postgres::config::Host::Unix(p) => p.to_string_lossy().into_owned(),
            })
            .collect();
        if names.is_empty() {
            return Err(BadUrl("no host given".into()));
        }
        let ports = cfg.get_ports();
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
        let sslmode = match query_param(url, "sslmode") {
            Some(m) => m.parse()?,
            None => SslMode::Prefer,
        };
        Ok(ConnParams {
            host: hosts[0].0.clone(),
            port: hosts[0].1,
            hosts,
            user,
            password,
            dbname,
            sslmode,
            ssl_root_cert: query_param(url, "sslrootcert").map(Into::into),
            connect_timeout: cfg
                .get_connect_timeout()
                .copied()
                .unwrap_or(connect_timeout),
        })
    }

    /// `user@host:port/db` (`user@h1:p1,h2:p2/db` for several
    /// candidates), safe to log.
    pub fn display(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        format!("{}@{}/{}", self.user, hosts.join(","), self.dbname)
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
        if !self.password.is_empty() {
            c.password(&self.password);
        }
        c
    }
}

/// Parameters read here that tokio-postgres would reject (or read
/// differently).
const OWN_PARAMS: [&str; 3] = ["sslmode", "sslrootcert", "target_session_attrs"];

/// The string without [`OWN_PARAMS`].
fn strip_own_params(url: &str) -> String {
    let keep = |kv: &&str| !OWN_PARAMS.iter().any(|k| kv.starts_with(&format!("{k}=")));
    match url.split_once('?') {
        Some((base, q)) => {
            let rest: Vec<&str> = q.split('&').filter(keep).collect();
            if rest.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", rest.join("&"))
            }
        }
        None if url.contains("://") => url.to_owned(),
        None => url.split(' ').filter(keep).collect::<Vec<_>>().join(" "),
    }
}

/// A parameter of the URL's query (`?a=b&c=d`) or of a key/value string
/// (`a=b c=d`).
fn query_param(url: &str, key: &str) -> Option<String> {
    let tail = url.split_once('?').map_or(url, |(_, q)| q);
    tail.split(['&', ' '])
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
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
        assert_eq!(
            c.ssl_root_cert.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
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
        assert_eq!(allow.sslmode, SslMode::Prefer);
    }
}
