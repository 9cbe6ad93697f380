//! `cdc-relay status --shards N`: the coverage proof, then every shard's
//! slot (holder, lag, wal_status) and publication, then the relays'
//! admin endpoints. The exit code is the first problem's: coverage, then
//! the shards in order, then the relays, then a slot at risk.

use serde::Serialize;
use tokio_postgres::Client;

use super::{Problem, RelayEndpoint, Status, ask_relays, slot_at_risk, unheld};
use crate::cli::{GlobalArgs, StatusArgs};
use crate::commands::outln;
use crate::source::failover;
use crate::source::shards::{self, Shard};

/// What `status --shards` reports.
#[derive(Debug, Serialize)]
pub struct ShardedStatus {
    /// How many shards.
    pub shards: u32,
    /// Probe rows the coverage proof evaluated (`None`: it failed).
    pub coverage_probes: Option<i64>,
    /// Each shard's slot and publication, in shard order (their own
    /// problems included).
    pub slots: Vec<Status>,
    /// What each relay admin endpoint asked said.
    pub relays: Vec<RelayEndpoint>,
    /// Rows in the dead-letter table (`None`: no such table).
    pub dead_letters_waiting: Option<i64>,
    /// Whether nothing stops delivery on any shard.
    pub healthy: bool,
    /// Every problem, the exit code's first.
    pub problems: Vec<Problem>,
    /// What does not stop delivery but fails elsewhere, besides each
    /// shard's own (this machine's clock far from the server's).
    pub warnings: Vec<String>,
}

/// Prints the sharded status; returns the exit code.
pub(super) async fn command(
    g: &GlobalArgs,
    a: &StatusArgs,
    client: &Client,
    count: u32,
) -> anyhow::Result<u8> {
    let conn = g.conn().map_err(crate::commands::ConfigError)?;
    let base = g.publication.first().cloned().unwrap_or_default();
    let columns = g.columns();
    let mut problems = Vec::new();
    let coverage = match shards::check_coverage(client, &g.table, &columns, &base, count).await {
        Ok(c) => Some(c),
        Err(e) => {
            let message = e.to_string();
            problems.push(Problem {
                code: crate::commands::run::exit_code(&e.into()),
                message,
            });
            None
        }
    };
    let siblings: Vec<String> = Shard::all(count).map(|s| s.name(&g.slot)).collect();
    let mut slots = Vec::new();
    for shard in Shard::all(count) {
        let filter = coverage
            .as_ref()
            .and_then(|c| c.filters.get(shard.index as usize).cloned());
        let mut s = super::status(
            client,
            &conn,
            &shard.name(&g.slot),
            &[shard.name(&base)],
            &g.table,
            &columns,
            filter.as_deref(),
        )
        .await?;
        s.failover = failover::slot_failover(client, &s.slot).await?;
        s.other_logical_slots
            .retain(|o| !siblings.contains(&o.name));
        if let Some(p) = unheld(&s) {
            s.problems.push(p);
        }
        s.healthy = s.problems.is_empty();
        slots.push(s);
    }
    problems.extend(slots.iter().flat_map(|s| {
        s.problems.iter().map(|p| Problem {
            code: p.code,
            message: p.message.clone(),
        })
    }));
    let mut relays = Vec::new();
    let all_held = slots.iter().all(|s| s.active);
    ask_relays(a, all_held, &mut relays, &mut problems).await;
    problems.extend(slots.iter().filter_map(slot_at_risk));
    let status = ShardedStatus {
        shards: count,
        coverage_probes: coverage.as_ref().map(|c| c.probes),
        healthy: problems.is_empty(),
        slots,
        relays,
        dead_letters_waiting: super::dead_letters_waiting(client).await?,
        problems,
        warnings: super::clock::warning(client).await?.into_iter().collect(),
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        outln!("{}", status.to_string().trim_end());
    }
    Ok(status.problems.first().map_or(0, |p| p.code))
}

impl std::fmt::Display for ShardedStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.coverage_probes {
            Some(n) => writeln!(
                f,
                "{} shards: the row filters put each of {n} probe rows in exactly one shard",
                self.shards
            )?,
            None => writeln!(
                f,
                "{} shards: the row filters are NOT proven to cover every row once (see the problems)",
                self.shards
            )?,
        }
        for (shard, s) in Shard::all(self.shards).zip(&self.slots) {
            writeln!(f, "\n== {shard}")?;
            write!(f, "{s}")?;
        }
        writeln!(f)?;
        for r in &self.relays {
            super::write_relay(f, r)?;
        }
        if let Some(n) = self.dead_letters_waiting {
            writeln!(f, "dead letters waiting: {n}")?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        if self.healthy {
            writeln!(f, "healthy: nothing stops delivery on any shard")
        } else {
            for p in &self.problems {
                writeln!(f, "problem (exit {}): {}", p.code, p.message)?;
            }
            Ok(())
        }
    }
}
