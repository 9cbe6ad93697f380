//! Every accepted form and every refusal, with the setting it names.

use super::*;

/// 32 bytes of plain text.
const PLAIN: &str = "0123456789abcdef0123456789abcdef";
/// 24 bytes, the spec's minimum: base64 of "twenty-four-byte-key-abc".
const WHSEC_24: &str = "whsec_dHdlbnR5LWZvdXItYnl0ZS1rZXktYWJj";

fn value(v: &str) -> Source<'_> {
    Source {
        value: Some(v),
        file: None,
    }
}

fn load(current: Option<&str>, previous: Option<&str>) -> Result<EventKeys, SecretError> {
    EventKeys::load(
        current.map(value).unwrap_or_default(),
        previous.map(value).unwrap_or_default(),
    )
}

fn refused(current: Option<&str>, previous: Option<&str>) -> String {
    load(current, previous).unwrap_err().to_string()
}

#[test]
fn plain_secrets_are_their_bytes_and_whsec_secrets_their_decoded_bytes() {
    let plain = load(Some(PLAIN), None).unwrap();
    assert_eq!(plain.current().as_bytes(), PLAIN.as_bytes());
    assert!(plain.previous().is_none());
    let whsec = load(Some(WHSEC_24), None).unwrap();
    assert_eq!(whsec.current().as_bytes(), b"twenty-four-byte-key-abc");
    // The same key in both forms is the same key.
    let same = format!(
        "{WHSEC_PREFIX}{}",
        base64::engine::general_purpose::STANDARD.encode(PLAIN)
    );
    assert_eq!(load(Some(&same), None).unwrap(), plain);
}

#[test]
fn surrounding_whitespace_is_trimmed() {
    let keys = load(Some(&format!("  {PLAIN}\n")), None).unwrap();
    assert_eq!(keys.current().as_bytes(), PLAIN.as_bytes());
}

#[test]
fn short_secrets_are_refused_with_their_length_and_the_minimum() {
    let err = refused(Some("a"), None);
    assert!(err.starts_with("EVENT_SECRET is 1 bytes long"), "{err}");
    assert!(err.contains("at least 32"), "{err}");
    assert!(load(Some(&PLAIN[..31]), None).is_err());
    // 16 decoded bytes.
    let err = refused(Some("whsec_MDEyMzQ1Njc4OWFiY2RlZg=="), None);
    assert!(
        err.contains("EVENT_SECRET") && err.contains("decodes to 16 bytes"),
        "{err}"
    );
    assert!(err.contains("at least 24"), "{err}");
    let err = refused(Some(PLAIN), Some("short-previous"));
    assert!(
        err.starts_with("EVENT_SECRET_PREVIOUS is 14 bytes"),
        "{err}"
    );
}

#[test]
fn lists_are_refused_naming_the_previous_setting() {
    let err = refused(Some(&format!("{PLAIN},{PLAIN}x")), None);
    assert!(err.starts_with("EVENT_SECRET contains a comma"), "{err}");
    assert!(err.contains("EVENT_SECRET_PREVIOUS"), "{err}");
    let err = refused(Some(&format!("{PLAIN} {PLAIN}x")), None);
    assert!(err.starts_with("EVENT_SECRET contains whitespace"), "{err}");
    let err = refused(Some(PLAIN), Some(&format!("{PLAIN}x,{PLAIN}y")));
    assert!(
        err.starts_with("EVENT_SECRET_PREVIOUS contains a comma"),
        "{err}"
    );
    assert!(err.contains("new secret goes in EVENT_SECRET"), "{err}");
}

#[test]
fn ambiguous_forms_are_refused() {
    let err = refused(Some("whsec_not base64!"), None);
    assert!(err.contains("EVENT_SECRET"), "{err}");
    let err = refused(Some("whsec_dHdlbnR5LWZvdXItYnl0ZS1rZXktYWJj!"), None);
    assert!(err.contains("not padded standard base64"), "{err}");
    // Unpadded base64 is refused: JavaScript's official verifier refuses it too.
    let err = refused(Some("whsec_dHdlbnR5LWZvdXItYnl0ZS1rZXktYWJjZA"), None);
    assert!(err.contains("not padded standard base64"), "{err}");
    let err = refused(Some("WHSEC_dHdlbnR5LWZvdXItYnl0ZS1rZXktYWJj"), None);
    assert!(err.contains("lower-case whsec_"), "{err}");
    let err = refused(Some(PLAIN), Some(PLAIN));
    assert!(
        err.starts_with("EVENT_SECRET_PREVIOUS is the same key as EVENT_SECRET"),
        "{err}"
    );
    // The same key written the other way is still the same key.
    let same = format!(
        "{WHSEC_PREFIX}{}",
        base64::engine::general_purpose::STANDARD.encode(PLAIN)
    );
    assert!(load(Some(PLAIN), Some(&same)).is_err());
}

#[test]
fn missing_or_blank_current_secret_is_refused_and_a_blank_previous_is_none() {
    for (current, previous) in [(None, None), (Some("  "), None), (None, Some(PLAIN))] {
        let err = refused(current, previous);
        assert!(err.starts_with("no event secret configured"), "{err}");
        assert!(err.contains("EVENT_SECRET"), "{err}");
    }
    let keys = load(Some(PLAIN), Some(" ")).unwrap();
    assert!(keys.previous().is_none());
}

#[test]
fn files_hold_one_secret_and_an_empty_previous_file_means_none() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let current = write("current", &format!("\n{PLAIN}\r\n\n"));
    let previous = write("previous", &format!("{WHSEC_24}\n"));
    let empty = write("empty", "\n  \n");
    let two = write("two", &format!("{PLAIN}\n{PLAIN}x\n"));
    fn file(p: &std::path::Path) -> Source<'_> {
        Source {
            value: None,
            file: Some(p),
        }
    }

    let keys = EventKeys::load(file(&current), file(&previous)).unwrap();
    assert_eq!(keys.current().as_bytes(), PLAIN.as_bytes());
    assert_eq!(
        keys.previous().unwrap().as_bytes(),
        b"twenty-four-byte-key-abc"
    );
    assert_eq!(keys.iter().count(), 2);

    let keys = EventKeys::load(file(&current), file(&empty)).unwrap();
    assert!(keys.previous().is_none());

    let err = EventKeys::load(file(&empty), Source::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("no event secret configured: --event-secret-file / EVENT_SECRET_FILE ("),
        "{err}"
    );

    let err = EventKeys::load(file(&two), Source::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("--event-secret-file / EVENT_SECRET_FILE (")
            && err.contains("has 2 lines of text"),
        "{err}"
    );
    assert!(err.contains("EVENT_SECRET_PREVIOUS_FILE"), "{err}");

    let both = Source {
        value: Some(PLAIN),
        file: Some(&current),
    };
    let err = EventKeys::load(both, Source::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("EVENT_SECRET and EVENT_SECRET_FILE are both set"),
        "{err}"
    );

    let missing = dir.path().join("missing");
    let err = EventKeys::load(file(&current), file(&missing))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("--event-secret-previous-file / EVENT_SECRET_PREVIOUS_FILE ("),
        "{err}"
    );
}

#[test]
fn key_ids_are_stable_short_and_differ_between_keys() {
    let a = load(Some(PLAIN), None).unwrap();
    let b = load(Some(WHSEC_24), None).unwrap();
    let id = a.current().id().to_string();
    assert_eq!(id.len(), 8);
    assert_eq!(id, a.current().id().to_string());
    assert_ne!(id, b.current().id().to_string());
    assert!(!format!("{:?}", a.current()).contains(PLAIN));
    let both = EventKeys::new(a.current().clone(), Some(b.current().clone()));
    assert_eq!(
        both.describe(),
        format!("key {id}, previous key {}", b.current().id())
    );
}
