//! Encoding a [`LogicalMessage`] into pgoutput protocol version 1 bytes.
//!
//! The relay never sends these messages; this is the inverse of
//! [`decode`](super::decode) for tests and tools that fabricate streams
//! (round-trip tests, the fuzz corpus, other modules' fake sources).

use bytes::{BufMut, Bytes, BytesMut};

use super::message::{
    Column, ColumnValue, LogicalMessage, OldTuple, Relation, ReplicaIdentity, TupleData,
};

/// Encodes `msg` as one XLogData payload; `decode(encode(m)) == Ok(m)`.
///
/// # Panics
///
/// If `msg` cannot exist on the wire: a name or prefix containing a NUL
/// byte, more than 65,535 columns or values, or a count or length above
/// `i32::MAX`. Meant for tests and tools, where that is a bug in the caller.
pub fn encode(msg: &LogicalMessage) -> Bytes {
    let mut out = BytesMut::with_capacity(64);
    out.put_u8(msg.kind().tag());
    match msg {
        LogicalMessage::Begin(m) => {
            out.put_u64(m.final_lsn.as_u64());
            out.put_i64(m.commit_time);
            out.put_u32(m.xid);
        }
        LogicalMessage::Commit(m) => {
            out.put_u8(m.flags);
            out.put_u64(m.commit_lsn.as_u64());
            out.put_u64(m.end_lsn.as_u64());
            out.put_i64(m.commit_time);
        }
        LogicalMessage::Origin(m) => {
            out.put_u64(m.commit_lsn.as_u64());
            put_string(&mut out, &m.name);
        }
        LogicalMessage::Relation(m) => put_relation(&mut out, m),
        LogicalMessage::Type(m) => {
            out.put_u32(m.oid);
            put_string(&mut out, &m.namespace);
            put_string(&mut out, &m.name);
        }
        LogicalMessage::Insert(m) => {
            out.put_u32(m.relation.0);
            out.put_u8(b'N');
            put_tuple(&mut out, &m.new);
        }
        LogicalMessage::Update(m) => {
            out.put_u32(m.relation.0);
            if let Some(old) = &m.old {
                put_old_tuple(&mut out, old);
            }
            out.put_u8(b'N');
            put_tuple(&mut out, &m.new);
        }
        LogicalMessage::Delete(m) => {
            out.put_u32(m.relation.0);
            put_old_tuple(&mut out, &m.old);
        }
        LogicalMessage::Truncate(m) => {
            out.put_i32(wire_i32(m.relations.len(), "relation count"));
            out.put_u8(m.options.0);
            for relation in &m.relations {
                out.put_u32(relation.0);
            }
        }
        LogicalMessage::Message(m) => {
            out.put_u8(m.flags.0);
            out.put_u64(m.lsn.as_u64());
            put_string(&mut out, &m.prefix);
            put_bytes(&mut out, &m.content, "content length");
        }
    }
    out.freeze()
}

fn put_relation(out: &mut BytesMut, relation: &Relation) {
    out.put_u32(relation.oid.0);
    put_string(out, &relation.namespace);
    put_string(out, &relation.name);
    out.put_u8(ReplicaIdentity::to_byte(relation.replica_identity));
    out.put_u16(wire_u16(relation.columns.len(), "column count"));
    for column in &relation.columns {
        put_column(out, column);
    }
}

fn put_column(out: &mut BytesMut, column: &Column) {
    out.put_u8(column.flags.0);
    put_string(out, &column.name);
    out.put_u32(column.type_oid);
    out.put_i32(column.type_modifier);
}

fn put_old_tuple(out: &mut BytesMut, old: &OldTuple) {
    out.put_u8(old.kind.to_byte());
    put_tuple(out, &old.tuple);
}

fn put_tuple(out: &mut BytesMut, tuple: &TupleData) {
    out.put_u16(wire_u16(tuple.len(), "tuple column count"));
    for value in tuple.values() {
        match value {
            ColumnValue::Null => out.put_u8(b'n'),
            ColumnValue::UnchangedToast => out.put_u8(b'u'),
            ColumnValue::Text(bytes) => {
                out.put_u8(b't');
                put_bytes(out, bytes, "text value length");
            }
            ColumnValue::Binary(bytes) => {
                out.put_u8(b'b');
                put_bytes(out, bytes, "binary value length");
            }
        }
    }
}

/// Int32 length, then the bytes.
fn put_bytes(out: &mut BytesMut, bytes: &[u8], what: &str) {
    out.put_i32(wire_i32(bytes.len(), what));
    out.put_slice(bytes);
}

/// A String field: the bytes, then a NUL terminator.
fn put_string(out: &mut BytesMut, s: &str) {
    assert!(
        !s.as_bytes().contains(&0),
        "pgoutput strings cannot contain NUL: {s:?}"
    );
    out.put_slice(s.as_bytes());
    out.put_u8(0);
}

fn wire_u16(n: usize, what: &str) -> u16 {
    u16::try_from(n).unwrap_or_else(|_| panic!("{what} {n} does not fit an Int16"))
}

fn wire_i32(n: usize, what: &str) -> i32 {
    i32::try_from(n).unwrap_or_else(|_| panic!("{what} {n} does not fit an Int32"))
}
