-- orders.sql: schema of the "orders" database.
--
-- Holds the Orders service's tables (`orders`, and `outbox`, the transactional
-- outbox the relay streams) and the two tables the relay owns for quarantined
-- events (`cdc_relay_dead_letter` and its audit trail).
--
-- How to apply (as a superuser or the database owner, never as an app role):
--
--   1. createdb orders
--   2. psql -v ON_ERROR_STOP=1 -d orders -f sql/orders.sql
--   3. psql -v ON_ERROR_STOP=1 -d orders -f sql/publication.sql
--   4. psql -v ON_ERROR_STOP=1 -d orders -f sql/roles.sql      (after the tables exist)
--   5. psql -d orders -c "ALTER ROLE orders_app PASSWORD '...'" (same for cdc_relay)
--
-- Billing lives in its own database: see billing.sql. Every statement here is
-- guarded (IF NOT EXISTS), so running the file again changes nothing.

-- The aggregate: one row per order, amounts in minor units (cents).
CREATE TABLE IF NOT EXISTS orders (
    id           uuid PRIMARY KEY,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    currency     char(3) NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- The outbox: written in the same transaction as the order. The relay only
-- reads the inserts through the publication; the polling columns (attempts,
-- claimed_by, lease_until, published_at) stay so that a polling relay works
-- against the same table unchanged.
CREATE TABLE IF NOT EXISTS outbox (
    id           uuid PRIMARY KEY,
    aggregate_id uuid NOT NULL REFERENCES orders (id),
    event_type   text NOT NULL,
    payload      jsonb NOT NULL,
    occurred_at  timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    attempts     integer NOT NULL DEFAULT 0,
    claimed_by   text,
    lease_until  timestamptz,
    published_at timestamptz
);

-- The W3C trace context of the request that wrote the row: its
-- `traceparent`, then one space and its `tracestate` when it has one. The
-- relay carries it to the endpoint on every attempt (and makes each
-- attempt a span of that trace), so one trace follows the order from the
-- Orders request to Billing's inbox. NULL: delivered untraced. Added after
-- 0.2.0; re-runnable.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS trace_context text;

-- What a polling relay scans: unpublished rows that are due, oldest first.
CREATE INDEX IF NOT EXISTS outbox_ready_idx
    ON outbox (available_at, occurred_at)
    WHERE published_at IS NULL;

-- Deleting or re-keying an order checks the outbox rows that reference it;
-- without this index that check (and any per-aggregate cleanup) is a full scan.
CREATE INDEX IF NOT EXISTS outbox_aggregate_id_idx
    ON outbox (aggregate_id);

-- Events the relay quarantined instead of delivering (a poison response such
-- as 400 or 422). A row here counts as "done" for the slot's confirmed LSN, so
-- the table is the only copy of the event outside the outbox: it keeps the
-- payload verbatim and everything needed to replay or explain it.
CREATE TABLE IF NOT EXISTS cdc_relay_dead_letter (
    id               bigserial PRIMARY KEY,
    -- outbox id column, as text so configurable id types fit; NULL when the
    -- row itself was unreadable (a NULL id is one reason to quarantine it).
    event_id         text,
    -- value of the configured aggregate-key column (ordering key), if any.
    aggregate_key    text,
    event_type       text,
    -- the payload's JSON text exactly as PostgreSQL emitted it.
    payload          text,
    -- LSNs of the transaction that inserted the event (pgoutput Begin/Commit);
    -- the end LSN is NULL when the event was dead-lettered before its Commit
    -- message arrived (events are dispatched as they stream). commit_lsn is
    -- NULL for a row `cdc-relay backfill` read from the table (no LSN known).
    commit_lsn       pg_lsn,
    end_lsn          pg_lsn,
    -- status of the last response; NULL when no response arrived.
    http_status      integer,
    error            text NOT NULL,
    -- first bytes of the last response body, for the operator.
    response_excerpt text,
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    first_attempt_at timestamptz,
    last_attempt_at  timestamptz,
    quarantined_at   timestamptz NOT NULL DEFAULT now()
);

-- Upgrade from 0.1.0, where commit_lsn was NOT NULL (backfill wrote 0/0-based
-- row counters there). Re-runnable.
ALTER TABLE cdc_relay_dead_letter ALTER COLUMN commit_lsn DROP NOT NULL;
-- A payload whose bytes are not UTF-8 (possible in a SQL_ASCII database),
-- kept exactly; `payload` is NULL then. Added after 0.1.0.
ALTER TABLE cdc_relay_dead_letter ADD COLUMN IF NOT EXISTS payload_bytes bytea;
-- The routes file's endpoint (`run --routes`) that refused the event; NULL in
-- one-endpoint mode (`--sink-url`), for an unrouted event and for an
-- unreadable row. Added after 0.1.0; re-runnable.
ALTER TABLE cdc_relay_dead_letter ADD COLUMN IF NOT EXISTS endpoint text;

-- The event's trace context (as outbox.trace_context), so that a replay
-- continues the event's trace. Added after 0.2.0; re-runnable.
ALTER TABLE cdc_relay_dead_letter ADD COLUMN IF NOT EXISTS trace_context text;

-- Who removed what from the dead-letter table, and when. A discard deletes
-- the quarantined row, so `entry` keeps a copy of it (as JSON).
CREATE TABLE IF NOT EXISTS cdc_relay_dead_letter_audit (
    id             bigserial PRIMARY KEY,
    action         text NOT NULL DEFAULT 'discard' CHECK (action IN ('discard', 'replay')),
    dead_letter_id bigint NOT NULL,
    event_id       text,
    entry          jsonb,
    reason         text,
    -- the operator's name when the CLI knows it, else the database role.
    performed_by   text NOT NULL DEFAULT session_user,
    performed_at   timestamptz NOT NULL DEFAULT now()
);

-- One dead letter per event and endpoint: the same event refused again (a
-- restart re-streaming it, a backfill over it, two writers at once) reuses
-- its row, so a replay sends it once. The unique index makes that hold for
-- concurrent writers too (the relay inserts ON CONFLICT DO NOTHING). A
-- database made before it may hold duplicates: the first run keeps each
-- event's oldest row and moves the others to the audit trail as discards
-- naming the row they duplicated, then builds the index, all in one
-- transaction under a lock that lets readers on. Added after 0.2.0;
-- re-runnable (a later run finds the index and does nothing).
DO $$
BEGIN
    IF to_regclass('cdc_relay_dead_letter_event_endpoint_key') IS NULL THEN
        LOCK TABLE cdc_relay_dead_letter IN SHARE ROW EXCLUSIVE MODE;
        WITH dup AS (
            SELECT id, first_value(id) OVER w AS kept, row_number() OVER w AS k
            FROM cdc_relay_dead_letter
            WHERE event_id IS NOT NULL
            WINDOW w AS (PARTITION BY event_id, coalesce(endpoint, '') ORDER BY id)),
        gone AS (
            DELETE FROM cdc_relay_dead_letter d USING dup
            WHERE d.id = dup.id AND dup.k > 1
            RETURNING d.id, d.event_id, to_jsonb(d) AS entry, dup.kept)
        INSERT INTO cdc_relay_dead_letter_audit (action, dead_letter_id, event_id, entry, reason)
        SELECT 'discard', id, event_id, entry,
               format('duplicate of dead letter %s (same event and endpoint), removed by sql/orders.sql', kept)
        FROM gone;
        CREATE UNIQUE INDEX IF NOT EXISTS cdc_relay_dead_letter_event_endpoint_key
            ON cdc_relay_dead_letter (event_id, (coalesce(endpoint, '')))
            WHERE event_id IS NOT NULL;
    END IF;
END
$$;

-- The unique index leads with event_id, so it serves every lookup by event
-- id; the plain index on event_id that earlier versions made only cost
-- each dead-letter insert one more B-tree entry at a random place (and,
-- after every checkpoint, a full-page image for each page first touched: a
-- parked endpoint writes hundreds of rows a second). Re-runnable.
DROP INDEX IF EXISTS cdc_relay_dead_letter_event_id_idx;

-- Where each slot's relay got to, written by the relay itself at most every
-- few seconds while it delivers (never while idle): the end LSN it confirmed,
-- and the commit time and id of the last event of the last fully delivered
-- transaction. Physical replication carries it to the standbys, so after a
-- failover it says where a backfill must start (`run
-- --on-slot-loss=recreate-and-backfill`), and it witnesses which relay
-- progressed. It also keeps the outbox's publication membership as last
-- verified (written only when it changes), so a membership change made while
-- no relay watched is noticed at the next start. Added after 0.1.0.
CREATE TABLE IF NOT EXISTS cdc_relay_progress (
    slot_name     text PRIMARY KEY,
    confirmed_lsn pg_lsn NOT NULL,
    commit_time   timestamptz,
    last_event_id text,
    -- the relay's application_name (host:pid by default)
    holder        text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    -- the publications carrying the outbox (identity tokens), the outbox's
    -- relation OID, and when that membership was first verified
    membership_carriers  text[],
    membership_table_oid oid,
    membership_at        timestamptz
);
-- A publication gap the relay found under `--on-gap tell` and that no
-- backfill has covered yet: rows inserted between these times were never
-- streamed. `/readyz` and `status` report it until a complete `cdc-relay
-- backfill` whose window covers it clears both. Added after 0.3.0.
ALTER TABLE cdc_relay_progress ADD COLUMN IF NOT EXISTS gap_owed_since timestamptz;
ALTER TABLE cdc_relay_progress ADD COLUMN IF NOT EXISTS gap_owed_until timestamptz;

-- Prune marks (`cdc-relay prune`, `run --prune-older-than`): the proof that
-- outbox rows were delivered before they are deleted. A `mark` row is taken
-- in one statement: `xid_horizon` is the oldest transaction of this
-- database still running in that statement's snapshot (every older one had
-- finished, its commit record written) and `wal_lsn` the WAL insert
-- position read after it. Once the slot's confirmed_flush_lsn reaches `wal_lsn`, every row
-- whose inserting transaction precedes `xid_horizon` was streamed and done
-- (delivered or dead-lettered). The `birth` row is written when the relay
-- or `setup` creates the slot: `xid_horizon` is then the next transaction
-- id, so rows of older transactions (never streamed by this slot) are not
-- proven by it. Creating the slot again replaces every row of the slot.
-- Added after 0.2.0.
CREATE TABLE IF NOT EXISTS cdc_relay_prune_mark (
    slot_name   text NOT NULL,
    kind        text NOT NULL DEFAULT 'mark' CHECK (kind IN ('mark', 'birth')),
    wal_lsn     pg_lsn NOT NULL,
    xid_horizon xid8 NOT NULL,
    taken_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot_name, kind, wal_lsn)
);

-- Idempotency keys of `POST /orders` (the Orders service's
-- `Idempotency-Key` header): one row per (scope, key), written in the
-- order's own transaction, so a retried request finds the original order
-- instead of creating a second one. `fingerprint` is the SHA-256 of the
-- request body's canonical JSON (the same key with another body is
-- refused); `status` the original answer's. A row is authoritative until
-- `expires_at`; after that the same key makes a new order and takes the row
-- over. Expired rows are otherwise kept: delete them as an admin when you
-- like (`DELETE FROM order_idempotency_keys WHERE expires_at < now()`).
-- Added after 0.1.0.
CREATE TABLE IF NOT EXISTS order_idempotency_keys (
    scope       text NOT NULL,
    key         text NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    fingerprint bytea NOT NULL,
    order_id    uuid NOT NULL REFERENCES orders (id),
    event_id    uuid NOT NULL,
    status      smallint NOT NULL CHECK (status BETWEEN 200 AND 299),
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS order_idempotency_keys_expires_at_idx
    ON order_idempotency_keys (expires_at);
