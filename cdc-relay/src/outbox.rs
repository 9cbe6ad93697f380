//! Outbox events: from decoded pgoutput inserts to the events the sink posts.
//!
//! Only inserts into the configured table become events. Columns are found
//! by name in the latest Relation message for the table (pgoutput sends one
//! before the first change of a relation in a session and again after every
//! schema change), so columns may be added, dropped or reordered while the
//! relay streams or sleeps. With `publish_via_partition_root`, inserts into a
//! partitioned outbox's leaves arrive under the root's name and map the same.

use std::collections::{HashMap, HashSet};
use std::fmt;

use bytes::Bytes;

use crate::deadletter::NewDeadLetter;
use crate::lsn::Lsn;
use crate::pgoutput::{ColumnValue, Insert, Relation, RelationId};

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
    /// LSN of the commit record of the event's transaction.
    pub commit_lsn: Lsn,
    /// Commit time of the event's transaction, microseconds since
    /// 2000-01-01 00:00:00 UTC (PostgreSQL's epoch).
    pub commit_time_micros: i64,
}

impl OutboxEvent {
    /// Bytes this event holds in memory (for the relay's byte-bounded window).
    pub fn size_bytes(&self) -> usize {
        self.id.len()
            + self.event_type.len()
            + self.payload.as_ref().map_or(0, Bytes::len)
            + self.aggregate_key.as_ref().map_or(0, String::len)
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
}

impl Default for OutboxColumns {
    fn default() -> Self {
        OutboxColumns {
            id: "id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            aggregate_key: Some("aggregate_id".into()),
        }
    }
}

/// Why an outbox insert could not become an event. The relay stops without
/// acknowledging it: nothing is skipped.
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
    /// An insert referenced a relation no Relation message described.
    #[error("insert into relation OID {0} arrived before its Relation message")]
    UnknownRelation(u32),
    /// A required column was NULL in an insert.
    #[error("outbox row has NULL in required column {column:?}")]
    NullValue {
        /// The column.
        column: String,
    },
    /// A value was not valid UTF-8 text, or came in a form the relay does not read.
    #[error("outbox column {column:?}: {reason}")]
    BadValue {
        /// The column.
        column: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// The tuple's column count differs from its Relation message.
    #[error("insert has {got} columns, its Relation message {expected}")]
    ColumnCount {
        /// Columns in the Relation message.
        expected: usize,
        /// Columns in the tuple.
        got: usize,
    },
}

/// Column positions in one version of the outbox's Relation message.
#[derive(Clone, Debug)]
struct Positions {
    columns: usize,
    id: usize,
    event_type: usize,
    payload: usize,
    aggregate_key: Option<usize>,
}

/// Transaction context an insert inherits (from the Begin message).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TxContext {
    /// The transaction's commit LSN (Begin's final LSN).
    pub commit_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01 UTC.
    pub commit_time_micros: i64,
}

/// Maps decoded messages to [`OutboxEvent`]s for one configured table.
#[derive(Debug)]
pub struct OutboxMapper {
    table: TableName,
    columns: OutboxColumns,
    /// Relations seen in this session. `Ok` for the outbox with resolved
    /// positions, `Err` for the outbox missing a column; other tables are absent
    /// from `outbox` but present in `known`.
    outbox: HashMap<RelationId, Result<Positions, OutboxError>>,
    known: HashSet<RelationId>,
}

impl OutboxMapper {
    /// A mapper for inserts into `table` with the given column names.
    pub fn new(table: TableName, columns: OutboxColumns) -> Self {
        OutboxMapper {
            table,
            columns,
            outbox: HashMap::new(),
            known: HashSet::new(),
        }
    }

    /// The configured outbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// A Relation message arrived: (re)resolve columns when it is the outbox.
    /// Replaces whatever an earlier Relation message for the same OID said.
    pub fn on_relation(&mut self, rel: &Relation) {
        self.known.insert(rel.oid);
        if rel.namespace == self.table.schema && rel.name == self.table.name {
            self.outbox.insert(rel.oid, self.resolve(rel));
        } else {
            self.outbox.remove(&rel.oid);
        }
    }

    fn resolve(&self, rel: &Relation) -> Result<Positions, OutboxError> {
        let find = |column: &str, setting: &'static str| {
            rel.columns
                .iter()
                .position(|c| c.name == column)
                .ok_or_else(|| OutboxError::MissingColumn {
                    table: self.table.to_string(),
                    column: column.to_owned(),
                    setting,
                })
        };
        Ok(Positions {
            columns: rel.columns.len(),
            id: find(&self.columns.id, "--id-column")?,
            event_type: find(&self.columns.event_type, "--type-column")?,
            payload: find(&self.columns.payload, "--payload-column")?,
            aggregate_key: match &self.columns.aggregate_key {
                Some(c) => Some(find(c, "--aggregate-column")?),
                None => None,
            },
        })
    }

    /// Maps an insert: `Ok(None)` for another table, an event for the outbox.
    pub fn on_insert(
        &self,
        ins: &Insert,
        tx: TxContext,
    ) -> Result<Option<OutboxEvent>, OutboxError> {
        let pos = match self.outbox.get(&ins.relation) {
            Some(Ok(pos)) => pos,
            Some(Err(e)) => return Err(e.clone()),
            None if self.known.contains(&ins.relation) => return Ok(None),
            None => return Err(OutboxError::UnknownRelation(ins.relation.0)),
        };
        let values = ins.new.values();
        if values.len() != pos.columns {
            return Err(OutboxError::ColumnCount {
                expected: pos.columns,
                got: values.len(),
            });
        }
        let required = |i: usize, column: &str| -> Result<String, OutboxError> {
            text(&values[i], column)?
                .map(str::to_owned)
                .ok_or_else(|| OutboxError::NullValue {
                    column: column.to_owned(),
                })
        };
        let payload = match &values[pos.payload] {
            ColumnValue::Null => None,
            ColumnValue::Text(b) => Some(b.clone()),
            other => return Err(bad_kind(other, &self.columns.payload)),
        };
        let aggregate_key = match (pos.aggregate_key, &self.columns.aggregate_key) {
            (Some(i), Some(c)) => text(&values[i], c)?.map(str::to_owned),
            _ => None,
        };
        Ok(Some(OutboxEvent {
            id: required(pos.id, &self.columns.id)?,
            event_type: required(pos.event_type, &self.columns.event_type)?,
            payload,
            aggregate_key,
            commit_lsn: tx.commit_lsn,
            commit_time_micros: tx.commit_time_micros,
        }))
    }
}

impl OutboxMapper {
    /// For an insert whose ROW is bad (a NULL id or type, text that is not
    /// UTF-8), the dead-letter record to quarantine it with: whatever is
    /// readable, lossily. `None` when the problem is structural (a missing
    /// column, an unknown relation): that is a configuration error, not a
    /// poison row, and the relay stops instead.
    pub fn quarantine_record(
        &self,
        ins: &Insert,
        tx: TxContext,
        err: &OutboxError,
    ) -> Option<NewDeadLetter> {
        if !matches!(
            err,
            OutboxError::NullValue { .. } | OutboxError::BadValue { .. }
        ) {
            return None;
        }
        let pos = self.outbox.get(&ins.relation)?.as_ref().ok()?;
        let values = ins.new.values();
        let lossy = |i: usize| match values.get(i) {
            Some(ColumnValue::Text(b)) | Some(ColumnValue::Binary(b)) => {
                Some(String::from_utf8_lossy(b).into_owned())
            }
            _ => None,
        };
        Some(NewDeadLetter {
            event_id: lossy(pos.id),
            aggregate_key: pos.aggregate_key.and_then(lossy),
            event_type: lossy(pos.event_type),
            payload: lossy(pos.payload),
            commit_lsn: tx.commit_lsn,
            http_status: None,
            error: format!("unreadable outbox row: {err}"),
            response_excerpt: None,
            attempts: 0,
            first_attempt_unix_micros: None,
        })
    }
}

fn text<'a>(value: &'a ColumnValue, column: &str) -> Result<Option<&'a str>, OutboxError> {
    match value {
        ColumnValue::Null => Ok(None),
        ColumnValue::Text(b) => {
            std::str::from_utf8(b)
                .map(Some)
                .map_err(|_| OutboxError::BadValue {
                    column: column.to_owned(),
                    reason: "not valid UTF-8",
                })
        }
        other => Err(bad_kind(other, column)),
    }
}

fn bad_kind(value: &ColumnValue, column: &str) -> OutboxError {
    OutboxError::BadValue {
        column: column.to_owned(),
        reason: match value {
            ColumnValue::UnchangedToast => "unchanged TOAST value in an insert",
            _ => "binary format (the relay requests text format)",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::{Column, ColumnFlags, ReplicaIdentity, TupleData};

    fn rel(oid: u32, name: &str, cols: &[&str]) -> Relation {
        Relation {
            oid: RelationId(oid),
            namespace: "public".into(),
            name: name.into(),
            replica_identity: ReplicaIdentity::Default,
            columns: cols
                .iter()
                .map(|c| Column {
                    flags: ColumnFlags(0),
                    name: (*c).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    fn insert(oid: u32, vals: &[Option<&str>]) -> Insert {
        Insert {
            relation: RelationId(oid),
            new: TupleData(
                vals.iter()
                    .map(|v| match v {
                        Some(s) => ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes())),
                        None => ColumnValue::Null,
                    })
                    .collect(),
            ),
        }
    }

    const TX: TxContext = TxContext {
        commit_lsn: Lsn(7),
        commit_time_micros: 9,
    };

    fn mapper() -> OutboxMapper {
        OutboxMapper::new("public.outbox".parse().unwrap(), OutboxColumns::default())
    }

    #[test]
    fn maps_columns_by_name_across_relation_changes() {
        let mut m = mapper();
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "event_type", "payload"],
        ));
        let e = m
            .on_insert(
                &insert(1, &[Some("e1"), Some("a1"), Some("T"), Some("{}")]),
                TX,
            )
            .unwrap()
            .unwrap();
        assert_eq!((e.id.as_str(), e.event_type.as_str()), ("e1", "T"));
        assert_eq!(e.aggregate_key.as_deref(), Some("a1"));
        assert_eq!(e.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(e.commit_lsn, Lsn(7));

        // Column dropped and re-added at the end: positions follow the new Relation.
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "payload", "extra", "event_type"],
        ));
        let e = m
            .on_insert(
                &insert(1, &[Some("e2"), None, None, Some("x"), Some("U")]),
                TX,
            )
            .unwrap()
            .unwrap();
        assert_eq!((e.id.as_str(), e.event_type.as_str()), ("e2", "U"));
        assert_eq!((e.payload, e.aggregate_key), (None, None));
    }

    #[test]
    fn other_tables_are_ignored_and_unknown_relations_are_errors() {
        let mut m = mapper();
        m.on_relation(&rel(2, "orders", &["id"]));
        assert_eq!(m.on_insert(&insert(2, &[Some("x")]), TX), Ok(None));
        assert_eq!(
            m.on_insert(&insert(3, &[Some("x")]), TX),
            Err(OutboxError::UnknownRelation(3))
        );
    }

    #[test]
    fn missing_columns_and_nulls_are_named() {
        let mut m = mapper();
        m.on_relation(&rel(1, "outbox", &["id", "aggregate_id", "payload"]));
        let err = m
            .on_insert(&insert(1, &[Some("e"), None, None]), TX)
            .unwrap_err();
        assert!(err.to_string().contains("\"event_type\""), "{err}");
        assert!(err.to_string().contains("--type-column"), "{err}");

        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "event_type", "payload"],
        ));
        let err = m
            .on_insert(&insert(1, &[None, None, Some("T"), None]), TX)
            .unwrap_err();
        assert_eq!(
            err,
            OutboxError::NullValue {
                column: "id".into()
            }
        );
        let err = m.on_insert(&insert(1, &[Some("e")]), TX).unwrap_err();
        assert_eq!(
            err,
            OutboxError::ColumnCount {
                expected: 4,
                got: 1
            }
        );
    }

    #[test]
    fn bad_rows_are_quarantined_and_structural_errors_are_not() {
        let mut m = mapper();
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "event_type", "payload"],
        ));
        let ins = insert(1, &[None, Some("a"), Some("T"), Some("{}")]);
        let err = m.on_insert(&ins, TX).unwrap_err();
        let row = m
            .quarantine_record(&ins, TX, &err)
            .expect("a NULL id is a poison row");
        assert_eq!(row.event_id, None);
        assert_eq!(row.event_type.as_deref(), Some("T"));
        assert_eq!(row.payload.as_deref(), Some("{}"));
        assert_eq!(row.commit_lsn, Lsn(7));
        assert!(row.error.contains("\"id\""), "{}", row.error);

        let short = insert(1, &[Some("e")]);
        let err = m.on_insert(&short, TX).unwrap_err();
        assert_eq!(m.quarantine_record(&short, TX, &err), None);
    }

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
