//! The routes file's validation: every mistake names the file, the
//! endpoint and the key.

use std::path::Path;

use super::*;

pub(crate) const GOOD: &str = r#"
unrouted = "skip"

[[endpoint]]
name = "billing"
url = "http://127.0.0.1:1/inbox"
event_types = ["OrderCreated", "Invoice*"]
secret_env = "BILLING_SECRET"
max_in_flight = 8
request_timeout = "2s"
probe_interval = "250ms"
poison_statuses = [400, 422]
max_lag = "10m"

[[endpoint]]
name = "audit-log_2"
url = "https://audit.example/inbox"
event_types = ["*"]
secret_file = "/etc/cdc-relay/audit"
previous_secret_env = "AUDIT_OLD"
"#;

pub(crate) fn parse(text: &str) -> Result<RoutesFile, RoutesError> {
    RoutesFile::parse(Path::new("/etc/routes.toml"), text)
}

fn problem(text: &str) -> (Option<String>, Option<String>, String) {
    let e = parse(text).expect_err("must be refused");
    let shown = e.to_string();
    assert!(
        shown.starts_with("routes file /etc/routes.toml: "),
        "{shown}"
    );
    (e.endpoint, e.key, e.problem)
}

pub(crate) fn with(extra: &str) -> String {
    format!(
        "[[endpoint]]\nname = \"a\"\nurl = \"http://x/\"\nevent_types = [\"T\"]\nsecret_env = \"S\"\n{extra}"
    )
}

#[test]
fn a_good_file_gives_endpoints_and_routes() {
    let f = parse(GOOD).unwrap();
    assert_eq!(f.unrouted, Unrouted::Skip);
    assert_eq!(f.endpoints.len(), 2);
    let b = &f.endpoints[0];
    assert_eq!(b.name, "billing");
    assert_eq!(b.secret, SecretRef::Env("BILLING_SECRET".into()));
    assert_eq!(b.max_in_flight, Some(8));
    assert_eq!(b.request_timeout, Some(Duration::from_secs(2)));
    assert_eq!(b.probe_interval, Some(Duration::from_millis(250)));
    assert_eq!(b.poison_statuses, Some(vec![400, 422]));
    let a = &f.endpoints[1];
    assert_eq!(a.secret, SecretRef::File("/etc/cdc-relay/audit".into()));
    assert_eq!(a.previous_secret, Some(SecretRef::Env("AUDIT_OLD".into())));
    assert_eq!(a.max_in_flight, None);
    // The endpoints' patterns, as the relay's router reads them.
    let r = crate::dispatch::Router::new(
        f.endpoints
            .iter()
            .map(|e| Some(e.event_types.clone()))
            .collect(),
        f.unrouted,
    );
    assert_eq!(r.matching("OrderCreated"), vec![0, 1]);
    assert_eq!(r.matching("Shipped"), vec![1]);
    assert_eq!(
        parse(&with("")).unwrap().unrouted,
        Unrouted::DeadLetter,
        "the default"
    );
}

#[test]
fn an_inline_secret_is_refused_with_what_to_write() {
    let (who, _, p) = problem(&with("secret = \"whsec_abc\""));
    assert_eq!(who.as_deref(), Some("endpoint \"a\""));
    assert!(
        p.contains("`secret`") && p.contains("secret_env") && p.contains("secret_file"),
        "{p}"
    );
}

#[test]
fn each_mistake_names_the_endpoint_and_the_key() {
    let cases: [(&str, Option<&str>, Option<&str>, &str); 18] = [
        ("not toml [", None, None, "not valid TOML"),
        (
            "[[endpoint]]\nname = \"a\"\nurl = \"http://x:0/\"\nevent_types = [\"T\"]\nsecret_env = \"S\"",
            Some("endpoint \"a\""),
            Some("url"),
            "port 0",
        ),
        (
            "[[endpoint]]\nname = \"a\"\nurl = \"ftp://x/\"\nevent_types = [\"T\"]\nsecret_env = \"S\"",
            Some("endpoint \"a\""),
            Some("url"),
            "must be http or https",
        ),
        (
            "unrouted = \"drop\"",
            None,
            Some("unrouted"),
            "\"dead-letter\" or \"skip\"",
        ),
        ("", None, Some("endpoint"), "at least one"),
        (
            "[[endpoint]]\nurl = \"http://x/\"",
            Some("endpoint #1"),
            Some("name"),
            "missing",
        ),
        (
            "[[endpoint]]\nname = \"Billing\"",
            Some("endpoint #1"),
            Some("name"),
            "a-z, 0-9",
        ),
        (
            &with("url2 = 1"),
            Some("endpoint \"a\""),
            None,
            "`url2`: unknown",
        ),
        (
            &with("max_in_flight = 0"),
            Some("endpoint \"a\""),
            Some("max_in_flight"),
            "from 1 to 4096",
        ),
        (
            &with("request_timeout = \"soon\""),
            Some("endpoint \"a\""),
            Some("request_timeout"),
            "not a duration",
        ),
        (
            &with("max_lag = \"-10s\""),
            Some("endpoint \"a\""),
            Some("max_lag"),
            "is negative",
        ),
        (
            &with("request_timeout = 4"),
            Some("endpoint \"a\""),
            Some("request_timeout"),
            "\"4s\"",
        ),
        (
            &with("probe_interval = \"10ms\""),
            Some("endpoint \"a\""),
            Some("probe_interval"),
            "below the minimum",
        ),
        (
            &with("max_lag = \"100000y\""),
            Some("endpoint \"a\""),
            Some("max_lag"),
            "3650 days",
        ),
        (
            &with("secret_file = \"/x\""),
            Some("endpoint \"a\""),
            Some("secret_file"),
            "not both",
        ),
        (
            "[[endpoint]]\nname = \"a\"\nurl = \"ftp://x/\"\nevent_types = [\"T\"]\nsecret_env = \"S\"",
            Some("endpoint \"a\""),
            Some("url"),
            "http or https",
        ),
        (
            "[[endpoint]]\nname = \"a\"\nurl = \"http://x/\"\nevent_types = []\nsecret_env = \"S\"",
            Some("endpoint \"a\""),
            Some("event_types"),
            "non-empty",
        ),
        (
            "[[endpoint]]\nname = \"a\"\nurl = \"http://x/\"\nevent_types = [\"T\"]",
            Some("endpoint \"a\""),
            Some("secret_env"),
            "missing",
        ),
    ];
    for (text, who, key, needle) in cases {
        let (w, k, p) = problem(text);
        assert_eq!(w.as_deref(), who, "{text}: {p}");
        assert_eq!(k.as_deref(), key, "{text}: {p}");
        assert!(p.contains(needle), "{text}: {p:?} lacks {needle:?}");
    }
}

#[test]
fn names_are_unique() {
    let text = format!("{}\n{}", with(""), with(""));
    let (who, key, p) = problem(&text);
    assert_eq!(
        (who.as_deref(), key.as_deref()),
        (Some("endpoint \"a\""), Some("name"))
    );
    assert!(p.contains("unique"), "{p}");
}

#[test]
fn a_missing_secret_variable_names_the_key_and_the_variable() {
    let f = parse(&with("").replace("\"S\"", "\"CDC_RELAY_TEST_UNSET_SECRET_VAR\"")).unwrap();
    let e = f.keys(&f.endpoints[0]).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("secret_env"));
    assert!(e.problem.contains("CDC_RELAY_TEST_UNSET_SECRET_VAR"), "{e}");
}

#[test]
fn rate_and_resume_are_read_and_checked() {
    let f = parse(&with("rate = 200\nresume = \"manual\"")).unwrap();
    assert_eq!(f.endpoints[0].rate, Some(200.0));
    assert!(!f.endpoints[0].auto_resume);
    let f = parse(&with("rate = 2.5")).unwrap();
    assert_eq!(f.endpoints[0].rate, Some(2.5));
    assert!(f.endpoints[0].auto_resume, "auto unless said");
    assert_eq!(parse(&with("")).unwrap().endpoints[0].rate, None);
    for bad in [
        "rate = 0",
        "rate = -1",
        "rate = 1e-20",
        "rate = nan",
        "rate = inf",
        "rate = \"fast\"",
        "rate = 2000000",
    ] {
        let e = parse(&with(bad)).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("rate"), "{bad}");
        assert!(e.problem.contains("requests per second"), "{e}");
    }
    let e = parse(&with("resume = \"sometimes\"")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("resume"));
    assert!(e.problem.contains("\"manual\""), "{e}");
}
