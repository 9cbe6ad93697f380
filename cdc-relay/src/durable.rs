//! Asynchronously written dead letters, and the rule that makes
//! confirming past them safe: the slot is confirmed past an event whose
//! dead-letter row is written asynchronously only once the server has
//! committed that row and flushed the commit.
//!
//! **Why asynchronous.** A parked endpoint turns every one of its events
//! into a dead-letter row. They arrive one at a time, as fast as the
//! endpoint's events, so group commit ([`crate::deadletter::GroupedStore`])
//! found little company, and one synchronous commit per row doubled the
//! server's WAL flushes in benchmark j. The other endpoints' events pass
//! through the same server, and their commit→2xx time includes waiting
//! behind those flushes. So the relay's writer commits its statements with
//! `synchronous_commit = off`, set for that statement's transaction only
//! (PostgreSQL docs, "Asynchronous Commit"): the commit returns before its
//! WAL is flushed, and the WAL writer or the next synchronous commit
//! flushes it. Nobody waits for that flush.
//!
//! **Parked jobs do not wait for the commit either.** A parked event's job
//! is done once its row is *queued* for the writer
//! ([`crate::deadletter::GroupedStore::park`]): the writer takes rows in
//! queue order, so an aggregate's rows still get increasing ids, and it
//! gathers the rows of a few milliseconds into one statement. A hot
//! aggregate of a parked endpoint then no longer waits one commit per
//! event, and the server runs tens of statements a second instead of one
//! per parked event. A statement that fails is retried by the writer, in
//! order, before anything behind it.
//!
//! **What a crash does.** A relay crash loses the queued rows; a server
//! crash loses the commits whose WAL was not flushed yet (WAL is flushed in
//! order, so a suffix of them). Until it is committed and flushed, a row is
//! therefore not yet a promise. [`FlushGate`] holds the confirmed position
//! back until it is:
//!
//! ```text
//!  store:      promised += 1 ─▶ queue the row ─▶ job done (parked) / wait for the commit (other rows)
//!  writer:     COMMIT (async) of the next k queued rows ─▶ committed += k ─▶ answers the waiters
//!  poller:     n = committed; F = pg_current_wal_insert_lsn();
//!              wait until pg_current_wal_flush_lsn() >= F; covered = n
//!  dispatcher: p = Scheduler::confirmed(); n = promised  ─▶ FlushGate::pass(p)
//!              = the latest p it was offered whose n <= covered
//! ```
//!
//! **Why this is safe.** A job counted in `p` completed after its row was
//! queued, and the row was counted in `promised` before it was queued. The
//! dispatcher reads `n` after computing `p`, so every such row is among
//! the first `n` rows of the queue (rows are counted before they are
//! queued, so no more than `n` were queued when `n` was read). The writer
//! commits rows in queue order and counts a statement's rows only after it
//! committed, so `covered >= n` means the first `n` rows were committed
//! and the poller read the insert position `F` after that commit returned:
//! the commit record ends at or before `F`, and `F` is flushed. The model
//! check (`cdc-relay/tests/ack_model.rs`, "asynchronous parking") drives
//! the real gate through relay and server crashes and catches the rule
//! without it, and the rule that counts committed rows instead of promised
//! ones.
//!
//! **Not with synchronous replication.** A synchronous commit also waits
//! for the synchronous standbys (`synchronous_standby_names`); the flush
//! position read here is the primary's own. So where that setting is set
//! the relay commits its dead letters synchronously and waits for each, as
//! before, and uses no gate (`relay::Session::prepare` reads it at each
//! session start).
//!
//! **What it costs.** Only the confirmed position waits: for the writer's
//! gathering (about [`crate::deadletter::GATHER`]), then one poll (about
//! [`POLL_INTERVAL`]) while other commits flush the WAL, or at most about
//! three `wal_writer_delay` (600 ms by default) when nothing else does.
//! Without dead letters it costs nothing: `promised` stays at `covered`
//! and the gate passes every position at once.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio_postgres::Client;

/// The least time between two of the poller's reads of the server's
/// positions. Commits keep coming while an endpoint is parked; without a
/// pace the poller would query back to back.
pub const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// How long the poller waits after a failed query before trying again
/// (the connection is still open; a closed one ends the poller).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Most positions a gate holds; beyond it, the latest replaces the newest
/// held (that one then waits a little longer: never less safe).
const MAX_OFFERED: usize = 64;

/// The store's and the writer's side: counts the rows promised (queued
/// for the writer) and the rows whose statement committed, and wakes the
/// poller. Both count rows in queue order.
#[derive(Clone, Debug)]
pub struct Flushes {
    promised: Arc<AtomicU64>,
    committed: Arc<AtomicU64>,
    wake: Arc<Notify>,
}

impl Flushes {
    /// A row is about to be queued for the writer: count it. Call it
    /// before queueing the row, and so before anyone counts its job done
    /// (see the module doc).
    pub fn promised(&self) {
        self.promised.fetch_add(1, Ordering::SeqCst);
    }

    /// The writer's statement holding the next `rows` queued rows committed
    /// asynchronously (a row it dropped, its waiter gone, counts too: it
    /// needs nothing flushed): count them. Call it before answering anyone.
    pub fn committed(&self, rows: u64) {
        self.committed.fetch_add(rows, Ordering::SeqCst);
        self.wake.notify_one();
    }
}

/// The reader's side: how many rows were promised, and how many of them
/// the server has flushed (a prefix of the queue: the writer commits in
/// queue order, and WAL is flushed in order).
#[derive(Clone, Debug)]
pub struct Durability {
    promised: Arc<AtomicU64>,
    covered: watch::Receiver<u64>,
}

impl Durability {
    /// Rows promised so far (queued, committed or not).
    pub fn promised(&self) -> u64 {
        self.promised.load(Ordering::SeqCst)
    }

    /// How many of them are known committed and flushed: the first
    /// `covered()` rows of the queue.
    pub fn covered(&self) -> u64 {
        *self.covered.borrow()
    }
}

/// Counters of the rows promised and committed over `client`'s session,
/// and the task that follows their flush: the store's and writer's
/// [`Flushes`], the dispatcher's [`Durability`], and the poller to spawn.
/// The poller runs `SELECT pg_current_wal_insert_lsn(),
/// pg_current_wal_flush_lsn()` on `client` only while a committed row is
/// not known flushed, at most once per [`POLL_INTERVAL`]; it ends when
/// `client` closes or every [`Durability`] is dropped.
pub fn follow(
    client: Arc<Client>,
) -> (
    Flushes,
    Durability,
    impl std::future::Future<Output = ()> + Send,
) {
    let promised = Arc::new(AtomicU64::new(0));
    let committed = Arc::new(AtomicU64::new(0));
    let wake = Arc::new(Notify::new());
    let (covered_tx, covered) = watch::channel(0);
    let flushes = Flushes {
        promised: Arc::clone(&promised),
        committed: Arc::clone(&committed),
        wake: Arc::clone(&wake),
    };
    let durability = Durability { promised, covered };
    (
        flushes,
        durability,
        poll(client, committed, wake, covered_tx),
    )
}

/// The poller of [`follow`].
async fn poll(
    client: Arc<Client>,
    committed: Arc<AtomicU64>,
    wake: Arc<Notify>,
    covered: watch::Sender<u64>,
) {
    loop {
        let n = committed.load(Ordering::SeqCst);
        if n <= *covered.borrow() {
            tokio::select! {
                () = wake.notified() => continue,
                () = covered.closed() => return,
            }
        }
        let paced = tokio::time::sleep(POLL_INTERVAL);
        match flushed_to_insert(&client).await {
            Ok(()) => {
                if covered.send(n).is_err() {
                    return;
                }
                paced.await;
            }
            Err(e) if client.is_closed() => {
                tracing::debug!(error = %e, "flush poller ends with its connection");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the server's WAL flush position; the confirmed position waits for it");
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}

/// Returns once the server has flushed its WAL up to the insert position
/// read at the call (every commit that returned before it is flushed).
async fn flushed_to_insert(client: &Client) -> Result<(), tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT pg_current_wal_insert_lsn()::text, \
                    pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()",
            &[],
        )
        .await?;
    let target: String = row.get(0);
    let mut flushed: bool = row.get(1);
    while !flushed {
        tokio::time::sleep(POLL_INTERVAL).await;
        flushed = client
            .query_one(
                "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                &[&target],
            )
            .await?
            .get(0);
    }
    Ok(())
}

/// The positions offered and not yet passed, each with the number of
/// promised rows it needs committed and flushed; the pure part of
/// [`FlushGate`].
///
/// Invariant: positions and counts strictly increase from front to back,
/// and every position is greater than `passed`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Held<P> {
    offered: VecDeque<(P, u64)>,
    passed: P,
}

impl<P: Copy + Ord> Held<P> {
    /// Nothing held; `start` passed.
    pub fn new(start: P) -> Self {
        Held {
            offered: VecDeque::new(),
            passed: start,
        }
    }

    /// Position `p` is done as far as deliveries go, and the first `needs`
    /// promised rows (counted after `p` was computed) must be committed and
    /// flushed before it is confirmed; the first `covered` are. Returns the position that may be confirmed.
    pub fn offer(&mut self, p: P, needs: u64, covered: u64) -> P {
        let newest = self.offered.back().map_or(self.passed, |&(q, _)| q);
        if p > newest {
            let full = self.offered.len() >= MAX_OFFERED;
            match self.offered.back_mut() {
                Some(back) if back.1 == needs || full => {
                    *back = (p, needs.max(back.1));
                }
                _ => self.offered.push_back((p, needs)),
            }
        }
        self.release(covered)
    }

    /// The first `covered` promised rows are committed and flushed: passes
    /// every position they were all it needed. Returns the position that may be confirmed.
    pub fn release(&mut self, covered: u64) -> P {
        while let Some(&(p, needs)) = self.offered.front() {
            if needs > covered {
                break;
            }
            self.passed = p;
            self.offered.pop_front();
        }
        self.passed
    }

    /// The position that may be confirmed.
    pub fn passed(&self) -> P {
        self.passed
    }

    /// Whether a position waits for a flush.
    pub fn is_holding(&self) -> bool {
        !self.offered.is_empty()
    }
}

/// The dispatcher's gate between the scheduler's confirmed position and
/// the confirmed position it publishes (see the module doc).
#[derive(Debug)]
pub struct FlushGate<P> {
    durability: Durability,
    held: Held<P>,
}

impl<P: Copy + Ord> FlushGate<P> {
    /// A gate that has passed `start`.
    pub fn new(durability: Durability, start: P) -> Self {
        FlushGate {
            durability,
            held: Held::new(start),
        }
    }

    /// `p`, the scheduler's confirmed position just computed: returns the
    /// position that may be confirmed now (`p`, or an earlier one whose
    /// commits are flushed).
    pub fn pass(&mut self, p: P) -> P {
        let needs = self.durability.promised();
        self.held.offer(p, needs, self.durability.covered())
    }

    /// Waits until the poller reports more commits flushed (never returns
    /// once the poller has ended); [`FlushGate::pass`] then gives more.
    pub async fn flushed(&mut self) {
        if self.durability.covered.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// `p`, the scheduler's final confirmed position, once every commit it
    /// needs is flushed; the last position passed if the poller has ended
    /// first.
    pub async fn settle(&mut self, p: P) -> P {
        loop {
            let passed = self.pass(p);
            if passed == p || !self.held.is_holding() {
                return passed;
            }
            if self.durability.covered.changed().await.is_err() {
                return self.held.passed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_position_waits_for_the_commits_counted_after_it() {
        let mut h = Held::new(0u64);
        assert_eq!(
            h.offer(10, 0, 0),
            10,
            "no asynchronous commit: passed at once"
        );
        assert_eq!(h.offer(20, 2, 1), 10, "needs 2 flushed, 1 is");
        assert_eq!(h.offer(30, 3, 1), 10);
        assert_eq!(h.release(2), 20);
        assert_eq!(h.release(2), 20);
        assert_eq!(h.offer(40, 3, 3), 40, "all flushed: the newest passes");
        assert!(!h.is_holding());
    }

    #[test]
    fn a_full_gate_merges_into_its_newest_position() {
        let mut h = Held::new(0u64);
        for i in 1..=(MAX_OFFERED as u64 + 10) {
            h.offer(i, i, 0);
        }
        assert_eq!(h.offered.len(), MAX_OFFERED);
        assert_eq!(h.release(MAX_OFFERED as u64 - 1), MAX_OFFERED as u64 - 1);
        assert_eq!(
            h.release(MAX_OFFERED as u64 + 9),
            MAX_OFFERED as u64 - 1,
            "the newest held entry took the later offers: it waits for their count"
        );
        assert_eq!(h.release(MAX_OFFERED as u64 + 10), MAX_OFFERED as u64 + 10);
    }

    proptest! {
        /// Whatever the order of offers and flushes: the gate never passes a
        /// position before the commits counted with it are flushed, never
        /// moves back, and passes the newest position once everything is
        /// flushed.
        #[test]
        fn never_passes_a_position_before_its_commits_are_flushed(
            steps in proptest::collection::vec((any::<bool>(), 0u64..4, 0u64..4), 1..200),
        ) {
            let mut h = Held::new(0u64);
            let (mut p, mut committed, mut covered) = (0u64, 0u64, 0u64);
            let mut needs_of: Vec<(u64, u64)> = Vec::new();
            let mut last = 0;
            for (offer, dp, dc) in steps {
                if offer {
                    p += dp;
                    committed += dc;
                    needs_of.push((p, committed));
                    let passed = h.offer(p, committed, covered);
                    prop_assert!(passed >= last, "moved back");
                    last = passed;
                } else {
                    covered = (covered + dc).min(committed);
                    let passed = h.release(covered);
                    prop_assert!(passed >= last, "moved back");
                    last = passed;
                }
                // Every position passed had its commits flushed: the least
                // count any offer of a position >= it needed is covered.
                let needed = needs_of.iter().filter(|&&(q, _)| q >= last && last > 0).map(|&(_, n)| n).min();
                if let Some(n) = needed {
                    prop_assert!(n <= covered, "passed {} needing {} with {} flushed", last, n, covered);
                }
            }
            prop_assert_eq!(h.release(committed), p, "everything flushed: the newest passes");
        }
    }
}
