//! What a harness cluster's data directory holds besides the data: the
//! `initdb` call, `pg_hba.conf` and `harness.conf` (the settings, included
//! from `postgresql.conf`). A standby's directory comes from
//! `pg_basebackup` instead, then gets a `harness.conf` of its own.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{Context, bail};

use crate::pg::{ClusterOptions, NewCluster, SUPERUSER, hand_over};
use crate::pgbin::PgBin;

pub(crate) fn initdb(new: &NewCluster<'_>, password: &str) -> anyhow::Result<()> {
    let pwfile = new.root.join("pwfile");
    {
        let mut file = File::create(&pwfile)?;
        fs::set_permissions(&pwfile, fs::Permissions::from_mode(0o600))?;
        writeln!(file, "{password}")?;
    }
    hand_over(&pwfile, new.run_as)?;
    let output = new
        .command("initdb")
        .arg("-D")
        .arg(new.data_dir)
        .arg("--username")
        .arg(SUPERUSER)
        .arg(format!("--pwfile={}", pwfile.display()))
        .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
        .args(["--encoding=UTF8", "--locale=C", "--no-sync"])
        .output()
        .with_context(|| format!("running {}", new.bin.path("initdb").display()))?;
    fs::remove_file(&pwfile)?;
    if !output.status.success() {
        bail!(
            "initdb failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// Trust over the socket in our private directory; SCRAM over TCP. A logical
/// replication connection names a database, so it matches the `all` line;
/// the `replication` line serves physical replication (standbys,
/// `pg_basebackup`) and names the superuser only: the relay's role has
/// REPLICATION, and a `replication` line for it would let it copy the
/// whole cluster (issue 18, item 8), as in `deploy/postgresql/pg_hba.conf`.
pub(crate) fn write_hba(data_dir: &Path) -> anyhow::Result<()> {
    let hba = format!(
        "\
# Written by the cdc-relay test harness.
local all         all                 trust
host  all         all  127.0.0.1/32  scram-sha-256
host  replication {SUPERUSER}  127.0.0.1/32  scram-sha-256
"
    );
    fs::write(data_dir.join("pg_hba.conf"), hba).context("writing pg_hba.conf")
}

/// Writes `harness.conf` and includes it from `postgresql.conf` (once).
/// A standby gets its own (its port, its directory) over the copy of its primary's.
pub(crate) fn write_settings(
    data_dir: &Path,
    socket_dir: &Path,
    port: u16,
    opts: &ClusterOptions,
    bin: &PgBin,
    standby_slots: &str,
) -> anyhow::Result<()> {
    let durable = if opts.fsync { "on" } else { "off" };
    let mut settings: Vec<(&str, String)> = vec![
        ("listen_addresses", "127.0.0.1".to_owned()),
        ("port", port.to_string()),
        ("unix_socket_directories", socket_dir.display().to_string()),
        ("wal_level", "logical".to_owned()),
        // Slots of finished tests are dropped when the next stack is
        // made (`stack::Lease`): only running tests hold any.
        ("max_replication_slots", "100".to_owned()),
        ("max_wal_senders", "100".to_owned()),
        ("wal_sender_timeout", opts.wal_sender_timeout.clone()),
        ("max_connections", "200".to_owned()),
        ("max_prepared_transactions", "10".to_owned()),
        ("fsync", durable.to_owned()),
        ("synchronous_commit", "on".to_owned()),
        ("full_page_writes", durable.to_owned()),
        ("logging_collector", "off".to_owned()),
        ("log_line_prefix", "%m [%p] %q%u@%d ".to_owned()),
    ];
    if bin.has_pg_stat_statements() {
        settings.push(("shared_preload_libraries", "pg_stat_statements".to_owned()));
    }
    if let Some(size) = &opts.max_slot_wal_keep_size {
        settings.push(("max_slot_wal_keep_size", size.clone()));
    }
    if !standby_slots.is_empty() {
        settings.push(("synchronized_standby_slots", standby_slots.to_owned()));
    }
    let mut conf = String::from("# Written by the cdc-relay test harness.\n");
    for (name, value) in settings.iter().map(|(n, v)| (*n, v.as_str())).chain(
        opts.extra_settings
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str())),
    ) {
        conf.push_str(&format!("{name} = '{}'\n", value.replace('\'', "''")));
    }
    fs::write(data_dir.join("harness.conf"), conf).context("writing harness.conf")?;

    let main_conf = data_dir.join("postgresql.conf");
    let include = "include 'harness.conf'\n";
    let current = fs::read_to_string(&main_conf).context("reading postgresql.conf")?;
    if !current.contains(include) {
        let mut file = OpenOptions::new().append(true).open(&main_conf)?;
        file.write_all(include.as_bytes())?;
    }
    Ok(())
}
