//! The Orders service: `POST /orders` writes an order and its `OrderCreated`
//! outbox row in ONE transaction (`docs/architecture.md#data-flow`), so an
//! order without its event,
//! or an event without its order, is never visible.
//!
//! ```text
//! POST /orders ─▶ order::NewOrder::from_json ─▶ store::OrderStore::create
//!                  (422 naming the field)        BEGIN; INSERT orders; INSERT outbox; COMMIT
//!   (with Idempotency-Key: also INSERT order_idempotency_keys, or the stored answer)
//! GET /orders/{id} ─────────────────────────────▶ store::OrderStore::find
//! ```

pub mod config;
pub mod idempotency;
pub mod order;
pub mod routes;
pub mod store;

pub use config::OrdersArgs;
pub use routes::router;
