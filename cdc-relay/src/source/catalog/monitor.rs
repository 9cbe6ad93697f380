//! The slot monitor's reading: the slot, the outbox's publication
//! membership, the other logical slots and the dead letters waiting, in
//! one statement (`source::monitor` takes it every interval).

use tokio_postgres::Client;

use super::super::error::SourceError;
use super::membership::{MEMBERSHIP_SQL, Membership, membership_from_row};
use super::slots::{INVALIDATION_REASON, REPLY_AGE, SlotInfo, WALSENDER, slot_from_row};
use crate::outbox::TableName;

/// Dead-letter rows counted one by one before [`dead_letters_waiting`]
/// takes the statistics' count instead.
pub const DEAD_LETTERS_COUNTED: i64 = 10_000;

/// The rows of `cdc_relay_dead_letter`, as a scalar subquery (`bigint`),
/// at a cost that does not grow with the table: counted exactly while
/// fewer than [`DEAD_LETTERS_COUNTED`] (at most that many rows read); from
/// there on, the larger of that figure and PostgreSQL's live-row count
/// (`pg_stat_user_tables.n_live_tup`: rows inserted minus rows deleted, as
/// they commit; an `ANALYZE` replaces it with its estimate, and it starts
/// from zero after a crash or a statistics reset). A parked endpoint
/// writes hundreds of rows a second and the slot monitor reads this every
/// `--slot-stats-interval`: a plain `count(*)` would read the whole table
/// each time.
pub fn dead_letters_waiting() -> String {
    format!(
        "(SELECT CASE WHEN c.n < {DEAD_LETTERS_COUNTED} THEN c.n \
           ELSE greatest(c.n, (SELECT n_live_tup FROM pg_stat_user_tables \
                               WHERE relid = 'cdc_relay_dead_letter'::regclass)) END \
         FROM (SELECT count(*) AS n \
               FROM (SELECT FROM cdc_relay_dead_letter LIMIT {DEAD_LETTERS_COUNTED}) l) c)"
    )
}

/// What the slot monitor reads every interval ([`monitor_reading`]).
#[derive(Debug)]
pub struct MonitorReading {
    /// The slot; `None` when it does not exist.
    pub slot: Option<SlotInfo>,
    /// The outbox's publication membership.
    pub membership: Membership,
    /// The other logical slots of this database, by name.
    pub others: Vec<String>,
    /// The rows of `cdc_relay_dead_letter` ([`dead_letters_waiting`]);
    /// `None` when not counted.
    pub dead_letters: Option<i64>,
    /// The server backend that answered (`pg_backend_pid()`): constant for
    /// a session of its own, so a change means the side connection goes
    /// through a pool in transaction or statement mode
    /// (`source::pairing`).
    pub backend_pid: i32,
}

/// The slot and the outbox's publication membership in ONE statement (the
/// slot monitor's reading: its cost is the relay's whole cost to an idle
/// database).
///
/// The same statement lists the other logical slots of this database,
/// names the backend that answered and, with `count_dead_letters`, counts
/// the rows of `cdc_relay_dead_letter` ([`dead_letters_waiting`]). `row_filter` as for
/// [`membership`](super::membership()).
pub async fn monitor_reading(
    client: &Client,
    slot: &str,
    publications: &[String],
    table: &TableName,
    columns: &[String],
    row_filter: Option<&str>,
    count_dead_letters: bool,
) -> Result<MonitorReading, SourceError> {
    let dead_letters = if count_dead_letters {
        dead_letters_waiting()
    } else {
        "NULL::bigint".to_owned()
    };
    let sql = format!(
        "WITH m AS ({MEMBERSHIP_SQL}) \
         SELECT m.*, s.plugin::text, s.database::text, s.active, s.active_pid, \
                s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size, \
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, {REPLY_AGE}, \
                a.wait_event_type::text, s.database = current_database(), {INVALIDATION_REASON}, \
                (pg_current_wal_lsn() - s.restart_lsn)::bigint, {WALSENDER}, \
                s.slot_name IS NOT NULL, \
                ARRAY(SELECT o.slot_name::text FROM pg_replication_slots o \
                      WHERE o.slot_type = 'logical' AND o.database = current_database() \
                        AND o.slot_name <> $1 ORDER BY 1), \
                {dead_letters}, pg_backend_pid() \
         FROM m \
         LEFT JOIN pg_replication_slots s ON s.slot_name = $1 \
         LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
         LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid"
    );
    let row = client
        .query_one(
            &sql,
            &[
                &slot,
                &publications,
                &table.schema,
                &table.name,
                &columns,
                &row_filter,
            ],
        )
        .await
        .map_err(|e| SourceError::sql("reading the slot and the publications", &e))?;
    Ok(MonitorReading {
        slot: row.get::<_, bool>(21).then(|| slot_from_row(&row, 5)),
        membership: membership_from_row(&row),
        others: row.get(22),
        dead_letters: row.get(23),
        backend_pid: row.get(24),
    })
}

/// Whether `cdc_relay_dead_letter` exists (as the relay's role resolves
/// the name), so the monitor can count its rows.
pub async fn dead_letter_table_exists(client: &Client) -> Result<bool, SourceError> {
    let row = client
        .query_one(
            "SELECT to_regclass('cdc_relay_dead_letter') IS NOT NULL",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("looking up cdc_relay_dead_letter", &e))?;
    Ok(row.get(0))
}
