//! SQL of the Payments service.
//!
//! `create` charges once per key. With an `Idempotency-Key`: BEGIN, the
//! charge (none for a decline), the key with the request's fingerprint and
//! the answer, COMMIT, pipelined as one round trip. The key insert finds an
//! unexpired key already stored (after waiting for a concurrent request
//! with it to commit or roll back) and returns no row: the transaction is
//! rolled back, charge included, and the stored answer is read instead. An
//! expired key is taken over (its old charge stays). Without a key the
//! charge is one statement: every request charges.

use std::time::Duration;

use axum::http::StatusCode;
use deadpool_postgres::tokio_postgres::error::SqlState;
use deadpool_postgres::tokio_postgres::types::ToSql;
use serde::Serialize;
use serde_json::Value;
use service_common::ServiceError;
use service_common::idempotency::{self, IdempotencyKey};
use service_common::pool::Pool;
use uuid::Uuid;

use crate::charge::{Answer, NewCharge};

const INSERT_CHARGE: &str =
    "INSERT INTO charges (id, reference, amount_cents, currency) VALUES ($1, $2, $3, $4)";
/// Claims the key for this answer; no row when an unexpired claim exists.
const CLAIM_KEY: &str = "INSERT INTO charge_idempotency_keys AS k \
     (key, fingerprint, status, response, charge_id, expires_at) \
     VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6)) \
     ON CONFLICT (key) DO UPDATE SET \
     fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status, \
     response = EXCLUDED.response, charge_id = EXCLUDED.charge_id, \
     created_at = now(), expires_at = EXCLUDED.expires_at \
     WHERE k.expires_at <= now() \
     RETURNING k.key";
const SELECT_KEY: &str =
    "SELECT fingerprint, status, response FROM charge_idempotency_keys WHERE key = $1";
const SELECT_BY_REFERENCE: &str = "SELECT id, amount_cents, currency, \
     to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
     FROM charges WHERE reference = $1 ORDER BY created_at, id";

/// What `create` did.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// This request decided: a new charge (or a decline) was committed.
    Fresh(Answer),
    /// The key was stored with the same body: the first answer; nothing
    /// was committed now.
    Replayed(Answer),
}

/// A charge as `GET /charges?reference=` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Charge {
    /// `charges.id`.
    pub charge_id: Uuid,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Currency code.
    pub currency: String,
    /// Creation time, RFC 3339 in UTC with microseconds.
    pub created_at: String,
}

/// Charges over a pool.
#[derive(Clone)]
pub struct ChargeStore {
    pool: Pool,
    key_ttl: Duration,
}

impl ChargeStore {
    /// A store keeping idempotency keys for `key_ttl`.
    pub fn new(pool: Pool, key_ttl: Duration) -> ChargeStore {
        ChargeStore { pool, key_ttl }
    }

    /// Commits `answer` for `charge` (with its charge row when the answer
    /// is a success, `charge_id` being its id) unless `key` is stored
    /// already: then the stored answer, or 422 `idempotency_key_reused`
    /// when it came with another body, or 409 `idempotency_key_in_progress`
    /// when the request holding it outlives `lock_timeout`.
    pub async fn create(
        &self,
        charge: &NewCharge,
        charge_id: Option<Uuid>,
        answer: Answer,
        key: Option<&IdempotencyKey>,
    ) -> Result<Outcome, ServiceError> {
        let mut client = self.pool.get().await?;
        let insert = client.prepare_cached(INSERT_CHARGE).await?;
        let charge_params: [&(dyn ToSql + Sync); 4] = [
            &charge_id,
            &charge.reference,
            &charge.amount_cents,
            &charge.currency,
        ];
        let Some(key) = key else {
            if charge_id.is_some() {
                client.execute(&insert, &charge_params).await?;
            }
            return Ok(Outcome::Fresh(answer));
        };
        let claim = client.prepare_cached(CLAIM_KEY).await?;
        let tx = client.transaction().await?;
        let status = i16::try_from(answer.status.as_u16()).unwrap_or(500);
        let ttl_secs = self.key_ttl.as_secs_f64();
        let claim_params: [&(dyn ToSql + Sync); 6] = [
            &key.key,
            &key.fingerprint,
            &status,
            &answer.body,
            &charge_id,
            &ttl_secs,
        ];
        // Pipelined; the first failure is the one to report (after it the
        // statements behind it only say the transaction is aborted).
        let claimed = match charge_id {
            Some(_) => {
                let (inserted, claimed) = tokio::join!(
                    tx.execute(&insert, &charge_params),
                    tx.query_opt(&claim, &claim_params)
                );
                inserted.and(claimed)
            }
            None => tx.query_opt(&claim, &claim_params).await,
        }
        .map_err(|e| {
            if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                tracing::warn!("Idempotency-Key still held by another request past lock_timeout");
                idempotency::in_progress()
            } else {
                ServiceError::from(e)
            }
        })?;
        if claimed.is_some() {
            tx.commit().await?;
            return Ok(Outcome::Fresh(answer));
        }
        let stored = tx.query_opt(SELECT_KEY, &[&key.key]).await?;
        drop(tx);
        let Some(row) = stored else {
            return Err(idempotency::in_progress());
        };
        let fingerprint: Vec<u8> = row.get(0);
        if fingerprint != key.fingerprint {
            return Err(idempotency::reused("charge"));
        }
        let status: i16 = row.get(1);
        let body: Value = row.get(2);
        Ok(Outcome::Replayed(Answer {
            status: u16::try_from(status)
                .ok()
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            body,
        }))
    }

    /// Every charge made for `reference`, oldest first.
    pub async fn by_reference(&self, reference: &str) -> Result<Vec<Charge>, ServiceError> {
        let client = self.pool.get().await?;
        let select = client.prepare_cached(SELECT_BY_REFERENCE).await?;
        let rows = client.query(&select, &[&reference]).await?;
        Ok(rows
            .iter()
            .map(|row| Charge {
                charge_id: row.get(0),
                amount_cents: row.get(1),
                currency: row.get(2),
                created_at: row.get(3),
            })
            .collect())
    }
}
