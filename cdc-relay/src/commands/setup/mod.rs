//! `cdc-relay setup`: prepare the database side (settings, the outbox
//! table, the publication, the slot) and say what was done.
//!
//! Setup is idempotent and creates the publication BEFORE the slot: the slot
//! decodes with the catalog as of each change, so a publication created after
//! the slot's starting point would make older changes undecodable.

use tokio_postgres::Client;

use super::{connect, outln};

mod shards;
use crate::cli::{GlobalArgs, SetupArgs};
use crate::outbox::{OutboxColumns, TableName};
use crate::source::SourceError;
use crate::source::catalog;
use crate::source::{failover, slot_creation, transport};

/// `cdc-relay setup`: runs [`setup`] and prints its report.
pub async fn command(g: &GlobalArgs, a: SetupArgs) -> anyhow::Result<()> {
    let client = connect(g).await?;
    super::check_connections(g, &client).await?;
    let plan = SetupPlan {
        table: g.table.clone(),
        columns: g.columns(),
        publication: g.publication.first().cloned().unwrap_or_default(),
        slot: g.slot.clone(),
        recreate_slot: a.recreate_slot,
        failover: a.failover,
        conn: match g.replication_conn().map_err(anyhow::Error::msg)? {
            Some(replication) => replication,
            None => g.conn().map_err(anyhow::Error::msg)?,
        },
        shards: g.shards,
        slot_create_timeout: g.slot_create_timeout,
    };
    // A hint naming the role (ownership) names the side connection's.
    let user = g.conn().map_err(anyhow::Error::msg)?.user;
    for line in setup(&client, &plan)
        .await
        .map_err(|e| e.naming_role(&user))?
    {
        outln!("{line}");
    }
    Ok(())
}

/// What setup needs to know.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    /// Outbox table.
    pub table: TableName,
    /// Columns the relay reads.
    pub columns: OutboxColumns,
    /// Publication name (the first one given).
    pub publication: String,
    /// Slot name.
    pub slot: String,
    /// Recreate the slot when it is invalidated.
    pub recreate_slot: bool,
    /// Make the slot a failover slot (17+).
    pub failover: bool,
    /// The replication connection's server (`--replication-url`, else
    /// `--database-url`), for the replication command that switches
    /// failover on.
    pub conn: crate::source::ConnParams,
    /// `--shards N`: N publications and slots named after `publication`
    /// and `slot` with the shard's suffix, each with its row filter.
    pub shards: Option<u32>,
    /// How long creating a slot may wait (`--slot-create-timeout`).
    pub slot_create_timeout: std::time::Duration,
}

/// Runs setup and returns one line per check or action, for the operator.
pub async fn setup(client: &Client, plan: &SetupPlan) -> Result<Vec<String>, SourceError> {
    catalog::check_slot_name(&plan.slot)?;
    let mut report = Vec::new();
    check_settings(client, &mut report).await?;
    let table = check_table(client, plan, &mut report).await?;
    if let Some(count) = plan.shards {
        shards::setup(client, plan, &table, count, &mut report).await?;
        return Ok(report);
    }
    let created = ensure_publication(client, plan, table.relkind == "p", &mut report).await?;
    let publications = [plan.publication.clone()];
    for warning in catalog::publication_warnings(client, &plan.table, &table, &publications).await?
    {
        report.push(format!("warning: {warning}"));
    }
    ensure_slot(client, plan, created, &mut report).await?;
    Ok(report)
}

async fn check_settings(client: &Client, report: &mut Vec<String>) -> Result<(), SourceError> {
    let wal_level = catalog::setting(client, "wal_level").await?;
    if wal_level != "logical" {
        return Err(SourceError::Definite(format!(
            "wal_level is {wal_level:?}; set wal_level = logical in postgresql.conf and restart PostgreSQL (see deploy/postgresql.conf)"
        )));
    }
    report.push("ok: wal_level = logical".into());
    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int, (SELECT count(*)::int FROM pg_replication_slots), \
                    current_setting('max_wal_senders')::int, (SELECT count(*)::int FROM pg_stat_replication)",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading replication limits", &e))?;
    let (max_slots, slots, max_senders, senders): (i32, i32, i32, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if slots >= max_slots {
        report.push(format!(
            "warning: {slots} of max_replication_slots = {max_slots} in use; a new slot cannot be created"
        ));
    } else {
        report.push(format!("ok: replication slots {slots}/{max_slots} in use"));
    }
    if senders + 2 > max_senders {
        report.push(format!(
            "warning: {senders} of max_wal_senders = {max_senders} in use; the relay and a standby need 2"
        ));
    } else {
        report.push(format!("ok: wal senders {senders}/{max_senders} in use"));
    }
    let keep = catalog::setting(client, "max_slot_wal_keep_size").await?;
    if keep == "-1" {
        report.push(
            "warning: max_slot_wal_keep_size = -1: a stopped relay makes the server keep WAL without limit (disk full risk); set a bound, e.g. 10GB"
                .into(),
        );
    } else {
        report.push(format!("ok: max_slot_wal_keep_size = {keep}"));
    }
    // PostgreSQL 18: slots inactive this long are invalidated (absent
    // before 18: NULL).
    let idle: Option<String> = client
        .query_one(
            "SELECT current_setting('idle_replication_slot_timeout', true)",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading idle_replication_slot_timeout", &e))?
        .get(0);
    match idle.as_deref() {
        None | Some("" | "0") => {}
        Some(t) => report.push(format!(
            "warning: idle_replication_slot_timeout = {t}: the server invalidates a slot inactive that long, so a relay stopped (or down) longer loses its slot and the events since must be backfilled; set it to 0, or well above the longest outage you plan for"
        )),
    }
    Ok(())
}

/// Checks the table and its columns (the payload json or jsonb).
async fn check_table(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<catalog::OutboxTable, SourceError> {
    let table = catalog::check_outbox_table(client, &plan.table, &plan.columns).await?;
    report.push(format!(
        "ok: table {} has the columns the relay reads (payload json/jsonb)",
        plan.table
    ));
    Ok(table)
}

/// Whether `publication` has `t` as a member at all (listed, with or
/// without a row filter or column list; through its schema; or every
/// table), and whether it publishes via the partition root.
async fn membership_of(
    client: &Client,
    publication: &str,
    t: &TableName,
) -> Result<(bool, bool), SourceError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_rel pr \
                            WHERE pr.prpubid = p.oid AND pr.prrelid = c.oid) \
                 OR EXISTS (SELECT 1 FROM pg_publication_namespace pn \
                            WHERE pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace) \
                 OR p.puballtables, \
                    p.pubviaroot \
             FROM pg_publication p, pg_class c \
             WHERE p.pubname = $1 AND c.oid = to_regclass(format('%I.%I', $2::text, $3::text))",
            &[&publication, &t.schema, &t.name],
        )
        .await
        .map_err(|e| SourceError::sql("reading the publication's tables", &e))?;
    Ok((row.get(0), row.get(1)))
}

/// Creates the publication unless it exists; returns whether it created it.
async fn ensure_publication(
    client: &Client,
    plan: &SetupPlan,
    partitioned: bool,
    report: &mut Vec<String>,
) -> Result<bool, SourceError> {
    let exists = client
        .query_opt("SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = $1", &[&plan.publication])
        .await
        .map_err(|e| SourceError::sql("looking up the publication", &e))?;
    let t = &plan.table;
    if let Some(row) = exists {
        let (ins, upd, del, tru): (bool, bool, bool, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let publications = std::slice::from_ref(&plan.publication);
        let mut m =
            catalog::membership(client, publications, t, &plan.columns.names(), None).await?;
        let (member, via_root) = membership_of(client, &plan.publication, t).await?;
        // What brings the publication to carry the outbox: statements,
        // each with what it does (for its error) and its report line.
        let mut fixes: Vec<(String, &str, String)> = Vec::new();
        if ins && !m.included() && !member {
            // The table left the publication (ALTER PUBLICATION ... DROP
            // TABLE, or it was dropped and created again), or only some of
            // its partitions are listed: put it back, as the relay's and
            // status's messages say setup does.
            fixes.push((
                format!(
                    "ALTER PUBLICATION {} ADD TABLE {}",
                    catalog::quote_ident(&plan.publication),
                    catalog::quote_table(t)
                ),
                "adding the table to the publication",
                format!(
                    "added: {t} to publication {:?} (inserts committed while it was out were not streamed: re-send them with `cdc-relay backfill --since <when it left> --until <now>`; a running relay logs the exact command)",
                    plan.publication
                ),
            ));
        }
        if ins && !m.included() && partitioned && !via_root {
            // The partitions stream under their own names: the relay reads
            // a partitioned outbox only through its root.
            fixes.push((
                format!(
                    "ALTER PUBLICATION {} SET (publish_via_partition_root = true)",
                    catalog::quote_ident(&plan.publication)
                ),
                "publishing via the partition root",
                format!(
                    "set: publish_via_partition_root = true on publication {:?} ({t} is partitioned: the relay reads it through its root; a running relay reports what it could not read meanwhile, with the backfill to run)",
                    plan.publication
                ),
            ));
        }
        for (stmt, what, line) in &fixes {
            client
                .batch_execute(stmt)
                .await
                .map_err(|e| SourceError::sql(what, &e))?;
            report.push(line.clone());
        }
        if !fixes.is_empty() {
            m = catalog::membership(client, publications, t, &plan.columns.names(), None).await?;
        }
        if !ins || !m.included() {
            return Err(SourceError::Definite(format!(
                "publication {:?} exists but does not carry every insert into {t}: {}; fix that as it says, or choose another --publication",
                plan.publication,
                catalog::membership_problem(&m, publications, t)
            )));
        }
        report.push(format!(
            "exists: publication {:?} publishes inserts into {t}",
            plan.publication
        ));
        if upd || del || tru {
            report.push(format!(
                "warning: publication {:?} also publishes updates/deletes/truncates; the relay ignores them (counted in cdc_relay_ignored_changes_total) but the slot still decodes them",
                plan.publication
            ));
        }
        return Ok(false);
    }
    let via_root = if partitioned {
        ", publish_via_partition_root = true"
    } else {
        ""
    };
    let stmt = format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert'{via_root})",
        catalog::quote_ident(&plan.publication),
        catalog::quote_table(t)
    );
    client
        .batch_execute(&stmt)
        .await
        .map_err(|e| SourceError::sql("creating the publication", &e))?;
    report.push(format!(
        "created: publication {:?} (inserts into {t} only{})",
        plan.publication,
        if partitioned {
            ", via partition root"
        } else {
            ""
        }
    ));
    Ok(true)
}

/// Creates the slot unless a usable one exists. A slot older than the
/// publication (created before it, or before setup just created it) cannot
/// decode with it: refused, or recreated with `--recreate-slot`.
async fn ensure_slot(
    client: &Client,
    plan: &SetupPlan,
    created_publication: bool,
    report: &mut Vec<String>,
) -> Result<(), SourceError> {
    let info = catalog::slot_info(client, &plan.slot).await?;
    if let Some(i) = info.as_ref().filter(|i| !i.local) {
        return Err(catalog::slot_elsewhere(&plan.slot, i));
    }
    let publications = [plan.publication.clone()];
    let predates = match &info {
        Some(_) if created_publication => true,
        Some(s) if !s.active => {
            catalog::slot_predates_publication(&plan.conn, &plan.slot, &publications).await?
                == Some(true)
        }
        _ => false,
    };
    if predates {
        if !plan.recreate_slot {
            return Err(SourceError::SlotPredatesPublication {
                slot: plan.slot.clone(),
                publication: plan.publication.clone(),
            });
        }
        client
            .execute("SELECT pg_drop_replication_slot($1)", &[&plan.slot])
            .await
            .map_err(|e| SourceError::sql("dropping the slot older than its publication", &e))?;
        report.push(format!(
            "dropped: slot {:?}, older than publication {:?} (re-send what it missed with `cdc-relay backfill`)",
            plan.slot, plan.publication
        ));
        return create_slot(client, plan, report).await;
    }
    match info {
        Some(s) if s.invalidated() => {
            if !plan.recreate_slot {
                return Err(SourceError::SlotInvalidated {
                    slot: plan.slot.clone(),
                    reason: s.invalidation_reason.clone(),
                    since: crate::source::progress::backfill_since(client, &plan.slot).await,
                });
            }
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&plan.slot])
                .await
                .map_err(|e| SourceError::sql("dropping the invalidated slot", &e))?;
            report.push(format!("dropped: invalidated slot {:?}", plan.slot));
            create_slot(client, plan, report).await
        }
        Some(s) if slot_creation::being_created_by(&s).is_some() => {
            let pid = slot_creation::being_created_by(&s).unwrap_or_default();
            let blockers = slot_creation::blockers(client, pid).await?;
            Err(SourceError::Definite(slot_creation::being_created_message(
                &plan.slot, pid, &blockers,
            )))
        }
        // A slot of another plugin was refused by `slot_info`.
        Some(s) => {
            report.push(format!(
                "exists: slot {:?} (pgoutput, confirmed_flush_lsn {})",
                plan.slot,
                s.confirmed_flush_lsn
                    .map(|l| l.to_string())
                    .unwrap_or_else(|| "-".into())
            ));
            ensure_failover(client, plan, report).await
        }
        None => {
            create_slot(client, plan, report).await?;
            ensure_failover(client, plan, report).await
        }
    }
}

/// `--failover`: the slot is a failover slot (switched on with
/// ALTER_REPLICATION_SLOT when it is not), and a warning when the primary
/// does not hold logical WAL back for the standbys.
async fn ensure_failover(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<(), SourceError> {
    if !plan.failover {
        return Ok(());
    }
    match failover::slot_failover(client, &plan.slot).await? {
        None => {
            return Err(SourceError::Definite(
                "--failover: failover slots need PostgreSQL 17 or later; without them, run the relay with --on-slot-loss=recreate-and-backfill".into(),
            ));
        }
        Some(true) => report.push(format!("ok: slot {:?} is a failover slot", plan.slot)),
        Some(false) => {
            let sql = format!(
                "ALTER_REPLICATION_SLOT {} ( FAILOVER true )",
                catalog::quote_ident(&plan.slot)
            );
            transport::replication_command(&plan.conn, &plan.slot, &sql).await?;
            report.push(format!(
                "altered: slot {:?} is now a failover slot",
                plan.slot
            ));
        }
    }
    match failover::synchronized_standby_slots(client).await? {
        Some(s) if s.trim().is_empty() => report.push(
            "warning: synchronized_standby_slots is empty on the primary: it may confirm (and the relay deliver) \
             WAL a standby has not received, and after that standby's promotion those events are phantoms. \
             Set synchronized_standby_slots = '<the standbys' physical slot names>' in postgresql.conf and reload"
                .into(),
        ),
        Some(s) => report.push(format!("ok: synchronized_standby_slots = {s}")),
        None => {}
    }
    Ok(())
}

async fn create_slot(
    client: &Client,
    plan: &SetupPlan,
    report: &mut Vec<String>,
) -> Result<(), SourceError> {
    // A progress record for this slot name means a slot of that name
    // delivered before: this new one starts at the current WAL, so events
    // committed since the record's last delivered transaction were never
    // delivered by either. Say so with the command that re-sends them.
    let previous = crate::source::progress::read(client, &plan.slot).await?;
    let lsn = slot_creation::create_slot(
        client,
        &plan.conn,
        &plan.slot,
        plan.failover,
        plan.slot_create_timeout,
    )
    .await?;
    // Created through the replication connection's URL: it must be the
    // side connection's server too (a copy of that server answers the
    // start-up identity check alike; only the slot tells them apart).
    if catalog::slot_info(client, &plan.slot).await?.is_none() {
        return Err(SourceError::ServersDiffer {
            detail: format!(
                "setup created slot {:?} through --replication-url ({}), but the server behind \
                 --database-url does not show it: the two URLs reach different servers (a copy \
                 of the same cluster?). Drop the slot made there (SELECT \
                 pg_drop_replication_slot('{}') on that server), fix the URL, then run setup again",
                plan.slot,
                plan.conn.display(),
                plan.slot
            ),
        });
    }
    report.push(format!(
        "created: slot {:?} (pgoutput) at {lsn}; events committed from now on will be delivered",
        plan.slot
    ));
    if let Some(p) = previous {
        let since = p
            .commit_time
            .clone()
            .unwrap_or_else(|| "<the time of the last event the receiver got>".into());
        report.push(format!(
            "warning: a previous slot {:?} delivered up to {} (last delivered commit {since}, by {}); events committed after that and before this slot was created were NOT delivered: re-send them with `cdc-relay backfill --since '{since}'` (receivers deduplicate by id)",
            plan.slot,
            p.confirmed_lsn,
            p.holder.as_deref().unwrap_or("an earlier relay")
        ));
    }
    Ok(())
}
