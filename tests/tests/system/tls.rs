//! TLS end to end, with a private CA made here with the `openssl` command:
//! the relay's two PostgreSQL connections with `sslmode=verify-full`, and
//! delivery to an https sink trusted through `--sink-ca-file` (HTTP/2
//! sinks are in `http2.rs`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use harness::app::{self, TEST_SECRET};
use harness::pki::path_str;
use harness::sink::sign;
use harness::{ClusterOptions, PgCluster, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// TLS end to end with a private CA made here with the `openssl` CLI: the
/// relay delivers to an https sink it trusts through `--sink-ca-file` (and
/// not without it), and both its PostgreSQL connections, the side one and
/// the replication one, run over TLS with `sslmode=verify-full` against a
/// cluster started with `ssl=on`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgres_and_to_the_sink_with_a_private_ca() -> anyhow::Result<()> {
    let pki = Pki::generate()?;
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![
            ("ssl".into(), "on".into()),
            ("ssl_cert_file".into(), path_str(&pki.cert)?.into()),
            ("ssl_key_file".into(), path_str(&pki.pg_key)?.into()),
        ],
        ..ClusterOptions::default()
    })?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = harness::tls_sink::TlsSink::start(&pki.cert, &pki.key, None).await?;
    // By name here; by IP address in pg_tls::.
    let db_url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        stack.relay_url.replacen("@127.0.0.1:", "@localhost:", 1),
        path_str(&pki.ca)?
    );
    anyhow::ensure!(db_url.contains("@localhost:"), "{db_url}");
    let db = stack.orders_admin().await?;

    // Without the CA the sink's certificate is refused: nothing arrives.
    let mut untrusting = app::start_relay_with_url(&stack, &db_url, &sink.url, &[]).await?;
    app::wait_streaming(&untrusting).await?;
    let event = app::insert_order_event(&db).await?;
    wait_until("a failed TLS delivery attempt", WAIT, || async {
        let m = untrusting.metrics().await?;
        Ok::<_, anyhow::Error>(
            m.value(
                "cdc_relay_delivery_attempts_total",
                &[("outcome", "retry"), ("status_class", "none")],
            )
            .is_some_and(|v| v >= 1.0),
        )
    })
    .await?;
    assert!(
        sink.bodies().is_empty(),
        "delivered without trusting the CA"
    );
    // A refused certificate is a TLS failure, labelled so (not `connect`).
    let m = untrusting.metrics().await?;
    assert!(
        m.value("cdc_relay_retries_total", &[("reason", "tls")])
            .is_some_and(|v| v >= 1.0),
        "{:?}",
        m.label_values("cdc_relay_retries_total", "reason")
    );
    untrusting.process.sigkill();

    let relay = app::start_relay_with_url(
        &stack,
        &db_url,
        &sink.url,
        &["--sink-ca-file", path_str(&pki.ca)?],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    wait_until("delivery over https", WAIT, || async {
        sink.bodies()
            .iter()
            .any(|(body, _)| body.contains(&event.to_string()))
    })
    .await?;
    let (body, signature) = sink
        .bodies()
        .into_iter()
        .find(|(body, _)| body.contains(&event.to_string()))
        .context("the event")?;
    assert_eq!(Some(sign(TEST_SECRET, body.as_bytes())), signature);

    // Both of the relay's sessions are encrypted: the side connection and
    // the walsender.
    let rows = db
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'cdc_relay' AND a.pid <> pg_backend_pid()",
            &[],
        )
        .await?;
    let sessions: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        sessions.iter().any(|(t, _)| t == "walsender")
            && sessions.iter().any(|(t, _)| t == "client backend"),
        "{sessions:?}"
    );
    assert!(sessions.iter().all(|(_, ssl)| *ssl), "{sessions:?}");
    Ok(())
}

/// A throwaway certificate authority and one server certificate for
/// `localhost` and `127.0.0.1`, made with the `openssl` command.
pub(crate) struct Pki {
    _dir: tempfile::TempDir,
    pub(crate) ca: PathBuf,
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    /// The server key as PostgreSQL insists: mode 0600, owned by the user
    /// the server runs as.
    pg_key: PathBuf,
}

impl Pki {
    pub(crate) fn generate() -> anyhow::Result<Pki> {
        let dir = harness::pki::dir()?;
        let ca = harness::pki::Ca::new(dir.path(), "cdc-relay-test-ca")?;
        let server = ca.issue(&harness::pki::Request {
            name: "localhost",
            sans: &["DNS:localhost", "IP:127.0.0.1"],
            client: false,
            expired: false,
        })?;
        Ok(Pki {
            ca: ca.cert.clone(),
            pg_key: harness::pki::server_key(&server.key)?,
            cert: server.cert,
            key: server.key,
            _dir: dir,
        })
    }
}

/// An `https://` sink URL that reaches a plain-HTTP listener: the retry's
/// detail says the endpoint does not speak TLS and what to change (it
/// said only "received corrupt message of type InvalidContentType"), and
/// the event stays pending, then is delivered once the URL is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_url_to_a_plain_http_endpoint_says_so() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = harness::sink::ScriptedSink::start().await?;
    let https = sink.url.replacen("http://", "https://", 1);
    let relay = app::start_relay(&stack, &https, &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let id = app::insert_order_event(&db).await?.to_string();
    wait_until("the plain-text answer named", WAIT, || async {
        relay.process.logs().contains("does not speak TLS")
    })
    .await?;
    assert!(
        !harness::oracle::arrival_ids(&sink.delivered()).contains(&id),
        "nothing reached the plain-HTTP sink over TLS"
    );
    drop(relay);
    let fixed = app::start_relay(&stack, &sink.url, &[]).await?;
    wait_until("the event delivered over http://", WAIT, || async {
        harness::oracle::arrival_ids(&sink.delivered()).contains(&id)
    })
    .await?;
    drop(fixed);
    Ok(())
}
