//! The routes file's flags and command: `run --routes FILE`, `dead-letter
//! replay --routes FILE`, `routes check FILE` (`settings` builds the
//! endpoints from them).

use std::path::PathBuf;

use clap::{Args, Subcommand};

/// `--routes`: several endpoints from one slot.
#[derive(Clone, Debug, Default, Args)]
#[command(next_help_heading = "Routes")]
pub struct RoutesArgs {
    /// A routes file (TOML): endpoints, the event types each takes, their
    /// secrets by reference and delivery settings (docs/operations.md,
    /// "Routes file"). Instead of --sink-url; settings an endpoint leaves
    /// out take the flags' values. `cdc-relay routes check FILE` validates
    /// it.
    #[arg(long, env = "CDC_RELAY_ROUTES", conflicts_with = "sink_url")]
    pub routes: Option<PathBuf>,
}

/// `cdc-relay routes …`.
#[derive(Debug, Subcommand)]
pub enum RoutesCommand {
    /// Validate a routes file and print which endpoints each event type of
    /// the outbox's recent rows goes to. Exit 0: valid; 2: invalid (the
    /// message names the file, the endpoint and the key); 1: the database
    /// could not be read.
    Check(CheckArgs),
}

/// `cdc-relay routes check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The routes file.
    pub file: PathBuf,
    /// How many of the outbox's most recent rows (by --time-column) to
    /// read event types from.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(i64).range(1..=10_000_000))]
    pub recent_rows: i64,
    /// The outbox column rows are ordered by (their insert time).
    #[arg(long, env = "CDC_RELAY_TIME_COLUMN", default_value = "occurred_at")]
    pub time_column: String,
    /// Only validate the file (secrets included); do not read the outbox.
    #[arg(long)]
    pub offline: bool,
}
