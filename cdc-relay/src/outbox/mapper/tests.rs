//! The mapper against hand-built Relation and Insert messages.

use super::*;
use crate::lsn::Lsn;
use crate::outbox::TraceColumn;
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
                // text, and jsonb for the payload
                type_oid: if *c == "payload" { 3802 } else { 25 },
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
    OutboxMapper::new(
        "public.outbox".parse().unwrap(),
        OutboxColumns::default(),
        Some(1),
    )
}

const COLUMNS: [&str; 4] = ["id", "aggregate_id", "event_type", "payload"];

#[test]
fn the_outbox_is_known_by_oid_whatever_its_name() {
    let mut m = mapper();
    // The start OID under an older name (WAL from before a rename).
    assert_eq!(
        m.on_relation(&rel(1, "outbox_old", &COLUMNS)),
        RelationKind::OutboxUnderOtherName {
            oid: 1,
            name: "public.outbox_old".into()
        }
    );
    let e = event(&m, &insert(1, &[Some("e1"), None, Some("T"), Some("{}")]));
    assert_eq!(e.id, "e1", "mapped while the caller decides about the name");
    assert_eq!(
        m.on_relation(&rel(1, "outbox", &COLUMNS)),
        RelationKind::Outbox
    );
    // Another table under the configured name: the outbox now, too.
    assert_eq!(
        m.on_relation(&rel(2, "outbox", &COLUMNS)),
        RelationKind::NewOutbox { oid: 2 }
    );
    assert_eq!(
        m.on_relation(&rel(2, "outbox", &COLUMNS)),
        RelationKind::Outbox
    );
    // ... and renamed away again.
    assert!(matches!(
        m.on_relation(&rel(2, "outbox_v2", &COLUMNS)),
        RelationKind::OutboxUnderOtherName { oid: 2, .. }
    ));
    assert!(m.is_outbox(RelationId(1)) && m.is_outbox(RelationId(2)));
    assert_eq!(
        m.on_relation(&rel(3, "orders", &["id"])),
        RelationKind::Other
    );
    assert!(!m.is_outbox(RelationId(3)));
    assert_eq!(m.relation_name(RelationId(3)), Some("public.orders"));
}

#[test]
fn a_payload_that_is_not_json_or_not_utf8_never_becomes_an_event() {
    let mut m = mapper();
    let mut r = rel(1, "outbox", &COLUMNS);
    r.columns[3].type_oid = 25; // ALTER COLUMN payload TYPE text
    m.on_relation(&r);
    let Ok(Mapped::Unreadable(row)) = m.on_insert(
        &insert(1, &[Some("e"), None, Some("T"), Some("not json")]),
        TX,
    ) else {
        panic!("text that is not JSON is an unreadable row")
    };
    assert!(row.problem.contains("not JSON"), "{}", row.problem);
    assert_eq!(row.payload.as_deref(), Some(&b"not json"[..]));
    let e = event(
        &m,
        &insert(1, &[Some("e2"), None, Some("T"), Some(r#"{"ok":1}"#)]),
    );
    assert_eq!(
        e.payload.as_deref(),
        Some(&br#"{"ok":1}"#[..]),
        "JSON text of another type is checked and sent"
    );

    m.on_relation(&rel(1, "outbox", &COLUMNS));
    let mut ins = insert(1, &[Some("e"), None, Some("T"), Some("{}")]);
    ins.new.0[3] = ColumnValue::Text(Bytes::from_static(b"{\"a\":\"\xff\"}"));
    let Ok(Mapped::Unreadable(row)) = m.on_insert(&ins, TX) else {
        panic!("a payload that is not UTF-8 is an unreadable row")
    };
    assert_eq!(row.payload.as_deref(), Some(&b"{\"a\":\"\xff\"}"[..]));
    assert!(row.problem.contains("UTF-8"), "{}", row.problem);
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
    assert_eq!(row.payload.as_deref(), Some(&b"{}"[..]));
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

/// A configured column renamed (same position, same shape) is followed:
/// renamed away while rows are committed, then back, the WAL's rows under
/// either name map, and the rename is reported; a changed shape (a column
/// added) is not guessed at.
#[test]
fn a_renamed_column_of_the_same_shape_is_followed_by_position() {
    let cols = ["id", "aggregate_id", "event_type", "payload"];
    let mut m = mapper();
    m.on_relation(&rel(1, "outbox", &cols));
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "etype", "payload"],
    ));
    assert_eq!(
        m.followed_renames(RelationId(1)),
        [("event_type".to_owned(), "etype".to_owned())]
    );
    let e = event(
        &m,
        &insert(1, &[Some("e1"), Some("a"), Some("Renamed"), Some("{}")]),
    );
    assert_eq!(e.event_type, "Renamed");
    // Renamed back: found by name again, nothing followed.
    m.on_relation(&rel(1, "outbox", &cols));
    assert!(m.followed_renames(RelationId(1)).is_empty());

    // A column added meanwhile: another shape, no guess.
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "etype", "payload", "x"],
    ));
    let err = m
        .on_insert(&insert(1, &[Some("e"), None, None, None, None]), TX)
        .unwrap_err();
    assert!(err.to_string().contains("--type-column"), "{err}");
    // Nor is a name another configured column has.
    let mut m = mapper();
    m.on_relation(&rel(1, "outbox", &cols));
    m.on_relation(&rel(1, "outbox", &["id", "aggregate_id", "id", "payload"]));
    assert!(
        m.on_insert(&insert(1, &[Some("e"), None, None, None]), TX)
            .is_err()
    );
}

/// A table no column was ever dropped from, with a column added since the
/// WAL's description: that description is the catalog's first columns,
/// so a renamed column is followed at its position. With a dropped column
/// somewhere (positions may have shifted) it is not, and a configured
/// column the older description lacks is missing, not an index past its
/// end.
#[test]
fn a_table_only_added_to_lets_an_older_description_follow_a_rename() {
    let now = [
        ("id".into(), 25),
        ("aggregate_id".into(), 25),
        ("event_type".into(), 25),
        ("payload".into(), 3802),
        ("note".into(), 25),
    ];
    let older = |m: &mut OutboxMapper| {
        m.on_relation(&rel(
            1,
            "outbox",
            &["id", "aggregate_id", "etype", "payload"],
        ));
    };
    let mut m = mapper();
    m.seed_layout(&now, true);
    older(&mut m);
    let e = event(
        &m,
        &insert(1, &[Some("e1"), Some("a"), Some("FromWal"), Some("{}")]),
    );
    assert_eq!(e.event_type, "FromWal");
    let mut m = mapper();
    m.seed_layout(&now, false);
    older(&mut m);
    assert!(
        m.on_insert(&insert(1, &[Some("e"), None, None, None]), TX)
            .is_err(),
        "a column was dropped: positions are not known"
    );
    // The configured type column is the fifth now: the older description
    // (four columns) has none at that position.
    let mut m = mapper();
    m.seed_layout(
        &[
            ("id".into(), 25),
            ("aggregate_id".into(), 25),
            ("etype".into(), 25),
            ("payload".into(), 3802),
            ("event_type".into(), 25),
        ],
        true,
    );
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "kind", "payload"],
    ));
    assert!(
        m.on_insert(&insert(1, &[Some("e"), None, None, None]), TX)
            .is_err()
    );
}

/// The catalog's layout seeds the outbox: a session whose first Relation
/// message names a column as it was before a rename (renamed back since)
/// still maps it.
#[test]
fn the_catalog_layout_lets_a_session_follow_an_older_column_name() {
    let mut m = mapper();
    m.seed_layout(
        &[
            ("id".into(), 25),
            ("aggregate_id".into(), 25),
            ("event_type".into(), 25),
            ("payload".into(), 3802),
        ],
        false,
    );
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "etype", "payload"],
    ));
    let e = event(
        &m,
        &insert(1, &[Some("e1"), Some("a"), Some("FromWal"), Some("{}")]),
    );
    assert_eq!(e.event_type, "FromWal");
    // A different payload type in the seed: not the same shape.
    let mut m = mapper();
    m.seed_layout(
        &[
            ("id".into(), 25),
            ("aggregate_id".into(), 25),
            ("event_type".into(), 25),
            ("payload".into(), 25),
        ],
        false,
    );
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "etype", "payload"],
    ));
    assert!(
        m.on_insert(&insert(1, &[Some("e"), None, None, None]), TX)
            .is_err()
    );
}

/// A description of the outbox that lacks configured columns stops the
/// stream, until the caller has found that the table has them again now:
/// the description is then of the past, and its rows are dead-lettered
/// with the columns they have. A later description that fits maps again.
#[test]
fn rows_of_a_past_description_lacking_columns_are_dead_lettered_once_accepted() {
    let mut m = mapper();
    m.on_relation(&rel(1, "outbox", &["id", "aggregate_id", "event_type"]));
    assert_eq!(m.lacking(RelationId(1)), ["payload"]);
    let ins = insert(1, &[Some("e1"), Some("a"), Some("T")]);
    let err = m.on_insert(&ins, TX).unwrap_err();
    assert!(
        matches!(&err, OutboxError::MissingColumn { column, setting: "--payload-column", .. } if column == "payload"),
        "{err:?}"
    );

    m.accept_past_shape(RelationId(1));
    assert!(m.lacking(RelationId(1)).is_empty());
    let Ok(Mapped::Unreadable(row)) = m.on_insert(&ins, TX) else {
        panic!("a row of an accepted past description is dead-lettered")
    };
    assert_eq!(row.event_id.as_deref(), Some("e1"));
    assert_eq!(row.aggregate_key.as_deref(), Some("a"));
    assert_eq!(row.event_type.as_deref(), Some("T"));
    assert_eq!(row.payload, None);
    assert_eq!(row.commit_lsn, Some(Lsn::new(7)));
    assert!(
        row.problem.contains("no column \"payload\"") && row.problem.contains("added again"),
        "{}",
        row.problem
    );
    // A tuple that does not fit that description is still an error.
    assert_eq!(
        m.on_insert(&insert(1, &[Some("e1")]), TX).unwrap_err(),
        OutboxError::ColumnCount {
            expected: 3,
            got: 1
        }
    );

    // The column added back (at the end): rows map again.
    m.on_relation(&rel(
        1,
        "outbox",
        &["id", "aggregate_id", "event_type", "payload"],
    ));
    let e = event(
        &m,
        &insert(1, &[Some("e2"), Some("a"), Some("T"), Some("{}")]),
    );
    assert_eq!(e.payload.as_deref(), Some(&b"{}"[..]));

    // Two columns missing: both named; the id's absence leaves no id.
    m.on_relation(&rel(1, "outbox", &["aggregate_id", "event_type"]));
    assert_eq!(m.lacking(RelationId(1)), ["id", "payload"]);
    m.accept_past_shape(RelationId(1));
    let Ok(Mapped::Unreadable(row)) = m.on_insert(&insert(1, &[Some("a"), Some("T")]), TX) else {
        panic!("dead-lettered")
    };
    assert_eq!(row.event_id, None);
    assert_eq!(row.event_type.as_deref(), Some("T"));
    assert!(
        row.problem.contains("\"id\", \"payload\""),
        "{}",
        row.problem
    );
}

/// A required trace context column (`--trace-column`) missing from a past
/// description costs its rows their trace, not their delivery; while not
/// accepted it stops the stream like any configured column.
#[test]
fn a_past_description_lacking_only_the_trace_column_delivers_untraced() {
    let mut m = OutboxMapper::new(
        "public.outbox".parse().unwrap(),
        OutboxColumns {
            trace: Some(TraceColumn {
                name: "tc".into(),
                required: true,
            }),
            ..OutboxColumns::default()
        },
        Some(1),
    );
    m.on_relation(&rel(1, "outbox", &COLUMNS));
    assert_eq!(m.lacking(RelationId(1)), ["tc"]);
    let ins = insert(1, &[Some("e1"), Some("a"), Some("T"), Some("{}")]);
    let err = m.on_insert(&ins, TX).unwrap_err();
    assert!(err.to_string().contains("--trace-column"), "{err}");
    m.accept_past_shape(RelationId(1));
    let e = event(&m, &ins);
    assert_eq!((e.id.as_str(), e.trace), ("e1", None));
}
