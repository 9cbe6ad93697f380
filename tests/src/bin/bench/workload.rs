//! What every scenario is made of: a fresh pair of seeded databases, a
//! backlog, orders posted at a steady rate, the null sink, and Billing's
//! invoice count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use harness::app::{self, Running};
use harness::prom;
use harness::stack::Stack;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use uuid::Uuid;

use crate::Ctx;

/// A fresh pair of databases with seeded tables (10k published orders, so
/// plans are those of a used database); with `slot`, `cdc-relay setup` runs
/// after the seed, so the relay never sees it. `orders_app` may UPDATE the
/// outbox (the baseline needs it; the product's roles.sql does not grant it).
pub(crate) async fn fresh_stack(ctx: &Ctx, slot: bool) -> anyhow::Result<Stack> {
    let stack = ctx.cluster.create_stack().await?;
    let db = stack.orders_admin().await?;
    db.batch_execute(&format!(
        "INSERT INTO orders (id, amount_cents, currency, created_at)
           SELECT gen_random_uuid(), 1000 + i, 'EUR', now() - interval '1 day'
           FROM generate_series(1, {n}) i;
         INSERT INTO outbox (id, aggregate_id, event_type, payload, occurred_at, published_at)
           SELECT gen_random_uuid(), id, 'OrderCreated',
                  jsonb_build_object('order_id', id, 'amount_cents', amount_cents, 'currency', currency),
                  created_at, created_at
           FROM orders;
         ANALYZE orders; ANALYZE outbox;
         GRANT UPDATE ON outbox TO orders_app;",
        n = ctx.cfg.seed_orders
    ))
    .await
    .context("seeding the orders database")?;
    if slot {
        app::relay_setup(&stack).await?;
    }
    Ok(stack)
}

/// Drops the slot (once its walsender is gone) and both databases.
pub(crate) async fn drop_stack(ctx: &Ctx, stack: &Stack) {
    let Ok(admin) = ctx.cluster.connect_superuser("postgres").await else {
        return;
    };
    for _ in 0..50 {
        let r = admin
            .query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1 AND NOT active",
                &[&stack.slot],
            )
            .await;
        let gone: bool = admin
            .query_one(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
                &[&stack.slot],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(true);
        if r.is_ok() && gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for db in [&stack.orders_db, &stack.billing_db] {
        if let Err(err) = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await
        {
            eprintln!("    (could not drop {db}: {err})");
        }
    }
}

/// Inserts `n` outbox rows, each with its order in its own transaction
/// (synchronous_commit off for the loader only), in chunks.
pub(crate) async fn insert_backlog(stack: &Stack, n: u64) -> anyhow::Result<()> {
    insert_rows(stack, n, "now()", "backlog", false).await
}

/// [`insert_backlog`] with a distinct, sampled W3C trace context in each
/// row's `trace_context` (`00-<trace id>-<span id>-01`, both ids md5
/// digests of the row's order id), as Orders stores it for a traced
/// request.
pub(crate) async fn insert_traced_backlog(stack: &Stack, n: u64) -> anyhow::Result<()> {
    insert_rows(stack, n, "now()", "traced backlog", true).await
}

/// [`insert_backlog`] with each row's `occurred_at` set to `occurred_at`
/// (an SQL expression, e.g. `now() - interval '30 days'`); `what` names the
/// backlog in the progress line and errors.
pub(crate) async fn insert_backlog_at(
    stack: &Stack,
    n: u64,
    occurred_at: &str,
    what: &str,
) -> anyhow::Result<()> {
    insert_rows(stack, n, occurred_at, what, false).await
}

async fn insert_rows(
    stack: &Stack,
    n: u64,
    occurred_at: &str,
    what: &str,
    traced: bool,
) -> anyhow::Result<()> {
    let (trace_column, trace_value) = if traced {
        (
            ", trace_context",
            ", '00-' || md5(o::text) || '-' || left(md5(o::text || 'span'), 16) || '-01'",
        )
    } else {
        ("", "")
    };
    let db = stack.orders_admin().await?;
    db.batch_execute("SET synchronous_commit = off").await?;
    let t = Instant::now();
    let chunk = 50_000;
    let mut done = 0;
    while done < n {
        let k = chunk.min(n - done);
        db.batch_execute(&format!(
            "DO $$ DECLARE o uuid; BEGIN
               FOR i IN 1..{k} LOOP
                 o := gen_random_uuid();
                 INSERT INTO orders (id, amount_cents, currency) VALUES (o, 1000 + i % 5000, 'EUR');
                 INSERT INTO outbox (id, aggregate_id, event_type, payload, occurred_at{trace_column})
                   VALUES (gen_random_uuid(), o, 'OrderCreated',
                           jsonb_build_object('order_id', o, 'amount_cents', 1000 + i % 5000, 'currency', 'EUR'),
                           {occurred_at}{trace_value});
                 COMMIT;
               END LOOP; END $$"
        ))
        .await
        .with_context(|| format!("inserting the {what}"))?;
        done += k;
    }
    db.batch_execute("ANALYZE orders; ANALYZE outbox").await?;
    eprintln!(
        "    {what} of {n} rows inserted in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A minimal in-process HTTP server answering 204 to every POST /inbox,
/// counting requests and recording nothing else.
pub(crate) struct NullSink {
    pub(crate) url: String,
    pub(crate) count: Arc<AtomicU64>,
    pub(crate) _stop: tokio::sync::oneshot::Sender<()>,
}

pub(crate) async fn null_sink() -> anyhow::Result<NullSink> {
    // Counts events: a batch request (`X-Event-Batch: N`) is N of them.
    pub(crate) async fn handle(
        State(count): State<Arc<AtomicU64>>,
        headers: axum::http::HeaderMap,
        _body: Bytes,
    ) -> StatusCode {
        let events = headers
            .get("x-event-batch")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1);
        count.fetch_add(events, Ordering::Relaxed);
        StatusCode::NO_CONTENT
    }
    let count = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/inbox", post(handle))
        .with_state(Arc::clone(&count));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = harness::sink::serve(listener, app);
    Ok(NullSink {
        url: format!("http://{addr}/inbox"),
        count,
        _stop: stop,
    })
}

pub(crate) async fn billing_invoiced(
    http: &reqwest::Client,
    billing: &Running,
) -> anyhow::Result<u64> {
    let m = prom::scrape(http, &billing.admin_url).await?;
    Ok(m.sum("billing_invoices_created_total") as u64)
}

/// Posts orders through Orders' API, one per tick at `rate`/s, for
/// `duration`; at most 512 outstanding (then the ticker waits, lowering the
/// rate). Returns the order ids and the achieved rate.
pub(crate) async fn post_at_rate(
    http: &reqwest::Client,
    orders_url: &str,
    rate: f64,
    duration: Duration,
) -> anyhow::Result<(Vec<Uuid>, f64, usize)> {
    let sem = Arc::new(Semaphore::new(512));
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let total = (rate * duration.as_secs_f64()).round() as usize;
    let mut set = JoinSet::new();
    let t = Instant::now();
    for _ in 0..total {
        ticker.tick().await;
        let permit = Arc::clone(&sem).acquire_owned().await?;
        let http = http.clone();
        let url = orders_url.to_owned();
        set.spawn(async move {
            let r = app::post_order(&http, &url, 2599).await;
            drop(permit);
            r
        });
    }
    let posting = t.elapsed().as_secs_f64();
    let mut ids = Vec::with_capacity(total);
    let mut errors = 0;
    while let Some(r) = set.join_next().await {
        match r? {
            Ok((order, _)) => ids.push(order.parse()?),
            Err(_) => errors += 1,
        }
    }
    Ok((ids, total as f64 / posting.max(1e-9), errors))
}

/// Waits until Billing holds `n` invoices in total or `cap` passes.
pub(crate) async fn wait_invoices(stack: &Stack, n: u64, cap: Duration) -> anyhow::Result<u64> {
    let db = stack.billing_admin().await?;
    let deadline = Instant::now() + cap;
    loop {
        let c: i64 = db
            .query_one("SELECT count(*) FROM invoices", &[])
            .await?
            .get(0);
        if c as u64 >= n || Instant::now() >= deadline {
            return Ok(c as u64);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
