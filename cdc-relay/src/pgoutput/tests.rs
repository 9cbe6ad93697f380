//! Decoder tests: byte vectors written from the spec by hand (not with the
//! encoder, so the two cannot share a mistake) and malformed input; the
//! property tests are in `props`.

use bytes::Bytes;

use super::*;
use crate::lsn::Lsn;

/// Concatenates spec fields into one payload.
fn payload(fields: &[&[u8]]) -> Bytes {
    Bytes::from(fields.concat())
}

fn decode_ok(fields: &[&[u8]]) -> LogicalMessage {
    let buf = payload(fields);
    decode(buf.clone()).unwrap_or_else(|e| panic!("{e} for {buf:?}"))
}

fn text(s: &str) -> ColumnValue {
    ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

// ---- one hand-built message of each kind, checked field by field ----

#[test]
fn begin_from_spec_bytes() {
    let msg = decode_ok(&[
        b"B",
        &0x0000_0001_0000_00A0u64.to_be_bytes(), // final LSN 1/A0
        &789_000_000i64.to_be_bytes(),           // commit time, µs since 2000-01-01
        &4242u32.to_be_bytes(),                  // xid
    ]);
    let LogicalMessage::Begin(b) = msg else {
        panic!("not a Begin: {msg:?}")
    };
    assert_eq!(b.final_lsn, Lsn::new(0x1_0000_00A0));
    assert_eq!(b.final_lsn.to_string(), "1/A0");
    assert_eq!(b.commit_time, 789_000_000);
    assert_eq!(b.xid, 4242);
}

#[test]
fn commit_from_spec_bytes() {
    let msg = decode_ok(&[
        b"C",
        &[0],                        // flags
        &0x16B3748u64.to_be_bytes(), // commit LSN
        &0x16B3780u64.to_be_bytes(), // end LSN
        &(-5i64).to_be_bytes(),      // before the epoch: still valid
    ]);
    let LogicalMessage::Commit(c) = msg else {
        panic!("not a Commit: {msg:?}")
    };
    assert_eq!(c.flags, 0);
    assert_eq!(c.commit_lsn, Lsn::new(0x16B3748));
    assert_eq!(c.end_lsn, Lsn::new(0x16B3780));
    assert_eq!(c.commit_time, -5);
}

#[test]
fn origin_from_spec_bytes() {
    let msg = decode_ok(&[b"O", &7u64.to_be_bytes(), b"pg_16399\0"]);
    assert_eq!(
        msg,
        LogicalMessage::Origin(Origin {
            commit_lsn: Lsn::new(7),
            name: "pg_16399".into()
        })
    );
}

#[test]
fn relation_from_spec_bytes() {
    let msg = decode_ok(&[
        b"R",
        &16_385u32.to_be_bytes(),
        b"public\0",
        b"outbox\0",
        b"d",
        &3u16.to_be_bytes(),
        // id uuid, part of the key
        &[1],
        b"id\0",
        &2950u32.to_be_bytes(),
        &(-1i32).to_be_bytes(),
        // event_type varchar(64): typmod 64 + 4
        &[0],
        b"event_type\0",
        &1043u32.to_be_bytes(),
        &68i32.to_be_bytes(),
        // payload jsonb
        &[0],
        b"payload\0",
        &3802u32.to_be_bytes(),
        &(-1i32).to_be_bytes(),
    ]);
    let LogicalMessage::Relation(r) = msg else {
        panic!("not a Relation: {msg:?}")
    };
    assert_eq!(r.oid, RelationId(16_385));
    assert_eq!(r.namespace, "public");
    assert_eq!(r.name, "outbox");
    assert_eq!(r.replica_identity, ReplicaIdentity::Default);
    let names: Vec<_> = r.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["id", "event_type", "payload"]);
    assert!(r.columns[0].flags.is_key());
    assert!(!r.columns[1].flags.is_key());
    assert_eq!(r.columns[0].type_oid, 2950);
    assert_eq!(r.columns[1].type_modifier, 68);
    assert_eq!(r.columns[2].type_oid, 3802);
    assert_eq!(r.columns[2].type_modifier, -1);
}

#[test]
fn relation_in_pg_catalog_with_no_columns() {
    let msg = decode_ok(&[b"R", &1u32.to_be_bytes(), b"\0", b"t\0", b"f", &[0, 0]]);
    let LogicalMessage::Relation(r) = msg else {
        panic!("not a Relation: {msg:?}")
    };
    assert_eq!(r.namespace, "", "empty namespace stands for pg_catalog");
    assert_eq!(r.replica_identity, ReplicaIdentity::Full);
    assert!(r.columns.is_empty());
}

#[test]
fn type_from_spec_bytes() {
    let msg = decode_ok(&[b"Y", &16_400u32.to_be_bytes(), b"public\0", b"mood\0"]);
    assert_eq!(
        msg,
        LogicalMessage::Type(TypeMessage {
            oid: 16_400,
            namespace: "public".into(),
            name: "mood".into()
        })
    );
}

#[test]
fn insert_from_spec_bytes_with_every_value_kind() {
    let msg = decode_ok(&[
        b"I",
        &16_385u32.to_be_bytes(),
        b"N",
        &4u16.to_be_bytes(),
        b"t",
        &5i32.to_be_bytes(),
        b"hello",
        b"n",
        b"u",
        b"b",
        &2i32.to_be_bytes(),
        &[0xFF, 0x00],
    ]);
    let LogicalMessage::Insert(i) = msg else {
        panic!("not an Insert: {msg:?}")
    };
    assert_eq!(i.relation, RelationId(16_385));
    assert_eq!(
        i.new.values(),
        [
            text("hello"),
            ColumnValue::Null,
            ColumnValue::UnchangedToast,
            ColumnValue::Binary(Bytes::from_static(&[0xFF, 0x00])),
        ]
    );
}

#[test]
fn insert_values_are_slices_of_the_input() {
    let buf = payload(&[
        b"I",
        &1u32.to_be_bytes(),
        b"N",
        &[0, 1],
        b"t",
        &3i32.to_be_bytes(),
        b"abc",
    ]);
    let range = buf.as_ptr_range();
    let LogicalMessage::Insert(i) = decode(buf.clone()).unwrap() else {
        panic!("not an Insert")
    };
    let value = i.new.values()[0].as_text().unwrap();
    assert_eq!(&value[..], b"abc");
    assert!(range.contains(&value.as_ptr()), "value was copied");
}

#[test]
fn update_without_old_tuple() {
    let msg = decode_ok(&[
        b"U",
        &9u32.to_be_bytes(),
        b"N",
        &[0, 1],
        b"t",
        &1i32.to_be_bytes(),
        b"x",
    ]);
    assert_eq!(
        msg,
        LogicalMessage::Update(Update {
            relation: RelationId(9),
            old: None,
            new: TupleData(vec![text("x")]),
        })
    );
}

#[test]
fn update_with_key_and_with_old_row() {
    for (marker, kind) in [(b"K", OldTupleKind::Key), (b"O", OldTupleKind::Old)] {
        let msg = decode_ok(&[
            b"U",
            &9u32.to_be_bytes(),
            marker,
            &[0, 2],
            b"t",
            &1i32.to_be_bytes(),
            b"1",
            b"n",
            b"N",
            &[0, 2],
            b"t",
            &1i32.to_be_bytes(),
            b"2",
            b"u",
        ]);
        assert_eq!(
            msg,
            LogicalMessage::Update(Update {
                relation: RelationId(9),
                old: Some(OldTuple {
                    kind,
                    tuple: TupleData(vec![text("1"), ColumnValue::Null]),
                }),
                new: TupleData(vec![text("2"), ColumnValue::UnchangedToast]),
            })
        );
    }
}

#[test]
fn delete_with_key_and_with_old_row() {
    for (marker, kind) in [(b"K", OldTupleKind::Key), (b"O", OldTupleKind::Old)] {
        let msg = decode_ok(&[
            b"D",
            &9u32.to_be_bytes(),
            marker,
            &[0, 1],
            b"t",
            &[0, 0, 0, 0],
        ]);
        assert_eq!(
            msg,
            LogicalMessage::Delete(Delete {
                relation: RelationId(9),
                old: OldTuple {
                    kind,
                    tuple: TupleData(vec![text("")]),
                },
            })
        );
    }
}

#[test]
fn truncate_from_spec_bytes() {
    let msg = decode_ok(&[
        b"T",
        &2i32.to_be_bytes(),
        &[3],
        &10u32.to_be_bytes(),
        &11u32.to_be_bytes(),
    ]);
    let LogicalMessage::Truncate(t) = msg else {
        panic!("not a Truncate: {msg:?}")
    };
    assert!(t.options.cascade());
    assert!(t.options.restart_identity());
    assert_eq!(t.relations, [RelationId(10), RelationId(11)]);
}

#[test]
fn message_from_spec_bytes() {
    let msg = decode_ok(&[
        b"M",
        &[1],
        &0x20u64.to_be_bytes(),
        b"billing\0",
        &4i32.to_be_bytes(),
        &[0, b'a', 0, 0xFF], // content is bytes, NULs allowed
    ]);
    let LogicalMessage::Message(m) = msg else {
        panic!("not a Message: {msg:?}")
    };
    assert!(m.flags.is_transactional());
    assert_eq!(m.lsn, Lsn::new(0x20));
    assert_eq!(m.prefix, "billing");
    assert_eq!(&m.content[..], &[0, b'a', 0, 0xFF]);

    let empty = decode_ok(&[b"M", &[0], &0u64.to_be_bytes(), b"p\0", &0i32.to_be_bytes()]);
    let LogicalMessage::Message(m) = empty else {
        panic!("not a Message")
    };
    assert!(!m.flags.is_transactional());
    assert!(m.content.is_empty());
}

// ---- malformed input: each a typed error with kind and offset ----

#[test]
fn empty_and_unknown_tags() {
    assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
    assert_eq!(
        decode(Bytes::from_static(b"Z")),
        Err(DecodeError::UnknownTag { tag: b'Z' })
    );
}

#[test]
fn later_protocol_versions_are_unsupported_not_unknown() {
    for (tag, version) in [
        (b'S', 2),
        (b'E', 2),
        (b'c', 2),
        (b'A', 2),
        (b'b', 3),
        (b'P', 3),
        (b'K', 3),
        (b'r', 3),
        (b'p', 3),
    ] {
        let err = decode(Bytes::from(vec![tag, 0, 0, 0, 1])).unwrap_err();
        assert!(
            matches!(err, DecodeError::UnsupportedMessage { tag: t, version: v, .. } if t == tag && v == version),
            "{}: {err:?}",
            char::from(tag)
        );
    }
}

#[test]
fn truncated_field_reports_offset_and_need() {
    let err = decode(payload(&[b"B", &[0; 8], &[0; 5]])).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Truncated {
            kind: MessageKind::Begin,
            offset: 9,
            what: "commit timestamp",
            needed: 8,
            available: 5,
        }
    );
    assert_eq!(err.kind(), Some(MessageKind::Begin));
    assert_eq!(err.offset(), 9);
    assert!(err.to_string().contains("Begin ('B')"), "{err}");
}

#[test]
fn value_longer_than_the_payload_is_truncated() {
    let err = decode(payload(&[
        b"I",
        &[0; 4],
        b"N",
        &[0, 1],
        b"t",
        &i32::MAX.to_be_bytes(),
        b"ab",
    ]))
    .unwrap_err();
    assert_eq!(
        err,
        DecodeError::Truncated {
            kind: MessageKind::Insert,
            offset: 13,
            what: "text value",
            needed: i32::MAX as usize,
            available: 2,
        }
    );
}

#[test]
fn negative_lengths_are_rejected() {
    let err = decode(payload(&[
        b"I",
        &[0; 4],
        b"N",
        &[0, 1],
        b"t",
        &(-1i32).to_be_bytes(),
    ]))
    .unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::NegativeLength {
                kind: MessageKind::Insert,
                offset: 9,
                length: -1,
                ..
            }
        ),
        "{err:?}"
    );
    let err = decode(payload(&[b"T", &i32::MIN.to_be_bytes(), &[0]])).unwrap_err();
    assert!(
        matches!(err, DecodeError::NegativeLength { offset: 1, .. }),
        "{err:?}"
    );
    let err = decode(payload(&[
        b"M",
        &[0],
        &[0; 8],
        b"\0",
        &(-7i32).to_be_bytes(),
    ]))
    .unwrap_err();
    assert!(
        matches!(err, DecodeError::NegativeLength { offset: 11, .. }),
        "{err:?}"
    );
}

#[test]
fn forged_counts_do_not_allocate_or_loop_past_the_payload() {
    // 2^31 - 1 relations announced, one present.
    let err = decode(payload(&[
        b"T",
        &i32::MAX.to_be_bytes(),
        &[0],
        &[0, 0, 0, 1],
    ]))
    .unwrap_err();
    assert!(
        matches!(err, DecodeError::Truncated { offset: 10, .. }),
        "{err:?}"
    );
    // 65,535 columns announced, none present.
    let err = decode(payload(&[b"I", &[0; 4], b"N", &[0xFF, 0xFF]])).unwrap_err();
    assert!(
        matches!(err, DecodeError::Truncated { offset: 8, .. }),
        "{err:?}"
    );
}

#[test]
fn bad_markers_and_kinds() {
    let err = decode(payload(&[b"I", &[0; 4], b"K", &[0, 0]])).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::BadTupleKind {
                offset: 5,
                found: b'K',
                ..
            }
        ),
        "{err:?}"
    );
    let err = decode(payload(&[b"U", &[0; 4], b"X"])).unwrap_err();
    assert!(
        matches!(err, DecodeError::BadTupleKind { offset: 5, .. }),
        "{err:?}"
    );
    let err = decode(payload(&[b"U", &[0; 4], b"K", &[0, 0], b"O", &[0, 0]])).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::BadTupleKind {
                offset: 8,
                expected: "'N'",
                found: b'O',
                ..
            }
        ),
        "K and O together: {err:?}"
    );
    let err = decode(payload(&[b"D", &[0; 4], b"N", &[0, 0]])).unwrap_err();
    assert!(
        matches!(err, DecodeError::BadTupleKind { offset: 5, .. }),
        "{err:?}"
    );
    let err = decode(payload(&[b"I", &[0; 4], b"N", &[0, 2], b"n", b"x"])).unwrap_err();
    assert_eq!(
        err,
        DecodeError::BadColumnKind {
            kind: MessageKind::Insert,
            offset: 9,
            found: b'x'
        }
    );
    let err = decode(payload(&[b"R", &[0; 4], b"\0", b"t\0", b"z", &[0, 0]])).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::BadReplicaIdentity {
                offset: 8,
                found: b'z',
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn strings_must_be_terminated_utf8() {
    let err = decode(payload(&[b"O", &[0; 8], b"no-nul"])).unwrap_err();
    assert!(
        matches!(err, DecodeError::UnterminatedString { offset: 9, .. }),
        "{err:?}"
    );
    let err = decode(payload(&[b"Y", &[0; 4], b"ok\0", &[0xC3, 0x28, 0]])).unwrap_err();
    assert_eq!(
        err,
        DecodeError::InvalidUtf8 {
            kind: MessageKind::Type,
            offset: 8,
            what: "type name"
        }
    );
}

#[test]
fn trailing_bytes_are_rejected() {
    let err = decode(payload(&[b"B", &[0; 20], b"!"])).unwrap_err();
    assert_eq!(
        err,
        DecodeError::TrailingBytes {
            kind: MessageKind::Begin,
            offset: 21,
            remaining: 1
        }
    );
}

mod props;
