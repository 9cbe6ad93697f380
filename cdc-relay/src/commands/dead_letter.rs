//! `cdc-relay dead-letter list|show|replay|discard`: inspect and resolve
//! dead-lettered events (`replay` is in `dead_letter/replay.rs`).

mod replay;
pub mod rows;

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Context;
use tokio_postgres::Client;

use super::{ConfigError, connect, outln};
use crate::cli::{DeadLetterCommand, GlobalArgs};
use crate::dead_letter::{self, Removal};
use rows::{DeadLetter, Filter, Payloads};

/// Runs one `dead-letter` subcommand.
pub async fn command(g: &GlobalArgs, c: DeadLetterCommand) -> anyhow::Result<()> {
    // A replay checks its sink settings before it connects (a bad one
    // exits 2 whatever the database).
    let c = match c {
        DeadLetterCommand::Replay(a) => return replay::replay(g, *a).await,
        other => other,
    };
    let mut client = connect(g).await?;
    match c {
        DeadLetterCommand::List {
            json,
            filter,
            limit,
        } => list(&client, json, &checked(&client, &filter).await?, limit).await?,
        DeadLetterCommand::Show { id } => {
            let row = rows::get(&client, id)
                .await?
                .with_context(|| format!("no dead-letter row {id}"))?;
            outln!("{}", serde_json::to_string_pretty(&shown(row))?);
        }
        DeadLetterCommand::Replay(_) => unreachable!("run above"),
        DeadLetterCommand::Discard {
            ids,
            all,
            filter,
            dry_run,
            note,
            actor,
            yes,
        } => {
            let selection = Selection::new(ids, all, checked(&client, &filter).await?)?;
            let how = Discard {
                reason: &note,
                actor: actor.as_deref(),
                yes,
                dry_run,
            };
            discard(&mut client, &selection, &how).await?
        }
    }
    Ok(())
}

/// The filter of `args`, its `--since`/`--until` checked to be instants
/// (exit 2 otherwise, as for `backfill`).
async fn checked(
    client: &Client,
    args: &crate::cli::DeadLetterFilterArgs,
) -> anyhow::Result<Filter> {
    let filter = Filter::of(args);
    for (flag, value) in [("--since", &filter.since), ("--until", &filter.until)] {
        if let Some(v) = value {
            crate::backfill::check_instant(client, flag, v)
                .await
                .map_err(|e| match e {
                    crate::backfill::BoundError::Bad(m) => anyhow::Error::new(ConfigError(m)),
                    other => other.into(),
                })?;
        }
    }
    Ok(filter)
}

/// The rows a `replay` or `discard` works on: ids given, or a filter with
/// `--all`, or a filter alone.
enum Selection {
    Ids(Vec<i64>),
    Filtered(Filter),
}

impl Selection {
    fn new(ids: Vec<i64>, all: bool, filter: Filter) -> anyhow::Result<Self> {
        match (ids.is_empty(), all || !filter.is_empty()) {
            // An id given twice is one row (its first place kept).
            (false, false) => {
                let mut seen = std::collections::HashSet::new();
                Ok(Self::Ids(ids.into_iter().filter(|i| seen.insert(*i)).collect()))
            }
            (true, true) => Ok(Self::Filtered(filter)),
            (false, true) => Err(ConfigError(
                "give row ids or filters (--all, --type, ...), not both".into(),
            )
            .into()),
            (true, false) => Err(ConfigError(
                "which rows? give row ids, a filter (--type, --reason, --since, --until, --aggregate, --endpoint), or --all for every row"
                    .into(),
            )
            .into()),
        }
    }

    /// Calls `each` with every row, in order: the ids' rows in the order
    /// given, with their payloads (every one must exist), or the filter's
    /// rows oldest first, without them, read a page at a time and never
    /// held together.
    async fn visit(
        &self,
        client: &Client,
        mut each: impl FnMut(&DeadLetter),
    ) -> anyhow::Result<()> {
        match self {
            Self::Filtered(f) => {
                let mut pages = rows::Pages::new(client, f.clone(), Payloads::Without, None);
                loop {
                    let page = pages.next().await?;
                    if page.is_empty() {
                        return Ok(());
                    }
                    page.iter().for_each(&mut each);
                }
            }
            Self::Ids(ids) => {
                let mut found: std::collections::HashMap<i64, DeadLetter> =
                    rows::get_many(client, ids)
                        .await?
                        .into_iter()
                        .map(|r| (r.id, r))
                        .collect();
                for id in ids {
                    let row = found
                        .remove(id)
                        .with_context(|| format!("no dead-letter row {id}; nothing was changed"))?;
                    each(&row);
                }
                Ok(())
            }
        }
    }

    /// The rows [`Selection::visit`] visits, together (`replay` of ids).
    async fn rows(&self, client: &Client) -> anyhow::Result<Vec<DeadLetter>> {
        let mut rows = Vec::new();
        self.visit(client, |r| rows.push(r.clone())).await?;
        Ok(rows)
    }
}

/// `show`'s JSON: the row, its payload as a JSON value when it is JSON
/// (else as the stored text).
fn shown(row: DeadLetter) -> serde_json::Value {
    let payload = row.payload.as_deref().map(|p| {
        serde_json::from_str::<serde_json::Value>(p)
            .unwrap_or_else(|_| serde_json::Value::String(p.to_owned()))
    });
    let mut v = serde_json::to_value(&row).unwrap_or_default();
    if let (Some(obj), Some(p)) = (v.as_object_mut(), payload) {
        obj.insert("payload".into(), p);
    }
    v
}

/// `3 s`, `4 min`, `2 h 5 min`, `3 d 4 h`: an age at a glance.
fn age(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `dead-letter list`: the rows `filter` selects, oldest first, at most
/// `limit`, as a table or a JSON array, read and printed a page at a time
/// ([`rows::Pages`]).
async fn list(
    client: &Client,
    json: bool,
    filter: &Filter,
    limit: Option<i64>,
) -> anyhow::Result<()> {
    let mut array = json.then(JsonArray::default);
    if !json {
        outln!(
            "{:>6}  {:<36}  {:<16}  {:<12}  {:>6}  {:>8}  {:>10}  error",
            "id",
            "event_id",
            "type",
            "endpoint",
            "status",
            "attempts",
            "age"
        );
    }
    let mut pages = rows::Pages::new(client, filter.clone(), Payloads::Without, limit);
    let mut listed = 0_i64;
    loop {
        let page = pages.next().await?;
        if page.is_empty() {
            break;
        }
        listed += i64::try_from(page.len()).unwrap_or(i64::MAX);
        match &mut array {
            Some(array) => {
                if let Some(text) = array.push(&page)? {
                    outln!("{text}");
                }
            }
            None => outln!("{}", table_rows(&page)),
        }
    }
    match (array, limit) {
        (Some(array), _) => outln!("{}", array.finish()),
        (None, Some(l)) if listed >= l => outln!(
            "{listed} dead-lettered event(s) shown, the first --limit {l}: there may be more (`cdc-relay status` counts them all)"
        ),
        (None, _) => outln!("{listed} dead-lettered event(s)"),
    }
    Ok(())
}

/// `rows` as lines of `list`'s table (no final line break).
fn table_rows(rows: &[DeadLetter]) -> String {
    let lines: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{:>6}  {:<36}  {:<16}  {:<12}  {:>6}  {:>8}  {:>10}  {}",
                r.id,
                printable(r.event_id.as_deref().unwrap_or("(none)")),
                printable(r.event_type.as_deref().unwrap_or("(none)")),
                printable(r.endpoint.as_deref().unwrap_or("-")),
                r.http_status.map_or("-".into(), |s| s.to_string()),
                r.attempts,
                age(r.age_secs),
                printable(&r.error.chars().take(80).collect::<String>())
            )
        })
        .collect();
    lines.join("\n")
}

/// A JSON array printed a page at a time, laid out as
/// `serde_json::to_string_pretty` lays out the whole array: each element
/// but the last is followed by a comma, so the last element read is held
/// until the next page (or the end) says whether it was the last.
#[derive(Default)]
struct JsonArray {
    /// `[` has been printed.
    opened: bool,
    /// The last element read, indented, not yet printed.
    held: Option<String>,
}

impl JsonArray {
    /// The lines to print now (no final line break; `None`: nothing yet):
    /// the held element and all of `rows` but the last, which it holds.
    fn push(&mut self, rows: &[DeadLetter]) -> serde_json::Result<Option<String>> {
        let mut lines = Vec::with_capacity(rows.len() + 1);
        if !self.opened && !rows.is_empty() {
            self.opened = true;
            lines.push("[".to_owned());
        }
        for r in rows {
            // A JSON text's strings escape line breaks: every line break
            // in the pretty form is the layout's.
            let element = serde_json::to_string_pretty(r)?
                .lines()
                .map(|l| format!("  {l}"))
                .collect::<Vec<_>>()
                .join("\n");
            if let Some(previous) = self.held.replace(element) {
                lines.push(previous + ",");
            }
        }
        Ok((!lines.is_empty()).then(|| lines.join("\n")))
    }

    /// The last lines: the held element and the array's end (`[]` when
    /// nothing was pushed).
    fn finish(self) -> String {
        match (self.opened, self.held) {
            (true, Some(last)) => format!("{last}\n]"),
            _ => "[]".to_owned(),
        }
    }
}

/// `text` for one line of a terminal table: control characters (a line
/// break, an escape sequence) written as escapes. The outbox's writers
/// choose these fields; printed raw, a newline forges a row and an escape
/// sequence reaches the operator's terminal.
pub(super) fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// How `discard` goes about it.
struct Discard<'a> {
    /// Why (kept in the audit table).
    reason: &'a str,
    /// Who; the database role when `None`.
    actor: Option<&'a str>,
    /// No confirmation question.
    yes: bool,
    /// List the rows and remove nothing.
    dry_run: bool,
}

/// Removes the selected rows without sending them, after a confirmation
/// (unless `yes`), recording the reason and actor in the audit table, in
/// one transaction. The rows are described as they are read (on stdout for
/// a dry run, on stderr for the question) and only their ids are kept.
async fn discard(
    client: &mut Client,
    selection: &Selection,
    how: &Discard<'_>,
) -> anyhow::Result<()> {
    debug_assert!(
        !how.reason.trim().is_empty(),
        "--note's parser refuses a blank one"
    );
    // The outbox's writers chose these fields: escaped, as in `list`, so
    // a row cannot forge a line of the list being confirmed.
    let describe = |r: &DeadLetter| {
        format!(
            "row {}: {} {} ({})",
            r.id,
            printable(r.event_type.as_deref().unwrap_or("(no type)")),
            printable(r.event_id.as_deref().unwrap_or("(no id)")),
            printable(&r.error.chars().take(80).collect::<String>())
        )
    };
    let ask = !how.dry_run && !how.yes && std::io::stdin().is_terminal();
    let mut ids = Vec::new();
    selection
        .visit(client, |r| {
            ids.push(r.id);
            if how.dry_run {
                outln!("would discard {}", describe(r));
            } else if ask {
                eprintln!("  {}", describe(r));
            }
        })
        .await?;
    if how.dry_run {
        outln!("discard (dry run): {} row(s); nothing removed", ids.len());
        return Ok(());
    }
    if ids.is_empty() {
        outln!("no dead-letter row matches; nothing discarded");
        return Ok(());
    }
    if !how.yes {
        anyhow::ensure!(
            ask,
            "discarding drops {} event(s) for good: confirm with --yes (stdin is not a terminal to ask on)",
            ids.len()
        );
        eprint!(
            "discard these {} event(s) without sending them? [y/N] ",
            ids.len()
        );
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        anyhow::ensure!(
            matches!(answer.trim(), "y" | "Y" | "yes"),
            "not confirmed; nothing was discarded"
        );
    }
    // One transaction: every row goes (each with its audit row) or none.
    let tx = client.transaction().await?;
    if let Some(holder) = dead_letter::replay_holding(&tx, &ids).await? {
        anyhow::bail!(
            "{holder} is running over these rows: it sends the rows it has read, so a discard now could record as never sent an event the sink receives. Wait for it to finish (or stop it), then discard again; nothing was discarded"
        );
    }
    let removed =
        dead_letter::remove_many(&tx, &ids, Removal::Discard, Some(how.reason), how.actor).await?;
    if let Some(gone) = ids.iter().find(|id| removed.binary_search(id).is_err()) {
        anyhow::bail!("dead-letter row {gone} was removed meanwhile; nothing was discarded");
    }
    tx.commit().await?;
    for id in &ids {
        outln!("discarded dead-letter row {id} (kept in cdc_relay_dead_letter_audit)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `discard 1 1` said row 1 did not exist (the second visit found it
    /// taken): an id given twice is one row.
    #[test]
    fn an_id_given_twice_selects_its_row_once() {
        let Ok(Selection::Ids(ids)) = Selection::new(vec![3, 1, 3, 2, 1], false, Filter::default())
        else {
            panic!("ids")
        };
        assert_eq!(ids, [3, 1, 2]);
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(-1), "0 s");
        assert_eq!(age(59), "59 s");
        assert_eq!(age(61), "1 min");
        assert_eq!(age(7_500), "2 h 5 min");
        assert_eq!(age(3 * 86_400 + 4 * 3600 + 5), "3 d 4 h");
    }

    /// Pages of any size print what one `to_string_pretty` of the whole
    /// array prints.
    #[test]
    fn a_json_array_printed_by_pages_reads_as_one() {
        let row = |id: i64| DeadLetter {
            id,
            event_id: Some(format!("e-{id}")),
            aggregate_key: None,
            event_type: Some("Order\nPaid".into()),
            payload: None,
            payload_bytes_hex: None,
            commit_lsn: Some("0/16B3748".into()),
            http_status: Some(422),
            error: "http_422: no".into(),
            response_excerpt: None,
            attempts: 1,
            dead_lettered_at: "2026-12-07T09:00:00.000000Z".into(),
            age_secs: 5,
            endpoint: None,
            trace_context: None,
        };
        let all: Vec<DeadLetter> = (1..=7).map(row).collect();
        for sizes in [
            &[][..],
            &[0],
            &[1],
            &[7],
            &[0, 3, 0, 4],
            &[1, 1, 5],
            &[2, 2, 2, 1],
        ] {
            let mut array = JsonArray::default();
            let mut printed = Vec::new();
            let mut at = 0;
            for n in sizes {
                printed.extend(array.push(&all[at..at + n]).unwrap());
                at += n;
            }
            printed.push(array.finish());
            assert_eq!(
                printed.join("\n"),
                serde_json::to_string_pretty(&all[..at]).unwrap(),
                "{sizes:?}"
            );
        }
    }

    #[test]
    fn control_characters_are_escaped_for_the_table() {
        assert_eq!(printable("OrderPaid"), "OrderPaid");
        assert_eq!(
            printable("Evil\n    99  fake-row\u{1b}[31mRED"),
            "Evil\\n    99  fake-row\\u{1b}[31mRED"
        );
    }
}
