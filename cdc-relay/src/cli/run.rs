//! The flags of `run`, and the sink, signing and delivery groups it
//! shares with `backfill` and `dead-letter replay`.

use super::*;

/// Where and how events are POSTed (`run`, `backfill`, `dead-letter replay`).
#[derive(Debug, Args)]
#[command(next_help_heading = "Sink")]
pub struct SinkArgs {
    /// Inbox URL events are POSTed to (http:// or https://, with a host).
    /// Required to send anything (not by `--dry-run`).
    #[arg(long, env = "CDC_RELAY_SINK_URL", value_parser = SinkUrlParser)]
    pub sink_url: Option<url::Url>,
    /// Extra CA certificate(s) (PEM) to trust for an https sink, besides
    /// the public roots. Read again for each new connection: a rotated
    /// file needs no restart.
    #[arg(long, env = "CDC_RELAY_SINK_CA_FILE")]
    pub sink_ca_file: Option<PathBuf>,
    /// Client certificate (PEM, with its chain) to present to https sinks
    /// that ask for one (mutual TLS); with --sink-client-key. Read again
    /// for each new connection.
    #[arg(long, env = "CDC_RELAY_SINK_CLIENT_CERT")]
    pub sink_client_cert: Option<PathBuf>,
    /// The private key (unencrypted PEM) of --sink-client-cert.
    #[arg(long, env = "CDC_RELAY_SINK_CLIENT_KEY")]
    pub sink_client_key: Option<PathBuf>,
    /// Sink TCP connect timeout (a TLS handshake counts against
    /// --request-timeout, which bounds the whole attempt).
    #[arg(long, env = "CDC_RELAY_SINK_CONNECT_TIMEOUT", default_value = "2s", value_parser = parse_timeout)]
    pub sink_connect_timeout: Duration,
    /// Whole-request timeout for one delivery attempt. Must be shorter
    /// than --shutdown-timeout, so an attempt on the wire when SIGTERM
    /// arrives can finish.
    #[arg(long, env = "CDC_RELAY_REQUEST_TIMEOUT", default_value = "4s", value_parser = parse_timeout)]
    pub request_timeout: Duration,
    /// Maximum age of a kept-alive sink connection: once a connection is this
    /// old it takes no new request, and the next one opens a new connection
    /// with a fresh DNS lookup (a blue/green switch behind one name is
    /// followed within this time). At least 1s.
    #[arg(long, env = "CDC_RELAY_SINK_CONNECTION_MAX_AGE", default_value = "60s", value_parser = parse_duration)]
    pub sink_connection_max_age: Duration,
    /// A kept-alive sink connection idle for this long is closed by the relay,
    /// before a load balancer's idle timeout (commonly 60 s) can close it
    /// under a request. At least 1s.
    #[arg(long, env = "CDC_RELAY_SINK_IDLE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub sink_idle_timeout: Duration,
    /// The signing secrets and headers.
    #[command(flatten)]
    pub secrets: SecretArgs,
}

/// The event secrets and which signature headers carry them
/// (docs/architecture.md#wire-format). One secret per setting: a plain
/// secret of at least 32 bytes, or `whsec_<base64>` of at least 24 decoded
/// bytes. `run` reads the files again on SIGHUP.
#[derive(Clone, Debug, Args)]
#[command(next_help_heading = "Signing")]
pub struct SecretArgs {
    /// The current secret (signs X-Event-Signature and webhook-signature).
    /// Prefer the env var or a file.
    #[arg(long, env = "EVENT_SECRET", hide_env_values = true)]
    pub event_secret: Option<String>,
    /// File holding the current secret (one line).
    #[arg(long, env = "EVENT_SECRET_FILE")]
    pub event_secret_file: Option<PathBuf>,
    /// During a rotation, the secret being retired: webhook-signature then
    /// carries a second signature made with it. Unset (or empty) otherwise.
    #[arg(long, env = "EVENT_SECRET_PREVIOUS", hide_env_values = true)]
    pub event_secret_previous: Option<String>,
    /// File holding the secret being retired (one line; an empty file means
    /// none, so a rotation ends by emptying it and sending SIGHUP).
    #[arg(long, env = "EVENT_SECRET_PREVIOUS_FILE")]
    pub event_secret_previous_file: Option<PathBuf>,
    /// Signature headers: `standard` (Standard Webhooks: webhook-id,
    /// webhook-timestamp, webhook-signature), `legacy` (X-Event-Signature)
    /// or `both`.
    #[arg(
        long,
        env = "CDC_RELAY_SIGNATURE_SCHEME",
        value_enum,
        default_value = "both"
    )]
    pub signature_scheme: crate::sink::SignatureScheme,
}

/// The runtime's worker threads when `--worker-threads` is not given, for
/// a machine with `cpus` CPUs: one per CPU but one, at least one. The
/// relay runs beside PostgreSQL, whose walsender decodes the stream on a
/// CPU of its own; on a 2-CPU machine shared with the database and a
/// receiver, one thread delivered more for less CPU per event than two
/// (`docs/benchmarks.md`, "Runtime threads beside PostgreSQL").
pub fn default_worker_threads(cpus: usize) -> usize {
    cpus.saturating_sub(1).max(1)
}

/// `cdc-relay run`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Relay")]
pub struct RunArgs {
    /// Traces: each delivery attempt of an event with a stored trace
    /// context as a span, exported over OTLP/HTTP.
    #[command(flatten)]
    pub trace: trace_context::TraceArgs,
    /// After SIGTERM: time to finish the attempts on the wire (no new
    /// attempt starts once shutdown begins) and flush the confirmed LSN.
    /// Must exceed --request-timeout; 5s keeps the stop under a container
    /// runtime's usual 10 s grace.
    #[arg(long, env = "CDC_RELAY_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Cap of the reconnect backoff after a lost replication connection.
    /// At least 100ms (the first delay).
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
    /// Connections the admin endpoint serves at once (its own small budget:
    /// a flood on it never starves deliveries of descriptors); idle ones
    /// close after 5 s.
    #[arg(long, env = "CDC_RELAY_ADMIN_MAX_CONNECTIONS", default_value_t = 16)]
    pub admin_max_connections: usize,
    /// /readyz fails when events are pending and the confirmed LSN has not
    /// advanced for this long. At least 1s.
    #[arg(long, env = "CDC_RELAY_READY_WINDOW", default_value = "60s", value_parser = parse_duration)]
    pub ready_window: Duration,
    /// After an error that needs an operator (exit codes 3-7): `exit` at
    /// once with its code, or `linger`: keep serving /metrics
    /// (`cdc_relay_halted{code}` 1, the slot's state) with /readyz failing
    /// with the error, until SIGTERM/SIGINT, then exit with the code. With
    /// `linger` an alert sees a relay that stopped for good (a lost slot
    /// exits within milliseconds of start otherwise). Exit codes 1 and 2
    /// always exit.
    #[arg(long, env = "CDC_RELAY_ON_FATAL", value_enum, default_value = "exit")]
    pub on_fatal: OnFatal,
    /// With --shards: stream at most this many shards at once. The process
    /// claims free shards (a slot no other process streams) up to this
    /// many, each in its own session, and waits as a hot standby for the
    /// rest: when another relay dies, one waiting takes its shard within
    /// about a second. Run shards + spares processes with --max-shards 1,
    /// or fewer processes with more each.
    #[arg(long, env = "CDC_RELAY_MAX_SHARDS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=crate::source::shards::MAX_SHARDS as i64), allow_negative_numbers = true)]
    pub max_shards: u32,
    /// Stop, exit 0, once the slot (each shard's, with --shards) is
    /// confirmed at or past this LSN (e.g. 0/3000060), and never start
    /// streaming a slot already past it. For resharding: `setup --shards`
    /// prints the LSN the new slots start from; the old relays stop there
    /// and the new ones start after them, so each aggregate's events keep
    /// their order (docs/operations.md#resharding).
    #[arg(long, env = "CDC_RELAY_STOP_AT_LSN", value_parser = parse_lsn)]
    pub stop_at_lsn: Option<crate::lsn::Lsn>,
    /// application_name shown in pg_stat_replication.
    #[arg(long, env = "CDC_RELAY_APPLICATION_NAME", default_value = "cdc-relay")]
    pub application_name: String,
    /// Create the slot if it does not exist. Only for a fresh install: a new
    /// slot starts at the current WAL position, so after a failover or a lost
    /// slot it would silently skip events (use `setup` and `backfill` then).
    #[arg(long, env = "CDC_RELAY_CREATE_SLOT")]
    pub create_slot: bool,
    /// Require a failover slot (PostgreSQL 17+; `setup --failover`): a slot
    /// without it is refused at every connect.
    #[arg(long, env = "CDC_RELAY_FAILOVER")]
    pub failover: bool,
    /// Largest lag, in bytes behind the primary's slot, a standby's copy
    /// may have and count as ready (cdc_relay_failover_ready).
    #[arg(long, env = "CDC_RELAY_FAILOVER_MAX_LAG", default_value = "16MiB", value_parser = parse_bytes)]
    pub failover_max_lag: u32,
    /// WAL budget of the slot (`pg_current_wal_lsn() - restart_lsn`,
    /// checked at every slot monitor reading): above it, the endpoint
    /// holding the oldest pending event is parked, its events dead-lettered
    /// with reason `parked`, so the slot moves on (docs/operations.md, "A
    /// parked endpoint"). E.g. 4GiB; unset: no budget.
    #[arg(long, env = "CDC_RELAY_MAX_RETAINED_WAL", value_parser = parse_size)]
    pub max_retained_wal: Option<u64>,
    /// What to do when the slot is missing at start or after a reconnect:
    /// stop (exit 3) with the steps, or, after a failover to a server
    /// without a copy of the slot, recreate it and re-send the outbox rows
    /// committed since the last delivered transaction (the progress record
    /// in cdc_relay_progress, minus --backfill-margin) before streaming.
    #[arg(
        long,
        env = "CDC_RELAY_ON_SLOT_LOSS",
        value_enum,
        default_value = "stop"
    )]
    pub on_slot_loss: crate::relay::OnSlotLoss,
    /// What to do when the outbox was out of its publication for a while
    /// (rows inserted meanwhile were never decoded): tell (log the exact
    /// `cdc-relay backfill` command, its window starting --backfill-margin
    /// early, and fail /readyz and `status` until a backfill covering it
    /// completes), or, once the table is back, backfill (re-send the rows
    /// of the gap's window from the table through the pipeline, the window
    /// starting --backfill-margin early, then stream on; the receiver
    /// deduplicates).
    #[arg(long, env = "CDC_RELAY_ON_GAP", value_enum, default_value = "tell")]
    pub on_gap: crate::relay::OnGap,
    /// How far before the last delivered commit a recovery backfill starts,
    /// and before a publication gap its window (transactions that were long
    /// commit after their rows' insert time).
    #[arg(long, env = "CDC_RELAY_BACKFILL_MARGIN", default_value = "5m", value_parser = parse_duration)]
    pub backfill_margin: Duration,
    /// Column a recovery backfill orders the outbox rows by (their insert
    /// time).
    #[arg(long, env = "CDC_RELAY_TIME_COLUMN", default_value = "occurred_at")]
    pub time_column: String,
    /// Stream from a database whose server_encoding is not UTF8 (e.g.
    /// SQL_ASCII). The stream then carries the stored bytes as they are, and
    /// a row that is not valid UTF-8 goes to the dead-letter table (its
    /// payload bytes kept in payload_bytes) instead of being sent.
    #[arg(long, env = "CDC_RELAY_ALLOW_NON_UTF8")]
    pub allow_non_utf8: bool,
    /// Opt-in retention: delete outbox rows older than this (e.g. 7d;
    /// above 0) and proven delivered, at a low rate, from the relay itself (as
    /// `cdc-relay prune` does, rows only: partitions need the table's
    /// owner). The relay's role needs `GRANT DELETE ON <outbox> TO
    /// cdc_relay`. Unset: the relay never deletes.
    #[arg(long, env = "CDC_RELAY_PRUNE_OLDER_THAN", value_parser = parse_retention, help_heading = "Retention")]
    pub prune_older_than: Option<Duration>,
    /// Time between two prune ticks. An idle tick is one statement; keep it
    /// at a minute or more to stay within the idle budget. At least 1s.
    #[arg(long, env = "CDC_RELAY_PRUNE_INTERVAL", default_value = "10m", value_parser = parse_duration, help_heading = "Retention")]
    pub prune_interval: Duration,
    /// Test-only: the delay before the first prune tick (default 10 s, or
    /// the interval if shorter), so a test sees a tick without waiting
    /// for the interval. Hidden from --help; not for production use.
    #[arg(long, env = "CDC_RELAY_PRUNE_FIRST_TICK", value_parser = parse_duration, hide = true, help_heading = "Retention")]
    pub prune_first_tick: Option<Duration>,
    /// Rows per prune batch (about).
    #[arg(long, env = "CDC_RELAY_PRUNE_BATCH", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000), allow_negative_numbers = true, help_heading = "Retention")]
    pub prune_batch: u32,
    /// Pause between two prune batches.
    #[arg(long, env = "CDC_RELAY_PRUNE_PAUSE", default_value = "1s", value_parser = parse_duration, help_heading = "Retention")]
    pub prune_pause: Duration,
    /// Runtime worker threads (CPU cores the relay may keep busy). Default:
    /// one per available CPU but one, at least one (1 on a 2-CPU machine):
    /// the relay runs beside PostgreSQL, whose walsender decodes what it
    /// streams. On a machine of its own, set it to the CPU count.
    #[arg(long, env = "CDC_RELAY_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024), allow_negative_numbers = true)]
    pub worker_threads: Option<u16>,
    /// The sink.
    #[command(flatten)]
    pub sink: SinkArgs,
    /// Several endpoints instead of the one sink.
    #[command(flatten)]
    pub routes: crate::routes::args::RoutesArgs,
    /// Delivery tuning.
    #[command(flatten)]
    pub delivery: DeliveryArgs,
}

/// Pipelining, memory window, retries and the circuit breaker (`run`, `backfill`).
#[derive(Debug, Args)]
#[command(next_help_heading = "Delivery")]
pub struct DeliveryArgs {
    /// Deliveries at once (pipelining). 1 gives strict global commit order.
    #[arg(long, env = "CDC_RELAY_MAX_IN_FLIGHT", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096), allow_negative_numbers = true)]
    pub max_in_flight: u32,
    /// Events one request may carry at most (a batch: a JSON array body,
    /// `docs/architecture.md#batches`; the receiver must take batches). 1,
    /// the default, sends one request per event. Batches form by themselves
    /// under load: a request goes as soon as one of --max-in-flight is free,
    /// with the events ready then.
    #[arg(long, env = "CDC_RELAY_BATCH_MAX_EVENTS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000), allow_negative_numbers = true)]
    pub batch_max_events: u32,
    /// A batch's body size at most (estimated from the events' sizes; a
    /// larger event goes alone, and a receiver's 413 splits a batch). Keep it
    /// below the receiver's body limit (Billing: 64KiB by default).
    #[arg(long, env = "CDC_RELAY_BATCH_MAX_BYTES", default_value = "48KiB", value_parser = super::parse_batch_bytes)]
    pub batch_max_bytes: u32,
    /// The memory window, in events: events received and not yet done
    /// (delivered or dead-lettered at every endpoint) that the relay holds.
    /// When the window is full the relay stops reading and WAL waits on the
    /// server ("pending" in the flag's name is the window's content).
    #[arg(long, env = "CDC_RELAY_MAX_PENDING_EVENTS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..), allow_negative_numbers = true)]
    pub max_pending_events: u32,
    /// The memory window, in bytes of those events (payloads included). A
    /// larger event is admitted alone.
    #[arg(long, env = "CDC_RELAY_MAX_PENDING_BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub max_pending_bytes: u32,
    /// First retry delay ceiling (doubles per attempt, full jitter).
    #[arg(long, env = "CDC_RELAY_BACKOFF_BASE", default_value = "50ms", value_parser = parse_duration)]
    pub backoff_base: Duration,
    /// Retry delay cap. Keep it near a second: long caps oversleep recovery.
    #[arg(long, env = "CDC_RELAY_BACKOFF_CAP", default_value = "1s", value_parser = parse_duration)]
    pub backoff_cap: Duration,
    /// Largest Retry-After honoured (delay-seconds or an HTTP-date). A
    /// Retry-After on a failed answer (429, 503, ...) pauses every request
    /// to the sink, circuit-breaker probes included, for that long, up to
    /// this bound.
    #[arg(long, env = "CDC_RELAY_RETRY_AFTER_MAX", default_value = "60s", value_parser = parse_duration)]
    pub retry_after_max: Duration,
    /// HTTP statuses that mark an event as poison.
    #[arg(
        long,
        env = "CDC_RELAY_POISON_STATUSES",
        default_value = "400,413,422",
        value_delimiter = ','
    )]
    pub poison_statuses: Vec<u16>,
    /// Consecutive transient failures that open the circuit breaker.
    #[arg(long, env = "CDC_RELAY_FAILURE_THRESHOLD", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..), allow_negative_numbers = true)]
    pub failure_threshold: u32,
    /// While the circuit is open, one probe (the delivery waiting longest) goes
    /// out per interval (plus up to 20 % jitter).
    #[arg(long, env = "CDC_RELAY_PROBE_INTERVAL", default_value = "500ms", value_parser = parse_duration)]
    pub probe_interval: Duration,
    /// Once an endpoint answers 410 Gone (retired by its receiver), one
    /// probe goes out per this interval (plus up to 20 % jitter) until it
    /// answers 2xx again. At least 1s.
    #[arg(long, env = "CDC_RELAY_RETIRED_PROBE_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub retired_probe_interval: Duration,
    /// Poison verdicts on this many distinct events in a row (no 2xx between,
    /// counting only 2xx to requests sent after the first of them) mean the
    /// sink is broken, not the events: stop dead-lettering and open the
    /// circuit.
    #[arg(long, env = "CDC_RELAY_POISON_STORM_THRESHOLD", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..), allow_negative_numbers = true)]
    pub poison_storm_threshold: u32,
}
