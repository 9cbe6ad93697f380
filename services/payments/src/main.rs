//! `payments`: see the library docs and `payments --help`.

use std::process::ExitCode;

use payments::PaymentsArgs;

#[tokio::main]
async fn main() -> ExitCode {
    let args = PaymentsArgs::parse_env();
    let settings = args.settings();
    let result =
        service_common::service::run("payments", args.service, move |pool, metrics, _spans| {
            Ok(service_common::server::Routes {
                public: payments::router(pool, &metrics, settings)?,
                admin: axum::Router::new(),
            })
        })
        .await;
    service_common::service::exit_code("payments", result)
}
