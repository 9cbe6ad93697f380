//! What the relay cannot honour on both of its connections, and a
//! `--replication-url` or `--standby-url` weaker or broken beside
//! `--database-url`: refused before connecting, exit 2, named.

use harness::PgCluster;
use harness::app;
use harness::pki::{self, Ca, Request, path_str};

use super::tries::{Outcome, Tries};

/// What the relay cannot do on both of its connections is refused before
/// it connects: exit 2, the parameter named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_honoured_on_both_connections_exits_2_naming_it() -> anyhow::Result<()> {
    let cluster = PgCluster::shared();
    let stack = cluster.create_stack().await?;
    let home = tempfile::tempdir()?;
    let t = Tries {
        cluster,
        stack: &stack,
        home: home.path().to_owned(),
        cert_file: None,
    };
    for (params, names) in [
        (
            "sslmode=require&channel_binding=require",
            "channel_binding=require",
        ),
        (
            "sslmode=require&sslnegotiation=direct",
            "sslnegotiation=direct",
        ),
        ("sslrootcert=system&sslmode=require", "sslrootcert=system"),
        ("sslmode=verify-full", "sslrootcert"),
        ("sslmode=require&sslpassword=x", "sslpassword"),
        ("sslmode=require&sslcrl=/crl.pem", "sslcrl"),
        // libpq takes a repeated parameter's last value; tokio-postgres a
        // second host: given twice, it is refused.
        (
            "sslmode=disable&sslrootcert=/ca.pem&sslmode=verify-full",
            "sslmode is given twice",
        ),
        ("host=localhost", "host is given twice"),
        // libpq refuses a parameter without a value; passed over, it would
        // leave the default (prefer) in force.
        ("sslmode", "sslmode in the URL's query has no value"),
    ] {
        match t.relay("127.0.0.1", params).await? {
            Outcome::Refused {
                code: Some(2),
                output,
            } if output.contains(names) => {}
            other => anyhow::bail!("{params}: expected exit 2 naming {names}, got {other:?}"),
        }
    }

    // A --replication-url silent about TLS beside a --database-url that
    // verifies the server: the stream would go unverified by oversight
    // (each URL's TLS parameters are its own). Exit 2 naming the mode.
    let dir = pki::dir()?;
    let ca = Ca::new(dir.path(), "ca")?;
    let verifying = t.url(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={}", path_str(&ca.cert)?),
    );
    let silent = app::relay_command(
        &stack,
        &verifying,
        &["status", "--replication-url", &stack.relay_url],
        &[],
    )
    .await?;
    assert!(
        silent.code() == Some(2)
            && silent.text().contains("--replication-url")
            && silent.text().contains("sslmode=verify-full"),
        "{}",
        silent.text()
    );
    // PGSSLMODE=disable, which the --database-url's own sslmode overrides,
    // is no choice made for the stream either (it passed the guard and the
    // stream went plain text): refused, naming the variable.
    let from_env = app::relay_command(
        &stack,
        &verifying,
        &["status", "--replication-url", &stack.relay_url],
        &[("PGSSLMODE", "disable")],
    )
    .await?;
    assert!(
        from_env.code() == Some(2)
            && from_env.text().contains("--replication-url")
            && from_env.text().contains("PGSSLMODE=disable"),
        "{}",
        from_env.text()
    );

    // A --standby-url's client certificate and key are loaded at startup,
    // as the other URLs' are: a mismatched pair is exit 2 naming the flag
    // (was: accepted, and the standby's copy never read).
    let (one, other) = (
        ca.issue(&Request {
            name: "standby-one",
            sans: &[],
            client: true,
            expired: false,
        })?,
        ca.issue(&Request {
            name: "standby-other",
            sans: &[],
            client: true,
            expired: false,
        })?,
    );
    let standby = t.url(
        "127.0.0.1",
        &format!(
            "sslmode=require&sslcert={}&sslkey={}",
            path_str(&one.cert)?,
            path_str(&other.key)?
        ),
    );
    let mismatched = app::relay_command(
        &stack,
        &stack.relay_url,
        &["status", "--standby-url", &standby],
        &[],
    )
    .await?;
    assert!(
        mismatched.code() == Some(2) && mismatched.text().contains("--standby-url"),
        "{}",
        mismatched.text()
    );
    Ok(())
}
