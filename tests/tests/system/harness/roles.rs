//! The least-privilege roles from `sql/`: logins, what each may and may
//! not touch.

use super::*;

#[tokio::test]
async fn roles_log_in_over_tcp_with_scram_and_a_wrong_password_fails() {
    let stack = stack().await;
    for (url, role) in [
        (&stack.orders_app_url, "orders_app"),
        (&stack.billing_app_url, "billing_app"),
        (&stack.relay_url, "cdc_relay"),
    ] {
        let client = connect(url)
            .await
            .unwrap_or_else(|err| panic!("{role}: {err:#}"));
        let user: String = client
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(user, role);
    }

    let wrong = stack
        .orders_app_url
        .replacen("orders_app:", "orders_app:not-the-password", 1);
    let err = connect(&wrong)
        .await
        .expect_err("a wrong password must fail");
    assert!(
        format!("{err:#}").contains("password authentication failed"),
        "{err:#}"
    );

    let admin = stack.orders_admin().await.unwrap();
    let scram: bool = admin
        .query_one(
            "SELECT bool_and(rolpassword LIKE 'SCRAM-SHA-256$%') FROM pg_authid
             WHERE rolname IN ('orders_app', 'billing_app', 'cdc_relay')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(scram, "passwords are stored as SCRAM verifiers");
}

#[tokio::test]
async fn relay_role_opens_a_logical_replication_connection() {
    let cluster = PgCluster::shared();
    let psql = cluster.bin_dir().join("psql");
    assert!(
        psql.exists(),
        "psql ships with the server packages: {}",
        psql.display()
    );
    let stack = stack().await;
    let output = cluster
        .command("psql")
        .arg(format!("{}?replication=database", stack.relay_url))
        .args(["-X", "-A", "-t", "-c", "IDENTIFY_SYSTEM"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains(&stack.orders_db),
        "IDENTIFY_SYSTEM names the database: {stdout}"
    );
}

#[tokio::test]
async fn no_app_role_is_privileged_or_owns_anything() {
    let stack = stack().await;
    let admin = stack.orders_admin().await.unwrap();
    let rows = admin
        .query(
            "SELECT rolname::text, rolsuper, rolcreatedb, rolcreaterole, rolbypassrls, rolreplication, rolcanlogin
             FROM pg_roles WHERE rolname IN ('orders_app', 'billing_app', 'cdc_relay') ORDER BY rolname",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 3);
    for row in rows {
        let name: String = row.get(0);
        for (i, what) in [
            (1, "superuser"),
            (2, "createdb"),
            (3, "createrole"),
            (4, "bypassrls"),
        ] {
            assert!(!row.get::<_, bool>(i), "{name} must not have {what}");
        }
        assert_eq!(
            row.get::<_, bool>(5),
            name == "cdc_relay",
            "only cdc_relay has REPLICATION"
        );
        assert!(row.get::<_, bool>(6), "{name} can log in");
    }
    let owned: i64 = admin
        .query_one(
            "SELECT (SELECT count(*) FROM pg_database WHERE pg_get_userbyid(datdba) IN ('orders_app', 'billing_app', 'cdc_relay'))
                  + (SELECT count(*) FROM pg_class WHERE pg_get_userbyid(relowner) IN ('orders_app', 'billing_app', 'cdc_relay'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owned, 0);
    let memberships: Vec<String> = admin
        .query(
            "SELECT pg_get_userbyid(member) || ' in ' || pg_get_userbyid(roleid) FROM pg_auth_members
             WHERE pg_get_userbyid(member) IN ('orders_app', 'billing_app', 'cdc_relay') ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        memberships,
        ["cdc_relay in pg_read_all_stats"],
        "the relay's watchdog reads pg_stat_replication details; nothing else is granted a role"
    );
}

/// Issue 18, item 9: what `roles.sql` takes from the app roles besides
/// table grants, tried as each role: the maintenance databases (CONNECT,
/// TEMPORARY; the relay keeps CONNECT on `postgres` only, to name a
/// catalog lock's holder), temporary tables in their own database, and
/// large objects.
#[tokio::test]
async fn app_roles_cannot_use_maintenance_databases_temp_tables_or_large_objects() {
    let stack = stack().await;
    let admin = stack.orders_admin().await.unwrap();
    let roles = [
        ("orders_app", &stack.orders_app_url),
        ("billing_app", &stack.billing_app_url),
        ("cdc_relay", &stack.relay_url),
    ];
    for (role, url) in roles {
        let own = connect(url).await.unwrap();
        for maintenance in ["postgres", "template1"] {
            // The one exception: the relay reads a catalog lock's holder
            // from `postgres` when a login to its own database waits.
            if role == "cdc_relay" && maintenance == "postgres" {
                let there = connect(&with_db(url, maintenance)).await.unwrap();
                assert_denied(&there, "CREATE TEMP TABLE mine (x int)").await;
            } else {
                let err = connect(&with_db(url, maintenance))
                    .await
                    .expect_err(&format!("{role} connected to {maintenance}"));
                assert!(
                    format!("{err:#}").contains("permission denied for database"),
                    "{role} -> {maintenance}: {err:#}"
                );
            }
            // TEMPORARY is revoked as well, for the day someone grants
            // CONNECT back (asked of the server, as the role itself).
            let temp: bool = own
                .query_one(
                    "SELECT has_database_privilege($1, 'TEMPORARY')",
                    &[&maintenance],
                )
                .await
                .unwrap()
                .get(0);
            assert!(!temp, "{role} has TEMPORARY on {maintenance}");
        }
        assert_denied(&own, "CREATE TEMP TABLE mine (x int)").await;
        for sql in [
            "SELECT lo_creat(-1)",
            "SELECT lo_create(0)",
            "SELECT lo_from_bytea(0, '\\x00')",
            "SELECT lo_import('/etc/hostname')",
            "SELECT lo_open(1, 131072)",
            "SELECT lo_unlink(1)",
            "SELECT lo_get(1)",
            "SELECT lo_put(1, 0, '\\x00')",
        ] {
            assert_denied(&own, sql).await;
        }
    }
    // The superuser still may: the revocation is PUBLIC's, not everyone's.
    let oid: u32 = admin
        .query_one("SELECT lo_from_bytea(0, '\\x01')", &[])
        .await
        .unwrap()
        .get(0);
    admin
        .execute("SELECT lo_unlink($1)", &[&oid])
        .await
        .unwrap();
}

/// Issue 18, item 8: the relay's role has REPLICATION, but no `replication`
/// line of `pg_hba.conf` names it, so it cannot copy the cluster with
/// `pg_basebackup` (a physical replication connection); the superuser can
/// open one (the line works).
#[tokio::test]
async fn relay_role_cannot_open_a_physical_replication_connection() {
    let stack = stack().await;
    let cluster = PgCluster::shared();
    let config: tokio_postgres::Config = stack.relay_url.parse().unwrap();
    let password = String::from_utf8(config.get_password().unwrap().to_vec()).unwrap();
    let target = tempfile::tempdir().unwrap();
    let output = cluster
        .command("pg_basebackup")
        .args(["-h", cluster.host(), "-p", &cluster.port().to_string()])
        .args(["-U", "cdc_relay", "-w", "-X", "none", "-D"])
        .arg(target.path().join("copy"))
        .env("PGPASSWORD", &password)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "pg_basebackup as cdc_relay succeeded"
    );
    assert!(
        stderr.contains("no pg_hba.conf entry for replication connection"),
        "{stderr}"
    );
    // The same statement-level check as the superuser: the line exists.
    let output = cluster
        .command("psql")
        .arg(format!(
            "host={} port={} user=postgres password={} replication=true dbname=replication",
            cluster.host(),
            cluster.port(),
            cluster.superuser_password()
        ))
        .args(["-X", "-A", "-t", "-c", "IDENTIFY_SYSTEM"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the superuser's physical replication connection: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn orders_app_writes_orders_but_cannot_read_billing_nor_create_tables() {
    let stack = stack().await;
    let app = connect(&stack.orders_app_url).await.unwrap();
    // The tutorial's Orders transaction works as is.
    app.batch_execute(
        "BEGIN;
         INSERT INTO orders (id, amount_cents, currency) VALUES ('33333333-3333-4333-8333-333333333333', 100, 'USD');
         INSERT INTO outbox (id, aggregate_id, event_type, payload)
           VALUES (gen_random_uuid(), '33333333-3333-4333-8333-333333333333', 'OrderCreated', CAST('{}' AS jsonb));
         COMMIT;",
    )
    .await
    .unwrap();
    app.batch_execute("SELECT * FROM orders; SELECT * FROM outbox")
        .await
        .unwrap();
    assert_denied(&app, "UPDATE outbox SET published_at = now()").await;
    assert_denied(&app, "DELETE FROM orders").await;
    assert_denied(&app, "CREATE TABLE mine (x int)").await;
    assert_denied(&app, "CREATE TEMP TABLE mine (x int)").await;
    assert_denied(&app, "SELECT * FROM cdc_relay_dead_letter").await;

    // The billing database refuses the connection outright ...
    let err = connect(&with_db(&stack.orders_app_url, &stack.billing_db))
        .await
        .expect_err("no CONNECT on billing");
    assert!(
        format!("{err:#}").contains("permission denied for database"),
        "{err:#}"
    );
    // ... and even with CONNECT granted by mistake, invoices stay unreadable.
    let billing_admin = stack.billing_admin().await.unwrap();
    billing_admin
        .batch_execute(&format!(
            "GRANT CONNECT ON DATABASE {} TO orders_app",
            stack.billing_db
        ))
        .await
        .unwrap();
    let in_billing = connect(&with_db(&stack.orders_app_url, &stack.billing_db))
        .await
        .unwrap();
    assert_denied(&in_billing, "SELECT * FROM invoices").await;
    assert_denied(&in_billing, "CREATE TABLE mine (x int)").await;
}

#[tokio::test]
async fn billing_app_writes_its_inbox_but_cannot_touch_outbox() {
    let stack = stack().await;
    let app = connect(&stack.billing_app_url).await.unwrap();
    // The tutorial's inbox statement: ON CONFLICT DO NOTHING ... RETURNING.
    let sql =
        "INSERT INTO processed_events (event_id) VALUES ('44444444-4444-4444-8444-444444444444')
               ON CONFLICT DO NOTHING RETURNING event_id";
    assert_eq!(app.query(sql, &[]).await.unwrap().len(), 1);
    assert_eq!(
        app.query(sql, &[]).await.unwrap().len(),
        0,
        "a replay is a no-op"
    );
    app.batch_execute(
        "INSERT INTO invoices (id, order_id, amount_cents, currency)
         VALUES (gen_random_uuid(), gen_random_uuid(), 100, 'EUR')",
    )
    .await
    .unwrap();
    assert_denied(&app, "UPDATE invoices SET amount_cents = 1").await;
    assert_denied(&app, "DELETE FROM processed_events").await;
    assert_denied(&app, "CREATE TABLE mine (x int)").await;

    let err = connect(&with_db(&stack.billing_app_url, &stack.orders_db))
        .await
        .expect_err("no CONNECT on orders");
    assert!(
        format!("{err:#}").contains("permission denied for database"),
        "{err:#}"
    );
    let orders_admin = stack.orders_admin().await.unwrap();
    orders_admin
        .batch_execute(&format!(
            "GRANT CONNECT ON DATABASE {} TO billing_app",
            stack.orders_db
        ))
        .await
        .unwrap();
    let in_orders = connect(&with_db(&stack.billing_app_url, &stack.orders_db))
        .await
        .unwrap();
    assert_denied(&in_orders, "SELECT * FROM outbox").await;
    assert_denied(
        &in_orders,
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), gen_random_uuid(), 'x', '{}')",
    )
    .await;
}

#[tokio::test]
async fn cdc_relay_reads_outbox_owns_dead_letters_and_cannot_write_orders() {
    let stack = stack().await;
    let relay = connect(&stack.relay_url).await.unwrap();
    relay.batch_execute("SELECT * FROM outbox").await.unwrap();
    assert_denied(
        &relay,
        "INSERT INTO orders (id, amount_cents, currency) VALUES (gen_random_uuid(), 1, 'EUR')",
    )
    .await;
    assert_denied(&relay, "UPDATE outbox SET published_at = now()").await;
    assert_denied(&relay, "SELECT * FROM orders").await;
    assert_denied(&relay, "CREATE TABLE mine (x int)").await;
    assert_denied(&relay, "CREATE PUBLICATION mine FOR TABLE outbox").await;

    relay
        .batch_execute(
            "INSERT INTO cdc_relay_dead_letter
               (event_id, aggregate_key, event_type, payload, commit_lsn, end_lsn, http_status, error, attempts)
             VALUES ('e1', 'a1', 'OrderCreated', '{}', '0/16B3748', '0/16B3780', 422, 'invalid_event', 1)",
        )
        .await
        .unwrap();
    let listed = relay
        .query("SELECT id, event_id FROM cdc_relay_dead_letter", &[])
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    relay
        .batch_execute(
            "WITH gone AS (DELETE FROM cdc_relay_dead_letter WHERE event_id = 'e1' RETURNING *)
             INSERT INTO cdc_relay_dead_letter_audit (dead_letter_id, event_id, entry, reason)
             SELECT id, event_id, to_jsonb(gone), 'test' FROM gone",
        )
        .await
        .unwrap();
    assert_denied(&relay, "SELECT * FROM cdc_relay_dead_letter_audit").await;
    assert_denied(&relay, "DELETE FROM cdc_relay_dead_letter_audit").await;

    let admin = stack.orders_admin().await.unwrap();
    let row = admin
        .query_one(
            "SELECT action, performed_by, entry->>'error' FROM cdc_relay_dead_letter_audit",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "discard");
    assert_eq!(row.get::<_, String>(1), "cdc_relay");
    assert_eq!(row.get::<_, String>(2), "invalid_event");
}
