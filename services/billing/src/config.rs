//! Flags of the `billing` binary. Every flag is also a `BILLING_*` variable,
//! except the secrets: `EVENT_SECRET` as in the tutorial, and
//! `EVENT_SECRET_FILE`, both shared with the relay.

use std::path::PathBuf;

use clap::Parser;
use service_common::cli::ServiceArgs;

use crate::signature::{EventSecrets, SecretError};

/// Prefix of the environment variables (`BILLING_LISTEN`, ...).
pub const ENV_PREFIX: &str = "BILLING";

/// Default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8081";

/// `billing`: HTTP inbox turning signed `OrderCreated` events into invoices.
#[derive(Debug, Clone, Parser)]
#[command(name = "billing", version, about)]
pub struct BillingArgs {
    /// Flags shared with `orders`.
    #[command(flatten)]
    pub service: ServiceArgs,
    /// Accepted HMAC-SHA256 secrets for `X-Event-Signature`, comma-separated
    /// (during a rotation: the new and the previous one). Prefer the
    /// environment or the file over the command line, which `ps` shows.
    #[arg(long, env = "EVENT_SECRET", hide_env_values = true)]
    pub event_secret: Option<String>,
    /// File with one accepted secret per line (blank lines skipped); combined
    /// with `--event-secret`. Same variable as the relay's, which signs with
    /// the same secret.
    #[arg(long, env = "EVENT_SECRET_FILE")]
    pub event_secret_file: Option<PathBuf>,
}

impl BillingArgs {
    /// Parses the process arguments and variables; exits on error.
    pub fn parse_env() -> Self {
        service_common::cli::parse_with_env_prefix(ENV_PREFIX, DEFAULT_LISTEN)
    }

    /// The configured secrets; an empty set is an error naming the settings.
    pub fn secrets(&self) -> Result<EventSecrets, SecretError> {
        EventSecrets::load(
            self.event_secret.as_deref(),
            self.event_secret_file.as_deref(),
        )
    }
}
