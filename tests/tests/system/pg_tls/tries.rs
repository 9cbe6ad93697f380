//! The machinery of the TLS matrix: one try of a URL by `psql` (the
//! oracle) and by the relay against a server with `ssl = on`, what each
//! gave, and the cases that say what they must give.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use harness::app;
use harness::pki::{self, Ca, path_str};
use harness::{ClusterOptions, PgCluster};

/// How long a relay may take to stream or to give up.
pub(super) const DECIDE: Duration = Duration::from_secs(30);

/// What one try gave.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Connected (`psql`), or streaming (the relay); `ssl` whether the
    /// session is encrypted (for the relay: both of its connections, the
    /// walsender and the side connection, as `pg_stat_ssl` shows them).
    Accepted { ssl: Option<bool> },
    /// Refused, with the exit code and what was printed.
    Refused { code: Option<i32>, output: String },
}

impl Outcome {
    pub(super) fn accepted(&self) -> bool {
        matches!(self, Outcome::Accepted { .. })
    }
}

/// One row of the matrix.
pub(super) struct Case {
    /// What is being tried.
    pub(super) what: &'static str,
    /// The URL's host: `127.0.0.1`, `localhost` or `[::1]`.
    pub(super) host: &'static str,
    /// The URL's TLS parameters (`sslmode=…&sslrootcert=…`).
    pub(super) params: String,
    /// Whether libpq (and so the relay) must accept.
    pub(super) accept: bool,
    /// For a refusal: a word the relay's message must carry (the
    /// parameter to fix).
    pub(super) names: &'static str,
}

/// A cluster with `ssl = on` serving `cert`, trusting `ca` for client
/// certificates.
pub(super) fn ssl_cluster(ca: &Ca, cert: &pki::Issued) -> anyhow::Result<PgCluster> {
    PgCluster::start(ClusterOptions {
        extra_settings: vec![
            ("ssl".into(), "on".into()),
            ("ssl_cert_file".into(), path_str(&cert.cert)?.into()),
            (
                "ssl_key_file".into(),
                path_str(&pki::server_key(&cert.key)?)?.into(),
            ),
            ("ssl_ca_file".into(), path_str(&ca.cert)?.into()),
            // ::1 too, which the harness's pg_hba.conf does not name.
            ("listen_addresses".into(), "127.0.0.1,::1".into()),
        ],
        ..ClusterOptions::default()
    })
}

/// Tries against one server, with `HOME` (libpq's `~/.postgresql`) at
/// `home` and `SSL_CERT_FILE` (the system roots) at `cert_file` when set,
/// for both `psql` and the relay.
#[derive(Clone)]
pub(super) struct Tries<'a> {
    pub(super) cluster: &'a PgCluster,
    pub(super) stack: &'a harness::stack::Stack,
    pub(super) home: PathBuf,
    pub(super) cert_file: Option<PathBuf>,
}

impl Tries<'_> {
    /// Serves `cert` from now on (the server reloads its TLS files on
    /// SIGHUP).
    pub(super) fn serve(&self, cert: &pki::Issued) -> anyhow::Result<()> {
        let key = pki::server_key(&cert.key)?;
        for (setting, file) in [("ssl_cert_file", &cert.cert), ("ssl_key_file", &key)] {
            self.cluster.psql(
                "postgres",
                &format!("ALTER SYSTEM SET {setting} = '{}'", path_str(file)?),
            )?;
        }
        self.cluster.psql("postgres", "SELECT pg_reload_conf()")?;
        // New backends see the reloaded files once the postmaster has them.
        let want = path_str(&cert.cert)?.to_owned();
        for _ in 0..100 {
            if self.cluster.psql("postgres", "SHOW ssl_cert_file")?.trim() == want {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        anyhow::bail!("the server did not reload ssl_cert_file = {want}")
    }

    /// Runs `cases`: psql and the relay agree with each other and with the
    /// case; a refusal by the relay names what to fix.
    pub(super) async fn run(&self, cases: &[Case]) -> anyhow::Result<()> {
        let mut wrong = Vec::new();
        for c in cases {
            let oracle = self.psql(c.host, &c.params)?;
            let relay = self.relay(c.host, &c.params).await?;
            let named = match &relay {
                Outcome::Refused { output, .. } => output.contains(c.names),
                Outcome::Accepted { .. } => true,
            };
            // disable, and allow where the server takes plain, stay plain.
            // prefer whose handshake fails goes on in plain text.
            let plain = c.params.contains("sslmode=disable")
                || (c.params.contains("sslmode=allow") && !c.what.contains("plain refused"))
                || c.what.contains("then plain text");
            let encrypted_as_libpq = [&oracle, &relay].iter().all(|outcome| match outcome {
                Outcome::Accepted { ssl } => *ssl == Some(!plain),
                Outcome::Refused { .. } => true,
            });
            if oracle.accepted() != c.accept
                || relay.accepted() != c.accept
                || !named
                || !encrypted_as_libpq
            {
                wrong.push(format!(
                    "{} ({}, {}): expected {}, psql {oracle:?}, relay {relay:?}{}",
                    c.what,
                    c.host,
                    c.params,
                    if c.accept { "accepted" } else { "refused" },
                    if named {
                        String::new()
                    } else {
                        format!(" (the message should name {})", c.names)
                    }
                ));
            }
        }
        anyhow::ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
        Ok(())
    }

    pub(super) fn url(&self, host: &str, params: &str) -> String {
        let url = self
            .stack
            .relay_url
            .replacen("@127.0.0.1:", &format!("@{host}:"), 1);
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}{params}")
    }

    /// libpq's answer: `psql` connects and says whether the session is
    /// encrypted.
    pub(super) fn psql(&self, host: &str, params: &str) -> anyhow::Result<Outcome> {
        let out = self
            .cluster
            .command("psql")
            .args([
                &self.url(host, params),
                "-XAtc",
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            ])
            .env("HOME", &self.home)
            .envs(self.cert_file.iter().map(|f| ("SSL_CERT_FILE", f)))
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .context("running psql")?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        Ok(if out.status.success() {
            Outcome::Accepted {
                ssl: Some(text == "t"),
            }
        } else {
            Outcome::Refused {
                code: out.status.code(),
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        })
    }

    /// The relay's answer: `cdc-relay run` streams (then it is stopped) or
    /// exits.
    pub(super) async fn relay(&self, host: &str, params: &str) -> anyhow::Result<Outcome> {
        let log = tempfile::NamedTempFile::new()?;
        let admin = self.cluster.connect_superuser("postgres").await?;
        let since: std::time::SystemTime = admin.query_one("SELECT now()", &[]).await?.get(0);
        let mut argv = app::relay_globals(self.stack);
        argv.extend(
            [
                "run",
                "--sink-url",
                "http://127.0.0.1:9/inbox",
                "--admin-listen",
                "127.0.0.1:0",
            ]
            .map(String::from),
        );
        let mut child = tokio::process::Command::new(harness::bins::path("cdc-relay"))
            .args(&argv)
            .env("CDC_RELAY_DATABASE_URL", self.url(host, params))
            .env("CDC_RELAY_LOG", "info")
            .env("EVENT_SECRET", app::TEST_SECRET)
            .env("HOME", &self.home)
            .envs(self.cert_file.iter().map(|f| ("SSL_CERT_FILE", f)))
            .stdout(log.reopen()?)
            .stderr(log.reopen()?)
            .kill_on_drop(true)
            .spawn()
            .context("starting cdc-relay")?;
        let read = || std::fs::read_to_string(log.path()).unwrap_or_default();
        let deadline = tokio::time::Instant::now() + DECIDE;
        loop {
            if read().lines().any(app::is_session_start) {
                let ssl = relay_sessions_encrypted(&admin, since).await?;
                if let Some(pid) = child.id() {
                    nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGTERM,
                    )?;
                }
                tokio::time::timeout(DECIDE, child.wait()).await??;
                return Ok(Outcome::Accepted { ssl: Some(ssl) });
            }
            if let Some(status) = child.try_wait()? {
                return Ok(Outcome::Refused {
                    code: status.code(),
                    output: read(),
                });
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the relay neither streamed nor exited within {DECIDE:?} ({params}):\n{}",
                read()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Whether the relay's sessions that started since `since` (its walsender
/// and its side connection, both of the `cdc_relay` role) are encrypted;
/// an error unless there are both and they agree.
pub(super) async fn relay_sessions_encrypted(
    admin: &tokio_postgres::Client,
    since: std::time::SystemTime,
) -> anyhow::Result<bool> {
    let rows = admin
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'cdc_relay' AND a.backend_start >= $1 ORDER BY 1",
            &[&since],
        )
        .await?;
    let sessions: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let kinds: std::collections::BTreeSet<&str> =
        sessions.iter().map(|(kind, _)| kind.as_str()).collect();
    anyhow::ensure!(
        kinds.contains("walsender") && kinds.contains("client backend"),
        "the streaming relay's two connections are not both on the server: {sessions:?}"
    );
    let encrypted = sessions[0].1;
    anyhow::ensure!(
        sessions.iter().all(|(_, ssl)| *ssl == encrypted),
        "the relay's connections disagree on TLS: {sessions:?}"
    );
    Ok(encrypted)
}
