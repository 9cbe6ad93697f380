//! A streaming physical standby of a harness cluster, for failover tests.
//!
//! ```text
//!  primary (PgCluster)                                standby (Standby: Deref<Target = PgCluster>)
//!    physical slot <slot> ◀── walreceiver ──────────  pg_basebackup -R -C -S <slot>, hot_standby_feedback
//!    synchronized_standby_slots = <slot>  (17+)       sync_replication_slots = on, dbname in primary_conninfo (17+)
//! ```
//!
//! [`PgCluster::start_standby`] copies a running cluster with
//! `pg_basebackup -R` (which creates the physical slot and writes
//! `primary_conninfo`, `primary_slot_name` and `standby.signal`), starts it on
//! its own port and directory with the same settings plus
//! `hot_standby_feedback`, and returns once its walreceiver streams. On
//! PostgreSQL 17+ it also turns on logical slot synchronisation: logical slots
//! created with `failover => true` on the primary appear on the standby with
//! `pg_replication_slots.synced`. A synced copy stays `temporary` (and is
//! dropped at promotion) until the primary's slot has moved past the
//! standby's own reservation, which takes a consumer confirming progress and
//! a running-xacts record (`pg_log_standby_snapshot()`).
//!
//! A [`Standby`] is a [`PgCluster`] (same password, `stop`, `kill`,
//! `connect_superuser`, `log_tail`, even `start_standby` for a cascade or the
//! next round), plus [`Standby::promote`] and [`Standby::catch_up`]. Stacks
//! created on the primary exist on the standby too (same roles, same
//! passwords, databases under the same names); only their URLs name the
//! primary's port.
//!
//! The lifecycle calls block (like [`PgCluster::stop`]): call them through
//! `tokio::task::spawn_blocking` while a relay or an in-process sink must
//! keep running on the test's runtime.

use std::ops::Deref;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use crate::pg::{ClusterOptions, NewCluster, PgCluster, SUPERUSER, random_token};
use crate::wait::wait_until;

/// How long [`PgCluster::start_standby`] waits for the walreceiver to stream,
/// and [`Standby::promote`] for the promotion to finish.
const STREAMING_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`Standby::catch_up`] waits for replay.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);

/// The first major version with failover slots and their synchronisation.
pub const SLOT_SYNC_MAJOR: u32 = 17;

/// How [`PgCluster::start_standby`] makes a standby.
#[derive(Debug, Clone)]
pub struct StandbyOptions {
    /// The physical replication slot on the primary that `pg_basebackup`
    /// creates and the standby streams from (`primary_slot_name`).
    /// Default: `standby_<random>`.
    pub slot: String,
    /// Synchronise failover slots (PostgreSQL 17+): `sync_replication_slots
    /// = on` on the standby, and the physical slot added to the primary's
    /// `synchronized_standby_slots` (a failover slot's consumer then never
    /// gets ahead of this standby). Default on; has no effect below 17, and
    /// [`Standby::syncs_slots`] says whether it was done.
    pub sync_slots: bool,
    /// Further settings of the standby, after the primary's and the ones above.
    pub extra_settings: Vec<(String, String)>,
    /// The standby's port; `None` (the default) picks a free one. A failover
    /// drill gives the next standby the dead primary's port, so clients
    /// configured with both hosts (`h:p1,h:p2`) find every new server.
    pub port: Option<u16>,
}

impl Default for StandbyOptions {
    fn default() -> Self {
        StandbyOptions {
            slot: format!("standby_{}", random_token(8).to_lowercase()),
            sync_slots: true,
            extra_settings: Vec::new(),
            port: None,
        }
    }
}

/// A running streaming standby (until [`promote`](Standby::promote)d); a
/// [`PgCluster`] through `Deref`. Stopped and deleted on drop; its slot stays
/// on the primary (see [`PgCluster::drop_standby_slot`]).
#[derive(Debug)]
pub struct Standby {
    cluster: PgCluster,
    slot: String,
    syncs_slots: bool,
}

impl PgCluster {
    /// Starts a streaming physical standby of this (running) cluster, as
    /// described in the module doc, and returns once its walreceiver streams
    /// from the slot (at most 30 s). Errors carry the standby's log tail.
    ///
    /// Use a cluster of your own, not [`PgCluster::shared`]: on 17+ this
    /// changes the primary's `synchronized_standby_slots`.
    pub fn start_standby(&self, opts: StandbyOptions) -> anyhow::Result<Standby> {
        ensure!(
            !opts.slot.is_empty()
                && opts
                    .slot
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "a slot name is lowercase letters, digits and underscores, not {:?}",
            opts.slot
        );
        let syncs_slots = opts.sync_slots && self.major_version() >= SLOT_SYNC_MAJOR;
        let mut settings = self.options().clone();
        settings
            .extra_settings
            .push(("hot_standby_feedback".to_owned(), "on".to_owned()));
        if syncs_slots {
            settings
                .extra_settings
                .push(("sync_replication_slots".to_owned(), "on".to_owned()));
        }
        settings.extra_settings.extend(opts.extra_settings);

        let conninfo = format!(
            "host={} port={} user={SUPERUSER} password={} dbname=postgres application_name={}",
            self.host(),
            self.port(),
            self.superuser_password(),
            opts.slot
        );
        let mut cluster = PgCluster::create(
            self.bin().clone(),
            self.superuser_password().to_owned(),
            settings,
            opts.port,
            |new| base_backup(new, &conninfo, &opts.slot, self.options()),
        )?;
        cluster.stacks = self.stacks.clone();
        let standby = Standby {
            cluster,
            slot: opts.slot,
            syncs_slots,
        };
        standby.wait_streaming()?;
        if syncs_slots {
            let slot = standby.slot.clone();
            self.change_standby_slots(|slots| slots.push(slot))?;
        }
        Ok(standby)
    }

    /// Forgets a standby that is gone for good: removes its slot from
    /// `synchronized_standby_slots` (where a missing standby would hold back
    /// every failover slot's consumer) and drops the physical slot, once no
    /// walsender holds it (at most 30 s after the standby stopped).
    pub fn drop_standby_slot(&self, slot: &str) -> anyhow::Result<()> {
        self.change_standby_slots(|slots| slots.retain(|s| s != slot))?;
        // WHERE runs before the select list: only an inactive slot is dropped.
        let drop = format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{slot}' AND NOT active; \
             SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}'"
        );
        poll(
            &format!("physical slot {slot} to be released and dropped"),
            || Ok(self.psql("postgres", &drop)? == "0"),
        )
    }
}

impl Standby {
    /// The physical slot on the primary this standby streams from.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Whether failover slots are synchronised to this standby (asked for,
    /// and the server is 17 or newer).
    pub fn syncs_slots(&self) -> bool {
        self.syncs_slots
    }

    /// The standby as a plain cluster (what it is after promotion).
    pub fn into_cluster(self) -> PgCluster {
        self.cluster
    }

    /// Waits (at most 60 s) until this standby has replayed everything
    /// `primary` had written when this was called.
    pub async fn catch_up(&self, primary: &PgCluster) -> anyhow::Result<()> {
        let target: String = primary
            .connect_superuser("postgres")
            .await?
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .context("reading the primary's WAL position")?
            .get(0);
        let client = self.connect_superuser("postgres").await?;
        let what = format!(
            "the standby on port {} to replay up to {target}",
            self.port()
        );
        wait_until(&what, CATCH_UP_TIMEOUT, || async {
            let row = client
                .query_one(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                    &[&target],
                )
                .await?;
            Ok(row.get::<_, bool>(0))
        })
        .await
    }

    /// Promotes the standby (`pg_ctl promote`) and waits (at most 30 s) until
    /// it is out of recovery and accepts writes. The old primary is left
    /// alone: kill or stop it first for a failover.
    pub fn promote(&self) -> anyhow::Result<()> {
        let output = self
            .cluster
            .server_command("pg_ctl")
            .arg("promote")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-w", "-t", &STREAMING_TIMEOUT.as_secs().to_string()])
            .output()
            .context("running pg_ctl promote")?;
        if !output.status.success() {
            bail!(
                "pg_ctl promote failed ({}): {}{}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr),
                self.log_tail(40)
            );
        }
        self.wait_until_status("ready")?;
        let in_recovery = self.psql("postgres", "SELECT pg_is_in_recovery()")?;
        ensure!(
            in_recovery == "f",
            "promoted standby still in recovery\n{}",
            self.log_tail(40)
        );
        Ok(())
    }

    /// Waits until the walreceiver streams from our slot: proof that the
    /// standby reached the primary with the right libpq.
    fn wait_streaming(&self) -> anyhow::Result<()> {
        let sql = format!(
            "SELECT pg_is_in_recovery() AND EXISTS (SELECT FROM pg_stat_wal_receiver \
             WHERE status = 'streaming' AND slot_name = '{}')",
            self.slot
        );
        poll("the standby's walreceiver to stream", || {
            Ok(self.psql("postgres", &sql)? == "t")
        })
        .with_context(|| self.log_tail(40))
    }
}

impl Deref for Standby {
    type Target = PgCluster;

    fn deref(&self) -> &PgCluster {
        &self.cluster
    }
}

/// `pg_basebackup` of the primary into the new cluster's data directory,
/// creating the physical slot and the standby configuration (`-R`).
fn base_backup(
    new: &NewCluster<'_>,
    conninfo: &str,
    slot: &str,
    primary: &ClusterOptions,
) -> anyhow::Result<()> {
    let mut command = new.command("pg_basebackup");
    command
        .arg("-D")
        .arg(new.data_dir)
        .args(["-R", "-X", "stream", "-c", "fast", "-C", "-S", slot])
        .arg("-d")
        .arg(conninfo);
    if !primary.fsync {
        command.arg("--no-sync");
    }
    let output = command.output().context("running pg_basebackup")?;
    if !output.status.success() {
        bail!(
            "pg_basebackup failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// The blocking counterpart of [`wait_until`] for the lifecycle calls:
/// every 20 ms until `ready` holds, at most 30 s.
fn poll(what: &str, mut ready: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + STREAMING_TIMEOUT;
    let mut last_error = None;
    loop {
        match ready() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(err) => last_error = Some(err),
        }
        if Instant::now() >= deadline {
            match last_error {
                Some(err) => bail!(
                    "timed out after {STREAMING_TIMEOUT:?} waiting for {what} (last error: {err:#})"
                ),
                None => bail!("timed out after {STREAMING_TIMEOUT:?} waiting for {what}"),
            }
        }
        std::thread::sleep(crate::wait::POLL_INTERVAL);
    }
}
