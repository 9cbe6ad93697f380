//! The throwaway-PostgreSQL harness: one implementation behind the system
//! tests, the benchmarks and the demo.
//!
//! ```text
//!  bins::path("cdc-relay") ──▶ process::ServiceProcess ──▶ logs, listen_addr, signals
//!                                        │ connects to
//!  pg::PgCluster::start / shared() ──▶ stack::Stack (orders_N + billing_N, roles, publication;
//!        │                                          payments_N on demand: create_payments)
//!        │    └── start_standby ──▶ standby::Standby (pg_basebackup, streaming, promote)
//!        │
//!        └── guardian (sh) ── kills the postmaster if this process dies, even by SIGKILL
//! ```
//!
//! - [`pg`] owns one PostgreSQL cluster in a temporary directory: `initdb`,
//!   settings for logical replication, start/stop/restart/kill, and the
//!   guarantee that no postmaster outlives the process that started it.
//! - [`pgbin`] finds the server binaries (`CDC_RELAY_PG_BINDIR`, e.g. from
//!   `tests/pg-install.sh`), reads their major version, and starts each of
//!   them with the installation's `lib` on `LD_LIBRARY_PATH`; `pgfiles`
//!   writes a cluster's `pg_hba.conf` and `harness.conf`.
//! - [`standby`] adds a streaming physical standby to a cluster
//!   (`pg_basebackup`, physical slot, failover-slot sync on 17+) and
//!   promotes it: the base of the failover tests.
//! - [`stack`] creates a fresh pair of databases per test from the operator
//!   files in `sql/`, with least-privilege roles and per-stack names.
//! - [`process`] runs one of our binaries with its output captured.
//! - [`bins`] finds (and builds once) the workspace binaries.
//! - [`app`] starts Orders, Billing and the relay on a stack, runs
//!   `cdc-relay` as a CLI command, and reads the relay's sessions from its log.
//! - [`sink`] is the scripted in-process HTTP sink; [`proxy`] the
//!   fault-injecting TCP proxy; [`chaos`] the chaos run built from them
//!   (its fronts and the proxy share `tcp`'s accept loop).
//! - [`wait`] is the bounded polling every wait goes through.
//! - [`scenario`] is the preamble of most system tests in one call (stack,
//!   setup, inbox, relay streaming); [`oracle`] is what a test judges the
//!   outcome by: the ledger, the slot's confirmed position (`settle`, the
//!   one way to prove nothing else happened), the exact expected events.
//! - [`otlp`] is a real OTLP/HTTP receiver (protobuf), collecting spans.
//! - [`prom`] parses the Prometheus text format strictly, for tests, demo
//!   and benchmark alike; [`stats`] holds the one percentile definition.

pub mod app;
pub mod bins;
pub mod chaos;
pub mod debian;
mod guardian;
pub mod oracle;
pub mod otlp;
pub mod pg;
pub mod pgbin;
mod pgfiles;
pub mod pki;
pub mod pooler;
pub mod process;
pub mod prom;
pub mod proxy;
pub mod scenario;
pub mod sink;
pub mod stack;
pub mod standby;
pub mod stats;
mod tcp;
pub mod tls_sink;
pub mod wait;

pub use pg::{ClusterOptions, PgCluster, StopMode};
pub use process::ServiceProcess;
pub use scenario::{Inbox, Scenario};
pub use stack::{Stack, StackOptions, connect, first_column};
pub use standby::{Standby, StandbyOptions};
pub use wait::wait_until;
