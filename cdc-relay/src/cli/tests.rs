//! The command line's parsers and help.
use super::*;

#[test]
fn help_groups_flags_under_headings_and_shows_no_env_values() {
    let mut cmd = Cli::command();
    cmd.build(); // propagates the global flags to the subcommands
    let run = cmd.find_subcommand_mut("run").expect("run");
    let help = run.render_long_help().to_string();
    // heading -> the lines under it, up to the next heading.
    let mut sections: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        match line.strip_suffix(':') {
            Some(h) if !line.starts_with(' ') && !h.contains(' ') || h == "Slot and outbox" => {
                sections.push((h.to_owned(), String::new()));
            }
            _ => {
                if let Some((_, body)) = sections.last_mut() {
                    body.push_str(line);
                    body.push('\n');
                }
            }
        }
    }
    for (flag, heading) in [
        ("--sink-url", "Sink"),
        ("--event-secret", "Signing"),
        ("--max-in-flight", "Delivery"),
        ("--shutdown-timeout", "Relay"),
        ("--database-url", "Database"),
        ("--slot", "Slot and outbox"),
        ("--log-format", "Logging"),
    ] {
        let (_, body) = sections
            .iter()
            .find(|(h, _)| h == heading)
            .unwrap_or_else(|| panic!("heading {heading:?} in:\n{help}"));
        assert!(
            body.contains(&format!("      {flag} ")),
            "{flag} under {heading}:\n{help}"
        );
    }
    assert!(help.contains("[env: CDC_RELAY_SINK_URL]"), "{help}");
    assert!(
        !help.contains("=]"),
        "no env value or trailing '=':\n{help}"
    );
}

fn help_of(path: &[&str]) -> String {
    let mut argv = vec!["cdc-relay"];
    argv.extend_from_slice(path);
    argv.push("--help");
    let err = Cli::command().try_get_matches_from(argv).unwrap_err();
    assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
    err.to_string()
}

#[test]
fn each_subcommand_shows_only_the_flags_it_reads() {
    let shows = |path: &[&str], flag: &str| help_of(path).contains(&format!(" {flag} "));
    for (path, shown, hidden) in [
        (
            &["completions"][..],
            &[][..],
            &["--database-url", "--log"][..],
        ),
        (
            &["dead-letter", "list"],
            &["--database-url", "--log-format"],
            &["--slot", "--table", "--standby-url"],
        ),
        (
            &["backfill"],
            &["--database-url", "--table", "--id-column"],
            &["--slot", "--publication", "--standby-url"],
        ),
        (
            &["setup"],
            &["--slot", "--publication", "--table"],
            &["--standby-url"],
        ),
        (&["status"], &["--slot", "--standby-url", "--table"], &[]),
        (&["run"], &["--slot", "--standby-url", "--table"], &[]),
    ] {
        for flag in shown {
            assert!(
                shows(path, flag),
                "{path:?} shows {flag}:\n{}",
                help_of(path)
            );
        }
        for flag in hidden {
            assert!(
                !shows(path, flag),
                "{path:?} hides {flag}:\n{}",
                help_of(path)
            );
        }
    }
    // Hidden, not refused: one set of flags serves every command.
    let cli = Cli::try_parse_from([
        "cdc-relay",
        "--slot",
        "s2",
        "dead-letter",
        "--table",
        "t2",
        "list",
    ])
    .expect("hidden global flags are accepted");
    assert_eq!(
        (
            cli.global.slot.as_str(),
            cli.global.table.to_string().as_str()
        ),
        ("s2", "public.t2")
    );
}

#[test]
fn a_required_setting_is_never_one_an_environment_variable_could_give() {
    // clap's "required argument" error names only the flag; a setting
    // with an environment variable is checked where the error can name
    // both (`--sink-url (or CDC_RELAY_SINK_URL) is required`).
    fn walk(cmd: &clap::Command, path: &str) {
        for a in cmd.get_arguments() {
            assert!(
                !(a.is_required_set() && a.get_env().is_some()),
                "{path} {:?} is required by clap but has an env var",
                a.get_id()
            );
        }
        for sub in cmd.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()));
        }
    }
    let mut cmd = Cli::command();
    cmd.build();
    walk(&cmd, "cdc-relay");
    let cli = Cli::try_parse_from(["cdc-relay", "run"]).expect("parses without --sink-url");
    let Command::Run(run) = cli.command else {
        panic!("run")
    };
    let err = run.sink.build().unwrap_err();
    assert!(
        err.contains("--sink-url") && err.contains("CDC_RELAY_SINK_URL"),
        "{err}"
    );
}

#[test]
fn cli_is_consistent() {
    Cli::command().debug_assert();
}

fn run_args(extra: &[&str]) -> Result<Cli, clap::Error> {
    let mut argv = vec!["cdc-relay", "run", "--sink-url", "http://127.0.0.1:1/inbox"];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv)
}

#[test]
fn syntax_errors_name_the_flag() {
    assert!(run_args(&[]).is_ok());
    let err = run_args(&["--max-in-flight", "0"]).unwrap_err().to_string();
    assert!(err.contains("--max-in-flight"), "{err}");
    for flag in [
        "--connect-timeout",
        "--sink-connect-timeout",
        "--request-timeout",
    ] {
        let err = run_args(&[flag, "0s"]).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{flag}");
        assert!(err.to_string().contains(flag), "{flag}: {err}");
    }
    // The routes file's range for batch_max_bytes, 1KiB to 16MiB.
    for ok in ["1KiB", "16MiB"] {
        assert!(run_args(&["--batch-max-bytes", ok]).is_ok(), "{ok}");
    }
    for bad in ["1", "1023", "16777217", "3GiB"] {
        let err = run_args(&["--batch-max-bytes", bad]).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{bad}");
        assert!(
            err.to_string().contains("--batch-max-bytes"),
            "{bad}: {err}"
        );
    }
    let err = run_args(&["--backoff-cap", "soon"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--backoff-cap"), "{err}");
    for bad in ["http:///inbox", "http:inbox", "https://", "not a url"] {
        let argv = [
            "cdc-relay",
            "run",
            "--sink-url",
            bad,
            "--max-in-flight",
            "1",
        ];
        let err = Cli::try_parse_from(argv).unwrap_err().to_string();
        assert!(err.contains("--sink-url"), "{bad}: {err}");
    }
}

/// A blank `--note` is refused by clap naming the flag (exit 2), like any
/// bad value, not by the command after it connected (exit 1).
#[test]
fn a_blank_discard_note_is_refused_naming_the_flag() {
    let discard = |note| {
        Cli::try_parse_from([
            "cdc-relay",
            "dead-letter",
            "discard",
            "--all",
            "--note",
            note,
        ])
    };
    for note in ["", "  ", "\t"] {
        let err = discard(note).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{note:?}");
        assert!(err.to_string().contains("--note"), "{note:?}: {err}");
    }
    assert!(discard("duplicate of #42").is_ok());
}

/// A blank dead-letter filter is refused naming the flag (exit 2): an unset
/// shell variable in `discard --reason "$R" --yes` would otherwise select
/// (and drop) every row, while `--type ''` selected none.
#[test]
fn a_blank_dead_letter_filter_is_refused_naming_the_flag() {
    for (flag, named) in [
        ("--type", "--type"),
        ("--reason", "--reason"),
        ("--error-contains", "--reason"),
        ("--since", "--since"),
        ("--until", "--until"),
        ("--aggregate", "--aggregate"),
        ("--endpoint", "--endpoint"),
    ] {
        for command in ["list", "discard"] {
            let argv = [
                "cdc-relay",
                "dead-letter",
                command,
                flag,
                " ",
                "--note",
                "n",
            ];
            let argv = if command == "list" {
                &argv[..5]
            } else {
                &argv[..]
            };
            let err = Cli::try_parse_from(argv).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{command} {flag}");
            assert!(err.to_string().contains(named), "{command} {flag}: {err}");
        }
    }
    assert!(
        Cli::try_parse_from(["cdc-relay", "dead-letter", "list", "--reason", "http_422"]).is_ok()
    );
}

/// A negative value with a unit after a space is the option's value, so
/// its parser refuses it naming the flag (clap read `-1s` as an unknown
/// option); a missing value is still named as missing.
#[test]
fn a_negative_value_with_a_unit_is_refused_by_the_flags_parser() {
    let parse = |argv: &[&str]| {
        let command = Cli::command();
        let argv = super::negative_values_joined(&command, argv.iter().map(Into::into).collect());
        command.try_get_matches_from(argv).unwrap_err().to_string()
    };
    for (argv, says) in [
        (
            &["cdc-relay", "run", "--request-timeout", "-1s"][..],
            "'-1s' for '--request-timeout",
        ),
        (
            &["cdc-relay", "run", "--batch-max-bytes", "-1KiB"][..],
            "'-1KiB' for '--batch-max-bytes",
        ),
        (
            &["cdc-relay", "run", "--backoff-cap", "-.5s"][..],
            "'-.5s' for '--backoff-cap",
        ),
        (
            &["cdc-relay", "run", "--sink-url", "--max-in-flight", "4"][..],
            "a value is required for '--sink-url",
        ),
    ] {
        let err = parse(argv);
        assert!(err.contains(says), "{argv:?}: {err}");
    }
}

/// A negative number given after a space is the flag's value, refused by
/// its parser naming the flag and the range (clap's default read it as
/// an unknown option: "unexpected argument '-1' found").
#[test]
fn a_negative_number_is_refused_as_the_flags_value() {
    for argv in [
        &["cdc-relay", "run", "--max-in-flight", "-1"][..],
        &["cdc-relay", "run", "--batch-max-events", "-5"][..],
        &["cdc-relay", "dead-letter", "replay", "--rate", "-3"][..],
    ] {
        let err = Cli::try_parse_from(argv).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "invalid value '{}' for '{}",
                argv[argv.len() - 1],
                argv[argv.len() - 2]
            )),
            "{argv:?}: {err}"
        );
    }
}

#[test]
fn sizes_and_durations_parse() {
    assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
    assert_eq!(parse_bytes("1024"), Ok(1024));
    assert!(parse_bytes("5GiB").is_err());
    assert_eq!(parse_size("4GiB"), Ok(4 << 30));
    assert_eq!(parse_size("1TiB"), Ok(1 << 40));
    assert!(parse_bytes("0").is_err());
    assert!(parse_bytes("12 parsecs").is_err());
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("3650d"), Ok(crate::clock::MAX_SETTING));
    // Larger would overflow a monotonic instant where the relay adds it.
    let err = parse_duration("3651d").unwrap_err();
    assert!(err.contains("3650 days"), "{err}");
    assert!(parse_timeout("500000000y").is_err());
    // A negative value says so (humantime's own words were "expected
    // number at 0"), as does a value that is no duration at all.
    for negative in ["-1s", " -5m"] {
        let err = parse_duration(negative).unwrap_err();
        assert!(err.contains("is negative"), "{negative}: {err}");
    }
    let err = parse_duration("soon").unwrap_err();
    assert!(err.contains("\"soon\" is not a duration"), "{err}");
    let argv = [
        "cdc-relay",
        "run",
        "--sink-url",
        "http://127.0.0.1:8081/inbox",
        "--probe-interval",
        "100000y",
    ];
    let err = Cli::try_parse_from(argv).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    let err = err.to_string();
    assert!(
        err.contains("--probe-interval") && err.contains("3650 days"),
        "{err}"
    );
}

#[test]
fn a_zero_retention_window_is_refused_naming_the_flag() {
    // A window of 0 deleted rows delivered a moment ago (it was accepted).
    let prune = |age: &str| Cli::try_parse_from(["cdc-relay", "prune", "--older-than", age]);
    for (flag, result) in [
        ("--older-than", prune("0s")),
        (
            "--prune-older-than",
            run_args(&["--prune-older-than", "0s"]),
        ),
    ] {
        let err = result.unwrap_err();
        assert_eq!(err.exit_code(), 2, "{flag}");
        let err = err.to_string();
        assert!(
            err.contains(flag) && err.contains("must be above 0") && err.contains("7d"),
            "{flag}: {err}"
        );
    }
    assert!(prune("1s").is_ok());
    assert!(run_args(&["--prune-older-than", "1s"]).is_ok());
}

#[test]
fn a_bad_url_names_the_flag_it_came_from() {
    let good = "postgres://relay:pw@127.0.0.1:5432/orders";
    let bad = "postgres://relay:pw@127.0.0.1:5432/orders?sslmode=require&sslcrl=/crl.pem";
    for (flag, own, other) in [
        ("--database-url", "--database-url", "--replication-url"),
        ("--replication-url", "--replication-url", "--database-url"),
        ("--standby-url", "--standby-url", "--database-url"),
    ] {
        let mut argv = vec!["cdc-relay", "--database-url", good, "status"];
        if flag == "--database-url" {
            argv[2] = bad;
        } else {
            argv.extend([flag, bad]);
        }
        let cli = Cli::try_parse_from(argv).expect("parses");
        let err = match flag {
            "--database-url" => cli.global.conn().map(drop),
            "--replication-url" => cli.global.replication_conn().map(drop),
            _ => cli.global.standbys().map(drop),
        }
        .unwrap_err();
        assert!(
            err.contains(&format!("invalid {own}"))
                && err.contains("sslcrl")
                && !err.contains(other),
            "{flag}: {err}"
        );
    }
}

#[test]
fn an_empty_optional_url_is_unset() {
    let good = "postgres://relay:pw@127.0.0.1:5432/orders";
    let argv = [
        "cdc-relay",
        "--database-url",
        good,
        "status",
        "--replication-url",
        "",
        "--standby-url",
        " ",
    ];
    let cli = Cli::try_parse_from(argv).expect("parses");
    assert_eq!(cli.global.replication_conn().map(|c| c.is_none()), Ok(true));
    assert_eq!(cli.global.standbys().map(|s| s.len()), Ok(0));
}

#[test]
fn an_impossible_slot_name_is_a_usage_error() {
    for bad in ["", "Bad-Name", "slot!", &"s".repeat(64)] {
        let err = Cli::try_parse_from(["cdc-relay", "status", "--slot", bad])
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("--slot") && err.contains("lower-case"),
            "{bad:?}: {err}"
        );
    }
    assert!(Cli::try_parse_from(["cdc-relay", "status", "--slot", "cdc_relay_2"]).is_ok());
}

#[test]
fn names_no_database_object_could_have_are_bad_configuration() {
    // Each was looked up and reported missing (exit 3, "run setup"):
    // they are typos in the flag, exit 2 naming it.
    let long = "x".repeat(64);
    for (flag, value) in [
        ("--publication", ""),
        ("--publication", "a,"),
        ("--publication", ",a"),
        ("--publication", "a, b"),
        ("--publication", long.as_str()),
        ("--id-column", ""),
        ("--id-column", " id"),
        ("--type-column", ""),
        ("--payload-column", long.as_str()),
        ("--aggregate-column", "key "),
        ("--trace-column", long.as_str()),
        ("--table", "public."),
        ("--table", "public. outbox"),
        ("--table", &format!("public.{long}")),
    ] {
        let err = Cli::try_parse_from(["cdc-relay", "run", flag, value])
            .expect_err(&format!("{flag} {value:?} is refused"));
        assert_eq!(err.exit_code(), 2, "{flag} {value:?}: {err}");
        assert!(err.to_string().contains(flag), "{flag} named: {err}");
    }
    let cli = Cli::try_parse_from([
        "cdc-relay",
        "run",
        "--publication",
        "a,b_2",
        "--aggregate-column",
        "",
        "--trace-column",
        "",
        "--id-column",
        &"y".repeat(63),
    ])
    .expect("names PostgreSQL keeps, and empty where it disables");
    assert_eq!(cli.global.publication, ["a", "b_2"]);
    assert_eq!(cli.global.aggregate_column, "");
    assert_eq!(cli.global.trace_column.as_deref(), Some(""));
}

#[test]
fn the_default_runtime_leaves_one_cpu_to_postgresql() {
    assert_eq!(
        [0, 1, 2, 3, 8].map(super::default_worker_threads),
        [1, 1, 1, 2, 7]
    );
}
