//! Upgrading in place: the `sql/` files of this version applied, by `psql`
//! as an operator would, to databases made by the previous release
//! (`tests/fixtures/sql-<version>/`) with data in every table. Nothing is
//! lost, no column disappears, and the files stay re-runnable.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ::harness::stack::sql_dir;
use ::harness::{PgCluster, connect};
use tokio_postgres::Client;

/// The previous release's `sql/` directory.
fn previous_sql() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sql-0.1.0")
}

/// Runs `files` from `dir` with psql, stopping on the first error.
fn psql(url: &str, dir: &Path, files: &[&str]) {
    for file in files {
        let output = PgCluster::shared()
            .command("psql")
            .arg(url)
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
            .arg(dir.join(file))
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}: {}",
            dir.join(file).display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Every (table, column) of the public schema.
async fn columns(client: &Client) -> BTreeSet<(String, String)> {
    client
        .query(
            "SELECT table_name::text, column_name::text FROM information_schema.columns \
             WHERE table_schema = 'public'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Row count of every table of the public schema, by name.
async fn row_counts(client: &Client) -> Vec<(String, i64)> {
    let tables: Vec<String> = client
        .query(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = Vec::new();
    for t in tables {
        let n: i64 = client
            .query_one(&format!("SELECT count(*) FROM \"{t}\""), &[])
            .await
            .unwrap()
            .get(0);
        out.push((t, n));
    }
    out
}

#[tokio::test]
async fn sql_upgrades_in_place_from_the_previous_release_with_data() {
    let cluster = PgCluster::shared();
    let admin = cluster.connect_superuser("postgres").await.unwrap();
    let suffix = std::process::id();
    let (orders_db, billing_db) = (
        format!("up_orders_{suffix}"),
        format!("up_billing_{suffix}"),
    );
    for db in [&orders_db, &billing_db] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
    }
    let orders_url = cluster.superuser_url(&orders_db);
    let billing_url = cluster.superuser_url(&billing_db);
    let orders_files = ["orders.sql", "publication.sql", "roles.sql"];
    let billing_files = ["billing.sql", "roles.sql"];

    // The previous release, with data in every table.
    psql(&orders_url, &previous_sql(), &orders_files);
    psql(&billing_url, &previous_sql(), &billing_files);
    let orders = connect(&orders_url).await.unwrap();
    orders
        .batch_execute(
            "INSERT INTO orders (id, amount_cents, currency)
               VALUES ('11111111-1111-4111-8111-111111111111', 500, 'EUR');
             INSERT INTO outbox (id, aggregate_id, event_type, payload)
               VALUES ('22222222-2222-4222-8222-222222222222',
                       '11111111-1111-4111-8111-111111111111', 'OrderCreated', '{\"n\":1}');
             INSERT INTO cdc_relay_dead_letter (event_id, event_type, payload, commit_lsn, error)
               VALUES ('e1', 'OrderCreated', '{}', '0/16B3748', 'http_422: refused');
             INSERT INTO cdc_relay_dead_letter_audit (action, dead_letter_id, event_id, reason)
               VALUES ('discard', 7, 'e0', 'test');",
        )
        .await
        .unwrap();
    let billing = connect(&billing_url).await.unwrap();
    billing
        .batch_execute(
            "INSERT INTO processed_events (event_id)
               VALUES ('22222222-2222-4222-8222-222222222222');
             INSERT INTO invoices (id, order_id, amount_cents, currency)
               VALUES ('33333333-3333-4333-8333-333333333333',
                       '11111111-1111-4111-8111-111111111111', 500, 'EUR');",
        )
        .await
        .unwrap();
    let before = (
        columns(&orders).await,
        columns(&billing).await,
        row_counts(&orders).await,
        row_counts(&billing).await,
    );
    assert!(
        before.2.iter().chain(&before.3).all(|(_, n)| *n > 0),
        "every table holds data before the upgrade: {:?} {:?}",
        before.2,
        before.3
    );

    // This version, twice (re-runnable).
    for _ in 0..2 {
        psql(&orders_url, &sql_dir(), &orders_files);
        psql(&billing_url, &sql_dir(), &billing_files);
    }

    let (orders_cols, billing_cols) = (columns(&orders).await, columns(&billing).await);
    assert!(
        before.0.is_subset(&orders_cols),
        "orders lost columns: {:?}",
        before.0.difference(&orders_cols).collect::<Vec<_>>()
    );
    assert!(
        before.1.is_subset(&billing_cols),
        "billing lost columns: {:?}",
        before.1.difference(&billing_cols).collect::<Vec<_>>()
    );
    // Tables the release had keep every row; new tables may appear.
    let kept = |after: Vec<(String, i64)>, before: &[(String, i64)]| {
        after
            .into_iter()
            .filter(|(t, _)| before.iter().any(|(b, _)| b == t))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        kept(row_counts(&orders).await, &before.2),
        before.2,
        "orders rows"
    );
    assert_eq!(
        kept(row_counts(&billing).await, &before.3),
        before.3,
        "billing rows"
    );
    let kept: String = orders
        .query_one(
            "SELECT commit_lsn::text FROM cdc_relay_dead_letter WHERE event_id = 'e1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, "0/16B3748");

    // The plain event-id index of 0.1.0 is gone: the unique index on
    // (event id, endpoint) serves a lookup by event id instead.
    let plain: Option<String> = orders
        .query_one(
            "SELECT to_regclass('cdc_relay_dead_letter_event_id_idx')::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(plain, None, "the plain event-id index is dropped");
    let plan = harness::first_column(
        &orders,
        "SET enable_seqscan = off; \
         EXPLAIN SELECT id FROM cdc_relay_dead_letter WHERE event_id = 'e1'; \
         RESET enable_seqscan",
    )
    .await
    .unwrap();
    assert!(
        plan.iter()
            .any(|l| l.contains("cdc_relay_dead_letter_event_endpoint_key")),
        "a lookup by event id uses the unique index: {plan:?}"
    );

    // 0.2.0: a dead letter written by a backfill has no commit LSN.
    orders
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error) VALUES ('e2', 'backfill')",
        )
        .await
        .unwrap();

    // Issue 15 (routes): dead letters name the endpoint that refused them;
    // the rows from before have none, and the relay may write the column.
    let endpoint: Option<String> = orders
        .query_one(
            "SELECT endpoint FROM cdc_relay_dead_letter WHERE event_id = 'e1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        endpoint, None,
        "a dead letter from before names no endpoint"
    );
    orders
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error, endpoint)
               VALUES ('e3', 'http_422: refused', 'billing')",
        )
        .await
        .unwrap();
    for privilege in ["SELECT", "INSERT"] {
        let granted: bool = orders
            .query_one(
                "SELECT has_column_privilege('cdc_relay', 'cdc_relay_dead_letter', 'endpoint', $1)",
                &[&privilege],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            granted,
            "cdc_relay lacks {privilege} on cdc_relay_dead_letter.endpoint"
        );
    }

    // Issue 18 item 7: the idempotency keys of POST /orders, a new table
    // that refers to orders made before the upgrade, writable by Orders.
    orders
        .batch_execute(
            "INSERT INTO order_idempotency_keys
               (scope, key, fingerprint, order_id, event_id, status, expires_at)
             VALUES ('POST /orders', 'k-before', '\\x00', '11111111-1111-4111-8111-111111111111',
                     '22222222-2222-4222-8222-222222222222', 201, now() + interval '1 day');",
        )
        .await
        .unwrap();
    for privilege in ["SELECT", "INSERT", "UPDATE"] {
        let granted: bool = orders
            .query_one(
                "SELECT has_table_privilege('orders_app', 'order_idempotency_keys', $1)",
                &[&privilege],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            granted,
            "orders_app lacks {privilege} on order_idempotency_keys"
        );
    }
    // Issue 17: the prune marks, a new table the relay writes; and DELETE
    // on the outbox, granted by hand for `run --prune-older-than`.
    orders
        .batch_execute(
            "INSERT INTO cdc_relay_prune_mark (slot_name, kind, wal_lsn, xid_horizon)
               VALUES ('cdc_relay', 'mark', '0/16B3748', '740');
             GRANT DELETE ON outbox TO cdc_relay;",
        )
        .await
        .unwrap();
    let granted = async |table: &str, privilege: &str| -> bool {
        orders
            .query_one(
                "SELECT has_table_privilege('cdc_relay', $1, $2)",
                &[&table, &privilege],
            )
            .await
            .unwrap()
            .get(0)
    };
    for privilege in ["SELECT", "INSERT", "DELETE"] {
        assert!(
            granted("cdc_relay_prune_mark", privilege).await,
            "cdc_relay lacks {privilege} on cdc_relay_prune_mark"
        );
    }
    assert!(!granted("cdc_relay_prune_mark", "UPDATE").await);
    // And the files run again over that data, changing nothing.
    let with_keys = row_counts(&orders).await;
    psql(&orders_url, &sql_dir(), &orders_files);
    assert_eq!(row_counts(&orders).await, with_keys);
    let endpoint: Option<String> = orders
        .query_one(
            "SELECT endpoint FROM cdc_relay_dead_letter WHERE event_id = 'e3'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(endpoint.as_deref(), Some("billing"), "kept by a re-run");
    assert!(
        granted("outbox", "DELETE").await,
        "a DELETE grant on the outbox survives roles.sql"
    );
}

/// A database made before dead letters were unique per event and
/// endpoint may hold duplicates (two writers at once, or a restart
/// re-streaming a refused event). The upgrade keeps each event's oldest
/// row, moves the others to the audit trail as discards naming the row
/// they duplicated, and builds the unique index; rows without an event id
/// all stay; a second run changes nothing; a duplicate is refused after.
#[tokio::test]
async fn an_upgrade_moves_duplicate_dead_letters_to_the_audit_trail() {
    let cluster = PgCluster::shared();
    let admin = cluster.connect_superuser("postgres").await.unwrap();
    let db = format!("up_dups_{}", std::process::id());
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let url = cluster.superuser_url(&db);
    let files = ["orders.sql", "publication.sql", "roles.sql"];
    psql(&url, &previous_sql(), &files);
    let orders = connect(&url).await.unwrap();
    orders
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error, commit_lsn) VALUES
               ('e1', 'first', '0/1'), ('e2', 'only', '0/2'), ('e1', 'second', '0/3'),
               (NULL, 'unreadable a', '0/4'), ('e1', 'third', '0/5'), (NULL, 'unreadable b', '0/6');",
        )
        .await
        .unwrap();
    let id_of = async |error: &str| -> i64 {
        orders
            .query_one(
                "SELECT id FROM cdc_relay_dead_letter WHERE error = $1",
                &[&error],
            )
            .await
            .unwrap()
            .get(0)
    };
    let (kept, second, third) = (
        id_of("first").await,
        id_of("second").await,
        id_of("third").await,
    );

    for _ in 0..2 {
        psql(&url, &sql_dir(), &files);
    }

    let left: Vec<(Option<String>, String)> = orders
        .query(
            "SELECT event_id, error FROM cdc_relay_dead_letter ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let some = |e: &str, why: &str| (Some(e.to_owned()), why.to_owned());
    assert_eq!(
        left,
        vec![
            some("e1", "first"),
            some("e2", "only"),
            (None, "unreadable a".to_owned()),
            (None, "unreadable b".to_owned()),
        ]
    );
    let audit: Vec<(String, i64, String, String)> = orders
        .query(
            "SELECT action, dead_letter_id, entry->>'error', reason \
             FROM cdc_relay_dead_letter_audit ORDER BY dead_letter_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let why = format!(
        "duplicate of dead letter {kept} (same event and endpoint), removed by sql/orders.sql"
    );
    assert_eq!(
        audit,
        vec![
            (
                "discard".to_owned(),
                second,
                "second".to_owned(),
                why.clone()
            ),
            ("discard".to_owned(), third, "third".to_owned(), why),
        ],
        "each removed duplicate is kept in the audit trail, once (the second run added none)"
    );
    let again = orders
        .execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error) VALUES ('e1', 'again')",
            &[],
        )
        .await
        .expect_err("a second row of e1 without an endpoint is refused");
    assert_eq!(
        again.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
    orders
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter (event_id, error, endpoint) VALUES ('e1', 'elsewhere', 'shipping');
             INSERT INTO cdc_relay_dead_letter (event_id, error) VALUES (NULL, 'unreadable c');",
        )
        .await
        .unwrap();
}
