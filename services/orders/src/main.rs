//! `orders`: see the library docs and `orders --help`.

use std::process::ExitCode;

use orders::OrdersArgs;

#[tokio::main]
async fn main() -> ExitCode {
    let args = OrdersArgs::parse_env();
    let fault = args.fault_after_order_insert;
    let key_ttl = args.idempotency_key_ttl;
    let result =
        service_common::service::run("orders", args.service, move |pool, metrics, spans| {
            Ok(service_common::server::Routes {
                public: orders::router(pool, &metrics, spans, fault, key_ttl)?,
                // GET /orders/{id} is the clients' (POST answers with its Location).
                admin: axum::Router::new(),
            })
        })
        .await;
    service_common::service::exit_code("orders", result)
}
