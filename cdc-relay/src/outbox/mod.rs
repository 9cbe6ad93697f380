//! Outbox events: from decoded pgoutput inserts to the events the sink posts.
//!
//! Only inserts into the configured table become events. Columns are found
//! by name in the latest Relation message for the table (pgoutput sends one
//! before the first change of a relation in a session and again after every
//! schema change), so columns may be added, dropped or reordered while the
//! relay streams or sleeps. With `publish_via_partition_root`, inserts into a
//! partitioned outbox's leaves arrive under the root's name and map the same.

mod mapper;

use std::fmt;

use bytes::Bytes;

use crate::lsn::Lsn;
pub use mapper::{OutboxMapper, RelationKind};

/// Type OIDs the payload column may have (PostgreSQL's `pg_type.dat`):
/// `json` and `jsonb`, whose text output is always valid JSON.
pub const JSON_TYPES: [u32; 2] = [114, 3802];

/// One committed outbox insert, ready for delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The id column as text (the tutorial's schema: a uuid). Also the
    /// idempotency key.
    pub id: String,
    /// The event type column as text, e.g. `OrderCreated`.
    pub event_type: String,
    /// The payload column's text output exactly as PostgreSQL printed it
    /// (JSON for `json`/`jsonb`); `None` for SQL NULL.
    pub payload: Option<Bytes>,
    /// The aggregate key column as text: events sharing a key are delivered
    /// one at a time in commit order. `None` when unconfigured or NULL.
    pub aggregate_key: Option<String>,
    /// LSN of the commit record of the event's transaction; `None` for a
    /// row a backfill read from the table.
    pub commit_lsn: Option<Lsn>,
    /// Commit time of the event's transaction, microseconds since
    /// 2000-01-01 00:00:00 UTC (PostgreSQL's epoch).
    pub commit_time_micros: i64,
    /// The dead-letter row this event was read back from, when a replay
    /// sends it again (`dispatch::replay`); `None` for an event of the
    /// stream or of a backfill.
    pub dead_letter_id: Option<i64>,
    /// The trace context stored with the row (`--trace-column`): each
    /// delivery attempt is a span in that trace. `None` without the
    /// column, for NULL, or for a value that is not a valid `traceparent`.
    pub trace: Option<trace_context::SpanContext>,
}

impl OutboxEvent {
    /// Bytes this event holds in memory (for the relay's byte-bounded window).
    pub fn size_bytes(&self) -> usize {
        self.id.len()
            + self.event_type.len()
            + self.payload.as_ref().map_or(0, Bytes::len)
            + self.aggregate_key.as_ref().map_or(0, String::len)
            + self
                .trace
                .as_ref()
                .map_or(0, |_| trace_context::stored::MAX_HELD)
            + 64
    }
}

/// A schema-qualified table name, e.g. `public.outbox`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableName {
    /// Schema (namespace), e.g. `public`.
    pub schema: String,
    /// Table name, e.g. `outbox`.
    pub name: String,
}

impl std::str::FromStr for TableName {
    type Err = String;

    /// Parses `schema.table` or `table` (schema `public`). Names are taken
    /// literally, as stored in the catalog (no quoting, no case folding).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (schema, name) = s.split_once('.').unwrap_or(("public", s));
        if schema.is_empty() || name.is_empty() || name.contains('.') {
            return Err(format!(
                "invalid table name {s:?}: expected schema.table, e.g. public.outbox"
            ));
        }
        for part in [schema, name] {
            if part.len() > 63 || part.trim() != part || part.contains('\0') {
                return Err(format!(
                    "invalid table name {s:?}: {part:?} is not a name PostgreSQL keeps (1 to 63 bytes, no space at either end, no NUL)"
                ));
            }
        }
        Ok(TableName {
            schema: schema.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// Which outbox columns hold what. Defaults follow the tutorial's schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    /// Event id column (default `id`).
    pub id: String,
    /// Event type column (default `event_type`).
    pub event_type: String,
    /// Payload column (default `payload`).
    pub payload: String,
    /// Aggregate key column (default `aggregate_id`); `None` disables
    /// per-aggregate ordering.
    pub aggregate_key: Option<String>,
    /// Trace context column (default `trace_context` when the table has
    /// it); `None` disables reading one.
    pub trace: Option<TraceColumn>,
}

/// The column holding each row's W3C trace context
/// (`trace_context::stored`'s text form).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceColumn {
    /// Its name.
    pub name: String,
    /// Named by `--trace-column`: a table without it is a configuration
    /// error. Otherwise (the default name) a table without it has no trace
    /// context, and its events are delivered untraced.
    pub required: bool,
}

impl TraceColumn {
    /// The default column, read when the table has it.
    pub const DEFAULT: &str = "trace_context";
}

impl OutboxColumns {
    /// The configured column names (the aggregate key's when set).
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![
            self.id.clone(),
            self.event_type.clone(),
            self.payload.clone(),
        ];
        names.extend(self.aggregate_key.clone());
        names.extend(
            self.trace
                .iter()
                .filter(|t| t.required)
                .map(|t| t.name.clone()),
        );
        names
    }
}

impl Default for OutboxColumns {
    fn default() -> Self {
        OutboxColumns {
            id: "id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            aggregate_key: Some("aggregate_id".into()),
            trace: Some(TraceColumn {
                name: TraceColumn::DEFAULT.into(),
                required: false,
            }),
        }
    }
}

/// An outbox insert whose row cannot become an event (a NULL id or type,
/// text that is not UTF-8): dead-lettered with whatever is readable,
/// lossily, never sent and never skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadableRow {
    /// The id column, if readable.
    pub event_id: Option<String>,
    /// The aggregate key column, if readable.
    pub aggregate_key: Option<String>,
    /// The type column, if readable.
    pub event_type: Option<String>,
    /// The payload column's bytes as the server sent them (not
    /// necessarily UTF-8).
    pub payload: Option<Bytes>,
    /// Commit LSN of the row's transaction (`None` for a backfill).
    pub commit_lsn: Option<Lsn>,
    /// What is wrong with the row.
    pub problem: String,
}

impl UnreadableRow {
    /// Bytes this row holds in memory (for the window).
    pub fn size_bytes(&self) -> usize {
        [&self.event_id, &self.aggregate_key, &self.event_type]
            .iter()
            .map(|v| v.as_ref().map_or(0, String::len))
            .sum::<usize>()
            + self.payload.as_ref().map_or(0, Bytes::len)
            + self.problem.len()
            + 64
    }
}

/// What an insert maps to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// An outbox event to deliver.
    Event(OutboxEvent),
    /// An outbox row that cannot become an event: to dead-letter.
    Unreadable(UnreadableRow),
    /// An insert into another table of the publication.
    OtherTable,
}

/// Why an outbox insert could not be mapped at all: the table no longer
/// matches the configuration. The relay stops without acknowledging it:
/// nothing is skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboxError {
    /// The latest Relation message for the outbox lacks a configured column.
    #[error(
        "table {table} has no column {column:?} (set by {setting}); fix the table or the setting"
    )]
    MissingColumn {
        /// The outbox table.
        table: String,
        /// The configured column name that was not found.
        column: String,
        /// The CLI flag that names the column.
        setting: &'static str,
    },
    /// The relation that was the outbox now has another name than
    /// `--table` (renamed while the relay streamed): its changes would no
    /// longer be the configured table's.
    #[error(
        "the outbox {table} (relation OID {oid}) was renamed to {now}; the relay stopped before acknowledging anything from it on. If the rename is intended, start the relay with --table {now} (CDC_RELAY_TABLE): nothing after this point was confirmed, so nothing is lost"
    )]
    Renamed {
        /// The configured table.
        table: String,
        /// The relation's OID.
        oid: u32,
        /// Its name now (`schema.name`).
        now: String,
    },
    /// A partitioned outbox now has another name than `--table`, found by
    /// the slot monitor: the stream carries its partitions' rows through
    /// the root's OID and never describes the root again under its new
    /// name, so what the relay delivered meanwhile was the renamed table's.
    #[error(
        "the partitioned outbox {table} (relation OID {oid}) was renamed to {now}; the relay stopped when its slot monitor found it (the events it delivered meanwhile were the renamed table's: nothing is lost). If the rename is intended, start the relay with --table {now} (CDC_RELAY_TABLE)"
    )]
    RenamedPartitioned {
        /// The configured table.
        table: String,
        /// The relation's OID.
        oid: u32,
        /// Its name now (`schema.name`).
        now: String,
    },
    /// An insert referenced a relation no Relation message described.
    #[error("insert into relation OID {0} arrived before its Relation message")]
    UnknownRelation(u32),
    /// The tuple's column count differs from its Relation message.
    #[error("insert has {got} columns, its Relation message {expected}")]
    ColumnCount {
        /// Columns in the Relation message.
        expected: usize,
        /// Columns in the tuple.
        got: usize,
    },
}

/// Transaction context an insert inherits (from the Begin message).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TxContext {
    /// The transaction's commit LSN (Begin's final LSN); `None` for rows a
    /// backfill reads from the table.
    pub commit_lsn: Option<Lsn>,
    /// Commit time, microseconds since 2000-01-01 UTC.
    pub commit_time_micros: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_parse() {
        let t: TableName = "outbox".parse().unwrap();
        assert_eq!(t.to_string(), "public.outbox");
        let t: TableName = "app.events".parse().unwrap();
        assert_eq!((t.schema.as_str(), t.name.as_str()), ("app", "events"));
        assert!("".parse::<TableName>().is_err());
        assert!("a.b.c".parse::<TableName>().is_err());
    }
}
