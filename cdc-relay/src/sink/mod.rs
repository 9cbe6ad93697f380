//! The HTTP sink: one file per stage of a delivery.
//!
//! ```text
//! OutboxEvent ─encoder─▶ body + signature ─service─▶ POST ─▶ Attempt ─classify─▶ Disposition
//!                                                       ▲                          │ Retry
//!                                                       └──────── backoff ◀────────┘
//! ```

pub mod backoff;
pub mod classify;
pub mod encoder;
pub mod service;

pub use backoff::Backoff;
pub use classify::{Disposition, StatusPolicy, classify};
pub use encoder::Signer;
pub use service::{Attempt, HttpSink, SinkConfig, SinkError};
