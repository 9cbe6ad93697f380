//! The application stack on top of a [`Stack`]: the Orders, Billing and
//! relay binaries as real processes, `cdc-relay` as a CLI command (`command`), and the
//! relay's sessions as its log reports them. What the tests judge the
//! outcome by is in [`oracle`](crate::oracle).
//!
//! Every system test, the demo and the benchmarks start processes and run
//! commands through here, so flags and credentials live in one place.

use std::time::Duration;

use anyhow::Context;

mod command;
pub use command::{CommandOutput, refused_run, relay_command, relay_command_peak_rss};

use crate::process::ServiceProcess;
use crate::prom::{self, Exposition};
use crate::stack::Stack;
use crate::{bins, wait_until};

/// The event secret every test process shares: a plain secret (its bytes
/// are the key) of at least 32 bytes, the floor both the relay and Billing
/// enforce.
pub const TEST_SECRET: &str = "test-secret-4f1c2a-0d9e7b3c5a1f8e62";

/// The secret settings; a started relay gets only the ones a test gives.
const SECRET_VARS: [&str; 4] = [
    "EVENT_SECRET",
    "EVENT_SECRET_FILE",
    "EVENT_SECRET_PREVIOUS",
    "EVENT_SECRET_PREVIOUS_FILE",
];

/// How long a process may take to print its `listening on` line.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running service with its base URL.
pub struct Running {
    /// The process.
    pub process: ServiceProcess,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Where its `/metrics` are: Orders' and Billing's admin listener, the
    /// relay's (only) admin endpoint (then the same as `url`).
    pub admin_url: String,
}

impl Running {
    /// `cdc-relay status --admin-url <this relay>` against `stack`'s
    /// database, as the relay's role.
    pub async fn status(&self, stack: &Stack) -> anyhow::Result<CommandOutput> {
        relay_command(
            stack,
            &stack.relay_url,
            &["status", "--admin-url", &self.url],
            &[],
        )
        .await
    }

    /// A relay (or any process with one listener) at `url`.
    pub fn single(process: ServiceProcess, url: String) -> Running {
        Running {
            process,
            admin_url: url.clone(),
            url,
        }
    }

    /// Orders or Billing: `url`, and the admin URL it printed.
    pub async fn service(process: ServiceProcess, url: String) -> anyhow::Result<Running> {
        let admin_url = process.admin_addr(START_TIMEOUT).await?;
        Ok(Running {
            process,
            url,
            admin_url,
        })
    }

    /// Its `/metrics`, parsed strictly.
    pub async fn metrics(&self) -> anyhow::Result<Exposition> {
        prom::scrape(&reqwest::Client::new(), &self.admin_url).await
    }

    /// Billing's inbox: `<url>/inbox`.
    pub fn inbox(&self) -> String {
        format!("{}/inbox", self.url)
    }

    /// `GET <url><path>` (e.g. `/readyz`): the status and the body.
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let response = reqwest::get(format!("{}{path}", self.url)).await?;
        Ok((response.status().as_u16(), response.text().await?))
    }

    /// The value of the unlabelled series `name` in its `/metrics`, if
    /// exposed.
    pub async fn gauge(&self, name: &str) -> anyhow::Result<Option<f64>> {
        Ok(self.metrics().await?.value(name, &[]))
    }
}

/// Starts the Orders service for `stack` on a free port.
pub async fn start_orders(stack: &Stack) -> anyhow::Result<Running> {
    start_orders_with(stack, &[], &[]).await
}

/// Starts the Orders service for `stack` on a free port with extra `args`
/// and environment `env`.
pub async fn start_orders_with(
    stack: &Stack,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<Running> {
    start_service(
        "orders",
        ("ORDERS_DATABASE_URL", &stack.orders_app_url),
        args,
        env,
    )
    .await
}

/// Starts the Billing service for `stack` on a free port, accepting
/// `secret` (`EVENT_SECRET`).
pub async fn start_billing(stack: &Stack, secret: &str) -> anyhow::Result<Running> {
    start_billing_with(stack, &[], &[("EVENT_SECRET", secret)]).await
}

/// Starts the Billing service for `stack` on a free port with extra `args`
/// and environment `env` (its secrets among them).
pub async fn start_billing_with(
    stack: &Stack,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<Running> {
    start_service(
        "billing",
        ("BILLING_DATABASE_URL", &stack.billing_app_url),
        args,
        env,
    )
    .await
}

/// Starts the Payments service over `payments` on a free port with extra
/// `args` (its test hooks, `--idempotency-key-ttl`, ...).
pub async fn start_payments(
    payments: &crate::stack::PaymentsDb,
    args: &[&str],
) -> anyhow::Result<Running> {
    start_service(
        "payments",
        ("PAYMENTS_DATABASE_URL", &payments.app_url),
        args,
        &[],
    )
    .await
}

/// Billing's flags that charge each invoice at `payments_url` (a provider
/// base URL), polling for due invoices every 200 ms and backing off at most
/// 1 s, so that tests and chaos runs drain fast; `args` follow.
pub fn charging_args<'a>(payments_url: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec![
        "--payments-url",
        payments_url,
        "--charge-poll-interval",
        "200ms",
        "--charge-backoff-max",
        "1s",
        "--charge-timeout",
        "3s",
    ];
    all.extend_from_slice(args);
    all
}

/// Starts service binary `bin` on a free port with its database URL
/// variable `db`, extra `args` and environment `env`; returns once it listens.
async fn start_service(
    bin: &str,
    db: (&str, &str),
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<Running> {
    let mut argv = vec!["--listen", "127.0.0.1:0"];
    argv.extend_from_slice(args);
    let mut envs = vec![db, ("RUST_LOG", "warn")];
    envs.extend_from_slice(env);
    let process = ServiceProcess::spawn(bins::path(bin), &argv, &envs)?;
    let url = process.listen_addr(START_TIMEOUT).await?;
    Running::service(process, url).await
}

/// The relay's command-line arguments shared by every command for `stack`.
pub fn relay_globals(stack: &Stack) -> Vec<String> {
    vec![
        "--slot".into(),
        stack.slot.clone(),
        "--publication".into(),
        stack.publication.clone(),
    ]
}

/// Runs `cdc-relay setup` as the superuser (it creates the slot) and returns
/// its stdout.
pub async fn relay_setup(stack: &Stack) -> anyhow::Result<String> {
    let out = relay_command(stack, &stack.orders_admin_url, &["setup"], &[]).await?;
    anyhow::ensure!(
        out.success(),
        "cdc-relay setup failed ({}):\n{}",
        out.status,
        out.text()
    );
    Ok(out.stdout)
}

/// Starts `cdc-relay run` as the relay role (LOGIN REPLICATION, no
/// superuser) delivering to `sink_url`, with extra `args` after `run`.
/// Returns once its admin endpoint listens (streaming may start later).
pub async fn start_relay(stack: &Stack, sink_url: &str, args: &[&str]) -> anyhow::Result<Running> {
    start_relay_with_url(stack, &stack.relay_url, sink_url, args).await
}

/// Waits until the relay reports it streams from the slot.
pub async fn wait_streaming(relay: &Running) -> anyhow::Result<()> {
    relay
        .process
        .wait_for_line_where(
            "the relay's `streaming slot=...` line",
            is_session_start,
            START_TIMEOUT,
        )
        .await
        .map(|_| ())
}

/// Whether `line` is the relay's log line for a replication session that
/// started streaming: the message `streaming` with its `slot=` field. Matched
/// on message and field, not on the module path, which may move.
pub fn is_session_start(line: &str) -> bool {
    let mut words = line.split_whitespace();
    words.clone().any(|w| w == "streaming") && words.any(|w| w.starts_with("slot="))
}

/// Replication sessions `relay` started so far (its `streaming` log lines).
pub fn sessions(relay: &Running) -> usize {
    relay
        .process
        .logs()
        .lines()
        .filter(|l| is_session_start(l))
        .count()
}

/// Waits (up to `timeout`) until `relay` started a session after the first `before`.
pub async fn wait_new_session(
    relay: &Running,
    before: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    wait_until("the relay to stream again", timeout, || async {
        sessions(relay) > before
    })
    .await
}

/// Posts one order through the Orders API; returns `(order_id, event_id)`.
pub async fn post_order(
    http: &reqwest::Client,
    orders: &str,
    amount_cents: i64,
) -> anyhow::Result<(String, String)> {
    let resp = http
        .post(format!("{orders}/orders"))
        .json(&serde_json::json!({"amount_cents": amount_cents, "currency": "EUR"}))
        .send()
        .await?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await?;
    anyhow::ensure!(status.as_u16() == 201, "POST /orders: {status} {body}");
    let field = |k: &str| {
        body[k]
            .as_str()
            .map(str::to_owned)
            .context("missing id in response")
    };
    Ok((field("order_id")?, field("event_id")?))
}

/// Posts one order as a careful client does under load: with an
/// `Idempotency-Key`, and again with the same key after a 503's
/// `Retry-After` (Orders' answer when its database pool stays busy past
/// its wait) or after a connection the server closed under it (a kept-alive
/// one it closed as idle to make room, as servers may), at most `attempts`
/// times; returns `(order_id, event_id)`.
pub async fn post_order_retrying(
    http: &reqwest::Client,
    orders: &str,
    amount_cents: i64,
    attempts: u32,
) -> anyhow::Result<(String, String)> {
    let key = uuid::Uuid::new_v4().to_string();
    for attempt in 1.. {
        let resp = match http
            .post(format!("{orders}/orders"))
            .header("idempotency-key", &key)
            .json(&serde_json::json!({"amount_cents": amount_cents, "currency": "EUR"}))
            .send()
            .await
        {
            Err(e) if e.is_request() && attempt < attempts => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            sent => sent?,
        };
        let status = resp.status();
        if status.as_u16() == 503 && attempt < attempts {
            let wait = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .unwrap_or(1);
            tokio::time::sleep(Duration::from_secs(wait)).await;
            continue;
        }
        let body: serde_json::Value = resp.json().await?;
        anyhow::ensure!(
            status.as_u16() == 201,
            "POST /orders (attempt {attempt}): {status} {body}"
        );
        let field = |k: &str| {
            body[k]
                .as_str()
                .map(str::to_owned)
                .context("missing id in response")
        };
        return Ok((field("order_id")?, field("event_id")?));
    }
    unreachable!("the loop returns")
}

/// [`start_relay`] with the relay's database URL given: e.g. `stack.relay_url`
/// rewritten by [`proxied`] to pass through a fault-injecting proxy.
pub async fn start_relay_with_url(
    stack: &Stack,
    db_url: &str,
    sink_url: &str,
    args: &[&str],
) -> anyhow::Result<Running> {
    start_relay_with_env(
        stack,
        db_url,
        sink_url,
        args,
        &[("EVENT_SECRET", TEST_SECRET)],
    )
    .await
}

/// [`start_relay_with_url`] with the secret settings given in `secrets`
/// (`EVENT_SECRET`, `EVENT_SECRET_FILE`, `EVENT_SECRET_PREVIOUS`, ...)
/// instead of [`TEST_SECRET`].
pub async fn start_relay_with_env(
    stack: &Stack,
    db_url: &str,
    sink_url: &str,
    args: &[&str],
    secrets: &[(&str, &str)],
) -> anyhow::Result<Running> {
    spawn_run(stack, db_url, &["--sink-url", sink_url], args, secrets).await
}

/// Starts `cdc-relay run --routes FILE <args>` against the stack as the
/// relay role, with `env` (the endpoints' secret variables) and no
/// `EVENT_SECRET*`.
pub async fn start_relay_with_routes(
    stack: &Stack,
    routes: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<Running> {
    let routes = routes.to_str().context("a UTF-8 routes file path")?;
    spawn_run(stack, &stack.relay_url, &["--routes", routes], args, env).await
}

/// `cdc-relay run <target> --admin-listen 127.0.0.1:0 <args>` with `secrets`
/// as the only secret settings in its environment.
async fn spawn_run(
    stack: &Stack,
    db_url: &str,
    target: &[&str],
    args: &[&str],
    secrets: &[(&str, &str)],
) -> anyhow::Result<Running> {
    let mut argv = relay_globals(stack);
    argv.push("run".into());
    argv.extend(target.iter().map(|s| s.to_string()));
    argv.extend(["--admin-listen", "127.0.0.1:0"].map(String::from));
    argv.extend(args.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let envs = [
        ("CDC_RELAY_DATABASE_URL", db_url),
        (
            "CDC_RELAY_LOG",
            "info,cdc_relay=debug,pgwire_replication=off",
        ),
    ];
    let mut command = std::process::Command::new(bins::path("cdc-relay"));
    command.args(&argv).envs(envs);
    for var in SECRET_VARS {
        command.env_remove(var);
    }
    command.envs(secrets.iter().copied());
    let process = ServiceProcess::from_command(command)?;
    let url = process.listen_addr(START_TIMEOUT).await?;
    Ok(Running::single(process, url))
}

/// Starts a [`FaultProxy`](crate::proxy::FaultProxy) in front of the host
/// and port of `url` (`postgres://…` or `http://…`, on an IP address) and
/// returns it with `url` rewritten to go through it; user, password, path
/// and query are kept.
pub async fn proxied(url: &str) -> anyhow::Result<(crate::proxy::FaultProxy, String)> {
    let mut parsed = reqwest::Url::parse(url).with_context(|| format!("parsing {url:?}"))?;
    let host = parsed.host_str().context("the URL names no host")?;
    let port = parsed
        .port_or_known_default()
        .context("the URL names no port")?;
    let upstream: std::net::SocketAddr = format!("{host}:{port}")
        .parse()
        .with_context(|| format!("{host}:{port} is not an IP address and port"))?;
    let proxy = crate::proxy::FaultProxy::start(upstream).await?;
    parsed
        .set_port(Some(proxy.port()))
        .map_err(|()| anyhow::anyhow!("cannot set a port on {url:?}"))?;
    Ok((proxy, parsed.into()))
}

/// Commits an order and its `OrderCreated` outbox row in one transaction
/// with plain SQL (what the Orders service does); returns the event id.
pub async fn insert_order_event(db: &tokio_postgres::Client) -> anyhow::Result<uuid::Uuid> {
    let event = uuid::Uuid::new_v4();
    insert_order_event_with_id(db, event).await?;
    Ok(event)
}

/// One transaction of `n` orders and their events, as SQL for
/// `batch_execute`: the relay reads them together, all in flight at once.
pub fn order_events_sql(n: usize) -> String {
    let mut sql = String::from("BEGIN;");
    for _ in 0..n {
        let (order, event) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        sql.push_str(&format!(
            "INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 1, 'EUR'); \
             INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{event}', '{order}', \
             'OrderCreated', jsonb_build_object('order_id', '{order}'::uuid, 'amount_cents', 1, 'currency', 'EUR'));"
        ));
    }
    sql.push_str("COMMIT;");
    sql
}

/// [`insert_order_event`] with the event id chosen by the caller (to script
/// a sink's answer for it before it is committed).
pub async fn insert_order_event_with_id(
    db: &tokio_postgres::Client,
    event: uuid::Uuid,
) -> anyhow::Result<()> {
    let order = uuid::Uuid::new_v4();
    db.batch_execute(&format!(
        "BEGIN; \
         INSERT INTO orders (id, amount_cents, currency) VALUES ('{order}', 250, 'EUR'); \
         INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ('{event}', '{order}', \
           'OrderCreated', jsonb_build_object('order_id', '{order}'::uuid, 'amount_cents', 250, 'currency', 'EUR')); \
         COMMIT"
    ))
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::is_session_start;

    #[test]
    fn a_session_start_is_the_streaming_message_with_its_slot_field() {
        for line in [
            "2025-06-01T10:00:00.000000Z  INFO cdc_relay::relay: streaming slot=s1 start=0/16B3748 status_interval_ms=1000",
            // The module path may change; message and field are what count.
            "2025-06-01T10:00:00.000000Z  INFO cdc_relay::source::stream: streaming slot=s1 start=0/1",
        ] {
            assert!(is_session_start(line), "{line}");
        }
        for line in [
            "2025-06-01T10:00:00.000000Z  INFO cdc_relay::relay: slot is held by another process; waiting as hot standby slot=s1 active_pid=42",
            "2025-06-01T10:00:00.000000Z  WARN cdc_relay::relay: not streaming: reconnecting in 100ms",
            "streaming",
        ] {
            assert!(!is_session_start(line), "{line}");
        }
    }
}
