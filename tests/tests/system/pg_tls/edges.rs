//! Where libpq's TLS differs from a web browser's, tried by a newcomer
//! against the relay after the common-name fallback landed (`c4a434c`),
//! with psql as the oracle. Each case failed there:
//!
//! - PostgreSQL's documented self-signed server certificate (`openssl req
//!   -x509`, a CA, no subjectAltName) trusted by putting it in
//!   `sslrootcert`: psql accepts it in require, verify-ca and verify-full;
//!   the relay refused it (`CaUsedAsEndEntity`);
//! - an intermediate CA alone in `sslrootcert`: libpq (OpenSSL) trusts a
//!   chain only up to a self-signed root and refuses; the relay accepted;
//! - a DNS name in the subjectAltName that is the IP address the URL
//!   names: libpq compares every DNS name with the host's text and
//!   accepts; the relay refused;
//! - `prefer` with a root that does not sign the server's certificate:
//!   libpq checks the chain whenever a root is known, and on failure goes
//!   on in plain text; the relay streamed over unverified TLS;
//! - two hosts, the first presenting a certificate for another name:
//!   libpq stops there; the relay went on to the second and streamed;
//! - the root CA itself (key usage: certificate signing) served as the
//!   server's certificate: psql refuses its purpose; accepted by the first
//!   version of the self-signed exception (a later newcomer's finding);
//! - roots OpenSSL does not end a chain at (expired, not a CA) and a
//!   subjectAltName that does not read, beside a common name that matches
//!   (a third newcomer's findings on `a67f052`: all accepted);
//! - `prefer` whose TLS attempt fails and whose plain attempt is refused
//!   by `pg_hba.conf`: the message said only "no encryption" (libpq
//!   reports both attempts).

use harness::app;
use harness::pki::{self, Ca, Request, path_str};

use super::tries::{Case, Tries, ssl_cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpqs_own_rules_for_roots_names_and_fallbacks_hold_on_both_connections()
-> anyhow::Result<()> {
    let dir = pki::dir()?;
    let root = Ca::new(dir.path(), "root")?;
    let int = root.intermediate("int")?;
    let other = Ca::new(dir.path(), "other")?;
    let leaf = |ca: &Ca, name: &'static str, sans: &[&str]| {
        ca.issue(&Request {
            name,
            sans,
            client: false,
            expired: false,
        })
    };
    let by_int = leaf(&int, "by-int", &["DNS:localhost", "IP:127.0.0.1"])?;
    let by_int_chain = by_int.with_chain(&int)?;
    let self_signed = pki::self_signed_server(dir.path(), "localhost")?;
    let ip_as_dns = leaf(&root, "ip-as-dns", &["DNS:127.0.0.1"])?;

    let cluster = ssl_cluster(&root, &by_int_chain)?;
    let stack = cluster.create_stack().await?;
    app::relay_setup(&stack).await?;
    let home = tempfile::tempdir()?;
    let t = Tries {
        cluster: &cluster,
        stack: &stack,
        home: home.path().to_owned(),
        cert_file: None,
    };
    let case = |what, host, params: String, accept, names| Case {
        what,
        host,
        params,
        accept,
        names,
    };
    let root_pem = path_str(&root.cert)?;
    let int_pem = path_str(&int.cert)?;
    let other_pem = path_str(&other.cert)?;
    let both = dir.path().join("root-and-int.pem");
    std::fs::write(
        &both,
        [std::fs::read(&root.cert)?, std::fs::read(&int.cert)?].concat(),
    )?;
    let both_pem = path_str(&both)?;

    // The server presents its certificate and the intermediate.
    t.run(&[
        case(
            "verify-full, the root in sslrootcert, the intermediate from the server",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={root_pem}"),
            true,
            "",
        ),
        case(
            "verify-ca, only the intermediate in sslrootcert",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={int_pem}"),
            false,
            "sslrootcert",
        ),
        case(
            "prefer, a root that did not sign it: verification fails, then plain text",
            "127.0.0.1",
            format!("sslmode=prefer&sslrootcert={other_pem}"),
            true,
            "",
        ),
        case(
            "require, a root that did not sign it",
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={other_pem}"),
            false,
            "sslrootcert",
        ),
    ])
    .await?;

    // The server presents its certificate alone.
    t.serve(&by_int)?;
    t.run(&[
        case(
            "verify-full, the intermediate missing from the server, root and intermediate in sslrootcert",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={both_pem}"),
            true,
            "",
        ),
        case(
            "verify-full, the intermediate missing everywhere",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={root_pem}"),
            false,
            "sslrootcert",
        ),
    ])
    .await?;

    // PostgreSQL's documented self-signed certificate, trusted as itself.
    t.serve(&self_signed)?;
    let self_pem = path_str(&self_signed.cert)?;
    t.run(&[
        case(
            "self-signed, verify-full by its common name",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={self_pem}"),
            true,
            "",
        ),
        case(
            "self-signed, verify-ca",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={self_pem}"),
            true,
            "",
        ),
        case(
            "self-signed, require with it as the root",
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={self_pem}"),
            true,
            "",
        ),
        case(
            "self-signed, verify-full by another name",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={self_pem}"),
            false,
            "verify-ca",
        ),
        case(
            "self-signed, verify-ca against another root",
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={root_pem}"),
            false,
            "sslrootcert",
        ),
    ])
    .await?;
    // A CA certificate whose key usage is certificate signing only, served
    // as the server's own: OpenSSL refuses its purpose, although the root
    // file holds it.
    t.serve(&root.as_served())?;
    t.run(&[case(
        "the root CA itself (keyCertSign only) as the server's certificate",
        "127.0.0.1",
        format!("sslmode=verify-ca&sslrootcert={root_pem}"),
        false,
        "keyUsage",
    )])
    .await?;

    // Roots OpenSSL will not end a chain at: expired, not a CA. A
    // subjectAltName that does not read (raw UTF-8 where IA5 belongs):
    // libpq stops there and never looks at the common name.
    let expired_root = Ca::self_signed(
        dir.path(),
        "expired-root",
        &[
            "basicConstraints=critical,CA:TRUE",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        Some("-10d"),
    )?;
    let not_a_ca = Ca::self_signed(
        dir.path(),
        "not-a-ca-root",
        &["basicConstraints=critical,CA:FALSE"],
        None,
    )?;
    for (bad, what) in [
        (
            &expired_root,
            "verify-full, the root in sslrootcert expired",
        ),
        (&not_a_ca, "verify-full, the root in sslrootcert not a CA"),
    ] {
        t.serve(&leaf(bad, "by-bad-root", &["DNS:localhost"])?)?;
        t.run(&[case(
            what,
            "localhost",
            format!("sslmode=verify-full&sslrootcert={}", path_str(&bad.cert)?),
            false,
            "sslrootcert",
        )])
        .await?;
    }
    // A root whose pathLenConstraint allows no CA below it, above an
    // intermediate: OpenSSL refuses the chain (webpki reads no limit from
    // a trust anchor, and the relay accepted it); one level more allowed
    // is accepted by both.
    for (pathlen, accepted, what) in [
        (
            0,
            false,
            "verify-full, a root with pathlen:0 above an intermediate",
        ),
        (
            1,
            true,
            "verify-full, a root with pathlen:1 above an intermediate",
        ),
    ] {
        let limited = Ca::self_signed(
            dir.path(),
            &format!("pathlen{pathlen}-root"),
            &[
                &format!("basicConstraints=critical,CA:TRUE,pathlen:{pathlen}"),
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
            None,
        )?;
        let below = limited.intermediate(&format!("under-pathlen{pathlen}"))?;
        t.serve(&leaf(&below, "by-limited", &["DNS:localhost"])?.with_chain(&below)?)?;
        t.run(&[case(
            what,
            "localhost",
            format!(
                "sslmode=verify-full&sslrootcert={}",
                path_str(&limited.cert)?
            ),
            accepted,
            if accepted { "" } else { "pathlen" },
        )])
        .await?;
    }
    // Where libpq checks nothing (require, prefer without a root), the
    // relay checked the handshake signature with the certificate's key and
    // parsed the certificate: one with an unknown critical extension
    // failed the handshake, and under prefer the relay went on in plain
    // text where psql encrypts.
    let critical = Ca::self_signed(
        dir.path(),
        "critical-ext",
        &[
            "basicConstraints=critical,CA:FALSE",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "1.3.6.1.4.1.55555.1=critical,ASN1:UTF8String:unknown",
        ],
        None,
    )?;
    t.serve(&critical.as_served())?;
    t.run(&[
        case(
            "require without a root, an unknown critical extension",
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "",
        ),
        case(
            "prefer without a root, an unknown critical extension",
            "127.0.0.1",
            "sslmode=prefer".into(),
            true,
            "",
        ),
    ])
    .await?;
    // A root file that starts with a UTF-8 byte order mark: OpenSSL reads
    // past it; the relay lost the certificate behind it.
    t.serve(&leaf(&root, "for-bom", &["DNS:localhost"])?)?;
    let bom = dir.path().join("root-bom.pem");
    std::fs::write(
        &bom,
        [&b"\xEF\xBB\xBF"[..], &std::fs::read(&root.cert)?].concat(),
    )?;
    t.run(&[case(
        "verify-full, a root file starting with a byte order mark",
        "localhost",
        format!("sslmode=verify-full&sslrootcert={}", path_str(&bom)?),
        true,
        "",
    )])
    .await?;
    t.serve(&leaf(&root, "unreadable-san", &["DNS:b\u{e9}.example"])?)?;
    t.run(&[case(
        "verify-full, an unreadable subjectAltName beside a matching common name",
        "localhost",
        format!("sslmode=verify-full&sslrootcert={root_pem}"),
        false,
        "verify-ca",
    )])
    .await?;

    // A DNS name that is the URL's IP address, as text.
    t.serve(&ip_as_dns)?;
    let port = cluster.port();
    let two_hosts: &'static str = Box::leak(format!("localhost:{port},127.0.0.1").into_boxed_str());
    t.run(&[
        case(
            "verify-full by IP, the IP written as a DNS name",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={root_pem}"),
            true,
            "",
        ),
        case(
            "two hosts, the first refused by name: libpq stops there",
            two_hosts,
            format!("sslmode=verify-full&sslrootcert={root_pem}"),
            false,
            "verify-ca",
        ),
    ])
    .await?;

    // prefer whose TLS attempt fails, and whose plain attempt pg_hba.conf
    // refuses: the refusal names the certificate, not only "no
    // encryption" (libpq reports both attempts).
    let hba = cluster.data_dir().join("pg_hba.conf");
    let before = std::fs::read_to_string(&hba)?;
    std::fs::write(
        &hba,
        format!("hostnossl all cdc_relay 127.0.0.1/32 reject\n{before}"),
    )?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    t.run(&[case(
        "prefer, a root that did not sign it, plain text refused",
        "127.0.0.1",
        format!("sslmode=prefer&sslrootcert={other_pem}"),
        false,
        "sslrootcert",
    )])
    .await?;
    std::fs::write(&hba, before)?;
    cluster.psql("postgres", "SELECT pg_reload_conf()")?;
    Ok(())
}

/// What libpq would read from its environment and the relay does not, and
/// hosts and ports libpq reads another way, are refused with exit 2 naming
/// them (a second newcomer's findings on `578c8e1`: `PGSERVICE` was
/// ignored and the relay streamed unverified where psql refused;
/// `PGPORT` was ignored and the relay retried port 5432 forever; `127.1`
/// looped on "invalid dns name", and under `prefer` went plain text where
/// psql used TLS; three hosts with two ports were cycled; a URL query's
/// `host=a,b` was read as one host named `a,b`; and, from a third, on
/// `a67f052`: `PGOPTIONS`, `PGSSLMINPROTOCOLVERSION`,
/// `PGTARGETSESSIONATTRS` and a URL's `options` were dropped silently).
/// What is tried, the URL, the environment, and what the refusal names.
type Try<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_libpq_reads_another_way_exits_2_naming_it() -> anyhow::Result<()> {
    let cluster = harness::PgCluster::shared();
    let stack = cluster.create_stack().await?;
    let port = cluster.port();
    let url = &stack.relay_url;
    let no_port = url.replacen(&format!(":{port}/"), "/", 1);
    let short_ip = url.replacen("@127.0.0.1:", "@127.1:", 1);
    let cycled = format!("host=127.0.0.1,localhost,localhost port={port},{port} user=cdc_relay");
    let with_options = format!("{url}?options=-cnosuch%3D1");
    let query_hosts =
        format!("{no_port}?host=127.0.0.1,localhost").replacen("@127.0.0.1/", "@/", 1);
    let tries: [Try<'_>; 11] = [
        (
            "PGSERVICE",
            url,
            &[("PGSERVICE", "relaysvc")],
            "PGSERVICE=relaysvc",
        ),
        ("PGPORT", &no_port, &[("PGPORT", "1")], "PGPORT=1"),
        (
            "a short IPv4 address under prefer",
            &short_ip,
            &[],
            "host 127.1",
        ),
        (
            "two ports for three hosts",
            &cycled,
            &[],
            "2 ports for 3 hosts",
        ),
        (
            "several hosts in a URL query's host",
            &query_hosts,
            &[],
            "names several hosts",
        ),
        (
            "PGHOSTADDR",
            url,
            &[("PGHOSTADDR", "127.0.0.1")],
            "PGHOSTADDR",
        ),
        (
            "PGOPTIONS",
            url,
            &[("PGOPTIONS", "-cnosuch=1")],
            "PGOPTIONS",
        ),
        (
            "PGSSLMINPROTOCOLVERSION",
            url,
            &[("PGSSLMINPROTOCOLVERSION", "TLSv1.3")],
            "PGSSLMINPROTOCOLVERSION",
        ),
        (
            "PGTARGETSESSIONATTRS=standby",
            url,
            &[("PGTARGETSESSIONATTRS", "standby")],
            "PGTARGETSESSIONATTRS=standby",
        ),
        (
            "options in the URL",
            &with_options,
            &[],
            "options is not supported",
        ),
        // A file named by libpq's environment is named by its variable
        // (was: as the URL parameter sslrootcert, which the URL lacks).
        (
            "PGSSLROOTCERT naming a missing file",
            url,
            &[("PGSSLROOTCERT", "/nonexistent/root.crt")],
            "PGSSLROOTCERT=/nonexistent/root.crt",
        ),
    ];
    for (what, url, env, names) in tries {
        let out = app::relay_command(&stack, url, &["status"], env).await?;
        anyhow::ensure!(
            out.code() == Some(2) && out.text().contains(names),
            "{what}: expected exit 2 naming {names}, got {:?}: {}",
            out.code(),
            out.text()
        );
    }
    Ok(())
}
