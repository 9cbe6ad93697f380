//! Flags of the `orders` binary. Every flag is also an `ORDERS_*` variable.

use clap::Parser;
use clap::builder::BoolishValueParser;
use service_common::cli::ServiceArgs;

/// Prefix of every environment variable (`ORDERS_LISTEN`, ...).
pub const ENV_PREFIX: &str = "ORDERS";

/// Default `--admin-listen` address (`/metrics`, `/healthz`; loopback).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9180";

/// Default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// `orders`: HTTP service writing orders and their outbox events.
#[derive(Debug, Clone, Parser)]
#[command(name = "orders", version, about)]
pub struct OrdersArgs {
    /// Flags shared with `billing`.
    #[command(flatten)]
    pub service: ServiceArgs,
    /// TEST HOOK, never set in production (off by default): every POST /orders
    /// fails with 500 after inserting the order and before inserting its outbox
    /// row, so tests can prove the transaction leaves neither row behind.
    #[arg(long, action = clap::ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub fault_after_order_insert: bool,
    /// How long an `Idempotency-Key` of `POST /orders` is kept: a repeat
    /// within it gets the original answer, a later one makes a new order.
    #[arg(long, default_value = "24h", value_parser = service_common::cli::key_ttl)]
    pub idempotency_key_ttl: std::time::Duration,
}

impl OrdersArgs {
    /// Parses the process arguments and `ORDERS_*` variables; exits on error.
    pub fn parse_env() -> Self {
        service_common::cli::parse_with_env_prefix(ENV_PREFIX, DEFAULT_LISTEN, DEFAULT_ADMIN_LISTEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> OrdersArgs {
        service_common::cli::try_parse_with_env_prefix(
            "ORDERS_UNSET_IN_TESTS",
            DEFAULT_LISTEN,
            DEFAULT_ADMIN_LISTEN,
            std::iter::once("orders").chain(args.iter().copied()),
        )
        .expect("parses")
    }

    #[test]
    fn fault_hook_is_off_by_default() {
        let args = parse(&["--database-url", "postgresql://u@h/db"]);
        assert!(!args.fault_after_order_insert);
        assert_eq!(args.service.listen.to_string(), DEFAULT_LISTEN);
        assert!(
            args.service.admin_listen.ip().is_loopback(),
            "metrics stay on loopback by default"
        );
        assert_eq!(args.service.admin_listen.to_string(), DEFAULT_ADMIN_LISTEN);
        let args = parse(&[
            "--database-url",
            "postgresql://u@h/db",
            "--fault-after-order-insert",
        ]);
        assert!(args.fault_after_order_insert);
    }
}
