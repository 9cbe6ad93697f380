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
    // For psql over the socket above (PGHOST/PGPORT): as the superuser.
    println!("PGUSER={}", harness::pg::SUPERUSER);
    let stack = if args.stack {
        Some(cluster.create_stack().await?)
    } else {
        None
    };
    if let Some(stack) = &stack {
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
    if let Some(stack) = &stack {
        // How to use it from another shell, on stderr (stdout stays
        // KEY=value lines a script can read). The binaries are the ones
        // built beside this one (target/debug or target/release).
        let bin = std::env::current_exe()?
            .parent()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| ".".into());
        eprintln!(
            "throwaway-pg: in another shell, export the KEY=value lines above\n\
             (`export PGHOST=… PGPORT=… PGUSER=… ORDERS_DATABASE_URL=… …`), then:\n\
             \x20 psql -d {orders}   # PGHOST, PGPORT, PGUSER\n\
             \x20 export EVENT_SECRET=$(openssl rand -hex 32)\n\
             \x20 {bin}/billing --listen 127.0.0.1:8081    # reads BILLING_DATABASE_URL, EVENT_SECRET\n\
             \x20 {bin}/orders --listen 127.0.0.1:8080     # reads ORDERS_DATABASE_URL\n\
             \x20 CDC_RELAY_DATABASE_URL=$ORDERS_ADMIN_URL {bin}/cdc-relay setup\n\
             \x20 {bin}/cdc-relay run --sink-url http://127.0.0.1:8081/inbox   # reads CDC_RELAY_*, EVENT_SECRET\n\
             (the binaries beside this one: `cargo build --workspace` builds them)",
            orders = stack.orders_db,
        );
    }

    let mut terminate = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    drop(cluster);
    Ok(())
}
