//! Reading a libpq connection string: a URL's query or a key/value
//! string's pairs, and the string without the parameters the relay reads
//! itself (PostgreSQL docs, "libpq — Connection Strings").

/// `%XX` escapes of a URL query key or value decoded.
pub(super) fn percent_decode(v: &str) -> String {
    percent_encoding::percent_decode_str(v)
        .decode_utf8_lossy()
        .into_owned()
}

/// Whether `s` is a libpq URI (`postgresql://` or `postgres://`, as libpq
/// recognises one); anything else is a key/value string, even with `://`
/// inside a value.
pub fn is_url(s: &str) -> bool {
    s.starts_with("postgresql://") || s.starts_with("postgres://")
}

/// A URL split as libpq splits it: the part before the query, the hosts of
/// its authority (without the credentials), and the query. Credentials
/// run to an `@` before the first `/`, so a `?` or `/`-free `@` inside a
/// password does not start the query. `None` for a key/value string.
fn url_parts(url: &str) -> Option<(&str, &str, Option<&str>)> {
    if !is_url(url) {
        return None;
    }
    let scheme_end = url.find("://")? + 3;
    let rest = &url[scheme_end..];
    let after_credentials = match rest.find(['@', '/']) {
        Some(i) if rest[i..].starts_with('@') => scheme_end + i + 1,
        _ => scheme_end,
    };
    let tail = &url[after_credentials..];
    let hosts = tail.split(['/', '?']).next().unwrap_or_default();
    match tail.find('?') {
        Some(q) => Some((&url[..after_credentials + q], hosts, Some(&tail[q + 1..]))),
        None => Some((url, hosts, None)),
    }
}

/// Parameters read here that tokio-postgres would reject (or read
/// differently).
const OWN_PARAMS: [&str; 12] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "channel_binding",
    "sslnegotiation",
    "target_session_attrs",
    "requiressl",
];

/// The string without [`OWN_PARAMS`] (a key/value string is rebuilt with
/// libpq's quoting).
pub(super) fn strip_own_params(url: &str) -> String {
    let own = |k: &str| OWN_PARAMS.contains(&k);
    if let Some((base, _, query)) = url_parts(url) {
        return match query {
            Some(q) => {
                let rest: Vec<&str> = q
                    .split('&')
                    .filter(|kv| !own(&percent_decode(kv.split('=').next().unwrap_or(""))))
                    .collect();
                if rest.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", rest.join("&"))
                }
            }
            None => url.to_owned(),
        };
    }
    match key_values(url) {
        Some(pairs) => pairs
            .iter()
            .filter(|(k, _)| !own(k))
            .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(" "),
        // Not parseable: tokio-postgres says why.
        None => url.to_owned(),
    }
}

/// A key/value connection string's pairs as libpq reads them (PostgreSQL
/// docs, "libpq — Connection Strings"): `key = value`, spaces around `=`
/// allowed, a value single-quoted with `\'` and `\\` escapes inside, or
/// unquoted up to the next space (backslash escapes too). `None` when it
/// does not parse.
pub(super) fn key_values(s: &str) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(pairs);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') || key.is_empty() {
            return None;
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next()? {
                    '\'' => break,
                    '\\' => value.push(chars.next()?),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    value.push(chars.next()?);
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// The connection string's parameters: a URL's query (percent-decoded) or
/// a key/value string's pairs.
fn params(url: &str) -> Vec<(String, String)> {
    if let Some((_, _, query)) = url_parts(url) {
        let Some(q) = query else {
            return Vec::new();
        };
        return q
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (percent_decode(k), percent_decode(v)))
            .collect();
    }
    key_values(url).unwrap_or_default()
}

/// A parameter the connection string gives twice, as `(key, first value,
/// last value)`: libpq takes the last value, tokio-postgres (which reads
/// the rest of the string) another host or port for `host` and `port`,
/// and this module the first, so the string is refused instead of read
/// three ways. A URL's `host` or `port` in the query beside one in its
/// authority (`postgresql://h:5432/db?host=other`) counts as given twice.
pub(super) fn repeated_param(url: &str) -> Option<(String, String, String)> {
    let mut seen: Vec<(String, String)> = Vec::new();
    if let Some(hosts) = authority_hosts(url) {
        seen.push(("host".into(), format!("{hosts} (in the URL's authority)")));
        if with_port(hosts) {
            seen.push(("port".into(), format!("{hosts} (in the URL's authority)")));
        }
    }
    for (k, v) in params(url) {
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == k) {
            return Some((k, first.clone(), v));
        }
        seen.push((k, v));
    }
    None
}

/// What is wrong with a URL's query that libpq refuses and the parsers
/// would pass over: an empty parameter (`&&`, a trailing `&`) or one
/// without `=` (`?sslmode`, which would leave the default in force); or
/// a key/value string libpq cannot read (an unterminated quote, a word
/// without `=`), whose TLS parameters would otherwise be lost and a
/// neighbouring one blamed.
pub(super) fn malformed_query(url: &str) -> Option<String> {
    if !is_url(url) {
        return key_values(url).is_none().then(|| {
            "the key/value connection string does not read as libpq reads it: a quoted value \
             without its closing ', a trailing \\, or a word without =value"
                .to_owned()
        });
    }
    if url.contains("%00") {
        return Some("a percent-encoded NUL (%00) in the URL, which libpq refuses".to_owned());
    }
    let bytes = url.as_bytes();
    let bad_escape = bytes.iter().enumerate().any(|(i, &b)| {
        b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    });
    if bad_escape {
        // The text is not repeated: the escape may be in the password.
        return Some(
            "a % in the URL not followed by two hexadecimal digits (libpq refuses it): write a \
             literal % as %25"
                .to_owned(),
        );
    }
    let query = url_parts(url)?.2?;
    if query.is_empty() {
        return None;
    }
    query.split('&').find_map(|kv| {
        if kv.is_empty() {
            Some("an empty parameter (`&&` or a trailing `&`) in the URL's query".to_owned())
        } else if !kv.contains('=') {
            Some(format!(
                "{kv} in the URL's query has no value: write {kv}=…"
            ))
        } else {
            None
        }
    })
}

/// A URL's hosts as its authority gives them (`h1:5432,h2`), without the
/// user; `None` for a key/value string or a URL without a host there.
fn authority_hosts(url: &str) -> Option<&str> {
    let hosts = url_parts(url)?.1;
    (!hosts.is_empty()).then_some(hosts)
}

/// Whether an authority's hosts carry a port (`h:5432`, `[::1]:5432`).
fn with_port(hosts: &str) -> bool {
    hosts.contains("]:") || (!hosts.starts_with('[') && hosts.contains(':'))
}

/// Whether the connection string names a port: in a URL's authority, or
/// as a `port` parameter.
pub(super) fn gives_port(url: &str) -> bool {
    authority_hosts(url).is_some_and(with_port) || query_param(url, "port").is_some()
}

/// A parameter of the URL's query (`?a=b&c=d`) or of a key/value string
/// (`a=b c='d e'`), decoded.
pub(super) fn query_param(url: &str, key: &str) -> Option<String> {
    params(url)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::{ConnParams, RootCert, SslMode};
    use super::*;

    #[test]
    fn urls_and_key_value_strings_are_told_apart_and_split_as_libpq_does() {
        // A value holding :// does not make a key/value string a URL.
        let kv = "host=h sslmode=require application_name=a://b";
        assert_eq!(query_param(kv, "sslmode").as_deref(), Some("require"));
        // A ? in the password is not the query's start.
        let url = "postgres://q:p?w@h:5432/d?sslmode=require";
        assert_eq!(query_param(url, "sslmode").as_deref(), Some("require"));
        assert_eq!(authority_hosts(url), Some("h:5432"));
        assert_eq!(strip_own_params(url), "postgres://q:p?w@h:5432/d");
        assert_eq!(query_param("postgres://h/d?a=1", "a").as_deref(), Some("1"));
        assert_eq!(authority_hosts("postgres:///d?host=/tmp"), None);
    }

    #[test]
    fn a_query_parameter_without_a_value_is_found() {
        for url in [
            "postgresql://u@h/d?sslmode",
            "postgresql://u@h/d?sslmode=require&&sslrootcert=/a",
            "postgresql://u@h/d?sslmode=require&",
            "host=h sslmode",
            "postgresql://u@h/d?sslmode=disable%00",
            "postgresql://u:p%zz@h/d",
            "postgresql://u@h/d?application_name=a%2",
        ] {
            assert!(malformed_query(url).is_some(), "{url}");
        }
        for url in [
            "postgresql://u@h/d",
            "postgresql://u@h/d?",
            "postgresql://u@h/d?sslmode=require&application_name=",
            "postgresql://u:p%25w@h/d?application_name=a%20b",
        ] {
            assert_eq!(malformed_query(url), None, "{url}");
        }
    }

    #[test]
    fn a_parameter_given_twice_is_found() {
        for (url, key) in [
            (
                "postgresql://u@h/d?sslmode=disable&sslrootcert=/ca.pem&sslmode=verify-full",
                "sslmode",
            ),
            (
                "postgresql://u@h/d?sslrootcert=/a&sslrootcert=/b",
                "sslrootcert",
            ),
            ("postgresql://u@h:5432/d?host=127.0.0.1", "host"),
            ("postgresql://u@h:5432/d?port=6000", "port"),
            ("postgresql://u@[::1]:5432/d?port=6000", "port"),
            ("host=a sslmode=disable host=b", "host"),
            ("host=a sslmode=require sslmode='verify-full'", "sslmode"),
        ] {
            assert_eq!(
                repeated_param(url).map(|(k, _, _)| k).as_deref(),
                Some(key),
                "{url}"
            );
        }
        for url in [
            "postgresql://u@h/d?sslmode=verify-full&sslrootcert=/ca.pem",
            "postgresql://u@h1:5432,h2:5433/d?sslmode=require",
            "postgresql://u@[::1]/d?port=6000",
            "postgresql:///d?host=/var/run/postgresql&port=5433",
            "postgresql://u@h/d?user=v",
            "host=a port=1 sslmode=require",
        ] {
            assert_eq!(repeated_param(url), None, "{url}");
        }
    }

    #[test]
    fn key_value_strings_are_read_with_libpq_quoting() {
        let kv = r"host=h user=u dbname = d sslrootcert='/tmp/sp ace/ca%.crt' sslcert=/a\ b/c.pem";
        assert_eq!(
            query_param(kv, "sslrootcert").as_deref(),
            Some("/tmp/sp ace/ca%.crt")
        );
        assert_eq!(query_param(kv, "sslcert").as_deref(), Some("/a b/c.pem"));
        assert_eq!(query_param(kv, "dbname").as_deref(), Some("d"));
        assert!(key_values("host='unterminated").is_none());
        let unterminated = "host=h sslmode=verify-full sslrootcert='/ca.pem";
        assert!(
            malformed_query(unterminated).is_some_and(|m| m.contains("closing '")),
            "{unterminated}"
        );
        assert_eq!(malformed_query("host=h sslrootcert='/a b.pem'"), None);
        let q = r"host=h user=u sslmode=verify-ca sslrootcert='/tmp/x y/ca.pem' application_name='a \'b\''";
        assert_eq!(query_param(q, "application_name").as_deref(), Some("a 'b'"));
        let stripped = strip_own_params(q);
        assert!(
            !stripped.contains("sslrootcert") && !stripped.contains("sslmode"),
            "{stripped}"
        );
        let c = ConnParams::parse(q, Duration::from_secs(1)).unwrap();
        assert_eq!(
            c.ssl_root_cert,
            Some(RootCert::File("/tmp/x y/ca.pem".into()))
        );
        assert_eq!(c.sslmode, SslMode::VerifyCa);
        // A URL's values are percent-decoded.
        assert_eq!(
            query_param(
                "postgres://u@h/d?sslrootcert=%2Fa%20b%25.pem",
                "sslrootcert"
            )
            .as_deref(),
            Some("/a b%.pem")
        );
    }
}
