//! A parked event refused when its endpoint resumes.

use std::collections::BTreeSet;

use super::*;

/// A parked event its endpoint refuses as poison when the relay replays
/// it on resume: its row stays, recorded as refused (the 422, its reason,
/// one more attempt, no longer parked), the other parked rows are
/// replayed in order, and the endpoint goes back to live delivery.
///
/// Broken before: `sql/roles.sql` did not grant the relay's role UPDATE
/// on the dead-letter table, so recording the refusal failed (permission
/// denied), was retried at ERROR forever, and the resume never ended.
#[tokio::test]
async fn a_parked_event_refused_on_resume_stays_as_refused_and_the_endpoint_resumes() {
    let (stack, sinks, dir) = two_sinks().await;
    let path = routes_file(dir.path(), &sinks, "auto");
    let relay = start(&stack, &path).await;
    let db = stack.orders_admin().await.unwrap();
    let aggregates = orders(&db, 4).await;
    sinks[0].set_status(503);
    let events = commit(&db, &aggregates, 6, 0).await;
    oracle::settle(&db, &stack.slot).await.unwrap();
    assert_eq!(parked_rows(&db).await.len(), 12, "parked, the slot moved");
    let poison = &events[5].id;
    sinks[0].reject(poison, 422);
    sinks[0].set_status(204);
    wait_until(
        "billing resumed with no parked row left",
        std::time::Duration::from_secs(60),
        || async {
            let m = relay.metrics().await?;
            let live =
                m.value("cdc_relay_endpoint_parked", &[("endpoint", "billing")]) == Some(0.0);
            anyhow::Ok(live && parked_rows(&db).await.is_empty())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.process.logs()));
    let row = db
        .query_one(
            "SELECT http_status, error, attempts FROM cdc_relay_dead_letter \
             WHERE endpoint = 'billing' AND event_id = $1",
            &[poison],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i32>>(0), Some(422));
    let error: String = row.get(1);
    assert!(error.starts_with("http_422"), "{error}");
    assert!(row.get::<_, i32>(2) >= 1, "the replay's attempt is counted");
    let rows: i64 = db
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE endpoint = 'billing'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "only the refused event's row is left");
    let delivered: BTreeSet<String> = sinks[0].delivered().iter().map(|r| r.id()).collect();
    for e in events.iter().filter(|e| &e.id != poison) {
        assert!(delivered.contains(&e.id), "{} replayed to billing", e.id);
    }
    assert!(
        !relay
            .process
            .logs()
            .contains("cannot record a replayed dead letter as refused"),
        "{}",
        relay.process.logs()
    );
}
