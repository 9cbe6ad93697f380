//! pgoutput, protocol version 1: the messages a logical replication slot
//! using the `pgoutput` plugin sends inside XLogData, and a decoder for them.
//!
//! Source of truth: PostgreSQL's "Logical Replication Message Formats"
//! (§55.9 of the PostgreSQL 15 manual), cross-checked against the server's
//! `src/backend/replication/logical/proto.c`.
//!
//! ```text
//! XLogData payload ──decode()──▶ LogicalMessage (Relation, Insert, …)
//! ```
//!
//! A transaction arrives as `Begin`, then any number of `Relation`, `Type`,
//! `Origin`, `Insert`, `Update`, `Delete`, `Truncate` and transactional
//! `Message`s, then `Commit`. Non-transactional `Message`s may arrive
//! outside any transaction.
//!
//! - [`decode`] turns one payload into a [`LogicalMessage`]; any malformed
//!   input is a [`DecodeError`] naming the message kind and byte offset,
//!   never a panic. Column values are zero-copy slices of the payload.
//! - Keeping the latest [`Relation`] per OID is the consumer's job
//!   ([`crate::outbox::OutboxMapper`] does it for the outbox table).
//! - [`encode`] is the inverse of [`decode`], for tests and tools.
//!
//! Streaming (protocol version 2) and two-phase commit (version 3) messages
//! are rejected with [`DecodeError::UnsupportedMessage`]: start replication
//! with `proto_version '1'` and without `streaming` or `two_phase`.

mod decode;
mod encode;
mod message;

pub use decode::{DecodeError, decode};
pub use encode::encode;
pub use message::{
    Begin, Column, ColumnFlags, ColumnValue, Commit, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, MessageFlags, MessageKind, OldTuple, OldTupleKind, Origin, Relation,
    RelationId, ReplicaIdentity, Truncate, TruncateOptions, TupleData, TypeMessage, Update,
};

#[cfg(test)]
mod tests;
