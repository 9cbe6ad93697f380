//! Property tests of the decoder: every message the encoder can write
//! round-trips, and arbitrary or mutated bytes never panic and are either
//! refused or decoded to exactly what re-encodes to them.

use bytes::Bytes;
use proptest::prelude::*;

use super::super::*;
use crate::lsn::Lsn;

/// A String field: any UTF-8 without NUL, which the wire cannot carry.
fn name() -> impl Strategy<Value = String> {
    "[^\u{0}]{0,12}"
}

fn lsn() -> impl Strategy<Value = Lsn> {
    any::<u64>().prop_map(Lsn::new)
}

fn raw_bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn column_value() -> impl Strategy<Value = ColumnValue> {
    prop_oneof![
        Just(ColumnValue::Null),
        Just(ColumnValue::UnchangedToast),
        raw_bytes(40).prop_map(ColumnValue::Text),
        raw_bytes(40).prop_map(ColumnValue::Binary),
    ]
}

fn tuple() -> impl Strategy<Value = TupleData> {
    prop::collection::vec(column_value(), 0..8).prop_map(TupleData)
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    (
        prop_oneof![Just(OldTupleKind::Key), Just(OldTupleKind::Old)],
        tuple(),
    )
        .prop_map(|(kind, tuple)| OldTuple { kind, tuple })
}

fn relation_id() -> impl Strategy<Value = RelationId> {
    any::<u32>().prop_map(RelationId)
}

fn relation() -> impl Strategy<Value = Relation> {
    let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| Column {
            flags: ColumnFlags(flags),
            name,
            type_oid,
            type_modifier,
        },
    );
    let identity = prop_oneof![
        Just(ReplicaIdentity::Default),
        Just(ReplicaIdentity::Nothing),
        Just(ReplicaIdentity::Full),
        Just(ReplicaIdentity::Index),
    ];
    (
        relation_id(),
        name(),
        name(),
        identity,
        prop::collection::vec(column, 0..6),
    )
        .prop_map(
            |(oid, namespace, name, replica_identity, columns)| Relation {
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            },
        )
}

fn logical_message() -> impl Strategy<Value = LogicalMessage> {
    prop_oneof![
        (lsn(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
            LogicalMessage::Begin(Begin {
                final_lsn,
                commit_time,
                xid,
            })
        }),
        (any::<u8>(), lsn(), lsn(), any::<i64>()).prop_map(
            |(flags, commit_lsn, end_lsn, commit_time)| {
                LogicalMessage::Commit(Commit {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                })
            }
        ),
        (lsn(), name())
            .prop_map(|(commit_lsn, name)| LogicalMessage::Origin(Origin { commit_lsn, name })),
        relation().prop_map(LogicalMessage::Relation),
        (any::<u32>(), name(), name()).prop_map(|(oid, namespace, name)| LogicalMessage::Type(
            TypeMessage {
                oid,
                namespace,
                name
            }
        )),
        (relation_id(), tuple())
            .prop_map(|(relation, new)| LogicalMessage::Insert(Insert { relation, new })),
        (relation_id(), prop::option::of(old_tuple()), tuple())
            .prop_map(|(relation, old, new)| LogicalMessage::Update(Update { relation, old, new })),
        (relation_id(), old_tuple())
            .prop_map(|(relation, old)| LogicalMessage::Delete(Delete { relation, old })),
        (any::<u8>(), prop::collection::vec(relation_id(), 0..6)).prop_map(
            |(options, relations)| {
                LogicalMessage::Truncate(Truncate {
                    options: TruncateOptions(options),
                    relations,
                })
            }
        ),
        (any::<u8>(), lsn(), name(), raw_bytes(64)).prop_map(|(flags, lsn, prefix, content)| {
            LogicalMessage::Message(LogicalDecodingMessage {
                flags: MessageFlags(flags),
                lsn,
                prefix,
                content,
            })
        }),
    ]
}

/// Decodes arbitrary input; whatever it accepts must re-encode to exactly
/// the same bytes (the decoder drops nothing and invents nothing).
fn check_no_panic_and_canonical(input: Vec<u8>) -> Result<(), TestCaseError> {
    let len = input.len();
    let buf = Bytes::from(input);
    match decode(buf.clone()) {
        Ok(msg) => prop_assert_eq!(encode(&msg), buf),
        Err(err) => prop_assert!(err.offset() <= len, "{err:?} past the end of {len} bytes"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn encode_then_decode_round_trips(msg in logical_message()) {
        prop_assert_eq!(decode(encode(&msg)), Ok(msg));
    }

    #[test]
    fn arbitrary_bytes_never_panic(input in prop::collection::vec(any::<u8>(), 0..256)) {
        check_no_panic_and_canonical(input)?;
    }

    #[test]
    fn arbitrary_bodies_after_valid_tags_never_panic(
        tag in prop::sample::select(b"BCORYIUDTM".to_vec()),
        body in prop::collection::vec(
            prop_oneof![any::<u8>(), prop::sample::select(b"\0NKOnutb".to_vec())], 0..128),
    ) {
        let mut input = vec![tag];
        input.extend(body);
        check_no_panic_and_canonical(input)?;
    }

    #[test]
    fn every_strict_prefix_is_an_error(msg in logical_message()) {
        let full = encode(&msg);
        for cut in 0..full.len() {
            prop_assert!(decode(full.slice(..cut)).is_err(), "prefix of {} bytes decoded", cut);
        }
    }

    #[test]
    fn single_byte_mutations_never_panic(
        msg in logical_message(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let mut input = encode(&msg).to_vec();
        let i = at.index(input.len());
        input[i] = byte;
        check_no_panic_and_canonical(input)?;
    }
}
