//! The `POST /charges` request and its answers:
//! `{"amount_cents":2599,"currency":"EUR","reference":"<the merchant's id>"}`
//! answered 201 `{"charge_id","status":"succeeded","amount_cents","currency","reference"}`
//! or 402 `charge_declined`. Validation failures are 422 `invalid_charge`
//! naming the field.

use axum::http::StatusCode;
use serde_json::{Value, json};
use service_common::ServiceError;
use service_common::money::{amount_cents, is_currency_code};
use uuid::Uuid;

const INVALID: &str = "invalid_charge";

/// Longest `reference`, in characters.
pub const MAX_REFERENCE_LEN: usize = 255;

/// A validated charge request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCharge {
    /// Amount in cents, at least 1.
    pub amount_cents: i64,
    /// Three upper-case letters.
    pub currency: String,
    /// The merchant's own id for what is paid (Billing: the invoice id):
    /// 1 to 255 characters, no control characters. Not unique: the
    /// `Idempotency-Key`, not the reference, makes a retry safe.
    pub reference: String,
}

impl NewCharge {
    /// Validates a parsed body. Unknown keys are ignored.
    pub fn from_json(body: &Value) -> Result<NewCharge, ServiceError> {
        let Value::Object(fields) = body else {
            return Err(ServiceError::invalid_field(
                INVALID,
                "body",
                "expected a JSON object",
            ));
        };
        let amount_cents = amount_cents(fields.get("amount_cents"))
            .map_err(|reason| ServiceError::invalid_field(INVALID, "amount_cents", reason))?;
        let currency = match fields.get("currency").and_then(Value::as_str) {
            Some(code) if is_currency_code(code) => code.to_owned(),
            _ => {
                return Err(ServiceError::invalid_field(
                    INVALID,
                    "currency",
                    "must be three upper-case letters",
                ));
            }
        };
        let reference = match fields.get("reference").and_then(Value::as_str) {
            Some(r)
                if !r.is_empty()
                    && r.chars().count() <= MAX_REFERENCE_LEN
                    && !r.chars().any(char::is_control) =>
            {
                r.to_owned()
            }
            _ => {
                return Err(ServiceError::invalid_field(
                    INVALID,
                    "reference",
                    "must be a string of 1 to 255 characters without control characters",
                ));
            }
        };
        Ok(NewCharge {
            amount_cents,
            currency,
            reference,
        })
    }

    /// The 201 body of this charge under `charge_id`.
    pub fn succeeded(&self, charge_id: Uuid) -> Value {
        json!({
            "charge_id": charge_id,
            "status": "succeeded",
            "amount_cents": self.amount_cents,
            "currency": self.currency,
            "reference": self.reference,
        })
    }
}

/// An answer as it is stored under a key and sent (again) to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// 201 or 402.
    pub status: StatusCode,
    /// The JSON body.
    pub body: Value,
}

/// The 402 of a charge over `limit` cents: stored under the key like a
/// success, so a retry is declined the same way without a second look.
pub fn declined(limit: i64) -> Answer {
    Answer {
        status: StatusCode::PAYMENT_REQUIRED,
        body: json!({
            "error": "charge_declined",
            "detail": format!("the amount is over this account's limit of {limit} cents"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(body: Value) -> Option<String> {
        NewCharge::from_json(&body)
            .unwrap_err()
            .field()
            .map(str::to_owned)
    }

    #[test]
    fn accepts_a_charge_and_names_each_bad_field() {
        let ok = NewCharge::from_json(
            &json!({"amount_cents": 2599, "currency": "EUR", "reference": "inv-1", "x": 1}),
        )
        .expect("valid");
        assert_eq!(ok.reference, "inv-1");
        let base = json!({"amount_cents": 1, "currency": "EUR", "reference": "r"});
        for (key, value, field) in [
            ("amount_cents", json!(0), "amount_cents"),
            ("amount_cents", json!("1"), "amount_cents"),
            ("currency", json!("eur"), "currency"),
            ("reference", json!(""), "reference"),
            ("reference", json!("a\nb"), "reference"),
            (
                "reference",
                json!("r".repeat(MAX_REFERENCE_LEN + 1)),
                "reference",
            ),
            ("reference", json!(7), "reference"),
        ] {
            let mut body = base.clone();
            body[key] = value.clone();
            assert_eq!(field_of(body).as_deref(), Some(field), "{key}={value}");
        }
        assert_eq!(field_of(json!([1])).as_deref(), Some("body"));
    }
}
