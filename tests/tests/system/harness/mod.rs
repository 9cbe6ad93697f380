//! Tests of the harness itself against real PostgreSQL: cluster settings,
//! stacks, the least-privilege roles from `sql/`, re-runnable SQL files,
//! stop/start/restart, no orphan postmaster and the process supervisor.
//! The oracles themselves are tested in `oracle.rs`. The roles' privileges
//! are in `roles.rs`, processes (stop, start, orphans, the supervisor) in
//! `processes.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::harness::process::LISTENING;
use ::harness::stack::sql_dir;
use ::harness::{ClusterOptions, PgCluster, ServiceProcess, Stack, StopMode, connect, wait_until};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

mod processes;
mod roles;

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
