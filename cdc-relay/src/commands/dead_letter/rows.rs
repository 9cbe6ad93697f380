//! The operator's reads of the dead-letter table: `list`, `show` and the
//! rows a `replay` or `discard` works on, with the one [`Filter`] they share.

use serde::Serialize;
use tokio_postgres::Client;

use crate::dead_letter::query_traced;

/// Which dead letters a command works on: every condition given must hold
/// (`None` is no condition). One filter serves `list`, `replay` and
/// `discard`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// Event type: an exact name, or a glob where `*` matches any run of
    /// characters (`Order*`).
    pub event_type: Option<String>,
    /// Text the row's error contains, case-insensitively (`http_422`,
    /// `unreadable`, `order_already_invoiced`).
    pub reason: Option<String>,
    /// Dead-lettered at or after this instant (timestamptz text with a
    /// UTC offset).
    pub since: Option<String>,
    /// Dead-lettered before this instant.
    pub until: Option<String>,
    /// Aggregate key (the ordering key column's value), exactly.
    pub aggregate: Option<String>,
    /// The routes file's endpoint that refused the event, exactly (rows of
    /// one-endpoint mode, unrouted events and unreadable rows have none).
    pub endpoint: Option<String>,
}

impl Filter {
    /// The filter the `dead-letter` flags describe.
    pub fn of(args: &crate::cli::DeadLetterFilterArgs) -> Filter {
        Filter {
            event_type: args.event_type.clone(),
            reason: args.reason.clone(),
            since: args.since.clone(),
            until: args.until.clone(),
            aggregate: args.aggregate.clone(),
            endpoint: args.endpoint.clone(),
        }
    }

    /// Whether no condition is set: every row matches.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The `LIKE` pattern for the event-type glob: `*` becomes `%`, and
    /// `%`, `_` and `\` match themselves.
    pub fn type_pattern(&self) -> Option<String> {
        self.event_type.as_ref().map(|t| {
            let mut p = String::with_capacity(t.len());
            for c in t.chars() {
                match c {
                    '*' => p.push('%'),
                    '%' | '_' | '\\' => {
                        p.push('\\');
                        p.push(c);
                    }
                    c => p.push(c),
                }
            }
            p
        })
    }
}

/// The conditions of a [`Filter`] on `cdc_relay_dead_letter`: parameters
/// `$1` to `$6` are the type pattern, reason, since, until, aggregate and
/// endpoint, in that order.
pub const FILTERED: &str = "($1::text IS NULL OR event_type LIKE $1) \
       AND ($2::text IS NULL OR strpos(lower(error), lower($2)) > 0) \
       AND ($3::text IS NULL OR quarantined_at >= $3::text::timestamptz) \
       AND ($4::text IS NULL OR quarantined_at < $4::text::timestamptz) \
       AND ($5::text IS NULL OR aggregate_key = $5) \
       AND ($6::text IS NULL OR endpoint = $6)";

/// A row of the dead-letter table, as listed.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct DeadLetter {
    /// Row id (what `show`, `replay` and `discard` take).
    pub id: i64,
    /// Event id.
    pub event_id: Option<String>,
    /// Aggregate key.
    pub aggregate_key: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Payload JSON text (only in `show`; `list` leaves it out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// A payload that was not UTF-8, as hex (only in `show`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_bytes_hex: Option<String>,
    /// Commit LSN (PostgreSQL text form); none for a backfilled row.
    pub commit_lsn: Option<String>,
    /// HTTP status of the last response.
    pub http_status: Option<i32>,
    /// Why it was dead-lettered.
    pub error: String,
    /// First bytes of the last response body.
    pub response_excerpt: Option<String>,
    /// Delivery attempts.
    pub attempts: i32,
    /// When it was written (RFC 3339, UTC; the table's `quarantined_at`).
    #[serde(rename = "quarantined_at")]
    pub dead_lettered_at: String,
    /// How long it has waited, seconds.
    pub age_secs: i64,
    /// The routes file's endpoint that refused it (`null`: one-endpoint
    /// mode, unrouted, or unreadable).
    pub endpoint: Option<String>,
    /// The event's stored W3C trace context (`traceparent`, then a space
    /// and `tracestate` when it has one); a replay continues that trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_context: Option<String>,
}

const COLUMNS: &str = "id, event_id, aggregate_key, event_type, commit_lsn::text, http_status, error, \
     response_excerpt, attempts, to_char(quarantined_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
     EXTRACT(EPOCH FROM now() - quarantined_at)::bigint, endpoint, \
     trace_context_or_null"; // dead_letter::TRACE_COLUMN (a test checks it)

fn from_row(
    r: &tokio_postgres::Row,
    payload: Option<String>,
    payload_bytes: Option<Vec<u8>>,
) -> DeadLetter {
    DeadLetter {
        id: r.get(0),
        event_id: r.get(1),
        aggregate_key: r.get(2),
        event_type: r.get(3),
        payload,
        payload_bytes_hex: payload_bytes.map(hex::encode),
        commit_lsn: r.get(4),
        http_status: r.get(5),
        error: r.get(6),
        response_excerpt: r.get(7),
        attempts: r.get(8),
        dead_lettered_at: r.get(9),
        age_secs: r.get(10),
        endpoint: r.get(11),
        trace_context: r.get(12),
    }
}

/// Runs `sql`, whose `$1`–`$6` are [`FILTERED`]'s, with `filter`'s values
/// and then `extra` as `$7`, `$8`, … (through [`query_traced`]).
async fn query_filtered(
    client: &Client,
    filter: &Filter,
    sql: &str,
    extra: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let pattern = filter.type_pattern();
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
        &pattern,
        &filter.reason,
        &filter.since,
        &filter.until,
        &filter.aggregate,
        &filter.endpoint,
    ];
    params.extend_from_slice(extra);
    query_traced(client, sql, &params).await
}

/// The payload columns, after [`COLUMNS`], for the reads that need them.
const WITH_PAYLOAD: &str = "payload, payload_bytes";

/// Whether a read carries each row's payload (`show`, `replay`) or leaves
/// it out (`list`, `discard`, which never print it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payloads {
    /// Read `payload` and `payload_bytes` too.
    With,
    /// The listed columns only.
    Without,
}

/// Rows a command reads per statement: a listing, discard or replay of any
/// length holds one page of rows at a time.
pub const PAGE: i64 = 1_000;

/// A keyset walk over the rows a [`Filter`] selects, oldest first, a
/// [`PAGE`] per statement (at most what `limit` leaves): `list`, `discard`
/// and `replay` never hold all the rows. Not one snapshot: a row written
/// during the walk may appear, one removed meanwhile may not.
pub struct Pages<'a> {
    client: &'a Client,
    filter: Filter,
    payloads: Payloads,
    /// Rows still to read (`None`: no limit).
    left: Option<i64>,
    /// The last row id read.
    after: i64,
    done: bool,
}

impl<'a> Pages<'a> {
    /// The walk over `filter`'s rows, at most `limit` of them.
    pub fn new(client: &'a Client, filter: Filter, payloads: Payloads, limit: Option<i64>) -> Self {
        Pages {
            client,
            filter,
            payloads,
            left: limit,
            after: 0,
            done: false,
        }
    }

    /// The next page; empty once every row is read. A `since`/`until`
    /// PostgreSQL cannot read as a time is an error (22007/22008).
    pub async fn next(&mut self) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
        let want = self.left.map_or(PAGE, |l| l.min(PAGE));
        if self.done || want <= 0 {
            return Ok(Vec::new());
        }
        let columns = match self.payloads {
            Payloads::With => format!("{COLUMNS}, {WITH_PAYLOAD}"),
            Payloads::Without => COLUMNS.to_owned(),
        };
        let rows = query_filtered(
            self.client,
            &self.filter,
            &format!(
                "SELECT {columns} FROM cdc_relay_dead_letter \
                 WHERE {FILTERED} AND id > $7 ORDER BY id LIMIT $8"
            ),
            &[&self.after, &want],
        )
        .await?;
        let read = i64::try_from(rows.len()).unwrap_or(i64::MAX);
        self.done = read < want;
        self.left = self.left.map(|l| l - read);
        if let Some(last) = rows.last() {
            self.after = last.get(0);
        }
        Ok(rows
            .iter()
            .map(|r| match self.payloads {
                Payloads::With => from_row(r, r.get(13), r.get(14)),
                Payloads::Without => from_row(r, None, None),
            })
            .collect())
    }
}

/// One row with its payload.
pub async fn get(client: &Client, id: i64) -> Result<Option<DeadLetter>, tokio_postgres::Error> {
    Ok(get_many(client, &[id]).await?.pop())
}

/// The rows of `ids` that exist, with their payloads, oldest first; one
/// statement.
pub async fn get_many(
    client: &Client,
    ids: &[i64],
) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
    let rows = query_traced(
        client,
        &format!(
            "SELECT {COLUMNS}, {WITH_PAYLOAD} FROM cdc_relay_dead_letter \
                 WHERE id = ANY($1) ORDER BY id"
        ),
        &[&ids],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|r| from_row(r, r.get(13), r.get(14)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_globs_become_like_patterns_that_match_only_what_they_say() {
        let f = |t: &str| Filter {
            event_type: Some(t.into()),
            ..Filter::default()
        };
        assert_eq!(f("Order*").type_pattern().as_deref(), Some("Order%"));
        assert_eq!(
            f("OrderCreated").type_pattern().as_deref(),
            Some("OrderCreated")
        );
        assert_eq!(f("a_b%c").type_pattern().as_deref(), Some("a\\_b\\%c"));
        assert!(Filter::default().is_empty() && !f("x").is_empty());
    }

    /// `query_traced` finds the trace column only by its token.
    #[test]
    fn the_columns_end_with_the_trace_token() {
        assert!(COLUMNS.ends_with(crate::dead_letter::TRACE_COLUMN));
    }
}
