//! The end-state oracles every system test judges the relay by.
//!
//! - [`ledger`]: what was committed against what took effect in Billing
//!   (lost, duplicated, phantom).
//! - [`charges`]: the payment provider's charges against Billing's invoices,
//!   per order (once, never, twice): the effect outside the databases.
//! - [`slot`]: the slot's own account of progress, and [`settle`], the one
//!   way a test proves that something did NOT happen: the relay confirms a
//!   position only once every transaction before it is done, so once the
//!   slot's `confirmed_flush_lsn` passed the WAL position taken after the
//!   last statement, every delivery that will ever come for those
//!   transactions has come. No sleep can promise that.
//! - [`expected`]: the events PostgreSQL committed, read back as it returned
//!   them, and the check that a sink received exactly those, byte for byte.
//! - [`accounting`]: the proof-wide ledger for any inbox: every outbox row
//!   delivered or dead-lettered (balanced), or else still held by the slot,
//!   which [`held`] proves by peeking at it.

pub mod accounting;
pub mod charges;
pub mod expected;
pub mod held;
pub mod ledger;
pub mod slot;

pub use accounting::Accounting;
pub use charges::Charges;
pub use expected::{Expected, arrival_ids, assert_exact, body_id};
pub use ledger::{Ledger, wait_ledger_clean};
pub use slot::{SlotPosition, settle, slot_position, wal_position, walsender_pid};
