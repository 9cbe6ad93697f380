//! The listener's limits as command-line flags, and the value parsers that
//! refuse a zero limit (shared by the services' other flags).

use std::time::Duration;

use crate::Limits;

/// The command-line form of [`Limits`] (flags under a listener-specific
/// prefix are the caller's business; these are the defaults of a public
/// service).
#[derive(Clone, Debug, clap::Args)]
pub struct LimitArgs {
    /// A request head must arrive within this (the first one and every
    /// later one on a kept-alive connection: also the idle keep-alive
    /// timeout).
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    pub header_read_timeout: Duration,
    /// Connections served at once; twice as many more may wait for their
    /// first byte, and further ones wait in the backlog. Keep three times
    /// it well below the descriptor limit (LimitNOFILE).
    #[arg(long, default_value_t = 512, value_parser = positive_count)]
    pub max_connections: usize,
}

/// Parses a duration in humantime's form (`10s`, `500ms`, `24h`) that is
/// above zero: a flag's value parser, so that a zero (which would time out
/// or expire everything at once) exits 2 naming the flag.
///
/// # Errors
/// Not a duration, or zero.
pub fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if d.is_zero() {
        return Err("must be above zero".into());
    }
    Ok(d)
}

/// Parses a count that is at least 1: a flag's value parser, so that a
/// zero (a limit nothing fits in) exits 2 naming the flag.
///
/// # Errors
/// Not a whole number, or zero.
pub fn positive_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

impl LimitArgs {
    /// The limits, with `drain_timeout` for shutdown.
    pub fn limits(&self, drain_timeout: Duration) -> Limits {
        Limits {
            header_read_timeout: self.header_read_timeout,
            max_connections: self.max_connections,
            drain_timeout,
        }
    }
}
