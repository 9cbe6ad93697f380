//! cdc-relay: the transactional outbox, delivered from the WAL.
//!
//! An application commits a business row and an outbox row in one
//! transaction. The relay streams the outbox's inserts from a logical
//! replication slot (plugin `pgoutput`), POSTs each one, HMAC-signed, to an
//! inbox endpoint, and lets the slot advance only past transactions whose
//! events all got a 2xx.
//!
//! ```text
//!  PostgreSQL ──pgoutput──▶ source ──▶ pgoutput::decode ──▶ outbox (events)
//!      ▲                                                        │
//!      │ standby status update                                 ▼ window (events, bytes)
//!      │ (confirmed LSN)                                    dispatch ──▶ sink ──POST──▶ inbox
//!      └──────────────── ack (done prefix) ◀── completions ─────┘
//! ```
//!
//! Why the progress rule is safe: PostgreSQL resumes a slot at its
//! `confirmed_flush_lsn` and re-sends every transaction that ends after it
//! ("Logical Decoding Concepts" → "Replication Slots" in the PostgreSQL docs).
//! [`ack::AckTracker`] confirms only the end LSN of the longest prefix of
//! transactions whose events are all done, so a crash at any instant
//! redelivers, and never loses, an event.

pub mod ack;
pub mod admin;
pub mod backfill;
pub mod breaker;
pub mod config;
pub mod deadletter;
pub mod dispatch;
pub mod lsn;
pub mod metrics;
pub mod outbox;
pub mod pgoutput;
pub mod relay;
pub mod setup;
pub mod sink;
pub mod source;
pub mod tls;

/// An error and its `source()` chain, joined with ": " (one line for logs
/// and operator messages; many library errors say only their outermost
/// layer in `Display`).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}
