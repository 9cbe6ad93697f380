//! The flags of `setup`, `status`, `backfill` and `prune`.

use super::*;

/// `cdc-relay backfill`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Backfill")]
pub struct BackfillArgs {
    /// Traces: each attempt of a row with a stored trace context as a span
    /// of that trace, exported over OTLP/HTTP.
    #[command(flatten)]
    pub trace: trace_context::TraceArgs,
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
    /// this may go (e.g. 7d, 36h; above 0). Keep it longer than any
    /// backfill you may need (docs/operations.md, "Outbox retention").
    #[arg(long, value_parser = parse_retention)]
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
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000), allow_negative_numbers = true)]
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
