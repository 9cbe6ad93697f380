//! The chaos run's services (Orders, Billing, the payment provider): how
//! each is started, killed and restarted behind its [`Front`], and the two
//! faults that kill a service at an exact point of the charge (Billing
//! after the provider's charge and before its record; the provider after
//! its charge and before its answer), through the services' own test hooks.

use std::time::Duration;

use anyhow::Context;

use super::World;
use super::front::{self, Front};
use super::report::FaultOutcome;
use crate::app::{self, Running, TEST_SECRET};
use crate::stack::{PaymentsDb, Stack};
use tokio::sync::Mutex as AsyncMutex;

/// The provider's own misbehaviour for the whole run: this share of charge
/// requests is answered 503 without charging, and this share of answers
/// is dropped after the charge committed.
pub const PROVIDER_FAULT_RATIOS: (&str, &str) = ("0.02", "0.02");

/// Bound on a hooked service reaching its exit point (its next charge).
const HOOK_EXIT: Duration = Duration::from_secs(60);

/// One of the services behind a front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Service {
    Orders,
    Billing,
    Payments,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Orders => "orders",
            Service::Billing => "billing",
            Service::Payments => "payments",
        }
    }
}

/// Starts Billing charging at `payments_url`; `key` false sends no
/// `Idempotency-Key` (the comparison run); `exit_after_charge` is its hook.
pub(super) async fn start_billing(
    stack: &Stack,
    payments_url: &str,
    key: bool,
    exit_after_charge: bool,
) -> anyhow::Result<Running> {
    let mut extra = Vec::new();
    if !key {
        extra.push("--charge-without-idempotency-key");
    }
    if exit_after_charge {
        extra.push("--fault-exit-after-charge");
    }
    let args = app::charging_args(payments_url, &extra);
    app::start_billing_with(stack, &args, &[("EVENT_SECRET", TEST_SECRET)]).await
}

/// Starts the provider with [`PROVIDER_FAULT_RATIOS`]; `exit_after_commit`
/// is its hook.
pub(super) async fn start_payments(
    payments: &PaymentsDb,
    exit_after_commit: bool,
) -> anyhow::Result<Running> {
    let (fail, drop) = PROVIDER_FAULT_RATIOS;
    let mut args = vec![
        "--fault-fail-ratio",
        fail,
        "--fault-drop-after-commit-ratio",
        drop,
    ];
    if exit_after_commit {
        args.push("--fault-exit-after-commit");
    }
    app::start_payments(payments, &args).await
}

impl World {
    fn slot(&self, service: Service) -> (&AsyncMutex<Running>, &Front) {
        match service {
            Service::Orders => (&self.orders, &self.orders_front),
            Service::Billing => (&self.billing, &self.billing_front),
            Service::Payments => (&self.payments, &self.payments_front),
        }
    }

    async fn start(&self, service: Service, hooked: bool) -> anyhow::Result<Running> {
        match service {
            Service::Orders => app::start_orders(&self.stack).await,
            Service::Billing => {
                let url = self.payments_front.url();
                start_billing(&self.stack, &url, self.idempotency_key, hooked).await
            }
            Service::Payments => start_payments(&self.payments_db, hooked).await,
        }
    }

    /// Starts `service` (three tries), points its front at it and puts it
    /// in `running`'s place; the one it replaces is buried (killed first).
    async fn replace(
        &self,
        service: Service,
        running: &mut Running,
        hooked: bool,
    ) -> anyhow::Result<()> {
        let (_, front) = self.slot(service);
        let mut last = None;
        for _ in 0..3 {
            match self.start(service, hooked).await {
                Ok(new) => {
                    front.set_upstream(front::socket_addr(&new.url)?);
                    let mut old = std::mem::replace(running, new);
                    // Its kept-alive connections would stay with it.
                    old.process.sigkill();
                    self.bury(service.name(), old.process);
                    return Ok(());
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.expect("three attempts")).context(format!("restarting {}", service.name()))
    }

    /// SIGKILL of `service`, restarted after the fault's hold; for Billing,
    /// the requests reaching it meanwhile are counted.
    pub(super) async fn kill_service(
        &self,
        out: &mut FaultOutcome,
        service: Service,
    ) -> anyhow::Result<()> {
        let (slot, _) = self.slot(service);
        let mut running = slot.lock().await;
        out.started = self.now();
        running.process.sigkill();
        out.victim = Some(service.name().to_owned());
        let counted = self.count_sink_requests(false, out.fault.hold).await;
        let replaced = self.replace(service, &mut running, false).await;
        out.ended = self.now();
        if replaced.is_ok() && service == Service::Billing {
            out.sink_requests_after_first_second = Some(counted.finish(self));
        }
        replaced
    }

    /// `service` (Billing or the provider) restarted with its exit hook:
    /// it dies at its next charge, between the charge and Billing's record
    /// of it (or the provider's answer); restarted without the hook after
    /// the fault's hold.
    pub(super) async fn exit_after_charge(
        &self,
        out: &mut FaultOutcome,
        service: Service,
    ) -> anyhow::Result<()> {
        let (slot, _) = self.slot(service);
        let mut running = slot.lock().await;
        out.started = self.now();
        self.replace(service, &mut running, true).await?;
        out.victim = Some(service.name().to_owned());
        let exited = running.process.wait_exit(HOOK_EXIT).await;
        if exited.is_err() {
            running.process.sigkill();
        }
        tokio::time::sleep(out.fault.hold).await;
        let replaced = self.replace(service, &mut running, false).await;
        out.ended = self.now();
        replaced?;
        exited.map(|_| ()).with_context(|| {
            format!(
                "{} did not reach a charge within {HOOK_EXIT:?}",
                service.name()
            )
        })
    }
}
