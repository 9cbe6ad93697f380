//! The preamble most system tests share, in one call: a fresh stack,
//! `cdc-relay setup`, an inbox, optionally the Orders service, and the relay
//! streaming into the inbox as its least-privilege role.
//!
//! ```text
//! Scenario::start(Inbox::Scripted)                   shared cluster, defaults
//! Scenario::plan(Inbox::ScriptedBilling)             Billing behind a scripted proxy
//!     .orders()                                      + the Orders service
//!     .relay_args(&["--max-in-flight", "64"])        + flags after `run`
//!     .on(stack)                                     a stack of the test's own
//!     .start()
//! ```
//!
//! No event is committed before the relay streams, so a test scripts its
//! sink (status, delay) after `start` returns and before its first insert.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use tokio_postgres::Client;
use uuid::Uuid;

use crate::app::{self, Running, TEST_SECRET};
use crate::oracle::{self, Accounting, Expected, expected};
use crate::sink::ScriptedSink;
use crate::stack::Stack;
use crate::{PgCluster, wait_until};

/// Bound for expected deliveries to arrive.
const DELIVER: Duration = Duration::from_secs(45);

/// The relay's budget for a clean stop after SIGTERM, plus margin.
const CLEAN_STOP: Duration = Duration::from_secs(20);

/// Bound for the walsender to release the slot after the relay exited.
const SLOT_RELEASE: Duration = Duration::from_secs(10);

/// Bound for the relay to stop on its own after a change it must refuse:
/// the slot monitor's period (15 s) and a margin.
const REFUSAL: Duration = Duration::from_secs(30);

/// Pause between two looks at the relay and the slot in [`Scenario::wait_refusal`].
const REFUSAL_POLL: Duration = Duration::from_millis(50);

/// Where the relay delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbox {
    /// A [`ScriptedSink`]: records every request, answers as scripted (204).
    Scripted,
    /// The Billing service itself.
    Billing,
    /// Billing behind a [`ScriptedSink::proxy`], which records each request
    /// and can delay it or answer for Billing.
    ScriptedBilling,
}

/// What [`Plan::start`] brings up.
#[derive(Debug)]
pub struct Plan {
    inbox: Inbox,
    orders: bool,
    relay_args: Vec<String>,
    service_env: Vec<(String, String)>,
    stack: Option<Stack>,
}

impl Plan {
    /// Environment for Orders and Billing (e.g. their OTLP endpoint).
    pub fn service_env(mut self, env: &[(&str, &str)]) -> Plan {
        self.service_env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self
    }

    /// Also start the Orders service.
    pub fn orders(mut self) -> Plan {
        self.orders = true;
        self
    }

    /// Flags for `cdc-relay run` (after the harness's own).
    pub fn relay_args(mut self, args: &[&str]) -> Plan {
        self.relay_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Use `stack` (e.g. on a cluster of the test's own, or prepared before
    /// setup) instead of a fresh one on the shared cluster.
    pub fn on(mut self, stack: Stack) -> Plan {
        self.stack = Some(stack);
        self
    }

    /// Setup, inbox, Orders, relay; returns once the relay streams.
    pub async fn start(self) -> anyhow::Result<Scenario> {
        let stack = match self.stack {
            Some(stack) => stack,
            None => PgCluster::shared().create_stack().await?,
        };
        let setup = app::relay_setup(&stack).await?;
        let env: Vec<(&str, &str)> = self
            .service_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let billing = match self.inbox {
            Inbox::Scripted => None,
            Inbox::Billing | Inbox::ScriptedBilling => {
                let mut billing_env = vec![("EVENT_SECRET", TEST_SECRET)];
                billing_env.extend(env.iter().copied());
                Some(app::start_billing_with(&stack, &[], &billing_env).await?)
            }
        };
        let sink = match (&self.inbox, &billing) {
            (Inbox::Scripted, _) => Some(ScriptedSink::start().await?),
            (Inbox::ScriptedBilling, Some(b)) => Some(ScriptedSink::proxy(&b.inbox()).await?),
            _ => None,
        };
        let inbox_url = match (&sink, &billing) {
            (Some(s), _) => s.url.clone(),
            (None, Some(b)) => b.inbox(),
            (None, None) => anyhow::bail!("no inbox for {:?}", self.inbox),
        };
        let orders = match self.orders {
            true => Some(app::start_orders_with(&stack, &[], &env).await?),
            false => None,
        };
        let args: Vec<&str> = self.relay_args.iter().map(String::as_str).collect();
        let relay = app::start_relay(&stack, &inbox_url, &args).await?;
        app::wait_streaming(&relay).await?;
        let db = stack.orders_admin().await?;
        Ok(Scenario {
            stack,
            setup,
            db,
            relay,
            sink,
            billing,
            orders,
            inbox_url,
        })
    }
}

/// A stack with the relay streaming into its inbox. Fields drop in
/// declaration order: the relay stops before its inbox.
pub struct Scenario {
    /// The databases, roles, slot and publication.
    pub stack: Stack,
    /// What `cdc-relay setup` printed.
    pub setup: String,
    /// A superuser connection to the orders database.
    pub db: Client,
    /// `cdc-relay run`.
    pub relay: Running,
    sink: Option<ScriptedSink>,
    billing: Option<Running>,
    orders: Option<Running>,
    inbox_url: String,
}

impl Scenario {
    /// A scenario delivering to `inbox`, to configure before [`Plan::start`].
    pub fn plan(inbox: Inbox) -> Plan {
        Plan {
            inbox,
            orders: false,
            relay_args: Vec::new(),
            service_env: Vec::new(),
            stack: None,
        }
    }

    /// The default scenario on the shared cluster: relay delivering to `inbox`.
    pub async fn start(inbox: Inbox) -> anyhow::Result<Scenario> {
        Scenario::plan(inbox).start().await
    }

    /// The scripted sink (or proxy) the relay delivers to.
    ///
    /// # Panics
    /// For [`Inbox::Billing`], which has none.
    pub fn sink(&self) -> &ScriptedSink {
        self.sink
            .as_ref()
            .expect("this scenario delivers to Billing directly: no scripted sink")
    }

    /// The Billing service.
    ///
    /// # Panics
    /// For [`Inbox::Scripted`], which has none.
    pub fn billing(&self) -> &Running {
        self.billing
            .as_ref()
            .expect("this scenario delivers to a scripted sink: no Billing")
    }

    /// The Orders service.
    ///
    /// # Panics
    /// Unless the plan asked for [`Plan::orders`].
    pub fn orders(&self) -> &Running {
        self.orders
            .as_ref()
            .expect("this scenario was planned without .orders()")
    }

    /// The URL the relay delivers to.
    pub fn inbox_url(&self) -> &str {
        &self.inbox_url
    }

    /// Inserts an order row to reference from outbox rows (through [`Self::db`]).
    pub async fn insert_order(&self) -> anyhow::Result<Uuid> {
        expected::insert_order(&self.db).await
    }

    /// Inserts one outbox row through [`Self::db`], in whatever transaction
    /// it is in, and returns it as PostgreSQL stored it
    /// ([`expected::insert_event`]).
    pub async fn insert_event(
        &self,
        aggregate: Uuid,
        event_type: &str,
        payload: Option<&str>,
    ) -> anyhow::Result<Expected> {
        expected::insert_event(&self.db, aggregate, event_type, payload).await
    }

    /// [`Self::insert_event`] into `table` (e.g. a renamed outbox).
    pub async fn insert_event_into(
        &self,
        table: &str,
        aggregate: Uuid,
        event_type: &str,
        payload: Option<&str>,
    ) -> anyhow::Result<Expected> {
        expected::insert_event_into(&self.db, table, aggregate, event_type, payload).await
    }

    /// Waits (bounded) for the relay to stop on its own and returns how it
    /// exited. `after` is a WAL position read after the commit of a
    /// transaction the relay must refuse ([`oracle::wal_position`]): the
    /// wait fails at once if the slot's confirmed position reaches it,
    /// because that transaction was then acknowledged without delivery.
    pub async fn wait_refusal(&mut self, after: u64) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + REFUSAL;
        loop {
            if let Some(status) = self.relay.process.try_status() {
                return Ok(status);
            }
            let confirmed = oracle::slot_position(&self.db, &self.stack.slot)
                .await?
                .confirmed;
            anyhow::ensure!(
                confirmed < after,
                "the slot is confirmed at {confirmed}, at or past {after}: a transaction the relay \
                 had to refuse was acknowledged; the inbox got {} request(s); the relay still runs:\n{}",
                self.sink.as_ref().map_or(0, ScriptedSink::arrivals),
                tail(&self.relay.process.logs(), 30)
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "the relay still runs {REFUSAL:?} after a transaction it had to refuse \
                 (slot confirmed at {confirmed}, before {after}):\n{}",
                tail(&self.relay.process.logs(), 30)
            );
            tokio::time::sleep(REFUSAL_POLL).await;
        }
    }

    /// Waits until the relay is done with every transaction committed so
    /// far ([`oracle::settle`]).
    pub async fn settle(&self) -> anyhow::Result<()> {
        oracle::settle(&self.db, &self.stack.slot).await
    }

    /// Distinct event ids the inbox took: Billing's `processed_events` when
    /// Billing is the inbox, else the scripted sink's 2xx requests.
    pub async fn delivered_ids(&self) -> anyhow::Result<Vec<String>> {
        if self.billing.is_some() {
            let billing = self.stack.billing_admin().await?;
            return Ok(billing
                .query("SELECT event_id::text FROM processed_events", &[])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect());
        }
        Ok(oracle::arrival_ids(&self.sink().delivered()))
    }

    /// The proof-wide ledger over the outbox rows of `tables` (e.g.
    /// `&["outbox"]`) against what the inbox took and the dead letters;
    /// judge it with [`Accounting::assert_balanced`] or
    /// [`Accounting::assert_held`].
    pub async fn accounting(&self, tables: &[&str]) -> anyhow::Result<Accounting> {
        Accounting::read(&self.db, tables, self.delivered_ids().await?).await
    }

    /// Asserts the ledger of the `outbox` table balances (every row
    /// delivered or dead-lettered, nothing else) after settling.
    pub async fn assert_balanced(&self) -> anyhow::Result<()> {
        self.settle().await?;
        self.accounting(&["outbox"]).await?.assert_balanced();
        Ok(())
    }

    /// Asserts every row of `tables` not delivered nor dead-lettered is
    /// still held by the slot (peeked through the stack's publications).
    /// The relay must have stopped or exited: only an inactive slot can be
    /// peeked.
    pub async fn assert_held(&self, tables: &[&str]) -> anyhow::Result<Accounting> {
        let accounting = self.accounting(tables).await?;
        accounting
            .assert_held(&self.db, &self.stack.slot, &self.stack.publications())
            .await?;
        Ok(accounting)
    }

    /// Waits for `expected.len()` requests at the scripted sink, settles,
    /// and asserts the sink got exactly these events ([`oracle::assert_exact`]).
    pub async fn expect_exactly(&self, expected: &[Expected]) -> anyhow::Result<()> {
        let sink = self.sink();
        let n = expected.len();
        wait_until(
            &format!("the sink to receive {n} requests"),
            DELIVER,
            || async { sink.count() >= n },
        )
        .await?;
        self.settle().await?;
        oracle::assert_exact(&sink.received(), expected);
        Ok(())
    }

    /// Stops the relay with SIGTERM; it must exit 0 (a clean stop).
    pub async fn stop_relay(&mut self) -> anyhow::Result<()> {
        self.relay.process.sigterm();
        let status = self.relay.process.wait_exit(CLEAN_STOP).await?;
        anyhow::ensure!(
            status.success(),
            "relay exited with {status} after SIGTERM\n{}",
            self.relay.process.logs()
        );
        Ok(())
    }

    /// Starts the relay again (with `args` after `run`) and waits until it streams.
    pub async fn restart_relay(&mut self, args: &[&str]) -> anyhow::Result<()> {
        self.relay = app::start_relay(&self.stack, &self.inbox_url, args).await?;
        app::wait_streaming(&self.relay).await
    }

    /// Stops the relay cleanly and drops the slot, so a shared cluster does
    /// not accumulate slots (each holds back WAL and a walsender slot).
    pub async fn finish(mut self) -> anyhow::Result<()> {
        self.stop_relay().await?;
        let (db, slot) = (&self.db, &self.stack.slot);
        // The walsender may take a moment to release the slot after the relay exited.
        wait_until("the slot to be dropped", SLOT_RELEASE, || async {
            db.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                .await
                .map(|_| true)
                .map_err(anyhow::Error::from)
        })
        .await
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
