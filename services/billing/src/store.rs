//! SQL of the Billing service.
//!
//! The inbox write is ONE statement, so it is its own transaction and costs
//! one round trip (statements are prepared once per pooled connection):
//! the `processed_events` insert with `ON CONFLICT DO NOTHING RETURNING`
//! feeds the invoice insert, which therefore happens only when the event id
//! was new. A concurrent duplicate waits on the first one's key, then finds
//! the conflict and inserts nothing. Any error aborts both inserts. The
//! invoice starts its charge's state machine there (`pending`, due now) when
//! Billing charges; [`crate::charge`] takes it from there.

use std::collections::HashSet;

use deadpool_postgres::tokio_postgres::error::SqlState;
use serde::Serialize;
use service_common::ServiceError;
use service_common::pool::Pool;
use uuid::Uuid;

use crate::event::OrderCreated;

const RECORD_EVENT: &str = "\
    WITH inbox AS ( \
        INSERT INTO processed_events (event_id) VALUES ($1) \
        ON CONFLICT DO NOTHING \
        RETURNING event_id \
    ) \
    INSERT INTO invoices (id, order_id, amount_cents, currency, charge_status, charge_next_at) \
    SELECT $2::uuid, $3::uuid, $4::bigint, $5::bpchar, $6::text, now() FROM inbox";

/// A batch's events in ONE statement: the inbox rows of the ids not seen
/// before, then an invoice for each of those, in array order. An id seen
/// before changes nothing. Before it writes, the statement takes a
/// transaction-scoped advisory lock per order it names, in `order_id`
/// order (`locked`, which the inbox insert joins, so it runs first), and
/// the inbox rows go in id order: two batches naming the same orders or
/// sharing ids in different orders (a client's retry racing a slow first
/// attempt, overlapping batches, two events of one order in two batches)
/// wait for each other in one order, never deadlock, and the later finds
/// the earlier's invoices committed. (Without the locks, two batches
/// naming 100 orders in opposite orders waited on each other's invoice
/// keys until `lock_timeout`: a 500.)
const RECORD_BATCH: &str = "\
    WITH batch AS ( \
        SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::bigint[], $5::text[]) \
            WITH ORDINALITY AS b(event_id, invoice_id, order_id, amount_cents, currency, ord) \
    ), locked AS ( \
        SELECT count(pg_advisory_xact_lock(hashtextextended('billing.invoice:' || order_id::text, 0))) \
        FROM (SELECT DISTINCT order_id FROM batch ORDER BY order_id) o \
    ), inbox AS ( \
        INSERT INTO processed_events (event_id) \
        SELECT event_id FROM batch, locked ORDER BY event_id \
        ON CONFLICT DO NOTHING \
        RETURNING event_id \
    ) \
    INSERT INTO invoices (id, order_id, amount_cents, currency, charge_status, charge_next_at) \
    SELECT b.invoice_id, b.order_id, b.amount_cents, b.currency::bpchar, $6::text, now() \
    FROM batch b JOIN inbox USING (event_id) ORDER BY b.ord";

/// Of a batch's orders, those invoiced (by any event).
const INVOICED: &str = "SELECT order_id FROM invoices WHERE order_id = ANY($1)";

const SEEN: &str = "SELECT event_id FROM processed_events WHERE event_id = ANY($1)";

const SELECT_INVOICES: &str = "SELECT id, order_id, amount_cents, currency, \
     to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
     charge_status, charge_id, charge_error, charge_attempts \
     FROM invoices WHERE order_id = $1 ORDER BY created_at, id";

/// What recording an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// First delivery: inbox row and invoice committed.
    Invoiced,
    /// The event id was already in the inbox: nothing changed.
    Duplicate,
}

/// An invoice as `GET /invoices` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Invoice {
    /// `invoices.id`.
    pub invoice_id: Uuid,
    /// The invoiced order.
    pub order_id: Uuid,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Currency code.
    pub currency: String,
    /// Creation time, RFC 3339 in UTC with microseconds.
    pub created_at: String,
    /// `none`, `pending`, `charging`, `charged` or `failed`
    /// (`sql/billing.sql`).
    pub charge_status: String,
    /// The provider's charge id, once `charged`.
    pub charge_id: Option<String>,
    /// Why it `failed`, or the last attempt's error while `charging`.
    pub charge_error: Option<String>,
    /// Attempts so far.
    pub charge_attempts: i32,
}

/// Inbox and invoices over a pool.
#[derive(Clone)]
pub struct InboxStore {
    pool: Pool,
    charge_status: &'static str,
}

impl InboxStore {
    /// A store over `pool`; new invoices start `pending` when `charging`
    /// (a payments URL is set), else `none`.
    pub fn new(pool: Pool, charging: bool) -> Self {
        Self {
            pool,
            charge_status: if charging { "pending" } else { "none" },
        }
    }

    /// Records `event` exactly once. A second event id for an already
    /// invoiced order violates `invoices.order_id UNIQUE`: 422
    /// `order_already_invoiced`, nothing committed. 422, not 409: the event
    /// itself can never succeed, so a relay quarantines it (dead letter)
    /// instead of retrying it forever.
    pub async fn record(&self, event: &OrderCreated) -> Result<Recorded, ServiceError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(RECORD_EVENT).await?;
        let invoice_id = Uuid::new_v4();
        let inserted = client
            .execute(
                &statement,
                &[
                    &event.id,
                    &invoice_id,
                    &event.order_id,
                    &event.amount_cents,
                    &event.currency,
                    &self.charge_status,
                ],
            )
            .await
            .map_err(|e| {
                if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
                    tracing::warn!(event_id = %event.id, order_id = %event.order_id, "a different event already invoiced this order");
                    ServiceError::new(
                        axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                        "order_already_invoiced",
                        "another event already invoiced this order; nothing was committed",
                    )
                } else {
                    ServiceError::from(e)
                }
            })?;
        Ok(if inserted == 1 {
            Recorded::Invoiced
        } else {
            Recorded::Duplicate
        })
    }

    /// Records a batch's `events` (distinct ids, [`crate::batch::parse`])
    /// in one transaction: `Ok(new)`, how many were new (inbox row and
    /// invoice committed; the rest were seen before and changed nothing),
    /// or `Err(culprits)`, the indexes of the events that name an order
    /// another event already invoiced (before, or earlier in this batch),
    /// all of them at once: then nothing was committed, and the caller
    /// records the others without them.
    pub async fn record_batch(
        &self,
        events: &[&OrderCreated],
    ) -> Result<Result<u64, Vec<usize>>, ServiceError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(RECORD_BATCH).await?;
        let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
        let invoice_ids: Vec<Uuid> = events.iter().map(|_| Uuid::new_v4()).collect();
        let orders: Vec<Uuid> = events.iter().map(|e| e.order_id).collect();
        let amounts: Vec<i64> = events.iter().map(|e| e.amount_cents).collect();
        let currencies: Vec<&str> = events.iter().map(|e| e.currency.as_str()).collect();
        let result = client
            .execute(
                &statement,
                &[
                    &ids,
                    &invoice_ids,
                    &orders,
                    &amounts,
                    &currencies,
                    &self.charge_status,
                ],
            )
            .await;
        let e = match result {
            Ok(new) => return Ok(Ok(new)),
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => e,
            Err(e) => return Err(e.into()),
        };
        // Every event not seen before whose order is invoiced now, or
        // named by an earlier new event of the batch (the first in array
        // order keeps it): refusing them all at once takes one more
        // statement, not one per event.
        let seen: HashSet<Uuid> = client
            .query(SEEN, &[&ids])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut invoiced: HashSet<Uuid> = client
            .query(INVOICED, &[&orders])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let culprits: Vec<usize> = events
            .iter()
            .enumerate()
            .filter(|(_, ev)| !seen.contains(&ev.id) && !invoiced.insert(ev.order_id))
            .map(|(i, _)| i)
            .collect();
        if culprits.is_empty() {
            // The invoice that conflicted is gone again: a retry decides.
            return Err(e.into());
        }
        Ok(Err(culprits))
    }

    /// Invoices of `order_id` (zero or one, by the UNIQUE constraint).
    pub async fn invoices_for(&self, order_id: Uuid) -> Result<Vec<Invoice>, ServiceError> {
        let client = self.pool.get().await?;
        let select = client.prepare_cached(SELECT_INVOICES).await?;
        let rows = client.query(&select, &[&order_id]).await?;
        Ok(rows
            .iter()
            .map(|row| Invoice {
                invoice_id: row.get(0),
                order_id: row.get(1),
                amount_cents: row.get(2),
                currency: row.get(3),
                created_at: row.get(4),
                charge_status: row.get(5),
                charge_id: row.get(6),
                charge_error: row.get(7),
                charge_attempts: row.get(8),
            })
            .collect())
    }
}
