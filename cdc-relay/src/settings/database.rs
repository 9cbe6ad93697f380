//! The database URLs of the global flags: `--database-url` with its
//! password settings, `--replication-url` (checked against it) and
//! `--standby-url`, each parsed into [`ConnParams`] that name their flag.

use crate::cli::GlobalArgs;
use crate::source::ConnParams;

impl GlobalArgs {
    /// The database URL with the password from the flag, env or file applied.
    pub fn conn(&self) -> Result<ConnParams, String> {
        let url = self
            .database_url
            .as_deref()
            .ok_or("--database-url (CDC_RELAY_DATABASE_URL) is required")?;
        let mut conn = ConnParams::parse(url, self.connect_timeout)
            .map_err(|e| format!("invalid --database-url (CDC_RELAY_DATABASE_URL): {e}"))?;
        match (&self.database_password, &self.database_password_file) {
            (Some(_), Some(_)) => {
                return Err("--database-password (CDC_RELAY_DATABASE_PASSWORD) and \
                     --database-password-file (CDC_RELAY_DATABASE_PASSWORD_FILE) are both set: \
                     set one of them"
                    .into());
            }
            (Some(p), None) => conn.password = p.clone(),
            (None, Some(path)) => {
                conn.password = read_secret_file(path, "--database-password-file")?;
                conn.password_file = Some(path.clone());
            }
            (None, None) => {}
        }
        // The TLS files must load once at startup (later, a file that stops
        // loading keeps its last good copy).
        crate::source::tls::check_files(&conn)
            .map_err(|e| format!("invalid --database-url (CDC_RELAY_DATABASE_URL): {e}"))?;
        Ok(conn)
    }

    /// The replication connection's own server (`--replication-url`), if
    /// set: one host, with the password from the flag, env or file when
    /// its URL has none (a file stays the one re-read on rotation).
    pub fn replication_conn(&self) -> Result<Option<ConnParams>, String> {
        const FLAG: &str = "--replication-url (CDC_RELAY_REPLICATION_URL)";
        // Empty is unset (`CDC_RELAY_REPLICATION_URL=` in an env file).
        let Some(url) = self
            .replication_url
            .as_deref()
            .filter(|u| !u.trim().is_empty())
        else {
            return Ok(None);
        };
        let mut c = ConnParams::parse(url, self.connect_timeout)
            .map_err(|e| format!("invalid {FLAG}: {e}"))?;
        c.flag = FLAG;
        if c.hosts.len() != 1 {
            return Err(format!(
                "{FLAG} names {} hosts: give it the one server the slot is on (several hosts, \
                 to find the primary among them, belong in --database-url)",
                c.hosts.len()
            ));
        }
        let side = self.conn()?;
        weaker_tls(url, &c, &side)?;
        if c.password.is_empty() {
            c.password = side.password;
            c.password_file = side.password_file;
        }
        crate::source::tls::check_files(&c).map_err(|e| format!("invalid {FLAG}: {e}"))?;
        Ok(Some(c))
    }

    /// The standbys of `--standby-url`, with the password from the flag,
    /// env or file when their URL has none.
    pub fn standbys(&self) -> Result<Vec<ConnParams>, String> {
        let password = self.conn().ok().map(|c| c.password);
        const FLAG: &str = "--standby-url (CDC_RELAY_STANDBY_URLS)";
        self.standby_url
            .iter()
            .flat_map(|value| split_urls(value))
            // Empty is unset (`CDC_RELAY_STANDBY_URLS=`), as is an empty
            // item of the list.
            .filter(|url| !url.trim().is_empty())
            .map(|url| {
                let mut c = ConnParams::parse(url.trim(), self.connect_timeout)
                    .map_err(|e| format!("invalid {FLAG}: {e}"))?;
                c.flag = FLAG;
                if c.password.is_empty()
                    && let Some(p) = &password
                {
                    c.password = p.clone();
                }
                // Its TLS files load now, as the other URLs' do: a
                // mismatched pair would otherwise surface only as a copy
                // that is never read.
                crate::source::tls::check_files(&c).map_err(|e| format!("invalid {FLAG}: {e}"))?;
                Ok(c)
            })
            .collect()
    }
}

/// Splits one `--standby-url` value into its URLs: at a comma or
/// whitespace that a `postgres://` or `postgresql://` URL follows, and
/// nowhere else, so a multi-host URL (`postgres://a,b/db`), a key/value
/// string (`host=a,b port=5432`) and a password with a comma stay whole.
fn split_urls(value: &str) -> Vec<&str> {
    let starts_url = |rest: &str| {
        let rest = rest.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        crate::source::conn::is_url(rest)
    };
    let mut urls = Vec::new();
    let mut start = 0;
    for (i, c) in value.char_indices() {
        if (c == ',' || c.is_whitespace()) && i > start && starts_url(&value[i..]) {
            urls.push(&value[start..i]);
            start = i + 1;
        }
    }
    urls.push(&value[start..]);
    urls
}

fn read_secret_file(path: &std::path::Path, setting: &str) -> Result<String, String> {
    let loaded = crate::reread::load(setting, path, |b| crate::reread::first_line(b).map(drop))
        .map_err(|reason| format!("{setting} {}: {reason}", path.display()))?;
    crate::reread::first_line(&loaded.bytes)
        .map_err(|reason| format!("{setting} {}: {reason}", path.display()))
}

/// Refuses a `--replication-url` that says nothing about TLS (so libpq's
/// default, `prefer`: the server's certificate unchecked) while
/// `--database-url` verifies the server: the stream carries every outbox
/// row, and its TLS parameters are its own, as in libpq, so the weaker
/// mode would be an oversight, not a choice. An `sslmode` in the URL is
/// taken as given; `PGSSLMODE`, which both URLs read and the side URL's
/// own sslmode overrides, is not; a Unix socket needs no TLS.
fn weaker_tls(url: &str, replication: &ConnParams, side: &ConnParams) -> Result<(), String> {
    // require, prefer and allow check the chain too when a root is known.
    let verifies = |c: &ConnParams| c.sslmode.checks_chain(c.ssl_root_cert.as_ref());
    let silent = !crate::source::conn::names_param(url, "sslmode")
        && !crate::source::conn::names_param(url, "requiressl");
    if silent && !replication.host.starts_with('/') && verifies(side) && !verifies(replication) {
        // PGSSLMODE is read by both URLs; the side connection's own
        // sslmode overrode it, so a weaker one there is not a choice made
        // for the stream either.
        let from_env = std::env::var("PGSSLMODE")
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| format!(" (PGSSLMODE={v} in the environment applies to it)"))
            .unwrap_or_default();
        return Err(format!(
            "--replication-url (CDC_RELAY_REPLICATION_URL) sets no sslmode{from_env}, so the \
             stream would not check the server's certificate, while --database-url has \
             sslmode={mode}: its TLS parameters are its own, as in libpq. Add sslmode={mode} and \
             sslrootcert=… to --replication-url (or an explicit sslmode=prefer to leave the \
             stream unverified on purpose)",
            mode = side.sslmode.as_str()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn standby_urls_split_only_where_a_url_starts() {
        for (value, urls) in [
            ("postgres://a/db", &["postgres://a/db"][..]),
            ("postgres://a,b:5433/db", &["postgres://a,b:5433/db"]),
            (
                "postgres://a/db,postgresql://b/db",
                &["postgres://a/db", "postgresql://b/db"],
            ),
            (
                "postgres://a/db, postgres://b/db",
                &["postgres://a/db", " postgres://b/db"],
            ),
            (
                "postgres://a/db postgres://b/db",
                &["postgres://a/db", "postgres://b/db"],
            ),
            (
                "postgres://u:p,w@a/db,postgres://b/db",
                &["postgres://u:p,w@a/db", "postgres://b/db"],
            ),
            (
                "host=a,b port=5432 dbname=orders",
                &["host=a,b port=5432 dbname=orders"],
            ),
        ] {
            assert_eq!(split_urls(value), urls, "{value}");
        }
    }

    #[test]
    fn a_replication_url_silent_about_tls_beside_a_verifying_side_is_refused() {
        use crate::source::SslMode;
        let parse = |u: &str| ConnParams::parse(u, Duration::from_secs(5)).expect("parses");
        let mut side = parse("postgres://relay@db.internal:6432/orders");
        side.sslmode = SslMode::VerifyFull;
        let direct = "postgres://relay@db.internal:5432/orders";
        let err = weaker_tls(direct, &parse(direct), &side).unwrap_err();
        assert!(
            err.contains("sslmode=verify-full") && err.contains("--replication-url"),
            "{err}"
        );
        // Said on purpose, or no TLS to speak of, or the side verifies nothing.
        let explicit = "postgres://relay@db.internal:5432/orders?sslmode=prefer";
        assert_eq!(weaker_tls(explicit, &parse(explicit), &side), Ok(()));
        let socket = "postgres:///orders?host=/var/run/postgresql&user=relay";
        assert_eq!(weaker_tls(socket, &parse(socket), &side), Ok(()));
        side.sslmode = SslMode::Require;
        side.ssl_root_cert = None;
        assert_eq!(weaker_tls(direct, &parse(direct), &side), Ok(()));
        // require with a root checks the chain (libpq's verify-ca).
        side.ssl_root_cert = Some(crate::source::conn::RootCert::File("/ca.pem".into()));
        assert!(weaker_tls(direct, &parse(direct), &side).is_err());
    }
}
