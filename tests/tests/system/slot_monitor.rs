//! What the slot monitor reads every interval, and at what cost: a figure
//! it publishes (`cdc_relay_dead_letters_waiting`, the same in `status`)
//! is read at a cost that does not grow with the table it describes.

use std::time::Duration;

use anyhow::Context;
use harness::PgCluster;

/// The rows of the scan nodes over `cdc_relay_dead_letter` in an
/// `EXPLAIN (ANALYZE, FORMAT JSON)` plan (each node's rows times its loops).
fn dead_letter_rows_read(plan: &serde_json::Value) -> f64 {
    let own = if plan["Relation Name"] == "cdc_relay_dead_letter" {
        plan["Actual Rows"].as_f64().unwrap_or(0.0) * plan["Actual Loops"].as_f64().unwrap_or(1.0)
    } else {
        0.0
    };
    own + plan["Plans"].as_array().map_or(0.0, |children| {
        children.iter().map(dead_letter_rows_read).sum()
    })
}

/// The dead letters waiting (the slot monitor's
/// `cdc_relay_dead_letters_waiting` and `status`) are read at a cost that
/// does not grow with the table: a parked endpoint writes hundreds of rows
/// a second, and the monitor reads the figure every interval. Over
/// `DEAD_LETTERS_COUNTED` rows the figure is PostgreSQL's live-row count
/// and at most that many rows are read; under it, the exact count. Fails
/// with a plain `count(*)` (it reads all 25,000 rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letters_waiting_are_read_without_scanning_the_table() -> anyhow::Result<()> {
    use cdc_relay::source::catalog::{DEAD_LETTERS_COUNTED, dead_letters_waiting};
    let stack = PgCluster::shared().create_stack().await?;
    let admin = stack.orders_admin().await?;
    let relay = harness::connect(&stack.relay_url).await?;
    let n = DEAD_LETTERS_COUNTED * 5 / 2;
    // No autovacuum: its ANALYZE would replace the live-row count with an
    // estimate. The statistics are flushed when the transaction ends.
    admin
        .batch_execute(&format!(
            "ALTER TABLE cdc_relay_dead_letter SET (autovacuum_enabled = off); \
             INSERT INTO cdc_relay_dead_letter (event_id, error) \
             SELECT 'e' || g, 'test' FROM generate_series(1, {n}) g; \
             SELECT pg_stat_force_next_flush()"
        ))
        .await?;
    let sql = format!("SELECT {}", dead_letters_waiting());
    let waiting = || async { relay.query_one(&sql, &[]).await.map(|r| r.get::<_, i64>(0)) };
    harness::wait_until(
        &format!("{n} dead letters waiting"),
        Duration::from_secs(30),
        || async { waiting().await.map(|w| w == n).map_err(anyhow::Error::from) },
    )
    .await?;
    let plan =
        harness::first_column(&relay, &format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).await?;
    let plan: serde_json::Value =
        serde_json::from_str(plan.first().context("EXPLAIN gave no plan")?)?;
    let read = dead_letter_rows_read(&plan[0]["Plan"]);
    assert!(
        read > 0.0 && read <= DEAD_LETTERS_COUNTED as f64,
        "{read} rows read of {n}: {plan}"
    );
    // Under the threshold the count is exact, whatever the statistics say.
    admin
        .batch_execute("DELETE FROM cdc_relay_dead_letter WHERE id > (SELECT min(id) + 2 FROM cdc_relay_dead_letter)")
        .await?;
    assert_eq!(waiting().await?, 3);
    Ok(())
}
