//! The messages of pgoutput protocol version 1, one type per message kind.
//!
//! Field docs paraphrase PostgreSQL's "Logical Replication Message Formats"
//! (protocol chapter, §55.9 in the PostgreSQL 15 manual). Integers are
//! big-endian on the wire; "String" there means NUL-terminated bytes, which
//! this module requires to be UTF-8.

use bytes::Bytes;
use std::fmt;

use crate::lsn::Lsn;

/// OID of a table, as sent in Relation messages and referenced by
/// Insert/Update/Delete/Truncate (`pg_class.oid` on the publisher).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelationId(pub u32);

impl fmt::Display for RelationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One decoded XLogData payload of a pgoutput (protocol version 1) stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogicalMessage {
    /// `B`: start of a committed transaction.
    Begin(Begin),
    /// `C`: end of the transaction opened by the last [`Begin`].
    Commit(Commit),
    /// `O`: the transaction was replicated from another node.
    Origin(Origin),
    /// `R`: the current shape of a table; replaces any earlier one for its OID.
    Relation(Relation),
    /// `Y`: name of a non-built-in data type used by a following Relation.
    Type(TypeMessage),
    /// `I`: a row was inserted.
    Insert(Insert),
    /// `U`: a row was updated.
    Update(Update),
    /// `D`: a row was deleted.
    Delete(Delete),
    /// `T`: one or more tables were truncated.
    Truncate(Truncate),
    /// `M`: a message written by `pg_logical_emit_message`.
    Message(LogicalDecodingMessage),
}

impl LogicalMessage {
    /// Which kind of message this is.
    pub fn kind(&self) -> MessageKind {
        match self {
            LogicalMessage::Begin(_) => MessageKind::Begin,
            LogicalMessage::Commit(_) => MessageKind::Commit,
            LogicalMessage::Origin(_) => MessageKind::Origin,
            LogicalMessage::Relation(_) => MessageKind::Relation,
            LogicalMessage::Type(_) => MessageKind::Type,
            LogicalMessage::Insert(_) => MessageKind::Insert,
            LogicalMessage::Update(_) => MessageKind::Update,
            LogicalMessage::Delete(_) => MessageKind::Delete,
            LogicalMessage::Truncate(_) => MessageKind::Truncate,
            LogicalMessage::Message(_) => MessageKind::Message,
        }
    }
}

/// The kinds of protocol version 1 message, named after their spec entries.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// `B`
    Begin,
    /// `C`
    Commit,
    /// `O`
    Origin,
    /// `R`
    Relation,
    /// `Y`
    Type,
    /// `I`
    Insert,
    /// `U`
    Update,
    /// `D`
    Delete,
    /// `T`
    Truncate,
    /// `M`
    Message,
}

impl MessageKind {
    /// The tag byte that opens messages of this kind.
    pub const fn tag(self) -> u8 {
        match self {
            MessageKind::Begin => b'B',
            MessageKind::Commit => b'C',
            MessageKind::Origin => b'O',
            MessageKind::Relation => b'R',
            MessageKind::Type => b'Y',
            MessageKind::Insert => b'I',
            MessageKind::Update => b'U',
            MessageKind::Delete => b'D',
            MessageKind::Truncate => b'T',
            MessageKind::Message => b'M',
        }
    }

    /// The kind a tag byte opens, if it is a protocol version 1 kind.
    pub const fn from_tag(tag: u8) -> Option<MessageKind> {
        Some(match tag {
            b'B' => MessageKind::Begin,
            b'C' => MessageKind::Commit,
            b'O' => MessageKind::Origin,
            b'R' => MessageKind::Relation,
            b'Y' => MessageKind::Type,
            b'I' => MessageKind::Insert,
            b'U' => MessageKind::Update,
            b'D' => MessageKind::Delete,
            b'T' => MessageKind::Truncate,
            b'M' => MessageKind::Message,
            _ => return None,
        })
    }

    /// The spec's name for the kind, e.g. `"Insert"`.
    pub const fn name(self) -> &'static str {
        match self {
            MessageKind::Begin => "Begin",
            MessageKind::Commit => "Commit",
            MessageKind::Origin => "Origin",
            MessageKind::Relation => "Relation",
            MessageKind::Type => "Type",
            MessageKind::Insert => "Insert",
            MessageKind::Update => "Update",
            MessageKind::Delete => "Delete",
            MessageKind::Truncate => "Truncate",
            MessageKind::Message => "Message",
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ('{}')", self.name(), char::from(self.tag()))
    }
}

/// Begin (`B`): opens a transaction. Only committed transactions are sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Begin {
    /// Int64: the final LSN of the transaction (its commit record).
    pub final_lsn: Lsn,
    /// Int64: commit timestamp, microseconds since 2000-01-01 00:00 UTC
    /// (the PostgreSQL epoch).
    pub commit_time: i64,
    /// Int32: transaction id (xid) on the publisher.
    pub xid: u32,
}

/// Commit (`C`): closes the transaction opened by the last [`Begin`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// Int8: flags; currently unused and sent as 0. Kept raw, not checked,
    /// so that a future flag does not stop the stream.
    pub flags: u8,
    /// Int64: the LSN of the commit record.
    pub commit_lsn: Lsn,
    /// Int64: the end LSN of the transaction, i.e. the position just past
    /// its commit record. This is the position to acknowledge.
    pub end_lsn: Lsn,
    /// Int64: commit timestamp, microseconds since 2000-01-01 00:00 UTC.
    pub commit_time: i64,
}

/// Origin (`O`): the transaction was applied here from another node. There
/// may be several inside one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// Int64: the LSN of the commit on the origin server.
    pub commit_lsn: Lsn,
    /// String: name of the origin.
    pub name: String,
}

/// Relation (`R`): the current description of a published table. Sent
/// before the first change to the table in a session and again whenever its
/// definition changed; a new one replaces the old one for the same OID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    /// Int32: OID of the relation.
    pub oid: RelationId,
    /// String: schema name; the empty string stands for `pg_catalog`.
    pub namespace: String,
    /// String: relation name.
    pub name: String,
    /// Int8: replica identity setting (`pg_class.relreplident`).
    pub replica_identity: ReplicaIdentity,
    /// Int16 count, then one entry per column, in the order tuple values are
    /// sent. Dropped and generated columns (and, since PostgreSQL 15, columns
    /// left out of the publication's column list) are not listed.
    pub columns: Vec<Column>,
}

/// Replica identity of a table: what its Update and Delete messages carry
/// as the old row (`pg_class.relreplident`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    /// `d`: the primary key, if any.
    Default,
    /// `n`: nothing.
    Nothing,
    /// `f`: all columns.
    Full,
    /// `i`: the columns of a chosen unique index.
    Index,
}

impl ReplicaIdentity {
    /// The `relreplident` byte for this setting.
    pub const fn to_byte(self) -> u8 {
        match self {
            ReplicaIdentity::Default => b'd',
            ReplicaIdentity::Nothing => b'n',
            ReplicaIdentity::Full => b'f',
            ReplicaIdentity::Index => b'i',
        }
    }

    /// The setting a `relreplident` byte names, if any.
    pub const fn from_byte(byte: u8) -> Option<ReplicaIdentity> {
        Some(match byte {
            b'd' => ReplicaIdentity::Default,
            b'n' => ReplicaIdentity::Nothing,
            b'f' => ReplicaIdentity::Full,
            b'i' => ReplicaIdentity::Index,
            _ => return None,
        })
    }
}

/// One column of a [`Relation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    /// Int8: column flags; see [`ColumnFlags`].
    pub flags: ColumnFlags,
    /// String: column name (`pg_attribute.attname`).
    pub name: String,
    /// Int32: OID of the column's data type (`pg_type.oid`).
    pub type_oid: u32,
    /// Int32: type modifier (`pg_attribute.atttypmod`); -1 when the type has
    /// none, e.g. `varchar(10)` sends 14 (10 + the 4-byte header).
    pub type_modifier: i32,
}

/// Column flags of a Relation message. Bits other than [`ColumnFlags::KEY`]
/// are undefined by the spec and kept as received.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ColumnFlags(pub u8);

impl ColumnFlags {
    /// Bit 1: the column is part of the replica identity (the "key").
    pub const KEY: ColumnFlags = ColumnFlags(1);

    /// Whether the column is part of the replica identity.
    pub const fn is_key(self) -> bool {
        self.0 & Self::KEY.0 != 0
    }
}

/// Type (`Y`): names a data type that is not built in (an enum, a domain,
/// an extension type) before a Relation that uses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeMessage {
    /// Int32: OID of the data type.
    pub oid: u32,
    /// String: schema name; the empty string stands for `pg_catalog`.
    pub namespace: String,
    /// String: name of the data type.
    pub name: String,
}

/// Insert (`I`): one inserted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insert {
    /// Int32: OID of the relation, as in its Relation message.
    pub relation: RelationId,
    /// Byte1(`N`) then TupleData: the new row.
    pub new: TupleData,
}

/// Update (`U`): one updated row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    /// Int32: OID of the relation, as in its Relation message.
    pub relation: RelationId,
    /// Optional Byte1(`K`) or Byte1(`O`) then TupleData: the old key, sent
    /// when the update changed a replica identity column, or the whole old
    /// row, sent when the replica identity is FULL. Never both.
    pub old: Option<OldTuple>,
    /// Byte1(`N`) then TupleData: the new row. Unchanged TOASTed values are
    /// [`ColumnValue::UnchangedToast`].
    pub new: TupleData,
}

/// Delete (`D`): one deleted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    /// Int32: OID of the relation, as in its Relation message.
    pub relation: RelationId,
    /// Byte1(`K`) or Byte1(`O`) then TupleData: the old key (replica identity
    /// DEFAULT or INDEX; the other columns are sent as NULL) or the whole
    /// old row (replica identity FULL).
    pub old: OldTuple,
}

/// The old-row part of an [`Update`] or [`Delete`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OldTuple {
    /// Whether the tuple holds only the key or the whole old row.
    pub kind: OldTupleKind,
    /// The values, one per column of the relation.
    pub tuple: TupleData,
}

/// The marker before an old tuple.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum OldTupleKind {
    /// `K`: the replica identity key columns.
    Key,
    /// `O`: the whole old row (replica identity FULL).
    Old,
}

impl OldTupleKind {
    /// The marker byte for this kind.
    pub const fn to_byte(self) -> u8 {
        match self {
            OldTupleKind::Key => b'K',
            OldTupleKind::Old => b'O',
        }
    }
}

/// Truncate (`T`): one TRUNCATE statement over one or more published tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncate {
    /// Int8: option bits; see [`TruncateOptions`].
    pub options: TruncateOptions,
    /// Int32 count, then Int32 OID per truncated relation.
    pub relations: Vec<RelationId>,
}

/// Option bits of a Truncate message. Undefined bits are kept as received.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TruncateOptions(pub u8);

impl TruncateOptions {
    /// Bit 1: `CASCADE`.
    pub const CASCADE: TruncateOptions = TruncateOptions(1);
    /// Bit 2: `RESTART IDENTITY`.
    pub const RESTART_IDENTITY: TruncateOptions = TruncateOptions(2);

    /// Whether `CASCADE` was given.
    pub const fn cascade(self) -> bool {
        self.0 & Self::CASCADE.0 != 0
    }

    /// Whether `RESTART IDENTITY` was given.
    pub const fn restart_identity(self) -> bool {
        self.0 & Self::RESTART_IDENTITY.0 != 0
    }
}

/// Message (`M`): a logical decoding message from `pg_logical_emit_message`.
/// Only sent when the replication was started with `messages 'true'`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// Int8: flags; see [`MessageFlags`].
    pub flags: MessageFlags,
    /// Int64: the LSN of the message.
    pub lsn: Lsn,
    /// String: the prefix given to `pg_logical_emit_message`.
    pub prefix: String,
    /// Int32 length, then that many bytes: the content, arbitrary bytes
    /// (a slice of the received buffer, not a copy).
    pub content: Bytes,
}

/// Flags of a logical decoding message. Undefined bits are kept as received.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MessageFlags(pub u8);

impl MessageFlags {
    /// Bit 1: the message is transactional (sent inside its transaction,
    /// between Begin and Commit, and only if that transaction committed).
    pub const TRANSACTIONAL: MessageFlags = MessageFlags(1);

    /// Whether the message is transactional.
    pub const fn is_transactional(self) -> bool {
        self.0 & Self::TRANSACTIONAL.0 != 0
    }
}

/// TupleData: one row's values, one per column of the relation, in the
/// order of the relation's latest Relation message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TupleData(pub Vec<ColumnValue>);

impl TupleData {
    /// The values, in column order.
    pub fn values(&self) -> &[ColumnValue] {
        &self.0
    }

    /// Number of values (Int16 on the wire).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the row has no values.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One column value of a [`TupleData`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ColumnValue {
    /// `n`: SQL NULL.
    Null,
    /// `u`: an unchanged TOASTed value; the value itself is not sent.
    UnchangedToast,
    /// `t`, Int32 length, bytes: the value in the type's text output format,
    /// in the server encoding. Not NUL-terminated.
    Text(Bytes),
    /// `b`, Int32 length, bytes: the value in the type's binary send format
    /// (only with the `binary` option, PostgreSQL 14+).
    Binary(Bytes),
}

impl ColumnValue {
    /// Whether the value is SQL NULL.
    pub fn is_null(&self) -> bool {
        matches!(self, ColumnValue::Null)
    }

    /// The text-format bytes, if the value was sent as text.
    pub fn as_text(&self) -> Option<&Bytes> {
        match self {
            ColumnValue::Text(bytes) => Some(bytes),
            _ => None,
        }
    }

    /// The binary-format bytes, if the value was sent as binary.
    pub fn as_binary(&self) -> Option<&Bytes> {
        match self {
            ColumnValue::Binary(bytes) => Some(bytes),
            _ => None,
        }
    }
}
