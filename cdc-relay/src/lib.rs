//! cdc-relay: the transactional outbox, delivered from the WAL.
pub mod lsn;
pub mod pgoutput;
