//! What a slot still holds: the inserts it would stream again, read by
//! peeking at it (`pg_logical_slot_peek_binary_changes`, which decodes from
//! the slot's position without consuming anything) through the same
//! publications and protocol version the relay streams with.
//!
//! Why peeking is the sound check for "the slot is not past this row": the
//! server decodes exactly what a new session on the slot would receive,
//! with the catalog (and the publications' membership) as of each change.
//! A row whose insert shows up here is still ahead of `confirmed_flush_lsn`
//! and will be streamed to the next session; a row missing here never will
//! be, whatever the relay does.
//!
//! Only an inactive slot can be peeked (PostgreSQL lets one process hold
//! it), so [`held_inserts`] waits, bounded, for the walsender to let go:
//! stop the relay, or let it exit, first.
//!
//! The parser reads the two pgoutput messages it needs (protocol 1,
//! PostgreSQL's "Logical Replication Message Formats"): Relation (`R`: OID,
//! namespace, name, replica identity, columns) and Insert (`I`: relation
//! OID, `N`, TupleData); every other message is skipped by its tag.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use tokio_postgres::Client;

use crate::wait_until;

/// Bound for the walsender to release the slot before peeking.
const RELEASE: Duration = Duration::from_secs(15);

/// One insert the slot would stream again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldInsert {
    /// `namespace.name` from the Relation message in force for the insert.
    pub relation: String,
    /// Column name → text value (`None` for NULL) of the inserted row.
    pub values: HashMap<String, Option<String>>,
}

impl HeldInsert {
    /// The text value of `column`, if the row has it and it is not NULL.
    pub fn value(&self, column: &str) -> Option<&str> {
        self.values.get(column).and_then(|v| v.as_deref())
    }
}

/// Every insert `slot` still holds, decoded through `publications`. Waits
/// (bounded) for the slot to be inactive; errors if it stays held.
pub async fn held_inserts(
    db: &Client,
    slot: &str,
    publications: &[String],
) -> anyhow::Result<Vec<HeldInsert>> {
    wait_until(
        &format!("slot {slot} to be inactive (peeking needs it)"),
        RELEASE,
        || async {
            let active: bool = db
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?
                .get(0);
            anyhow::Ok(!active)
        },
    )
    .await?;
    let rows = db
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publications.join(",")],
        )
        .await
        .with_context(|| format!("peeking at slot {slot} through {publications:?}"))?;
    let messages: Vec<Vec<u8>> = rows.iter().map(|r| r.get(0)).collect();
    decode_inserts(&messages)
}

/// The inserts in a sequence of pgoutput messages, each with the columns of
/// the latest Relation message for its relation.
pub fn decode_inserts(messages: &[Vec<u8>]) -> anyhow::Result<Vec<HeldInsert>> {
    let mut relations: HashMap<u32, (String, Vec<String>)> = HashMap::new();
    let mut inserts = Vec::new();
    for message in messages {
        let mut r = Reader(message);
        match r.u8()? {
            b'R' => {
                let oid = r.u32()?;
                let namespace = r.cstr()?;
                let name = r.cstr()?;
                let _replica_identity = r.u8()?;
                let n = r.u16()?;
                let mut columns = Vec::with_capacity(usize::from(n));
                for _ in 0..n {
                    let _flags = r.u8()?;
                    columns.push(r.cstr()?);
                    let _type_oid = r.u32()?;
                    let _type_modifier = r.u32()?;
                }
                relations.insert(oid, (format!("{namespace}.{name}"), columns));
            }
            b'I' => {
                let oid = r.u32()?;
                ensure!(r.u8()? == b'N', "Insert without a new tuple");
                let (relation, columns) = relations
                    .get(&oid)
                    .with_context(|| format!("Insert for relation {oid} before its Relation"))?;
                let values = r.tuple()?;
                ensure!(
                    values.len() == columns.len(),
                    "{relation}: {} values for {} columns",
                    values.len(),
                    columns.len()
                );
                inserts.push(HeldInsert {
                    relation: relation.clone(),
                    values: columns.iter().cloned().zip(values).collect(),
                });
            }
            _ => {}
        }
    }
    Ok(inserts)
}

/// A cursor over one message's bytes; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> anyhow::Result<&[u8]> {
        if self.0.len() < n {
            bail!("message truncated: {n} bytes wanted, {} left", self.0.len());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> anyhow::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> anyhow::Result<u16> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into()?))
    }

    fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into()?))
    }

    fn cstr(&mut self) -> anyhow::Result<String> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .context("string without its NUL")?;
        let s = String::from_utf8_lossy(&self.0[..end]).into_owned();
        self.0 = &self.0[end + 1..];
        Ok(s)
    }

    /// TupleData: Int16 count, then per column `n` (NULL), `u` (unchanged
    /// TOAST), or `t`/`b` with an Int32 length and the bytes.
    fn tuple(&mut self) -> anyhow::Result<Vec<Option<String>>> {
        let n = self.u16()?;
        let mut values = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            match self.u8()? {
                b'n' | b'u' => values.push(None),
                b't' | b'b' => {
                    let len = usize::try_from(self.u32()?)?;
                    values.push(Some(String::from_utf8_lossy(self.take(len)?).into_owned()));
                }
                other => bail!("unknown tuple column kind {:?}", char::from(other)),
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(oid: u32, name: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(oid.to_be_bytes());
        m.extend(b"public\0");
        m.extend(name.as_bytes());
        m.push(0);
        m.push(b'd');
        m.extend(u16::try_from(columns.len()).unwrap().to_be_bytes());
        for c in columns {
            m.push(0);
            m.extend(c.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend((-1i32).to_be_bytes());
        }
        m
    }

    fn insert(oid: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(oid.to_be_bytes());
        m.push(b'N');
        m.extend(u16::try_from(values.len()).unwrap().to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(s) => {
                    m.push(b't');
                    m.extend(u32::try_from(s.len()).unwrap().to_be_bytes());
                    m.extend(s.as_bytes());
                }
            }
        }
        m
    }

    #[test]
    fn inserts_take_the_columns_and_name_of_the_latest_relation() {
        let messages = vec![
            b"B-anything".to_vec(),
            relation(7, "outbox", &["id", "payload"]),
            insert(7, &[Some("e1"), None]),
            relation(7, "outbox_v2", &["payload", "id"]),
            insert(7, &[Some("{}"), Some("e2")]),
            b"C".to_vec(),
        ];
        let got = decode_inserts(&messages).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].relation.as_str(), got[0].value("id")),
            ("public.outbox", Some("e1"))
        );
        assert_eq!(got[0].value("payload"), None);
        assert_eq!(
            (got[1].relation.as_str(), got[1].value("id")),
            ("public.outbox_v2", Some("e2"))
        );
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let good = insert(7, &[Some("e1")]);
        for bad in [
            vec![insert(7, &[Some("e1")])],
            vec![
                relation(7, "outbox", &["id"]),
                good[..good.len() - 1].to_vec(),
            ],
            vec![relation(7, "outbox", &["id", "x"]), good.clone()],
            vec![b"R\0\0".to_vec()],
        ] {
            assert!(decode_inserts(&bad).is_err(), "{bad:?}");
        }
    }
}
