//! Flags of the `billing` binary. Every flag is also a `BILLING_*` variable,
//! except the secrets: `EVENT_SECRET` and `EVENT_SECRET_PREVIOUS` (and their
//! `_FILE` forms) as the relay names them, read with the relay's own rules
//! (the `event_secret` crate).

use std::path::PathBuf;

use clap::Parser;
use event_secret::{EventKeys, SecretError, Source};
use service_common::cli::ServiceArgs;

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
    /// least 32 bytes, or whsec_<base64>). Prefer the environment or the
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
