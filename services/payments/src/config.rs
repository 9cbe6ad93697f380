//! Flags of the `payments` binary. Every flag is also a `PAYMENTS_*`
//! variable.

use std::time::Duration;

use clap::Parser;
use service_common::cli::ServiceArgs;

use crate::faults::{FaultArgs, Faults};

/// Prefix of every environment variable (`PAYMENTS_LISTEN`, ...).
pub const ENV_PREFIX: &str = "PAYMENTS";

/// Default `--admin-listen` address (`/metrics`, `/healthz`; loopback).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9182";

/// Default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8082";

/// `payments`: an example payment provider with idempotent charges.
#[derive(Debug, Clone, Parser)]
#[command(name = "payments", version, about)]
pub struct PaymentsArgs {
    /// Flags shared with `orders` and `billing`.
    #[command(flatten)]
    pub service: ServiceArgs,
    /// How long an `Idempotency-Key` answers repeats with the first
    /// result. After it the same key charges again: a client must not
    /// retry with a key older than this (Billing stops well before).
    #[arg(long, default_value = "24h", value_parser = service_common::cli::key_ttl)]
    pub idempotency_key_ttl: Duration,
    /// Charges above this amount (in cents) are declined with 402
    /// `charge_declined`, as a card over its limit would be.
    #[arg(long, default_value_t = 100_000_000, value_parser = clap::value_parser!(i64).range(1..))]
    pub decline_above_cents: i64,
    /// Test hooks.
    #[command(flatten)]
    pub faults: FaultArgs,
}

/// What the routes need from the flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--idempotency-key-ttl`.
    pub key_ttl: Duration,
    /// `--decline-above-cents`.
    pub decline_above_cents: i64,
    /// The test hooks in force.
    pub faults: Faults,
}

impl PaymentsArgs {
    /// Parses the process arguments and `PAYMENTS_*` variables; exits on error.
    pub fn parse_env() -> Self {
        service_common::cli::parse_with_env_prefix(ENV_PREFIX, DEFAULT_LISTEN, DEFAULT_ADMIN_LISTEN)
    }

    /// The settings the routes take.
    pub fn settings(&self) -> Settings {
        Settings {
            key_ttl: self.idempotency_key_ttl,
            decline_above_cents: self.decline_above_cents,
            faults: Faults::new(&self.faults),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<PaymentsArgs, clap::Error> {
        service_common::cli::try_parse_with_env_prefix(
            "PAYMENTS_UNSET_IN_TESTS",
            DEFAULT_LISTEN,
            DEFAULT_ADMIN_LISTEN,
            ["payments", "--database-url", "postgresql://u@h/db"]
                .into_iter()
                .chain(args.iter().copied()),
        )
    }

    #[test]
    fn hooks_are_off_and_keys_live_a_day_by_default() {
        let args = parse(&[]).expect("parses");
        assert_eq!(args.idempotency_key_ttl, Duration::from_secs(86_400));
        assert!(Faults::new(&args.faults).is_off());
        assert!(args.service.admin_listen.ip().is_loopback());
    }

    #[test]
    fn a_key_lifetime_of_zero_or_past_a_century_is_refused_naming_the_flag() {
        for bad in ["0s", "101years", "300000y"] {
            let err = parse(&["--idempotency-key-ttl", bad]).unwrap_err();
            assert!(
                err.to_string().contains("--idempotency-key-ttl"),
                "{bad}: {err}"
            );
            assert_eq!(err.exit_code(), 2, "{bad}");
        }
        assert!(parse(&["--idempotency-key-ttl", "100years"]).is_ok());
    }

    #[test]
    fn a_ratio_outside_zero_to_one_is_refused_naming_the_flag() {
        let err = parse(&["--fault-fail-ratio", "1.5"]).unwrap_err();
        assert!(err.to_string().contains("--fault-fail-ratio"), "{err}");
        assert!(parse(&["--fault-fail-ratio", "0.25"]).is_ok());
    }
}
