//! What the relay reads from (and creates in) the source database's catalog
//! on a normal SQL connection, by subject:
//!
//! - `slots`: the slot's row ([`SlotInfo`]), the other logical slots,
//!   a new slot's birth in the prune marks, and whether its pending WAL
//!   predates a publication (creating a slot is `source::slot_creation`);
//! - `membership`: whether the outbox is in its publications
//!   ([`Membership`]);
//! - `monitor`: the slot monitor's one statement reading both;
//! - `settings`: server settings and what the version allows;
//! - `outbox`: the checks that the outbox table and the publications are
//!   what the relay needs before it streams, and relation lookups.
//!
//! Every function returns [`SourceError`](super::SourceError): a
//! precondition the operator must fix is
//! [`SourceError::Definite`](super::SourceError::Definite) with a message
//! that names the setting; a failed statement is classified by
//! [`SourceError::sql`](super::SourceError::sql).

use crate::outbox::TableName;

mod membership;
mod monitor;
mod outbox;
mod settings;
mod slots;

pub use membership::{Membership, membership, membership_problem};
pub use monitor::{
    DEAD_LETTERS_COUNTED, MonitorReading, dead_letter_table_exists, dead_letters_waiting,
    monitor_reading,
};
pub use outbox::{
    OutboxTable, check_outbox_table, check_stream_config, partition_root, payload_type_message,
    publication_warnings, relation_name, table_oid,
};
pub use settings::{
    parse_pg_duration, server_encoding, server_version, setting, supports_failover_slots,
    wal_sender_timeout,
};
pub use slots::{
    OtherSlot, SlotInfo, SlotReading, check_slot_name, other_logical_slots, record_slot_birth,
    slot_elsewhere, slot_held_by, slot_info, slot_predates_publication,
};

/// Quotes an SQL identifier (`outbox` → `"outbox"`, `a"b` → `"a""b"`).
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `"schema"."table"`.
pub fn quote_table(t: &TableName) -> String {
    format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("outbox"), "\"outbox\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
