//! Decoding one XLogData payload into a [`LogicalMessage`].
//!
//! The payload is untrusted input: every read is bounds-checked, every
//! length is checked for sign and converted with `usize::try_from`, and
//! allocations are capped by the bytes actually present, so no input makes
//! the decoder panic or allocate much more than the payload's size.

use bytes::Bytes;

use super::message::{
    Begin, Column, ColumnFlags, ColumnValue, Commit, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, MessageFlags, MessageKind, OldTuple, OldTupleKind, Origin, Relation,
    RelationId, ReplicaIdentity, Truncate, TruncateOptions, TupleData, TypeMessage, Update,
};
use crate::lsn::Lsn;

/// Why a payload is not a valid protocol version 1 message.
///
/// Offsets count bytes from the start of the payload, whose tag byte is at
/// offset 0, and point at the start of the field that failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload has no bytes at all, not even a tag.
    #[error("empty pgoutput message: no tag byte")]
    Empty,
    /// The tag names no known pgoutput message.
    #[error("unknown pgoutput message tag {tag:#04x} ('{}')", char::from(*tag))]
    UnknownTag {
        /// The first byte of the payload.
        tag: u8,
    },
    /// The tag names a message of a later protocol version (streaming in
    /// version 2, two-phase commit in version 3), which this decoder does not
    /// speak: the stream was started with the wrong `proto_version` or options.
    #[error("unsupported pgoutput message {name} ('{}'): needs protocol version {version}, only 1 is supported", char::from(*tag))]
    UnsupportedMessage {
        /// The first byte of the payload.
        tag: u8,
        /// The spec's name for the message, e.g. `"Stream Start"`.
        name: &'static str,
        /// The protocol version that introduced it.
        version: u8,
    },
    /// The payload ended inside a field.
    #[error(
        "{kind} message truncated at byte {offset}: {what} needs {needed} byte(s), {available} left"
    )]
    Truncated {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the field starts.
        offset: usize,
        /// The field being read.
        what: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the payload.
        available: usize,
    },
    /// A String field has no terminating NUL before the end of the payload.
    #[error("{kind} message: {what} at byte {offset} has no terminating NUL")]
    UnterminatedString {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the string starts.
        offset: usize,
        /// The field being read.
        what: &'static str,
    },
    /// A String field is not valid UTF-8.
    #[error("{kind} message: {what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the string starts.
        offset: usize,
        /// The field being read.
        what: &'static str,
    },
    /// An Int32 length or count is negative.
    #[error("{kind} message: {what} at byte {offset} is negative ({length})")]
    NegativeLength {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the length starts.
        offset: usize,
        /// The field being read.
        what: &'static str,
        /// The value received.
        length: i64,
    },
    /// A length or count does not fit this platform's address space.
    #[error("{kind} message: {what} at byte {offset} is too large ({length})")]
    LengthOverflow {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the length starts.
        offset: usize,
        /// The field being read.
        what: &'static str,
        /// The value received.
        length: u64,
    },
    /// A tuple marker is not the one the message allows there
    /// (`N` for a new row, `K` or `O` for an old one).
    #[error("{kind} message: expected {expected} at byte {offset}, found {found:#04x}")]
    BadTupleKind {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the marker is.
        offset: usize,
        /// What the message allows there, e.g. `"'N'"`.
        expected: &'static str,
        /// The byte received.
        found: u8,
    },
    /// A column value's kind byte is none of `n`, `u`, `t`, `b`.
    #[error(
        "{kind} message: column value kind at byte {offset} is {found:#04x}, expected 'n', 'u', 't' or 'b'"
    )]
    BadColumnKind {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the kind byte is.
        offset: usize,
        /// The byte received.
        found: u8,
    },
    /// A Relation's replica identity byte is none of `d`, `n`, `f`, `i`.
    #[error(
        "{kind} message: replica identity at byte {offset} is {found:#04x}, expected 'd', 'n', 'f' or 'i'"
    )]
    BadReplicaIdentity {
        /// The message being decoded.
        kind: MessageKind,
        /// Where the byte is.
        offset: usize,
        /// The byte received.
        found: u8,
    },
    /// Bytes remain after a complete message: the payload holds something
    /// this decoder does not understand, so nothing of it is trusted.
    #[error("{kind} message complete at byte {offset} but {remaining} byte(s) follow")]
    TrailingBytes {
        /// The message decoded.
        kind: MessageKind,
        /// Where the message ended.
        offset: usize,
        /// Bytes left over.
        remaining: usize,
    },
}

impl DecodeError {
    /// The kind of message that failed, when the tag was a known one.
    pub fn kind(&self) -> Option<MessageKind> {
        match self {
            DecodeError::Empty
            | DecodeError::UnknownTag { .. }
            | DecodeError::UnsupportedMessage { .. } => None,
            DecodeError::Truncated { kind, .. }
            | DecodeError::UnterminatedString { kind, .. }
            | DecodeError::InvalidUtf8 { kind, .. }
            | DecodeError::NegativeLength { kind, .. }
            | DecodeError::LengthOverflow { kind, .. }
            | DecodeError::BadTupleKind { kind, .. }
            | DecodeError::BadColumnKind { kind, .. }
            | DecodeError::BadReplicaIdentity { kind, .. }
            | DecodeError::TrailingBytes { kind, .. } => Some(*kind),
        }
    }

    /// The payload offset the error refers to (0 for tag errors).
    pub fn offset(&self) -> usize {
        match self {
            DecodeError::Empty
            | DecodeError::UnknownTag { .. }
            | DecodeError::UnsupportedMessage { .. } => 0,
            DecodeError::Truncated { offset, .. }
            | DecodeError::UnterminatedString { offset, .. }
            | DecodeError::InvalidUtf8 { offset, .. }
            | DecodeError::NegativeLength { offset, .. }
            | DecodeError::LengthOverflow { offset, .. }
            | DecodeError::BadTupleKind { offset, .. }
            | DecodeError::BadColumnKind { offset, .. }
            | DecodeError::BadReplicaIdentity { offset, .. }
            | DecodeError::TrailingBytes { offset, .. } => *offset,
        }
    }
}

/// Decodes one XLogData payload of a pgoutput stream started with
/// `proto_version '1'`.
///
/// Column values and message contents are slices of `buf` (no copies);
/// names are copied into `String`s. The whole payload must be one message.
///
/// # Errors
///
/// [`DecodeError`] for anything but exactly one well-formed version 1
/// message; version 2/3 tags give [`DecodeError::UnsupportedMessage`].
pub fn decode(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    let tag = *buf.first().ok_or(DecodeError::Empty)?;
    let kind = MessageKind::from_tag(tag).ok_or_else(|| unsupported_or_unknown(tag))?;
    let mut r = Reader { buf, pos: 1, kind };
    let msg = match kind {
        MessageKind::Begin => LogicalMessage::Begin(r.begin()?),
        MessageKind::Commit => LogicalMessage::Commit(r.commit()?),
        MessageKind::Origin => LogicalMessage::Origin(r.origin()?),
        MessageKind::Relation => LogicalMessage::Relation(r.relation()?),
        MessageKind::Type => LogicalMessage::Type(r.type_message()?),
        MessageKind::Insert => LogicalMessage::Insert(r.insert()?),
        MessageKind::Update => LogicalMessage::Update(r.update()?),
        MessageKind::Delete => LogicalMessage::Delete(r.delete()?),
        MessageKind::Truncate => LogicalMessage::Truncate(r.truncate()?),
        MessageKind::Message => LogicalMessage::Message(r.logical_message()?),
    };
    r.finish()?;
    Ok(msg)
}

/// Tags of protocol versions 2 (streaming) and 3 (two-phase commit), from
/// PostgreSQL's `LogicalRepMsgType`.
fn unsupported_or_unknown(tag: u8) -> DecodeError {
    let (name, version) = match tag {
        b'S' => ("Stream Start", 2),
        b'E' => ("Stream Stop", 2),
        b'c' => ("Stream Commit", 2),
        b'A' => ("Stream Abort", 2),
        b'b' => ("Begin Prepare", 3),
        b'P' => ("Prepare", 3),
        b'K' => ("Commit Prepared", 3),
        b'r' => ("Rollback Prepared", 3),
        b'p' => ("Stream Prepare", 3),
        _ => return DecodeError::UnknownTag { tag },
    };
    DecodeError::UnsupportedMessage { tag, name, version }
}

/// A cursor over one payload. `pos` never exceeds `buf.len()`.
struct Reader {
    buf: Bytes,
    pos: usize,
    kind: MessageKind,
}

/// Smallest encoding of one Relation column: flags, empty name, two Int32s.
const MIN_COLUMN_LEN: usize = 1 + 1 + 4 + 4;
/// Smallest encoding of one tuple value: a bare kind byte (`n` or `u`).
const MIN_VALUE_LEN: usize = 1;

impl Reader {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Takes the next `n` bytes as a slice of the payload.
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], DecodeError> {
        let available = self.remaining();
        if n > available {
            return Err(DecodeError::Truncated {
                kind: self.kind,
                offset: self.pos,
                what,
                needed: n,
                available,
            });
        }
        let start = self.pos;
        self.pos += n;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N, what)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.array(what).map(u16::from_be_bytes)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.array(what).map(u32::from_be_bytes)
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        self.array(what).map(i32::from_be_bytes)
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        self.array(what).map(i64::from_be_bytes)
    }

    fn lsn(&mut self, what: &'static str) -> Result<Lsn, DecodeError> {
        self.array(what).map(u64::from_be_bytes).map(Lsn::new)
    }

    fn relation_id(&mut self) -> Result<RelationId, DecodeError> {
        self.u32("relation OID").map(RelationId)
    }

    /// Reads an Int32 length or count, rejecting negative values.
    fn length(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let length = self.i32(what)?;
        let kind = self.kind;
        let unsigned = u32::try_from(length).map_err(|_| DecodeError::NegativeLength {
            kind,
            offset,
            what,
            length: i64::from(length),
        })?;
        usize::try_from(unsigned).map_err(|_| DecodeError::LengthOverflow {
            kind,
            offset,
            what,
            length: u64::from(unsigned),
        })
    }

    /// Reads `len` bytes as a zero-copy slice of the payload.
    fn bytes(&mut self, len: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        let start = self.pos;
        self.take(len, what)?;
        Ok(self.buf.slice(start..self.pos))
    }

    /// Reads a NUL-terminated UTF-8 string and skips its terminator.
    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let offset = self.pos;
        let kind = self.kind;
        let rest = &self.buf[offset..];
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString { kind, offset, what })?;
        let text = std::str::from_utf8(&rest[..len])
            .map_err(|_| DecodeError::InvalidUtf8 { kind, offset, what })?
            .to_owned();
        self.pos += len + 1;
        Ok(text)
    }

    /// Caps a count read from the wire by what the remaining bytes can hold,
    /// so a forged count cannot trigger a huge allocation.
    fn capacity(&self, count: usize, min_item_len: usize) -> usize {
        count.min(self.remaining() / min_item_len)
    }

    fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            remaining => Err(DecodeError::TrailingBytes {
                kind: self.kind,
                offset: self.pos,
                remaining,
            }),
        }
    }

    fn begin(&mut self) -> Result<Begin, DecodeError> {
        Ok(Begin {
            final_lsn: self.lsn("final LSN")?,
            commit_time: self.i64("commit timestamp")?,
            xid: self.u32("xid")?,
        })
    }

    fn commit(&mut self) -> Result<Commit, DecodeError> {
        Ok(Commit {
            flags: self.u8("flags")?,
            commit_lsn: self.lsn("commit LSN")?,
            end_lsn: self.lsn("end LSN")?,
            commit_time: self.i64("commit timestamp")?,
        })
    }

    fn origin(&mut self) -> Result<Origin, DecodeError> {
        Ok(Origin {
            commit_lsn: self.lsn("origin commit LSN")?,
            name: self.string("origin name")?,
        })
    }

    fn relation(&mut self) -> Result<Relation, DecodeError> {
        let oid = self.relation_id()?;
        let namespace = self.string("namespace")?;
        let name = self.string("relation name")?;
        let replica_identity = self.replica_identity()?;
        let count = usize::from(self.u16("column count")?);
        let mut columns = Vec::with_capacity(self.capacity(count, MIN_COLUMN_LEN));
        for _ in 0..count {
            columns.push(self.column()?);
        }
        Ok(Relation {
            oid,
            namespace,
            name,
            replica_identity,
            columns,
        })
    }

    fn replica_identity(&mut self) -> Result<ReplicaIdentity, DecodeError> {
        let offset = self.pos;
        let found = self.u8("replica identity")?;
        ReplicaIdentity::from_byte(found).ok_or(DecodeError::BadReplicaIdentity {
            kind: self.kind,
            offset,
            found,
        })
    }

    fn column(&mut self) -> Result<Column, DecodeError> {
        Ok(Column {
            flags: ColumnFlags(self.u8("column flags")?),
            name: self.string("column name")?,
            type_oid: self.u32("column type OID")?,
            type_modifier: self.i32("column type modifier")?,
        })
    }

    fn type_message(&mut self) -> Result<TypeMessage, DecodeError> {
        Ok(TypeMessage {
            oid: self.u32("type OID")?,
            namespace: self.string("namespace")?,
            name: self.string("type name")?,
        })
    }

    fn insert(&mut self) -> Result<Insert, DecodeError> {
        let relation = self.relation_id()?;
        self.expect_new_marker()?;
        Ok(Insert {
            relation,
            new: self.tuple()?,
        })
    }

    fn update(&mut self) -> Result<Update, DecodeError> {
        let relation = self.relation_id()?;
        let offset = self.pos;
        let marker = self.u8("tuple kind")?;
        let old = match marker {
            b'N' => None,
            b'K' | b'O' => {
                let old = self.old_tuple_after(marker)?;
                self.expect_new_marker()?;
                Some(old)
            }
            found => return Err(self.bad_tuple_kind(offset, "'K', 'O' or 'N'", found)),
        };
        Ok(Update {
            relation,
            old,
            new: self.tuple()?,
        })
    }

    fn delete(&mut self) -> Result<Delete, DecodeError> {
        let relation = self.relation_id()?;
        let offset = self.pos;
        let marker = self.u8("tuple kind")?;
        if !matches!(marker, b'K' | b'O') {
            return Err(self.bad_tuple_kind(offset, "'K' or 'O'", marker));
        }
        Ok(Delete {
            relation,
            old: self.old_tuple_after(marker)?,
        })
    }

    /// Reads the TupleData following a `K` or `O` marker.
    fn old_tuple_after(&mut self, marker: u8) -> Result<OldTuple, DecodeError> {
        let kind = if marker == b'K' {
            OldTupleKind::Key
        } else {
            OldTupleKind::Old
        };
        Ok(OldTuple {
            kind,
            tuple: self.tuple()?,
        })
    }

    fn expect_new_marker(&mut self) -> Result<(), DecodeError> {
        let offset = self.pos;
        match self.u8("tuple kind")? {
            b'N' => Ok(()),
            found => Err(self.bad_tuple_kind(offset, "'N'", found)),
        }
    }

    fn bad_tuple_kind(&self, offset: usize, expected: &'static str, found: u8) -> DecodeError {
        DecodeError::BadTupleKind {
            kind: self.kind,
            offset,
            expected,
            found,
        }
    }

    fn truncate(&mut self) -> Result<Truncate, DecodeError> {
        let count = self.length("relation count")?;
        let options = TruncateOptions(self.u8("truncate options")?);
        let mut relations = Vec::with_capacity(self.capacity(count, 4));
        for _ in 0..count {
            relations.push(self.relation_id()?);
        }
        Ok(Truncate { options, relations })
    }

    fn logical_message(&mut self) -> Result<LogicalDecodingMessage, DecodeError> {
        let flags = MessageFlags(self.u8("flags")?);
        let lsn = self.lsn("message LSN")?;
        let prefix = self.string("prefix")?;
        let len = self.length("content length")?;
        Ok(LogicalDecodingMessage {
            flags,
            lsn,
            prefix,
            content: self.bytes(len, "content")?,
        })
    }

    /// TupleData: Int16 column count, then one value per column.
    fn tuple(&mut self) -> Result<TupleData, DecodeError> {
        let count = usize::from(self.u16("tuple column count")?);
        let mut values = Vec::with_capacity(self.capacity(count, MIN_VALUE_LEN));
        for _ in 0..count {
            values.push(self.column_value()?);
        }
        Ok(TupleData(values))
    }

    fn column_value(&mut self) -> Result<ColumnValue, DecodeError> {
        let offset = self.pos;
        match self.u8("column value kind")? {
            b'n' => Ok(ColumnValue::Null),
            b'u' => Ok(ColumnValue::UnchangedToast),
            b't' => {
                let len = self.length("text value length")?;
                self.bytes(len, "text value").map(ColumnValue::Text)
            }
            b'b' => {
                let len = self.length("binary value length")?;
                self.bytes(len, "binary value").map(ColumnValue::Binary)
            }
            found => Err(DecodeError::BadColumnKind {
                kind: self.kind,
                offset,
                found,
            }),
        }
    }
}
