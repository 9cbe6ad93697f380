//! Issue 30, item 1: TLS to PostgreSQL means what libpq says, on both of
//! the relay's connections. A server with `ssl = on` and a private CA
//! (made here with `openssl`) presents in turn a certificate with the
//! right DNS and IP names, one for another name, an expired one and one
//! from an unknown CA; for each, every `sslmode` the case needs is tried
//! by `psql` (the oracle of what libpq accepts) and by the relay, which
//! accepts only if its side connection and its replication session both
//! come up (it logs `streaming`). They must agree, and agree with what the
//! case expects. Client certificates are tried against `pg_hba.conf`'s
//! `cert` method, and what the relay cannot do on both connections is
//! refused at startup with exit 2 naming the parameter.
//!
//! A client certificate the server refuses (from a CA its `ssl_ca_file`
//! lacks, or expired) is refused at startup, naming `sslcert` (the relay
//! reconnected without end on `c4a434c`, and blamed the server's
//! certificate for an expired one).
//!
//! A server certificate for client authentication only (extendedKeyUsage
//! clientAuth) is refused naming `serverAuth` (was: "check sslrootcert
//! and sslmode"); `sslmode=disable` to `::1`, which no `pg_hba.conf` line
//! names, says to add a line for it (was: "set sslmode=require", which
//! fails again).
//!
//! Certificates without a subjectAltName of the host's type are matched
//! by their common name, as libpq does (refused on `1532615`: the
//! replication transport checked names only in the subjectAltName).
//!
//! Failed on `cb3ea2e`: verify-full to `127.0.0.1` exited 1 (the
//! replication transport refused an IP host although the certificate has
//! it in its SAN); verify-ca refused a certificate for another name;
//! `sslcert`, `sslkey` were unknown options; `channel_binding=require`
//! was dropped and the relay streamed.

use std::time::Duration;

use harness::app;
use harness::pki::{self, Ca, Request, path_str};

mod edges;
mod refused;
mod tries;

use tries::{Case, Outcome, Tries, ssl_cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sslmode_behaves_as_libpq_on_both_connections() -> anyhow::Result<()> {
    let dir = pki::dir()?;
    let ca = Ca::new(dir.path(), "ca")?;
    let unknown = Ca::new(dir.path(), "unknown-ca")?;
    let right_names = ["DNS:localhost", "IP:127.0.0.1"];
    let server = |ca: &Ca, name: &'static str, sans: &[&str], expired: bool| {
        ca.issue(&Request {
            name,
            sans,
            client: false,
            expired,
        })
    };
    let good = server(&ca, "good", &right_names, false)?;
    let wrong = server(&ca, "wrong", &["DNS:db.invalid", "IP:10.255.0.1"], false)?;
    let expired = server(&ca, "expired", &right_names, true)?;
    let stranger = server(&unknown, "stranger", &right_names, false)?;
    let client_cert = |ca: &Ca, expired: bool| {
        ca.issue(&Request {
            name: "cdc_relay",
            sans: &[],
            client: true,
            expired,
        })
    };
    let client = client_cert(&ca, false)?;
    let expired_client = client_cert(&ca, true)?;
    let stranger_client = client_cert(&unknown, false)?;
    // A client certificate served as the server's: extendedKeyUsage
    // clientAuth only.
    let client_usage = ca.issue(&Request {
        name: "client-usage",
        sans: &right_names,
        client: true,
        expired: false,
    })?;

    let cluster = ssl_cluster(&ca, &good)?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let home = tempfile::tempdir()?;
    let t = Tries {
        cluster: &cluster,
        stack: &stack,
        home: home.path().to_owned(),
        cert_file: None,
    };
    let ca_pem = path_str(&ca.cert)?;
    let unknown_pem = path_str(&unknown.cert)?;
    let case = |what, host, params: String, accept, names| Case {
        what,
        host,
        params,
        accept,
        names,
    };

    // The right certificate.
    t.run(&[
        case(
            "verify-full by IP (IP SAN)",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "verify-full by name",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "verify-ca",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "require, no root",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
        case(
            "require with another CA's root is verify-ca",
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={unknown_pem}"),
            false,
            "sslrootcert",
        ),
        case("prefer", "127.0.0.1", "sslmode=prefer".into(), true, ""),
        case(
            "channel_binding=prefer (SCRAM over TLS)",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}&channel_binding=prefer"),
            true,
            "",
        ),
        case(
            "channel_binding=disable",
            "127.0.0.1",
            "sslmode=require&channel_binding=disable".into(),
            true,
            "",
        ),
        case(
            "allow (plain first)",
            "127.0.0.1",
            "sslmode=allow".into(),
            true,
            "",
        ),
        case("disable", "127.0.0.1", "sslmode=disable".into(), true, ""),
        case(
            "verify-full, another CA",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={unknown_pem}"),
            false,
            "sslrootcert",
        ),
    ])
    .await?;
    // An address no pg_hba.conf line names (as `localhost` resolving to
    // ::1 while the lines name 127.0.0.1): the hint said "set
    // sslmode=require", which fails again (`… SSL encryption`).
    t.run(&[case(
        "disable to ::1, which no pg_hba.conf line names",
        "[::1]",
        "sslmode=disable".into(),
        false,
        "add one for it to pg_hba.conf",
    )])
    .await?;
    // libpq's default root, ~/.postgresql/root.crt.
    let dot = home.path().join(".postgresql");
    std::fs::create_dir_all(&dot)?;
    std::fs::copy(&ca.cert, dot.join("root.crt"))?;
    t.run(&[case(
        "verify-full with ~/.postgresql/root.crt",
        "127.0.0.1",
        "sslmode=verify-full".into(),
        true,
        "",
    )])
    .await?;
    std::fs::remove_file(dot.join("root.crt"))?;

    t.serve(&wrong)?;
    t.run(&[
        case(
            "verify-full, certificate for another name",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "verify-ca",
        ),
        case(
            "verify-full by name, certificate for another name",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "verify-ca",
        ),
        case(
            "verify-ca checks only the chain",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "require, certificate for another name",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
    ])
    .await?;

    // Certificates without a subjectAltName of the host's type: libpq
    // falls back to the common name (psql agrees or the test fails).
    let cn_only = server(&ca, "localhost", &[], false)?;
    let cn_ip_dns_san = server(&ca, "127.0.0.1", &["DNS:db.invalid"], false)?;
    t.serve(&cn_only)?;
    t.run(&[
        case(
            "verify-full by name, no SAN, the name is the CN",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "verify-full by IP, no SAN, the CN is another name",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "by its common name",
        ),
        case(
            "verify-ca, no SAN",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "require with the root, no SAN",
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={ca_pem}"),
            true,
            "",
        ),
    ])
    .await?;
    t.serve(&cn_ip_dns_san)?;
    t.run(&[
        case(
            "verify-full by IP, only a DNS SAN, the IP is the CN",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            true,
            "",
        ),
        case(
            "verify-full by name, a DNS SAN for another name: the CN is not looked at",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "verify-ca",
        ),
    ])
    .await?;

    t.serve(&expired)?;
    t.run(&[
        case(
            "verify-ca, expired",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            false,
            "expired",
        ),
        case(
            "verify-full, expired",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "expired",
        ),
        case(
            "require, no root, expired",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
    ])
    .await?;

    t.serve(&stranger)?;
    t.run(&[
        case(
            "verify-ca, unknown CA",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            false,
            "sslrootcert",
        ),
        case(
            "verify-full, unknown CA",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "sslrootcert",
        ),
        case(
            "require, no root, unknown CA",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
        case(
            "require with the root, unknown CA",
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={ca_pem}"),
            false,
            "sslrootcert",
        ),
    ])
    .await?;

    t.serve(&client_usage)?;
    t.run(&[
        case(
            "verify-ca, a certificate for client authentication only",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={ca_pem}"),
            false,
            "extendedKeyUsage = serverAuth",
        ),
        case(
            "require, no root, a certificate for client authentication only",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
    ])
    .await?;

    t.serve(&good)?;
    // sslrootcert=system: the system's trusted roots, which libpq (through
    // OpenSSL) and the relay both take from SSL_CERT_FILE when it is set.
    // libpq has the value from 16 on (15's psql reads a file named
    // "system"): there the relay alone is tried.
    for (bundle, accept, what) in [
        (
            &ca.cert,
            true,
            "sslrootcert=system, the system roots hold the CA",
        ),
        (
            &unknown.cert,
            false,
            "sslrootcert=system, the system roots lack the CA",
        ),
    ] {
        let system = Tries {
            cert_file: Some(bundle.clone()),
            ..t.clone()
        };
        let c = case(
            what,
            "localhost",
            "sslrootcert=system".into(),
            accept,
            "sslrootcert",
        );
        if cluster.major_version() >= 16 {
            system.run(&[c]).await?;
        } else {
            let relay = system.relay(c.host, &c.params).await?;
            let named = match &relay {
                Outcome::Refused { output, .. } => output.contains(c.names),
                Outcome::Accepted { ssl } => *ssl == Some(true),
            };
            anyhow::ensure!(
                relay.accepted() == accept && named,
                "{what}: relay {relay:?}"
            );
        }
    }

    // Client certificates: the relay's role only over TLS, with a
    // certificate whose CN is the role.
    let hba = cluster.data_dir().join("pg_hba.conf");
    let before = std::fs::read_to_string(&hba)?;
    std::fs::write(
        &hba,
        format!(
            "hostssl all cdc_relay 127.0.0.1/32 cert\nhost all cdc_relay 127.0.0.1/32 reject\n{before}"
        ),
    )?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let certs_of = |c: &pki::Issued| -> anyhow::Result<String> {
        Ok(format!(
            "sslcert={}&sslkey={}",
            path_str(&c.cert)?,
            path_str(&c.key)?
        ))
    };
    let certs = certs_of(&client)?;
    t.run(&[
        case(
            "client certificate, verify-full",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}&{certs}"),
            true,
            "",
        ),
        case(
            "no client certificate",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca_pem}"),
            false,
            "sslcert",
        ),
        case(
            "client certificate, allow (plain refused, then TLS)",
            "127.0.0.1",
            format!("sslmode=allow&{certs}"),
            true,
            "",
        ),
        case(
            "client certificate, disable",
            "127.0.0.1",
            format!("sslmode=disable&{certs}"),
            false,
            "sslmode=require",
        ),
        // The server's alert: the relay retried forever on c4a434c (and
        // blamed the server's certificate for the expired one).
        case(
            "client certificate from a CA the server does not trust",
            "127.0.0.1",
            format!(
                "sslmode=verify-full&sslrootcert={ca_pem}&{}",
                certs_of(&stranger_client)?
            ),
            false,
            "the server's ssl_ca_file",
        ),
        case(
            "expired client certificate",
            "127.0.0.1",
            format!(
                "sslmode=verify-full&sslrootcert={ca_pem}&{}",
                certs_of(&expired_client)?
            ),
            false,
            "client certificate (sslcert) as expired",
        ),
    ])
    .await?;
    // libpq's default client certificate, ~/.postgresql/postgresql.crt.
    std::fs::copy(&client.cert, dot.join("postgresql.crt"))?;
    std::fs::copy(&client.key, dot.join("postgresql.key"))?;
    t.run(&[case(
        "client certificate from ~/.postgresql",
        "127.0.0.1",
        "sslmode=require".into(),
        true,
        "",
    )])
    .await?;
    std::fs::write(&hba, before)?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;
    Ok(())
}
