//! `cdc-relay run` before it streams: bad configuration exits 2 naming the
//! setting, a missing slot or a table that would skip events is named,
//! `--create-slot`, `version` and completions, and SIGTERM with a closed
//! stderr.

use std::time::Duration;

use anyhow::Context;

use harness::PgCluster;
use harness::app::{self, TEST_SECRET};
use harness::sink::ScriptedSink;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_slot_exits_naming_setup() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let sink = ScriptedSink::start().await?;
    let out = app::relay_command(
        &stack,
        &stack.relay_url,
        &[
            "run",
            "--sink-url",
            &sink.url,
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(out.text().contains("cdc-relay setup"), "{}", out.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_exits_non_zero_naming_the_setting() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let run = |extra: &'static [&'static str], env: &'static [(&'static str, &'static str)]| {
        let stack = stack.clone();
        async move { app::refused_run(&stack, &stack.relay_url, extra, env).await }
    };
    // Every configuration error exits 2, as a command line clap refuses.
    let no_secret = run(&[], &[]).await?;
    assert_eq!(no_secret.code(), Some(2), "{}", no_secret.text());
    assert!(
        no_secret.text().contains("EVENT_SECRET"),
        "{}",
        no_secret.text()
    );

    let timeouts = run(
        &["--request-timeout", "30s"],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(timeouts.code(), Some(2), "{}", timeouts.text());
    assert!(
        timeouts.text().contains("--shutdown-timeout"),
        "{}",
        timeouts.text()
    );

    // An empty file setting from the environment (an env file's `X=`) is
    // named by its variable (clap named only the flag, never given).
    let empty_file = run(
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_DATABASE_PASSWORD_FILE", ""),
        ],
    )
    .await?;
    assert_eq!(empty_file.code(), Some(2), "{}", empty_file.text());
    assert!(
        empty_file
            .text()
            .contains("CDC_RELAY_DATABASE_PASSWORD_FILE is set but empty"),
        "{}",
        empty_file.text()
    );

    // A bad value from the environment is named by its variable too.
    let from_env = run(
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_MAX_IN_FLIGHT", "lots"),
        ],
    )
    .await?;
    assert_eq!(from_env.code(), Some(2), "{}", from_env.text());
    assert!(
        from_env.text().contains(
            "the environment variable CDC_RELAY_MAX_IN_FLIGHT (--max-in-flight was not given)"
        ),
        "{}",
        from_env.text()
    );

    let bad_size = run(
        &["--max-pending-bytes", "lots"],
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await?;
    assert_eq!(bad_size.code(), Some(2));
    assert!(
        bad_size.text().contains("--max-pending-bytes"),
        "{}",
        bad_size.text()
    );

    // A sink URL from the environment is named by its variable: set but
    // empty, and in conflict with --routes (clap named two flags, one
    // never typed).
    let listen = ["run", "--admin-listen", "127.0.0.1:0"];
    let empty = app::relay_command(
        &stack,
        &stack.relay_url,
        &listen,
        &[("EVENT_SECRET", TEST_SECRET), ("CDC_RELAY_SINK_URL", "")],
    )
    .await?;
    assert_eq!(empty.code(), Some(2), "{}", empty.text());
    assert!(
        empty.text().contains(
            "CDC_RELAY_SINK_URL is set but empty: unset it, or give it a value (--sink-url)"
        ),
        "{}",
        empty.text()
    );
    let conflict = app::relay_command(
        &stack,
        &stack.relay_url,
        &[
            "run",
            "--routes",
            "/nonexistent/routes.toml",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_SINK_URL", "http://127.0.0.1:9/inbox"),
        ],
    )
    .await?;
    assert_eq!(conflict.code(), Some(2), "{}", conflict.text());
    assert!(
        conflict.text().contains(
            "--routes cannot be used with --sink-url (from the environment variable CDC_RELAY_SINK_URL): unset CDC_RELAY_SINK_URL"
        ),
        "{}",
        conflict.text()
    );

    // A setting checked after parsing names the variable its value came
    // from, never the value (it may be a secret).
    let from_env = run(
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_REQUEST_TIMEOUT", "30s"),
        ],
    )
    .await?;
    assert_eq!(from_env.code(), Some(2), "{}", from_env.text());
    assert!(
        from_env.text().contains(
            "note: --request-timeout came from the environment variable CDC_RELAY_REQUEST_TIMEOUT"
        ),
        "{}",
        from_env.text()
    );

    // A sink URL with port 0 (nothing listens there) is refused by `run`
    // and by a replay, before it connects to any database.
    let env = [("EVENT_SECRET", TEST_SECRET)];
    let zero_port = "http://127.0.0.1:0/inbox";
    for (url, args) in [
        (
            stack.relay_url.as_str(),
            vec![
                "run",
                "--sink-url",
                zero_port,
                "--admin-listen",
                "127.0.0.1:0",
            ],
        ),
        (
            "postgres://nobody@127.0.0.1:9/none",
            vec!["dead-letter", "replay", "--sink-url", zero_port, "--all"],
        ),
    ] {
        let out = app::relay_command(&stack, url, &args, &env).await?;
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.text());
        assert!(
            out.text()
                .contains("for '--sink-url <SINK_URL>': has port 0"),
            "{args:?}: {}",
            out.text()
        );
    }

    // Durations that would make the relay spin or lie are refused: a
    // retention flag's even while retention is off (it was accepted and
    // ignored without --prune-older-than), a zero reconnect cap (about 750
    // connection attempts a second against a down server), a zero readiness
    // window; and every other duration with a floor.
    for flag in [
        "--prune-interval",
        "--reconnect-max",
        "--ready-window",
        "--slot-stats-interval",
        "--probe-interval",
        "--retired-probe-interval",
        "--sink-connection-max-age",
        "--sink-idle-timeout",
    ] {
        let zero = app::refused_run(
            &stack,
            &stack.relay_url,
            &[flag, "0s"],
            &[("EVENT_SECRET", TEST_SECRET)],
        )
        .await?;
        assert_eq!(zero.code(), Some(2), "{flag}: {}", zero.text());
        assert!(
            zero.text().contains(&format!("{flag} must be at least")),
            "{}",
            zero.text()
        );
    }

    // `status --json` that cannot answer still prints an object for a
    // script: the error and the exit code. (It printed nothing on stdout.)
    let mut closed = reqwest::Url::parse(&stack.relay_url)?;
    closed
        .set_port(Some(1))
        .map_err(|()| anyhow::anyhow!("a port"))?;
    let unreachable = app::relay_command(
        &stack,
        closed.as_str(),
        &["status", "--json", "--connect-timeout", "1s"],
        &[],
    )
    .await?;
    let object: serde_json::Value = serde_json::from_str(&unreachable.stdout)
        .map_err(|e| anyhow::anyhow!("{e}: {}", unreachable.text()))?;
    assert_eq!(object["healthy"], false, "{}", unreachable.text());
    assert_eq!(
        object["exit_code"].as_i64(),
        unreachable.code().map(i64::from),
        "{}",
        unreachable.text()
    );
    assert!(
        object["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{}",
        unreachable.text()
    );

    let wrong_password = app::refused_run(
        &stack,
        &stack.relay_url,
        &[],
        &[
            ("EVENT_SECRET", TEST_SECRET),
            ("CDC_RELAY_DATABASE_PASSWORD", "wrong"),
        ],
    )
    .await?;
    assert_eq!(wrong_password.code(), Some(1), "{}", wrong_password.text());
    assert!(
        wrong_password
            .text()
            .contains("password authentication failed"),
        "{}",
        wrong_password.text()
    );
    assert!(
        !wrong_password.text().contains("wrong"),
        "the password is never printed"
    );
    assert!(
        wrong_password.text().contains("pg_hba.conf")
            && wrong_password
                .text()
                .contains("CDC_RELAY_DATABASE_PASSWORD"),
        "an authentication failure names the settings to check: {}",
        wrong_password.text()
    );

    // Connect errors found on the client's side are as definite as a
    // refused password: each exits 1 at once (a retry loop would hide
    // them) and names what to change.
    let (scheme, rest) = stack.relay_url.split_once("://").expect("a URL");
    let (userinfo, host) = rest.split_once('@').expect("a URL with a user");
    let user = userinfo.split(':').next().unwrap_or_default();
    let no_password = format!("{scheme}://{user}@{host}");
    let tls_required = format!("{}?sslmode=require", stack.relay_url);
    let password_file = tempfile::NamedTempFile::new()?;
    std::fs::write(password_file.path(), "secret\n")?;
    let password_file = password_file.path().to_string_lossy().into_owned();
    for (db_url, env, names, code) in [
        (
            no_password.as_str(),
            vec![],
            "CDC_RELAY_DATABASE_PASSWORD_FILE",
            1,
        ),
        (tls_required.as_str(), vec![], "sslmode=disable", 1),
        (
            stack.relay_url.as_str(),
            vec![
                ("CDC_RELAY_DATABASE_PASSWORD", "secret"),
                ("CDC_RELAY_DATABASE_PASSWORD_FILE", password_file.as_str()),
            ],
            "are both set",
            2,
        ),
    ] {
        let mut env = env;
        env.push(("EVENT_SECRET", TEST_SECRET));
        let started = std::time::Instant::now();
        let out = app::refused_run(&stack, db_url, &[], &env).await?;
        assert_eq!(out.code(), Some(code), "{db_url}: {}", out.text());
        assert!(out.text().contains(names), "{db_url}: {}", out.text());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{db_url}: a definite error is not retried ({:?}): {}",
            started.elapsed(),
            out.text()
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_slot_flag_creates_a_missing_slot_and_streams() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let sink = ScriptedSink::start().await?;
    let relay = app::start_relay(&stack, &sink.url, &["--create-slot"]).await?;
    app::wait_streaming(&relay).await?;
    assert!(relay.process.logs().contains("created the missing slot"));
    let db = stack.orders_admin().await?;
    let order = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, 1, 'EUR')",
        &[&order],
    )
    .await?;
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), $1, 'T', '{}')",
        &[&order],
    )
    .await?;
    harness::wait_until("the event delivered", Duration::from_secs(20), || async {
        sink.delivered().len() == 1
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// Each needs `setup` or a flag fixed, not a restart: exit 3, which the
/// shipped unit does not restart.
async fn run_refuses_a_table_or_publication_that_would_skip_events() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let base = [
        "run",
        "--sink-url",
        &sink.url,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    let env = [("EVENT_SECRET", TEST_SECRET)];
    let mut wrong_table = base.to_vec();
    wrong_table.extend(["--table", "public.nope"]);
    let out = app::relay_command(&stack, &stack.relay_url, &wrong_table, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(out.text().contains("--table"), "{}", out.text());

    // A real table the publication does not carry.
    let db = stack.orders_admin().await?;
    db.batch_execute("CREATE TABLE other_outbox (LIKE outbox)")
        .await?;
    let mut unpublished = base.to_vec();
    unpublished.extend(["--table", "public.other_outbox"]);
    let out = app::relay_command(&stack, &stack.relay_url, &unpublished, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text()
            .contains("publishes inserts into public.other_outbox"),
        "{}",
        out.text()
    );

    let mut wrong_publication = base.to_vec();
    wrong_publication.extend(["--publication", "nope"]);
    let out = app::relay_command(&stack, &stack.relay_url, &wrong_publication, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text()
            .contains("\"nope\" does not exist (--publication / CDC_RELAY_PUBLICATION)"),
        "{}",
        out.text()
    );

    // The same mistakes in a hot standby beside a streaming relay are
    // refused at its start, not first at the takeover it stands by for.
    // (It logged "waiting as hot standby", stayed healthy, and exited 3
    // only when the active relay died.)
    let active = app::start_relay(&stack, &sink.url, &[]).await?;
    app::wait_streaming(&active).await?;
    let mut wrong_column = base.to_vec();
    wrong_column.extend(["--id-column", "nosuchcol"]);
    for (args, named) in [
        (&wrong_table, "--table"),
        (&wrong_publication, "--publication"),
        (&wrong_column, "nosuchcol"),
    ] {
        let out = app::relay_command(&stack, &stack.relay_url, args, &env).await?;
        assert_eq!(out.code(), Some(3), "{args:?}: {}", out.text());
        assert!(
            out.text().contains(named) && !out.text().contains("waiting as hot standby"),
            "{args:?}: {}",
            out.text()
        );
    }
    // A standby set up for another valid table, with its own publication:
    // the slot's progress record names the table the active relay
    // streams. (Broken before: it stood by as healthy, and at the takeover
    // confirmed the slot past every event of the real outbox.)
    db.batch_execute(
        "CREATE PUBLICATION other_pub FOR TABLE other_outbox; \
         GRANT SELECT ON other_outbox TO cdc_relay",
    )
    .await?;
    harness::wait_until(
        "the active relay's membership recorded",
        Duration::from_secs(40),
        || async {
            let oid: Option<u32> = db
                .query_opt(
                    "SELECT membership_table_oid FROM cdc_relay_progress WHERE slot_name = $1",
                    &[&stack.slot],
                )
                .await?
                .and_then(|r| r.get(0));
            anyhow::Ok(oid.is_some())
        },
    )
    .await?;
    let mut other = base.to_vec();
    other.extend([
        "--table",
        "public.other_outbox",
        "--publication",
        "other_pub",
    ]);
    let out = app::relay_command(&stack, &stack.relay_url, &other, &env).await?;
    assert_eq!(out.code(), Some(3), "{}", out.text());
    assert!(
        out.text().contains("streams the outbox public.outbox"),
        "{}",
        out.text()
    );
    drop(active);
    Ok(())
}

/// `--version` names the commit the binary was built from (the one checked
/// out: cargo rebuilds when HEAD moves), and `completions` prints a script
/// the shell accepts that knows the subcommands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_names_the_commit_and_completions_are_valid_shell() -> anyhow::Result<()> {
    let relay = harness::bins::path("cdc-relay");
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(&repo)
        .output()?;
    anyhow::ensure!(head.status.success(), "git rev-parse HEAD in {repo:?}");
    let head = String::from_utf8(head.stdout)?.trim().to_owned();
    let version = std::process::Command::new(&relay)
        .arg("--version")
        .output()?;
    let version = String::from_utf8(version.stdout)?;
    assert!(
        version.starts_with("cdc-relay ") && version.trim_end().ends_with(&format!(" ({head})")),
        "--version names HEAD {head}: {version}"
    );

    let script = std::process::Command::new(&relay)
        .args(["completions", "bash"])
        .output()?;
    assert!(script.status.success());
    let script = String::from_utf8(script.stdout)?;
    for word in ["setup", "status", "backfill", "dead-letter", "--sink-url"] {
        assert!(script.contains(word), "the bash completion knows {word}");
    }
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), &script)?;
    let check = std::process::Command::new("bash")
        .arg("-n")
        .arg(file.path())
        .output()?;
    assert!(
        check.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    Ok(())
}

/// A relay whose stderr lost its reader (a pipe closed after a journald
/// restart, `… 2>&1 | head`) still stops on SIGTERM: a log line it cannot
/// write is dropped, not reported by a panic that would take the signal
/// watcher down with it (the process then ignored every signal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_a_closed_stderr_still_stops_on_sigterm() -> anyhow::Result<()> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let stack = PgCluster::shared().create_stack().await?;
    app::relay_setup(&stack).await?;
    let sink = ScriptedSink::start().await?;
    let mut child = Command::new(harness::bins::path("cdc-relay"))
        .args(app::relay_globals(&stack))
        .args([
            "run",
            "--sink-url",
            &sink.url,
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("CDC_RELAY_DATABASE_URL", &stack.relay_url)
        .env("CDC_RELAY_LOG", "info,cdc_relay=debug")
        .env("EVENT_SECRET", TEST_SECRET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stderr.take()); // the reader goes away
    let stdout = child.stdout.take().expect("piped");
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .map(|_| line)
    })
    .await??;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    let outcome = async {
        let admin = first
            .split_whitespace()
            .last()
            .filter(|u| u.starts_with("http://"))
            .with_context(|| format!("a listening line, got {first:?}"))?
            .to_owned();
        let http = reqwest::Client::new();
        harness::wait_until("/readyz 200", Duration::from_secs(30), || async {
            let r = http.get(format!("{admin}/readyz")).send().await?;
            anyhow::Ok(r.status() == 200)
        })
        .await?;
        // Something to log (debug lines per delivery), then the signal.
        let db = stack.orders_admin().await?;
        app::insert_order_event(&db).await?;
        harness::wait_until("the event delivered", Duration::from_secs(30), || async {
            anyhow::Ok(sink.arrivals() >= 1)
        })
        .await?;
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = child.try_wait()? {
                return anyhow::Ok(status);
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "still running 15 s after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    .await;
    if outcome.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let status = outcome?;
    assert_eq!(status.code(), Some(0), "a clean stop");
    Ok(())
}
