//! A session's preflight on the side connection: the connection, the slot
//! (created, recreated and backfilled, or refused), the table, the
//! publications, the shard coverage and the encoding, all bounded in time.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::OnSlotLoss;
use super::recovery::{self, LeftAt};
use super::session::{Prepared, Session};
use super::standby::blocked;
use crate::dead_letter;
use crate::sink::HttpSink;
use crate::source::catalog::SlotInfo;
use crate::source::{
    self, ConnParams, SourceError, catalog, failover, lock_wait, progress, shards, slot_creation,
};

/// What [`Session::prepare`] read within its connect bound.
struct Early {
    side_closed: tokio::sync::oneshot::Receiver<()>,
    server: ConnParams,
    wal_sender_timeout: std::time::Duration,
    slot: Option<SlotInfo>,
    parked: Vec<String>,
    restreamed: std::collections::HashMap<(String, String), i64>,
}

impl Session<'_> {
    /// Connects the side connection and checks the slot, the table and the
    /// publications. tokio-postgres bounds only the TCP connect; a server
    /// that accepts and then never answers must not hang the relay, so the
    /// whole exchange is bounded too.
    pub(super) async fn prepare(
        &self,
        left: Option<&LeftAt>,
        sink: &HttpSink,
        shutdown: &CancellationToken,
    ) -> Result<Option<Prepared>, SourceError> {
        let cfg = self.cfg;
        let startup = async {
            let (side, side_closed, server) =
                source::connect_primary(&cfg.conn, &cfg.application_name).await?;
            lock_wait::bound(&side).await?;
            source::pairing::check(
                &side,
                &server,
                cfg.replication.as_ref(),
                &cfg.application_name,
            )
            .await?;
            let reads = async {
                let wal_sender_timeout = catalog::wal_sender_timeout(&side).await?;
                let slot = catalog::slot_info(&side, &cfg.slot).await?;
                let parked = dead_letter::parked_endpoints(&side)
                    .await
                    .map_err(|e| SourceError::sql("looking for parked dead letters", &e))?;
                // Rows an earlier session wrote and did not confirm: their
                // events stream again, and one delivered now supersedes
                // its row.
                let restreamed = match slot.as_ref().and_then(|s| s.confirmed_flush_lsn) {
                    Some(confirmed) => dead_letter::restreamable(&side, confirmed)
                        .await
                        .unwrap_or_else(|e| {
                            tracing::warn!(error = %crate::db_message(&e), "cannot read the dead letters of unconfirmed events: one delivered now keeps its row (a replay would send it again)");
                            Default::default()
                        }),
                    None => Default::default(),
                };
                Ok::<_, SourceError>((wal_sender_timeout, slot, parked, restreamed))
            };
            // A read that waited past lock_timeout names who holds the lock.
            let (wal_sender_timeout, slot, parked, restreamed) = match reads.await {
                Ok(read) => read,
                Err(e) => return Err(lock_wait::named(&side, e).await),
            };
            Ok::<_, SourceError>((
                side,
                side_closed,
                server,
                wal_sender_timeout,
                slot,
                (parked, restreamed),
            ))
        };
        let tries = u32::try_from(cfg.conn.hosts.len()).unwrap_or(u32::MAX);
        // Past the login's own bound (twice connect_timeout, then one more
        // to name a catalog lock's holders: `source::stalled_login_named`),
        // so that a stalled login is said as such, not as this bare bound.
        let bound = cfg.conn.connect_timeout * tries.saturating_add(2);
        let (side, side_closed, server, wal_sender_timeout, slot, (parked, restreamed)) =
            tokio::time::timeout(bound, startup).await.map_err(|_| {
                SourceError::Transient(format!(
                    "{}: no answer within {bound:?} while connecting",
                    cfg.conn.display()
                ))
            })??;
        let side = Arc::new(side);
        let early = Early {
            side_closed,
            server,
            wal_sender_timeout,
            slot,
            parked,
            restreamed,
        };
        // A check that waited past lock_timeout names who holds the lock.
        match self
            .checks(Arc::clone(&side), early, left, sink, shutdown)
            .await
        {
            Err(e) => Err(lock_wait::named(&side, e).await),
            checked => checked,
        }
    }

    /// The checks after [`Self::prepare`] connected: the slot (created,
    /// recreated or refused), the table, the publications, the shard
    /// coverage and the encoding.
    async fn checks(
        &self,
        side: Arc<tokio_postgres::Client>,
        early: Early,
        left: Option<&LeftAt>,
        sink: &HttpSink,
        shutdown: &CancellationToken,
    ) -> Result<Option<Prepared>, SourceError> {
        let cfg = self.cfg;
        let Early {
            side_closed,
            server,
            wal_sender_timeout,
            slot,
            parked,
            restreamed,
        } = early;
        // The slot was recreated and the gap since the progress record
        // re-sent: the new slot is ahead of where this process left the old
        // one by design, and nothing in between is skipped.
        let mut recovered = false;
        let slot = match slot {
            Some(slot) => slot,
            None if cfg.on_slot_loss == OnSlotLoss::RecreateAndBackfill => {
                match recovery::recreate_and_backfill(&side, &server, cfg, sink, shutdown).await? {
                    Some(slot) => {
                        recovered = true;
                        slot
                    }
                    None => return Ok(None),
                }
            }
            None if cfg.create_slot => {
                slot_creation::create_slot(
                    &side,
                    &server,
                    &cfg.slot,
                    cfg.failover,
                    cfg.slot_create_timeout,
                )
                .await?;
                tracing::warn!(slot = %cfg.slot, "created the missing slot (--create-slot): events committed before now are not delivered");
                catalog::slot_info(&side, &cfg.slot).await?.ok_or_else(|| {
                    SourceError::SlotMissing {
                        slot: cfg.slot.clone(),
                    }
                })?
            }
            None => {
                return Err(SourceError::SlotMissing {
                    slot: cfg.slot.clone(),
                });
            }
        };
        if !slot.local {
            return Err(catalog::slot_elsewhere(&cfg.slot, &slot));
        }
        if slot.invalidated() {
            return Err(SourceError::SlotInvalidated {
                slot: cfg.slot.clone(),
                reason: slot.invalidation_reason.clone(),
                since: progress::backfill_since(&side, &cfg.slot).await,
            });
        }
        if let (Some(at), Some(confirmed)) = (cfg.stop_at, slot.confirmed_flush_lsn)
            && confirmed >= at
        {
            tracing::info!(slot = %cfg.slot, confirmed_flush_lsn = %confirmed, stop_at_lsn = %at, "the slot is confirmed at or past --stop-at-lsn: nothing to stream");
            return Ok(None);
        }
        // Still being created by another backend: not usable yet, and not
        // a relay to stand by for.
        if let Some(pid) = slot_creation::being_created_by(&slot) {
            let blockers = slot_creation::blockers(&side, pid).await?;
            return Err(SourceError::Transient(
                slot_creation::being_created_message(&cfg.slot, pid, &blockers),
            ));
        }
        // Held by another process (START_REPLICATION would refuse it, and
        // stays the lock), or another split streams: wait as a hot standby,
        // after the checks of the configuration (a standby must be able to
        // take over: a wrong column or publication is reported now, not
        // first at the failover it exists for) and before the ones about
        // this process's own progress on the slot.
        let blocked = blocked(&side, cfg).await?;
        if blocked.is_some() && cfg.replication.is_none() {
            // Its stream's route is checked now too (a pooler, a role
            // without REPLICATION, a refused login); a separate
            // --replication-url was checked by the pairing above.
            // Definite includes the misconnections (a pooler).
            match source::transport::identify(&server).await {
                Err(e) if e.is_definite() => return Err(e),
                _ => {}
            }
        }
        if blocked.is_none() && !recovered {
            recovery::check_not_jumped(&side, cfg, self.holder, &slot, left).await?;
        }
        if cfg.failover && failover::slot_failover(&side, &cfg.slot).await? != Some(true) {
            return Err(SourceError::Definite(format!(
                "--failover: slot {:?} is not a failover slot (or the server predates PostgreSQL 17): run `cdc-relay setup --failover`",
                cfg.slot
            )));
        }
        // A publication that does not carry the table would let the slot be
        // confirmed past every event: refuse to stream (the standby too).
        // A shard streams only rows its filter keeps: first prove that the
        // filters of all the shards keep every row exactly once, then hold
        // the publication to the filter proven.
        let row_filter = match &cfg.shard {
            Some(s) => {
                let coverage = shards::check_coverage(
                    &side,
                    &cfg.table,
                    &cfg.columns,
                    &s.publication_base,
                    s.shard.count,
                )
                .await?;
                coverage.filters.get(s.shard.index as usize).cloned()
            }
            None => None,
        };
        let table = catalog::check_stream_config(
            &side,
            &cfg.table,
            &cfg.columns,
            &cfg.publications,
            row_filter.as_deref(),
        )
        .await?;
        if let Some(blocked) = blocked {
            // The slot's progress record names the table the relay holding
            // it streams: a standby set up for another table (a valid one,
            // with its own publication) would confirm the slot past every
            // event of the outbox at its takeover.
            if let Some(recorded) = progress::read_membership(&side, &cfg.slot).await?
                && let Some(oid) = recorded.table_oid
                && oid != table.oid
            {
                let streamed: Option<String> = side
                    .query_one(
                        "SELECT n.nspname || '.' || c.relname FROM pg_class c \
                         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
                        &[&oid],
                    )
                    .await
                    .ok()
                    .map(|r| r.get(0));
                return Err(SourceError::NeedsSetup(format!(
                    "slot {:?} streams the outbox {} (its progress record says so, written by the relay holding it), but this relay is set to --table {} (oid {}): at a takeover it would skip every event of the other. Give this relay the same --table, --publication and column flags as the active one",
                    cfg.slot,
                    streamed.unwrap_or_else(|| format!("with oid {oid}")),
                    cfg.table,
                    table.oid
                )));
            }
            return Err(blocked);
        }
        for warning in
            catalog::publication_warnings(&side, &cfg.table, &table, &cfg.publications).await?
        {
            tracing::warn!("{warning}");
        }
        // PostgreSQL 18 decodes past a publication that does not exist at a
        // point of the WAL with only a WARNING, which the replication stream
        // does not show: its events would be skipped unseen. Ask first
        // (15-17 fail on the stream instead, and `diagnose` says why).
        if !slot.active
            && catalog::server_version(&side).await? >= 180_000
            && catalog::slot_predates_publication(&server, &cfg.slot, &cfg.publications).await?
                == Some(true)
        {
            return Err(SourceError::SlotPredatesPublication {
                slot: cfg.slot.clone(),
                publication: cfg.publications.join(", "),
            });
        }
        // Read last before the stream starts: the monitor compares its
        // first reading with it (a flap in between is a gap to heal).
        let membership = catalog::membership(
            &side,
            &cfg.publications,
            &cfg.table,
            &cfg.columns.names(),
            row_filter.as_deref(),
        )
        .await?;
        let sql_ascii = self.check_encoding(&side).await?;
        if cfg.conn.hosts.len() > 1 {
            tracing::info!(server = %server.display(), "connected to the primary");
        }
        Ok(Some(Prepared {
            side,
            side_closed,
            server,
            wal_sender_timeout,
            slot,
            table,
            sql_ascii,
            row_filter,
            membership,
            parked,
            restreamed,
        }))
    }

    /// Text the relay sends must be UTF-8. A server in another encoding
    /// needs the operator's consent. The server converts a real encoding
    /// (LATIN1, …) to UTF-8 itself; SQL_ASCII stores any bytes and has no
    /// conversion, so the stream then asks for them as they are and rows
    /// that are not UTF-8 become dead letters. Returns whether the server
    /// is SQL_ASCII.
    async fn check_encoding(&self, side: &tokio_postgres::Client) -> Result<bool, SourceError> {
        let encoding = catalog::server_encoding(side).await?;
        if encoding == "UTF8" {
            return Ok(false);
        }
        if !self.cfg.allow_non_utf8 {
            return Err(SourceError::Definite(format!(
                "the source database's server_encoding is {encoding}, not UTF8: its text may hold bytes \
                 that are not UTF-8, which a JSON body cannot carry. Pass --allow-non-utf8 \
                 (CDC_RELAY_ALLOW_NON_UTF8=true) to stream anyway: rows that are not UTF-8 \
                 then go to the dead-letter table, their payload bytes kept exactly"
            )));
        }
        tracing::warn!(server_encoding = %encoding, "streaming from a database that is not UTF8 (--allow-non-utf8): rows that are not UTF-8 are dead-lettered, payload bytes kept");
        Ok(encoding == "SQL_ASCII")
    }
}
