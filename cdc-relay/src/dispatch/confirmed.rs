//! What the dispatcher publishes as confirmed: the position, and the last
//! fully done transaction that carried events (its commit time and last
//! event id) — what a progress record and a backfill suggestion need.

use std::collections::VecDeque;

use crate::ack::Position;

/// The confirmed position and the last done transaction with events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Confirmed<P> {
    /// Safe to confirm to the server.
    pub position: P,
    /// The last transaction at or before `position` that carried events,
    /// all done; `None` until one is.
    pub last_done: Option<DoneTx>,
}

/// A transaction whose events are all done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoneTx {
    /// Its commit time, microseconds since 2000-01-01 UTC.
    pub commit_time_micros: i64,
    /// The id of its last event (empty for a row without a readable id).
    pub last_event_id: String,
}

/// Committed transactions with events, oldest first, until the confirmed
/// position passes them. Bounded by what the window holds.
#[derive(Debug)]
pub struct DoneLog<P> {
    open_last_event: Option<String>,
    committed: VecDeque<(P, DoneTx)>,
}

impl<P: Position> DoneLog<P> {
    /// An empty log.
    pub fn new() -> Self {
        DoneLog {
            open_last_event: None,
            committed: VecDeque::new(),
        }
    }

    /// An event (with its id, if readable) of the open transaction.
    pub fn event(&mut self, id: Option<&str>) {
        // One buffer per transaction, overwritten by each of its events.
        let last = self.open_last_event.get_or_insert_with(String::new);
        last.clear();
        last.push_str(id.unwrap_or_default());
    }

    /// The open transaction committed at `end`.
    pub fn commit(&mut self, end: P, commit_time_micros: i64) {
        if let Some(last_event_id) = self.open_last_event.take() {
            self.committed.push_back((
                end,
                DoneTx {
                    commit_time_micros,
                    last_event_id,
                },
            ));
        }
    }

    /// The newest transaction at or before `confirmed`, if any passed since
    /// the last call.
    pub fn passed(&mut self, confirmed: P) -> Option<DoneTx> {
        let mut last = None;
        while self
            .committed
            .front()
            .is_some_and(|(end, _)| *end <= confirmed)
        {
            last = self.committed.pop_front().map(|(_, tx)| tx);
        }
        last
    }
}

impl<P: Position> Default for DoneLog<P> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    #[test]
    fn reports_the_newest_passed_transaction_with_events() {
        let mut log = DoneLog::new();
        log.event(Some("a"));
        log.commit(Lsn::new(100), 1);
        log.commit(Lsn::new(150), 2); // no events
        log.event(Some("b"));
        log.event(Some("c"));
        log.commit(Lsn::new(200), 3);
        assert_eq!(log.passed(Lsn::new(99)), None);
        assert_eq!(
            log.passed(Lsn::new(160)),
            Some(DoneTx {
                commit_time_micros: 1,
                last_event_id: "a".into()
            })
        );
        assert_eq!(log.passed(Lsn::new(160)), None, "reported once");
        assert_eq!(
            log.passed(Lsn::new(200)).map(|t| t.last_event_id),
            Some("c".into())
        );
    }
}
