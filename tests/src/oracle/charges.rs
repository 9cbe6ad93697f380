//! The ledger of the effect outside every database of ours: the payment
//! provider's charges against Billing's invoices, per order (Billing makes
//! one invoice per order, and sends the invoice id as the charge's
//! reference). Charged once is the only right answer; never and twice are
//! what crashes make of a charge without an idempotency key or without a
//! worker that resumes it.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use uuid::Uuid;

use crate::stack::{PaymentsDb, Stack, connect};

/// Invoices against the provider's charges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Charges {
    /// Invoices (one per order).
    pub invoices: usize,
    /// Charges the provider made.
    pub charges: usize,
    /// Orders charged exactly once.
    pub once: usize,
    /// Orders never charged (must be 0 once settled).
    pub never: usize,
    /// Orders charged twice or more: the double charges (must be 0).
    pub twice: usize,
    /// Charges beyond the first of their order, summed.
    pub extra_charges: usize,
    /// Charges for no invoice (must be 0).
    pub orphan: usize,
    /// `charged` invoices whose recorded charge id is none of the
    /// provider's charges for them (must be 0).
    pub mismatched: usize,
    /// Invoices by `charge_status`.
    pub by_status: BTreeMap<String, usize>,
}

impl Charges {
    /// Reads Billing's invoices and the provider's charges.
    pub async fn read(stack: &Stack, payments: &PaymentsDb) -> anyhow::Result<Charges> {
        let billing = connect(&stack.billing_admin_url).await?;
        let provider = payments.admin().await?;
        let invoices: Vec<(Uuid, String, Option<String>)> = billing
            .query("SELECT id, charge_status, charge_id FROM invoices", &[])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let mut made: HashMap<String, Vec<String>> = HashMap::new();
        let mut charges = 0;
        for row in provider
            .query("SELECT reference, id::text FROM charges", &[])
            .await?
        {
            made.entry(row.get(0)).or_default().push(row.get(1));
            charges += 1;
        }
        let mut ledger = Charges {
            invoices: invoices.len(),
            charges,
            ..Charges::default()
        };
        for (id, status, charge_id) in &invoices {
            *ledger.by_status.entry(status.clone()).or_insert(0) += 1;
            let of = made.remove(&id.to_string()).unwrap_or_default();
            match of.len() {
                0 => ledger.never += 1,
                1 => ledger.once += 1,
                n => {
                    ledger.twice += 1;
                    ledger.extra_charges += n - 1;
                }
            }
            if status == "charged" && !charge_id.as_ref().is_some_and(|c| of.contains(c)) {
                ledger.mismatched += 1;
            }
        }
        ledger.orphan = made.values().map(Vec::len).sum();
        Ok(ledger)
    }

    /// No invoice waits for its charge (`pending`, `charging`) any more.
    pub fn settled(&self) -> bool {
        ["pending", "charging"]
            .iter()
            .all(|s| !self.by_status.contains_key(*s))
    }

    /// Every invoice charged exactly once and recorded `charged` with that
    /// charge's id; no charge for anything else.
    pub fn is_clean(&self) -> bool {
        self.never == 0
            && self.twice == 0
            && self.orphan == 0
            && self.mismatched == 0
            && self.by_status.get("charged").copied().unwrap_or(0) == self.invoices
    }

    /// One line: `charges 120 for 120 invoices: once 120, never 0, twice 0`.
    pub fn line(&self) -> String {
        format!(
            "{} charges for {} invoices: charged once {}, never {}, twice or more {} ({} extra charges)",
            self.charges, self.invoices, self.once, self.never, self.twice, self.extra_charges
        )
    }
}
