//! SQL of the Orders service.
//!
//! `create` is the transactional-outbox write: BEGIN, the order, its
//! `OrderCreated` outbox row, COMMIT. The two inserts are pipelined (sent
//! together, answered together: one round trip); PostgreSQL runs them in
//! order, so the outbox foreign-key check sees the order. Any error drops the
//! transaction, which tokio-postgres rolls back, and maps to 500: nothing is
//! committed. Statements are prepared once per pooled connection.

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::types::ToSql;
use serde::Serialize;
use service_common::ServiceError;
use uuid::Uuid;

use crate::order::NewOrder;

const INSERT_ORDER: &str = "INSERT INTO orders (id, amount_cents, currency) VALUES ($1, $2, $3)";
const INSERT_EVENT: &str = "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
                            VALUES ($1, $2, 'OrderCreated', $3)";
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
}

impl OrderStore {
    /// A store; `fault_after_order_insert` is the test hook of
    /// [`crate::OrdersArgs::fault_after_order_insert`].
    pub fn new(pool: Pool, fault_after_order_insert: bool) -> Self {
        Self {
            pool,
            fault_after_order_insert,
        }
    }

    /// Commits the order and its outbox row together, or neither.
    pub async fn create(&self, order: &NewOrder) -> Result<CreatedOrder, ServiceError> {
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
        let tx = client.transaction().await?;
        let order_params: [&(dyn ToSql + Sync); 3] =
            [&created.order_id, &order.amount_cents, &order.currency];
        let event_params: [&(dyn ToSql + Sync); 3] =
            [&created.event_id, &created.order_id, &payload];
        let order_row = tx.execute(&insert_order, &order_params);
        if self.fault_after_order_insert {
            order_row.await?;
            tracing::warn!("test hook: failing between the order and outbox inserts");
            return Err(ServiceError::internal());
        }
        let event_row = tx.execute(&insert_event, &event_params);
        tokio::try_join!(order_row, event_row)?;
        tx.commit().await?;
        Ok(created)
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
