//! The `OrderCreated` event as Billing accepts it:
//! `{"id":"<uuid>","type":"OrderCreated","data":{"order_id":"<uuid>","amount_cents":<int>,"currency":"EUR"}}`.
//! Every failure is 422 `invalid_event` naming the field by its JSON path.

use serde_json::{Map, Value};
use service_common::ServiceError;
use service_common::money::{amount_cents, is_currency_code};
use uuid::Uuid;

const INVALID: &str = "invalid_event";

/// The only event type Billing handles.
pub const ORDER_CREATED: &str = "OrderCreated";

/// A validated `OrderCreated` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderCreated {
    /// The event id (`outbox.id`): the inbox key.
    pub id: Uuid,
    /// The order to invoice.
    pub order_id: Uuid,
    /// Amount in cents, at least 1.
    pub amount_cents: i64,
    /// Three upper-case ASCII letters.
    pub currency: String,
}

impl OrderCreated {
    /// Validates a parsed event. Unknown keys are ignored.
    pub fn from_json(event: &Value) -> Result<Self, ServiceError> {
        let event = object(event, "event")?;
        let id = uuid_field(event, "id", "id")?;
        if event.get("type").and_then(Value::as_str) != Some(ORDER_CREATED) {
            return Err(ServiceError::invalid_field(
                INVALID,
                "type",
                "must be \"OrderCreated\"",
            ));
        }
        let data = object(event.get("data").unwrap_or(&Value::Null), "data")?;
        let order_id = uuid_field(data, "order_id", "data.order_id")?;
        let amount_cents = amount_cents(data.get("amount_cents"))
            .map_err(|reason| ServiceError::invalid_field(INVALID, "data.amount_cents", reason))?;
        let currency = match data.get("currency").and_then(Value::as_str) {
            Some(code) if is_currency_code(code) => code.to_owned(),
            _ => {
                return Err(ServiceError::invalid_field(
                    INVALID,
                    "data.currency",
                    "must be three upper-case letters",
                ));
            }
        };
        Ok(Self {
            id,
            order_id,
            amount_cents,
            currency,
        })
    }
}

fn object<'a>(
    value: &'a Value,
    path: &'static str,
) -> Result<&'a Map<String, Value>, ServiceError> {
    value
        .as_object()
        .ok_or_else(|| ServiceError::invalid_field(INVALID, path, "must be a JSON object"))
}

/// A uuid in its hyphenated 36-character form (as PostgreSQL prints it).
pub fn parse_uuid(text: &str) -> Option<Uuid> {
    if text.len() == 36 {
        Uuid::try_parse(text).ok()
    } else {
        None
    }
}

fn uuid_field(
    object: &Map<String, Value>,
    key: &str,
    path: &'static str,
) -> Result<Uuid, ServiceError> {
    object
        .get(key)
        .and_then(Value::as_str)
        .and_then(parse_uuid)
        .ok_or_else(|| ServiceError::invalid_field(INVALID, path, "must be a hyphenated UUID"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = r#"{"id":"8f0e6c1a-52c5-4b7e-9d52-3f0d2d7b9e11","type":"OrderCreated","data":{"order_id":"0b6a7e4c-1f2d-4c3b-8a9e-5d6f7a8b9c0d","amount_cents":2599,"currency":"EUR"}}"#;

    fn with(pointer: &str, value: Value) -> Value {
        let mut event: Value = serde_json::from_str(VALID).expect("json");
        *event.pointer_mut(pointer).expect("pointer") = value;
        event
    }

    fn field_of(event: &Value) -> Option<String> {
        OrderCreated::from_json(event)
            .unwrap_err()
            .field()
            .map(str::to_owned)
    }

    #[test]
    fn accepts_the_canonical_event() {
        let event = OrderCreated::from_json(&serde_json::from_str(VALID).unwrap()).expect("valid");
        assert_eq!(event.amount_cents, 2599);
        assert_eq!(event.currency, "EUR");
    }

    #[test]
    fn names_each_bad_field() {
        let cases = [
            ("/id", Value::from("not-a-uuid"), "id"),
            ("/id", Value::from("8f0e6c1a52c54b7e9d523f0d2d7b9e11"), "id"),
            ("/type", Value::from("OrderShipped"), "type"),
            ("/data", Value::from(1), "data"),
            ("/data/order_id", Value::from(7), "data.order_id"),
            (
                "/data/amount_cents",
                serde_json::json!(1.5),
                "data.amount_cents",
            ),
            (
                "/data/amount_cents",
                Value::from("2599"),
                "data.amount_cents",
            ),
            ("/data/amount_cents", Value::from(0), "data.amount_cents"),
            ("/data/currency", Value::from("eur"), "data.currency"),
            ("/data/currency", Value::from("EURO"), "data.currency"),
        ];
        for (pointer, value, field) in cases {
            assert_eq!(
                field_of(&with(pointer, value.clone())).as_deref(),
                Some(field),
                "{pointer}={value}"
            );
        }
        assert_eq!(field_of(&Value::from(1)).as_deref(), Some("event"));
    }
}
