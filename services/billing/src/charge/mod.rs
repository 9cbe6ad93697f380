//! The charge of each invoice at the payment provider: an effect outside
//! Billing's database, made exactly once whatever crashes
//! (`services/README.md#effects-outside-the-database`).
//!
//! ```text
//! inbox transaction ── invoice charge_status = pending ──┐ (wakes the worker)
//!                                                        ▼
//! worker::ChargeWorker ─▶ store::ChargeStore::claim_due: pending/charging and due
//!   │                      → charging, attempts + 1, charge_next_at = now + timeout + backoff
//!   ├─▶ client::Provider::charge: POST /charges, Idempotency-Key: invoice-<id>   (no transaction open)
//!   ├─▶ verdict::verdict(reply) ─▶ Charged(id) │ Failed(reason) │ Retry(reason)
//!   └─▶ store: charged + charge_id │ failed + reason │ charge_next_at = now + backoff
//! ```
//!
//! Why it never charges twice: every attempt for an invoice sends the same
//! key, derived from the invoice id, which the inbox transaction fixed once;
//! the provider makes one charge per key and answers every later request
//! with that key with the first result. A crash anywhere leaves the invoice
//! `pending` or `charging` with a due time, and the worker (this process
//! after a restart, or another instance) resumes it with that key. The one
//! bound: the provider forgets a key after its TTL (24 h for ours), so
//! Billing stops retrying after `--charge-retry-window` (23 h), marking the
//! invoice `failed` for an operator to reconcile rather than risk a second
//! charge.

pub mod client;
pub mod store;
pub mod verdict;
pub mod worker;

use prometheus::{IntCounterVec, Opts, Registry};
use service_common::pool::Pool;
use uuid::Uuid;

pub use worker::{ChargeSettings, ChargeWorker};

use crate::config::ChargeArgs;

/// Starts the charge worker when `--payments-url` is set and returns it
/// (the inbox wakes it); registers `billing_charge_attempts_total{verdict}`
/// in `registry`. Without a URL nothing is charged: it returns `None`, and
/// warns when invoices wait to be charged (from a run with a URL).
pub fn start(
    args: &ChargeArgs,
    pool: Pool,
    registry: &Registry,
) -> anyhow::Result<Option<ChargeWorker>> {
    let store = store::ChargeStore::new(pool);
    let Some(url) = &args.payments_url else {
        tokio::spawn(async move {
            if let Ok(waiting @ 1..) = store.waiting().await {
                tracing::warn!(
                    invoices = waiting,
                    "invoices wait to be charged, but no --payments-url is set: they are charged once Billing runs with one"
                );
            }
        });
        return Ok(None);
    };
    let attempts = IntCounterVec::new(
        Opts::new(
            "billing_charge_attempts_total",
            "Charge attempts at the payment provider, by verdict (charged, failed, retry; gave_up: invoices past --charge-retry-window)",
        ),
        &["verdict"],
    )?;
    registry.register(Box::new(attempts.clone()))?;
    let send_key = !args.charge_without_idempotency_key;
    if !send_key {
        tracing::warn!(
            "TEST HOOK charge_without_idempotency_key is ON: a retried charge may charge twice"
        );
    }
    let provider = client::Provider::new(url, args.charge_timeout, send_key)?;
    tracing::info!(payments_url = %url, "charging invoices at the payment provider");
    let worker = ChargeWorker::new(store, provider, args.settings(), attempts);
    tokio::spawn(worker.clone().run());
    Ok(Some(worker))
}

/// The `Idempotency-Key` of every attempt to charge `invoice_id`.
pub fn idempotency_key(invoice_id: Uuid) -> String {
    format!("invoice-{invoice_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_depends_on_the_invoice_alone() {
        let invoice = Uuid::new_v4();
        assert_eq!(idempotency_key(invoice), idempotency_key(invoice));
        assert_ne!(idempotency_key(invoice), idempotency_key(Uuid::new_v4()));
        assert!(idempotency_key(invoice).len() <= 255);
    }
}
