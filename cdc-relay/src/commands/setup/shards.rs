//! `cdc-relay setup --shards N`: the N shard publications (each with its
//! row filter), the proof that their filters put every row in exactly one
//! shard, then the N slots (`docs/architecture.md#sharding`).

use tokio_postgres::Client;

use super::{SetupPlan, ensure_slot};
use crate::lsn::Lsn;
use crate::source::SourceError;
use crate::source::catalog::{self, OutboxTable};
use crate::source::shards::{self, Shard};

/// Creates what is missing of the `count` shards and checks what exists;
/// one report line per check or action.
pub(super) async fn setup(
    client: &Client,
    plan: &SetupPlan,
    table: &OutboxTable,
    count: u32,
    report: &mut Vec<String>,
) -> Result<(), SourceError> {
    for shard in Shard::all(count) {
        catalog::check_slot_name(&shard.name(&plan.slot))?;
    }
    let bucket = shards::bucket_expr(client, &plan.table, &plan.columns, count).await?;
    let mut created = Vec::new();
    for shard in Shard::all(count) {
        created.push(ensure_publication(client, plan, table, shard, &bucket, report).await?);
    }
    // Every publication first, then the proof, then the slots: a slot
    // decodes with the catalog as of each change, so it must not predate
    // its publication.
    let coverage =
        shards::check_coverage(client, &plan.table, &plan.columns, &plan.publication, count)
            .await?;
    report.push(format!(
        "ok: the {count} shard row filters put each of {} probe rows ({} from {}, the rest made up, with NULL keys, and empty ones for a text key) in exactly one shard",
        coverage.probes, coverage.table_rows, plan.table
    ));
    let mut new_slots = false;
    let mut start = Lsn::ZERO;
    for (shard, filter) in Shard::all(count).zip(&coverage.filters) {
        let one = SetupPlan {
            slot: shard.name(&plan.slot),
            publication: shard.name(&plan.publication),
            shards: None,
            ..plan.clone()
        };
        let publications = [one.publication.clone()];
        catalog::check_stream_config(
            client,
            &plan.table,
            &plan.columns,
            &publications,
            Some(filter),
        )
        .await?;
        for warning in
            catalog::publication_warnings(client, &plan.table, table, &publications).await?
        {
            report.push(format!("warning: {warning}"));
        }
        let existed = catalog::slot_info(client, &one.slot).await?.is_some();
        ensure_slot(client, &one, created[shard.index as usize], report).await?;
        if let Some(slot) = catalog::slot_info(client, &one.slot).await? {
            new_slots |= !existed;
            start = start.max(slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO));
        }
    }
    if new_slots {
        report.push(format!(
            "start: the {count} shard slots stream every transaction that commits after {start}. Moving from another split (or one slot)? \
             Restart the old relays with `cdc-relay run --stop-at-lsn {start}` (plus their --shards), start the new ones \
             (`cdc-relay run --shards {count}`) only after every old one stopped, then drop the old slots and publications \
             (docs/operations.md#resharding)"
        ));
    }
    Ok(())
}

/// Creates `shard`'s publication with its row filter unless it exists;
/// returns whether it created it. An existing one is judged by
/// [`shards::check_coverage`] afterwards.
async fn ensure_publication(
    client: &Client,
    plan: &SetupPlan,
    table: &OutboxTable,
    shard: Shard,
    bucket: &str,
    report: &mut Vec<String>,
) -> Result<bool, SourceError> {
    let name = shard.name(&plan.publication);
    let exists = client
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
        .await
        .map_err(|e| SourceError::sql("looking up the publication", &e))?
        .is_some();
    if exists {
        report.push(format!("exists: publication {name:?} ({shard})"));
        return Ok(false);
    }
    let via_root = if table.relkind == "p" {
        ", publish_via_partition_root = true"
    } else {
        ""
    };
    let filter = shards::filter(bucket, shard);
    let stmt = format!(
        "CREATE PUBLICATION {} FOR TABLE {} WHERE {filter} WITH (publish = 'insert'{via_root})",
        catalog::quote_ident(&name),
        catalog::quote_table(&plan.table)
    );
    client
        .batch_execute(&stmt)
        .await
        .map_err(|e| SourceError::sql("creating the shard's publication", &e))?;
    report.push(format!(
        "created: publication {name:?} ({shard}: inserts into {} WHERE {filter})",
        plan.table
    ));
    Ok(true)
}
