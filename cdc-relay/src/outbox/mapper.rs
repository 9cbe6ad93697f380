//! The mapper: decoded pgoutput messages to outbox events for the
//! configured table, columns found by name in the latest Relation message.

use std::collections::{HashMap, HashSet};

use super::{Mapped, OutboxColumns, OutboxError, OutboxEvent, TableName, TxContext, UnreadableRow};
use crate::pgoutput::{ColumnValue, Insert, Relation, RelationId};

/// Column positions in one version of the outbox's Relation message.
#[derive(Clone, Debug)]
struct Positions {
    columns: usize,
    id: usize,
    event_type: usize,
    payload: usize,
    aggregate_key: Option<usize>,
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

    /// Maps an insert into an event, an unreadable row, or nothing (another
    /// table). Errors when the outbox no longer matches the configuration.
    pub fn on_insert(&self, ins: &Insert, tx: TxContext) -> Result<Mapped, OutboxError> {
        let pos = match self.outbox.get(&ins.relation) {
            Some(Ok(pos)) => pos,
            Some(Err(e)) => return Err(e.clone()),
            None if self.known.contains(&ins.relation) => return Ok(Mapped::OtherTable),
            None => return Err(OutboxError::UnknownRelation(ins.relation.0)),
        };
        let values = ins.new.values();
        if values.len() != pos.columns {
            return Err(OutboxError::ColumnCount {
                expected: pos.columns,
                got: values.len(),
            });
        }
        Ok(match self.event(values, pos, tx) {
            Ok(event) => Mapped::Event(event),
            Err(problem) => Mapped::Unreadable(unreadable(values, pos, tx, problem)),
        })
    }

    /// The event in `values`, or what makes the row unreadable.
    fn event(
        &self,
        values: &[ColumnValue],
        pos: &Positions,
        tx: TxContext,
    ) -> Result<OutboxEvent, String> {
        let required = |i: usize, column: &str| -> Result<String, String> {
            text(&values[i], column)?
                .map(str::to_owned)
                .ok_or_else(|| format!("NULL in required column {column:?}"))
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
        Ok(OutboxEvent {
            id: required(pos.id, &self.columns.id)?,
            event_type: required(pos.event_type, &self.columns.event_type)?,
            payload,
            aggregate_key,
            commit_lsn: tx.commit_lsn,
            commit_time_micros: tx.commit_time_micros,
        })
    }
}

/// What is readable of an unreadable row, lossily.
fn unreadable(
    values: &[ColumnValue],
    pos: &Positions,
    tx: TxContext,
    problem: String,
) -> UnreadableRow {
    let lossy = |i: usize| match values.get(i) {
        Some(ColumnValue::Text(b)) | Some(ColumnValue::Binary(b)) => {
            Some(String::from_utf8_lossy(b).into_owned())
        }
        _ => None,
    };
    UnreadableRow {
        event_id: lossy(pos.id),
        aggregate_key: pos.aggregate_key.and_then(lossy),
        event_type: lossy(pos.event_type),
        payload: lossy(pos.payload),
        commit_lsn: tx.commit_lsn,
        problem,
    }
}

fn text<'a>(value: &'a ColumnValue, column: &str) -> Result<Option<&'a str>, String> {
    match value {
        ColumnValue::Null => Ok(None),
        ColumnValue::Text(b) => std::str::from_utf8(b)
            .map(Some)
            .map_err(|_| format!("column {column:?} is not valid UTF-8")),
        other => Err(bad_kind(other, column)),
    }
}

fn bad_kind(value: &ColumnValue, column: &str) -> String {
    let reason = match value {
        ColumnValue::UnchangedToast => "unchanged TOAST value in an insert",
        _ => "binary format (the relay requests text format)",
    };
    format!("column {column:?}: {reason}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;
    use crate::pgoutput::{Column, ColumnFlags, ReplicaIdentity, TupleData};
    use bytes::Bytes;

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
        commit_lsn: Some(Lsn::new(7)),
        commit_time_micros: 9,
    };

    fn event(m: &OutboxMapper, ins: &Insert) -> OutboxEvent {
        match m.on_insert(ins, TX) {
            Ok(Mapped::Event(e)) => e,
            other => panic!("not an event: {other:?}"),
        }
    }

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
        let e = event(
            &m,
            &insert(1, &[Some("e1"), Some("a1"), Some("T"), Some("{}")]),
        );
        assert_eq!((e.id.as_str(), e.event_type.as_str()), ("e1", "T"));
        assert_eq!(e.aggregate_key.as_deref(), Some("a1"));
        assert_eq!(e.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(e.commit_lsn, Some(Lsn::new(7)));

        // Column dropped and re-added at the end: positions follow the new Relation.
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "payload", "extra", "event_type"],
        ));
        let e = event(
            &m,
            &insert(1, &[Some("e2"), None, None, Some("x"), Some("U")]),
        );
        assert_eq!((e.id.as_str(), e.event_type.as_str()), ("e2", "U"));
        assert_eq!((e.payload, e.aggregate_key), (None, None));
    }

    #[test]
    fn other_tables_are_ignored_and_unknown_relations_are_errors() {
        let mut m = mapper();
        m.on_relation(&rel(2, "orders", &["id"]));
        assert_eq!(
            m.on_insert(&insert(2, &[Some("x")]), TX),
            Ok(Mapped::OtherTable)
        );
        assert_eq!(
            m.on_insert(&insert(3, &[Some("x")]), TX),
            Err(OutboxError::UnknownRelation(3))
        );
    }

    #[test]
    fn missing_columns_and_column_counts_are_errors() {
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
    fn bad_rows_are_unreadable_values_with_what_is_readable() {
        let mut m = mapper();
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "event_type", "payload"],
        ));
        let ins = insert(1, &[None, Some("a"), Some("T"), Some("{}")]);
        let Ok(Mapped::Unreadable(row)) = m.on_insert(&ins, TX) else {
            panic!("a NULL id makes the row unreadable")
        };
        assert_eq!(row.event_id, None);
        assert_eq!(row.aggregate_key.as_deref(), Some("a"));
        assert_eq!(row.event_type.as_deref(), Some("T"));
        assert_eq!(row.payload.as_deref(), Some("{}"));
        assert_eq!(row.commit_lsn, Some(Lsn::new(7)));
        assert!(row.problem.contains("\"id\""), "{}", row.problem);

        let mut bad = insert(1, &[Some("e"), None, Some("T"), Some("{}")]);
        bad.new.0[2] = ColumnValue::Text(Bytes::from_static(b"\xff"));
        let Ok(Mapped::Unreadable(row)) = m.on_insert(&bad, TX) else {
            panic!("a type that is not UTF-8 makes the row unreadable")
        };
        assert!(row.problem.contains("UTF-8"), "{}", row.problem);
        assert_eq!(row.event_type.as_deref(), Some("\u{fffd}"));
    }
}
