//! The relation cache: the latest [`Relation`] message per table OID, and
//! reading tuple values by column name.
//!
//! Tuples carry values by position only; positions mean something only
//! against the latest Relation message for the table. PostgreSQL sends a new
//! Relation whenever the table's definition changed (a column added,
//! dropped, re-added at the end, a type changed), even in the middle of a
//! transaction, before the first change that uses the new shape. So a new
//! Relation always replaces the old one, and names are resolved against
//! whichever is current when a change arrives.

use std::collections::HashMap;
use std::sync::Arc;

use super::message::{ColumnValue, Relation, RelationId, TupleData};

/// Why a change cannot be read against the known relations.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RelationError {
    /// A change references a relation OID no Relation message described.
    /// pgoutput always describes a table before its first change in a
    /// session, so this means the stream is corrupt or the cache was reset.
    #[error("change for relation OID {id} arrived before any Relation message for it")]
    UnknownRelation {
        /// The OID referenced by the change.
        id: RelationId,
    },
    /// A tuple's value count differs from its relation's column count.
    #[error(
        "tuple has {found} value(s) but relation {namespace}.{name} (OID {id}) has {expected} column(s)"
    )]
    ColumnCountMismatch {
        /// The relation's OID.
        id: RelationId,
        /// The relation's schema.
        namespace: String,
        /// The relation's name.
        name: String,
        /// Columns in the relation.
        expected: usize,
        /// Values in the tuple.
        found: usize,
    },
    /// The relation has no column of that name.
    #[error("relation {namespace}.{name} (OID {id}) has no column {column:?}")]
    NoSuchColumn {
        /// The relation's OID.
        id: RelationId,
        /// The relation's schema.
        namespace: String,
        /// The relation's name.
        name: String,
        /// The column asked for.
        column: String,
    },
}

impl Relation {
    /// Position of the column named `name` (compared exactly, as PostgreSQL
    /// stores it: unquoted identifiers are lower case), if there is one.
    ///
    /// On the hot path resolve positions once per Relation message and index
    /// tuples directly, rather than looking names up for every row.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|column| column.name == name)
    }

    /// Checks that `tuple` has one value per column of this relation.
    ///
    /// # Errors
    ///
    /// [`RelationError::ColumnCountMismatch`] otherwise.
    pub fn check_tuple(&self, tuple: &TupleData) -> Result<(), RelationError> {
        if tuple.len() == self.columns.len() {
            Ok(())
        } else {
            Err(RelationError::ColumnCountMismatch {
                id: self.oid,
                namespace: self.namespace.clone(),
                name: self.name.clone(),
                expected: self.columns.len(),
                found: tuple.len(),
            })
        }
    }
}

impl TupleData {
    /// The value of the column named `column`, reading this tuple against
    /// `relation`, the latest Relation message for its table.
    ///
    /// # Errors
    ///
    /// [`RelationError::ColumnCountMismatch`] if the tuple does not have one
    /// value per column of `relation` (it was decoded against another shape);
    /// [`RelationError::NoSuchColumn`] if `relation` has no such column.
    pub fn get(&self, relation: &Relation, column: &str) -> Result<&ColumnValue, RelationError> {
        relation.check_tuple(self)?;
        relation
            .columns
            .iter()
            .zip(self.values())
            .find_map(|(c, value)| (c.name == column).then_some(value))
            .ok_or_else(|| RelationError::NoSuchColumn {
                id: relation.oid,
                namespace: relation.namespace.clone(),
                name: relation.name.clone(),
                column: column.to_owned(),
            })
    }
}

/// The latest [`Relation`] per OID, shared cheaply through [`Arc`] with the
/// events that were decoded against it.
#[derive(Clone, Debug, Default)]
pub struct RelationCache {
    relations: HashMap<RelationId, Arc<Relation>>,
}

impl RelationCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `relation` as the current shape of its table, replacing any
    /// earlier one for the same OID, and returns the shared copy.
    pub fn insert(&mut self, relation: Relation) -> Arc<Relation> {
        let relation = Arc::new(relation);
        self.relations.insert(relation.oid, Arc::clone(&relation));
        relation
    }

    /// The current shape of the table with OID `id`.
    ///
    /// # Errors
    ///
    /// [`RelationError::UnknownRelation`] if no Relation message described it.
    pub fn get(&self, id: RelationId) -> Result<&Arc<Relation>, RelationError> {
        self.relations
            .get(&id)
            .ok_or(RelationError::UnknownRelation { id })
    }

    /// Number of relations known.
    pub fn len(&self) -> usize {
        self.relations.len()
    }

    /// Whether no relation is known yet.
    pub fn is_empty(&self) -> bool {
        self.relations.is_empty()
    }
}
