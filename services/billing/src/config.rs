//! Flags of the `billing` binary. Every flag is also a `BILLING_*` variable,
//! except the secrets: `EVENT_SECRET` and `EVENT_SECRET_PREVIOUS` (and their
//! `_FILE` forms) as the relay names them, read with the relay's own rules
//! (the `event_secret` crate).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use clap::builder::BoolishValueParser;
use event_secret::{EventKeys, SecretError, Source};
use service_common::cli::{ServiceArgs, positive_duration};

use crate::charge::ChargeSettings;
use crate::charge::store::Backoff;
use crate::signature::{SignatureScheme, Verifier};

/// Prefix of the environment variables (`BILLING_LISTEN`, ...).
pub const ENV_PREFIX: &str = "BILLING";

/// Default `--admin-listen` address (`/metrics`, `/healthz`; loopback).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9181";

/// Default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8081";

/// `billing`: HTTP inbox turning signed `OrderCreated` events into invoices.
#[derive(Debug, Clone, Parser)]
#[command(name = "billing", version, about)]
pub struct BillingArgs {
    /// Flags shared with `orders`.
    #[command(flatten)]
    pub service: ServiceArgs,
    /// The secret events are signed with (one secret: a plain one of at
    /// least 32 bytes, or `whsec_<base64>`). Prefer the environment or the
    /// file over the command line, which `ps` shows.
    #[arg(long, env = "EVENT_SECRET", hide_env_values = true)]
    pub event_secret: Option<String>,
    /// File holding that secret (one line). Re-read on SIGHUP.
    #[arg(long, env = "EVENT_SECRET_FILE")]
    pub event_secret_file: Option<PathBuf>,
    /// During a rotation, the secret being retired, still accepted.
    #[arg(long, env = "EVENT_SECRET_PREVIOUS", hide_env_values = true)]
    pub event_secret_previous: Option<String>,
    /// File holding the secret being retired (one line; empty: none).
    /// Re-read on SIGHUP.
    #[arg(long, env = "EVENT_SECRET_PREVIOUS_FILE")]
    pub event_secret_previous_file: Option<PathBuf>,
    /// Signatures accepted: `standard` (Standard Webhooks: webhook-id,
    /// webhook-timestamp, webhook-signature), `legacy` (X-Event-Signature)
    /// or `both` (webhook-signature when present, else X-Event-Signature).
    #[arg(long, value_enum, default_value = "both")]
    pub signature_scheme: SignatureScheme,
    /// How far webhook-timestamp may be from this server's clock, either
    /// way, in seconds. At most 300, the window of the standardwebhooks
    /// verifier (and of every official one).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=300))]
    pub timestamp_tolerance_secs: u32,
    /// Charging invoices at the payment provider.
    #[command(flatten)]
    pub charge: ChargeArgs,
}

/// The charge step (`services/README.md#effects-outside-the-database`):
/// on when `--payments-url` is given.
#[derive(Debug, Clone, clap::Args)]
pub struct ChargeArgs {
    /// Base URL of the payment provider (its `POST /charges`), e.g.
    /// `http://127.0.0.1:8082/`. When given, each new invoice is charged
    /// there once; without it invoices are only recorded (`charge_status`
    /// `none`) and nothing is charged.
    #[arg(long, value_parser = http_url)]
    pub payments_url: Option<reqwest::Url>,
    /// Bound on one charge request; an attempt without an answer by then
    /// is retried with the same key.
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    pub charge_timeout: Duration,
    /// Largest wait between two attempts of one invoice (exponential
    /// backoff from 200 ms, full jitter).
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    pub charge_backoff_max: Duration,
    /// How often invoices due again are looked for (retries, and attempts
    /// a crashed Billing left unfinished).
    #[arg(long, default_value = "1s", value_parser = positive_duration)]
    pub charge_poll_interval: Duration,
    /// Charge attempts at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub charge_concurrency: u16,
    /// An invoice older than this is not retried any more but marked
    /// `failed`, to reconcile by hand. Keep it below the provider's key
    /// lifetime (24 h for ours, and for most providers): a retry after the
    /// provider forgot the key could charge a second time.
    #[arg(long, default_value = "23h", value_parser = positive_duration)]
    pub charge_retry_window: Duration,
    /// TEST HOOK, never set in production: exit (status 87) right after the
    /// provider's charge and before recording it, as a crash there would.
    #[arg(long, action = clap::ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub fault_exit_after_charge: bool,
    /// TEST HOOK, never set in production: send no Idempotency-Key, to
    /// measure the double charges it prevents.
    #[arg(long, action = clap::ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub charge_without_idempotency_key: bool,
}

impl ChargeArgs {
    /// The worker's settings.
    pub fn settings(&self) -> ChargeSettings {
        ChargeSettings {
            timeout: self.charge_timeout,
            backoff: Backoff {
                base: Duration::from_millis(200),
                max: self.charge_backoff_max,
            },
            poll_interval: self.charge_poll_interval,
            concurrency: usize::from(self.charge_concurrency),
            retry_window: self.charge_retry_window,
            exit_after_charge: self.fault_exit_after_charge,
        }
    }
}

fn http_url(text: &str) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    match url.scheme() {
        "http" | "https" if url.host().is_some() => Ok(url),
        _ => Err(format!("{text:?} is not an http:// or https:// URL")),
    }
}

impl BillingArgs {
    /// Parses the process arguments and variables; exits on error.
    pub fn parse_env() -> Self {
        service_common::cli::parse_with_env_prefix(ENV_PREFIX, DEFAULT_LISTEN, DEFAULT_ADMIN_LISTEN)
    }

    /// The accepted keys, read now (files included); the error names the
    /// setting.
    pub fn keys(&self) -> Result<EventKeys, SecretError> {
        EventKeys::load(
            Source {
                value: self.event_secret.as_deref(),
                file: self.event_secret_file.as_deref(),
            },
            Source {
                value: self.event_secret_previous.as_deref(),
                file: self.event_secret_previous_file.as_deref(),
            },
        )
    }

    /// A verifier for the keys read now.
    pub fn verifier(&self) -> Result<Verifier, SecretError> {
        Ok(Verifier::new(
            &self.keys()?,
            self.signature_scheme,
            self.timestamp_tolerance_secs,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<BillingArgs, clap::Error> {
        service_common::cli::try_parse_with_env_prefix(
            "BILLING_UNSET_IN_TESTS",
            DEFAULT_LISTEN,
            DEFAULT_ADMIN_LISTEN,
            ["billing", "--database-url", "postgresql://u@h/db"]
                .into_iter()
                .chain(args.iter().copied()),
        )
    }

    #[test]
    fn the_charge_step_is_off_without_a_payments_url_and_hooks_are_off() {
        let args = parse(&[]).expect("parses");
        assert!(args.charge.payments_url.is_none());
        assert!(!args.charge.fault_exit_after_charge);
        assert!(!args.charge.charge_without_idempotency_key);
        assert!(args.charge.charge_retry_window < Duration::from_secs(24 * 3600));
        let args = parse(&["--payments-url", "http://127.0.0.1:8082/"]).expect("parses");
        assert_eq!(
            args.charge.payments_url.map(|u| u.to_string()).as_deref(),
            Some("http://127.0.0.1:8082/")
        );
    }

    #[test]
    fn a_bad_payments_url_or_duration_is_refused_naming_the_flag() {
        for bad in [
            ["--payments-url", "127.0.0.1:8082"],
            ["--payments-url", "ftp://h/"],
            ["--charge-timeout", "0s"],
            ["--charge-backoff-max", "soon"],
        ] {
            let err = parse(&bad).unwrap_err();
            assert!(err.to_string().contains(bad[0]), "{bad:?}: {err}");
            assert_eq!(err.exit_code(), 2, "{bad:?}");
        }
    }
}
