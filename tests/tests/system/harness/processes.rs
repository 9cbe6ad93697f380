//! The harness's processes: stop and start, no orphan postmaster after a
//! drop or a SIGKILL, the service supervisor, the workspace binaries.

use super::*;

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
