//! The worker that charges invoices: woken by the inbox for a new one, and
//! every `--charge-poll-interval` for those due again (a retry, or an
//! attempt a crashed Billing left `charging`). At most
//! `--charge-concurrency` attempts run at once.

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use tokio::sync::{Notify, Semaphore};

use super::client::Provider;
use super::store::{Backoff, ChargeStore, Due};
use super::verdict::{self, Verdict};

/// Exit status of the test hook `--fault-exit-after-charge`.
pub const EXIT_AFTER_CHARGE_STATUS: i32 = 87;

/// How the worker runs (from `ChargeArgs`).
#[derive(Debug, Clone)]
pub struct ChargeSettings {
    /// Bound on one request to the provider.
    pub timeout: Duration,
    /// Backoff between attempts of one invoice.
    pub backoff: Backoff,
    /// How often due invoices are looked for without a wake-up.
    pub poll_interval: Duration,
    /// Attempts at once.
    pub concurrency: usize,
    /// Invoices older than this are not retried any more (`failed`).
    pub retry_window: Duration,
    /// TEST HOOK: exit after the provider's charge, before recording it.
    pub exit_after_charge: bool,
}

/// The charge worker; [`ChargeWorker::wake`] is what the inbox calls.
#[derive(Clone)]
pub struct ChargeWorker {
    store: ChargeStore,
    provider: Provider,
    settings: ChargeSettings,
    wake: Arc<Notify>,
    attempts: IntCounterVec,
}

impl ChargeWorker {
    /// A worker over `store` charging through `provider`; counts each
    /// attempt's verdict in `attempts` (label `verdict`: `charged`,
    /// `failed`, `retry`, `gave_up`).
    pub fn new(
        store: ChargeStore,
        provider: Provider,
        settings: ChargeSettings,
        attempts: IntCounterVec,
    ) -> ChargeWorker {
        for verdict in ["charged", "failed", "retry", "gave_up"] {
            attempts.with_label_values(&[verdict]);
        }
        ChargeWorker {
            store,
            provider,
            settings,
            wake: Arc::new(Notify::new()),
            attempts,
        }
    }

    /// A new invoice waits: look now rather than at the next poll.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Runs until the process ends: claims due invoices while attempts are
    /// free, then waits for a wake-up, a finished attempt or the poll
    /// interval.
    pub async fn run(self) {
        if self.settings.exit_after_charge {
            tracing::warn!(
                "TEST HOOK fault_exit_after_charge is ON: Billing exits after the next charge"
            );
        }
        let slots = Arc::new(Semaphore::new(self.settings.concurrency.max(1)));
        let mut last_give_up: Option<tokio::time::Instant> = None;
        loop {
            if last_give_up.is_none_or(|t| t.elapsed() >= self.settings.poll_interval) {
                self.give_up().await;
                last_give_up = Some(tokio::time::Instant::now());
            }
            let free = slots.available_permits();
            let claimed = match free {
                0 => Vec::new(),
                _ => self
                    .store
                    .claim_due(free, self.settings.timeout, self.settings.backoff)
                    .await
                    .unwrap_or_else(|error| {
                        tracing::warn!(error = %format!("{error:#}"), "cannot claim invoices to charge; retrying at the next poll");
                        Vec::new()
                    }),
            };
            let full = !claimed.is_empty() && claimed.len() == free;
            for due in claimed {
                let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
                    break;
                };
                let worker = self.clone();
                tokio::spawn(async move {
                    worker.attempt(due).await;
                    drop(permit);
                    worker.wake();
                });
            }
            if full {
                // Perhaps more are due: look again once an attempt ends.
                self.wake.notified().await;
                continue;
            }
            let _ = tokio::time::timeout(self.settings.poll_interval, self.wake.notified()).await;
        }
    }

    /// One attempt: the request, then the verdict recorded. A failure to
    /// record leaves the invoice `charging`: it is resumed when its claim
    /// runs out, with the same key.
    async fn attempt(&self, due: Due) {
        let reply = self.provider.charge(&due).await;
        let verdict = verdict::verdict(reply.as_ref().map_err(String::as_str));
        let (label, recorded) = match &verdict {
            Verdict::Charged(charge_id) => {
                if self.settings.exit_after_charge {
                    tracing::warn!(invoice_id = %due.invoice_id, "test hook: exiting after the charge, before recording it");
                    std::process::exit(EXIT_AFTER_CHARGE_STATUS);
                }
                tracing::info!(invoice_id = %due.invoice_id, order_id = %due.order_id, %charge_id, attempt = due.attempt, "charged");
                (
                    "charged",
                    self.store.record_charged(due.invoice_id, charge_id).await,
                )
            }
            Verdict::Failed(reason) => {
                tracing::warn!(invoice_id = %due.invoice_id, %reason, "the provider refused the charge: failed");
                (
                    "failed",
                    self.store.record_failed(due.invoice_id, reason).await,
                )
            }
            Verdict::Retry(retry) => {
                if retry.misconfigured {
                    tracing::error!(invoice_id = %due.invoice_id, reason = %retry.reason, attempt = due.attempt, "charge refused as misconfigured; retrying");
                } else {
                    tracing::warn!(invoice_id = %due.invoice_id, reason = %retry.reason, attempt = due.attempt, "charge outcome unknown; retrying with the same key");
                }
                let recorded = self
                    .store
                    .record_retry(due.invoice_id, &retry.reason, self.settings.backoff)
                    .await;
                ("retry", recorded)
            }
        };
        self.attempts.with_label_values(&[label]).inc();
        if let Err(error) = recorded {
            tracing::warn!(invoice_id = %due.invoice_id, error = %format!("{error:#}"), "cannot record the charge's result; the invoice is resumed when its claim runs out");
        }
    }

    async fn give_up(&self) {
        match self
            .store
            .give_up_older_than(self.settings.retry_window)
            .await
        {
            Ok(0) => {}
            Ok(n) => {
                tracing::error!(invoices = n, window = %humantime::format_duration(self.settings.retry_window), "invoices not charged within --charge-retry-window: failed, to reconcile with the provider");
                self.attempts.with_label_values(&["gave_up"]).inc_by(n);
            }
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "cannot check for invoices past --charge-retry-window")
            }
        }
    }
}
