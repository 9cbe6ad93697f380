//! The parsers of flag values: each refuses what no setting could mean
//! (exit 2, naming the flag) rather than let a later lookup report it as
//! something else.

use std::time::Duration;

/// An LSN as PostgreSQL prints it: `16/B374D848`.
pub(super) fn parse_lsn(s: &str) -> Result<crate::lsn::Lsn, String> {
    s.parse().map_err(|e| {
        format!("{e}: an LSN looks like 16/B374D848 (as pg_current_wal_lsn() prints it)")
    })
}

/// `--slot`: a name PostgreSQL accepts for a replication slot, refused
/// here (exit 2) rather than looked up and reported missing (exit 3).
pub(super) fn parse_slot_name(s: &str) -> Result<String, String> {
    crate::source::catalog::check_slot_name(s)
        .map(|()| s.to_owned())
        .map_err(|_| {
            "a slot name is lower-case letters, digits and underscores, at most 63 (e.g. cdc_relay)"
                .into()
        })
}

/// A name PostgreSQL keeps whole: 1 to 63 bytes (NAMEDATALEN - 1; a
/// longer identifier is truncated by the server and never matches), no
/// NUL, and no space at either end (a typo in a comma-separated list).
/// Taken literally, as stored in the catalog: no quoting, no case folding.
pub(super) fn check_identifier(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.trim() != s {
        return Err(format!("{s:?} begins or ends with a space"));
    }
    if s.len() > 63 {
        return Err(format!(
            "{s:?} is {} bytes; PostgreSQL names are at most 63",
            s.len()
        ));
    }
    if s.contains('\0') {
        return Err(format!("{s:?} holds a NUL byte"));
    }
    Ok(())
}

/// `--publication`, each of its comma-separated names: refused here
/// (exit 2) when no publication could have it, rather than looked up and
/// reported missing (exit 3). An empty name (`--publication ''`, a
/// trailing comma) is refused too.
pub(super) fn parse_publication_name(s: &str) -> Result<String, String> {
    check_identifier(s)
        .map(|()| s.to_owned())
        .map_err(|e| format!("a publication name {e} (several: a,b with no spaces)"))
}

/// A column flag (`--id-column`, `--type-column`, `--payload-column`): a
/// name a column could have ([`check_identifier`]).
pub(super) fn parse_column_name(s: &str) -> Result<String, String> {
    check_identifier(s)
        .map(|()| s.to_owned())
        .map_err(|e| format!("a column name {e}"))
}

/// A column flag that empty disables (`--aggregate-column`,
/// `--trace-column`): empty, or a name a column could have.
pub(super) fn parse_optional_column_name(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Ok(String::new());
    }
    parse_column_name(s).map_err(|e| format!("{e} (empty disables it)"))
}

/// Parses `500ms`, `2s`, `1m 30s` (humantime syntax), at most
/// [`crate::clock::MAX_SETTING`].
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::clock::parse_setting(s)
}

/// Parses a duration as [`parse_duration`] does, above zero: a timeout of
/// 0 would give up on every attempt at once.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be above 0 (a timeout of 0 gives up at once)".into()),
        d => Ok(d),
    }
}

/// Parses a retention window (`prune --older-than`, `run
/// --prune-older-than`) as [`parse_duration`] does, above zero: a window of
/// 0 would delete rows delivered a moment ago, which no retention means.
pub(super) fn parse_retention(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(
            "must be above 0 (a window of 0 deletes rows delivered a moment \
             ago): give the age rows must reach before they go, longer than any backfill you \
             may need, e.g. 7d or 36h"
                .into(),
        ),
        d => Ok(d),
    }
}

/// Parses a byte size: `1048576`, `64KiB`, `64MiB`, `1GiB` (also kB/MB/GB as powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u32, String> {
    let v = parse_size(s)?;
    u32::try_from(v).map_err(|_| format!("size {:?} is above 4GiB", s.trim()))
}

/// `--batch-max-bytes`: a size as [`parse_bytes`] takes it, from 1KiB to
/// 16MiB (the routes file's `batch_max_bytes` takes the same range).
pub fn parse_batch_bytes(s: &str) -> Result<u32, String> {
    let v = parse_bytes(s)?;
    if !(1024..=16 << 20).contains(&v) {
        return Err(format!(
            "{v} bytes is out of range: a batch's size limit is 1KiB to 16MiB"
        ));
    }
    Ok(v)
}

/// Parses a byte size as [`parse_bytes`] does, up to `TiB`, into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?} (examples: 65536, 64KiB, 64MiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "invalid size unit in {s:?} (use B, KiB, MiB or GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size {s:?} out of range"))
}

/// `--sink-url`'s parser: [`parse_sink_url`], with an error that quotes the
/// value as [`crate::redact::url`] shows it. clap's own message for a
/// refused value quotes it verbatim, password and token included.
#[derive(Clone)]
pub(super) struct SinkUrlParser;

impl clap::builder::TypedValueParser for SinkUrlParser {
    type Value = url::Url;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<url::Url, clap::Error> {
        let s = value.to_string_lossy();
        parse_sink_url(&s).map_err(|reason| {
            let flag = arg.map_or_else(|| "--sink-url".to_owned(), |a| a.to_string());
            let long = arg
                .and_then(clap::Arg::get_long)
                .map_or_else(|| "--sink-url".to_owned(), |l| format!("--{l}"));
            // A value from the environment is named by its variable: the
            // command line never had the flag.
            let message = match arg.and_then(super::env_errors::env_source) {
                Some((env, _)) if s.trim().is_empty() => {
                    format!("{env} is set but empty: unset it, or give it a value ({long})\n")
                }
                Some((env, _)) => format!(
                    "invalid value '{}' of the environment variable {env} ({long} was not given): {reason}\n",
                    crate::redact::url(&s)
                ),
                None => format!(
                    "invalid value '{}' for '{flag}': {reason}\n",
                    crate::redact::url(&s)
                ),
            };
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, message).with_cmd(cmd)
        })
    }
}

/// `s` unless it is blank (an empty value is a script's unset variable):
/// then `Err("empty: {what}")`.
fn non_blank(s: &str, what: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err(format!("empty: {what}"));
    }
    Ok(s.to_owned())
}

/// A dead-letter filter's value (`--type`, `--reason`, …): not blank, or
/// `--reason ''` would select every row (`discard` all of them).
pub(super) fn parse_filter(s: &str) -> Result<String, String> {
    non_blank(
        s,
        "give the value to select by, or leave the flag out to select without it",
    )
}

/// `--note`: a reason kept in the audit table, not blank.
pub(super) fn parse_note(s: &str) -> Result<String, String> {
    non_blank(
        s,
        "say why the events are dropped (it is kept in the audit table)",
    )
}

/// `--sink-url`: an absolute http(s) URL with a host. The WHATWG parser
/// would read `http:///inbox` or `http:inbox` as the host `inbox`; those are
/// typos, refused here.
pub(super) fn parse_sink_url(s: &str) -> Result<url::Url, String> {
    let url =
        url::Url::parse(s.trim()).map_err(|e| format!("{e} (e.g. http://billing:8080/inbox)"))?;
    if matches!(url.scheme(), "http" | "https") {
        let rest = s.trim().split_once("://").map(|(_, rest)| rest);
        if !rest.is_some_and(|r| !r.is_empty() && !r.starts_with('/')) {
            return Err(
                "expected scheme://host[:port]/path, e.g. http://billing:8080/inbox".into(),
            );
        }
    }
    // Scheme, host and port, as for a routes file's url: checked here, so
    // a dry run refuses what a real one would.
    crate::sink::service::check_url(&url)?;
    Ok(url)
}
