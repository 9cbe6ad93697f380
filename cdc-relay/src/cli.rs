//! The command line: the clap schema and its value parsers. Every flag has
//! an environment variable; secrets come from the environment or a file,
//! never only from argv.
//!
//! Syntax errors exit 2 with clap's message; relations between settings are
//! checked when they are built into the pipeline's configuration
//! ([`crate::settings`]), with a message that names the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::outbox::TableName;

/// Streams a PostgreSQL outbox table through a pgoutput logical replication
/// slot and POSTs each committed insert, HMAC-signed, to an HTTP inbox. The
/// slot's confirmed LSN advances only past transactions whose events all got
/// a 2xx (or were quarantined): delivery is at-least-once, so the receiver
/// deduplicates by event id (the Idempotency-Key header).
///
/// Exit codes: 0 clean stop; 1 error (the message says which setting or what
/// to do); 2 bad configuration (a flag, variable or file: the message names
/// it); 3 the database needs `cdc-relay setup` (slot, publication, table or
/// column missing); 4 slot invalidated (see the message for recovery); 5 the
/// stream holds an outbox change the relay cannot map (a column dropped, the
/// payload no longer json/jsonb, the table renamed away from --table;
/// nothing after it was acknowledged); 6 the slot was created before its
/// publication (recreate it and backfill); 7 the slot is ahead of where this
/// relay left it with events undelivered (recreated, or a failover): backfill
/// from the time the message gives. `status` exits with the same codes, 8
/// when the database is fine but no relay delivers, and 9 when the slot is
/// about to be invalidated (wal_status unreserved).
#[derive(Debug, Parser)]
#[command(name = "cdc-relay", version = crate::VERSION, about, long_about)]
pub struct Cli {
    /// Settings shared by every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line as clap sees it, with environment values never
    /// shown in `--help` (`[env: CDC_RELAY_SINK_URL]`, neither a trailing
    /// `=` nor a value that may be a secret).
    pub fn command() -> clap::Command {
        fn hide(cmd: clap::Command) -> clap::Command {
            cmd.mut_args(|a| a.hide_env_values(true))
                .mut_subcommands(hide)
        }
        hide_unused_globals(hide(<Cli as clap::CommandFactory>::command()))
    }

    /// Parses the process's arguments with [`Cli::command`]; on an error
    /// prints it and exits 2 (or 0 for `--help` and `--version`).
    pub fn parse_args() -> Cli {
        let matches = Cli::command().get_matches();
        <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// The global flags (`GlobalArgs` field ids) by what they are for.
const DATABASE_FLAGS: &[&str] = &[
    "database_url",
    "database_password",
    "database_password_file",
    "connect_timeout",
];
const SLOT_FLAGS: &[&str] = &["slot", "publication", "shards"];
const STANDBY_FLAGS: &[&str] = &["standby_url"];
const OUTBOX_FLAGS: &[&str] = &[
    "table",
    "id_column",
    "type_column",
    "payload_column",
    "aggregate_column",
];
const LOG_FLAGS: &[&str] = &["log_format", "log"];

/// The global flag groups a subcommand reads; `None` for every group.
fn globals_read_by(subcommand: &str) -> Option<&'static [&'static [&'static str]]> {
    match subcommand {
        "setup" | "prune" => Some(&[DATABASE_FLAGS, SLOT_FLAGS, OUTBOX_FLAGS, LOG_FLAGS]),
        "backfill" => Some(&[DATABASE_FLAGS, OUTBOX_FLAGS, LOG_FLAGS]),
        "dead-letter" => Some(&[DATABASE_FLAGS, LOG_FLAGS]),
        "completions" => Some(&[]),
        _ => None, // run, status: all of them
    }
}

/// Hides from each subcommand's help (and completions) the global flags it
/// does not read. They stay accepted, so one environment file or one set
/// of flags before the subcommand serves every command. Done by giving the
/// subcommand a hidden copy of each such flag before clap copies the
/// global flags down (clap keeps a copy that is already there, and hands
/// it on to nested subcommands such as `dead-letter list`).
fn hide_unused_globals(cmd: clap::Command) -> clap::Command {
    let all = [
        DATABASE_FLAGS,
        SLOT_FLAGS,
        STANDBY_FLAGS,
        OUTBOX_FLAGS,
        LOG_FLAGS,
    ];
    let globals: Vec<clap::Arg> = cmd
        .get_arguments()
        .filter(|a| a.is_global_set())
        .cloned()
        .collect();
    cmd.mut_subcommands(|sub| {
        let Some(read) = globals_read_by(sub.get_name()) else {
            return sub;
        };
        let unused = all
            .iter()
            .filter(|group| !read.contains(group))
            .flat_map(|group| group.iter());
        unused.fold(sub, |sub, id| {
            let arg = globals
                .iter()
                .find(|a| a.get_id() == id)
                .unwrap_or_else(|| panic!("{id} is a global flag"));
            sub.arg(arg.clone().hide(true))
        })
    })
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
    /// Delete outbox rows older than --older-than that are proven delivered
    /// (the slot confirmed past a prune mark taken after their insert) and
    /// have no dead letter waiting; whole time-range partitions that qualify
    /// are detached and dropped instead. Small batches with a pause,
    /// progress on stderr, a summary on stdout. Deletes are not streamed
    /// (the publication is insert-only).
    Prune(Box<PruneArgs>),
    /// Check a routes file (`run --routes`).
    #[command(subcommand)]
    Routes(crate::routes::args::RoutesCommand),
    /// Print a shell completion script to stdout, e.g.
    /// `cdc-relay completions bash > /etc/bash_completion.d/cdc-relay`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `cdc-relay dead-letter …`.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead-lettered events, oldest first, with their age (payloads
    /// left out).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Which rows.
        #[command(flatten)]
        filter: DeadLetterFilterArgs,
        /// At most this many rows (the oldest).
        #[arg(long)]
        limit: Option<i64>,
    },
    /// Show one dead-lettered event as JSON, its payload as JSON.
    Show {
        /// Row id from `list`.
        id: i64,
    },
    /// Re-send dead-lettered events once each (same body and signature
    /// rules); a row is removed, with an audit entry, only after a 2xx. Stops
    /// at the first failure that says the sink itself is failing (5xx, 408,
    /// 429, 401/403/404/405, timeout, connection): the remaining rows are
    /// not attempted. An aggregate's events keep their order: after one is
    /// refused, its aggregate's later ones are not attempted.
    Replay(Box<ReplayArgs>),
    /// Remove dead-lettered events without sending them; the audit table
    /// keeps a copy of each row, who removed it and why. Rows are named by
    /// id, or chosen by the filters (or `--all`).
    Discard {
        /// Row ids from `list`.
        ids: Vec<i64>,
        /// Every row the filters select (every row, without a filter).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Which rows, instead of ids.
        #[command(flatten)]
        filter: DeadLetterFilterArgs,
        /// Print what would be discarded and remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Why (kept in the audit table). Required.
        #[arg(long)]
        reason: String,
        /// Who (kept in the audit table); default: $USER, else the
        /// database role.
        #[arg(long, env = "USER")]
        actor: Option<String>,
        /// Do not ask for confirmation (needed when stdin is not a
        /// terminal).
        #[arg(long)]
        yes: bool,
    },
}

/// `cdc-relay dead-letter replay`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Replay")]
pub struct ReplayArgs {
    /// Row id from `list`.
    #[arg(conflicts_with = "all")]
    pub id: Option<i64>,
    /// Replay every row the filters select (every row, without a filter),
    /// oldest first.
    #[arg(long)]
    pub all: bool,
    /// Which rows (with `--all`).
    #[command(flatten)]
    pub filter: DeadLetterFilterArgs,
    /// At most this many requests per second (default: as fast as the sink
    /// answers).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// At most this many requests in flight, each for a different
    /// aggregate (an aggregate's events go one at a time, oldest first). The
    /// first request goes alone: the window opens once the sink answers.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_in_flight: u32,
    /// Who replays (kept in the audit table with each removed row);
    /// default: $USER, else the database role.
    #[arg(long, env = "USER")]
    pub actor: Option<String>,
    /// Print what would be sent and send nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the outcome as JSON.
    #[arg(long)]
    pub json: bool,
    /// The sink.
    #[command(flatten)]
    pub sink: SinkArgs,
    /// With `--endpoint NAME`: the routes file whose endpoint NAME the rows
    /// go back to (its URL, secret and request timeout), instead of
    /// --sink-url.
    #[command(flatten)]
    pub routes: crate::routes::args::RoutesArgs,
}

/// Which dead letters (`list`, `replay --all`, `discard --all`): every
/// filter given must match.
#[derive(Clone, Debug, Default, Args)]
#[command(next_help_heading = "Filter")]
pub struct DeadLetterFilterArgs {
    /// Only rows of this event type; `*` matches any characters
    /// (`--type 'Order*'`).
    #[arg(long = "type")]
    pub event_type: Option<String>,
    /// Only rows whose recorded error contains this text, ignoring case
    /// (`http_422`, `unreadable`, `order_already_invoiced`).
    #[arg(long)]
    pub error_contains: Option<String>,
    /// Only rows dead-lettered at or after this time, with its UTC offset
    /// (e.g. '2026-11-30 10:00:00+00').
    #[arg(long)]
    pub since: Option<String>,
    /// Only rows dead-lettered before this time (with its UTC offset).
    #[arg(long)]
    pub until: Option<String>,
    /// Only rows of this aggregate (the aggregate column's value, e.g. an
    /// order id).
    #[arg(long)]
    pub aggregate: Option<String>,
    /// Only rows an endpoint of the routes file refused (its `name`); rows
    /// of one-endpoint mode, unrouted events and unreadable rows have none.
    #[arg(long)]
    pub endpoint: Option<String>,
}

impl DeadLetterFilterArgs {
    /// The filter these flags describe.
    pub fn filter(&self) -> crate::deadletter::Filter {
        crate::deadletter::Filter {
            event_type: self.event_type.clone(),
            reason: self.error_contains.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
            aggregate: self.aggregate.clone(),
            endpoint: self.endpoint.clone(),
        }
    }
}

/// Parses a rate in requests per second: `50`, `2.5`, `100/s`.
fn parse_rate(s: &str) -> Result<f64, String> {
    let n: f64 = s
        .trim()
        .trim_end_matches("/s")
        .parse()
        .map_err(|_| format!("invalid rate {s:?} (requests per second, e.g. 50 or 50/s)"))?;
    if n.is_finite() && n > 0.0 {
        Ok(n)
    } else {
        Err(format!("the rate must be above 0, got {s:?}"))
    }
}

/// `cdc-relay backfill`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Backfill")]
pub struct BackfillArgs {
    /// Re-send rows whose time column is at or after this: a PostgreSQL
    /// timestamptz with its UTC offset, e.g. '2026-11-30 10:00:00+00' (a
    /// time without one is refused: it would be read in the server's zone).
    #[arg(long)]
    pub since: String,
    /// Print what would be re-sent (rows, time range, first and last ids)
    /// and send nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the summary (or, with --dry-run, the preview) as JSON on
    /// stdout; the progress line stays on stderr.
    #[arg(long)]
    pub json: bool,
    /// Only rows before this (with its UTC offset, as --since).
    #[arg(long)]
    pub until: Option<String>,
    /// Stop when no row has been delivered or dead-lettered for this long
    /// while rows wait (the sink stays down), and print the --since to
    /// resume from; exit 1. 0 waits for ever.
    #[arg(long, env = "CDC_RELAY_BACKFILL_GIVE_UP_AFTER", default_value = "10m", value_parser = parse_duration)]
    pub give_up_after: Duration,
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

/// `cdc-relay prune`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Prune")]
pub struct PruneArgs {
    /// Retention window: rows whose time column is older than now minus
    /// this may go (e.g. 7d, 36h). Keep it longer than any backfill you may
    /// need (docs/operations.md, "Outbox retention").
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// Count what would go (rows, partitions) and delete nothing. Still
    /// records a prune mark, the proof a later run uses.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Rows per delete batch, each its own short transaction (about: a
    /// batch is a range of the table's blocks sized from the planner's
    /// rows-per-block estimate). With the default pause, 1000 deleted about
    /// 4,800 rows/s beside a relay delivering 1000 events/s without raising
    /// its p99 (5000: 23,000 rows/s, p99 4x; docs/benchmarks.md).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub batch: u32,
    /// Pause between two batches (leaves room to vacuum, to the relay's
    /// decoding and to other writers).
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub pause: Duration,
    /// How long to wait for the slot to pass the prune mark taken now (a
    /// caught-up relay passes it within about a second). After that the
    /// newest mark the slot has passed is the proof; with none, prune
    /// refuses (exit 1).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Never detach and drop partitions; delete rows only.
    #[arg(long)]
    pub keep_partitions: bool,
    /// Column with the row's insert time (the window applies to it; a
    /// range-partitioned outbox must be partitioned on it for partitions
    /// to be dropped).
    #[arg(long, env = "CDC_RELAY_TIME_COLUMN", default_value = "occurred_at")]
    pub time_column: String,
}

/// What `run` does after a fatal error (`--on-fatal`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnFatal {
    /// Exit at once with the error's code.
    Exit,
    /// Keep serving the admin endpoint, halted, until stopped.
    Linger,
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
        help_heading = "Database",
        long,
        env = "CDC_RELAY_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// Database password (overrides one in the URL).
    #[arg(
        help_heading = "Database",
        long,
        env = "CDC_RELAY_DATABASE_PASSWORD",
        global = true,
        hide_env_values = true
    )]
    pub database_password: Option<String>,
    /// File holding the database password (first line).
    #[arg(
        help_heading = "Database",
        long,
        env = "CDC_RELAY_DATABASE_PASSWORD_FILE",
        global = true
    )]
    pub database_password_file: Option<PathBuf>,
    /// Logical replication slot.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_SLOT",
        default_value = "cdc_relay",
        global = true
    )]
    pub slot: String,
    /// Publication streamed from the slot (comma-separated for several).
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_PUBLICATION",
        default_value = "cdc_relay_outbox",
        global = true,
        value_delimiter = ','
    )]
    pub publication: Vec<String>,
    /// Split the outbox into this many hash shards (1-64), each with its
    /// own publication and slot, `<publication>_<k>of<N>` and
    /// `<slot>_<k>of<N>`: a row filter puts each row in the shard of its
    /// aggregate key's hash (the event id's when the key is NULL or
    /// empty), so an aggregate's events keep their order while the shards
    /// stream in parallel; the order between aggregates of different
    /// shards is not kept. `setup` creates them, `run` claims up to
    /// --max-shards of them, `status` shows each. Unset: one publication
    /// and one slot, named exactly --publication and --slot.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_SHARDS",
        global = true,
        value_parser = clap::value_parser!(u32).range(1..=crate::source::shards::MAX_SHARDS as i64)
    )]
    pub shards: Option<u32>,
    /// A standby to check the slot's failover copy on (PostgreSQL 17+),
    /// libpq URL; repeat or comma-separate for several. A listed server out
    /// of recovery is a primary and is skipped, so list every server of the
    /// cluster. `status` shows each copy; `run` exports
    /// cdc_relay_failover_ready and nudges the primary
    /// (pg_log_standby_snapshot) while a copy is temporary.
    #[arg(
        help_heading = "Database",
        long,
        env = "CDC_RELAY_STANDBY_URLS",
        global = true,
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub standby_url: Vec<String>,
    /// Outbox table, schema-qualified.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_TABLE",
        default_value = "public.outbox",
        global = true
    )]
    pub table: TableName,
    /// Column with the event id (also the Idempotency-Key).
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_ID_COLUMN",
        default_value = "id",
        global = true
    )]
    pub id_column: String,
    /// Column with the event type.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_TYPE_COLUMN",
        default_value = "event_type",
        global = true
    )]
    pub type_column: String,
    /// Column with the JSON payload.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_PAYLOAD_COLUMN",
        default_value = "payload",
        global = true
    )]
    pub payload_column: String,
    /// Column with the aggregate key: events sharing a key are never in
    /// flight together and keep commit order. Empty disables it.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_AGGREGATE_COLUMN",
        default_value = "aggregate_id",
        global = true
    )]
    pub aggregate_column: String,
    /// Connect timeout for database connections.
    #[arg(help_heading = "Database", long, env = "CDC_RELAY_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_duration, global = true)]
    pub connect_timeout: Duration,
    /// Log format.
    #[arg(
        help_heading = "Logging",
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
        help_heading = "Logging",
        long,
        env = "CDC_RELAY_LOG",
        default_value = GlobalArgs::DEFAULT_LOG,
        global = true
    )]
    pub log: String,
}

impl GlobalArgs {
    /// `--log`'s default filter.
    pub const DEFAULT_LOG: &str = "info,pgwire_replication=off";
}

/// An LSN as PostgreSQL prints it: `16/B374D848`.
fn parse_lsn(s: &str) -> Result<crate::lsn::Lsn, String> {
    s.parse().map_err(|e| {
        format!("{e}: an LSN looks like 16/B374D848 (as pg_current_wal_lsn() prints it)")
    })
}

/// `cdc-relay setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Drop and recreate the slot when it is invalidated (wal_status = lost)
    /// or older than its publication. Events committed since its
    /// confirmed_flush_lsn must then be re-sent with `backfill`.
    #[arg(long)]
    pub recreate_slot: bool,
    /// Make the slot a failover slot (PostgreSQL 17+): created with
    /// FAILOVER, or switched on with ALTER_REPLICATION_SLOT, so standbys
    /// running with sync_replication_slots keep a copy that survives a
    /// promotion. Warns when the primary's synchronized_standby_slots is
    /// empty.
    #[arg(long, env = "CDC_RELAY_FAILOVER")]
    pub failover: bool,
}

/// `cdc-relay status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// A relay's admin endpoint to ask (/readyz, /metrics), e.g.
    /// http://10.0.0.7:9187; repeatable. Default: the local relay's
    /// (http:// + CDC_RELAY_ADMIN_LISTEN, else http://127.0.0.1:9187), a
    /// problem only when it answers not ready (a hot standby is fine). A
    /// given one that does not answer, or is not ready, is a problem (exit
    /// 8). Without any relay holding the slot, status exits 8 anyway.
    #[arg(long = "admin-url")]
    pub admin_url: Vec<String>,
}

/// Where and how events are POSTed (`run`, `backfill`, `dead-letter replay`).
#[derive(Debug, Args)]
#[command(next_help_heading = "Sink")]
pub struct SinkArgs {
    /// Inbox URL events are POSTed to (http:// or https://, with a host).
    /// Required to send anything (not by `--dry-run`).
    #[arg(long, env = "CDC_RELAY_SINK_URL", value_parser = parse_sink_url)]
    pub sink_url: Option<url::Url>,
    /// Extra CA certificate (PEM) to trust for an https sink.
    #[arg(long, env = "CDC_RELAY_SINK_CA_FILE")]
    pub sink_ca_file: Option<PathBuf>,
    /// Sink TCP connect timeout (a TLS handshake counts against
    /// --request-timeout, which bounds the whole attempt).
    #[arg(long, env = "CDC_RELAY_SINK_CONNECT_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub sink_connect_timeout: Duration,
    /// Whole-request timeout for one delivery attempt. Must be shorter
    /// than --shutdown-timeout, so an attempt on the wire when SIGTERM
    /// arrives can finish.
    #[arg(long, env = "CDC_RELAY_REQUEST_TIMEOUT", default_value = "4s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// Maximum age of a pooled sink connection: once a connection is this
    /// old it takes no new request, and the next one opens a new connection
    /// with a fresh DNS lookup (a blue/green switch behind one name is
    /// followed within this time). At least 1s.
    #[arg(long, env = "CDC_RELAY_SINK_CONNECTION_MAX_AGE", default_value = "60s", value_parser = parse_duration)]
    pub sink_connection_max_age: Duration,
    /// A pooled sink connection idle for this long is closed by the relay,
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
/// secret of at least 32 bytes, or whsec_<base64> of at least 24 decoded
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

/// `cdc-relay run`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Relay")]
pub struct RunArgs {
    /// After SIGTERM: time to finish the attempts on the wire (no new
    /// attempt starts once shutdown begins) and flush the confirmed LSN.
    /// Must exceed --request-timeout; 5s keeps the stop under a container
    /// runtime's usual 10 s grace.
    #[arg(long, env = "CDC_RELAY_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
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
    /// Connections the admin endpoint serves at once (its own small budget:
    /// a flood on it never starves deliveries of descriptors); idle ones
    /// close after 5 s.
    #[arg(long, env = "CDC_RELAY_ADMIN_MAX_CONNECTIONS", default_value_t = 16)]
    pub admin_max_connections: usize,
    /// /readyz fails when events are pending and the confirmed LSN has not
    /// advanced for this long.
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
    #[arg(long, env = "CDC_RELAY_MAX_SHARDS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=crate::source::shards::MAX_SHARDS as i64))]
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
    /// How far before the last delivered commit a recovery backfill starts
    /// (transactions that were long commit after their rows' insert time).
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
    /// Opt-in retention: delete outbox rows older than this (e.g. 7d) and
    /// proven delivered, at a low rate, from the relay itself (as
    /// `cdc-relay prune` does, rows only: partitions need the table's
    /// owner). The relay's role needs `GRANT DELETE ON <outbox> TO
    /// cdc_relay`. Unset: the relay never deletes.
    #[arg(long, env = "CDC_RELAY_PRUNE_OLDER_THAN", value_parser = parse_duration, help_heading = "Retention")]
    pub prune_older_than: Option<Duration>,
    /// Time between two prune ticks. An idle tick is one statement; keep it
    /// at a minute or more to stay within the idle budget. At least 1s.
    #[arg(long, env = "CDC_RELAY_PRUNE_INTERVAL", default_value = "10m", value_parser = parse_duration, help_heading = "Retention")]
    pub prune_interval: Duration,
    /// Rows per prune batch (about).
    #[arg(long, env = "CDC_RELAY_PRUNE_BATCH", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000), help_heading = "Retention")]
    pub prune_batch: u32,
    /// Pause between two prune batches.
    #[arg(long, env = "CDC_RELAY_PRUNE_PAUSE", default_value = "1s", value_parser = parse_duration, help_heading = "Retention")]
    pub prune_pause: Duration,
    /// Runtime worker threads (CPU cores the relay may keep busy). Default:
    /// one per available CPU. Running beside PostgreSQL on a small machine,
    /// 1 leaves the other cores to the database.
    #[arg(long, env = "CDC_RELAY_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
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

/// Parses `500ms`, `2s`, `1m 30s` (humantime syntax).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 2s, 1m)"))
}

/// Parses a byte size: `1048576`, `64KiB`, `64MiB`, `1GiB` (also kB/MB/GB as powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u32, String> {
    let v = parse_size(s)?;
    u32::try_from(v).map_err(|_| format!("size {:?} is above 4GiB", s.trim()))
}

/// Parses a byte size as [`parse_bytes`] does, up to `TiB`, into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
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
        "t" | "tb" | "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "invalid size unit in {s:?} (use B, KiB, MiB or GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size {s:?} out of range"))
}

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

    #[test]
    fn help_groups_flags_under_headings_and_shows_no_env_values() {
        let mut cmd = Cli::command();
        cmd.build(); // propagates the global flags to the subcommands
        let run = cmd.find_subcommand_mut("run").expect("run");
        let help = run.render_long_help().to_string();
        // heading -> the lines under it, up to the next heading.
        let mut sections: Vec<(String, String)> = Vec::new();
        for line in help.lines() {
            match line.strip_suffix(':') {
                Some(h) if !line.starts_with(' ') && !h.contains(' ') || h == "Slot and outbox" => {
                    sections.push((h.to_owned(), String::new()));
                }
                _ => {
                    if let Some((_, body)) = sections.last_mut() {
                        body.push_str(line);
                        body.push('\n');
                    }
                }
            }
        }
        for (flag, heading) in [
            ("--sink-url", "Sink"),
            ("--event-secret", "Signing"),
            ("--max-in-flight", "Delivery"),
            ("--shutdown-timeout", "Relay"),
            ("--database-url", "Database"),
            ("--slot", "Slot and outbox"),
            ("--log-format", "Logging"),
        ] {
            let (_, body) = sections
                .iter()
                .find(|(h, _)| h == heading)
                .unwrap_or_else(|| panic!("heading {heading:?} in:\n{help}"));
            assert!(
                body.contains(&format!("      {flag} ")),
                "{flag} under {heading}:\n{help}"
            );
        }
        assert!(help.contains("[env: CDC_RELAY_SINK_URL]"), "{help}");
        assert!(
            !help.contains("=]"),
            "no env value or trailing '=':\n{help}"
        );
    }

    fn help_of(path: &[&str]) -> String {
        let mut argv = vec!["cdc-relay"];
        argv.extend_from_slice(path);
        argv.push("--help");
        let err = Cli::command().try_get_matches_from(argv).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
        err.to_string()
    }

    #[test]
    fn each_subcommand_shows_only_the_flags_it_reads() {
        let shows = |path: &[&str], flag: &str| help_of(path).contains(&format!(" {flag} "));
        for (path, shown, hidden) in [
            (
                &["completions"][..],
                &[][..],
                &["--database-url", "--log"][..],
            ),
            (
                &["dead-letter", "list"],
                &["--database-url", "--log-format"],
                &["--slot", "--table", "--standby-url"],
            ),
            (
                &["backfill"],
                &["--database-url", "--table", "--id-column"],
                &["--slot", "--publication", "--standby-url"],
            ),
            (
                &["setup"],
                &["--slot", "--publication", "--table"],
                &["--standby-url"],
            ),
            (&["status"], &["--slot", "--standby-url", "--table"], &[]),
            (&["run"], &["--slot", "--standby-url", "--table"], &[]),
        ] {
            for flag in shown {
                assert!(
                    shows(path, flag),
                    "{path:?} shows {flag}:\n{}",
                    help_of(path)
                );
            }
            for flag in hidden {
                assert!(
                    !shows(path, flag),
                    "{path:?} hides {flag}:\n{}",
                    help_of(path)
                );
            }
        }
        // Hidden, not refused: one set of flags serves every command.
        let cli = Cli::try_parse_from([
            "cdc-relay",
            "--slot",
            "s2",
            "dead-letter",
            "--table",
            "t2",
            "list",
        ])
        .expect("hidden global flags are accepted");
        assert_eq!(
            (
                cli.global.slot.as_str(),
                cli.global.table.to_string().as_str()
            ),
            ("s2", "public.t2")
        );
    }

    #[test]
    fn a_required_setting_is_never_one_an_environment_variable_could_give() {
        // clap's "required argument" error names only the flag; a setting
        // with an environment variable is checked where the error can name
        // both (`--sink-url (or CDC_RELAY_SINK_URL) is required`).
        fn walk(cmd: &clap::Command, path: &str) {
            for a in cmd.get_arguments() {
                assert!(
                    !(a.is_required_set() && a.get_env().is_some()),
                    "{path} {:?} is required by clap but has an env var",
                    a.get_id()
                );
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()));
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        walk(&cmd, "cdc-relay");
        let cli = Cli::try_parse_from(["cdc-relay", "run"]).expect("parses without --sink-url");
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        let err = run.sink.build().unwrap_err();
        assert!(
            err.contains("--sink-url") && err.contains("CDC_RELAY_SINK_URL"),
            "{err}"
        );
    }

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
    fn syntax_errors_name_the_flag() {
        assert!(run_args(&[]).is_ok());
        let err = run_args(&["--max-in-flight", "0"]).unwrap_err().to_string();
        assert!(err.contains("--max-in-flight"), "{err}");
        let err = run_args(&["--backoff-cap", "soon"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--backoff-cap"), "{err}");
        for bad in ["http:///inbox", "http:inbox", "https://", "not a url"] {
            let argv = [
                "cdc-relay",
                "run",
                "--sink-url",
                bad,
                "--max-in-flight",
                "1",
            ];
            let err = Cli::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains("--sink-url"), "{bad}: {err}");
        }
    }

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert!(parse_bytes("5GiB").is_err());
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    }
}
