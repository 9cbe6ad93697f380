//! Command-line flags common to both services, each also read from the
//! environment under the service's prefix.
//!
//! A flag `--pool-size` of the `orders` binary is also `ORDERS_POOL_SIZE`; the
//! same struct serves `billing` as `BILLING_POOL_SIZE`. The names are derived
//! once, at parse time, by [`parse_with_env_prefix`], so the two binaries
//! cannot drift apart. A flag that names its own variable (Billing's
//! `EVENT_SECRET`) keeps it.

use std::ffi::OsString;
use std::net::SocketAddr;

use clap::{Command, Parser};

use crate::db::DbArgs;
use crate::server::HttpArgs;
use crate::telemetry::LogArgs;
pub use service_listener::{positive_count, positive_duration};

/// The longest `--idempotency-key-ttl` taken: 100 years (of 365.25 days,
/// as humantime counts them). A key's expiry is
/// a PostgreSQL timestamp, and one past its range (about 294,000 AD) would
/// make every request that carries a key fail with 500.
pub const MAX_KEY_TTL: std::time::Duration = std::time::Duration::from_secs(100 * 31_557_600);

/// Parses `--idempotency-key-ttl`: above zero, at most [`MAX_KEY_TTL`].
///
/// # Errors
/// Not a duration, zero, or above 100 years.
pub fn key_ttl(s: &str) -> Result<std::time::Duration, String> {
    let ttl = positive_duration(s)?;
    if ttl > MAX_KEY_TTL {
        return Err("must be at most 100 years".into());
    }
    Ok(ttl)
}

/// Flags every service has: where to listen, the database, HTTP limits, logs.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// Address to listen on (`host:port`); port 0 picks a free port. The bound
    /// address is printed to stdout as `listening on http://ADDR`.
    #[arg(long)]
    pub listen: SocketAddr,
    /// Address of the admin listener: `/metrics`, `/healthz` and the read
    /// endpoints only operators need (Billing's `GET /invoices`). Loopback
    /// by default: bind it to a private interface for a remote Prometheus,
    /// never to the public one. Port 0 picks a free port; the bound address
    /// is printed to stdout as `admin endpoint on http://ADDR`.
    #[arg(long)]
    pub admin_listen: SocketAddr,
    /// Database connection and its timeouts.
    #[command(flatten)]
    pub db: DbArgs,
    /// HTTP limits.
    #[command(flatten)]
    pub http: HttpArgs,
    /// Log output.
    #[command(flatten)]
    pub log: LogArgs,
    /// Traces: the request's span, exported over OTLP/HTTP.
    #[command(flatten)]
    pub trace: trace_context::TraceArgs,
}

/// Parses `std::env::args_os()` into `T`, giving every long flag without an
/// explicit `env` the variable `<PREFIX>_<FLAG_ID>`, `--listen` the default
/// `default_listen` and `--admin-listen` the default `default_admin_listen`.
/// Exits with clap's usage message on error.
pub fn parse_with_env_prefix<T: Parser>(
    env_prefix: &str,
    default_listen: &str,
    default_admin_listen: &str,
) -> T {
    try_parse_with_env_prefix(
        env_prefix,
        default_listen,
        default_admin_listen,
        std::env::args_os(),
    )
    .unwrap_or_else(|e| e.exit())
}

/// As [`parse_with_env_prefix`], over explicit `args` (first is the program
/// name), returning the error instead of exiting.
pub fn try_parse_with_env_prefix<T, I, A>(
    env_prefix: &str,
    default_listen: &str,
    default_admin_listen: &str,
    args: I,
) -> Result<T, clap::Error>
where
    T: Parser,
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    let mut cmd = command_with_env_prefix::<T>(env_prefix, default_listen, default_admin_listen);
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let matches = cmd
        .try_get_matches_from_mut(args.clone())
        .map_err(|e| with_env_tips(e, &cmd, &args))?;
    T::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// clap's `err` with tips naming environment variables (clap names only
/// flags): for a missing required flag, the variable that also sets it;
/// for a refused value that came from a variable (its flag not in
/// `args`), that variable.
fn with_env_tips(mut err: clap::Error, cmd: &Command, args: &[OsString]) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let tips: Vec<clap::builder::StyledStr> = match (err.kind(), err.get(ContextKind::InvalidArg)) {
        (ErrorKind::MissingRequiredArgument, Some(ContextValue::Strings(missing))) => cmd
            .get_arguments()
            .filter_map(|arg| {
                let long = arg.get_long()?;
                let var = arg.get_env()?.to_string_lossy();
                let flag = format!("--{long}");
                missing
                    .iter()
                    .any(|m| m.split_whitespace().next() == Some(flag.as_str()))
                    .then(|| format!("set {flag} or the environment variable {var}").into())
            })
            .collect(),
        (
            ErrorKind::InvalidValue | ErrorKind::ValueValidation,
            Some(ContextValue::String(refused)),
        ) => cmd
            .get_arguments()
            .filter_map(|arg| {
                let long = arg.get_long()?;
                let var = arg.get_env()?;
                let flag = format!("--{long}");
                let named = refused == &flag || refused.starts_with(&format!("{flag} "));
                let on_line = args.iter().any(|a| {
                    let a = a.to_string_lossy();
                    a == flag || a.starts_with(&format!("{flag}="))
                });
                (named && !on_line && std::env::var_os(var).is_some()).then(|| {
                    let var = var.to_string_lossy();
                    format!("the value came from the environment variable {var} ({flag} was not given): fix or unset {var}").into()
                })
            })
            .collect(),
        _ => Vec::new(),
    };
    if !tips.is_empty() {
        err.insert(ContextKind::Suggested, ContextValue::StyledStrs(tips));
    }
    err
}

fn command_with_env_prefix<T: Parser>(
    env_prefix: &str,
    default_listen: &str,
    default_admin_listen: &str,
) -> Command {
    T::command()
        .mut_args(|arg| {
            // `--help` names each variable but never shows its value (a
            // database URL may carry a password), as the relay's does.
            let arg = arg.hide_env_values(true);
            if arg.get_long().is_none() || arg.get_env().is_some() {
                return arg;
            }
            let var = format!(
                "{env_prefix}_{}",
                arg.get_id().as_str().to_ascii_uppercase()
            );
            arg.env(var)
        })
        .mut_arg("listen", |arg| {
            arg.required(false).default_value(default_listen.to_owned())
        })
        .mut_arg("admin_listen", |arg| {
            arg.required(false)
                .default_value(default_admin_listen.to_owned())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct TestCli {
        #[command(flatten)]
        common: ServiceArgs,
        /// A flag with its own variable.
        #[arg(long, env = "EXPLICIT_VAR_FOR_TEST")]
        explicit: Option<String>,
    }

    /// `--help` would print `[env: ORDERS_DATABASE_URL=postgres://…:password@…]`.
    #[test]
    fn help_never_shows_an_environment_value() {
        let cmd = command_with_env_prefix::<TestCli>("SVC", "127.0.0.1:8080", "127.0.0.1:9180");
        let shown: Vec<&str> = cmd
            .get_arguments()
            .filter(|a| a.get_env().is_some() && !a.is_hide_env_values_set())
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(shown.is_empty(), "values shown in --help: {shown:?}");
    }

    #[test]
    fn flags_get_prefixed_env_names_and_listen_default() {
        let cmd = command_with_env_prefix::<TestCli>("SVC", "127.0.0.1:8080", "127.0.0.1:9180");
        let env_of = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        assert_eq!(env_of("database_url").as_deref(), Some("SVC_DATABASE_URL"));
        assert_eq!(env_of("listen").as_deref(), Some("SVC_LISTEN"));
        assert_eq!(env_of("admin_listen").as_deref(), Some("SVC_ADMIN_LISTEN"));
        assert_eq!(env_of("pool_size").as_deref(), Some("SVC_POOL_SIZE"));
        assert_eq!(env_of("explicit").as_deref(), Some("EXPLICIT_VAR_FOR_TEST"));

        let parsed: TestCli = try_parse_with_env_prefix(
            "SVC_UNSET_IN_TESTS",
            "127.0.0.1:8080",
            "127.0.0.1:9180",
            ["svc", "--database-url", "postgresql://u@h/db"],
        )
        .expect("parses");
        assert_eq!(parsed.common.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(
            parsed.common.admin_listen,
            "127.0.0.1:9180".parse().unwrap()
        );
        assert_eq!(parsed.common.db.pool_size, 16);
        assert_eq!(parsed.common.http.body_limit_bytes, 64 * 1024);
    }

    /// A zero that would time out, expire or refuse everything at once is
    /// refused at start (exit 2), naming the flag; the server-side
    /// timeouts keep PostgreSQL's 0 (none).
    #[test]
    fn a_zero_limit_is_refused_naming_its_flag() {
        let parse = |flag: &str, value: &str| {
            try_parse_with_env_prefix::<TestCli, _, _>(
                "SVC_UNSET_IN_TESTS",
                "127.0.0.1:0",
                "127.0.0.1:0",
                ["svc", "--database-url", "postgresql://u@h/db", flag, value],
            )
        };
        for (flag, value) in [
            ("--pool-wait-timeout-ms", "0"),
            ("--connect-timeout-ms", "0"),
            ("--request-timeout-ms", "0"),
            ("--body-limit-bytes", "0"),
            ("--max-connections", "0"),
            ("--header-read-timeout", "0s"),
        ] {
            let err = parse(flag, value).expect_err(flag);
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{flag}"
            );
            assert_eq!(err.exit_code(), 2, "{flag}");
            let shown = err.render().to_string();
            assert!(shown.contains(flag), "{flag}: {shown}");
        }
        for flag in [
            "--statement-timeout-ms",
            "--lock-timeout-ms",
            "--idle-in-transaction-timeout-ms",
        ] {
            parse(flag, "0").unwrap_or_else(|e| panic!("{flag} 0 (none): {e}"));
        }
        let ok = parse("--max-connections", "1").expect("1 is a limit");
        assert_eq!(ok.common.http.listen.max_connections, 1);
    }

    #[test]
    fn database_url_is_required() {
        let err = try_parse_with_env_prefix::<TestCli, _, _>(
            "SVC_UNSET_IN_TESTS",
            "127.0.0.1:0",
            "127.0.0.1:0",
            ["svc"],
        )
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        let shown = err.render().to_string();
        assert!(
            shown.contains("tip: set --database-url or the environment variable SVC_UNSET_IN_TESTS_DATABASE_URL"),
            "{shown}"
        );
    }
}
