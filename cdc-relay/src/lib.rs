//! cdc-relay: the transactional outbox, delivered from the WAL.
//!
//! An application commits a business row and an outbox row in one
//! transaction. The relay streams the outbox's inserts from a logical
//! replication slot (plugin `pgoutput`), POSTs each one, HMAC-signed, to an
//! inbox endpoint, and lets the slot advance only past transactions whose
//! events all got a 2xx (or were dead-lettered).
//!
//! ```text
//!  PostgreSQL ──START_REPLICATION──▶ source::stream ──▶ pgoutput::decode ──▶ outbox::OutboxMapper
//!      ▲                                  │ admit (dispatch::Window)                │ OutboxEvent
//!      │ standby status update            ▼                                         ▼
//!      │ (Transport::confirm)      dispatch::run ──▶ dispatch::scheduler ──▶ dispatch::delivery ──▶ sink ──POST──▶ inbox
//!      │                                  │ complete                                 │ classify, breaker,
//!      └──── confirmed LSN (watch) ◀── ack::AckTracker ◀───────────────────────────────┘ dead_letter
//! ```
//!
//! Why the progress rule is safe: PostgreSQL resumes a slot at its
//! `confirmed_flush_lsn` and re-sends every transaction that ends after it
//! ("Logical Decoding Concepts" → "Replication Slots" in the PostgreSQL docs).
//! [`ack::AckTracker`] confirms only the end LSN of the longest prefix of
//! transactions whose events are all done, so a crash at any instant
//! redelivers, and never loses, an event. The whole design, in prose, is in
//! `docs/architecture.md`.
//!
//! Modules by role. Imports point down this list or stay within a group,
//! never up, and the import graph has no cycles, nor has the graph between
//! the modules of `source/` or of `dispatch/` (the `module_graph` test
//! checks all three):
//!
//! 1. operator surface: [`cli`] (the clap schema), [`settings`] (validate
//!    and build), [`routes`] (the routes file), [`commands`] (one module
//!    per command)
//! 2. engines: [`relay`] (`run`'s session supervisor), [`backfill`]
//!    (re-send from the table), [`prune`] (retention: delete delivered
//!    rows), [`admin`] (the admin endpoint)
//! 3. the pipeline, in flow order — [`source`] → [`pgoutput`] → [`outbox`]
//!    → [`dispatch`] → [`sink`] → [`ack`] — and its policies: [`breaker`]
//!    (circuit breaker, storm guard), [`dead_letter`] (where poison goes);
//!    what a response means is [`sink::classify`](mod@sink::classify)
//! 4. shared types: [`lsn`], [`clock`] (the server's time and ours),
//!    [`metrics`], [`endpoint_metrics`], [`health`],
//!    [`backoff`], [`pace`] (rate caps), [`redact`] (how a URL is shown; trace-context's),
//!    and the
//!    error-text helpers below

// 1. Operator surface.
/// The git commit the binary was built from (12 hex digits, or `unknown`;
/// see `build.rs`).
pub const GIT_COMMIT: &str = env!("CDC_RELAY_GIT_COMMIT");

/// `--version`: the package version and the commit, e.g. `0.1.0 (8ce51a9c0f12)`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("CDC_RELAY_GIT_COMMIT"),
    ")"
);

pub mod cli;
pub mod commands;
pub mod routes;
pub mod settings;

// 2. Engines.
pub mod admin;
pub mod backfill;
pub mod prune;
pub mod relay;

// 3. The pipeline, in flow order, and its policies.
pub mod source;

pub mod pgoutput;

pub mod outbox;

pub mod dispatch;

pub mod sink;

pub mod ack;

pub mod breaker;
pub mod dead_letter;

// 4. Shared types.
pub mod backoff;
pub mod clock;
pub mod endpoint_metrics;
pub mod health;
pub mod locks;
pub mod lsn;
pub mod metrics;
pub mod pace;
pub use trace_context::redact;
pub mod reread;

/// An optional value for a log field: the value's `Display`, or `none`
/// (never Rust's `Some(…)`). `event_id = %shown(&row.event_id)`.
pub fn shown<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "none".to_owned(), ToString::to_string)
}

/// An error and its `source()` chain, joined with ": " (one line for logs
/// and operator messages; many library errors say only their outermost
/// layer in `Display`).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// The server's own message and SQLSTATE when there is one
/// (tokio-postgres' `Display` says only "db error"), else the error chain.
pub fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => error_chain(e),
    }
}
