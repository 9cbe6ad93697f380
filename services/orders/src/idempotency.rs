//! `Idempotency-Key` on `POST /orders` (issue 18, item 7), after the IETF
//! HTTPAPI draft "The Idempotency-Key HTTP Header Field".
//!
//! A client that retries a `POST /orders` (a timeout, a reset connection)
//! sends the same `Idempotency-Key` each time. The key is stored with the
//! order, in the order's own transaction, under the unique constraint
//! `(scope, key)` of `order_idempotency_keys`; so:
//!
//! - a repeat (same key, same body) gets the original status and ids, and
//!   `Idempotent-Replayed: true`; no second order, no second event;
//! - the same key with a different body gets 422 `idempotency_key_reused`;
//! - two identical requests at once: both insert their order, the second's
//!   key insert waits for the first transaction, sees its key, rolls back
//!   and answers as a repeat. One order is committed.
//! - a key expires after `--idempotency-key-ttl` (default 24 h): later, the
//!   same key makes a new order (the row is taken over).
//!
//! The scope is the endpoint (`POST /orders`): Orders has no client
//! identity to scope by. Parsing the header and fingerprinting the body is
//! `service_common::idempotency`'s, shared with the Payments service.

pub use service_common::idempotency::{IdempotencyKey, REPLAYED_HEADER, in_progress};

/// The scope every key of `POST /orders` is stored under.
pub const SCOPE: &str = "POST /orders";

/// 422: the key was used with another body.
pub fn reused() -> service_common::ServiceError {
    service_common::idempotency::reused("order")
}
