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
    /// Whether the server's certificate chain is checked: verify-ca and
    /// verify-full, and `require` when a root certificate is known (libpq
    /// keeps that for compatibility: "require" with a root CA file behaves
    /// like verify-ca).
    pub fn checks_chain(self, root: Option<&RootCert>) -> bool {
        match self {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require => root.is_some(),
            SslMode::Disable | SslMode::Allow | SslMode::Prefer => false,
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
        let cfg = tokio_postgres::Config::from_str(&strip_own_params(url)).map_err(|e| {
            let why = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            BadUrl(format!("{e}{why}"))
        })?;
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
        let tls = TlsParams::parse(url, std::env::var_os("HOME").map(PathBuf::from))?;
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

/// Parameters read here that tokio-postgres would reject (or read
/// differently).
const OWN_PARAMS: [&str; 12] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "channel_binding",
    "sslnegotiation",
    "target_session_attrs",
    "requiressl",
];

/// The TLS parameters of a connection string, resolved as libpq resolves
/// them (PostgreSQL docs, "libpq — Parameter Key Words" and "SSL
/// Support"): defaults from `~/.postgresql/`, `require` with a root
/// certificate meaning verify-ca, `sslrootcert=system` forcing
/// verify-full. What the relay cannot do on both of its connections is
/// refused here, naming the parameter.
#[derive(Debug)]
struct TlsParams {
    sslmode: SslMode,
    root: Option<RootCert>,
    client: Option<ClientCert>,
    channel_binding: ChannelBinding,
}

impl TlsParams {
    fn parse(url: &str, home: Option<PathBuf>) -> Result<TlsParams, BadUrl> {
        let param = |k: &str| {
            query_param(url, k).or_else(|| {
                env_name(k)
                    .and_then(std::env::var_os)
                    .map(|v| v.to_string_lossy().into_owned())
            })
        };
        let dot_pg = |name: &str| home.as_ref().map(|h| h.join(".postgresql").join(name));
        let root = match param("sslrootcert").as_deref() {
            Some("system") => Some(RootCert::System),
            Some(path) => Some(RootCert::File(path.into())),
            None => dot_pg("root.crt")
                .filter(|p| p.exists())
                .map(RootCert::File),
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
            (None, None) => dot_pg("postgresql.crt")
                .filter(|p| p.exists())
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
                    "channel_binding=require: the replication connection cannot bind SCRAM \
                     authentication to the TLS channel (no SCRAM-SHA-256-PLUS), so the relay \
                     refuses rather than connect without it; remove channel_binding (or set \
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
        })
    }
}

/// libpq's check of a private key file: owned by us and not readable by
/// group or others (0600), or owned by root and at most group-readable
/// (0640).
fn check_key_file(key: &std::path::Path) -> Result<(), BadUrl> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(key).map_err(|e| {
        BadUrl(format!(
            "sslkey={}: {e} (the private key of the client certificate)",
            key.display()
        ))
    })?;
    let mode = meta.mode() & 0o777;
    let allowed = if meta.uid() == 0 { 0o640 } else { 0o600 };
    if mode & !allowed != 0 {
        return Err(BadUrl(format!(
            "sslkey={}: the private key has mode {mode:04o}; it must not be readable by others \
             (chmod 0600, or 0640 when owned by root)",
            key.display()
        )));
    }
    Ok(())
}

/// `%XX` escapes of a URL query key or value decoded.
fn percent_decode(v: &str) -> String {
    percent_encoding::percent_decode_str(v)
        .decode_utf8_lossy()
        .into_owned()
}

/// The string without [`OWN_PARAMS`] (a key/value string is rebuilt with
/// libpq's quoting).
fn strip_own_params(url: &str) -> String {
    let own = |k: &str| OWN_PARAMS.contains(&k);
    if url.contains("://") {
        return match url.split_once('?') {
            Some((base, q)) => {
                let rest: Vec<&str> = q
                    .split('&')
                    .filter(|kv| !own(&percent_decode(kv.split('=').next().unwrap_or(""))))
                    .collect();
                if rest.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", rest.join("&"))
                }
            }
            None => url.to_owned(),
        };
    }
    match key_values(url) {
        Some(pairs) => pairs
            .iter()
            .filter(|(k, _)| !own(k))
            .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(" "),
        // Not parseable: tokio-postgres says why.
        None => url.to_owned(),
    }
}

/// A key/value connection string's pairs as libpq reads them (PostgreSQL
/// docs, "libpq — Connection Strings"): `key = value`, spaces around `=`
/// allowed, a value single-quoted with `\'` and `\\` escapes inside, or
/// unquoted up to the next space (backslash escapes too). `None` when it
/// does not parse.
fn key_values(s: &str) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(pairs);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') || key.is_empty() {
            return None;
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next()? {
                    '\'' => break,
                    '\\' => value.push(chars.next()?),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    value.push(chars.next()?);
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// The connection string's parameters: a URL's query (percent-decoded) or
/// a key/value string's pairs.
fn params(url: &str) -> Vec<(String, String)> {
    if url.contains("://") {
        let Some((_, q)) = url.split_once('?') else {
            return Vec::new();
        };
        return q
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (percent_decode(k), percent_decode(v)))
            .collect();
    }
    key_values(url).unwrap_or_default()
}

/// A parameter of the URL's query (`?a=b&c=d`) or of a key/value string
/// (`a=b c='d e'`), decoded.
fn query_param(url: &str, key: &str) -> Option<String> {
    params(url)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
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

    /// A private home directory for one test.
    fn home(name: &str) -> PathBuf {
        let h = std::env::temp_dir().join(format!("cdc-relay-conn-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&h);
        std::fs::create_dir_all(h.join(".postgresql")).unwrap();
        h
    }

    fn tls(url: &str, home: &std::path::Path) -> Result<TlsParams, String> {
        TlsParams::parse(url, Some(home.to_owned())).map_err(|e| e.to_string())
    }

    #[test]
    fn tls_parameters_resolve_as_libpq_does() {
        let h = home("resolve");
        let u = "postgres://u@h/d";
        // Nothing in ~/.postgresql: prefer, no root, no client certificate.
        let t = tls(u, &h).unwrap();
        assert_eq!(
            (t.sslmode, &t.root, &t.client),
            (SslMode::Prefer, &None, &None)
        );
        assert!(!t.sslmode.checks_chain(t.root.as_ref()));
        // verify-ca / verify-full need a root certificate.
        for mode in ["verify-ca", "verify-full"] {
            let err = tls(&format!("{u}?sslmode={mode}"), &h).unwrap_err();
            assert!(
                err.contains(&format!("sslmode={mode}")) && err.contains("sslrootcert"),
                "{err}"
            );
        }
        // ~/.postgresql/root.crt is the default root, and makes require check the chain.
        std::fs::write(h.join(".postgresql/root.crt"), "x").unwrap();
        let t = tls(&format!("{u}?sslmode=require"), &h).unwrap();
        assert_eq!(t.root, Some(RootCert::File(h.join(".postgresql/root.crt"))));
        assert!(t.sslmode.checks_chain(t.root.as_ref()));
        assert!(tls(&format!("{u}?sslmode=verify-ca"), &h).is_ok());
        // sslrootcert=system: verify-full by default, nothing weaker.
        let t = tls(&format!("{u}?sslrootcert=system"), &h).unwrap();
        assert_eq!(
            (t.sslmode, t.root),
            (SslMode::VerifyFull, Some(RootCert::System))
        );
        for mode in ["require", "verify-ca", "prefer"] {
            let err = tls(&format!("{u}?sslrootcert=system&sslmode={mode}"), &h).unwrap_err();
            assert!(
                err.contains("sslrootcert=system") && err.contains("verify-full"),
                "{err}"
            );
        }
        // A percent-encoded path is decoded.
        let t = tls(
            &format!("{u}?sslmode=verify-ca&sslrootcert=%2Fetc%2Fca.pem"),
            &h,
        )
        .unwrap();
        assert_eq!(t.root, Some(RootCert::File("/etc/ca.pem".into())));
    }

    #[test]
    fn client_certificates_resolve_and_keys_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let h = home("client");
        let u = "postgres://u@h/d";
        let cert = h.join("c.pem");
        let key = h.join("c.key");
        std::fs::write(&cert, "x").unwrap();
        std::fs::write(&key, "x").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let url = format!("{u}?sslcert={}&sslkey={}", cert.display(), key.display());
        let t = tls(&url, &h).unwrap();
        assert_eq!(
            t.client,
            Some(ClientCert {
                cert: cert.clone(),
                key: key.clone()
            })
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = tls(&url, &h).unwrap_err();
        assert!(
            err.contains("sslkey=") && err.contains("0644") && err.contains("chmod 0600"),
            "{err}"
        );
        let err = tls(&format!("{u}?sslcert=/nonexistent/c.pem"), &h).unwrap_err();
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
        let t = tls(u, &h).unwrap();
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
        let h = home("refused");
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
            let err = tls(&format!("{u}&{param}"), &h).unwrap_err();
            assert!(err.contains(names), "{param}: {err}");
            // The same through ConnParams: the URL error names the setting.
            let err = ConnParams::parse(&format!("{u}&{param}"), Duration::from_secs(1))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--database-url") && err.contains(names),
                "{err}"
            );
        }
        for ok in [
            "channel_binding=disable",
            "channel_binding=prefer",
            "sslnegotiation=postgres",
            "sslsni=1",
        ] {
            assert!(tls(&format!("{u}&{ok}"), &h).is_ok(), "{ok}");
            assert!(
                ConnParams::parse(&format!("{u}&{ok}"), Duration::from_secs(1)).is_ok(),
                "{ok}"
            );
        }
    }

    #[test]
    fn key_value_strings_are_read_with_libpq_quoting() {
        let kv = r"host=h user=u dbname = d sslrootcert='/tmp/sp ace/ca%.crt' sslcert=/a\ b/c.pem";
        assert_eq!(
            query_param(kv, "sslrootcert").as_deref(),
            Some("/tmp/sp ace/ca%.crt")
        );
        assert_eq!(query_param(kv, "sslcert").as_deref(), Some("/a b/c.pem"));
        assert_eq!(query_param(kv, "dbname").as_deref(), Some("d"));
        assert!(key_values("host='unterminated").is_none());
        let q = r"host=h user=u sslmode=verify-ca sslrootcert='/tmp/x y/ca.pem' application_name='a \'b\''";
        assert_eq!(query_param(q, "application_name").as_deref(), Some("a 'b'"));
        let stripped = strip_own_params(q);
        assert!(
            !stripped.contains("sslrootcert") && !stripped.contains("sslmode"),
            "{stripped}"
        );
        let c = ConnParams::parse(q, Duration::from_secs(1)).unwrap();
        assert_eq!(
            c.ssl_root_cert,
            Some(RootCert::File("/tmp/x y/ca.pem".into()))
        );
        assert_eq!(c.sslmode, SslMode::VerifyCa);
        // A URL's values are percent-decoded.
        assert_eq!(
            query_param(
                "postgres://u@h/d?sslrootcert=%2Fa%20b%25.pem",
                "sslrootcert"
            )
            .as_deref(),
            Some("/a b%.pem")
        );
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
