//! The `POST /orders` command and its validation (the tutorial's rules:
//! amount a positive integer, currency three letters, upper-cased).

use serde_json::{Value, json};
use service_common::ServiceError;
use service_common::money::{amount_cents, is_currency_code};
use uuid::Uuid;

/// The error code of every validation failure.
const INVALID: &str = "invalid_order";

/// A validated order command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewOrder {
    /// Amount in cents (minor units), at least 1.
    pub amount_cents: i64,
    /// Three upper-case ASCII letters, e.g. `EUR`.
    pub currency: String,
}

impl NewOrder {
    /// Validates `{"amount_cents": <int>, "currency": "<3 letters>"}`; the
    /// currency is upper-cased first (`eur` → `EUR`). Unknown keys are ignored.
    /// Errors are 422 `invalid_order` naming the first bad field.
    pub fn from_json(body: &Value) -> Result<Self, ServiceError> {
        let Value::Object(fields) = body else {
            return Err(ServiceError::invalid_field(
                INVALID,
                "body",
                "expected a JSON object",
            ));
        };
        let amount_cents = amount_cents(fields.get("amount_cents"))
            .map_err(|reason| ServiceError::invalid_field(INVALID, "amount_cents", reason))?;
        let currency = match fields.get("currency") {
            Some(Value::String(code)) => code.to_ascii_uppercase(),
            _ => {
                return Err(ServiceError::invalid_field(
                    INVALID,
                    "currency",
                    "must be a string",
                ));
            }
        };
        if !is_currency_code(&currency) {
            return Err(ServiceError::invalid_field(
                INVALID,
                "currency",
                "must be three letters",
            ));
        }
        Ok(Self {
            amount_cents,
            currency,
        })
    }

    /// The `OrderCreated` outbox payload: `{"order_id","amount_cents","currency"}`
    /// with the amount as a JSON integer.
    pub fn event_payload(&self, order_id: Uuid) -> Value {
        json!({
            "order_id": order_id,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<NewOrder, ServiceError> {
        NewOrder::from_json(&serde_json::from_str(json).expect("json"))
    }

    #[test]
    fn accepts_and_upper_cases_currency() {
        let order = parse(r#"{"amount_cents":2599,"currency":"eur","note":"x"}"#).expect("valid");
        assert_eq!(
            order,
            NewOrder {
                amount_cents: 2599,
                currency: "EUR".into()
            }
        );
    }

    #[test]
    fn names_the_bad_field() {
        let field = |json| parse(json).unwrap_err().field().map(str::to_owned);
        assert_eq!(
            field(r#"{"amount_cents":1.5,"currency":"EUR"}"#).as_deref(),
            Some("amount_cents")
        );
        assert_eq!(
            field(r#"{"currency":"EUR"}"#).as_deref(),
            Some("amount_cents")
        );
        assert_eq!(
            field(r#"{"amount_cents":1,"currency":"EURO"}"#).as_deref(),
            Some("currency")
        );
        assert_eq!(
            field(r#"{"amount_cents":1,"currency":"€UR"}"#).as_deref(),
            Some("currency")
        );
        assert_eq!(
            field(r#"{"amount_cents":1,"currency":978}"#).as_deref(),
            Some("currency")
        );
        assert_eq!(field(r#"[1]"#).as_deref(), Some("body"));
    }

    #[test]
    fn payload_keeps_amount_an_integer() {
        let order = NewOrder {
            amount_cents: i64::MAX,
            currency: "EUR".into(),
        };
        let id = Uuid::nil();
        let text = order.event_payload(id).to_string();
        assert!(
            text.contains("\"amount_cents\":9223372036854775807"),
            "{text}"
        );
        assert!(
            text.contains("\"order_id\":\"00000000-0000-0000-0000-000000000000\""),
            "{text}"
        );
    }
}
