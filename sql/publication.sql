-- publication.sql: the publication the relay's replication slot reads.
--
-- Publishes INSERTs on public.outbox and nothing else: updates by a polling
-- relay, deletes by a cleanup job and truncates never reach the stream.
--
-- How to apply: in the orders database, after orders.sql, as a superuser or
-- the owner of public.outbox (creating a publication needs both CREATE on the
-- database and ownership of the table, which the relay's role deliberately
-- lacks):
--
--   psql -v ON_ERROR_STOP=1 -d orders -f sql/publication.sql
--
-- Re-runnable: it creates the publication when missing and otherwise brings
-- it back to this definition (insert-only, containing public.outbox).
DO $publication$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'cdc_relay_outbox') THEN
        CREATE PUBLICATION cdc_relay_outbox FOR TABLE public.outbox WITH (publish = 'insert');
        RETURN;
    END IF;

    IF EXISTS (
        SELECT 1 FROM pg_publication
        WHERE pubname = 'cdc_relay_outbox'
          AND (NOT pubinsert OR pubupdate OR pubdelete OR pubtruncate)
    ) THEN
        ALTER PUBLICATION cdc_relay_outbox SET (publish = 'insert');
    END IF;

    IF NOT EXISTS (
        SELECT 1 FROM pg_publication_tables
        WHERE pubname = 'cdc_relay_outbox' AND schemaname = 'public' AND tablename = 'outbox'
    ) THEN
        ALTER PUBLICATION cdc_relay_outbox ADD TABLE public.outbox;
    END IF;
END
$publication$;
