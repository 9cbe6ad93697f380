//! Hash-sharded slots: one outbox read through N publications, each with a
//! row filter that keeps the rows of one hash bucket, and one slot per
//! publication (`docs/architecture.md#sharding`).
//!
//! A row's bucket is the hash of its aggregate key, or of its event id when
//! the key is NULL or empty, with the built-in hash function of the
//! column's type (`hashtext`, `uuid_hash`, `hashint8`, …: PostgreSQL's row
//! filters accept only built-in immutable functions, operators and
//! constants — "Row Filters" → "Expression Restrictions" in the PostgreSQL
//! docs — so a `::text` cast of a uuid is refused and each type needs its
//! own function):
//!
//! ```text
//! ((coalesce(hash(nullif(aggregate_id, '')), hash(id), 0) & 2147483647) % N) = k
//! ```
//!
//! The expression is never NULL and lands in `0..N`, so every row is in
//! exactly one shard; [`check_coverage`] proves it on the server for the
//! filters that are really there. An aggregate lives in one shard, so its
//! order survives; the order between shards does not.

use tokio_postgres::Client;

use super::SourceError;
use super::catalog::{quote_ident, quote_table};
use crate::outbox::{OutboxColumns, TableName};

/// Most shards one outbox may be split into (each is a slot, a walsender
/// and a full decode of the WAL on the server).
pub const MAX_SHARDS: u32 = 64;

/// One shard of `count`: index `index` in `0..count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This shard's bucket, `0..count`.
    pub index: u32,
    /// How many shards the outbox is split into.
    pub count: u32,
}

impl Shard {
    /// Every shard of a split into `count`.
    pub fn all(count: u32) -> impl Iterator<Item = Shard> {
        (0..count).map(move |index| Shard { index, count })
    }

    /// The suffix that names this shard's slot, publication and metrics
    /// label: `2of4`. It carries the count, so the slots of a new split
    /// never share a name with the old ones while both exist (resharding).
    pub fn tag(&self) -> String {
        format!("{}of{}", self.index, self.count)
    }

    /// The slot or publication of this shard: `base_2of4`.
    pub fn name(&self, base: &str) -> String {
        format!("{base}_{}", self.tag())
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {} of {}", self.index, self.count)
    }
}

/// The row filter's bucket expression for `table` split into `count`
/// shards: an `int4` in `0..count` for every row (never NULL). Reads the
/// key columns' types to pick their built-in hash functions.
///
/// Errors: a key column whose type has no built-in hash function
/// (`SourceError::Definite`, naming the column and type), or SQL errors.
pub async fn bucket_expr(
    client: &Client,
    table: &TableName,
    columns: &OutboxColumns,
    count: u32,
) -> Result<String, SourceError> {
    let id = column_hash(client, table, &columns.id).await?;
    let hashed_id = id.call(&columns.id);
    let key = match &columns.aggregate_key {
        Some(agg) => {
            let key = column_hash(client, table, agg).await?;
            format!("{}, {hashed_id}", key.call(agg))
        }
        None => hashed_id,
    };
    Ok(format!("((coalesce({key}, 0) & 2147483647) % {count})"))
}

/// The row filter of `shard`: `(<bucket> = index)`.
pub fn filter(bucket: &str, shard: Shard) -> String {
    format!("({bucket} = {})", shard.index)
}

/// What keeps a relay of `slot` from streaming now: the slot itself held
/// by another process, or a slot of ANOTHER split of the same base
/// (`base` unsharded, or `base_<k>of<M>` with another M) held by one —
/// during a reshard the old split must have stopped before the new one
/// streams, or an aggregate's events could go out of order
/// (`docs/operations.md#resharding`). `split`: this relay's shard, `None`
/// unsharded. Returns the holder's slot and walsender pid. One statement
/// over `pg_replication_slots`: a hot standby's poll.
pub async fn blocker(
    client: &Client,
    slot: &str,
    base: &str,
    split: Option<Shard>,
) -> Result<Option<(String, Option<i32>)>, SourceError> {
    let active = client
        .query(
            "SELECT slot_name::text, active_pid FROM pg_replication_slots \
             WHERE active AND slot_type = 'logical' AND database = current_database()",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading which slots are active", &e))?;
    let held: Vec<(String, Option<i32>)> = active.iter().map(|r| (r.get(0), r.get(1))).collect();
    if let Some(own) = held.iter().find(|(name, _)| name == slot) {
        return Ok(Some(own.clone()));
    }
    Ok(held
        .into_iter()
        .find(|(name, _)| other_split(name, base, split)))
}

/// Whether `slot` is named like a shard's slot (`<base>_<k>of<N>`).
pub fn is_shard_slot(slot: &str) -> bool {
    slot.rsplit_once('_')
        .is_some_and(|(base, _)| !base.is_empty() && other_split(slot, base, None))
}

/// Whether `name` is a slot of a split of `base` other than `split`'s.
fn other_split(name: &str, base: &str, split: Option<Shard>) -> bool {
    if name == base {
        return split.is_some();
    }
    let Some(tag) = name
        .strip_prefix(base)
        .and_then(|rest| rest.strip_prefix('_'))
    else {
        return false;
    };
    let Some((index, count)) = tag.split_once("of") else {
        return false;
    };
    let (Ok(index), Ok(count)) = (index.parse::<u32>(), count.parse::<u32>()) else {
        return false;
    };
    index < count && split.is_none_or(|s| s.count != count)
}

/// How to hash one column in a row filter.
struct ColumnHash {
    /// The built-in hash function, e.g. `hashtext`.
    function: String,
    /// The type it takes (the column's base type), e.g. `text`.
    type_name: String,
    /// A string type: an empty value counts as no key.
    string: bool,
}

impl ColumnHash {
    fn call(&self, column: &str) -> String {
        let value = format!("{}::{}", quote_ident(column), self.type_name);
        if self.string {
            format!("{}(nullif({value}, ''))", self.function)
        } else {
            format!("{}({value})", self.function)
        }
    }
}

/// The default hash operator class's support function for the column's
/// (base) type, when it is built in; a string type without its own (e.g.
/// `varchar`) hashes as `text`.
async fn column_hash(
    client: &Client,
    table: &TableName,
    column: &str,
) -> Result<ColumnHash, SourceError> {
    let row = client
        .query_opt(
            "WITH c AS (SELECT coalesce(nullif(t.typbasetype, 0), t.oid) AS typ \
                        FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
                        WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text)) \
                          AND a.attname = $3 AND a.attnum > 0 AND NOT a.attisdropped) \
             SELECT format_type(c.typ, NULL), bt.typcategory = 'S', \
                    (SELECT p.proname::text FROM pg_opclass opc \
                       JOIN pg_am am ON am.oid = opc.opcmethod AND am.amname = 'hash' \
                       JOIN pg_amproc ap ON ap.amprocfamily = opc.opcfamily AND ap.amprocnum = 1 \
                            AND ap.amproclefttype = opc.opcintype AND ap.amprocrighttype = opc.opcintype \
                       JOIN pg_proc p ON p.oid = ap.amproc \
                     WHERE opc.opcdefault AND opc.opcintype = c.typ \
                       AND p.oid < 16384 AND p.provolatile = 'i' LIMIT 1) \
             FROM c JOIN pg_type bt ON bt.oid = c.typ",
            &[&table.schema, &table.name, &column],
        )
        .await
        .map_err(|e| SourceError::sql("reading the shard key columns' types", &e))?
        .ok_or_else(|| {
            SourceError::NeedsSetup(format!("column {column:?} is not in {table}"))
        })?;
    let (type_name, string, function): (String, bool, Option<String>) =
        (row.get(0), row.get(1), row.get(2));
    match function {
        Some(function) => Ok(ColumnHash {
            function,
            type_name,
            string,
        }),
        None if string => Ok(ColumnHash {
            function: "hashtext".into(),
            type_name: "text".into(),
            string,
        }),
        None => Err(SourceError::Definite(format!(
            "column {column:?} of {table} has type {type_name}, which has no built-in hash function a row filter may call: shard on a column of type text, uuid or an integer (--aggregate-column / --id-column)"
        ))),
    }
}

/// The row filter a publication applies to `table` (the root's, for a
/// partitioned table published through its root), as the server prints
/// it. `Ok(None)`: listed without a filter, or not listed.
///
/// Errors: the publication lists the table's partitions with different
/// filters (`SourceError::NeedsSetup`), or SQL errors.
pub async fn row_filter(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<Option<String>, SourceError> {
    let rows = client
        .query(
            "SELECT DISTINCT pt.rowfilter FROM pg_publication_tables pt \
             JOIN pg_namespace pn ON pn.nspname = pt.schemaname \
             JOIN pg_class pc ON pc.relnamespace = pn.oid AND pc.relname = pt.tablename \
             WHERE pt.pubname = $1 \
               AND coalesce(pg_partition_root(pc.oid), pc.oid)::oid \
                   = to_regclass(format('%I.%I', $2::text, $3::text))::oid",
            &[&publication, &table.schema, &table.name],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publication's row filter", &e))?;
    match rows.as_slice() {
        [] => Ok(None),
        [one] => Ok(one.get(0)),
        _ => Err(SourceError::NeedsSetup(format!(
            "publication {publication:?} lists the partitions of {table} with different row filters: recreate it with `cdc-relay setup --shards`"
        ))),
    }
}

/// What [`check_coverage`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coverage {
    /// Probe rows evaluated: synthetic keys and edge cases (NULL or empty
    /// key, NULL id) plus up to 2,000 rows of the table.
    pub probes: i64,
    /// Of those, rows taken from the table.
    pub table_rows: i64,
    /// Each shard's row filter as the server prints it, in shard order.
    pub filters: Vec<String>,
}

/// Synthetic probe rows: this many keys, each with and without an
/// aggregate key.
const SYNTHETIC_KEYS: i64 = 4096;

/// Proves on the server that the row filters of the `count` shard
/// publications (`publication_base_<k>of<count>`) put every row of `table`
/// in exactly one shard, and each in the bucket this relay computes: the
/// filters that are really in the catalog are evaluated over probe rows —
/// synthetic keys of the key columns' types, a NULL and an empty aggregate
/// key, a NULL id, and the table's first 2,000 rows. A row in no shard
/// would be silently lost, a row in two sent twice.
///
/// Errors (`SourceError::NeedsSetup`, saying which shard and what to run):
/// a publication missing, listing the table without a filter, or filters
/// that miss or double a probe row.
pub async fn check_coverage(
    client: &Client,
    table: &TableName,
    columns: &OutboxColumns,
    publication_base: &str,
    count: u32,
) -> Result<Coverage, SourceError> {
    let mut filters = Vec::new();
    for shard in Shard::all(count) {
        let publication = shard.name(publication_base);
        match row_filter(client, &publication, table).await? {
            Some(f) => filters.push(f),
            None => {
                return Err(SourceError::NeedsSetup(format!(
                    "{shard}: publication {publication:?} does not carry {table} with a shard row filter: run `cdc-relay setup --shards {count}`"
                )));
            }
        }
    }
    let bucket = bucket_expr(client, table, columns, count).await?;
    let t = quote_table(table);
    let hits = filters
        .iter()
        .map(|f| format!("coalesce(({f}), false)::int"))
        .collect::<Vec<_>>()
        .join(" + ");
    let own = filters
        .iter()
        .enumerate()
        .map(|(k, f)| format!("coalesce(({f}), false) = ({bucket} = {k})"))
        .collect::<Vec<_>>()
        .join(" AND ");
    let synthetic = synthetic_rows(client, table, columns).await?;
    let sql = format!(
        "WITH probe AS ((SELECT *, true AS cdc_relay_from_table FROM {t} LIMIT 2000) \
                        UNION ALL SELECT *, false FROM ({synthetic}) s), \
              judged AS (SELECT cdc_relay_from_table, ({hits}) AS hits, ({own}) AS own FROM probe) \
         SELECT count(*), count(*) FILTER (WHERE cdc_relay_from_table), \
                count(*) FILTER (WHERE hits = 0), count(*) FILTER (WHERE hits > 1), \
                count(*) FILTER (WHERE hits = 1 AND NOT own) \
         FROM judged"
    );
    let row = client.query_one(&sql, &[]).await.map_err(|e| {
        SourceError::sql("checking that the shard filters cover every row once", &e)
    })?;
    let (probes, table_rows, lost, doubled, elsewhere): (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let redo = format!(
        "drop the publications {publication_base}_*of{count} and their slots and run `cdc-relay setup --shards {count}`"
    );
    if lost > 0 || doubled > 0 {
        return Err(SourceError::NeedsSetup(format!(
            "the row filters of the {count} shard publications {publication_base}_*of{count} do not cover every row exactly once: of {probes} probe rows {lost} are in no shard (they would be lost) and {doubled} in several (sent twice); {redo}"
        )));
    }
    if elsewhere > 0 {
        return Err(SourceError::NeedsSetup(format!(
            "the row filters of the {count} shard publications {publication_base}_*of{count} split rows differently from this relay's shard function ({elsewhere} of {probes} probe rows): {redo}"
        )));
    }
    Ok(Coverage {
        probes,
        table_rows,
        filters,
    })
}

/// A `SELECT` of rows of `table`'s row type for the probe: for each of
/// [`SYNTHETIC_KEYS`] keys one row with the key as aggregate key and one
/// without (NULL, and empty for a string key), plus one row with neither
/// id nor key. Key values are made per type (uuid, number, string); a type
/// without a generator gets the edge rows only.
async fn synthetic_rows(
    client: &Client,
    table: &TableName,
    columns: &OutboxColumns,
) -> Result<String, SourceError> {
    let t = quote_table(table);
    let id = value_for(client, table, &columns.id, "g").await?;
    let mut objects = vec![format!(
        "jsonb_build_object({}, {id})",
        literal(&columns.id)
    )];
    if let Some(agg) = &columns.aggregate_key {
        let key = value_for(client, table, agg, "g + 7919").await?;
        let agg_lit = literal(agg);
        let id_lit = literal(&columns.id);
        objects.push(format!(
            "jsonb_build_object({id_lit}, {id}, {agg_lit}, {key})"
        ));
        if column_hash(client, table, agg).await?.string {
            objects.push(format!("jsonb_build_object({id_lit}, {id}, {agg_lit}, '')"));
        }
    }
    let rows = objects
        .iter()
        .map(|o| {
            format!(
                "SELECT (jsonb_populate_record(NULL::{t}, {o})).* FROM generate_series(1, {SYNTHETIC_KEYS}) g"
            )
        })
        .chain(std::iter::once(format!(
            "SELECT (jsonb_populate_record(NULL::{t}, '{{}}'::jsonb)).*"
        )))
        .collect::<Vec<_>>();
    Ok(rows.join(" UNION ALL "))
}

/// A jsonb value of `column`'s type made from the integer expression `g`
/// (distinct for distinct `g`), or `'null'::jsonb` when the type has no
/// generator here.
async fn value_for(
    client: &Client,
    table: &TableName,
    column: &str,
    g: &str,
) -> Result<String, SourceError> {
    let row = client
        .query_one(
            "SELECT format_type(coalesce(nullif(t.typbasetype, 0), t.oid), NULL), \
                    (SELECT typcategory FROM pg_type WHERE oid = coalesce(nullif(t.typbasetype, 0), t.oid))::text \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             WHERE a.attrelid = to_regclass(format('%I.%I', $1::text, $2::text)) \
               AND a.attname = $3 AND NOT a.attisdropped",
            &[&table.schema, &table.name, &column],
        )
        .await
        .map_err(|e| SourceError::sql("reading the shard key columns' types", &e))?;
    let (type_name, category): (String, String) = (row.get(0), row.get(1));
    Ok(match (type_name.as_str(), category.as_str()) {
        ("uuid", _) => format!("to_jsonb(md5(({g})::text)::uuid)"),
        (_, "N") => format!("to_jsonb({g})"),
        (_, "S") => format!("to_jsonb(md5(({g})::text))"),
        _ => "'null'::jsonb".into(),
    })
}

/// `s` as an SQL string literal.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_index_and_count() {
        let s = Shard { index: 2, count: 4 };
        assert_eq!(s.tag(), "2of4");
        assert_eq!(s.name("cdc_relay"), "cdc_relay_2of4");
        assert_eq!(s.to_string(), "shard 2 of 4");
        assert_eq!(
            Shard::all(3).map(|s| s.tag()).collect::<Vec<_>>(),
            ["0of3", "1of3", "2of3"]
        );
    }

    #[test]
    fn another_split_of_the_same_base_blocks_and_nothing_else_does() {
        let two = Some(Shard { index: 0, count: 2 });
        assert!(
            other_split("cdc_relay", "cdc_relay", two),
            "the unsharded slot"
        );
        assert!(
            other_split("cdc_relay_3of4", "cdc_relay", two),
            "the old 4-split"
        );
        assert!(
            !other_split("cdc_relay_1of2", "cdc_relay", two),
            "a sibling"
        );
        assert!(
            other_split("cdc_relay_1of2", "cdc_relay", None),
            "unsharded vs a split"
        );
        assert!(!other_split("cdc_relay", "cdc_relay", None), "itself");
        assert!(is_shard_slot("cdc_relay_2of4"));
        assert!(
            !is_shard_slot("cdc_relay")
                && !is_shard_slot("cdc_relay_4of4")
                && !is_shard_slot("_0of2")
        );
        for unrelated in [
            "cdc_relay_x",
            "cdc_relay2_0of2",
            "other_0of4",
            "cdc_relay_4of4",
            "cdc_relay_aof4",
        ] {
            assert!(!other_split(unrelated, "cdc_relay", two), "{unrelated}");
        }
    }

    #[test]
    fn string_keys_count_empty_as_no_key() {
        let text = ColumnHash {
            function: "hashtext".into(),
            type_name: "text".into(),
            string: true,
        };
        assert_eq!(
            text.call("aggregate_id"),
            "hashtext(nullif(\"aggregate_id\"::text, ''))"
        );
        let uuid = ColumnHash {
            function: "uuid_hash".into(),
            type_name: "uuid".into(),
            string: false,
        };
        assert_eq!(uuid.call("id"), "uuid_hash(\"id\"::uuid)");
        assert_eq!(
            filter("((x) % 4)", Shard { index: 1, count: 4 }),
            "(((x) % 4) = 1)"
        );
    }
}
