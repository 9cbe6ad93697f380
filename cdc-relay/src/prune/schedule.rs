//! The relay's opt-in pruning (`run --prune-older-than`): a tick every
//! interval on a connection of its own, one statement when nothing may go.
//! Its lock waits are bounded like the side connection's
//! ([`source::lock_wait`]).

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use super::batches::delete_rows;
use super::partitions::targets;
use super::proof::{birthless_warning, probe};
use super::{PruneError, PrunePlan};
use crate::metrics::Metrics;
use crate::source::{self, ConnParams};

/// Delay before the relay's first prune tick (or the interval, if shorter):
/// the session starts streaming first.
pub const FIRST_TICK: Duration = Duration::from_secs(10);

/// The relay's opt-in pruning (`run --prune-older-than`).
#[derive(Clone, Debug)]
pub struct Schedule {
    /// What to prune.
    pub plan: PrunePlan,
    /// Time between two ticks. A tick with nothing to prune costs one
    /// statement ([`probe`]).
    pub interval: Duration,
    /// Delay before the first tick ([`FIRST_TICK`] unless a test sets
    /// it); the interval, if shorter.
    pub first_tick: Duration,
}

/// Prunes every `schedule.interval` on a connection of its own (reopened
/// after a failure) until `shutdown`. A tick takes a mark and, when a row
/// may go, deletes in batches (`debug` log per batch,
/// `cdc_relay_pruned_rows_total`); it also refreshes
/// `cdc_relay_outbox_table_size_bytes`. A failure is logged, counted
/// (`cdc_relay_prune_failures_total`) and tried again at the next tick:
/// pruning never stops delivery.
pub async fn keep_pruning(
    conn: ConnParams,
    schedule: Schedule,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let first = tokio::time::Instant::now() + schedule.interval.min(schedule.first_tick);
    let mut tick = tokio::time::interval_at(first, schedule.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Opened at once (a connection problem shows at start) and after a
    // failure at the next tick; its one setting is made when it opens, so
    // an idle tick stays one statement.
    let mut client = open(&conn, &metrics).await;
    // The proof's missing birth record is said once: it stays missing
    // until the slot is made again.
    let mut birthless_said = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if client.as_ref().is_none_or(Client::is_closed) {
            client = open(&conn, &metrics).await;
        }
        let Some(c) = &client else { continue };
        let error = match tick_once(c, &schedule.plan, &metrics, &shutdown, &mut birthless_said)
            .await
        {
            Ok(0) => continue,
            Ok(rows) => {
                tracing::info!(rows, table = %schedule.plan.table, "prune: deleted delivered outbox rows older than the window");
                continue;
            }
            Err(PruneError::Source(e)) => source::lock_wait::named(c, e).await.to_string(),
            Err(error) => error.to_string(),
        };
        metrics.prune_failures.inc();
        tracing::warn!(%error, "prune: tick failed; trying again at the next tick");
    }
}

/// The prune connection, its lock waits bounded: a lock held on the
/// outbox (or a catalog) ends a tick's statement after lock_timeout, with
/// the holders named, instead of a tick waiting without a word. `None`
/// (logged): tried again at the next tick.
async fn open(conn: &ConnParams, metrics: &Metrics) -> Option<Client> {
    let opened = match source::connect_sql(conn, "cdc-relay-prune").await {
        Ok(c) => source::lock_wait::bound(&c).await.map(|()| c),
        Err(e) => Err(e),
    };
    opened
        .inspect_err(|error| {
            metrics.prune_failures.inc();
            tracing::warn!(%error, "prune: cannot connect; trying again at the next tick")
        })
        .ok()
}

/// One tick of [`keep_pruning`]; returns the rows deleted. Warns once
/// (`birthless_said`) when the proof has no birth record for the slot.
async fn tick_once(
    c: &Client,
    plan: &PrunePlan,
    metrics: &Metrics,
    shutdown: &CancellationToken,
    birthless_said: &mut bool,
) -> Result<u64, PruneError> {
    let probe = probe(c, plan, true).await?;
    metrics.outbox_table_bytes.set(probe.table_bytes);
    if let Some(proof) = &probe.proof
        && proof.birth_horizon.is_none()
        && !std::mem::replace(birthless_said, true)
    {
        tracing::warn!("prune: {}", birthless_warning(&plan.slot));
    }
    let (Some(proof), Some(true)) = (&probe.proof, probe.prunable) else {
        tracing::debug!(confirmed = %probe.confirmed, proven = probe.proof.is_some(), "prune: nothing to delete");
        return Ok(0);
    };
    let mut total = 0;
    for t in targets(c, plan).await? {
        total += delete_rows(
            c,
            plan,
            proof,
            &probe.cutoff,
            &t,
            |b| {
                metrics.pruned_rows.inc_by(b.rows);
                tracing::debug!(
                    relation = %b.relation, first_block = b.first_block, end_block = b.end_block,
                    rows = b.rows, "prune: batch"
                );
            },
            || shutdown.is_cancelled(),
        )
        .await?;
    }
    Ok(total)
}
