//! What the relay makes of unusual replication streams and payloads, checked
//! event by event against what PostgreSQL stored.
//!
//! - [`transactions`]: big, aborted, savepoint, prepared and WAL-heavy
//!   transactions.
//! - [`decoding`]: what else the stream carries: schema changes mid-stream
//!   and while stopped, enum types, truncates, logical messages, other
//!   tables, origins, updates and deletes on the outbox.
//! - [`payloads`]: bodies that must reach the sink byte for byte.
//!
//! Every test checks the sink received EXACTLY the expected bodies
//! ([`Scenario::expect_exactly`](harness::Scenario::expect_exactly)): the
//! `data` part byte-identical to `payload::text` as PostgreSQL returned it,
//! each event once, nothing else. "Nothing else" is established without
//! sleeping, by [`settle`](harness::oracle::settle): the relay confirms an
//! LSN only once every transaction before it is done, so once the slot's
//! `confirmed_flush_lsn` passed the WAL position taken after the last
//! statement, every delivery that will ever come for those transactions has
//! come. Each test ends with [`Scenario::finish`](harness::Scenario::finish),
//! which drops its slot.

mod decoding;
mod payloads;
mod transactions;
