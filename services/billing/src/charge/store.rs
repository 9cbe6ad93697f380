//! The charge's state on the invoice row (`sql/billing.sql`): claims, the
//! recorded results, and the give-up bound. Each is one statement, its own
//! transaction; none is open while the provider is called.

use std::time::Duration;

use deadpool_postgres::tokio_postgres::types::ToSql;
use service_common::pool::Pool;
use uuid::Uuid;

/// Claims the due invoices: each becomes `charging`, counts the attempt,
/// and is due again after the request's timeout plus a backoff, so that a
/// Billing dying mid-attempt leaves it to be resumed then. `SKIP LOCKED`:
/// two instances never claim one invoice at the same instant (and were they
/// to, the key would still make one charge).
const CLAIM_DUE: &str = "\
    UPDATE invoices i SET charge_status = 'charging', \
        charge_attempts = i.charge_attempts + 1, charge_updated_at = now(), \
        charge_next_at = now() + make_interval(secs => $2 + random() * \
            least($3, $4 * power(2, least(i.charge_attempts, 30)))) \
    FROM (SELECT id FROM invoices \
          WHERE charge_status IN ('pending', 'charging') AND charge_next_at <= now() \
          ORDER BY charge_next_at LIMIT $1 FOR UPDATE SKIP LOCKED) due \
    WHERE i.id = due.id \
    RETURNING i.id, i.order_id, i.amount_cents, i.currency, i.charge_attempts";

/// `charged` wins over anything but itself: the provider's word is the truth
/// even for an invoice given up on meanwhile.
const RECORD_CHARGED: &str = "\
    UPDATE invoices SET charge_status = 'charged', charge_id = $2, charge_error = NULL, \
        charge_next_at = NULL, charge_updated_at = now() \
    WHERE id = $1 AND charge_status <> 'charged'";

const RECORD_FAILED: &str = "\
    UPDATE invoices SET charge_status = 'failed', charge_error = $2, \
        charge_next_at = NULL, charge_updated_at = now() \
    WHERE id = $1 AND charge_status IN ('pending', 'charging')";

/// Full jitter over an exponential backoff: the attempt's number decides
/// the ceiling, a random point below it the time.
const RECORD_RETRY: &str = "\
    UPDATE invoices SET charge_error = $2, charge_updated_at = now(), \
        charge_next_at = now() + make_interval(secs => random() * \
            least($3, $4 * power(2, least(charge_attempts, 30)))) \
    WHERE id = $1 AND charge_status = 'charging'";

const GIVE_UP: &str = "\
    UPDATE invoices SET charge_status = 'failed', charge_next_at = NULL, charge_updated_at = now(), \
        charge_error = 'no definite answer from the payment provider within --charge-retry-window (' \
            || $2 || ' since the invoice); the charge may exist: look up reference ' || id \
            || ' at the provider before charging again. Last error: ' || coalesce(charge_error, 'none') \
    WHERE charge_status IN ('pending', 'charging') AND charge_next_at <= now() \
      AND created_at < now() - make_interval(secs => $1)";

const COUNT_WAITING: &str =
    "SELECT count(*) FROM invoices WHERE charge_status IN ('pending', 'charging')";

/// An invoice claimed for an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    /// `invoices.id`: the key is derived from it.
    pub invoice_id: Uuid,
    /// The invoiced order.
    pub order_id: Uuid,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Currency code.
    pub currency: String,
    /// This attempt's number (1 for the first).
    pub attempt: i32,
}

/// The backoff between attempts: a random time below
/// `min(max, base · 2^(attempt - 1))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The first ceiling.
    pub base: Duration,
    /// The largest ceiling (`--charge-backoff-max`).
    pub max: Duration,
}

/// The charge columns over a pool.
#[derive(Clone)]
pub struct ChargeStore {
    pool: Pool,
}

impl ChargeStore {
    /// A store over `pool`.
    pub fn new(pool: Pool) -> ChargeStore {
        ChargeStore { pool }
    }

    /// Claims at most `limit` due invoices; each is due again after
    /// `timeout` plus a backoff unless its result is recorded first.
    pub async fn claim_due(
        &self,
        limit: usize,
        timeout: Duration,
        backoff: Backoff,
    ) -> anyhow::Result<Vec<Due>> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(CLAIM_DUE).await?;
        let limit = i64::try_from(limit)?;
        let params: [&(dyn ToSql + Sync); 4] = [
            &limit,
            &timeout.as_secs_f64(),
            &backoff.max.as_secs_f64(),
            &backoff.base.as_secs_f64(),
        ];
        let rows = client.query(&statement, &params).await?;
        Ok(rows
            .iter()
            .map(|row| Due {
                invoice_id: row.get(0),
                order_id: row.get(1),
                amount_cents: row.get(2),
                currency: row.get(3),
                attempt: row.get(4),
            })
            .collect())
    }

    /// `charged` with the provider's id.
    pub async fn record_charged(&self, invoice: Uuid, charge_id: &str) -> anyhow::Result<()> {
        self.execute(RECORD_CHARGED, &[&invoice, &charge_id]).await
    }

    /// `failed` with the reason.
    pub async fn record_failed(&self, invoice: Uuid, reason: &str) -> anyhow::Result<()> {
        self.execute(RECORD_FAILED, &[&invoice, &reason]).await
    }

    /// Still `charging`: the attempt's error, and due again after a backoff.
    pub async fn record_retry(
        &self,
        invoice: Uuid,
        reason: &str,
        backoff: Backoff,
    ) -> anyhow::Result<()> {
        let (max, base) = (backoff.max.as_secs_f64(), backoff.base.as_secs_f64());
        self.execute(RECORD_RETRY, &[&invoice, &reason, &max, &base])
            .await
    }

    /// Fails every invoice still waiting whose invoice is older than
    /// `window`; returns how many.
    pub async fn give_up_older_than(&self, window: Duration) -> anyhow::Result<u64> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(GIVE_UP).await?;
        let described = humantime::format_duration(window).to_string();
        Ok(client
            .execute(&statement, &[&window.as_secs_f64(), &described])
            .await?)
    }

    /// Invoices `pending` or `charging`.
    pub async fn waiting(&self) -> anyhow::Result<i64> {
        let client = self.pool.get().await?;
        Ok(client.query_one(COUNT_WAITING, &[]).await?.get(0))
    }

    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> anyhow::Result<()> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(sql).await?;
        client.execute(&statement, params).await?;
        Ok(())
    }
}
