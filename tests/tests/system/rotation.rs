//! Issue 30, item 2: every credential and trust file is read again without
//! a restart. For the database: the password file, `sslrootcert`, and the
//! client certificate (`sslcert`/`sslkey`), against a server whose
//! `pg_hba.conf` asks the relay's role for both a password and a client
//! certificate. For the sinks: `--sink-ca-file` and the client certificate
//! (`--sink-client-cert`/`--sink-client-key`) of an https receiver that
//! asks for one. Each file is rotated (a new password, a new CA with new
//! certificates on both sides) and an event is delivered across the
//! rotation by the same process; then each file is broken (empty, not
//! PEM), and the relay keeps the copy that last loaded, says so at ERROR,
//! and delivers the next event.
//!
//! Failed on `cb3ea2e`: the password file was read once at startup (the
//! relay could not reconnect after the password changed), and
//! `--sink-client-cert`, `sslcert` and `sslkey` did not exist.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use harness::app;
use harness::otlp::Collector;
use harness::pki::{self, Ca, Request, path_str};
use harness::sink::ScriptedSink;
use harness::tls_sink::{TlsSink, serve_tls};
use harness::{ClusterOptions, PgCluster, wait_until};

const WAIT: Duration = Duration::from_secs(60);

fn issue(ca: &Ca, name: &'static str, client: bool) -> anyhow::Result<pki::Issued> {
    let sans: &[&str] = if client {
        &[]
    } else {
        &["DNS:localhost", "IP:127.0.0.1"]
    };
    ca.issue(&Request {
        name,
        sans,
        client,
        expired: false,
    })
}

/// Copies `from` over `to` (keeping `to`'s mode), as a rotation does.
fn put(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::write(to, std::fs::read(from)?).with_context(|| format!("writing {}", to.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_password_root_and_client_certificate_rotate_without_a_restart()
-> anyhow::Result<()> {
    let dir = pki::dir()?;
    let ca1 = Ca::new(dir.path(), "ca1")?;
    let ca2 = Ca::new(dir.path(), "ca2")?;
    let server1 = issue(&ca1, "server1", false)?;
    let server2 = issue(&ca2, "server2", false)?;
    let client1 = issue(&ca1, "cdc_relay", true)?;
    let client2 = issue(&ca2, "cdc_relay", true)?;
    // The server trusts client certificates from either CA.
    let client_cas = dir.path().join("client-cas.pem");
    std::fs::write(
        &client_cas,
        [std::fs::read(&ca1.cert)?, std::fs::read(&ca2.cert)?].concat(),
    )?;
    let cluster = PgCluster::start(ClusterOptions {
        extra_settings: vec![
            ("ssl".into(), "on".into()),
            ("ssl_cert_file".into(), path_str(&server1.cert)?.into()),
            (
                "ssl_key_file".into(),
                path_str(&pki::server_key(&server1.key)?)?.into(),
            ),
            ("ssl_ca_file".into(), path_str(&client_cas)?.into()),
        ],
        ..ClusterOptions::default()
    })?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let hba = cluster.data_dir().join("pg_hba.conf");
    let before = std::fs::read_to_string(&hba)?;
    std::fs::write(
        &hba,
        format!(
            "hostssl all cdc_relay 127.0.0.1/32 scram-sha-256 clientcert=verify-full\n\
             host all cdc_relay 127.0.0.1/32 reject\n{before}"
        ),
    )?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;

    // The relay's files, in one place, rotated in place.
    let files = tempfile::tempdir()?;
    let f = |name: &str| files.path().join(name);
    let (root, cert, key, password) = (
        f("root.pem"),
        f("client.pem"),
        f("client.key"),
        f("password"),
    );
    put(&ca1.cert, &root)?;
    put(&client1.cert, &cert)?;
    put(&client1.key, &key)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
    }
    let mut url = reqwest::Url::parse(&stack.relay_url)?;
    std::fs::write(
        &password,
        format!("{}\n", url.password().context("a password")?),
    )?;
    url.set_password(None)
        .map_err(|()| anyhow::anyhow!("no password to clear"))?;
    let db_url = format!(
        "{url}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        path_str(&root)?,
        path_str(&cert)?,
        path_str(&key)?
    );

    let sink = harness::sink::ScriptedSink::start().await?;
    let mut relay = app::start_relay_with_url(
        &stack,
        &db_url,
        &sink.url,
        &["--database-password-file", path_str(&password)?],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let admin = cluster.connect_superuser("postgres").await?;
    let delivered = |event: uuid::Uuid| {
        let sink = &sink;
        async move {
            wait_until(&format!("event {event} delivered"), WAIT, || async {
                sink.delivered()
                    .iter()
                    .any(|r| String::from_utf8_lossy(&r.body).contains(&event.to_string()))
            })
            .await
        }
    };
    let cut = || async {
        admin
            .batch_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'cdc_relay'",
            )
            .await
    };
    delivered(app::insert_order_event(&db).await?).await?;

    // Rotation: a new password, a new CA for the server's certificate and
    // for the client's; the relay's connections are cut, so it reconnects.
    admin
        .batch_execute("ALTER ROLE cdc_relay PASSWORD 'rotated-password'")
        .await?;
    std::fs::write(&password, "rotated-password\n")?;
    for (setting, file) in [
        ("ssl_cert_file", server2.cert.clone()),
        ("ssl_key_file", pki::server_key(&server2.key)?),
    ] {
        admin
            .batch_execute(&format!(
                "ALTER SYSTEM SET {setting} = '{}'",
                path_str(&file)?
            ))
            .await?;
    }
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    put(&ca2.cert, &root)?;
    put(&client2.cert, &cert)?;
    put(&client2.key, &key)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    cut().await?;
    delivered(app::insert_order_event(&db).await?).await?;
    let sessions = app::sessions(&relay);
    assert!(sessions >= 2, "the relay reconnected: {sessions} sessions");

    // Broken rotations: each file is kept as it last loaded.
    std::fs::write(&password, "\n")?;
    std::fs::write(&root, "not a certificate")?;
    std::fs::write(&cert, "")?;
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\ngarbage\n")?;
    cut().await?;
    delivered(app::insert_order_event(&db).await?).await?;
    let log = relay.process.logs();
    for setting in [
        "--database-password-file",
        "sslrootcert",
        "sslcert",
        "sslkey",
    ] {
        assert!(
            log.lines().any(|l| l.contains("ERROR")
                && l.contains(setting)
                && l.contains("keep using the copy that last loaded")),
            "no ERROR keeping {setting}:\n{log}"
        );
    }
    assert!(relay.process.try_status().is_none(), "the relay exited");

    // A rotated key readable by others: libpq refuses it at each
    // connection, and so does the relay, keeping the pair that last loaded
    // (it was used silently: a fourth newcomer's finding on 98e6b8e).
    put(&client2.cert, &cert)?;
    put(&client2.key, &key)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644))?;
    }
    cut().await?;
    delivered(app::insert_order_event(&db).await?).await?;
    let log = relay.process.logs();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("sslkey") && l.contains("mode 0644")),
        "no ERROR refusing the key readable by others:\n{log}"
    );
    std::fs::write(&hba, before)?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_ca_and_client_certificate_rotate_without_a_restart() -> anyhow::Result<()> {
    let dir = pki::dir()?;
    let ca1 = Ca::new(dir.path(), "ca1")?;
    let ca2 = Ca::new(dir.path(), "ca2")?;
    let server1 = issue(&ca1, "sink1", false)?;
    let server2 = issue(&ca2, "sink2", false)?;
    let client1 = issue(&ca1, "relay1", true)?;
    let client2 = issue(&ca2, "relay2", true)?;
    let mut sink = TlsSink::start(&server1.cert, &server1.key, Some(&ca1.cert)).await?;

    let files = tempfile::tempdir()?;
    let f = |name: &str| files.path().join(name);
    let (ca, cert, key) = (f("sink-ca.pem"), f("client.pem"), f("client.key"));
    put(&ca1.cert, &ca)?;
    put(&client1.cert, &cert)?;
    put(&client1.key, &key)?;

    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let mut relay = app::start_relay_with_url(
        &stack,
        &stack.relay_url,
        &sink.url,
        &[
            "--sink-ca-file",
            path_str(&ca)?,
            "--sink-client-cert",
            path_str(&cert)?,
            "--sink-client-key",
            path_str(&key)?,
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let event = app::insert_order_event(&db).await?;
    wait_until(
        "delivery with the first CA and client certificate",
        WAIT,
        || async { sink.got(&event.to_string()) },
    )
    .await?;

    // The receiver moves to a new CA for its certificate and for the
    // clients it accepts; the relay's files follow.
    put(&ca2.cert, &ca)?;
    put(&client2.cert, &cert)?;
    put(&client2.key, &key)?;
    sink.restart(&server2.cert, &server2.key, Some(&ca2.cert))
        .await?;
    let event = app::insert_order_event(&db).await?;
    wait_until("delivery across the rotation", WAIT, || async {
        sink.got(&event.to_string())
    })
    .await?;

    // Broken files: the copies that last loaded go on working.
    std::fs::write(&ca, "not a certificate")?;
    std::fs::write(&key, "")?;
    sink.restart(&server2.cert, &server2.key, Some(&ca2.cert))
        .await?;
    let event = app::insert_order_event(&db).await?;
    wait_until("delivery with the kept copies", WAIT, || async {
        sink.got(&event.to_string())
    })
    .await?;
    let log = relay.process.logs();
    for flag in ["--sink-ca-file", "--sink-client-key"] {
        assert!(
            log.lines().any(|l| l.contains("ERROR")
                && l.contains(flag)
                && l.contains("copy that last loaded")),
            "no ERROR keeping {flag}:\n{log}"
        );
    }
    // The key mended, the certificate broken: the same, naming it.
    put(&client2.key, &key)?;
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\ntruncated")?;
    sink.restart(&server2.cert, &server2.key, Some(&ca2.cert))
        .await?;
    let event = app::insert_order_event(&db).await?;
    wait_until("delivery with the kept certificate", WAIT, || async {
        sink.got(&event.to_string())
    })
    .await?;
    let log = relay.process.logs();
    assert!(
        log.lines().any(|l| l.contains("ERROR")
            && l.contains("--sink-client-cert")
            && l.contains("copy that last loaded")),
        "no ERROR keeping --sink-client-cert:\n{log}"
    );
    assert!(relay.process.try_status().is_none(), "the relay exited");
    Ok(())
}

/// The OTLP collector's CA (`--otlp-certificate`) rotates as the sinks'
/// does: the relay's spans reach a collector serving a certificate of the
/// first CA; the collector moves to a certificate of a second CA and the
/// file is replaced; the next event's spans arrive without a restart.
///
/// Fails without the fix: the file was read once at start, so after the
/// rotation every export failed its handshake and no span came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_otlp_collectors_ca_rotates_without_a_restart() -> anyhow::Result<()> {
    let dir = pki::dir()?;
    let ca1 = Ca::new(dir.path(), "otlp-ca1")?;
    let ca2 = Ca::new(dir.path(), "otlp-ca2")?;
    let server1 = issue(&ca1, "collector1", false)?;
    let server2 = issue(&ca2, "collector2", false)?;
    let collector = Collector::start().await?;
    let (port, stop) = serve_tls(&server1.cert, &server1.key, None, 0, collector.router()).await?;
    let files = tempfile::tempdir()?;
    let ca = files.path().join("otlp-ca.pem");
    put(&ca1.cert, &ca)?;

    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let endpoint = format!("https://localhost:{port}");
    let mut relay = app::start_relay(
        &stack,
        &sink.url,
        &[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-certificate",
            path_str(&ca)?,
        ],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    traced_event(&db).await?;
    collector
        .wait_for("spans through the first CA", WAIT, |s| !s.is_empty())
        .await?;

    // The collector's certificate comes from a new CA; the file follows.
    put(&ca2.cert, &ca)?;
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, _stop) = serve_tls(&server2.cert, &server2.key, None, port, collector.router()).await?;
    let before = collector.spans().len();
    traced_event(&db).await?;
    collector
        .wait_for("spans across the rotation", WAIT, |s| s.len() > before)
        .await?;
    assert!(relay.process.try_status().is_none(), "the relay exited");
    Ok(())
}

/// Inserts an outbox row carrying a sampled W3C trace context (the relay
/// makes its delivery span in the event's stored trace).
async fn traced_event(db: &tokio_postgres::Client) -> anyhow::Result<()> {
    let (event, order) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let trace = uuid::Uuid::new_v4().simple().to_string();
    db.batch_execute(&format!(
        "BEGIN; \
         INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 250, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload, trace_context) \
           VALUES ('{event}', '{order}', 'OrderCreated', '{{}}', '00-{trace}-b7ad6b7169203331-01'); \
         COMMIT"
    ))
    .await
    .context("a traced outbox row")?;
    Ok(())
}
