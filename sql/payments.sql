-- payments.sql: schema of the "payments" database, the example payment
-- provider's (services/payments). In a real deployment this database is the
-- provider's, not yours: it is here so that the demo and the tests have an
-- effect outside Billing's database to get right.
--
-- How to apply (as a superuser or the database owner, never as an app role):
--
--   1. createdb payments
--   2. psql -v ON_ERROR_STOP=1 -d payments -f sql/payments.sql
--   3. psql -v ON_ERROR_STOP=1 -d payments -f sql/roles.sql    (after the tables exist)
--   4. psql -d payments -c "ALTER ROLE payments_app PASSWORD '...'"
--
-- Every statement is guarded (IF NOT EXISTS): running the file again changes
-- nothing. Added after 0.2.0.

-- The effect: one row per charge made, i.e. per time money moved. Never
-- updated or deleted. `reference` is the merchant's id for what was paid
-- (Billing sends the invoice id); it is not unique, on purpose: a provider
-- charges what it is asked to, and only the idempotency key below makes a
-- retry safe.
CREATE TABLE IF NOT EXISTS charges (
    id           uuid PRIMARY KEY,
    reference    text NOT NULL CHECK (length(reference) BETWEEN 1 AND 255),
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    currency     char(3) NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS charges_reference_idx ON charges (reference);

-- The `Idempotency-Key` of each `POST /charges` that sent one, written in the
-- charge's own transaction: the request's fingerprint (SHA-256 of its
-- canonical JSON body; the same key with another body is refused) and the
-- answer given (201 with the charge, or 402 declined, which made no charge),
-- sent again to every retry until `expires_at` (`--idempotency-key-ttl`,
-- 24 h). After that the same key charges again and takes the row over.
-- Expired rows are otherwise kept: delete them when you like
-- (`DELETE FROM charge_idempotency_keys WHERE expires_at < now()`).
CREATE TABLE IF NOT EXISTS charge_idempotency_keys (
    key         text PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 255),
    fingerprint bytea NOT NULL,
    status      smallint NOT NULL CHECK (status BETWEEN 200 AND 499),
    response    jsonb NOT NULL,
    charge_id   uuid REFERENCES charges (id),
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS charge_idempotency_keys_expires_at_idx
    ON charge_idempotency_keys (expires_at);
