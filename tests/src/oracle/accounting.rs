//! The proof-wide ledger: every outbox row is accounted for. It is either
//! delivered (its id reached the inbox with a 2xx), dead-lettered (its id
//! is in `cdc_relay_dead_letter`), or still held by the slot (the next
//! session will stream it). Nothing else may happen to a committed row.
//!
//! [`Accounting::assert_balanced`] is the end state of a scenario that
//! finished: the outbox rows are exactly the delivered and dead-lettered
//! ids, nothing more (no phantom), nothing less (no loss).
//! [`Accounting::assert_held`] is the end state of a scenario that stopped
//! on purpose (the relay refused to go on): every row not done is still in
//! the slot, proven by peeking at it ([`super::held`]).

use std::collections::BTreeSet;

use tokio_postgres::Client;

use super::held;

/// Where each outbox row stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Accounting {
    /// Ids (`id::text`) of the rows in the outbox table(s).
    pub rows: BTreeSet<String>,
    /// Distinct ids the inbox received with a 2xx.
    pub delivered: BTreeSet<String>,
    /// Distinct ids in `cdc_relay_dead_letter` (rows without an id, which
    /// cannot be matched, are left out).
    pub dead_lettered: BTreeSet<String>,
}

impl Accounting {
    /// Reads the rows of `tables` (SQL names, e.g. `outbox` or
    /// `public.outbox_v2`; the tests' own, never user input) and the dead
    /// letters through `db`; `delivered` are the ids the inbox took.
    pub async fn read(
        db: &Client,
        tables: &[&str],
        delivered: impl IntoIterator<Item = String>,
    ) -> anyhow::Result<Accounting> {
        let mut rows = BTreeSet::new();
        for table in tables {
            for r in db
                .query(&format!("SELECT id::text FROM {table}"), &[])
                .await?
            {
                rows.insert(r.get(0));
            }
        }
        let dead_lettered = db
            .query(
                "SELECT DISTINCT event_id FROM cdc_relay_dead_letter WHERE event_id IS NOT NULL",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        Ok(Accounting {
            rows,
            delivered: delivered.into_iter().collect(),
            dead_lettered,
        })
    }

    /// Delivered or dead-lettered.
    pub fn done(&self) -> BTreeSet<String> {
        self.delivered.union(&self.dead_lettered).cloned().collect()
    }

    /// Rows neither delivered nor dead-lettered.
    pub fn undone(&self) -> Vec<String> {
        self.rows.difference(&self.done()).cloned().collect()
    }

    /// Ids delivered or dead-lettered that are no row of the outbox.
    pub fn phantom(&self) -> Vec<String> {
        self.done().difference(&self.rows).cloned().collect()
    }

    /// Asserts the ledger balances: the number of outbox rows equals the
    /// distinct ids delivered plus those dead-lettered, and they are the
    /// same ids (nothing lost, nothing phantom).
    ///
    /// # Panics
    /// When it does not balance, naming the ids that do not.
    pub fn assert_balanced(&self) {
        let (undone, phantom) = (self.undone(), self.phantom());
        assert!(
            undone.is_empty() && phantom.is_empty() && self.rows.len() == self.done().len(),
            "ledger: {} outbox rows, {} delivered, {} dead-lettered; \
             never delivered nor dead-lettered: {undone:?}; phantom: {phantom:?}",
            self.rows.len(),
            self.delivered.len(),
            self.dead_lettered.len(),
        );
    }

    /// Asserts nothing phantom, and that the slot still holds every row not
    /// done: peeking at `slot` through `publications` shows an insert with
    /// that id. The slot must be inactive (see [`held::held_inserts`]).
    ///
    /// # Panics
    /// When a row is neither done nor held: the slot passed it, so no
    /// session will ever stream it.
    pub async fn assert_held(
        &self,
        db: &Client,
        slot: &str,
        publications: &[String],
    ) -> anyhow::Result<()> {
        let phantom = self.phantom();
        assert!(phantom.is_empty(), "phantom deliveries: {phantom:?}");
        let undone = self.undone();
        if undone.is_empty() {
            return Ok(());
        }
        let inserts = held::held_inserts(db, slot, publications).await?;
        let held: BTreeSet<&str> = inserts.iter().filter_map(|i| i.value("id")).collect();
        let passed: Vec<&String> = undone
            .iter()
            .filter(|id| !held.contains(id.as_str()))
            .collect();
        assert!(
            passed.is_empty(),
            "the slot is past {} undelivered row(s) {passed:?}: neither delivered, dead-lettered \
             nor held ({} inserts held: {:?})",
            passed.len(),
            inserts.len(),
            inserts
                .iter()
                .map(|i| format!("{} {}", i.relation, i.value("id").unwrap_or("?")))
                .collect::<Vec<_>>()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn balanced_means_every_row_delivered_or_dead_lettered_and_nothing_else() {
        let ok = Accounting {
            rows: ids(&["a", "b", "c"]),
            delivered: ids(&["a", "b"]),
            dead_lettered: ids(&["c"]),
        };
        ok.assert_balanced();
        for bad in [
            Accounting {
                rows: ids(&["a", "b"]),
                delivered: ids(&["a"]),
                ..Accounting::default()
            },
            Accounting {
                rows: ids(&["a"]),
                delivered: ids(&["a", "z"]),
                ..Accounting::default()
            },
        ] {
            let r = std::panic::catch_unwind(|| bad.assert_balanced());
            assert!(r.is_err(), "{bad:?} balanced");
        }
        assert_eq!(
            Accounting {
                rows: ids(&["a", "b"]),
                delivered: ids(&["a", "q"]),
                ..Accounting::default()
            }
            .phantom(),
            vec!["q".to_owned()]
        );
    }
}
