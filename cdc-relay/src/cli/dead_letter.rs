//! `cdc-relay dead-letter …`: the subcommands, the replay's flags and the
//! filters shared by list, replay and discard.

use super::*;

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
        /// At most this many rows (the oldest); 1 or more. Without it,
        /// every row, read and printed a page at a time.
        #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(1..), allow_negative_numbers = true)]
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
        /// Why (kept in the audit table as the discard's reason). Required,
        /// not blank.
        #[arg(long, value_parser = parse_note)]
        note: String,
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
    /// Traces: each attempt of a row with a stored trace context as a span
    /// of that trace, exported over OTLP/HTTP.
    #[command(flatten)]
    pub trace: trace_context::TraceArgs,
    /// Row ids from `list`, in any order: an aggregate's rows go oldest
    /// first (all rows in id order with --max-in-flight 1).
    #[arg(conflicts_with = "all")]
    pub ids: Vec<i64>,
    /// Replay every row the filters select (every row, without a filter),
    /// oldest first.
    #[arg(long)]
    pub all: bool,
    /// Which rows (with `--all`).
    #[command(flatten)]
    pub filter: DeadLetterFilterArgs,
    /// At most this many requests per second (default: as fast as the sink
    /// answers).
    #[arg(long, value_parser = parse_rate, allow_negative_numbers = true)]
    pub rate: Option<f64>,
    /// At most this many requests in flight, each for a different
    /// aggregate (an aggregate's events go one at a time, oldest first). The
    /// first request goes alone: the window opens once the sink answers.
    #[arg(long, env = "CDC_RELAY_MAX_IN_FLIGHT", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096), allow_negative_numbers = true)]
    pub max_in_flight: u32,
    /// Events one request may carry at most (a batch,
    /// `docs/architecture.md#batches`; only for a receiver that takes
    /// batches). Default: the routes file endpoint's `batch_max_events`
    /// with `--routes`, else 1 (one request per row). A batch the sink
    /// refuses is split down to the refused row, which is kept.
    #[arg(long, env = "CDC_RELAY_BATCH_MAX_EVENTS", value_parser = clap::value_parser!(u32).range(1..=1000), allow_negative_numbers = true)]
    pub batch_max_events: Option<u32>,
    /// A batch's body size at most. Default: the routes file endpoint's
    /// `batch_max_bytes` with `--routes`, else 48KiB.
    #[arg(long, env = "CDC_RELAY_BATCH_MAX_BYTES", value_parser = super::parse_batch_bytes)]
    pub batch_max_bytes: Option<u32>,
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
    #[arg(long = "type", value_parser = parse_filter)]
    pub event_type: Option<String>,
    /// Only rows whose reason (the recorded error) contains this text,
    /// ignoring case (`parked`, `unrouted`, `unreadable`, `http_422`,
    /// `order_already_invoiced`).
    #[arg(long, visible_alias = "error-contains", value_parser = parse_filter)]
    pub reason: Option<String>,
    /// Only rows dead-lettered at or after this time, with its UTC offset
    /// (e.g. '2026-11-30 10:00:00+00').
    #[arg(long, value_parser = parse_filter)]
    pub since: Option<String>,
    /// Only rows dead-lettered before this time (with its UTC offset).
    #[arg(long, value_parser = parse_filter)]
    pub until: Option<String>,
    /// Only rows of this aggregate (the aggregate column's value, e.g. an
    /// order id).
    #[arg(long, value_parser = parse_filter)]
    pub aggregate: Option<String>,
    /// Only rows an endpoint of the routes file refused (its `name`); rows
    /// of one-endpoint mode, unrouted events and unreadable rows have none.
    #[arg(long, value_parser = parse_filter)]
    pub endpoint: Option<String>,
}

/// Parses a rate in requests per second: `50`, `2.5`, `100/s`.
fn parse_rate(s: &str) -> Result<f64, String> {
    let n: f64 = s
        .trim()
        .trim_end_matches("/s")
        .parse()
        .map_err(|_| format!("invalid rate {s:?} (requests per second, e.g. 50 or 50/s)"))?;
    if crate::pace::valid_rate(n) {
        Ok(n)
    } else {
        Err(format!(
            "the rate must be from {} to {} requests per second, got {s:?}",
            crate::pace::MIN_RATE,
            crate::pace::MAX_RATE
        ))
    }
}
