//! `billing`: see the library docs and `billing --help`.

use std::process::ExitCode;

use billing::BillingArgs;

#[tokio::main]
async fn main() -> ExitCode {
    let args = BillingArgs::parse_env();
    let result = match args.secrets() {
        Ok(secrets) => {
            service_common::server::run("billing", args.service, move |pool, metrics| {
                tracing::info!(secrets = secrets.len(), "event secrets loaded");
                billing::router(pool, &metrics, secrets)
            })
            .await
        }
        Err(e) => Err(e.into()),
    };
    service_common::server::exit_code("billing", result)
}
