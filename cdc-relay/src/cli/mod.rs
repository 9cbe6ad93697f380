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

mod dead_letter;
mod env_errors;
mod maintenance;
mod parse;
mod run;

pub use dead_letter::{DeadLetterCommand, DeadLetterFilterArgs, ReplayArgs};
pub use env_errors::environment_notes;
use env_errors::{conflict_from_env, env_behind, negative_values_joined};
pub use maintenance::{BackfillArgs, PruneArgs, SetupArgs, StatusArgs};
use parse::*;
pub use parse::{parse_batch_bytes, parse_bytes, parse_duration, parse_size, parse_timeout};
pub use run::{DeliveryArgs, RunArgs, SecretArgs, SinkArgs, default_worker_threads};

/// Streams a PostgreSQL outbox table through a pgoutput logical replication
/// slot and POSTs each committed insert, HMAC-signed, to an HTTP inbox. The
/// slot's confirmed LSN advances only past transactions whose events all got
/// a 2xx (or were dead-lettered): delivery is at-least-once, so the receiver
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
/// when the database is fine but no relay delivers, 9 when the slot is
/// about to be invalidated (wal_status unreserved), and 10 when an endpoint
/// of a routes file is parked or its circuit is open (the others deliver).
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
    /// prints it and exits 2 (or 0 for `--help` and `--version`). A value
    /// refused for being empty that came from an empty environment
    /// variable (`CDC_RELAY_DATABASE_PASSWORD_FILE=` in an env file) is
    /// named by that variable, not by the flag the command line never had.
    pub fn parse_args() -> Cli {
        let command = Cli::command();
        let argv = negative_values_joined(&command, std::env::args_os().collect());
        let matches = command.clone().try_get_matches_from(argv).unwrap_or_else(|mut e| {
            if let Some(said) = conflict_from_env(&command, &e) {
                eprintln!("{said}");
                std::process::exit(2);
            }
            if let Some((env, flag, value)) = env_behind(&command, &e) {
                if value.is_empty() {
                    eprintln!(
                        "error: {env} is set but empty: unset it, or give it a value ({flag})"
                    );
                    std::process::exit(2);
                }
                use clap::error::{ContextKind, ContextValue};
                e.insert(
                    ContextKind::Suggested,
                    ContextValue::StyledStrs(vec![
                        format!("the value came from the environment variable {env} ({flag} was not given): fix or unset {env}").into(),
                    ]),
                );
            }
            e.exit()
        });
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
const SLOT_CREATE_FLAGS: &[&str] = &["slot_create_timeout"];
const STANDBY_FLAGS: &[&str] = &["standby_url"];
const REPLICATION_FLAGS: &[&str] = &["replication_url"];
const OUTBOX_FLAGS: &[&str] = &[
    "table",
    "id_column",
    "type_column",
    "payload_column",
    "aggregate_column",
    "trace_column",
];
const LOG_FLAGS: &[&str] = &["log_format", "log"];

/// The global flag groups a subcommand reads; `None` for every group.
fn globals_read_by(subcommand: &str) -> Option<&'static [&'static [&'static str]]> {
    match subcommand {
        "setup" => Some(&[
            DATABASE_FLAGS,
            REPLICATION_FLAGS,
            SLOT_FLAGS,
            SLOT_CREATE_FLAGS,
            OUTBOX_FLAGS,
            LOG_FLAGS,
        ]),
        "prune" => Some(&[DATABASE_FLAGS, SLOT_FLAGS, OUTBOX_FLAGS, LOG_FLAGS]),
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
        SLOT_CREATE_FLAGS,
        STANDBY_FLAGS,
        REPLICATION_FLAGS,
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
    /// Inspect and resolve dead letters (poison events and parked endpoints' events).
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
    /// The replication connection's own URL, when it must reach the
    /// server by another route than --database-url: e.g. the side
    /// connection through a session-mode pooler (PgBouncer) while the
    /// stream goes straight to PostgreSQL, which a pooler cannot carry.
    /// One host, the server the slot is on, and the same database (checked
    /// at start: exit 2 otherwise); without a password it uses the one
    /// --database-url logs in with (its URL's, --database-password or its
    /// file). Its TLS parameters are its own, as in libpq: repeat sslmode,
    /// sslrootcert, sslcert and sslkey here (nothing is taken from
    /// --database-url; with no sslmode here while --database-url verifies
    /// the server, it exits 2). Default: --database-url's server.
    #[arg(
        help_heading = "Database",
        long,
        env = "CDC_RELAY_REPLICATION_URL",
        global = true,
        hide_env_values = true
    )]
    pub replication_url: Option<String>,
    /// Database password (overrides one in --database-url; a
    /// --replication-url with a password of its own keeps it, one without
    /// uses this).
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
    /// Logical replication slot (lower-case letters, digits and
    /// underscores, at most 63: PostgreSQL's rule for slot names).
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_SLOT",
        default_value = "cdc_relay",
        global = true,
        value_parser = parse_slot_name
    )]
    pub slot: String,
    /// Publication streamed from the slot (comma-separated for several).
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_PUBLICATION",
        default_value = "cdc_relay_outbox",
        global = true,
        value_delimiter = ',',
        value_parser = parse_publication_name
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
        value_parser = clap::value_parser!(u32).range(1..=crate::source::shards::MAX_SHARDS as i64), allow_negative_numbers = true
    )]
    pub shards: Option<u32>,
    /// How long creating a slot (`setup`, `run --create-slot`) may wait for
    /// the transactions older than it to end before it gives up, enforced
    /// by the server (statement_timeout): no backend is left creating it.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_SLOT_CREATE_TIMEOUT",
        default_value = "3m",
        value_parser = parse_duration,
        global = true
    )]
    pub slot_create_timeout: Duration,
    /// A standby to check the slot's failover copy on (PostgreSQL 17+),
    /// libpq URL or key/value string; repeat for several, or separate
    /// URLs with a comma or space (a comma inside one URL, as in
    /// `postgres://a,b/db`, stays part of it). A listed server out
    /// of recovery is a primary and is skipped, so list every server of the
    /// cluster. `status` shows each copy; `run` exports
    /// cdc_relay_failover_ready and nudges the primary
    /// (pg_log_standby_snapshot) while a copy is temporary.
    #[arg(
        help_heading = "Database",
        long,
        env = "CDC_RELAY_STANDBY_URLS",
        global = true,
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
        global = true,
        value_parser = parse_column_name
    )]
    pub id_column: String,
    /// Column with the event type.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_TYPE_COLUMN",
        default_value = "event_type",
        global = true,
        value_parser = parse_column_name
    )]
    pub type_column: String,
    /// Column with the JSON payload.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_PAYLOAD_COLUMN",
        default_value = "payload",
        global = true,
        value_parser = parse_column_name
    )]
    pub payload_column: String,
    /// Column with the aggregate key: events sharing a key are never in
    /// flight together and keep commit order. Empty disables it.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_AGGREGATE_COLUMN",
        default_value = "aggregate_id",
        global = true,
        value_parser = parse_optional_column_name
    )]
    pub aggregate_column: String,
    /// Column with each row's W3C trace context (`traceparent`, then a
    /// space and `tracestate` when there is one): every delivery attempt
    /// carries it to the endpoint, and is a span of that trace with
    /// --otlp-endpoint. Default: `trace_context` when the table has it,
    /// else none. Named here, the column must exist; empty disables it.
    #[arg(
        help_heading = "Slot and outbox",
        long,
        env = "CDC_RELAY_TRACE_COLUMN",
        value_name = "COLUMN",
        global = true,
        value_parser = parse_optional_column_name
    )]
    pub trace_column: Option<String>,
    /// Connect timeout for database connections.
    #[arg(help_heading = "Database", long, env = "CDC_RELAY_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_timeout, global = true)]
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

#[cfg(test)]
mod tests;
