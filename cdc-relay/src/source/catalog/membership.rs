//! Whether the outbox is in its publications, as the catalog says now:
//! which publications carry its inserts completely (a partitioned outbox
//! through its root), and why the others do not. (Watching it change over
//! time is `source::membership`.)

use tokio_postgres::Client;

use super::super::error::SourceError;
use crate::lsn::Lsn;
use crate::outbox::TableName;

/// Whether the outbox is in the publications, as one monitor reading saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// The publications that carry the outbox's inserts completely
    /// (inserts published; the table itself streamed under its own OID,
    /// a partitioned one through its root with
    /// `publish_via_partition_root`; no row filter; no column list leaving
    /// out a configured column), each as a token of its identity:
    /// `name:OID:via_root:all_tables:rel_rows:namespace_rows:xmin` — the
    /// OIDs of its `pg_publication_rel` row for the table and of its
    /// `pg_publication_namespace` row for the table's schema (the listings
    /// that carry it; other tables and schemas are left out), and its row's
    /// `xmin` (changed by any `ALTER PUBLICATION … SET`, `OWNER TO` or
    /// `RENAME`).
    /// Empty: the outbox's inserts are not (all) streamed.
    pub carriers: Vec<String>,
    /// The relation OID `--table` names now.
    pub table_oid: Option<u32>,
    /// When no publication carries it: why, per publication that lists it.
    pub problem: Option<String>,
    /// `pg_current_wal_lsn()` when read.
    pub wal_lsn: Lsn,
    /// The server's clock when read, `YYYY-MM-DD HH:MM:SS+00` (UTC), a
    /// `--since` value for `backfill`.
    pub at: String,
}

impl Membership {
    /// Some publication carries the outbox's inserts completely.
    pub fn included(&self) -> bool {
        !self.carriers.is_empty()
    }

    /// Whether, between `earlier` and this reading, no publication can
    /// have carried the outbox all along: no carrier is the same at both
    /// readings, or the table is another relation now. (A change in one of
    /// several publications while another carries it throughout is no gap.)
    /// `Some`: what changed, in words for the operator (`what_changed`).
    pub fn gap_since(&self, earlier: &Membership) -> Option<String> {
        if self.table_oid != earlier.table_oid {
            return Some(format!(
                "the table is another relation now (OID {} before, {} now): dropped and created again, or swapped",
                shown_oid(earlier.table_oid),
                shown_oid(self.table_oid)
            ));
        }
        let kept = self
            .carriers
            .iter()
            .any(|c| earlier.carriers.iter().any(|e| same_carrier(c, e)));
        (!kept).then(|| what_changed(&earlier.carriers, &self.carriers))
    }
}

fn shown_oid(oid: Option<u32>) -> String {
    oid.map_or_else(|| "none".to_owned(), |o| o.to_string())
}

/// One carrier token's fields (see [`Membership::carriers`]).
struct Carrier<'a> {
    name: &'a str,
    oid: &'a str,
    via_root: &'a str,
    all_tables: &'a str,
    /// `pg_publication_rel` row OIDs for the table.
    rel: Vec<&'a str>,
    /// `pg_publication_namespace` row OIDs for the table's schema.
    ns: Vec<&'a str>,
    xmin: Option<&'a str>,
}

impl<'a> Carrier<'a> {
    /// Read from the right, so that a publication name with a `:` in it
    /// stays whole: seven fields, or six in a token recorded before the
    /// `xmin` was added; `None` for a token of another shape.
    fn parse(token: &'a str) -> Option<Self> {
        let fields: Vec<&str> = token.rsplitn(7, ':').collect();
        let (xmin, f) = match fields.len() {
            7 => (Some(fields[0]), &fields[1..]),
            6 => (None, &fields[..]),
            _ => return None,
        };
        let oids = |list: &'a str| list.split(',').filter(|o| !o.is_empty()).collect();
        // f, right to left: namespaces, rel rows, all tables, via root, OID, name.
        Some(Carrier {
            name: f[5],
            oid: f[4],
            via_root: f[3],
            all_tables: f[2],
            rel: oids(f[1]),
            ns: oids(f[0]),
            xmin,
        })
    }

    /// Whether this reading's state of the publication carried the outbox
    /// all along since `earlier`: the same publication (OID), options
    /// unchanged (its row's `xmin`: any `ALTER PUBLICATION … SET`, `OWNER
    /// TO` or `RENAME` changes it, and `SET (publish = …)` out and back
    /// leaves nothing else to see), and every listing it had then still
    /// there (a `pg_publication_rel` or `pg_publication_namespace` row
    /// dropped and added back has a new OID). Tables or schemas added
    /// beside the outbox's listing change nothing.
    fn continues(&self, earlier: &Carrier<'_>) -> bool {
        self.name == earlier.name
            && self.oid == earlier.oid
            && self.via_root == earlier.via_root
            && self.all_tables == earlier.all_tables
            && (self.xmin == earlier.xmin || self.xmin.is_none() || earlier.xmin.is_none())
            && earlier.rel.iter().all(|r| self.rel.contains(r))
            && earlier.ns.iter().all(|n| self.ns.contains(n))
    }
}

/// What changed between two sets of carrier tokens that have none in
/// common, for the gap's log line: per publication that carried the
/// outbox before, the one difference the catalog shows. A publication
/// altered and altered back between two readings leaves only its `xmin`
/// changed: the catalog cannot tell what happened in between, so any
/// change is a possible gap, worded as such.
pub fn what_changed(before: &[String], now: &[String]) -> String {
    if before.is_empty() {
        return "no publication carried it when it was last verified".to_owned();
    }
    let parsed_now: Vec<Carrier<'_>> = now.iter().filter_map(|t| Carrier::parse(t)).collect();
    let said: Vec<String> = before
        .iter()
        .map(|token| {
            let Some(b) = Carrier::parse(token) else {
                return format!("publication {token} carries it differently now");
            };
            let name = b.name;
            let Some(n) = parsed_now.iter().find(|n| n.name == name) else {
                return format!("publication {name} no longer carries it");
            };
            if n.oid != b.oid {
                format!("publication {name} was dropped and created again")
            } else if n.all_tables != b.all_tables || !b.rel.iter().all(|r| n.rel.contains(r)) || !b.ns.iter().all(|x| n.ns.contains(x)) {
                format!(
                    "the outbox (or its schema) left publication {name} and was added back"
                )
            } else if n.via_root != b.via_root {
                let now_on = matches!(n.via_root, "true" | "t");
                format!(
                    "publication {name}'s publish_via_partition_root was turned {} (for a table that is not partitioned that changes nothing by itself; a partitioned outbox's rows streamed under the partitions' names are dead-lettered, not sent), and the catalog cannot tell whether the publication also left inserts out in between (publish changed and back)",
                    if now_on { "on" } else { "off" }
                )
            } else if n.xmin != b.xmin {
                format!(
                    "publication {name} was altered (ALTER PUBLICATION … SET, OWNER TO or RENAME) and carries the outbox's inserts as before: the catalog cannot tell whether it left them out in between (publish changed and back)"
                )
            } else {
                format!("publication {name} carries it differently now")
            }
        })
        .collect();
    let mut said = said.join("; ");
    let newcomers: Vec<&str> = parsed_now
        .iter()
        .map(|n| n.name)
        .filter(|n| {
            !before
                .iter()
                .filter_map(|t| Carrier::parse(t))
                .any(|b| b.name == *n)
        })
        .collect();
    if !newcomers.is_empty() {
        said.push_str(&format!("; {} carries it now", newcomers.join(", ")));
    }
    said
}

/// Whether the carrier token `now` continues `earlier`
/// ([`Carrier::continues`]); tokens of another shape must be equal.
fn same_carrier(now: &str, earlier: &str) -> bool {
    match (Carrier::parse(now), Carrier::parse(earlier)) {
        (Some(n), Some(e)) => n.continues(&e),
        _ => now == earlier,
    }
}

/// The membership part of the monitor's statement: `$2` publications, `$3`
/// schema, `$4` table, `$5` the configured columns, `$6` the row filter a
/// carrier must have (NULL: none; a shard's filter when sharded, see
/// [`crate::source::shards`]). Five columns: WAL
/// position, time, table OID, carriers, problem. Published tables are
/// matched by joining their names to pg_class, never with `to_regclass` on
/// the view's rows: the planner may evaluate that over every pg_class row,
/// and `pg_toast` then fails with a permission error for a plain role.
pub(super) const MEMBERSHIP_SQL: &str = "\
    WITH t AS (SELECT to_regclass(format('%I.%I', $3::text, $4::text))::oid AS oid), \
         p AS (SELECT oid, xmin::text AS pxmin, pubname, puballtables, pubinsert, pubviaroot \
               FROM pg_publication \
               WHERE pubname = ANY($2)), \
         listed AS (SELECT p.oid, p.pxmin, p.pubname, p.pubinsert, p.pubviaroot, p.puballtables, \
                           pt.rowfilter, pt.attnames, pc.oid AS reloid \
                    FROM p JOIN pg_publication_tables pt ON pt.pubname = p.pubname \
                    JOIN pg_namespace pn ON pn.nspname = pt.schemaname \
                    JOIN pg_class pc ON pc.relnamespace = pn.oid AND pc.relname = pt.tablename, t \
                    WHERE coalesce(pg_partition_root(pc.oid), pc.oid)::oid = t.oid), \
         carriers AS (SELECT DISTINCT oid, pxmin, pubname, pubviaroot, puballtables FROM listed \
                      WHERE pubinsert AND rowfilter IS NOT DISTINCT FROM $6::text \
                        AND reloid = (SELECT oid FROM t) \
                        AND (attnames IS NULL OR $5::text[]::name[] <@ attnames)) \
    SELECT pg_current_wal_lsn()::text, \
           to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US+00'), \
           (SELECT oid FROM t), \
           ARRAY(SELECT c.pubname || ':' || c.oid || ':' || c.pubviaroot || ':' || c.puballtables || ':' || \
                   coalesce((SELECT string_agg(pr.oid::text, ',' ORDER BY pr.oid) FROM pg_publication_rel pr, t \
                             WHERE pr.prpubid = c.oid AND pr.prrelid = t.oid), '') || ':' || \
                   coalesce((SELECT string_agg(pn.oid::text, ',' ORDER BY pn.oid) \
                             FROM pg_publication_namespace pn, pg_class tc, t \
                             WHERE pn.pnpubid = c.oid AND tc.oid = t.oid \
                               AND pn.pnnspid = tc.relnamespace), '') || ':' || c.pxmin \
                 FROM carriers c ORDER BY 1), \
           coalesce((SELECT format('%I.%I is UNLOGGED: its rows are never written to the WAL, so no \
                                   slot can decode them (a FOR ALL TABLES or TABLES IN SCHEMA publication \
                                   skips it): ALTER TABLE %I.%I SET LOGGED', $3::text, $4::text, $3::text, $4::text) \
                     FROM pg_class c, t WHERE c.oid = t.oid AND c.relpersistence = 'u'), \
           (SELECT string_agg(DISTINCT l.pubname || ' ' || CASE \
                     WHEN NOT l.pubinsert THEN 'does not publish inserts: ALTER PUBLICATION ' || quote_ident(l.pubname) || ' SET (publish = ''insert'')' \
                     WHEN $6::text IS NULL AND l.rowfilter IS NOT NULL THEN 'has a row filter (WHERE ' || l.rowfilter || '): drop it, the relay needs every row (BEGIN; ALTER PUBLICATION ' || quote_ident(l.pubname) || ' DROP TABLE ' || format('%I.%I', $3::text, $4::text) || '; ALTER PUBLICATION ' || quote_ident(l.pubname) || ' ADD TABLE ' || format('%I.%I', $3::text, $4::text) || '; COMMIT)' \
                     WHEN l.rowfilter IS DISTINCT FROM $6::text THEN 'has ' || coalesce('the row filter (WHERE ' || l.rowfilter || ')', 'no row filter') || ', not this shard''s (WHERE ' || $6::text || '): run `cdc-relay setup --shards`' \
                     WHEN l.reloid <> (SELECT oid FROM t) THEN 'carries partitions of ' || format('%I.%I', $3::text, $4::text) || ' under their own names (' || (SELECT string_agg(l2.name, ', ' ORDER BY l2.name) FROM (SELECT DISTINCT reloid::regclass::text AS name FROM listed l3 WHERE l3.oid = l.oid ORDER BY 1 LIMIT 3) l2) || CASE WHEN (SELECT count(DISTINCT reloid) FROM listed l4 WHERE l4.oid = l.oid) > 3 THEN ', …' ELSE '' END || '), not the table through its root: the relay reads a partitioned outbox only through its root, where every partition, present, future or detached later, is what it was when the row was written. ' || CASE WHEN NOT l.pubviaroot AND (l.puballtables OR EXISTS (SELECT 1 FROM pg_publication_rel pr, t WHERE pr.prpubid = l.oid AND pr.prrelid = t.oid) OR EXISTS (SELECT 1 FROM pg_publication_namespace pn, pg_class c, t WHERE pn.pnpubid = l.oid AND c.oid = t.oid AND pn.pnnspid = c.relnamespace)) THEN 'ALTER PUBLICATION ' || quote_ident(l.pubname) || ' SET (publish_via_partition_root = true)' WHEN NOT l.pubviaroot THEN 'ALTER PUBLICATION ' || quote_ident(l.pubname) || ' ADD TABLE ' || format('%I.%I', $3::text, $4::text) || '; ALTER PUBLICATION ' || quote_ident(l.pubname) || ' SET (publish_via_partition_root = true)' ELSE 'ALTER PUBLICATION ' || quote_ident(l.pubname) || ' ADD TABLE ' || format('%I.%I', $3::text, $4::text) END || ' (or run `cdc-relay setup`)' \
                     WHEN missing.names IS NOT NULL THEN 'cannot carry ' || missing.names || ': ' || format('%I.%I', $3::text, $4::text) || ' has no such column any more (fix the table, or the column flag that names it)' \
                     ELSE 'has a column list leaving out a column the relay reads: drop the list' END, '; ') \
            FROM listed l, \
                 (SELECT string_agg(quote_ident(c), ', ') AS names FROM unnest($5::text[]) c \
                  WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a, t \
                                    WHERE a.attrelid = t.oid AND a.attname = c AND a.attnum > 0 AND NOT a.attisdropped)) missing \
            WHERE l.oid NOT IN (SELECT oid FROM carriers)))";

/// Why the outbox is not carried, for messages: the reading's problem, or
/// "not in any of them" with the command that adds it.
pub fn membership_problem(m: &Membership, publications: &[String], table: &TableName) -> String {
    if m.table_oid.is_none() {
        return format!(
            "{table} does not exist (renamed or dropped?): if it was renamed, set --table (CDC_RELAY_TABLE) to the new name"
        );
    }
    m.problem.clone().unwrap_or_else(|| {
        format!(
            "{table} is in none of the publications ({}): ALTER PUBLICATION {} ADD TABLE {table} (or run `cdc-relay setup`)",
            publications.join(", "),
            publications.first().map_or("<publication>", String::as_str)
        )
    })
}

/// Reads the outbox's publication membership alone (one statement);
/// `row_filter` is the filter a carrier must have (`None`: no filter).
pub async fn membership(
    client: &Client,
    publications: &[String],
    table: &TableName,
    columns: &[String],
    row_filter: Option<&str>,
) -> Result<Membership, SourceError> {
    // $1 (the slot, in the monitor's statement) is unused here.
    let sql = format!("SELECT m.* FROM ({MEMBERSHIP_SQL}) m, (SELECT $1::text) unused");
    let row = client
        .query_one(
            &sql,
            &[
                &"",
                &publications,
                &table.schema,
                &table.name,
                &columns,
                &row_filter,
            ],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publications", &e))?;
    Ok(membership_from_row(&row))
}

pub(super) fn membership_from_row(row: &tokio_postgres::Row) -> Membership {
    Membership {
        wal_lsn: row.get::<_, String>(0).parse().unwrap_or_default(),
        at: row.get(1),
        table_oid: row.get(2),
        carriers: row.get(3),
        problem: row.get(4),
    }
}

#[cfg(test)]
mod carrier_tests {
    use super::same_carrier;

    #[test]
    fn a_gap_says_what_changed_in_the_catalog() {
        let t = |s: &str| vec![s.to_owned()];
        for (before, now, says) in [
            (
                "p:1:false:false:5::700",
                "p:2:false:false:6::710",
                "publication p was dropped and created again",
            ),
            (
                "p:1:false:false:5::700",
                "p:1:false:false:6::710",
                "the outbox (or its schema) left publication p and was added back",
            ),
            (
                "p:1:false:false:5::700",
                "p:1:true:false:5::710",
                "publish_via_partition_root was turned on",
            ),
            (
                "p:1:true:false:5::700",
                "p:1:false:false:5::710",
                "publish_via_partition_root was turned off",
            ),
            (
                "p:1:false:false:5::700",
                "p:1:false:false:5::710",
                "publication p was altered",
            ),
            (
                "a:b:1:false:false:5::700",
                "a:b:1:true:false:5::710",
                "publication a:b's publish_via_partition_root",
            ),
            (
                "p:1:false:false:5::700",
                "q:3:false:false:7::720",
                "publication p no longer carries it; q carries it now",
            ),
        ] {
            let said = super::what_changed(&t(before), &t(now));
            assert!(said.contains(says), "{before} → {now}: {said}");
        }
        assert!(
            super::what_changed(&[], &t("p:1:false:false:5::700"))
                .contains("no publication carried it")
        );
    }

    #[test]
    fn carriers_compare_with_and_without_the_publication_xmin() {
        assert!(same_carrier("p:1:f:f:5:", "p:1:f:f:5::700"));
        assert!(same_carrier("p:1:f:f:5::700", "p:1:f:f:5::700"));
        assert!(!same_carrier("p:1:f:f:5::700", "p:1:f:f:5::701"));
        assert!(!same_carrier("p:1:f:f:5:", "p:1:f:f:6::700"));
    }

    /// A schema or another table added beside the outbox's listing keeps
    /// it carried (`ADD TABLES IN SCHEMA` changes no `xmin`); a listing
    /// dropped, even with another left, does not.
    #[test]
    fn listings_added_beside_the_outbox_continue_it() {
        // now, earlier
        assert!(same_carrier("p:1:t:f:5:9:700", "p:1:t:f:5::700"));
        assert!(same_carrier("p:1:t:f:5,6:9:700", "p:1:t:f:5::700"));
        assert!(same_carrier("p:1:t:f:5:8,9:700", "p:1:t:f:5:9:700"));
        assert!(!same_carrier("p:1:t:f:6:9:700", "p:1:t:f:5:9:700"));
        assert!(!same_carrier("p:1:t:f:5::700", "p:1:t:f:5:9:700"));
        assert!(!same_carrier("p:1:t:f:5,6::700", "p:1:t:f:5,7::700"));
        assert!(!same_carrier("p:1:f:f:5::710", "p:1:t:f:5::700"));
    }
}
