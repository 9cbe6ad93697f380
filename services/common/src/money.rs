//! The two money fields both services validate identically: an amount in
//! cents and an ISO-4217-shaped currency code.

use serde_json::Value;

/// `value` as a positive amount in cents: a JSON integer in `1..=i64::MAX`.
///
/// JSON numbers that are not integers are refused even when integral
/// (`1.0`, `1e3`), and so are strings (`"12"`) and integers beyond `i64`
/// (serde_json reads those as `u64` or `f64`, never silently truncated).
/// The error is the reason, for the response's `detail`.
pub fn amount_cents(value: Option<&Value>) -> Result<i64, &'static str> {
    match value {
        None | Some(Value::Null) => Err("required"),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => match n.as_i64() {
            Some(cents) if cents >= 1 => Ok(cents),
            Some(_) => Err("must be at least 1"),
            None => Err("must fit a signed 64-bit integer"),
        },
        Some(_) => Err("must be a JSON integer"),
    }
}

/// True for exactly three upper-case ASCII letters (`EUR`).
pub fn is_currency_code(code: &str) -> bool {
    code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn amount(json: &str) -> Result<i64, &'static str> {
        let value: Value = serde_json::from_str(json).expect("json");
        amount_cents(Some(&value))
    }

    #[test]
    fn only_positive_json_integers_within_i64() {
        assert_eq!(amount("2599"), Ok(2599));
        assert_eq!(amount("9223372036854775807"), Ok(i64::MAX));
        assert!(amount("9223372036854775808").is_err());
        assert!(amount("99999999999999999999999").is_err());
        for bad in [
            "0", "-1", "1.5", "1.0", "1e3", "\"12\"", "true", "[1]", "null",
        ] {
            assert!(amount(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(amount_cents(None), Err("required"));
    }

    #[test]
    fn currency_code_is_three_upper_ascii_letters() {
        assert!(is_currency_code("EUR"));
        for bad in ["eur", "EU", "EURO", "E1R", "ÉUR", "", "EU "] {
            assert!(!is_currency_code(bad), "{bad} accepted");
        }
    }
}
