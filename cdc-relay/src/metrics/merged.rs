//! The exposition of a sharded process: its own families once, every
//! other family with each shard's series under one `# HELP`/`# TYPE`.

use std::collections::BTreeMap;

use prometheus::proto::MetricFamily;

use super::{Metrics, encode};

/// Families that describe the process, not a slot: with shards they come
/// from the process's own registry, without a `shard` label, and the
/// shards' copies are left out.
pub const PROCESS_FAMILIES: &[&str] = &[
    "cdc_relay_build_info",
    "cdc_relay_secret_reloads_total",
    "cdc_relay_halted",
    "cdc_relay_pruned_rows_total",
    "cdc_relay_prune_failures_total",
    "cdc_relay_outbox_table_size_bytes",
];

/// One exposition of a sharded process: the [`PROCESS_FAMILIES`] of
/// `process`, and every other family of each shard's registry, a family's
/// series of all shards together under one `# HELP`/`# TYPE`.
pub fn render_merged(process: &Metrics, shards: &[Metrics]) -> String {
    let mut families: BTreeMap<String, MetricFamily> = BTreeMap::new();
    let process_families = process
        .registry
        .gather()
        .into_iter()
        .filter(|f| PROCESS_FAMILIES.contains(&f.name()));
    let shard_families = shards.iter().flat_map(|m| {
        m.registry
            .gather()
            .into_iter()
            .filter(|f| !PROCESS_FAMILIES.contains(&f.name()))
    });
    for mut family in process_families.chain(shard_families) {
        match families.get_mut(family.name()) {
            Some(merged) => merged.mut_metric().append(family.mut_metric()),
            None => {
                families.insert(family.name().to_owned(), family);
            }
        }
    }
    encode(&families.into_values().collect::<Vec<_>>())
}
