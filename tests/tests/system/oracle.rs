//! Tests of the harness's oracles against real PostgreSQL: the proof-wide
//! ledger's peek at the slot can pass and fail.

use std::panic::AssertUnwindSafe;

use ::harness::oracle::{self, Accounting};
use ::harness::{PgCluster, Stack};
use futures::FutureExt;

async fn stack() -> Stack {
    PgCluster::shared()
        .create_stack()
        .await
        .expect("create_stack")
}

/// The proof-wide ledger's "held" check can pass and fail: rows committed
/// after the slot are held (peeked through the publication, with the ids
/// the Relation message names), rows of a table outside the publication are
/// not, and once the slot is advanced past them none are.
#[tokio::test]
async fn accounting_sees_what_the_slot_holds_and_what_it_passed() {
    let stack = stack().await;
    let db = stack.orders_admin().await.unwrap();
    db.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&stack.slot],
    )
    .await
    .unwrap();
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(
            ::harness::app::insert_order_event(&db)
                .await
                .unwrap()
                .to_string(),
        );
    }
    db.batch_execute("CREATE TABLE outbox_unpublished (LIKE outbox INCLUDING DEFAULTS)")
        .await
        .unwrap();
    let unpublished: String = db
        .query_one(
            "INSERT INTO outbox_unpublished (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'X', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let publications = stack.publications();

    let held = oracle::held::held_inserts(&db, &stack.slot, &publications)
        .await
        .unwrap();
    let held_ids: Vec<&str> = held.iter().filter_map(|i| i.value("id")).collect();
    assert_eq!(held_ids, ids, "{held:?}");
    assert!(!held_ids.contains(&unpublished.as_str()));
    assert!(held.iter().all(|i| i.relation == "public.outbox"));

    let outbox = Accounting::read(&db, &["outbox"], []).await.unwrap();
    assert_eq!(outbox.undone().len(), 2);
    outbox
        .assert_held(&db, &stack.slot, &publications)
        .await
        .unwrap();
    let one_delivered = Accounting::read(&db, &["outbox"], [ids[0].clone()])
        .await
        .unwrap();
    one_delivered
        .assert_held(&db, &stack.slot, &publications)
        .await
        .unwrap();
    let both = Accounting::read(&db, &["outbox", "outbox_unpublished"], [])
        .await
        .unwrap();
    let missed = AssertUnwindSafe(both.assert_held(&db, &stack.slot, &publications))
        .catch_unwind()
        .await;
    assert!(
        missed.is_err(),
        "a row the slot never streams counted as held"
    );
    let unbalanced = std::panic::catch_unwind(|| outbox.assert_balanced());
    assert!(unbalanced.is_err(), "undelivered rows balanced");

    db.execute(
        "SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())",
        &[&stack.slot],
    )
    .await
    .unwrap();
    let passed = AssertUnwindSafe(outbox.assert_held(&db, &stack.slot, &publications))
        .catch_unwind()
        .await;
    assert!(passed.is_err(), "rows behind the slot counted as held");
    db.execute("SELECT pg_drop_replication_slot($1)", &[&stack.slot])
        .await
        .unwrap();
}
