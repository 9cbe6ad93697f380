-- billing.sql: schema of the "billing" database.
--
-- The Billing service's inbox (`processed_events`) and its effect
-- (`invoices`). Both are written in one transaction: the inbox row first,
-- ON CONFLICT DO NOTHING, and the invoice only when that row was new.
--
-- How to apply (as a superuser or the database owner, never as an app role):
--
--   1. createdb billing
--   2. psql -v ON_ERROR_STOP=1 -d billing -f sql/billing.sql
--   3. psql -v ON_ERROR_STOP=1 -d billing -f sql/roles.sql     (after the tables exist)
--   4. psql -d billing -c "ALTER ROLE billing_app PASSWORD '...'"
--
-- Every statement is guarded (IF NOT EXISTS): running the file again changes nothing.

-- The inbox: one row per event id ever applied. A redelivery hits the primary
-- key and becomes a no-op.
CREATE TABLE IF NOT EXISTS processed_events (
    event_id     uuid PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);

-- The effect. `order_id` is UNIQUE as a second invariant (one invoice per
-- order), not as a replacement for the inbox.
CREATE TABLE IF NOT EXISTS invoices (
    id           uuid PRIMARY KEY,
    order_id     uuid NOT NULL UNIQUE,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    currency     char(3) NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
