-- roles.sql: least-privilege login roles for the Orders app, the Billing app,
-- the example payment provider and the relay.
--
--   orders_app   SELECT, INSERT on orders and outbox (the Orders service never
--                updates or deletes them); SELECT, INSERT, UPDATE on
--                order_idempotency_keys (an expired key is taken over).
--   billing_app  SELECT, INSERT on processed_events and invoices (the inbox
--                insert uses ON CONFLICT DO NOTHING ... RETURNING, which needs
--                SELECT; nothing deletes); UPDATE on the invoices' charge_*
--                columns only (the charge's state machine), when they exist.
--   payments_app SELECT, INSERT on charges (never updated or deleted);
--                SELECT, INSERT, UPDATE on charge_idempotency_keys (an
--                expired key is taken over).
--   cdc_relay    LOGIN REPLICATION: streams the publication through a logical
--                slot; SELECT, INSERT, UPDATE, DELETE on its dead-letter table,
--                INSERT on the audit table, SELECT on outbox for `backfill`,
--                SELECT, INSERT, UPDATE on its progress record; SELECT,
--                INSERT, DELETE on its prune marks (DELETE on outbox is NOT
--                granted: `run --prune-older-than` needs an explicit
--                GRANT DELETE ON outbox TO cdc_relay, which this file
--                then keeps); member of
--                pg_read_all_stats (its watchdog reads the walsender's
--                reply time; that role also shows other sessions' queries
--                in pg_stat_activity: revoke it if that is not acceptable).
--
-- None of them is a superuser, owns a database or a table, can create roles,
-- databases, schema objects, temporary tables or large objects, can connect
-- to the maintenance databases (postgres, template1), or has a password set
-- by this file.
--
-- How to apply: in EACH application database, after that database's schema
-- file (orders.sql + publication.sql, billing.sql, or payments.sql), as a
-- superuser:
--
--   psql -v ON_ERROR_STOP=1 -d orders   -f sql/roles.sql
--   psql -v ON_ERROR_STOP=1 -d billing  -f sql/roles.sql
--   psql -v ON_ERROR_STOP=1 -d payments -f sql/roles.sql
--
-- then set the passwords (the roles are cluster-wide; do it once):
--
--   ALTER ROLE orders_app  PASSWORD '...';
--   ALTER ROLE billing_app PASSWORD '...';
--   ALTER ROLE payments_app PASSWORD '...';
--   ALTER ROLE cdc_relay   PASSWORD '...';
--
-- Grants depend on which tables exist in the current database, so the same
-- file fits every database; a database holding none of them is left alone.
-- In a database it does touch, CONNECT is revoked from PUBLIC and granted
-- only to the roles whose tables live there. Re-runnable: the file converges
-- the privileges to exactly these, whatever was granted before.

-- Roles are cluster-wide. Two sessions running this file at once may both
-- try to create a role: the loser sees duplicate_object or unique_violation.
DO $roles$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT * FROM (VALUES ('orders_app', false),
                              ('billing_app', false),
                              ('payments_app', false),
                              ('cdc_relay', true)) AS wanted (name, replication)
    LOOP
        BEGIN
            EXECUTE format('CREATE ROLE %I', r.name);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;

        -- ALTER only when something differs: concurrent ALTERs of one role
        -- fail with "tuple concurrently updated".
        IF EXISTS (
            SELECT 1 FROM pg_roles
            WHERE rolname = r.name
              AND (rolsuper OR rolcreatedb OR rolcreaterole OR rolbypassrls
                   OR NOT rolcanlogin OR rolreplication <> r.replication)
        ) THEN
            EXECUTE format(
                'ALTER ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS %s',
                r.name,
                CASE WHEN r.replication THEN 'REPLICATION' ELSE 'NOREPLICATION' END);
        END IF;
    END LOOP;

    -- The relay's stream watchdog reads pg_stat_replication.reply_time, which
    -- PostgreSQL shows only to members of pg_read_all_stats. Revoke it to opt
    -- out (REVOKE pg_read_all_stats FROM cdc_relay): the watchdog then only
    -- checks that a walsender holds the slot, and says so once in the log.
    IF NOT pg_has_role('cdc_relay', 'pg_read_all_stats', 'MEMBER') THEN
        GRANT pg_read_all_stats TO cdc_relay;
    END IF;
END
$roles$;

-- The maintenance databases (`postgres`, `template1`) accept every role by
-- default (CONNECT and TEMPORARY for PUBLIC): an app role could log in there
-- and create temporary tables. Nothing of ours uses them, so PUBLIC loses
-- both; superusers are unaffected, and a non-superuser that needs one (a
-- monitoring agent) gets an explicit GRANT CONNECT. Cluster-wide, like the
-- roles; re-runnable. One exception: cdc_relay keeps CONNECT (only) on
-- `postgres`: when a login to its own database waits behind a lock on a
-- system catalog there, it reads the lock's holder from `postgres`, to name
-- it (see docs/operations.md, troubleshooting).
-- Only when something is granted: the same row changed by two sessions at
-- once fails with "tuple concurrently updated" (every app database's run
-- of this file touches these two), so a clash is retried.
DO $maintenance$
DECLARE
    db      text;
    attempt integer;
BEGIN
    FOR db IN SELECT datname FROM pg_database WHERE datname IN ('postgres', 'template1') LOOP
        FOR attempt IN 1..10 LOOP
            EXIT WHEN NOT EXISTS (
                SELECT 1
                FROM pg_database d,
                     aclexplode(coalesce(d.datacl, acldefault('d', d.datdba))) a
                WHERE d.datname = db
                  AND (a.grantee = 0 OR a.grantee IN (SELECT oid FROM pg_roles
                       WHERE rolname IN ('orders_app', 'billing_app', 'payments_app', 'cdc_relay')))
                  AND NOT (db = 'postgres' AND a.privilege_type = 'CONNECT'
                           AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = 'cdc_relay')))
              AND (db <> 'postgres' OR has_database_privilege('cdc_relay', db, 'CONNECT'));
            BEGIN
                EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', db);
                EXECUTE format('REVOKE ALL ON DATABASE %I FROM orders_app, billing_app, payments_app, cdc_relay', db);
                IF db = 'postgres' THEN
                    GRANT CONNECT ON DATABASE postgres TO cdc_relay;
                END IF;
            EXCEPTION WHEN internal_error THEN
                PERFORM pg_sleep(0.05 * attempt);
            END;
        END LOOP;
    END LOOP;
END
$maintenance$;

DO $grants$
DECLARE
    db          text := current_database();
    has_orders  boolean := to_regclass('public.orders') IS NOT NULL
                           AND to_regclass('public.outbox') IS NOT NULL;
    has_billing boolean := to_regclass('public.processed_events') IS NOT NULL
                           AND to_regclass('public.invoices') IS NOT NULL;
    has_payments boolean := to_regclass('public.charges') IS NOT NULL
                           AND to_regclass('public.charge_idempotency_keys') IS NOT NULL;
    has_dlq     boolean := to_regclass('public.cdc_relay_dead_letter') IS NOT NULL
                           AND to_regclass('public.cdc_relay_dead_letter_audit') IS NOT NULL;
    owner_role  text;
    fn          record;
    relay_prunes boolean;
BEGIN
    IF NOT (has_orders OR has_billing OR has_payments) THEN
        RAISE NOTICE 'roles.sql: database % holds none of the orders, billing and payments schemas; only the roles were ensured', db;
        RETURN;
    END IF;

    -- An owner bypasses every grant below, so refuse rather than pretend.
    SELECT pg_get_userbyid(datdba) INTO owner_role FROM pg_database WHERE datname = db;
    IF owner_role IN ('orders_app', 'billing_app', 'payments_app', 'cdc_relay') THEN
        RAISE EXCEPTION 'database % is owned by %; run ALTER DATABASE % OWNER TO <an admin role> first',
            db, owner_role, db;
    END IF;
    SELECT pg_get_userbyid(c.relowner) INTO owner_role
    FROM pg_class c
    WHERE c.oid IN (SELECT to_regclass(t) FROM unnest(ARRAY[
              'public.orders', 'public.outbox', 'public.processed_events', 'public.invoices',
              'public.cdc_relay_dead_letter', 'public.cdc_relay_dead_letter_audit',
              'public.cdc_relay_progress', 'public.order_idempotency_keys',
              'public.cdc_relay_prune_mark', 'public.charges',
              'public.charge_idempotency_keys']) AS t)
      AND pg_get_userbyid(c.relowner) IN ('orders_app', 'billing_app', 'payments_app', 'cdc_relay')
    LIMIT 1;
    IF owner_role IS NOT NULL THEN
        RAISE EXCEPTION 'a table in database % is owned by %; apply the schema files as an admin role', db, owner_role;
    END IF;

    -- Nobody but the roles granted below connects, creates temporary tables
    -- or creates objects in schema public (the default before PostgreSQL 15).
    EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', db);
    EXECUTE format('REVOKE ALL ON DATABASE %I FROM orders_app, billing_app, payments_app, cdc_relay', db);
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;
    REVOKE ALL ON SCHEMA public FROM orders_app, billing_app, payments_app, cdc_relay;

    -- Large objects: none of the services uses them, and by default any role
    -- may create them (lo_creat, lo_create, lo_from_bytea, lo_import with
    -- the client-side API) and fill the database outside every table's
    -- grants. EXECUTE on a function is PUBLIC's, so it is revoked from
    -- PUBLIC, for every large-object function of this database (reading
    -- ones too: there is nothing to read). Superusers are unaffected.
    FOR fn IN
        SELECT p.oid::regprocedure AS sig
        FROM pg_proc p
        WHERE p.pronamespace = 'pg_catalog'::regnamespace
          AND (p.proname LIKE 'lo\_%' OR p.proname IN ('loread', 'lowrite'))
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', fn.sig);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM orders_app, billing_app, payments_app, cdc_relay', fn.sig);
    END LOOP;

    IF has_orders THEN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO orders_app, cdc_relay', db);
        GRANT USAGE ON SCHEMA public TO orders_app, cdc_relay;

        -- DELETE on the outbox is the relay's only by an explicit grant, for
        -- `run --prune-older-than`; once given, it is kept.
        relay_prunes := has_table_privilege('cdc_relay', 'public.outbox', 'DELETE');
        REVOKE ALL ON public.orders, public.outbox FROM orders_app, billing_app, cdc_relay;
        GRANT SELECT, INSERT ON public.orders, public.outbox TO orders_app;
        -- Streaming needs no table privilege; `cdc-relay backfill` re-reads
        -- outbox rows by time range, and that is the only reason for this.
        GRANT SELECT ON public.outbox TO cdc_relay;
        IF relay_prunes THEN
            GRANT DELETE ON public.outbox TO cdc_relay;
        END IF;
    END IF;

    IF has_orders AND to_regclass('public.order_idempotency_keys') IS NOT NULL THEN
        REVOKE ALL ON public.order_idempotency_keys FROM orders_app, billing_app, cdc_relay;
        -- UPDATE: a key past expires_at is taken over by the next order with it.
        GRANT SELECT, INSERT, UPDATE ON public.order_idempotency_keys TO orders_app;
    END IF;

    IF has_orders AND has_dlq THEN
        REVOKE ALL ON public.cdc_relay_dead_letter, public.cdc_relay_dead_letter_audit
            FROM orders_app, billing_app, cdc_relay;
        -- SELECT for `dead-letter list`, DELETE for replay and discard,
        -- UPDATE to record a replayed row's new refusal on it (a parked row
        -- refused when its endpoint resumes; before this grant the resume
        -- retried that write forever). It adds nothing DELETE and INSERT
        -- do not already allow.
        GRANT SELECT, INSERT, UPDATE, DELETE ON public.cdc_relay_dead_letter TO cdc_relay;
        GRANT INSERT ON public.cdc_relay_dead_letter_audit TO cdc_relay;
        EXECUTE format('GRANT USAGE, SELECT ON SEQUENCE %s, %s TO cdc_relay',
            pg_get_serial_sequence('public.cdc_relay_dead_letter', 'id'),
            pg_get_serial_sequence('public.cdc_relay_dead_letter_audit', 'id'));
    END IF;

    -- Failover slots (PostgreSQL 16+ has the function): while a standby's
    -- copy of the slot is temporary, the relay logs a running-xacts record so
    -- the copy can become persistent even when the primary is idle.
    IF has_orders AND to_regprocedure('pg_log_standby_snapshot()') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO cdc_relay;
    END IF;

    IF has_orders AND to_regclass('public.cdc_relay_prune_mark') IS NOT NULL THEN
        REVOKE ALL ON public.cdc_relay_prune_mark FROM orders_app, billing_app, cdc_relay;
        -- The relay records marks while it prunes (`run --prune-older-than`)
        -- and replaces its slot's rows when it creates the slot.
        GRANT SELECT, INSERT, DELETE ON public.cdc_relay_prune_mark TO cdc_relay;
    END IF;

    IF has_orders AND to_regclass('public.cdc_relay_progress') IS NOT NULL THEN
        REVOKE ALL ON public.cdc_relay_progress FROM orders_app, billing_app, cdc_relay;
        -- The relay upserts its own progress row.
        GRANT SELECT, INSERT, UPDATE ON public.cdc_relay_progress TO cdc_relay;
    END IF;

    IF has_billing THEN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO billing_app', db);
        GRANT USAGE ON SCHEMA public TO billing_app;

        REVOKE ALL ON public.processed_events, public.invoices FROM orders_app, billing_app, cdc_relay;
        GRANT SELECT, INSERT ON public.processed_events, public.invoices TO billing_app;
        -- The charge's state machine (services/README.md): Billing moves an
        -- invoice's charge_* columns and nothing else of it.
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = 'public.invoices'::regclass AND attname = 'charge_status'
                     AND NOT attisdropped) THEN
            GRANT UPDATE (charge_status, charge_attempts, charge_next_at, charge_id,
                          charge_error, charge_updated_at) ON public.invoices TO billing_app;
        END IF;
    END IF;

    IF has_payments THEN
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO payments_app', db);
        GRANT USAGE ON SCHEMA public TO payments_app;

        REVOKE ALL ON public.charges, public.charge_idempotency_keys
            FROM orders_app, billing_app, payments_app, cdc_relay;
        GRANT SELECT, INSERT ON public.charges TO payments_app;
        -- UPDATE: a key past expires_at is taken over by the next charge with it.
        GRANT SELECT, INSERT, UPDATE ON public.charge_idempotency_keys TO payments_app;
    END IF;
END
$grants$;
