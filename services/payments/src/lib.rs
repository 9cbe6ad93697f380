//! The Payments service: a small payment provider with the API shape real
//! providers have, so that Billing has an effect outside its database to
//! get right (`services/README.md#effects-outside-the-database`).
//!
//! ```text
//! POST /charges ─▶ faults::Faults::before (test hook: 503, nothing charged)
//!   {"amount_cents","currency","reference"} ─▶ charge::NewCharge::from_json (422 naming the field)
//!   Idempotency-Key (optional) ─▶ store::ChargeStore::create:
//!       BEGIN; INSERT charges; INSERT charge_idempotency_keys (the key, the body's
//!       fingerprint, the answer); COMMIT    — or, for a key stored already, its answer
//!   ─▶ faults::Faults::after (test hooks: exit, drop the connection, be slow)
//!   ─▶ 201 {"charge_id",...} | 402 charge_declined   (a replay: the same, Idempotent-Replayed: true)
//! GET /charges?reference= ─▶ store::ChargeStore::by_reference (what a merchant reconciles with)
//! ```
//!
//! The charge and its key commit in one transaction, so a key is never
//! stored without its charge nor a charge made under a key without the
//! key: a retry with the key finds the first answer or finds nothing and
//! charges. Without a key every request charges, as with real providers.

pub mod charge;
pub mod config;
pub mod faults;
pub mod routes;
pub mod store;

pub use config::PaymentsArgs;
pub use routes::router;
