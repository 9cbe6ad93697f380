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
-- it back to this definition (insert-only, containing public.outbox, through
-- its root when the table is partitioned).
DO $publication$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'cdc_relay_outbox') THEN
        IF EXISTS (SELECT 1 FROM pg_class WHERE oid = 'public.outbox'::regclass AND relkind = 'p') THEN
            CREATE PUBLICATION cdc_relay_outbox FOR TABLE public.outbox
                WITH (publish = 'insert', publish_via_partition_root = true);
        ELSE
            CREATE PUBLICATION cdc_relay_outbox FOR TABLE public.outbox WITH (publish = 'insert');
        END IF;
        RETURN;
    END IF;

    IF EXISTS (
        SELECT 1 FROM pg_publication
        WHERE pubname = 'cdc_relay_outbox'
          AND (NOT pubinsert OR pubupdate OR pubdelete OR pubtruncate)
    ) THEN
        ALTER PUBLICATION cdc_relay_outbox SET (publish = 'insert');
    END IF;

    -- A member already: listed, through its schema, or every table.
    IF NOT EXISTS (
        SELECT 1 FROM pg_publication p
        WHERE p.pubname = 'cdc_relay_outbox'
          AND (p.puballtables
               OR EXISTS (SELECT 1 FROM pg_publication_rel pr
                          WHERE pr.prpubid = p.oid AND pr.prrelid = 'public.outbox'::regclass)
               OR EXISTS (SELECT 1 FROM pg_publication_namespace pn
                          WHERE pn.pnpubid = p.oid AND pn.pnnspid = 'public'::regnamespace))
    ) THEN
        ALTER PUBLICATION cdc_relay_outbox ADD TABLE public.outbox;
    END IF;

    -- A partitioned outbox is read through its root: its partitions'
    -- inserts then stream as the table's.
    IF EXISTS (SELECT 1 FROM pg_class WHERE oid = 'public.outbox'::regclass AND relkind = 'p')
       AND EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'cdc_relay_outbox' AND NOT pubviaroot)
    THEN
        ALTER PUBLICATION cdc_relay_outbox SET (publish_via_partition_root = true);
    END IF;
END
$publication$;
