//! The reaper: one task per sink, started with its first idle connection,
//! that closes idle connections the sink closed, or that are past
//! `--sink-idle-timeout` or `--sink-connection-max-age`, while no request
//! comes to take them (a request finds them unusable itself).

use std::sync::Weak;
use std::time::Duration;

use super::{Connections, Http1};

/// How often the reaper looks at idle connections at most: a connection
/// the sink closed while idle is closed on the relay's side within about
/// this long (not left half-closed until the idle timeout).
const REAP_PERIOD: Duration = Duration::from_secs(1);

/// Closes idle connections that the sink closed, or that are past their
/// idle timeout or age, while no request comes to take them; ends with
/// the sink.
pub(super) async fn reap(connections: Weak<Connections>) {
    let period = match connections.upgrade() {
        Some(c) => {
            (c.idle_timeout.min(c.max_age) / 2).clamp(Duration::from_millis(100), REAP_PERIOD)
        }
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(c) = connections.upgrade() else {
            return;
        };
        let expired: Vec<Http1> = {
            let mut idle = c.idle.lock().expect("connections lock is never poisoned");
            let mut expired = Vec::new();
            for mut h1 in std::mem::take(&mut *idle) {
                if c.usable(&h1) && h1.open() {
                    idle.push(h1);
                } else {
                    expired.push(h1);
                }
            }
            expired
        };
        drop(expired);
        let mut shared = c.shared.lock().expect("connections lock is never poisoned");
        if shared.as_ref().is_some_and(|h2| !c.takes_requests(h2)) {
            *shared = None;
        }
    }
}
