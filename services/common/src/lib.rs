//! Plumbing shared by the example Orders, Billing and Payments services.
//!
//! Both services are thin HTTP front ends over one PostgreSQL database each.
//! Everything that is not their business logic lives here, once:
//!
//! ```text
//!  argv/env ──▶ cli ──▶ db::build_pool ─────────────┐
//!                 │                                 ▼
//!                 └──▶ telemetry      server::service_router(app routes)
//!                                        │  /healthz, /metrics, JSON 404/405,
//!                                        │  request timeout, metrics, body limit
//!  TcpListener ─────────────────────────▶ server::serve(listener, router, limits, shutdown)
//!                                           prints `listening on http://ADDR`
//! ```
//!
//! A binary's `main` calls [`service::run`] (the whole of the above, until
//! SIGTERM/SIGINT) and [`service::exit_code`]. Imports between these
//! modules go one way: `service` uses `cli` and `server`, `cli` uses
//! `server`'s argument types, never the other way round.
//!
//! Handlers extract bodies with [`body::JsonBody`] / [`body::RawJsonBody`] and
//! fail with [`error::ServiceError`], which renders
//! `{"error":"<code>","detail":"..."}` with the right status.

pub mod body;
pub mod cli;
pub mod db;
pub mod error;
pub mod idempotency;
pub mod metrics;
pub mod money;
pub mod pool;
pub mod server;
pub mod service;
pub mod telemetry;

pub use error::ServiceError;
