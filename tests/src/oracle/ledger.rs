//! The ledger: what was committed in the orders database against what took
//! effect in Billing. Every test that runs the whole stack ends here.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use crate::stack::{Stack, connect};
use crate::wait_until;

/// How often [`wait_ledger_clean`] reads the ledger: each read costs two
/// connections.
const LEDGER_POLL: Duration = Duration::from_millis(200);

/// The end-state oracle: what was committed against what took effect.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ledger {
    /// Committed outbox rows.
    pub committed: usize,
    /// Invoices.
    pub invoices: usize,
    /// Committed events without an inbox row (must be 0).
    pub lost: usize,
    /// Orders with more than one invoice (must be 0).
    pub duplicate_effects: usize,
    /// Inbox rows for events that never committed (must be 0).
    pub phantom: usize,
}

impl Ledger {
    /// Reads both databases.
    pub async fn read(stack: &Stack) -> anyhow::Result<Ledger> {
        let orders = connect(&stack.orders_admin_url).await?;
        let billing = connect(&stack.billing_admin_url).await?;
        let committed: Vec<Uuid> = orders
            .query("SELECT id FROM outbox", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let processed: HashSet<Uuid> = billing
            .query("SELECT event_id FROM processed_events", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let committed_set: HashSet<Uuid> = committed.iter().copied().collect();
        let invoices: i64 = billing
            .query_one("SELECT count(*) FROM invoices", &[])
            .await?
            .get(0);
        let dup: i64 = billing
            .query_one(
                "SELECT count(*) FROM (SELECT order_id FROM invoices GROUP BY order_id HAVING count(*) > 1) d",
                &[],
            )
            .await?
            .get(0);
        Ok(Ledger {
            committed: committed.len(),
            invoices: usize::try_from(invoices)?,
            lost: committed_set.difference(&processed).count(),
            duplicate_effects: usize::try_from(dup)?,
            phantom: processed.difference(&committed_set).count(),
        })
    }

    /// Whether every committed event took effect exactly once and nothing else did.
    pub fn is_clean(&self) -> bool {
        self.lost == 0
            && self.duplicate_effects == 0
            && self.phantom == 0
            && self.invoices == self.committed
    }
}

/// Waits until the ledger is clean with `expected` committed events.
pub async fn wait_ledger_clean(
    stack: &Stack,
    expected: usize,
    timeout: Duration,
) -> anyhow::Result<Ledger> {
    let what = format!("{expected} committed events, each with exactly one invoice");
    wait_until(&what, timeout, || async {
        tokio::time::sleep(LEDGER_POLL).await;
        let l = Ledger::read(stack).await?;
        anyhow::Ok(l.committed == expected && l.is_clean())
    })
    .await?;
    Ledger::read(stack).await
}
