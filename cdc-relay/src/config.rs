//! Command line and environment: every flag has an environment variable;
//! secrets come from the environment or a file, never only from argv.
//!
//! Bad settings exit non-zero with a message naming the flag (clap does this
//! for syntax; [`RunArgs::validate`] for relations between settings).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::breaker::BreakerConfig;
use crate::dispatch::DispatchConfig;
use crate::outbox::{OutboxColumns, TableName};
use crate::sink::{HttpSink, Signer, SinkConfig, StatusPolicy};

/// Streams a PostgreSQL outbox table through a pgoutput logical replication
/// slot and POSTs each committed insert, HMAC-signed, to an HTTP inbox. The
/// slot's confirmed LSN advances only past transactions whose events all got
/// a 2xx (or were quarantined): delivery is at-least-once, so the receiver
/// deduplicates by event id (the Idempotency-Key header).
///
/// Exit codes: 0 clean stop; 1 error (the message says which setting or what
/// to do); 2 bad command line; 3 slot missing (run `cdc-relay setup`); 4 slot
/// invalidated (see the message for recovery); 5 the stream holds an outbox
/// row the relay cannot read (nothing after it was acknowledged).
#[derive(Debug, Parser)]
#[command(name = "cdc-relay", version, about, long_about)]
pub struct Cli {
    /// Settings shared by every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Prepare the database (idempotent): check wal_level and limits, check
    /// the outbox table, create the insert-only publication, then the slot.
    /// Needs a role that owns the table (or a superuser) and REPLICATION.
    Setup(SetupArgs),
    /// Show the slot (active, pid, confirmed_flush_lsn, lag, wal_status,
    /// safe_wal_size) and the publication's tables.
    Status(StatusArgs),
    /// Stream and deliver until SIGTERM/SIGINT.
    Run(Box<RunArgs>),
    /// Inspect and resolve quarantined (poison) events.
    #[command(subcommand)]
    DeadLetter(DeadLetterCommand),
    /// Re-send outbox rows still in the table, oldest first, through the same
    /// delivery path (the inbox deduplicates by id). For recovery after a lost
    /// slot: `backfill --since <time of the last delivered event>`.
    Backfill(Box<BackfillArgs>),
}

/// `cdc-relay dead-letter …`.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List quarantined events, oldest first (payloads left out).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one quarantined event with its payload, as JSON.
    Show {
        /// Row id from `list`.
        id: i64,
    },
    /// Re-send quarantined events once each (same body and signature rules);
    /// a row is removed, with an audit entry, only after a 2xx.
    Replay(Box<ReplayArgs>),
    /// Remove a quarantined event without sending it; the audit table keeps
    /// a copy of the row, who removed it and why.
    Discard {
        /// Row id from `list`.
        id: i64,
        /// Why (kept in the audit table).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `cdc-relay dead-letter replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Row id from `list`.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub id: Option<i64>,
    /// Replay every row, oldest first.
    #[arg(long)]
    pub all: bool,
    /// The sink.
    #[command(flatten)]
    pub sink: SinkArgs,
}

/// `cdc-relay backfill`.
#[derive(Debug, Args)]
pub struct BackfillArgs {
    /// Re-send rows whose time column is at or after this (any PostgreSQL
    /// timestamptz input, e.g. '2026-11-30 10:00:00+00').
    #[arg(long)]
    pub since: String,
    /// Only rows before this.
    #[arg(long)]
    pub until: Option<String>,
    /// Column that orders the rows (the tutorial's insert time).
    #[arg(long, env = "CDC_RELAY_TIME_COLUMN", default_value = "occurred_at")]
    pub time_column: String,
    /// The sink.
    #[command(flatten)]
    pub sink: SinkArgs,
    /// Delivery tuning.
    #[command(flatten)]
    pub delivery: DeliveryArgs,
}

/// Log output format.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Settings every command uses.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Source database, libpq URL or key=value string, e.g.
    /// postgres://cdc_relay@db:5432/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem.
    /// Put the password in CDC_RELAY_DATABASE_PASSWORD or a file, not here.
    #[arg(
        long,
        env = "CDC_RELAY_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// Database password (overrides one in the URL).
    #[arg(
        long,
        env = "CDC_RELAY_DATABASE_PASSWORD",
        global = true,
        hide_env_values = true
    )]
    pub database_password: Option<String>,
    /// File holding the database password (first line).
    #[arg(long, env = "CDC_RELAY_DATABASE_PASSWORD_FILE", global = true)]
    pub database_password_file: Option<PathBuf>,
    /// Logical replication slot.
    #[arg(
        long,
        env = "CDC_RELAY_SLOT",
        default_value = "cdc_relay",
        global = true
    )]
    pub slot: String,
    /// Publication streamed from the slot (comma-separated for several).
    #[arg(
        long,
        env = "CDC_RELAY_PUBLICATION",
        default_value = "cdc_relay_outbox",
        global = true,
        value_delimiter = ','
    )]
    pub publication: Vec<String>,
    /// Outbox table, schema-qualified.
    #[arg(
        long,
        env = "CDC_RELAY_TABLE",
        default_value = "public.outbox",
        global = true
    )]
    pub table: TableName,
    /// Column with the event id (also the Idempotency-Key).
    #[arg(long, env = "CDC_RELAY_ID_COLUMN", default_value = "id", global = true)]
    pub id_column: String,
    /// Column with the event type.
    #[arg(
        long,
        env = "CDC_RELAY_TYPE_COLUMN",
        default_value = "event_type",
        global = true
    )]
    pub type_column: String,
    /// Column with the JSON payload.
    #[arg(
        long,
        env = "CDC_RELAY_PAYLOAD_COLUMN",
        default_value = "payload",
        global = true
    )]
    pub payload_column: String,
    /// Column with the aggregate key: events sharing a key are never in
    /// flight together and keep commit order. Empty disables it.
    #[arg(
        long,
        env = "CDC_RELAY_AGGREGATE_COLUMN",
        default_value = "aggregate_id",
        global = true
    )]
    pub aggregate_column: String,
    /// Connect timeout for database connections.
    #[arg(long, env = "CDC_RELAY_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_duration, global = true)]
    pub connect_timeout: Duration,
    /// Log format.
    #[arg(
        long,
        env = "CDC_RELAY_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax), e.g. info,cdc_relay=debug. The
    /// replication transport's own logs are off by default: the relay logs
    /// every session error itself, once, with what it does about it.
    #[arg(
        long,
        env = "CDC_RELAY_LOG",
        default_value = "info,pgwire_replication=off",
        global = true
    )]
    pub log: String,
}

impl GlobalArgs {
    /// The database URL with the password from the flag, env or file applied.
    pub fn conn(&self) -> Result<crate::source::ConnParams, String> {
        let url = self
            .database_url
            .as_deref()
            .ok_or("--database-url (CDC_RELAY_DATABASE_URL) is required")?;
        let mut conn = crate::source::ConnParams::parse(url, self.connect_timeout)
            .map_err(|e| e.to_string())?;
        if let Some(p) = &self.database_password {
            conn.password = p.clone();
        }
        if let Some(path) = &self.database_password_file {
            conn.password = read_secret_file(path, "--database-password-file")?;
        }
        Ok(conn)
    }

    /// Outbox column names.
    pub fn columns(&self) -> OutboxColumns {
        OutboxColumns {
            id: self.id_column.clone(),
            event_type: self.type_column.clone(),
            payload: self.payload_column.clone(),
            aggregate_key: Some(self.aggregate_column.clone()).filter(|c| !c.is_empty()),
        }
    }
}

/// `cdc-relay setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Drop and recreate an invalidated (wal_status = lost) slot. Events
    /// committed since its confirmed_flush_lsn must then be re-sent with
    /// `backfill`.
    #[arg(long)]
    pub recreate_slot: bool,
}

/// `cdc-relay status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Where and how events are POSTed (`run`, `backfill`, `dead-letter replay`).
#[derive(Debug, Args)]
pub struct SinkArgs {
    /// Inbox URL events are POSTed to (http:// or https://, with a host).
    #[arg(long, env = "CDC_RELAY_SINK_URL", value_parser = parse_sink_url)]
    pub sink_url: url::Url,
    /// HMAC-SHA256 secret for X-Event-Signature. Prefer the env var or a file.
    #[arg(long, env = "EVENT_SECRET", hide_env_values = true)]
    pub event_secret: Option<String>,
    /// File holding the event secret (first line).
    #[arg(long, env = "EVENT_SECRET_FILE")]
    pub event_secret_file: Option<PathBuf>,
    /// Extra CA certificate (PEM) to trust for an https sink.
    #[arg(long, env = "CDC_RELAY_SINK_CA_FILE")]
    pub sink_ca_file: Option<PathBuf>,
    /// Sink TCP connect timeout (a TLS handshake counts against
    /// --request-timeout, which bounds the whole attempt).
    #[arg(long, env = "CDC_RELAY_SINK_CONNECT_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub sink_connect_timeout: Duration,
    /// Whole-request timeout for one delivery attempt.
    #[arg(long, env = "CDC_RELAY_REQUEST_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub request_timeout: Duration,
}

/// `cdc-relay run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The sink.
    #[command(flatten)]
    pub sink: SinkArgs,
    /// Delivery tuning.
    #[command(flatten)]
    pub delivery: DeliveryArgs,
    /// After SIGTERM: time to finish in-flight deliveries and flush the
    /// confirmed LSN. Must exceed --request-timeout.
    #[arg(long, env = "CDC_RELAY_SHUTDOWN_TIMEOUT", default_value = "15s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Cap of the reconnect backoff after a lost replication connection.
    #[arg(long, env = "CDC_RELAY_RECONNECT_MAX", default_value = "5s", value_parser = parse_duration)]
    pub reconnect_max: Duration,
    /// How often the side connection reads the slot's lag and wal_status
    /// (one statement each time: the relay's whole cost to the database
    /// while idle; 15 s matches a common Prometheus scrape interval). At
    /// least 1s.
    #[arg(long, env = "CDC_RELAY_SLOT_STATS_INTERVAL", default_value = "15s", value_parser = parse_duration)]
    pub slot_stats_interval: Duration,
    /// Admin HTTP address for /metrics, /healthz and /readyz.
    #[arg(long, env = "CDC_RELAY_ADMIN_LISTEN", default_value = "127.0.0.1:9187")]
    pub admin_listen: SocketAddr,
    /// /readyz fails when events are pending and the confirmed LSN has not
    /// advanced for this long.
    #[arg(long, env = "CDC_RELAY_READY_WINDOW", default_value = "60s", value_parser = parse_duration)]
    pub ready_window: Duration,
    /// application_name shown in pg_stat_replication.
    #[arg(long, env = "CDC_RELAY_APPLICATION_NAME", default_value = "cdc-relay")]
    pub application_name: String,
    /// Create the slot if it does not exist. Only for a fresh install: a new
    /// slot starts at the current WAL position, so after a failover or a lost
    /// slot it would silently skip events (use `setup` and `backfill` then).
    #[arg(long, env = "CDC_RELAY_CREATE_SLOT")]
    pub create_slot: bool,
    /// Runtime worker threads (CPU cores the relay may keep busy). Default:
    /// one per available CPU. Running beside PostgreSQL on a small machine,
    /// 1 leaves the other cores to the database.
    #[arg(long, env = "CDC_RELAY_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
}

/// Pipelining, memory window, retries and the circuit breaker (`run`, `backfill`).
#[derive(Debug, Args)]
pub struct DeliveryArgs {
    /// Deliveries at once (pipelining). 1 gives strict global commit order.
    #[arg(long, env = "CDC_RELAY_MAX_IN_FLIGHT", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_in_flight: u32,
    /// Events received and not yet delivered held in memory; when full the
    /// relay stops reading and WAL waits on the server.
    #[arg(long, env = "CDC_RELAY_MAX_PENDING_EVENTS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending_events: u32,
    /// Bytes of those events (payloads included). A larger event is admitted alone.
    #[arg(long, env = "CDC_RELAY_MAX_PENDING_BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub max_pending_bytes: u32,
    /// First retry delay ceiling (doubles per attempt, full jitter).
    #[arg(long, env = "CDC_RELAY_BACKOFF_BASE", default_value = "50ms", value_parser = parse_duration)]
    pub backoff_base: Duration,
    /// Retry delay cap. Keep it near a second: long caps oversleep recovery.
    #[arg(long, env = "CDC_RELAY_BACKOFF_CAP", default_value = "1s", value_parser = parse_duration)]
    pub backoff_cap: Duration,
    /// Largest Retry-After honoured.
    #[arg(long, env = "CDC_RELAY_RETRY_AFTER_MAX", default_value = "5s", value_parser = parse_duration)]
    pub retry_after_max: Duration,
    /// HTTP statuses that mark an event as poison.
    #[arg(
        long,
        env = "CDC_RELAY_POISON_STATUSES",
        default_value = "400,413,415,422",
        value_delimiter = ','
    )]
    pub poison_statuses: Vec<u16>,
    /// Consecutive transient failures that open the circuit breaker.
    #[arg(long, env = "CDC_RELAY_FAILURE_THRESHOLD", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub failure_threshold: u32,
    /// While the circuit is open, one probe (the oldest pending event) goes
    /// out per interval (plus up to 20 % jitter).
    #[arg(long, env = "CDC_RELAY_PROBE_INTERVAL", default_value = "500ms", value_parser = parse_duration)]
    pub probe_interval: Duration,
    /// Poison verdicts on this many distinct events in a row (no 2xx between)
    /// mean the sink is broken, not the events: stop quarantining and open
    /// the circuit.
    #[arg(long, env = "CDC_RELAY_POISON_STORM_THRESHOLD", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub poison_storm_threshold: u32,
}

impl SinkArgs {
    /// The event secret from the flag/env or the file; an error names the setting.
    pub fn secret(&self) -> Result<String, String> {
        let secret = match (&self.event_secret, &self.event_secret_file) {
            (Some(_), Some(_)) => {
                return Err(
                    "give --event-secret (EVENT_SECRET) or --event-secret-file, not both".into(),
                );
            }
            (Some(s), None) => s.clone(),
            (None, Some(p)) => read_secret_file(p, "--event-secret-file")?,
            (None, None) => {
                return Err(
                    "an event secret is required: set EVENT_SECRET or --event-secret-file".into(),
                );
            }
        };
        // Trimmed like Billing trims its list: a stray space or newline must
        // not make every signature wrong.
        let secret = secret.trim();
        if secret.is_empty() {
            return Err("the event secret (EVENT_SECRET / --event-secret-file) is empty".into());
        }
        Ok(secret.to_owned())
    }

    /// Builds the HTTP sink; the error names the setting.
    pub fn build(&self) -> Result<HttpSink, String> {
        if self.request_timeout.is_zero() || self.sink_connect_timeout.is_zero() {
            return Err("--request-timeout and --sink-connect-timeout must be above 0".into());
        }
        if !matches!(self.sink_url.scheme(), "http" | "https") {
            return Err(format!(
                "--sink-url must be http or https, got {}",
                self.sink_url.scheme()
            ));
        }
        let secret = self.secret()?;
        let ca_cert_pem = match &self.sink_ca_file {
            Some(p) => {
                Some(std::fs::read(p).map_err(|e| format!("--sink-ca-file {}: {e}", p.display()))?)
            }
            None => None,
        };
        HttpSink::new(SinkConfig {
            url: self.sink_url.clone(),
            signer: Signer::new(secret.as_bytes()),
            connect_timeout: self.sink_connect_timeout,
            request_timeout: self.request_timeout,
            ca_cert_pem,
        })
        .map_err(|e| e.to_string())
    }
}

impl DeliveryArgs {
    /// Checks relations between settings; the error names the flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.backoff_base.is_zero() || self.backoff_cap < self.backoff_base {
            return Err("--backoff-base must be > 0 and not above --backoff-cap".into());
        }
        if self.probe_interval < Duration::from_millis(50) {
            return Err("--probe-interval must be at least 50ms".into());
        }
        if let Some(bad) = self
            .poison_statuses
            .iter()
            .find(|s| !(400..500).contains(*s))
        {
            return Err(format!(
                "--poison-statuses may list only 4xx statuses, got {bad}"
            ));
        }
        if let Some(bad) = self
            .poison_statuses
            .iter()
            .find(|s| NEVER_POISON.contains(*s))
        {
            return Err(format!(
                "--poison-statuses cannot list {bad}: 401, 403, 404 and 405 say the relay's own \
                 configuration is wrong (events are kept and the circuit opens; a wrong \
                 --sink-url must not dead-letter every event), 408, 425 and 429 are retried"
            ));
        }
        Ok(())
    }

    /// Delivery settings.
    pub fn dispatch(&self) -> DispatchConfig {
        DispatchConfig {
            max_in_flight: self.max_in_flight as usize,
            backoff_base: self.backoff_base,
            backoff_cap: self.backoff_cap,
            retry_after_max: self.retry_after_max,
            policy: StatusPolicy {
                poison: self.poison_statuses.clone(),
            },
            breaker: BreakerConfig {
                failure_threshold: self.failure_threshold,
                probe_interval: self.probe_interval,
                storm_threshold: self.poison_storm_threshold,
            },
        }
    }
}

impl RunArgs {
    /// Checks relations between settings; the error names the flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.sink.request_timeout >= self.shutdown_timeout {
            return Err(format!(
                "--request-timeout ({:?}) must be shorter than --shutdown-timeout ({:?}) so in-flight requests can finish on shutdown",
                self.sink.request_timeout, self.shutdown_timeout
            ));
        }
        if self.slot_stats_interval < Duration::from_secs(1) {
            return Err("--slot-stats-interval must be at least 1s (it must not turn the relay into a poller)".into());
        }
        self.delivery.validate()
    }
}

fn read_secret_file(path: &std::path::Path, setting: &str) -> Result<String, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("{setting} {}: {e}", path.display()))?;
    Ok(text
        .lines()
        .next()
        .unwrap_or("")
        .trim_end_matches('\r')
        .to_owned())
}

/// Parses `500ms`, `2s`, `1m 30s` (humantime syntax).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 2s, 1m)"))
}

/// Parses a byte size: `1048576`, `64KiB`, `64MiB`, `1GiB` (also kB/MB/GB as powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u32, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?} (examples: 65536, 64KiB, 64MiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => {
            return Err(format!(
                "invalid size unit in {s:?} (use B, KiB, MiB or GiB)"
            ));
        }
    };
    let v = n
        .checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size {s:?} out of range"))?;
    u32::try_from(v).map_err(|_| format!("size {s:?} is above 4GiB"))
}

/// Statuses that are never the event's fault: configuration faults (the
/// URL, the secret, the method) and "try again later".
const NEVER_POISON: [u16; 7] = [401, 403, 404, 405, 408, 425, 429];

/// `--sink-url`: an absolute http(s) URL with a host. The WHATWG parser
/// would read `http:///inbox` or `http:inbox` as the host `inbox`; those are
/// typos, refused here.
fn parse_sink_url(s: &str) -> Result<url::Url, String> {
    let url =
        url::Url::parse(s.trim()).map_err(|e| format!("{e} (e.g. http://billing:8080/inbox)"))?;
    if matches!(url.scheme(), "http" | "https") {
        let rest = s.trim().split_once("://").map(|(_, rest)| rest);
        if !rest.is_some_and(|r| !r.is_empty() && !r.starts_with('/')) {
            return Err(
                "expected scheme://host[:port]/path, e.g. http://billing:8080/inbox".into(),
            );
        }
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    fn run_args(extra: &[&str]) -> Result<Cli, clap::Error> {
        let mut argv = vec!["cdc-relay", "run", "--sink-url", "http://127.0.0.1:1/inbox"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv)
    }

    #[test]
    fn bad_settings_name_the_flag() {
        let cli = run_args(&["--request-timeout", "20s", "--shutdown-timeout", "10s"]).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        let err = run.validate().unwrap_err();
        assert!(
            err.contains("--request-timeout") && err.contains("--shutdown-timeout"),
            "{err}"
        );

        let err = run_args(&["--max-in-flight", "0"]).unwrap_err().to_string();
        assert!(err.contains("--max-in-flight"), "{err}");
        let err = run_args(&["--backoff-cap", "soon"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--backoff-cap"), "{err}");
    }

    #[test]
    fn sink_url_typos_and_config_fault_poison_statuses_are_refused() {
        for bad in ["http:///inbox", "http:inbox", "https://", "not a url"] {
            let mut argv = vec!["cdc-relay", "run", "--sink-url", bad];
            argv.push("--max-in-flight");
            argv.push("1");
            let err = Cli::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains("--sink-url"), "{bad}: {err}");
        }
        assert!(run_args(&[]).is_ok());
        for bad in ["404", "400,401", "429"] {
            let cli = run_args(&["--poison-statuses", bad]).unwrap();
            let Command::Run(run) = cli.command else {
                panic!("run")
            };
            let err = run.delivery.validate().unwrap_err();
            assert!(err.contains("--poison-statuses"), "{bad}: {err}");
        }
        let cli = run_args(&["--poison-statuses", "400,409,422"]).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        assert!(run.delivery.validate().is_ok());
    }

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert!(parse_bytes("5GiB").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    }

    #[test]
    fn secrets_come_from_env_or_file() {
        let cli = run_args(&[]).unwrap();
        let Command::Run(mut run) = cli.command else {
            panic!("run")
        };
        run.sink.event_secret = None;
        assert!(run.sink.secret().unwrap_err().contains("EVENT_SECRET"));
        let dir = std::env::temp_dir().join(format!("cdc-relay-secret-{}", std::process::id()));
        std::fs::write(&dir, "s3cret\n").unwrap();
        run.sink.event_secret_file = Some(dir.clone());
        assert_eq!(run.sink.secret().unwrap(), "s3cret");
        std::fs::remove_file(dir).unwrap();
    }
}
