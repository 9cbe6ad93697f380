//! SQL of the Orders service.
//!
//! `create` is the transactional-outbox write: BEGIN, the order, its
//! `OrderCreated` outbox row, COMMIT. The two inserts are pipelined (sent
//! together, answered together: one round trip); PostgreSQL runs them in
//! order, so the outbox foreign-key check sees the order. Any error drops the
//! transaction, which tokio-postgres rolls back, and maps to 500: nothing is
//! committed. Statements are prepared once per pooled connection.
//!
//! With an `Idempotency-Key` (see [`crate::idempotency`]) a third insert,
//! of the key, joins the same pipeline. When it finds the key already
//! stored (and not expired) it returns no row: the transaction is rolled
//! back and the stored answer is read instead.

use service_common::pool::Pool;
use std::time::Duration;

use deadpool_postgres::tokio_postgres::error::SqlState;
use deadpool_postgres::tokio_postgres::types::ToSql;
use serde::Serialize;
use service_common::ServiceError;
use uuid::Uuid;

use crate::idempotency::{self, IdempotencyKey};
use crate::order::NewOrder;
use trace_context::SpanContext;

const INSERT_ORDER: &str = "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, $2, $3)";
/// The row's `trace_context` (sql/orders.sql) is the request span's W3C
/// context, or NULL.
const INSERT_EVENT: &str = "INSERT INTO outbox (id, aggregate_id, event_type, payload, trace_context) \
                            VALUES ($1, $2, 'OrderCreated', $3, $4)";
/// Claims the key for this order; no row when an unexpired claim exists
/// (after waiting for a concurrent one to commit or roll back). An expired
/// claim is taken over.
const CLAIM_KEY: &str = "INSERT INTO order_idempotency_keys AS k \
                         (scope, key, fingerprint, order_id, event_id, status, expires_at) \
                         VALUES ($1, $2, $3, $4, $5, 201, now() + make_interval(secs => $6)) \
                         ON CONFLICT (scope, key) DO UPDATE SET \
                         fingerprint = EXCLUDED.fingerprint, order_id = EXCLUDED.order_id, \
                         event_id = EXCLUDED.event_id, status = EXCLUDED.status, \
                         created_at = now(), expires_at = EXCLUDED.expires_at \
                         WHERE k.expires_at <= now() \
                         RETURNING k.order_id";
const SELECT_KEY: &str = "SELECT fingerprint, order_id, event_id, status \
                          FROM order_idempotency_keys WHERE scope = $1 AND key = $2";
const SELECT_ORDER: &str = "SELECT id, amount_cents, currency, \
                            to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
                            FROM orders WHERE id = $1";

/// Ids of a committed order and its outbox event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CreatedOrder {
    /// `orders.id`, also the event's `aggregate_id`.
    pub order_id: Uuid,
    /// `outbox.id`: the id Billing deduplicates on.
    pub event_id: Uuid,
}

/// What `POST /orders` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A new order was committed (201).
    Created(CreatedOrder),
    /// The `Idempotency-Key` was already stored with the same body: the
    /// original answer (its status and ids); nothing was committed now.
    Replayed {
        /// The ids of the original order.
        order: CreatedOrder,
        /// The original status.
        status: u16,
    },
}

/// An order as `GET /orders/{id}` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Order {
    /// `orders.id`.
    pub order_id: Uuid,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Currency code.
    pub currency: String,
    /// Creation time, RFC 3339 in UTC with microseconds.
    pub created_at: String,
}

/// Orders persistence over a pool.
#[derive(Clone)]
pub struct OrderStore {
    pool: Pool,
    fault_after_order_insert: bool,
    key_ttl: Duration,
}

impl OrderStore {
    /// A store; `fault_after_order_insert` is the test hook of
    /// [`crate::OrdersArgs::fault_after_order_insert`], `key_ttl` how long
    /// an idempotency key is kept.
    pub fn new(pool: Pool, fault_after_order_insert: bool, key_ttl: Duration) -> Self {
        Self {
            pool,
            fault_after_order_insert,
            key_ttl,
        }
    }

    /// Commits the order and its outbox row together, or neither; with a
    /// `key`, also the key, unless it is stored already: then the stored
    /// answer (or 422 when it was stored with another body). `trace` goes
    /// into the outbox row's `trace_context`.
    pub async fn create(
        &self,
        order: &NewOrder,
        key: Option<&IdempotencyKey>,
        trace: Option<&SpanContext>,
    ) -> Result<Outcome, ServiceError> {
        let created = CreatedOrder {
            order_id: Uuid::new_v4(),
            event_id: Uuid::new_v4(),
        };
        let payload = order.event_payload(created.order_id);
        let mut client = self.pool.get().await?;
        let (insert_order, insert_event) = tokio::try_join!(
            client.prepare_cached(INSERT_ORDER),
            client.prepare_cached(INSERT_EVENT)
        )?;
        let claim = match key {
            Some(_) => Some(client.prepare_cached(CLAIM_KEY).await?),
            None => None,
        };
        let tx = client.transaction().await?;
        let order_params: [&(dyn ToSql + Sync); 3] =
            [&created.order_id, &order.amount_cents, &order.currency];
        let trace_context = trace.and_then(trace_context::stored::format);
        let event_params: [&(dyn ToSql + Sync); 4] = [
            &created.event_id,
            &created.order_id,
            &payload,
            &trace_context,
        ];
        let order_row = tx.execute(&insert_order, &order_params);
        if self.fault_after_order_insert {
            order_row.await?;
            tracing::warn!("test hook: failing between the order and outbox inserts");
            return Err(ServiceError::internal());
        }
        let event_row = tx.execute(&insert_event, &event_params);
        // Pipelined, but the first failure is the one to report: after it
        // the statements behind it only say the transaction is aborted
        // (25P02), and `try_join!` returns whichever error it polls first.
        let (Some(key), Some(claim)) = (key, claim) else {
            let (order_done, event_done) = tokio::join!(order_row, event_row);
            order_done?;
            event_done?;
            tx.commit().await?;
            return Ok(Outcome::Created(created));
        };
        let ttl_secs = self.key_ttl.as_secs_f64();
        let claim_params: [&(dyn ToSql + Sync); 6] = [
            &idempotency::SCOPE,
            &key.key,
            &key.fingerprint,
            &created.order_id,
            &created.event_id,
            &ttl_secs,
        ];
        let claimed = tx.query_opt(&claim, &claim_params);
        let (order_done, event_done, claimed) = tokio::join!(order_row, event_row, claimed);
        let claimed = order_done.and(event_done).and(claimed).map_err(|e| {
            // The key's row is locked by a transaction that outlived
            // lock_timeout: the original request is still running.
            if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                tracing::warn!("Idempotency-Key still held by another request past lock_timeout");
                idempotency::in_progress()
            } else {
                ServiceError::from(e)
            }
        })?;
        if claimed.is_some() {
            tx.commit().await?;
            return Ok(Outcome::Created(created));
        }
        // Stored already: answer as the first time, commit nothing.
        let key_params: [&(dyn ToSql + Sync); 2] = [&idempotency::SCOPE, &key.key];
        let stored = tx.query_opt(SELECT_KEY, &key_params).await?;
        drop(tx);
        let Some(row) = stored else {
            return Err(idempotency::in_progress());
        };
        let fingerprint: Vec<u8> = row.get(0);
        if fingerprint != key.fingerprint {
            return Err(idempotency::reused());
        }
        let status: i16 = row.get(3);
        Ok(Outcome::Replayed {
            order: CreatedOrder {
                order_id: row.get(1),
                event_id: row.get(2),
            },
            status: u16::try_from(status).unwrap_or(201),
        })
    }

    /// The order with `id`, if any.
    pub async fn find(&self, id: Uuid) -> Result<Option<Order>, ServiceError> {
        let client = self.pool.get().await?;
        let select = client.prepare_cached(SELECT_ORDER).await?;
        let row = client.query_opt(&select, &[&id]).await?;
        Ok(row.map(|row| Order {
            order_id: row.get(0),
            amount_cents: row.get(1),
            currency: row.get(2),
            created_at: row.get(3),
        }))
    }
}
