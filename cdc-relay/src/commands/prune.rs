//! `cdc-relay prune`: delete delivered outbox rows older than the window
//! (or drop whole partitions), with progress on stderr and a summary on
//! stdout; the rules and the proof are in [`crate::prune`].

use std::time::{Duration, Instant};

use super::{ConfigError, connect, outln};
use crate::cli::{GlobalArgs, PruneArgs};
use crate::prune::{self, Batch, Probe, Proof, PruneError, PrunePlan, Target};
use crate::source::{SourceError, catalog, shards};

/// Pause between two looks at the slot while waiting for it to pass a mark.
const PROOF_POLL: Duration = Duration::from_millis(250);

/// Least time between two progress lines.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// A partition dropped (or, in a dry run, that would be).
#[derive(Debug, serde::Serialize)]
struct DroppedPartition {
    /// `"schema"."name"`.
    name: String,
    /// Rows it held.
    rows: i64,
}

/// What a run did (or, with `--dry-run`, would do).
#[derive(Debug, serde::Serialize)]
struct Summary {
    dry_run: bool,
    table: String,
    /// Rows older than this may go (UTC).
    cutoff: String,
    /// The slot's `confirmed_flush_lsn` when the proof was read.
    confirmed_flush_lsn: String,
    /// The mark that proves delivery.
    proof: Proof,
    /// Rows deleted (would be, in a dry run), partitions not counted.
    rows_deleted: u64,
    /// Partitions detached and dropped (would be, in a dry run).
    partitions_dropped: Vec<DroppedPartition>,
    /// Rows older than the cutoff kept because a dead letter waits for them.
    rows_kept_dead_lettered: i64,
    /// The outbox's total size before and after, bytes.
    table_bytes_before: i64,
    table_bytes_after: i64,
    /// Wall time, seconds.
    seconds: f64,
}

/// Runs `prune`; returns the exit code (0; 1 not provable or an error; 2
/// configuration; 3 setup missing; 4 slot invalidated).
pub async fn command(g: &GlobalArgs, a: PruneArgs) -> u8 {
    match super::lock_named(g, prune_table(g, &a).await).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            exit_code(&e)
        }
    }
}

fn exit_code(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<ConfigError>().is_some() {
        return 2;
    }
    match e.downcast_ref::<PruneError>() {
        Some(
            PruneError::NeedsSetup(_)
            | PruneError::Source(SourceError::SlotMissing { .. } | SourceError::NeedsSetup(_)),
        ) => 3,
        Some(
            PruneError::SlotInvalidated(_)
            | PruneError::Source(SourceError::SlotInvalidated { .. }),
        ) => 4,
        _ => 1,
    }
}

async fn prune_table(g: &GlobalArgs, a: &PruneArgs) -> anyhow::Result<()> {
    // One shard's slot proves nothing about the other shards' rows.
    if g.shards.is_some() || shards::is_shard_slot(&g.slot) {
        return Err(ConfigError(format!(
            "prune does not support sharded slots yet (--shards, or --slot {:?}): one shard's slot proves nothing about the rows of the others. Delete by hand under the conditions in docs/operations.md#sharding",
            g.slot
        ))
        .into());
    }
    let started = Instant::now();
    let plan = a.plan(g);
    let mut client = connect(g).await?;
    prune::check(&client, &plan).await?;
    // Rows inserted while the outbox is out of its publication are never
    // streamed: a slot past them proves nothing.
    let m = catalog::membership(
        &client,
        &g.publication,
        &g.table,
        &g.columns().names(),
        None,
    )
    .await
    .map_err(PruneError::from)?;
    if !m.included() {
        return Err(PruneError::NeedsSetup(format!(
            "{}; rows inserted meanwhile were never streamed, so nothing is pruned (re-send them with `cdc-relay backfill` once it is back)",
            catalog::membership_problem(&m, &g.publication, &g.table)
        ))
        .into());
    }
    let (probe, proof) = wait_for_proof(&client, &plan, a.wait).await?;
    eprintln!(
        "prune: {} rows older than {} (UTC); proven delivered: transactions before {} (mark at {} taken {}, slot confirmed at {})",
        plan.table, probe.cutoff, proof.xid_horizon, proof.wal_lsn, proof.taken_at, probe.confirmed
    );
    if proof.birth_horizon.is_none() {
        eprintln!("warning: {}", prune::birthless_warning(&g.slot));
    }
    let mut summary = Summary {
        dry_run: a.dry_run,
        table: plan.table.to_string(),
        cutoff: probe.cutoff.clone(),
        confirmed_flush_lsn: probe.confirmed.to_string(),
        proof: proof.clone(),
        rows_deleted: 0,
        partitions_dropped: Vec::new(),
        rows_kept_dead_lettered: prune::count_dead_lettered(&client, &plan, &probe.cutoff).await?,
        table_bytes_before: probe.table_bytes,
        table_bytes_after: probe.table_bytes,
        seconds: 0.0,
    };
    let mut rest = Vec::new();
    for t in prune::targets(&client, &plan).await? {
        let whole = if a.keep_partitions {
            None
        } else {
            prune::partition_verdict(&client, &plan, &proof, &probe.cutoff, &t).await?
        };
        match whole {
            Some(v) if v.kept == 0 && a.dry_run => {
                summary.partitions_dropped.push(DroppedPartition {
                    name: t.name.clone(),
                    rows: v.rows,
                })
            }
            Some(v) if v.kept == 0 => {
                match prune::drop_partition(&mut client, &plan, &proof, &probe.cutoff, &t).await? {
                    Some(rows) => {
                        eprintln!(
                            "prune: detached and dropped partition {} ({rows} rows)",
                            t.name
                        );
                        summary.partitions_dropped.push(DroppedPartition {
                            name: t.name.clone(),
                            rows,
                        });
                    }
                    None => rest.push(t),
                }
            }
            _ => rest.push(t),
        }
    }
    if a.dry_run {
        for t in &rest {
            let n = prune::count_deletable(&client, &plan, &proof, &probe.cutoff, t).await?;
            summary.rows_deleted += u64::try_from(n).unwrap_or(0);
        }
    } else {
        summary.rows_deleted = delete_with_progress(&client, &plan, &proof, &probe, &rest).await?;
        summary.table_bytes_after = prune::table_bytes(&client, &plan).await?;
    }
    summary.seconds = started.elapsed().as_secs_f64();
    print_summary(&summary, a.json)
}

/// Probes until the slot has passed the newest mark (the one waiting when
/// prune started, taken now unless one was waiting already), at most
/// `wait`; then settles for the newest mark it has passed, if any.
async fn wait_for_proof(
    client: &tokio_postgres::Client,
    plan: &PrunePlan,
    wait: Duration,
) -> Result<(Probe, Proof), PruneError> {
    let started = Instant::now();
    let mut target = None;
    loop {
        let probe = prune::probe(client, plan, false).await?;
        let target = *target.get_or_insert(probe.waiting_mark);
        if let Some(proof) = &probe.proof
            && target.is_none_or(|t| proof.wal_lsn >= t)
        {
            let proof = proof.clone();
            return Ok((probe, proof));
        }
        if started.elapsed() >= wait {
            return match probe.proof.clone() {
                Some(proof) => {
                    eprintln!(
                        "prune: the slot (confirmed at {}) has not passed the mark taken now within {:.0} s; proving with the older mark at {}",
                        probe.confirmed,
                        wait.as_secs_f64(),
                        proof.wal_lsn
                    );
                    Ok((probe, proof))
                }
                None => Err(PruneError::Unproven(prune::unproven_message(
                    plan,
                    &probe,
                    started.elapsed(),
                ))),
            };
        }
        tokio::time::sleep(PROOF_POLL).await;
    }
}

/// Deletes the rows of `targets` that may go, printing rows, rate and ETA
/// (by blocks walked) on stderr.
async fn delete_with_progress(
    client: &tokio_postgres::Client,
    plan: &PrunePlan,
    proof: &Proof,
    probe: &Probe,
    targets: &[Target],
) -> Result<u64, PruneError> {
    let total_blocks: i64 = targets.iter().map(|t| t.blocks).sum();
    let started = Instant::now();
    let mut last_print: Option<Instant> = None;
    let (mut rows, mut blocks_before) = (0u64, 0i64);
    for t in targets {
        let mut on_batch = |b: &Batch| {
            rows += b.rows;
            let done = blocks_before + b.end_block;
            if last_print.is_none_or(|p| p.elapsed() >= PROGRESS_EVERY) || done >= total_blocks {
                eprint!(
                    "\r{}",
                    progress_line(rows, done, total_blocks, started.elapsed())
                );
                last_print = Some(Instant::now());
            }
        };
        prune::delete_rows(client, plan, proof, &probe.cutoff, t, &mut on_batch, || {
            false
        })
        .await?;
        blocks_before += t.blocks;
    }
    if last_print.is_some() {
        eprintln!();
    }
    Ok(rows)
}

/// `prune: 12000 rows deleted (4000/s), blocks 300/1000 (30%), ETA 7 s`.
fn progress_line(rows: u64, done: i64, total: i64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-3);
    let share = if total > 0 {
        done as f64 / total as f64
    } else {
        1.0
    };
    let eta = if share > 0.0 {
        secs * (1.0 - share) / share
    } else {
        f64::NAN
    };
    format!(
        "prune: {rows} rows deleted ({:.0}/s), blocks {done}/{total} ({:.0}%), ETA {eta:.0} s",
        rows as f64 / secs,
        share * 100.0
    )
}

fn print_summary(s: &Summary, json: bool) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string_pretty(s)?);
        return Ok(());
    }
    let verb = if s.dry_run { "would delete" } else { "deleted" };
    let parts = s
        .partitions_dropped
        .iter()
        .map(|p| format!("{} ({} rows)", p.name, p.rows))
        .collect::<Vec<_>>();
    outln!(
        "prune{} done in {:.1} s: {verb} {} row(s) of {} older than {}; partitions {}: {}; kept {} row(s) with a dead letter waiting; table {} → {} bytes{}",
        if s.dry_run { " --dry-run" } else { "" },
        s.seconds,
        s.rows_deleted,
        s.table,
        s.cutoff,
        if s.dry_run { "to drop" } else { "dropped" },
        if parts.is_empty() {
            "none".to_owned()
        } else {
            parts.join(", ")
        },
        s.rows_kept_dead_lettered,
        s.table_bytes_before,
        s.table_bytes_after,
        if s.dry_run { "; nothing deleted" } else { "" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_reports_rows_rate_and_eta() {
        let line = progress_line(12_000, 300, 1000, Duration::from_secs(3));
        assert_eq!(
            line,
            "prune: 12000 rows deleted (4000/s), blocks 300/1000 (30%), ETA 7 s"
        );
        assert!(progress_line(0, 0, 0, Duration::ZERO).contains("(100%)"));
    }
}
