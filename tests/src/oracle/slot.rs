//! The replication slot's account of the relay's progress, and [`settle`]:
//! absence proven through the relay's own confirmed position.
//!
//! Why it holds: the relay moves `confirmed_flush_lsn` only to the end of
//! the longest prefix of transactions whose events were all delivered (a
//! 2xx) or dead-lettered, and while nothing is pending, to the position the
//! server reports. So once the confirmed position reached the WAL position
//! taken at some instant, every transaction committed before that instant
//! is done, and no delivery for it is still to come, even after a restart.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::wait_until;

/// Bound for the slot's confirmed position to pass a WAL position.
const SETTLE: Duration = Duration::from_secs(30);

/// Extra pause between two reads of the slot while settling: the relay
/// reports at least every second, so polling faster buys nothing.
const SETTLE_POLL: Duration = Duration::from_millis(50);

/// Where the slot stands, as WAL byte positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPosition {
    /// The slot's `confirmed_flush_lsn`: the relay's acknowledged position.
    pub confirmed: u64,
    /// `pg_current_wal_lsn()`, read in the same statement.
    pub current: u64,
}

impl SlotPosition {
    /// WAL the slot holds back, in bytes.
    pub fn lag(&self) -> u64 {
        self.current.saturating_sub(self.confirmed)
    }
}

/// Reads the position of `slot` (`db` connected to its database).
pub async fn slot_position(db: &Client, slot: &str) -> anyhow::Result<SlotPosition> {
    let r = db
        .query_one(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint, (pg_current_wal_lsn() - '0/0')::bigint \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(SlotPosition {
        confirmed: u64::try_from(r.get::<_, i64>(0))?,
        current: u64::try_from(r.get::<_, i64>(1))?,
    })
}

/// `pg_current_wal_lsn()` as a byte position. Read after a commit, it is
/// past that commit's record: a slot confirmed at or beyond it will never
/// stream that transaction again.
pub async fn wal_position(db: &Client) -> anyhow::Result<u64> {
    let v: i64 = db
        .query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[])
        .await?
        .get(0);
    Ok(u64::try_from(v)?)
}

/// Waits until the relay is done with every transaction committed before
/// this call: the slot's confirmed position reached the current WAL
/// position (see the module doc). The relay must be streaming from `slot`.
pub async fn settle(db: &Client, slot: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let now = slot_position(db, slot).await?.current;
    let what =
        format!("slot {slot} confirmed past WAL position {now} (every earlier transaction done)");
    wait_until(&what, SETTLE, || async {
        tokio::time::sleep(SETTLE_POLL).await;
        slot_position(db, slot).await.map(|p| p.confirmed >= now)
    })
    .await?;
    eprintln!("settled in {:?}", started.elapsed());
    Ok(())
}

/// The pid of the walsender holding `slot`, if any.
pub async fn walsender_pid(db: &Client, slot: &str) -> anyhow::Result<Option<i32>> {
    let r = db
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(r.get(0))
}
