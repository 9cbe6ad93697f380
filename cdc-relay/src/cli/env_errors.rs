//! Errors of the command line that name where a value came from: an
//! environment variable the operator set, not a flag never typed (clap
//! names only the flag), and a negative value with a unit given to its
//! option's parser.

use super::Cli;

/// `argv` with an option's value that looks like a negative number with
/// a unit (`--request-timeout -1s`, `--batch-max-bytes -1KiB`) joined to
/// its option (`--request-timeout=-1s`), so that the option's parser
/// refuses it naming the flag: clap reads `-1s` as an unknown option
/// ("unexpected argument '-1' found"). Anything else is left as it is,
/// so `--sink-url --max-in-flight 4` still says the value is missing.
pub(super) fn negative_values_joined(
    command: &clap::Command,
    argv: Vec<std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let takes_value = |long: &str| {
        args_of(command, long)
            .iter()
            .any(|a| a.get_action().takes_values())
    };
    let mut out: Vec<std::ffi::OsString> = Vec::with_capacity(argv.len());
    let mut args = argv.into_iter().peekable();
    while let Some(arg) = args.next() {
        let joined = arg
            .to_str()
            .and_then(|a| a.strip_prefix("--"))
            .filter(|long| !long.contains('=') && takes_value(long));
        let next_negative = args.peek().and_then(|n| n.to_str()).is_some_and(|n| {
            n.strip_prefix('-')
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit() || c == '.'))
        });
        match (joined, next_negative) {
            (Some(_), true) => {
                let mut both = arg.clone();
                both.push("=");
                both.push(args.next().expect("peeked"));
                out.push(both);
            }
            _ => out.push(arg),
        }
    }
    out
}

/// The environment variable that gave `arg` its value, and that value:
/// its variable is set while the command line does not give its flag
/// (`--flag` or `--flag=…`).
pub(super) fn env_source(arg: &clap::Arg) -> Option<(String, String)> {
    let (env, long) = (arg.get_env()?, arg.get_long()?);
    let flag = format!("--{long}");
    let on_line = std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    let value = std::env::var_os(env).filter(|_| !on_line)?;
    Some((
        env.to_string_lossy().into_owned(),
        value.to_string_lossy().into_owned(),
    ))
}

/// For an error of a setting checked after parsing (`--request-timeout
/// must be shorter than --shutdown-timeout`), a line for each flag it
/// names whose value came from the environment, not the command line:
/// `--request-timeout came from CDC_RELAY_REQUEST_TIMEOUT`. Never the
/// value (it may be a secret). Empty when every flag named was typed, or
/// has no variable set.
pub fn environment_notes(message: &str) -> Vec<String> {
    let command = Cli::command();
    let mut seen = Vec::new();
    let mut notes = Vec::new();
    for (at, _) in message.match_indices("--") {
        let long: String = message[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if long.is_empty() || seen.contains(&long) {
            continue;
        }
        seen.push(long.clone());
        let args = args_of(&command, &long);
        if let Some((env, _)) = args.iter().find_map(|a| env_source(a)) {
            notes.push(format!(
                "--{long} came from the environment variable {env} (not given on the command line): fix or unset {env}"
            ));
        }
    }
    notes
}

/// Every argument of `command` and its subcommands whose long flag is
/// `long` (without its `--`).
fn args_of<'a>(command: &'a clap::Command, long: &str) -> Vec<&'a clap::Arg> {
    let mut found = Vec::new();
    let mut pending = vec![command];
    while let Some(cmd) = pending.pop() {
        found.extend(cmd.get_arguments().filter(|a| a.get_long() == Some(long)));
        pending.extend(cmd.get_subcommands());
    }
    found
}

/// The argument that clap's error text `shown` names (`--sink-url
/// <SINK_URL>`, or `--sink-url`): of the subcommands' arguments of that
/// name, one with an environment variable if any has one.
fn arg_named<'a>(command: &'a clap::Command, shown: &str) -> Option<&'a clap::Arg> {
    let long = shown.strip_prefix("--")?.split(' ').next()?;
    let args = args_of(command, long);
    args.iter()
        .find(|a| a.get_env().is_some())
        .or(args.first())
        .copied()
}

/// The environment variable, its flag and its value behind clap's `error`
/// when it refused a value (invalid, or empty) of an argument whose
/// variable is set while the command line does not give that flag: clap
/// names only the flag, which the operator never typed.
pub(super) fn env_behind(
    command: &clap::Command,
    error: &clap::Error,
) -> Option<(String, String, String)> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let Some(ContextValue::String(refused)) = error.get(ContextKind::InvalidArg) else {
        return None;
    };
    let arg = arg_named(command, refused)?;
    let (env, value) = env_source(arg)?;
    Some((env, format!("--{}", arg.get_long()?), value))
}

/// clap's "the argument X cannot be used with Y" when X or Y came from
/// the environment, not the command line: the same refusal, naming the
/// variable to unset. `None` when both were typed (clap's words stand).
pub(super) fn conflict_from_env(command: &clap::Command, error: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if error.kind() != ErrorKind::ArgumentConflict {
        return None;
    }
    let Some(ContextValue::String(first)) = error.get(ContextKind::InvalidArg) else {
        return None;
    };
    let Some(ContextValue::String(second)) = error.get(ContextKind::PriorArg) else {
        return None;
    };
    let name = |shown: &str| {
        let arg = arg_named(command, shown)?;
        let (env, _) = env_source(arg)?;
        Some((
            format!(
                "--{} (from the environment variable {env})",
                arg.get_long()?
            ),
            env,
        ))
    };
    let (a, b) = (name(first), name(second));
    if a.is_none() && b.is_none() {
        return None;
    }
    let shown = |n: &Option<(String, String)>, raw: &str| {
        n.as_ref().map_or_else(
            || raw.split(' ').next().unwrap_or(raw).to_owned(),
            |(s, _)| s.clone(),
        )
    };
    let unset: Vec<&str> = [&a, &b]
        .into_iter()
        .flatten()
        .map(|(_, env)| env.as_str())
        .collect();
    Some(format!(
        "error: {} cannot be used with {}: unset {} or drop the other",
        shown(&a, first),
        shown(&b, second),
        unset.join(" and ")
    ))
}
