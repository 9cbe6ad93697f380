//! Server settings as the relay reads them (`current_setting`), and what
//! the server's version allows.

use std::time::Duration;

use tokio_postgres::Client;

use super::super::error::SourceError;

/// A server setting as text (`current_setting`).
pub async fn setting(client: &Client, name: &str) -> Result<String, SourceError> {
    let row = client
        .query_one("SELECT current_setting($1)", &[&name])
        .await
        .map_err(|e| SourceError::sql("reading server settings", &e))?;
    Ok(row.get(0))
}

/// The server's `wal_sender_timeout` (zero: disabled). 60 s when the value
/// cannot be read as a duration.
pub async fn wal_sender_timeout(client: &Client) -> Result<Duration, SourceError> {
    let text = setting(client, "wal_sender_timeout").await?;
    Ok(parse_pg_duration(&text).unwrap_or(Duration::from_secs(60)))
}

/// Parses a PostgreSQL duration setting as `SHOW` prints it (`60s`, `1min`,
/// `500ms`, `0`); `current_setting` prints the same form.
pub fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "" | "ms" => n,
        "s" => n * 1_000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The server's `server_version_num`, e.g. 170004 (0 when it cannot be
/// read as a number).
pub async fn server_version(client: &Client) -> Result<i32, SourceError> {
    Ok(setting(client, "server_version_num")
        .await?
        .parse()
        .unwrap_or(0))
}

/// Whether failover slots exist on a server of `version`
/// (`server_version_num`): PostgreSQL 17+.
pub fn supports_failover_slots(version: i32) -> bool {
    version >= 170_000
}

/// The server's encoding (`server_encoding`), e.g. `UTF8`.
pub async fn server_encoding(client: &Client) -> Result<String, SourceError> {
    setting(client, "server_encoding").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_durations_parse() {
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_pg_duration("x"), None);
    }
}
