//! The summary printed after the drain: orders, invoices, latencies, the
//! relay's own figures, the slot, the payment provider's charges per order,
//! and the ledger verdict.

use std::collections::HashMap;
use std::time::Duration;

use harness::app::Running;
use harness::oracle::{Charges, Ledger, SlotPosition, slot_position};
use harness::prom::{self, Exposition};
use harness::stack::{PaymentsDb, Stack};
use uuid::Uuid;

use crate::fmt::{fmt_duration, fmt_lsn, fmt_seconds, fmt_us, q};
use crate::load::{LoadReport, RowTimes, TIMES};

/// Longest wait for the slot to be confirmed past the last commit.
const SLOT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(15);

/// Everything the summary prints, gathered after the drain.
pub(crate) struct Summary {
    ledger: Ledger,
    charges: Charges,
    charges_settled: bool,
    /// Invoices joined to their orders.
    joined: usize,
    commit_us: Vec<i64>,
    created_us: Vec<i64>,
    /// Last invoice commit minus last order commit, microseconds.
    last_invoice_after_last_order_us: Option<i64>,
    relay: Exposition,
    billing: Exposition,
    slot: SlotPosition,
    slot_caught_up: bool,
}

pub(crate) async fn summarize(
    http: &reqwest::Client,
    stack: &Stack,
    payments: &PaymentsDb,
    relay: &Running,
    billing: &Running,
    load: &LoadReport,
) -> anyhow::Result<Summary> {
    // The slot: confirmed past everything committed so far?
    let orders = stack.orders_admin().await?;
    let target = slot_position(&orders, &stack.slot).await?.current;
    let slot_caught_up = harness::wait_until(
        "the slot confirmed past the last commit",
        if load.drained {
            SLOT_CONFIRM_TIMEOUT
        } else {
            Duration::from_secs(1)
        },
        || async {
            slot_position(&orders, &stack.slot)
                .await
                .map(|p| p.confirmed >= target)
        },
    )
    .await
    .is_ok();
    let slot = slot_position(&orders, &stack.slot).await?;

    // Latencies over every invoice, joined to its order by id.
    let billing_db = stack.billing_admin().await?;
    let all_orders: HashMap<Uuid, RowTimes> = orders
        .query(&format!("SELECT id, {TIMES} FROM orders"), &[])
        .await?
        .iter()
        .map(|r| {
            (
                r.get(0),
                RowTimes {
                    commit_us: r.get(1),
                    created_us: r.get(2),
                },
            )
        })
        .collect();
    let mut commit_us = Vec::new();
    let mut created_us = Vec::new();
    let mut joined = 0;
    let last_order = all_orders.values().filter_map(|o| o.commit_us).max();
    let mut last_invoice = None;
    for row in billing_db
        .query(&format!("SELECT order_id, {TIMES} FROM invoices"), &[])
        .await?
    {
        let id: Uuid = row.get(0);
        let Some(order) = all_orders.get(&id) else {
            continue;
        };
        joined += 1;
        let invoice = RowTimes {
            commit_us: row.get(1),
            created_us: row.get(2),
        };
        created_us.push(invoice.created_us - order.created_us);
        if let (Some(i), Some(o)) = (invoice.commit_us, order.commit_us) {
            commit_us.push(i - o);
            last_invoice = last_invoice.max(Some(i));
        }
    }
    commit_us.sort_unstable();
    created_us.sort_unstable();

    // Billing charges after its inbox commit: the last charges may trail
    // the last invoices by a moment.
    let charges_settled = harness::wait_until(
        "every invoice charged (or failed)",
        if load.drained {
            SLOT_CONFIRM_TIMEOUT
        } else {
            Duration::from_secs(1)
        },
        || async { Charges::read(stack, payments).await.map(|c| c.settled()) },
    )
    .await
    .is_ok();

    let relay_metrics = prom::scrape(http, &relay.url).await?;
    let billing_metrics = prom::scrape(http, &billing.admin_url).await?;
    Ok(Summary {
        ledger: Ledger::read(stack).await?,
        charges: Charges::read(stack, payments).await?,
        charges_settled,
        joined,
        commit_us,
        created_us,
        last_invoice_after_last_order_us: last_invoice.zip(last_order).map(|(i, o)| i - o),
        relay: relay_metrics,
        billing: billing_metrics,
        slot,
        slot_caught_up,
    })
}

impl Summary {
    /// Prints the summary; returns the ledger verdict.
    pub(crate) fn print(&self, load: &LoadReport) -> bool {
        let l = &self.ledger;
        println!();
        println!("== summary ==");
        let rate = if load.sending.is_zero() || load.sent < 2 {
            String::new()
        } else {
            format!(
                " over {:.1} s ({:.1}/s)",
                load.sending.as_secs_f64(),
                (load.sent - 1) as f64 / load.sending.as_secs_f64()
            )
        };
        println!(
            "orders         {} sent{rate}: {} accepted (201), {} failed",
            load.sent, load.accepted, load.failed
        );
        if load.sent < load.total {
            println!("               (stopped before sending all {})", load.total);
        }
        if let Some(err) = &load.first_error {
            println!("               first failure: {err}");
        }
        let inbox =
            self.billing
                .sum_by("billing_http_requests_total", ("route", "/inbox"), "status");
        let inbox_text = inbox
            .iter()
            .map(|(status, n)| format!("{n:.0}×{status}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "invoices       {} (Billing: POST /inbox answered {}; duplicates absorbed {:.0})",
            l.invoices,
            if inbox_text.is_empty() {
                "never".to_owned()
            } else {
                inbox_text
            },
            self.billing.sum("billing_duplicates_absorbed_total"),
        );
        let drain = if load.drained {
            self.last_invoice_after_last_order_us.map_or_else(
                || "every accepted order invoiced".to_owned(),
                |us| {
                    format!(
                        "every accepted order invoiced; the last invoice committed {} after the last order",
                        fmt_us(us)
                    )
                },
            )
        } else {
            format!(
                "NOT drained: invoices still missing after {}",
                fmt_duration(load.drain)
            )
        };
        println!("drain          {drain}");
        println!(
            "commit→invoice p50 {}  p99 {}  max {}   order commit → invoice commit (pg_xact_commit_timestamp, {} invoices)",
            q(&self.commit_us, 0.50),
            q(&self.commit_us, 0.99),
            q(&self.commit_us, 1.0),
            self.commit_us.len()
        );
        println!(
            "               p50 {}  p99 {}  max {}   invoices.created_at − orders.created_at (now() of each transaction, {} invoices)",
            q(&self.created_us, 0.50),
            q(&self.created_us, 0.99),
            q(&self.created_us, 1.0),
            self.joined
        );
        let hist = "cdc_relay_commit_to_delivery_seconds";
        let hq = |quantile: f64| {
            prom::histogram_quantile(&self.relay.buckets(hist), quantile)
                .map_or_else(|| "-".to_owned(), |s| format!("≈{}", fmt_seconds(s)))
        };
        println!(
            "relay          commit → 2xx p50 {}  p99 {} (its histogram, interpolated in buckets); {:.0} delivered, {:.0} retries",
            hq(0.50),
            hq(0.99),
            self.relay.sum("cdc_relay_events_delivered_total"),
            self.relay.sum("cdc_relay_retries_total"),
        );
        let lag = self.slot.lag();
        println!(
            "slot           confirmed_flush_lsn {}, pg_current_wal_lsn {}: lag {lag} bytes{}",
            fmt_lsn(self.slot.confirmed),
            fmt_lsn(self.slot.current),
            if self.slot_caught_up {
                ""
            } else {
                " (NOT yet confirmed past the last commit)"
            }
        );
        let c = &self.charges;
        println!(
            "payments       {}, double charges {}{}",
            c.line(),
            c.twice,
            if self.charges_settled {
                ""
            } else {
                " (some invoices still wait for their charge)"
            }
        );
        let clean = l.is_clean() && c.is_clean();
        println!(
            "ledger         committed {}, invoices {}, charged {}: lost {}, duplicate {}, phantom {}, double charges {}, uncharged {} → {}",
            l.committed,
            l.invoices,
            c.once + c.twice,
            l.lost,
            l.duplicate_effects,
            l.phantom,
            c.twice,
            c.never,
            if clean {
                "OK: every committed order invoiced and charged exactly once"
            } else {
                "FAILED"
            }
        );
        clean
    }
}
