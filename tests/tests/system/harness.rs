//! Tests of the harness itself against real PostgreSQL: cluster settings,
//! stacks, the least-privilege roles from `sql/`, re-runnable SQL files,
//! stop/start/restart, no orphan postmaster and the process supervisor.
//! The oracles themselves are tested in `oracle.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::harness::process::LISTENING;
use ::harness::stack::sql_dir;
use ::harness::{ClusterOptions, PgCluster, ServiceProcess, Stack, StopMode, connect, wait_until};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

const STEP: Duration = Duration::from_secs(10);

/// A process counts as gone once it no longer exists or is a zombie (its
/// parent died and PID 1 may not reap it).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.contains(") Z "),
        Err(_) => false,
    }
}

/// Pids whose parent is `pid` (the postmaster's backends and workers).
fn children_of(pid: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the command's closing parenthesis: state, ppid, ...
        let after = &stat[stat.rfind(')').unwrap_or(0) + 1..];
        if after.split_whitespace().nth(1) == Some(pid.to_string().as_str()) {
            children.push(child);
        }
    }
    children
}

async fn show(client: &Client, setting: &str) -> String {
    client
        .query_one(&format!("SHOW {setting}"), &[])
        .await
        .unwrap()
        .get(0)
}

fn sqlstate(err: &tokio_postgres::Error) -> Option<&SqlState> {
    err.code()
}

async fn assert_denied(client: &Client, sql: &str) {
    let err = client
        .batch_execute(sql)
        .await
        .expect_err(&format!("expected permission denied for: {sql}"));
    assert_eq!(
        sqlstate(&err),
        Some(&SqlState::INSUFFICIENT_PRIVILEGE),
        "{sql}: {err}"
    );
}

async fn stack() -> Stack {
    PgCluster::shared()
        .create_stack()
        .await
        .expect("create_stack")
}

/// The URL of `user` (with the password from `url_of_user`) to another database.
fn with_db(url_of_user: &str, db: &str) -> String {
    let (base, _) = url_of_user.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

#[tokio::test]
async fn cluster_runs_with_logical_replication_settings() {
    let cluster = PgCluster::shared();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    assert_eq!(show(&client, "wal_level").await, "logical");
    assert_eq!(show(&client, "max_replication_slots").await, "100");
    assert_eq!(show(&client, "max_wal_senders").await, "100");
    assert_eq!(show(&client, "wal_sender_timeout").await, "1min");
    assert_eq!(show(&client, "max_connections").await, "200");
    assert_eq!(show(&client, "max_prepared_transactions").await, "10");
    assert_eq!(show(&client, "fsync").await, "off");
    assert_eq!(show(&client, "full_page_writes").await, "off");
    // Kept on: off would lose acknowledged commits in an immediate shutdown.
    assert_eq!(show(&client, "synchronous_commit").await, "on");
    assert_eq!(show(&client, "listen_addresses").await, "127.0.0.1");
    assert_eq!(show(&client, "password_encryption").await, "scram-sha-256");
    assert_eq!(show(&client, "port").await, cluster.port().to_string());
    assert_eq!(
        Path::new(&show(&client, "data_directory").await),
        cluster.data_dir()
    );
    assert!(
        cluster
            .socket_dir()
            .join(format!(".s.PGSQL.{}", cluster.port()))
            .exists()
    );
    let pkglib = cluster.bin_dir().join("../lib/pg_stat_statements.so");
    if pkglib.exists() {
        assert_eq!(
            show(&client, "shared_preload_libraries").await,
            "pg_stat_statements"
        );
    }
    // Over TCP with SCRAM, as the superuser URL says.
    let tcp = connect(&cluster.superuser_url("postgres")).await.unwrap();
    let user: String = tcp
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "postgres");
    assert!(
        cluster
            .log_contents()
            .contains("database system is ready to accept connections")
    );
}

#[tokio::test]
async fn logical_slot_streams_only_outbox_inserts_through_the_stack_publication() {
    let stack = stack().await;
    let admin = stack.orders_admin().await.unwrap();
    admin
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&stack.slot],
        )
        .await
        .unwrap();

    let app = connect(&stack.orders_app_url).await.unwrap();
    app.batch_execute(
        "BEGIN;
         INSERT INTO orders (id, amount_cents, currency) VALUES ('11111111-1111-4111-8111-111111111111', 500, 'EUR');
         INSERT INTO outbox (id, aggregate_id, event_type, payload)
           VALUES ('22222222-2222-4222-8222-222222222222', '11111111-1111-4111-8111-111111111111',
                   'OrderCreated', '{\"order_id\":\"11111111-1111-4111-8111-111111111111\",\"amount_cents\":500}');
         COMMIT;",
    )
    .await
    .unwrap();
    admin
        .batch_execute("UPDATE outbox SET published_at = now()")
        .await
        .unwrap();

    // pgoutput message tags: B(egin), R(elation), I(nsert), U(pdate), C(ommit).
    let tags: Vec<String> = admin
        .query(
            "SELECT chr(get_byte(data, 0)) FROM pg_logical_slot_peek_binary_changes(
               $1, NULL, NULL, 'proto_version', '1', 'publication_names', $2)",
            &[&stack.slot, &stack.publication],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        tags.iter().filter(|t| *t == "I").count(),
        1,
        "one insert (outbox only): {tags:?}"
    );
    assert!(
        !tags.contains(&"U".to_owned()),
        "updates are not published: {tags:?}"
    );

    let active: bool = admin
        .query_one(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&stack.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!active);
    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&stack.slot])
        .await
        .unwrap();
    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&stack.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

#[tokio::test]
async fn create_stack_twice_gives_distinct_databases_slots_and_publications() {
    let (a, b) = tokio::join!(stack(), stack());
    assert_ne!(a.orders_db, b.orders_db);
    assert_ne!(a.billing_db, b.billing_db);
    assert_ne!(a.slot, b.slot);
    assert_ne!(a.publication, b.publication);
    assert_ne!(a.publication, "cdc_relay_outbox");

    let a_admin = a.orders_admin().await.unwrap();
    a_admin
        .batch_execute(
            "INSERT INTO orders (id, amount_cents, currency) VALUES (gen_random_uuid(), 1, 'EUR')",
        )
        .await
        .unwrap();
    let b_admin = b.orders_admin().await.unwrap();
    let count: i64 = b_admin
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 0, "stacks share nothing");
    let pubs: i64 = b_admin
        .query_one(
            "SELECT count(*) FROM pg_publication WHERE pubname = $1",
            &[&b.publication],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pubs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stack_is_reaped_by_the_next_one_and_a_held_one_is_not() {
    let cluster = PgCluster::start(ClusterOptions::default()).unwrap();
    let held = cluster.create_stack().await.unwrap();
    let gone = cluster.create_stack().await.unwrap();
    cluster.create_payments(&gone).await.unwrap();
    let admin = cluster.connect_superuser("postgres").await.unwrap();
    for stack in [&held, &gone] {
        stack
            .orders_admin()
            .await
            .unwrap()
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&stack.slot],
            )
            .await
            .unwrap();
    }
    let clone = gone.clone();
    let gone_db = gone.orders_db.clone();
    let count = |sql: &'static str, arg: String| {
        let admin = &admin;
        async move {
            let n: i64 = admin.query_one(sql, &[&arg]).await.unwrap().get(0);
            n
        }
    };
    let databases = "SELECT count(*) FROM pg_database WHERE datname LIKE '%' || $1";
    let slots = "SELECT count(*) FROM pg_replication_slots WHERE database = $1";
    drop(gone);
    let _third = cluster.create_stack().await.unwrap();
    let suffix = gone_db.trim_start_matches("orders_").to_owned();
    assert_eq!(
        count(databases, suffix.clone()).await,
        3,
        "a clone still holds it"
    );
    drop(clone);
    let _fourth = cluster.create_stack().await.unwrap();
    assert_eq!(
        count(databases, suffix).await,
        0,
        "orders, billing and payments dropped"
    );
    assert_eq!(count(slots, gone_db).await, 0, "its slot dropped");
    assert_eq!(
        count(slots, held.orders_db.clone()).await,
        1,
        "the held stack's slot kept"
    );
}

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

#[tokio::test]
async fn sql_files_are_rerunnable_by_harness_and_by_psql() {
    let stack = stack().await;
    stack.apply_schema().await.unwrap();
    stack.apply_schema().await.unwrap();

    // As an operator runs them: psql, stop on the first error, twice, with the
    // file's own publication name.
    for round in 0..2 {
        for (url, files) in [
            (
                &stack.orders_admin_url,
                &["orders.sql", "publication.sql", "roles.sql"][..],
            ),
            (&stack.billing_admin_url, &["billing.sql", "roles.sql"][..]),
        ] {
            for file in files {
                let output = PgCluster::shared()
                    .command("psql")
                    .arg(url)
                    .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
                    .arg(sql_dir().join(file))
                    .output()
                    .unwrap();
                assert!(
                    output.status.success(),
                    "round {round}, {file}: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }

    // publication.sql converges a drifted publication back to insert-only outbox.
    let admin = stack.orders_admin().await.unwrap();
    admin
        .batch_execute(&format!(
            "ALTER PUBLICATION {0} SET (publish = 'insert, update, delete');
             ALTER PUBLICATION {0} DROP TABLE outbox",
            stack.publication
        ))
        .await
        .unwrap();
    stack.apply_schema().await.unwrap();
    let row = admin
        .query_one(
            "SELECT pubinsert, pubupdate OR pubdelete OR pubtruncate,
                    (SELECT count(*) FROM pg_publication_tables t WHERE t.pubname = p.pubname AND tablename = 'outbox')
             FROM pg_publication p WHERE pubname = $1",
            &[&stack.publication],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    assert!(!row.get::<_, bool>(1));
    assert_eq!(row.get::<_, i64>(2), 1);

    // Privileges are still exactly right after all that.
    let app = connect(&stack.orders_app_url).await.unwrap();
    app.batch_execute("SELECT count(*) FROM outbox")
        .await
        .unwrap();
    assert_denied(&app, "UPDATE outbox SET attempts = 1").await;
}

#[tokio::test]
async fn stop_start_again_and_immediate_restart_keep_the_data() {
    let cluster = PgCluster::start(ClusterOptions::default()).unwrap();
    let port = cluster.port();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    client
        .batch_execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)")
        .await
        .unwrap();
    drop(client);

    let first = cluster.postmaster_pid().unwrap();
    cluster.stop(StopMode::Fast).unwrap();
    assert_eq!(cluster.postmaster_pid(), None);
    assert!(!alive(first));
    cluster.stop(StopMode::Fast).unwrap();

    cluster.start_again().unwrap();
    assert!(
        cluster.start_again().is_err(),
        "starting a running cluster is refused"
    );
    let client = cluster.connect_superuser("postgres").await.unwrap();
    client
        .batch_execute("INSERT INTO kept VALUES (2)")
        .await
        .unwrap();

    let second = cluster.postmaster_pid().unwrap();
    cluster.restart(StopMode::Immediate).unwrap();
    assert!(
        client.batch_execute("SELECT 1").await.is_err(),
        "the old session died with the server"
    );
    assert!(!alive(second));
    assert_eq!(cluster.port(), port);
    let client = connect(&cluster.superuser_url("postgres")).await.unwrap();
    let count: i64 = client
        .query_one("SELECT count(*) FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        count, 2,
        "committed rows survive an immediate (crash) restart"
    );
    assert!(
        cluster
            .log_contents()
            .contains("database system was interrupted")
    );
}

#[tokio::test]
async fn dropped_cluster_leaves_no_process_and_no_directory() {
    let cluster = PgCluster::start(ClusterOptions::default()).unwrap();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    client.batch_execute("SELECT 1").await.unwrap();
    let postmaster = cluster.postmaster_pid().unwrap();
    let mut pids = children_of(postmaster);
    assert!(!pids.is_empty(), "a running postmaster has children");
    pids.push(postmaster);
    let dir = cluster.socket_dir().to_path_buf();

    drop(cluster);
    for pid in &pids {
        assert!(!alive(*pid), "pid {pid} survived the drop");
    }
    assert!(!dir.exists(), "{} survived the drop", dir.display());
}

/// Runs `throwaway-pg` (a process owning a cluster), SIGKILLs it — no Drop
/// runs — and expects the guardian to take the postmaster down.
#[tokio::test]
async fn sigkilled_owner_leaves_no_postmaster() {
    let mut owner = ServiceProcess::spawn(env!("CARGO_BIN_EXE_throwaway-pg"), &[], &[]).unwrap();
    owner
        .wait_for_line("READY", Duration::from_secs(60))
        .await
        .unwrap();
    let value = |key: &str| -> String {
        let logs = owner.logs();
        let line = logs
            .lines()
            .find(|l| l.starts_with(&format!("{key}=")))
            .unwrap()
            .to_owned();
        line[key.len() + 1..].to_owned()
    };
    let postmaster: u32 = value("POSTMASTER_PID").parse().unwrap();
    let data_dir = PathBuf::from(value("PGDATA"));
    let mut pids = children_of(postmaster);
    pids.push(postmaster);
    assert!(alive(postmaster));

    owner.sigkill();
    let killed = Instant::now();
    wait_until(
        "the orphaned postmaster to exit",
        Duration::from_secs(5),
        || async { !alive(postmaster) },
    )
    .await
    .unwrap();
    let elapsed = killed.elapsed();
    eprintln!("postmaster gone {elapsed:?} after its owner was SIGKILLed");
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    wait_until("the postmaster's children to exit", STEP, || async {
        pids.iter().all(|p| !alive(*p))
    })
    .await
    .unwrap();
    wait_until("the cluster directory to be removed", STEP, || async {
        !data_dir.exists()
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn service_process_captures_output_and_finds_the_listen_address() {
    let script = format!(
        "echo starting; seq 1 2000; echo 'oops' >&2; echo '{LISTENING}127.0.0.1:4321'; exec sleep 30"
    );
    let mut process = ServiceProcess::spawn("sh", &["-c", &script], &[("UNUSED", "1")]).unwrap();
    assert_eq!(
        process.listen_addr(STEP).await.unwrap(),
        "http://127.0.0.1:4321"
    );
    assert_eq!(process.wait_for_line("oops", STEP).await.unwrap(), "oops");
    assert_eq!(process.wait_for_line("1999", STEP).await.unwrap(), "1999");
    assert!(process.logs().contains("starting\n"));
    assert!(
        std::fs::read_to_string(process.log_dir().join("stderr.log"))
            .unwrap()
            .contains("oops")
    );

    let err = process
        .wait_for_line("never printed", Duration::from_millis(200))
        .await
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("never printed") && text.contains(LISTENING),
        "{text}"
    );

    process.sigterm();
    let status = process.wait_exit(STEP).await.unwrap();
    assert!(!status.success());
}

#[tokio::test]
async fn wait_for_line_fails_fast_when_the_process_exits_and_drop_kills() {
    let process = ServiceProcess::spawn("sh", &["-c", "echo bye"], &[]).unwrap();
    let started = Instant::now();
    let err = process
        .wait_for_line("hello", Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "no waiting for the timeout"
    );
    assert!(format!("{err:#}").contains("bye"));

    let sleeper = ServiceProcess::spawn("sleep", &["30"], &[]).unwrap();
    let pid = sleeper.pid();
    let dir = sleeper.log_dir().to_path_buf();
    assert!(alive(pid));
    drop(sleeper);
    assert!(!alive(pid));
    wait_until("the log directory to be removed", STEP, || async {
        !dir.exists()
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn bins_builds_and_finds_the_workspace_binaries() {
    let paths =
        tokio::task::spawn_blocking(|| ::harness::bins::WORKSPACE_BINS.map(::harness::bins::path))
            .await
            .unwrap();
    for path in paths {
        let meta = std::fs::metadata(&path).unwrap();
        assert!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0,
            "{}",
            path.display()
        );
    }
}
