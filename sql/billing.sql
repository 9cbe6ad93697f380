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
-- Every statement is guarded (IF NOT EXISTS, or a check of the catalog):
-- running the file again changes nothing.

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

-- The charge of each invoice at the payment provider (services/README.md,
-- "Effects outside the database"): an effect outside this database, so it
-- cannot commit with the invoice. Its state machine lives on the invoice:
--
--   none      nothing to charge: Billing runs without --payments-url, and
--             every invoice from before this column existed
--   pending   created so, in the inbox transaction, when Billing charges
--   charging  an attempt was claimed (charge_attempts counts them) and may
--             have reached the provider; resumed at charge_next_at with the
--             same Idempotency-Key (derived from the invoice id), so the
--             provider answers a charge it made with that charge instead of
--             making a second one
--   charged   the provider's charge id is in charge_id
--   failed    the provider refused for good (charge_error says why), or no
--             definite answer came within --charge-retry-window
--
-- Added after 0.2.0; re-runnable. Billing's role may update these columns
-- only (roles.sql).
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_status text NOT NULL DEFAULT 'none'
    CHECK (charge_status IN ('none', 'pending', 'charging', 'charged', 'failed'));
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_attempts integer NOT NULL DEFAULT 0
    CHECK (charge_attempts >= 0);
-- When a pending or charging invoice is due (again): an attempt's claim
-- moves it past the request's timeout plus the backoff, so a Billing that
-- dies mid-attempt leaves the invoice to be resumed then.
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_next_at timestamptz;
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_id text;
-- Why it failed (failed), or the last attempt's error (charging).
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_error text;
ALTER TABLE invoices ADD COLUMN IF NOT EXISTS charge_updated_at timestamptz;

DO $charged_has_id$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'public.invoices'::regclass
                     AND conname = 'invoices_charged_has_charge_id') THEN
        ALTER TABLE invoices ADD CONSTRAINT invoices_charged_has_charge_id
            CHECK ((charge_status = 'charged') = (charge_id IS NOT NULL));
    END IF;
END
$charged_has_id$;

-- What the charge worker scans: the invoices still to charge, by due time.
CREATE INDEX IF NOT EXISTS invoices_charge_due_idx ON invoices (charge_next_at)
    WHERE charge_status IN ('pending', 'charging');
