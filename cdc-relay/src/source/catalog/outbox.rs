//! The outbox table and its publications, as the catalog describes them.

use tokio_postgres::Client;

use super::super::error::SourceError;
use crate::outbox::{JSON_TYPES, OutboxColumns, TableName};

/// The outbox table as the catalog describes it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxTable {
    /// Its relation OID: what the stream's Relation messages identify it by.
    pub oid: u32,
    /// `r` (table) or `p` (partitioned).
    pub relkind: String,
    /// `relreplident`: `d` default (primary key), `n` nothing, `f` full,
    /// `i` index.
    pub replica_identity: String,
    /// Whether it has a primary key (what `d` needs to identify rows).
    pub has_primary_key: bool,
    /// Its columns as pgoutput describes them: name and type OID in attnum
    /// order, dropped and generated columns left out.
    pub columns: Vec<(String, u32)>,
    /// No column of it was ever dropped (`pg_attribute` keeps a dropped
    /// column for good): every column it ever had is in `columns`, in the
    /// order they were added.
    pub never_dropped: bool,
}

/// Type OIDs a trace context column may have (`pg_type.dat`): `text`,
/// `varchar`, `bpchar`.
const TEXT_TYPES: [u32; 3] = [25, 1043, 1042];

/// Checks that `table` exists, has every configured column, and that the
/// payload column is `json` or `jsonb` (or a domain over one); returns what the relay needs to
/// know about it. Errors name the flag to fix; a missing table or column is
/// [`SourceError::NeedsSetup`], a payload of another type
/// [`SourceError::PayloadType`].
pub async fn check_outbox_table(
    client: &Client,
    t: &TableName,
    c: &OutboxColumns,
) -> Result<OutboxTable, SourceError> {
    let row = client
        .query_opt(
            "SELECT c.oid, c.relkind::text, c.relreplident::text, \
                    EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), \
                    NOT EXISTS (SELECT 1 FROM pg_attribute a \
                                WHERE a.attrelid = c.oid AND a.attnum > 0 AND a.attisdropped), \
                    (SELECT format('%I.%I', rn.nspname, rc.relname) \
                     FROM pg_class rc JOIN pg_namespace rn ON rn.oid = rc.relnamespace \
                     WHERE c.relispartition AND rc.oid = pg_partition_root(c.oid)) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("looking up the outbox table", &e))?;
    let Some(row) = row else {
        return Err(SourceError::NeedsSetup(format!(
            "table {t} does not exist (--table / CDC_RELAY_TABLE); create it first (e.g. sql/orders.sql), or set --table if it was renamed"
        )));
    };
    // A partitioned outbox is read through its root: a partition is no
    // outbox of its own (its rows stream as the root's).
    if let Some(root) = row.get::<_, Option<String>>(5) {
        return Err(SourceError::NeedsSetup(format!(
            "table {t} is a partition of {root}: the relay reads a partitioned outbox through its root; set --table (CDC_RELAY_TABLE) to {root}"
        )));
    }
    let table = OutboxTable {
        oid: row.get(0),
        relkind: row.get(1),
        replica_identity: row.get(2),
        has_primary_key: row.get(3),
        columns: Vec::new(),
        never_dropped: row.get(4),
    };
    let rows = client
        .query(
            // The type, or for a domain the type it is built on (domains
            // over domains followed to the base): a domain over jsonb has
            // jsonb's text.
            "SELECT a.attname::text, \
                    (WITH RECURSIVE d(oid, base) AS ( \
                         SELECT t.oid, t.typbasetype FROM pg_type t WHERE t.oid = a.atttypid \
                         UNION ALL \
                         SELECT t.oid, t.typbasetype FROM pg_type t JOIN d ON t.oid = d.base) \
                     SELECT oid FROM d WHERE base = 0), \
                    format_type(a.atttypid, a.atttypmod), a.atttypid, a.attgenerated = '' \
             FROM pg_attribute a \
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            &[&table.oid],
        )
        .await
        .map_err(|e| SourceError::sql("reading the outbox columns", &e))?;
    let cols: Vec<(String, u32, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    if let Some((_, oid, type_name)) = cols.iter().find(|(name, ..)| *name == c.payload)
        && !JSON_TYPES.contains(oid)
    {
        return Err(SourceError::PayloadType(payload_type_message(
            t, &c.payload, type_name,
        )));
    }
    // The trace context is text (a traceparent, a space, a tracestate); a
    // value of another type would arrive quoted and never parse.
    if let Some(trace) = c.trace.as_ref().filter(|trace| trace.required)
        && let Some((_, _, type_name)) = cols
            .iter()
            .find(|(name, oid, _)| *name == trace.name && !TEXT_TYPES.contains(oid))
    {
        return Err(SourceError::NeedsSetup(format!(
            "the trace context column {t}.{} (--trace-column) has type {type_name}; it must be text or varchar \
             (a traceparent, then a space and a tracestate): point --trace-column at such a column",
            trace.name
        )));
    }
    let mut table = table;
    table.columns = rows
        .iter()
        .filter(|r| r.get::<_, bool>(4))
        .map(|r| (r.get(0), r.get(3)))
        .collect();
    let cols: Vec<String> = cols.into_iter().map(|(name, ..)| name).collect();
    let mut wanted = vec![
        (c.id.as_str(), "--id-column"),
        (c.event_type.as_str(), "--type-column"),
        (c.payload.as_str(), "--payload-column"),
    ];
    if let Some(a) = &c.aggregate_key {
        wanted.push((a.as_str(), "--aggregate-column"));
    }
    if let Some(t) = c.trace.as_ref().filter(|t| t.required) {
        wanted.push((t.name.as_str(), "--trace-column"));
    }
    for (col, flag) in wanted {
        if !cols.iter().any(|have| have == col) {
            return Err(SourceError::NeedsSetup(format!(
                "table {t} has no column {col:?} ({flag}); its columns: {}",
                cols.join(", ")
            )));
        }
    }
    Ok(table)
}

/// Why a payload column of `type_name` is refused.
pub fn payload_type_message(t: &TableName, column: &str, type_name: &str) -> String {
    format!(
        "the payload column {t}.{column} (--payload-column) has type {type_name}; it must be json or jsonb, \
         whose text is always valid JSON (the relay sends it as the body's \"data\" verbatim). \
         ALTER TABLE ... ALTER COLUMN {column} TYPE jsonb USING {column}::jsonb, or point --payload-column at a json/jsonb column"
    )
}

/// Warnings about how `table` is published (for `setup` and the start of
/// `run`): a publication that also publishes UPDATE or DELETE on an outbox
/// without a usable replica identity makes those statements fail on the
/// primary (SQLSTATE 55000), cleanup `DELETE`s included.
pub async fn publication_warnings(
    client: &Client,
    t: &TableName,
    table: &OutboxTable,
    publications: &[String],
) -> Result<Vec<String>, SourceError> {
    let row = client
        .query_one(
            "SELECT coalesce(bool_or(p.pubupdate), false), coalesce(bool_or(p.pubdelete), false), \
                    coalesce(string_agg(DISTINCT 'ALTER PUBLICATION ' || quote_ident(p.pubname) \
                                        || ' SET (publish = ''insert'')', '; ') \
                             FILTER (WHERE p.pubupdate OR p.pubdelete), '') \
             FROM pg_publication p JOIN pg_publication_tables pt ON pt.pubname = p.pubname \
             WHERE p.pubname = ANY($1) AND pt.schemaname = $2 AND pt.tablename = $3",
            &[&publications, &t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publications", &e))?;
    let (update, delete, fix): (bool, bool, String) = (row.get(0), row.get(1), row.get(2));
    let identity = match table.replica_identity.as_str() {
        "n" => false,
        "d" => table.has_primary_key,
        _ => true,
    };
    let mut warnings = Vec::new();
    if (update || delete) && !identity {
        warnings.push(format!(
            "the publication publishes UPDATE/DELETE on {t}, which has no replica identity \
             (no primary key, or REPLICA IDENTITY NOTHING): every UPDATE or DELETE on it, cleanup \
             included, fails with SQLSTATE 55000. Make it insert-only ({fix}; what `cdc-relay \
             setup` creates), or give the table a replica identity (a primary key, or ALTER TABLE \
             {t} REPLICA IDENTITY FULL)"
        ));
    }
    Ok(warnings)
}

/// `schema.name` of relation `oid` and whether it is a partitioned table
/// (`relkind = 'p'`), as the catalog says now; `None` when it no longer
/// exists.
pub async fn relation_name(
    client: &Client,
    oid: u32,
) -> Result<Option<(String, bool)>, SourceError> {
    let row = client
        .query_opt(
            "SELECT n.nspname || '.' || c.relname, c.relkind = 'p' FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            &[&oid],
        )
        .await
        .map_err(|e| SourceError::sql("looking up a relation", &e))?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// The OID `table` names now, `None` when no such table exists.
pub async fn table_oid(client: &Client, table: &TableName) -> Result<Option<u32>, SourceError> {
    let row = client
        .query_one(
            "SELECT to_regclass(format('%I.%I', $1::text, $2::text))::oid",
            &[&table.schema, &table.name],
        )
        .await
        .map_err(|e| SourceError::sql("looking up the outbox table", &e))?;
    Ok(row.get(0))
}

/// The top of the partition tree `oid` belongs to (itself when it is not
/// a partition; `None` when it no longer exists), as the catalog says now.
pub async fn partition_root(client: &Client, oid: u32) -> Result<Option<u32>, SourceError> {
    let row = client
        .query_opt(
            "SELECT coalesce(pg_partition_root(c.oid::regclass), c.oid::regclass)::oid \
             FROM pg_class c WHERE c.oid = $1",
            &[&oid],
        )
        .await
        .map_err(|e| SourceError::sql("looking up a partition", &e))?;
    Ok(row.map(|r| r.get(0)))
}

/// Before streaming: the table and columns exist, the payload is json or
/// jsonb, and one of `publications` publishes inserts into it. Streaming a
/// publication that does not carry the table would confirm the slot past
/// every event: never start like that. `row_filter`: the filter a carrier
/// must have (`None`: none; a shard's when sharded). Returns the table.
pub async fn check_stream_config(
    client: &Client,
    t: &TableName,
    c: &OutboxColumns,
    publications: &[String],
    row_filter: Option<&str>,
) -> Result<OutboxTable, SourceError> {
    let table = check_outbox_table(client, t, c).await?;
    let existing: Vec<String> = client
        .query(
            "SELECT pubname::text FROM pg_publication WHERE pubname = ANY($1)",
            &[&publications],
        )
        .await
        .map_err(|e| SourceError::sql("looking up the publications", &e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if let Some(missing) = publications.iter().find(|p| !existing.contains(p)) {
        return Err(SourceError::NeedsSetup(format!(
            "publication {missing:?} does not exist (--publication / CDC_RELAY_PUBLICATION); run `cdc-relay setup`"
        )));
    }
    // Several publications may carry the table: pgoutput streams their
    // union. One carries it only with inserts on, no row filter (or exactly
    // the shard's), and no column list leaving out a column the relay reads.
    let m = super::membership(client, publications, t, &c.names(), row_filter).await?;
    if !m.included() {
        return Err(SourceError::NeedsSetup(format!(
            "no publication in --publication ({}) publishes inserts into {t} (--table) completely: {}",
            publications.join(", "),
            super::membership_problem(&m, publications, t)
        )));
    }
    Ok(table)
}
