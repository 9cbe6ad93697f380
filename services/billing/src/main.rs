//! `billing`: see the library docs and `billing --help`.

use std::process::ExitCode;

use billing::BillingArgs;
use billing::signature::{SharedVerifier, reload_on_sighup};
use prometheus::{IntCounterVec, Opts};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> ExitCode {
    let args = BillingArgs::parse_env();
    let result = match (args.verifier(), signal(SignalKind::hangup())) {
        (Ok(verifier), Ok(hangup)) => {
            let shared = SharedVerifier::new(verifier);
            let service = args.service.clone();
            service_common::service::run("billing", service, move |pool, metrics, spans| {
                let current = shared.current();
                tracing::info!(keys = %current.keys(), scheme = %current.scheme(), "event secrets loaded");
                let reloads = IntCounterVec::new(
                    Opts::new(
                        "billing_secret_reloads_total",
                        "Event secret reloads on SIGHUP by result (ok, error: the keys in use stay)",
                    ),
                    &["result"],
                )?;
                metrics.registry().register(Box::new(reloads.clone()))?;
                for result in ["ok", "error"] {
                    reloads.with_label_values(&[result]);
                }
                let charge = billing::charge::start(&args.charge, pool.clone(), metrics.registry())?;
                tokio::spawn(reload_on_sighup(
                    hangup,
                    move || args.verifier(),
                    shared.clone(),
                    reloads,
                ));
                billing::router(pool, &metrics, spans, shared, charge)
            })
            .await
        }
        (Err(e), _) => Err(service_common::service::BadSetting(e.into()).into()),
        (_, Err(e)) => Err(anyhow::Error::new(e).context("installing the SIGHUP handler")),
    };
    service_common::service::exit_code("billing", result)
}
