//! The mapper: decoded pgoutput messages to outbox events for the
//! configured table, columns found by name in the latest Relation message.

use std::collections::HashMap;

use super::{
    JSON_TYPES, Mapped, OutboxColumns, OutboxError, OutboxEvent, TableName, TxContext,
    UnreadableRow,
};
use crate::pgoutput::{ColumnValue, Insert, Relation, RelationId};

/// Column positions in one version of the outbox's Relation message.
#[derive(Clone, Debug)]
struct Positions {
    /// Every column's type OID, in order: the table's shape.
    types: Vec<u32>,
    /// Configured columns found at their old position under another name
    /// (`configured`, `name now`): renamed, followed.
    followed: Vec<(String, String)>,
    columns: usize,
    id: usize,
    event_type: usize,
    payload: usize,
    /// The payload column's type (json/jsonb text needs no check).
    payload_type: u32,
    aggregate_key: Option<usize>,
    /// The trace context column, when configured and present.
    trace: Option<usize>,
    /// The catalog's layout of a table no column was ever dropped from
    /// ([`OutboxMapper::seed_layout`]): the WAL describes any earlier
    /// version of it as its first columns (columns are only ever added at
    /// the end).
    appended_only: bool,
}

/// A description of the outbox that lacks configured columns.
#[derive(Clone, Debug)]
struct Lacking {
    /// The first missing column, as the error that stops the stream.
    error: OutboxError,
    /// Every configured column it lacks.
    missing: Vec<String>,
    columns: usize,
    id: Option<usize>,
    event_type: Option<usize>,
    payload: Option<usize>,
    aggregate_key: Option<usize>,
    /// When the only column missing is a required trace context column:
    /// the positions without it (a past row is then delivered untraced).
    untraced: Option<Positions>,
    /// The caller found the table has every configured column now
    /// ([`OutboxMapper::accept_past_shape`]): the description is of the
    /// past, its rows are dead-lettered instead of stopping the stream.
    past: bool,
}

/// The outbox's latest description, against the settings.
#[derive(Clone, Debug)]
enum Shape {
    /// Every configured column is there.
    Fits(Positions),
    /// Some are not.
    Lacks(Box<Lacking>),
}

/// What a Relation message means for the relay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RelationKind {
    /// The outbox, under the configured name (or the table the configured
    /// name resolved to when the session started, under an older name).
    Outbox,
    /// A relation newly seen under the configured name with another OID
    /// than the outbox had (dropped and recreated, or a swap): it is the
    /// outbox now; the old OID stays tracked too.
    NewOutbox {
        /// Its OID.
        oid: u32,
    },
    /// A relation that is or was the outbox in this session, described
    /// under another name: either an older name (the WAL predates a rename
    /// done before the session) or a rename away from the configured name.
    /// The caller asks the catalog which; the mapper keeps mapping it.
    OutboxUnderOtherName {
        /// Its OID.
        oid: u32,
        /// `schema.name` as the message says.
        name: String,
    },
    /// Another table of the publication.
    Other,
}

/// Maps decoded messages to [`OutboxEvent`]s for one configured table.
///
/// The outbox is identified by relation OID: the OID its configured name
/// had when the session started, and any relation a Relation message
/// describes under the configured name. So an insert is never dropped
/// because the table's name changed; whether a name change is acceptable
/// is the caller's decision ([`RelationKind::OutboxUnderOtherName`]).
#[derive(Debug)]
pub struct OutboxMapper {
    table: TableName,
    columns: OutboxColumns,
    /// The OID the configured name resolved to when the session started.
    start_oid: Option<RelationId>,
    /// Relations that are or were the outbox, with their latest positions
    /// (or what the latest Relation message lacks of the settings).
    outbox: HashMap<RelationId, Shape>,
    /// Every relation described in this session, by OID: `schema.name`.
    names: HashMap<RelationId, String>,
    /// Partitions of the outbox streamed under their own names
    /// ([`OutboxMapper::set_aside`]): their layout, and why their rows are
    /// dead-lettered rather than sent.
    aside: HashMap<RelationId, (Shape, String)>,
}

impl OutboxMapper {
    /// A mapper for inserts into `table` with the given column names;
    /// `start_oid` is the OID the catalog gives `table` now (`None` when
    /// unknown: the mapper then knows the outbox by name alone).
    pub fn new(table: TableName, columns: OutboxColumns, start_oid: Option<u32>) -> Self {
        OutboxMapper {
            table,
            columns,
            start_oid: start_oid.map(RelationId),
            outbox: HashMap::new(),
            names: HashMap::new(),
            aside: HashMap::new(),
        }
    }

    /// The configured outbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// `schema.name` of a relation described in this session.
    pub fn relation_name(&self, oid: RelationId) -> Option<&str> {
        self.names.get(&oid).map(String::as_str)
    }

    /// Whether `oid` is or was the outbox in this session.
    pub fn is_outbox(&self, oid: RelationId) -> bool {
        self.outbox.contains_key(&oid) || self.start_oid == Some(oid)
    }

    /// Sets `rel` aside: a relation the stream describes under its own
    /// name that is a partition of the outbox now (written while the
    /// publication did not publish via the partition root). Whether a row
    /// of it was the outbox's when written cannot be told from here, so
    /// each becomes an unreadable row (dead-lettered with its columns and
    /// `problem`), never an event and never dropped. It stays another
    /// relation for everything else.
    pub fn set_aside(&mut self, rel: &Relation, problem: String) {
        let shape = self.resolve(rel);
        self.aside.insert(rel.oid, (shape, problem));
    }

    /// Whether `oid` was set aside ([`OutboxMapper::set_aside`]).
    pub fn is_aside(&self, oid: RelationId) -> bool {
        self.aside.contains_key(&oid)
    }

    /// A Relation message arrived: (re)resolve columns when it is the
    /// outbox (replacing what an earlier message for the same OID said), and
    /// say what the relation is.
    pub fn on_relation(&mut self, rel: &Relation) -> RelationKind {
        let name = format!("{}.{}", rel.namespace, rel.name);
        self.names.insert(rel.oid, name.clone());
        let configured = rel.namespace == self.table.schema && rel.name == self.table.name;
        if !configured && !self.is_outbox(rel.oid) {
            return RelationKind::Other;
        }
        let new = configured
            && !self.outbox.contains_key(&rel.oid)
            && self.start_oid.is_some_and(|s| s != rel.oid);
        self.outbox.insert(rel.oid, self.resolve(rel));
        if !configured {
            RelationKind::OutboxUnderOtherName {
                oid: rel.oid.0,
                name,
            }
        } else if new {
            RelationKind::NewOutbox { oid: rel.oid.0 }
        } else {
            RelationKind::Outbox
        }
    }

    /// Seeds what the outbox (`start_oid`) looks like in the catalog now:
    /// its columns as pgoutput sends them (name and type OID, in attnum
    /// order, dropped and generated columns left out). The WAL may describe
    /// the table with a column under an older name (renamed since, e.g.
    /// renamed away and back while events were committed): with the same
    /// shape, the column at the same position is followed. With
    /// `never_dropped` (no column of the table was ever dropped), so is a
    /// WAL description whose shape is the first columns' (columns added
    /// since: the older description lists the columns it had, which keep
    /// their positions).
    pub fn seed_layout(&mut self, columns: &[(String, u32)], never_dropped: bool) {
        let Some(oid) = self.start_oid else { return };
        let seed = Relation {
            oid,
            namespace: self.table.schema.clone(),
            name: self.table.name.clone(),
            replica_identity: crate::pgoutput::ReplicaIdentity::Default,
            columns: columns
                .iter()
                .map(|(name, type_oid)| crate::pgoutput::Column {
                    flags: crate::pgoutput::ColumnFlags(0),
                    name: name.clone(),
                    type_oid: *type_oid,
                    type_modifier: -1,
                })
                .collect(),
        };
        if let Shape::Fits(mut p) = self.resolve(&seed) {
            p.appended_only = never_dropped;
            self.outbox.insert(oid, Shape::Fits(p));
        }
    }

    /// Configured columns the latest Relation message of `oid` names
    /// otherwise, followed by position: `(configured, name now)`.
    pub fn followed_renames(&self, oid: RelationId) -> &[(String, String)] {
        match self.outbox.get(&oid) {
            Some(Shape::Fits(p)) => &p.followed,
            _ => &[],
        }
    }

    /// The configured columns the latest Relation message of `oid` lacks,
    /// while its inserts would stop the stream (empty when it fits, or
    /// after [`OutboxMapper::accept_past_shape`]).
    pub fn lacking(&self, oid: RelationId) -> &[String] {
        match self.outbox.get(&oid) {
            Some(Shape::Lacks(l)) if !l.past => &l.missing,
            _ => &[],
        }
    }

    /// The caller found that the outbox has every configured column now,
    /// so the latest Relation message of `oid`, which lacks some, describes
    /// the table as it was when its rows were committed (a column dropped,
    /// then added back before the relay read them). Those rows cannot
    /// become events: each is dead-lettered as an [`UnreadableRow`] with
    /// the columns it has (a row that lacks only a required trace context
    /// column is delivered untraced). Without this call they stop the
    /// stream ([`OutboxError::MissingColumn`]).
    pub fn accept_past_shape(&mut self, oid: RelationId) {
        let Some(Shape::Lacks(l)) = self.outbox.get_mut(&oid) else {
            return;
        };
        match l.untraced.take() {
            Some(p) => {
                self.outbox.insert(oid, Shape::Fits(p));
            }
            None => l.past = true,
        }
    }

    /// The configured column names and the settings that name them.
    pub fn columns(&self) -> &OutboxColumns {
        &self.columns
    }

    fn resolve(&self, rel: &Relation) -> Shape {
        let types: Vec<u32> = rel.columns.iter().map(|c| c.type_oid).collect();
        // The positions this relation had when last described, when its
        // shape (every column's type, in order) is unchanged: a configured
        // name missing now was renamed, and its column is still there.
        let before = match self.outbox.get(&rel.oid) {
            Some(Shape::Fits(p)) if p.types == types => Some(p),
            // An older description of a table only ever added to: its
            // columns are the first ones, at the same positions.
            Some(Shape::Fits(p)) if p.appended_only && p.types.starts_with(&types) => Some(p),
            _ => None,
        };
        let configured = self.columns.names();
        let mut followed = Vec::new();
        let mut missing: Vec<(String, &'static str)> = Vec::new();
        let mut find = |column: &str, setting: &'static str, old: Option<usize>| {
            if let Some(i) = rel.columns.iter().position(|c| c.name == column) {
                return Some(i);
            }
            match old {
                Some(i)
                    if i < rel.columns.len()
                        && !configured.iter().any(|c| *c == rel.columns[i].name) =>
                {
                    followed.push((column.to_owned(), rel.columns[i].name.clone()));
                    Some(i)
                }
                _ => {
                    missing.push((column.to_owned(), setting));
                    None
                }
            }
        };
        let id = find(&self.columns.id, "--id-column", before.map(|b| b.id));
        let event_type = find(
            &self.columns.event_type,
            "--type-column",
            before.map(|b| b.event_type),
        );
        let payload = find(
            &self.columns.payload,
            "--payload-column",
            before.map(|b| b.payload),
        );
        let aggregate_key = self.columns.aggregate_key.as_ref().map(|c| {
            find(
                c,
                "--aggregate-column",
                before.and_then(|b| b.aggregate_key),
            )
        });
        let trace = match &self.columns.trace {
            Some(t) if t.required => find(&t.name, "--trace-column", before.and_then(|b| b.trace)),
            Some(t) => rel.columns.iter().position(|c| c.name == t.name),
            None => None,
        };
        let essentials = match (id, event_type, payload, aggregate_key) {
            (Some(id), Some(event_type), Some(payload), None | Some(Some(_))) => Some(Positions {
                types: types.clone(),
                followed: followed.clone(),
                columns: rel.columns.len(),
                id,
                event_type,
                payload,
                payload_type: rel.columns[payload].type_oid,
                aggregate_key: aggregate_key.flatten(),
                trace,
                appended_only: false,
            }),
            _ => None,
        };
        let Some((column, setting)) = missing.first().cloned() else {
            return Shape::Fits(essentials.expect("no configured column is missing"));
        };
        // Only a required trace column missing: the rest maps.
        let untraced = essentials.filter(|_| missing.len() == 1);
        Shape::Lacks(Box::new(Lacking {
            error: OutboxError::MissingColumn {
                table: self.table.to_string(),
                column,
                setting,
            },
            missing: missing.into_iter().map(|(c, _)| c).collect(),
            columns: rel.columns.len(),
            id,
            event_type,
            payload,
            aggregate_key: aggregate_key.flatten(),
            untraced,
            past: false,
        }))
    }

    /// Maps an insert into an event, an unreadable row, or nothing (another
    /// table). Errors when the outbox no longer matches the configuration.
    pub fn on_insert(&self, ins: &Insert, tx: TxContext) -> Result<Mapped, OutboxError> {
        let pos = match self.outbox.get(&ins.relation) {
            Some(Shape::Fits(pos)) => pos,
            Some(Shape::Lacks(l)) if l.past => return past_row(l, ins, tx),
            Some(Shape::Lacks(l)) => return Err(l.error.clone()),
            None if self.aside.contains_key(&ins.relation) => return self.set_aside_row(ins, tx),
            None if self.names.contains_key(&ins.relation) => return Ok(Mapped::OtherTable),
            None => return Err(OutboxError::UnknownRelation(ins.relation.0)),
        };
        let values = ins.new.values();
        check_count(values, pos.columns)?;
        Ok(match self.event(values, pos, tx) {
            Ok(event) => Mapped::Event(event),
            Err(problem) => Mapped::Unreadable(unreadable(values, pos, tx, problem)),
        })
    }

    /// A row of a relation set aside: unreadable, with its columns.
    fn set_aside_row(&self, ins: &Insert, tx: TxContext) -> Result<Mapped, OutboxError> {
        let (shape, problem) = &self.aside[&ins.relation];
        match shape {
            Shape::Fits(pos) => {
                let values = ins.new.values();
                check_count(values, pos.columns)?;
                Ok(Mapped::Unreadable(unreadable(
                    values,
                    pos,
                    tx,
                    problem.clone(),
                )))
            }
            Shape::Lacks(l) => past_row(l, ins, tx),
        }
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
        // json/jsonb text is valid JSON in a UTF-8 database; in another
        // server encoding it may hold bytes that are not UTF-8, which a
        // JSON body cannot carry.
        // Text of any other type (a type change, a domain) is checked, row
        // by row: the body splices it in as JSON. (Stopping on the type
        // instead would wedge the slot: the WAL keeps the old rows' type.)
        let payload = match &values[pos.payload] {
            ColumnValue::Null => None,
            ColumnValue::Text(b) if std::str::from_utf8(b).is_err() => {
                return Err(format!(
                    "column {:?} is not valid UTF-8",
                    self.columns.payload
                ));
            }
            ColumnValue::Text(b)
                if !JSON_TYPES.contains(&pos.payload_type)
                    && serde_json::from_slice::<serde::de::IgnoredAny>(b).is_err() =>
            {
                return Err(format!(
                    "column {:?} (type OID {}, not json/jsonb) holds text that is not JSON",
                    self.columns.payload, pos.payload_type
                ));
            }
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
            dead_letter_id: None,
            // A value that is not a trace context is no context: the event
            // is delivered as if the column were NULL.
            trace: pos.trace.and_then(|i| match &values[i] {
                ColumnValue::Text(b) => std::str::from_utf8(b)
                    .ok()
                    .and_then(trace_context::stored::parse),
                _ => None,
            }),
        })
    }
}

fn check_count(values: &[ColumnValue], expected: usize) -> Result<(), OutboxError> {
    if values.len() != expected {
        return Err(OutboxError::ColumnCount {
            expected,
            got: values.len(),
        });
    }
    Ok(())
}

/// A row committed while the outbox lacked configured columns that it has
/// again now: dead-lettered with the columns it has.
fn past_row(l: &Lacking, ins: &Insert, tx: TxContext) -> Result<Mapped, OutboxError> {
    let values = ins.new.values();
    check_count(values, l.columns)?;
    let missing = l
        .missing
        .iter()
        .map(|c| format!("{c:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let problem = format!(
        "the outbox had no column {missing} when this row was committed (dropped, and added again \
         before the relay read the row): the row cannot become an event"
    );
    Ok(Mapped::Unreadable(readable(
        values,
        [l.id, l.aggregate_key, l.event_type, l.payload],
        tx,
        problem,
    )))
}

/// What is readable of an unreadable row, lossily.
fn unreadable(
    values: &[ColumnValue],
    pos: &Positions,
    tx: TxContext,
    problem: String,
) -> UnreadableRow {
    readable(
        values,
        [
            Some(pos.id),
            pos.aggregate_key,
            Some(pos.event_type),
            Some(pos.payload),
        ],
        tx,
        problem,
    )
}

/// The values at `[id, aggregate key, type, payload]`, lossily.
fn readable(
    values: &[ColumnValue],
    [id, aggregate_key, event_type, payload]: [Option<usize>; 4],
    tx: TxContext,
    problem: String,
) -> UnreadableRow {
    let raw = |i: Option<usize>| match values.get(i?) {
        Some(ColumnValue::Text(b)) | Some(ColumnValue::Binary(b)) => Some(b.clone()),
        _ => None,
    };
    let lossy = |i: Option<usize>| raw(i).map(|b| String::from_utf8_lossy(&b).into_owned());
    UnreadableRow {
        event_id: lossy(id),
        aggregate_key: lossy(aggregate_key),
        event_type: lossy(event_type),
        payload: raw(payload),
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
mod tests;
