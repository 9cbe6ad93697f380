//! `throwaway-pg`: starts a throwaway PostgreSQL cluster (and optionally one
//! stack) with the harness, prints how to reach it as `KEY=value` lines, and
//! keeps it until SIGINT/SIGTERM. When this process dies any other way, the
//! harness's guardian removes the cluster. Used by the demo and by the test
//! that proves no postmaster outlives its owner.

use clap::Parser;
use harness::{ClusterOptions, PgCluster};
use tokio::signal::unix::{SignalKind, signal};

/// Command line of `throwaway-pg`.
#[derive(Debug, Parser)]
#[command(about = "Start a throwaway PostgreSQL cluster for cdc-relay and print its URLs")]
struct Args {
    /// Also create one database pair (orders + billing) with roles and publication.
    #[arg(long)]
    stack: bool,
    /// Durable commits (fsync on), as for benchmarks.
    #[arg(long)]
    fsync: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cluster = PgCluster::start(ClusterOptions {
        fsync: args.fsync,
        ..ClusterOptions::default()
    })?;
    println!(
        "POSTMASTER_PID={}",
        cluster.postmaster_pid().unwrap_or_default()
    );
    println!("PGHOST={}", cluster.socket_dir().display());
    println!("PGPORT={}", cluster.port());
    println!("PGDATA={}", cluster.data_dir().display());
    println!("SUPERUSER_URL={}", cluster.superuser_url("postgres"));
    if args.stack {
        let stack = cluster.create_stack().await?;
        println!("ORDERS_DATABASE_URL={}", stack.orders_app_url);
        println!("BILLING_DATABASE_URL={}", stack.billing_app_url);
        println!("RELAY_DATABASE_URL={}", stack.relay_url);
        println!("ORDERS_ADMIN_URL={}", stack.orders_admin_url);
        println!("BILLING_ADMIN_URL={}", stack.billing_admin_url);
        println!("SLOT={}", stack.slot);
        println!("PUBLICATION={}", stack.publication);
        // The names `cdc-relay` itself reads: `eval` or `export` these and
        // run `cdc-relay status` (or `run --sink-url …`) against the stack.
        println!("CDC_RELAY_DATABASE_URL={}", stack.relay_url);
        println!("CDC_RELAY_SLOT={}", stack.slot);
        println!("CDC_RELAY_PUBLICATION={}", stack.publication);
    }
    println!("READY");

    let mut terminate = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    drop(cluster);
    Ok(())
}
