//! This machine's clock against the database server's, read once over the
//! side connection: a relay on this machine signs with timestamps its
//! receivers check against theirs, so a skew the running relay would warn
//! about ([`crate::clock::SKEW_WARN`]) is a warning of `status` too, in
//! the same words ([`skew_warning`]).

use tokio_postgres::Client;

use crate::clock::{skew_warning, unix_micros};
use crate::source::SourceError;

/// Seconds this machine's clock is ahead of the server's (negative:
/// behind): the server's `clock_timestamp()` against the midpoint of the
/// local clock read before and after the query, so the round trip (a few
/// milliseconds) counts half.
async fn skew_seconds(client: &Client) -> Result<f64, SourceError> {
    let before = unix_micros();
    let server: i64 = client
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8",
            &[],
        )
        .await
        .map_err(|e| SourceError::sql("reading the server's clock", &e))?
        .get(0);
    let after = unix_micros();
    let local = before + (after - before) / 2;
    Ok((local - server) as f64 / 1e6)
}

/// The clock warning `status` prints, if the clocks are apart.
pub(super) async fn warning(client: &Client) -> Result<Option<String>, SourceError> {
    Ok(skew_warning(skew_seconds(client).await?))
}

#[cfg(test)]
mod tests {
    use crate::clock::skew_warning;

    #[test]
    fn a_skew_past_the_relays_threshold_is_named_with_the_fix() {
        assert_eq!(skew_warning(0.4), None);
        assert_eq!(skew_warning(-29.0), None);
        let ahead = skew_warning(600.2).unwrap_or_default();
        assert!(
            ahead.contains("600 s ahead of the database server's") && ahead.contains("NTP"),
            "{ahead}"
        );
        let behind = skew_warning(-31.0).unwrap_or_default();
        assert!(behind.contains("31 s behind"), "{behind}");
    }
}
