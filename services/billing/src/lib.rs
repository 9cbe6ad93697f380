//! The Billing service: an idempotent inbox for `OrderCreated` events
//! (`docs/architecture.md#data-flow`, `#wire-format`).
//!
//! ```text
//! POST /inbox ─▶ 415/413 ─▶ signature::Verifier::verify ─▶ parse ─▶ event::OrderCreated::from_json
//!                 (bytes)    (webhook-signature or           (400)    (422 naming the field; Idempotency-Key
//!                             X-Event-Signature over the              and webhook-id must equal the id)
//!                             exact bytes, before parsing: 401)
//!            ─▶ store::InboxStore::record: ONE statement, its own transaction:
//!               processed_events row ON CONFLICT DO NOTHING, invoice only if that row is new
//!            ─▶ 204 (new or replay)
//!          a JSON array body (a batch) ─▶ batch::parse (422 naming [i].<field>)
//!            ─▶ store::InboxStore::record_batch: ONE statement for every event
//!            ─▶ 204 (each id new or seen before)
//! GET /invoices?order_id= ─▶ store::InboxStore::invoices_for
//! ```
//!
//! Delivery is at-least-once; the inbox makes the effect exactly-once, and
//! `invoices.order_id UNIQUE` is a second invariant behind it.

pub mod batch;
pub mod charge;
pub mod config;
pub mod event;
pub mod routes;
pub mod signature;
pub mod store;

pub use config::BillingArgs;
pub use routes::router;
