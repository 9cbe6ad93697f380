//! The demo's command line.

use std::time::Duration;

use clap::Parser;

/// Command line of `demo`.
#[derive(Debug, Parser)]
#[command(
    name = "demo",
    about = "Run cdc-relay end to end on a throwaway PostgreSQL: Orders → outbox → slot → relay → Billing",
    long_about = "Run cdc-relay end to end on a throwaway PostgreSQL cluster (fsync on): \
        `cdc-relay setup`, then Payments, Billing (charging each invoice there), Orders and the \
        relay as real processes; post real orders through the Orders HTTP API at a steady rate \
        with a live progress line; wait for the last invoices; print a summary (orders, invoices, \
        duplicates absorbed, commit-to-invoice p50/p99, slot lag, charges per order) and the \
        ledger verdict (lost / duplicate / phantom / double charges / uncharged must be 0, else \
        exit status 1). Everything is stopped and removed at the end, on error and on Ctrl-C.\n\n\
        Uses the PostgreSQL server binaries found here (CDC_RELAY_PG_BINDIR, pg_config, \
        /usr/lib/postgresql); when there are none it fetches PostgreSQL 17 as tests/pg-install.sh \
        does (python3 and pip needed, no root). Under root the server runs as the `postgres` user."
)]
pub(crate) struct Args {
    /// Orders per second, posted one per tick of an interval timer.
    #[arg(long, default_value_t = 50.0, value_parser = parse_rate)]
    pub(crate) rate: f64,
    /// How long to post orders (`20s`, `2m`, ...).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Post exactly N orders (at --rate) instead of running for --duration.
    #[arg(long, value_name = "N", conflicts_with = "duration", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) orders: Option<u64>,
    /// The relay's --max-in-flight: deliveries to Billing at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_in_flight: u32,
    /// After the run, keep the stack up and print how to reach it (URLs,
    /// psql connection strings, a curl that posts an order) until Ctrl-C.
    #[arg(long)]
    pub(crate) keep_running: bool,
    /// Longest wait for the last invoices once the last order is accepted.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) drain_timeout: Duration,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 && rate <= 100_000.0 => Ok(rate),
        _ => Err("a number of orders per second, above 0 and at most 100000".to_owned()),
    }
}

/// `20s`, `1.5s`, `500ms`, `2m`, `1h`, or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit.trim() {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("unknown unit {unit:?}: use ms, s, m or h")),
    };
    number
        .parse::<f64>()
        .ok()
        .map(|n| n * scale)
        .filter(|secs| secs.is_finite() && *secs > 0.0 && *secs < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{text:?} is not a positive duration such as 20s or 2m"))
}

impl Args {
    /// Orders to post: `--orders`, or `--rate` × `--duration` (at least one).
    pub(crate) fn total_orders(&self) -> u64 {
        self.orders.unwrap_or_else(|| {
            // Saturating float-to-int conversion; at least one order.
            ((self.rate * self.duration.as_secs_f64()).round() as u64).max(1)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
