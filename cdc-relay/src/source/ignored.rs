//! Changes the stream carries that are not outbox inserts: updates,
//! deletes and truncates of the outbox, and any change of a relation that
//! is not the outbox (a publication that lists more than the outbox).
//! Counted in `cdc_relay_ignored_changes_total{relation}` and logged once
//! per relation and kind; never delivered.

use std::collections::HashSet;

use crate::metrics::{IGNORED_RELATIONS, Metrics};
use crate::pgoutput::RelationId;

/// Counts the stream's changes that are not outbox inserts in
/// `cdc_relay_ignored_changes_total{relation}` (bounded label values) and
/// logs each relation's first one.
pub(super) struct IgnoredChanges {
    metrics: Metrics,
    labels: HashSet<String>,
    logged: HashSet<(RelationId, &'static str)>,
}

impl IgnoredChanges {
    pub(super) fn new(metrics: Metrics) -> Self {
        IgnoredChanges {
            metrics,
            labels: HashSet::new(),
            logged: HashSet::new(),
        }
    }

    /// Counts one change of `kind` (`"insert"`, `"update"`, `"delete"`,
    /// `"truncate"`) to `relation`, named `name`; `outbox` says whether
    /// that relation is (a partition of) the outbox.
    pub(super) fn count(
        &mut self,
        relation: RelationId,
        name: &str,
        kind: &'static str,
        outbox: bool,
    ) {
        let label = if self.labels.contains(name) || self.labels.len() < IGNORED_RELATIONS {
            self.labels.insert(name.to_owned());
            name
        } else {
            "other"
        };
        self.metrics
            .ignored_changes
            .with_label_values(&[label])
            .inc();
        if self.logged.insert((relation, kind)) {
            if outbox {
                tracing::info!(relation = %name, kind, "the publication streams {kind}s of the outbox {name}; they are not events and are counted in cdc_relay_ignored_changes_total (an insert-only publication avoids decoding them)");
            } else {
                tracing::info!(relation = %name, kind, "the publication streams {kind}s of {name}, which is not the outbox; they are counted in cdc_relay_ignored_changes_total and not delivered");
            }
        }
    }
}
