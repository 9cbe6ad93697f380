//! How a URL is shown: the one display function every output surface
//! (logs, `status`, `routes check`, error messages) uses for a URL an
//! operator gave, so a credential in it never leaves the process.
//!
//! A URL carries secrets in two places: its userinfo (`user:password@`,
//! sent as `Authorization: Basic`, or a bare token in the user part) and its
//! query (`?token=…`, `?api_key=…`: many webhook receivers authenticate
//! that way). No rule tells a secret query value from a harmless one, so
//! every value is hidden; the keys stay, so the operator still sees which
//! URL it is. A fragment never goes on the wire but is hidden too.

/// What replaces a hidden part.
pub const HIDDEN: &str = "***";

/// `raw` with its userinfo, every query value and the fragment replaced by
/// [`HIDDEN`]: `https://u:p@h/inbox?token=t&v=2#f` →
/// `https://***@h/inbox?token=***&v=***#***`.
///
/// Works on text, not on a parsed URL, so that a string that failed to
/// parse (the very one an error message quotes) is hidden the same way:
/// the userinfo is whatever precedes the last `@` of the authority (the
/// text after `scheme://` up to the first `/`, `?` or `#`), as in RFC 3986
/// section 3.2. A string without `://` has no authority; its query and
/// fragment are still hidden.
pub fn url(raw: &str) -> String {
    let (head, rest) = match raw.split_once("://") {
        Some((scheme, rest)) if is_scheme(scheme) => (format!("{scheme}://"), rest),
        _ => return malformed(raw),
    };
    let mut out = head;
    let rest = {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        match authority.rsplit_once('@') {
            Some((_, host)) => {
                out.push_str(HIDDEN);
                out.push('@');
                out.push_str(host);
            }
            None => out.push_str(authority),
        }
        path
    };
    hide_query_and_fragment(out, rest)
}

/// A string without `scheme://` (a typo such as `http:/user:pw@host` or
/// `http//user:pw@host`): everything up to the last `@` before its query
/// may be userinfo, so it is hidden; the query and fragment as in [`url`].
fn malformed(raw: &str) -> String {
    let end = raw.find(['?', '#']).unwrap_or(raw.len());
    match raw[..end].rfind('@') {
        Some(at) => hide_query_and_fragment(format!("{HIDDEN}@"), &raw[at + 1..]),
        None => hide_query_and_fragment(String::new(), raw),
    }
}

/// `out` followed by `rest` (a path, query and fragment) with every query
/// value and the fragment hidden.
fn hide_query_and_fragment(mut out: String, rest: &str) -> String {
    let (before_fragment, fragment) = match rest.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (rest, None),
    };
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            out.push_str(&hidden_query(query));
        }
        None => out.push_str(before_fragment),
    }
    if let Some(f) = fragment {
        out.push('#');
        if !f.is_empty() {
            out.push_str(HIDDEN);
        }
    }
    out
}

/// `k=v&flag` → `k=***&***`: a piece without `=` may be a bare token.
fn hidden_query(query: &str) -> String {
    query
        .split('&')
        .map(|piece| match piece.split_once('=') {
            Some((key, "")) => format!("{key}="),
            Some((key, _)) => format!("{key}={HIDDEN}"),
            None if piece.is_empty() => String::new(),
            None => HIDDEN.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// RFC 3986 section 3.1: a letter, then letters, digits, `+`, `-`, `.`.
fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hides_userinfo_query_values_and_fragment() {
        assert_eq!(
            url("https://u:p%40ss@billing.internal:8443/inbox?token=t0k&v=2#frag"),
            "https://***@billing.internal:8443/inbox?token=***&v=***#***"
        );
        assert_eq!(url("http://tok@h/x"), "http://***@h/x");
        assert_eq!(url("http://h/x?abc123"), "http://h/x?***");
        assert_eq!(url("http://h/x?a=&b"), "http://h/x?a=&***");
    }

    #[test]
    fn leaves_a_url_without_secrets_as_it_is() {
        for plain in [
            "http://billing:8080/inbox",
            "https://h/",
            "http://[::1]:9/x",
        ] {
            assert_eq!(url(plain), plain);
        }
    }

    #[test]
    fn hides_them_in_a_string_that_is_not_a_valid_url() {
        // An empty host and a port out of range: the strings error
        // messages quote.
        assert_eq!(
            url("http://u:pw@/inbox?token=t"),
            "http://***@/inbox?token=***"
        );
        assert_eq!(url("http://u:pw@h:99999"), "http://***@h:99999");
        // The last `@` of the authority ends the userinfo (a password may
        // hold an unescaped `@`); an `@` in the path is not userinfo.
        assert_eq!(url("http://u:p@w@h/a@b"), "http://***@h/a@b");
        assert_eq!(url("not a url ?token=t"), "not a url ?token=***");
        // Typos in the scheme's separator: no `://`, the userinfo still
        // hidden (everything before the last `@` ahead of the query).
        assert_eq!(url("http:/u:pw@h:1/inbox"), "***@h:1/inbox");
        assert_eq!(url("http//u:pw@h/x?token=t"), "***@h/x?token=***");
        assert_eq!(url("http:u:pw@h"), "***@h");
    }

    proptest::proptest! {
        /// Whatever the password and token hold, neither survives.
        #[test]
        fn no_planted_secret_survives(
            password in "[A-Za-z0-9@:%._~!$&'()*+,;=-]{1,24}",
            token in "[A-Za-z0-9%._~!$'()*+,;:@/?-]{1,24}",
        ) {
            for sep in ["://", ":/", "//", ":"] {
                let shown = url(&format!("https{sep}user:{password}@h/inbox?x=1&token={token}"));
                proptest::prop_assert!(!shown.contains(&format!(":{password}")), "{}", shown);
                proptest::prop_assert!(shown.ends_with(&format!("&token={HIDDEN}")), "{}", shown);
            }
        }
    }
}
