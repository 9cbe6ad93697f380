//! The request to the payment provider: `POST <payments-url>/charges` with
//! the invoice's amount, currency and id as the reference, and its
//! `Idempotency-Key`. No database transaction is open while it runs.

use std::time::Duration;

use serde_json::json;

use super::store::Due;
use super::verdict::Reply;

/// The provider's charge endpoint and the client that calls it.
#[derive(Clone, Debug)]
pub struct Provider {
    client: reqwest::Client,
    charges_url: reqwest::Url,
    send_key: bool,
}

impl Provider {
    /// A client for `payments_url` (its `/charges`), each request bounded
    /// by `timeout`. `send_key` false is the test hook that sends no
    /// `Idempotency-Key` (to measure what it prevents).
    pub fn new(
        payments_url: &reqwest::Url,
        timeout: Duration,
        send_key: bool,
    ) -> anyhow::Result<Provider> {
        let mut base = payments_url.clone();
        if !base.path().ends_with('/') {
            // `join` replaces the last segment of a path without its slash.
            base.set_path(&format!("{}/", base.path()));
        }
        let charges_url = base.join("charges")?;
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            // A redirect is a configuration fault, not something to follow
            // with a payment.
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Provider {
            client,
            charges_url,
            send_key,
        })
    }

    /// Asks for `invoice`'s charge; `Err` is no answer (connection refused
    /// or closed, timeout, a body cut off), in the transport's words.
    pub async fn charge(&self, invoice: &Due) -> Result<Reply, String> {
        let body = json!({
            "amount_cents": invoice.amount_cents,
            "currency": invoice.currency,
            "reference": invoice.invoice_id,
        });
        let mut request = self
            .client
            .post(self.charges_url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if self.send_key {
            request = request.header(
                "idempotency-key",
                super::idempotency_key(invoice.invoice_id),
            );
        }
        let response = request.send().await.map_err(|e| error_chain(&e))?;
        let status = response.status().as_u16();
        let body = response.bytes().await.map_err(|e| error_chain(&e))?;
        Ok(Reply {
            status,
            body: body.to_vec(),
        })
    }
}

/// An error and its causes: reqwest's own words say only "error sending
/// request".
fn error_chain(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(err) = cause {
        text.push_str(": ");
        text.push_str(&err.to_string());
        cause = err.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_is_under_the_base_url_with_or_without_its_slash() {
        for (base, expected) in [
            ("http://127.0.0.1:8082", "http://127.0.0.1:8082/charges"),
            ("http://127.0.0.1:8082/", "http://127.0.0.1:8082/charges"),
            (
                "https://pay.example/api/v1",
                "https://pay.example/api/v1/charges",
            ),
            (
                "https://pay.example/api/v1/",
                "https://pay.example/api/v1/charges",
            ),
        ] {
            let url = reqwest::Url::parse(base).unwrap();
            let provider = Provider::new(&url, Duration::from_secs(1), true).unwrap();
            assert_eq!(provider.charges_url.as_str(), expected, "{base}");
        }
    }
}
