//! Secrets an operator puts in a sink URL (a `user:password@` and a query
//! token) reach the sink and no output surface: logs in both formats,
//! `/metrics`, `/healthz`, `/readyz`, `status` in both formats, `routes
//! check`, `dead-letter list`, error messages, dead-letter and progress
//! rows, and the relay's `application_name`.
//!
//! Fails on `cb3ea2e` (before issue 30): `routes check` printed the
//! endpoint's URL with its `user:password@`, and the startup log line (text
//! and JSON) carried the query token (the two leaks issue 30 reported).

use std::time::Duration;

use base64::Engine as _;
use harness::app::{self, CommandOutput, Running, TEST_SECRET};
use harness::sink::ScriptedSink;
use harness::{PgCluster, Stack};

const WAIT: Duration = Duration::from_secs(30);

/// The planted secrets and the sink URL that carries them.
struct Planted {
    password: String,
    token: String,
}

impl Planted {
    fn new() -> Planted {
        Planted {
            password: format!("pw-{}", uuid::Uuid::new_v4().simple()),
            token: format!("tok-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// `base` (`http://host:port/path`) with the user `relay`, the password
    /// and `?v=2&token=…`.
    fn url(&self, base: &str) -> String {
        let rest = base.strip_prefix("http://").expect("an http:// URL");
        format!(
            "http://relay:{}@{rest}?v=2&token={}",
            self.password, self.token
        )
    }

    /// The output of `surface` holds neither secret, nor the Basic token
    /// made of the password.
    fn assert_absent(&self, surface: &str, text: &str) {
        let basic =
            base64::engine::general_purpose::STANDARD.encode(format!("relay:{}", self.password));
        for needle in [&self.password, &self.token, &basic] {
            assert!(
                !text.contains(needle.as_str()),
                "{surface} shows {needle:?}:\n{text}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_and_token_in_a_sink_url_appear_on_no_output_surface() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let planted = Planted::new();
    let secret_url = planted.url(&sink.url);
    let mut outputs: Vec<(String, String)> = Vec::new();

    // A relay logging text at debug: one event delivered, one dead-lettered.
    // Its stream goes by --replication-url, which carries the relay role's
    // database password.
    let relay = app::start_relay(
        &stack,
        &secret_url,
        &["--log", "debug", "--replication-url", &stack.relay_url],
    )
    .await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let poison = uuid::Uuid::new_v4();
    // A sink's error page may echo the request's URL and Authorization
    // header: the excerpt the relay logs and stores must not carry them.
    // (It did: the log line, the dead-letter row and replay's output.)
    let basic =
        base64::engine::general_purpose::STANDARD.encode(format!("relay:{}", planted.password));
    sink.reject_with_body(
        &poison.to_string(),
        422,
        format!(
            "refused /inbox?v=2&token={} with auth Basic {basic} (password {})",
            planted.token, planted.password
        ),
    );
    app::insert_order_event_with_id(&db, poison).await?;
    let delivered = app::insert_order_event(&db).await?;
    harness::wait_until(
        "one event delivered, one dead-lettered, the progress row written",
        WAIT,
        || async {
            let dead: i64 = db
                .query_one("SELECT count(*) FROM cdc_relay_dead_letter", &[])
                .await?
                .get(0);
            let progress: i64 = db
                .query_one(
                    "SELECT count(*) FROM cdc_relay_progress WHERE slot_name = $1",
                    &[&stack.slot],
                )
                .await?
                .get(0);
            let done = sink
                .delivered()
                .iter()
                .any(|r| r.id() == delivered.to_string());
            Ok::<_, anyhow::Error>(done && dead == 1 && progress == 1)
        },
    )
    .await?;
    // The secrets are really in use: the sink got them.
    let request = sink.delivered().pop().expect("a delivered request");
    assert_eq!(request.authorization, Some(format!("Basic {basic}")));
    assert!(
        request
            .target
            .ends_with(&format!("token={}", planted.token)),
        "{}",
        request.target
    );

    outputs.extend(admin_surfaces(&relay).await?);
    outputs.extend(database_surfaces(&stack, &db).await?);
    let admin = ["--admin-url", relay.url.as_str()];
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["dead-letter", "list"],
    ] {
        let out = command(&stack, &[args, &admin[..]].concat(), &[]).await?;
        outputs.push((format!("cdc-relay {args:?}"), out.text()));
    }
    let mut relay = relay;
    relay.process.sigterm();
    relay.process.wait_exit(WAIT).await?;
    outputs.push(("run (text logs)".into(), relay.process.logs()));

    // A relay logging JSON, delivering to a port where nothing listens: its
    // connection errors, retried, are logged too.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}/inbox", listener.local_addr()?)
    };
    let mut relay = app::start_relay(
        &stack,
        &planted.url(&closed),
        &["--log", "debug", "--log-format", "json"],
    )
    .await?;
    let undelivered = app::insert_order_event(&db).await?;
    harness::wait_until("the relay to retry the unreachable sink", WAIT, || async {
        let m = relay.metrics().await?;
        Ok::<_, anyhow::Error>(m.sum("cdc_relay_endpoint_retries_total") >= 2.0)
    })
    .await?;
    outputs.extend(admin_surfaces(&relay).await?);
    relay.process.sigterm();
    relay.process.wait_exit(WAIT).await?;
    let logs = relay.process.logs();
    assert!(
        logs.contains(&undelivered.to_string()) && logs.contains("\"level\""),
        "the JSON relay logged its retries (so this test reads real logs)\n{logs}"
    );
    outputs.push(("run (JSON logs)".into(), logs));

    outputs.extend(routes_check(&stack, &planted, &sink.url).await?);
    outputs.extend(refused_values(&stack, &planted).await?);

    let db_password = reqwest::Url::parse(&stack.relay_url)?
        .password()
        .unwrap_or_default()
        .to_owned();
    anyhow::ensure!(
        !db_password.is_empty(),
        "the relay role's URL has a password"
    );
    for (surface, text) in &outputs {
        planted.assert_absent(surface, text);
        assert!(
            !text.contains(&db_password),
            "{surface} shows the database password of --replication-url:\n{text}"
        );
    }
    // The surfaces were read: each names what it is about.
    let all: String = outputs.iter().map(|(_, t)| t.as_str()).collect();
    for seen in [
        "cdc_relay_events_delivered_total",
        "***@127.0.0.1",
        "token=***",
        &poison.to_string(),
    ] {
        assert!(all.contains(seen), "no surface shows {seen:?}");
    }
    Ok(())
}

/// `/metrics`, `/healthz` and `/readyz` of `relay`.
async fn admin_surfaces(relay: &Running) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (_, body) = relay.get(path).await?;
        out.push((path.to_owned(), body));
    }
    Ok(out)
}

/// Every dead-letter and progress row as JSON, and the `application_name`
/// of every session.
async fn database_surfaces(
    stack: &Stack,
    db: &tokio_postgres::Client,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (surface, sql) in [
        (
            "dead-letter rows",
            "SELECT coalesce(string_agg(row_to_json(d)::text, E'\\n'), '') FROM cdc_relay_dead_letter d",
        ),
        (
            "progress rows",
            "SELECT coalesce(string_agg(row_to_json(p)::text, E'\\n'), '') FROM cdc_relay_progress p",
        ),
        (
            "application_name",
            "SELECT coalesce(string_agg(application_name, E'\\n'), '') FROM pg_stat_activity",
        ),
    ] {
        let text: String = db.query_one(sql, &[]).await?.get(0);
        out.push((format!("{surface} ({})", stack.slot), text));
    }
    Ok(out)
}

/// `routes check` of a file whose endpoint URL carries the secrets, and of
/// one whose URL carrying them is not a URL.
async fn routes_check(
    stack: &Stack,
    planted: &Planted,
    sink: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let dir = tempfile::tempdir()?;
    let endpoint = |url: &str| {
        format!(
            "[[endpoint]]\nname = \"billing\"\nurl = {url:?}\nevent_types = [\"*\"]\nsecret_env = \"BILLING_SECRET\"\n"
        )
    };
    let good = dir.path().join("routes.toml");
    std::fs::write(&good, endpoint(&planted.url(sink)))?;
    // An empty host: not a URL, quoted by the error.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        endpoint(&format!(
            "http://relay:{}@/inbox?token={}",
            planted.password, planted.token
        )),
    )?;
    // A typo in the scheme (no `://`), and a string left open: the TOML
    // parser's message quoted the whole line.
    let typo = dir.path().join("typo.toml");
    std::fs::write(
        &typo,
        endpoint(&format!(
            "http//relay:{}@h/x?token={}",
            planted.password, planted.token
        )),
    )?;
    let open = dir.path().join("open.toml");
    std::fs::write(
        &open,
        format!(
            "[[endpoint]]\nname = \"billing\"\nurl = \"{}\nevent_types = [\"*\"]\n",
            planted.url(sink)
        ),
    )?;
    let env = [("BILLING_SECRET", TEST_SECRET)];
    let mut out = Vec::new();
    for (file, ok) in [(&good, true), (&bad, false), (&typo, false), (&open, false)] {
        let file = file.to_str().expect("a UTF-8 path");
        let check = command(stack, &["routes", "check", file], &env).await?;
        assert_eq!(check.success(), ok, "routes check {file}: {}", check.text());
        out.push((format!("routes check {file}"), check.text()));
    }
    Ok(out)
}

/// The messages that refuse a value carrying the secrets: `--sink-url`
/// from the flag and the environment, and `--admin-url`.
async fn refused_values(stack: &Stack, planted: &Planted) -> anyhow::Result<Vec<(String, String)>> {
    let empty_host = format!(
        "http://relay:{}@/inbox?token={}",
        planted.password, planted.token
    );
    let bad_port = planted.url("http://127.0.0.1:99999/inbox");
    let not_http = format!(
        "ftp://relay:{}@h/?token={}",
        planted.password, planted.token
    );
    // One slash missing: no `scheme://` for the display to find.
    let one_slash = format!(
        "http:/relay:{}@127.0.0.1:9/inbox?token={}",
        planted.password, planted.token
    );
    let mut out = Vec::new();
    for (args, env) in [
        (vec!["run", "--sink-url", empty_host.as_str()], vec![]),
        (vec!["run"], vec![("CDC_RELAY_SINK_URL", bad_port.as_str())]),
        (vec!["status", "--admin-url", not_http.as_str()], vec![]),
        (vec!["run", "--sink-url", one_slash.as_str()], vec![]),
        (vec!["status", "--admin-url", one_slash.as_str()], vec![]),
        (
            vec![
                "run",
                "--sink-url",
                "http://127.0.0.1:9/inbox",
                "--otlp-endpoint",
                not_http.as_str(),
            ],
            vec![],
        ),
    ] {
        let refused = command(stack, &args, &env).await?;
        assert_eq!(refused.code(), Some(2), "{args:?}: {}", refused.text());
        out.push((format!("cdc-relay {}", args[0]), refused.text()));
    }
    Ok(out)
}

/// `cdc-relay <args>` as the relay role, with `env`.
async fn command(
    stack: &Stack,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<CommandOutput> {
    app::relay_command(stack, &stack.relay_url, args, env).await
}
