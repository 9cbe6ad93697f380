//! The classifier's cases.

use super::*;

fn server(msg: &str) -> SourceError {
    SourceError::transport(&PgWireError::Server(msg.into()), "s")
}

#[test]
fn a_pooler_refusing_the_login_is_definite_and_says_what_to_check() {
    // PgBouncer's words for a wrong password (md5/plain) and a failed
    // SCRAM exchange, with its SQLSTATE.
    for refusal in [
        "password authentication failed (SQLSTATE 08P01)",
        "SASL authentication failed (SQLSTATE 08P01)",
    ] {
        let e = server(refusal);
        assert!(
            e.is_definite() && e.to_string().contains("auth_file"),
            "{e}"
        );
        let e = classify(Some("08P01"), refusal.into(), None);
        assert!(e.is_definite() && e.to_string().contains("password"), "{e}");
    }
    // Any other protocol violation stays transient.
    let e = classify(Some("08P01"), "server conn crashed?".into(), None);
    assert!(!e.is_definite(), "{e}");
}

#[test]
fn privilege_errors_say_what_to_grant() {
    for refusal in [
        "must be superuser or replication role to start walsender (SQLSTATE 42501)",
        "permission denied to start WAL sender (SQLSTATE 42501)",
    ] {
        let e = server(refusal);
        assert!(e.is_definite(), "{e}");
        // The role is the connection's, not always cdc_relay.
        let named = e.naming_role("orders_reader").to_string();
        assert!(
            named.contains("ALTER ROLE orders_reader REPLICATION"),
            "{named}"
        );
        let quoted = server(refusal).naming_role("Relay \"2\"").to_string();
        assert!(
            quoted.contains(r#"ALTER ROLE "Relay ""2""" REPLICATION"#),
            "{quoted}"
        );
    }
    let e = classify(
        Some("42501"),
        "permission denied for table outbox".into(),
        None,
    );
    assert!(e.to_string().contains("sql/roles.sql"), "{e}");
    let e = classify(
        Some("42501"),
        "creating the publication: must be owner of table Outbox (SQLSTATE 42501)".into(),
        None,
    );
    let named = e.naming_role("dba").to_string();
    assert!(
        named.contains("(dba) does not own table Outbox")
            && named.contains(r#"ALTER TABLE "Outbox" OWNER TO dba"#),
        "{named}"
    );
    let e = classify(
        Some("42501"),
        "must be owner of publication p (SQLSTATE 42501)".into(),
        None,
    );
    assert!(
        e.to_string()
            .contains("ALTER PUBLICATION p OWNER TO <the URL's role>"),
        "{e}"
    );
}

#[test]
fn sqlstates_are_classified() {
    assert_eq!(
        sqlstate("terminating connection (SQLSTATE 57P01)"),
        Some("57P01")
    );
    assert_eq!(sqlstate("no code"), None);
    for c in [
        "57P01", "57P02", "57P03", "55006", "08006", "53300", "40001",
    ] {
        assert!(sqlstate_is_transient(c), "{c}");
        assert!(!classify(Some(c), "x".into(), None).is_definite(), "{c}");
    }
    for c in ["28P01", "42704", "3D000", "42501", "55000"] {
        assert!(!sqlstate_is_transient(c), "{c}");
        assert!(classify(Some(c), "x".into(), None).is_definite(), "{c}");
    }
    assert!(!classify(None, "connection reset".into(), None).is_definite());
}

#[test]
fn a_lock_wait_is_transient_and_names_its_holders_once_read() {
    let unnamed = SourceError::LockWait {
        context: "reading the publications".into(),
        holders: String::new(),
    };
    assert!(!unnamed.is_definite());
    assert_eq!(unnamed.cause(), "lock_wait");
    assert_eq!(
        unnamed.to_string(),
        "reading the publications: the server ended a wait for a lock another session holds (lock_timeout)"
    );
    let named = SourceError::LockWait {
        context: "reading the publications".into(),
        holders: "pid 7 (psql, …) holds AccessExclusiveLock on pg_class".into(),
    };
    assert!(
        named
            .to_string()
            .ends_with("(lock_timeout): pid 7 (psql, …) holds AccessExclusiveLock on pg_class"),
        "{named}"
    );
}

#[test]
fn connect_errors_that_retrying_cannot_fix_say_what_to_change() {
    for (code, msg, names) in [
        (
            None,
            "c: invalid configuration: password missing",
            "CDC_RELAY_DATABASE_PASSWORD_FILE",
        ),
        (
            None,
            "c: error performing TLS handshake: server does not support TLS",
            "sslmode=disable",
        ),
        (
            None,
            "c: error performing TLS handshake: invalid peer certificate: UnknownIssuer",
            "sslrootcert",
        ),
        (
            None,
            "c: error performing TLS handshake: invalid peer certificate: CaUsedAsEndEntity",
            "leaf certificate",
        ),
        (
            Some("28P01"),
            "c: password authentication failed for user \"x\" (SQLSTATE 28P01)",
            "pg_hba.conf",
        ),
        (
            Some("28000"),
            "c: no pg_hba.conf entry (SQLSTATE 28000)",
            "pg_hba.conf",
        ),
    ] {
        let hint = connect_hint(code, msg).unwrap_or_else(|| panic!("a hint for {msg}"));
        assert!(hint.contains(names), "{msg}: {hint}");
    }
    for (code, msg) in [
        (
            None,
            "c: error connecting to server: Connection refused (os error 111)",
        ),
        (
            None,
            "c: error performing TLS handshake: connection reset by peer",
        ),
        (
            Some("57P03"),
            "c: the database system is starting up (SQLSTATE 57P03)",
        ),
    ] {
        assert_eq!(connect_hint(code, msg), None, "{msg}");
    }
}

#[test]
fn server_errors_map_to_slot_states() {
    let e = server(r#"replication slot "s" does not exist (SQLSTATE 42704)"#);
    assert!(matches!(e, SourceError::SlotMissing { .. }));
    assert!(e.to_string().contains("cdc-relay setup"));
    let e = server(r#"replication slot "s" is active for PID 4242 (SQLSTATE 55006)"#);
    assert!(
        matches!(
            e,
            SourceError::SlotActive {
                pid: Some(4242),
                ..
            }
        ),
        "{e:?}"
    );
    let e = server(r#"can no longer get changes from replication slot "s" (SQLSTATE 55000)"#);
    assert!(matches!(e, SourceError::SlotInvalidated { .. }));
    // PostgreSQL 18's wording.
    let e = server(r#"can no longer access replication slot "s" (SQLSTATE 55000)"#);
    assert!(matches!(e, SourceError::SlotInvalidated { .. }), "{e:?}");
    let idle = SourceError::SlotInvalidated {
        slot: "s".into(),
        reason: Some("idle_timeout".into()),
        since: None,
    };
    assert!(idle.to_string().contains("idle_replication_slot_timeout"));
    assert!(
        idle.to_string()
            .contains("<time of the last delivered event>")
    );
    let known = SourceError::SlotInvalidated {
        slot: "s".into(),
        reason: None,
        since: Some("2026-12-01 02:22:57.905884+00".into()),
    };
    assert!(
        known
            .to_string()
            .contains("cdc-relay backfill --since '2026-12-01 02:22:57.905884+00'"),
        "{known}"
    );
    assert!(!idle.to_string().contains("max_slot_wal_keep_size"));
    let e = server("publication \"p\" does not exist (SQLSTATE 42704)");
    assert!(
        matches!(&e, SourceError::SlotPredatesPublication { publication, .. } if publication == "p"),
        "{e:?}"
    );
    assert!(e.to_string().contains("--recreate-slot") && e.to_string().contains("backfill"));
    assert!(!server("the database system is starting up (SQLSTATE 57P03)").is_definite());
    // A pooler in between: PgBouncer's refusal (08P01, a connection
    // class), or a replication command run as SQL by a server that got
    // a normal session. Named for what it is, and definite.
    for msg in [
        "unsupported startup parameter: replication (SQLSTATE 08P01)",
        "unsupported startup parameter: options (SQLSTATE 08P01)",
        "syntax error at or near \"IDENTIFY_SYSTEM\" (SQLSTATE 42601)",
        "syntax error at or near \"START_REPLICATION\" (SQLSTATE 42601)",
    ] {
        let e = server(msg);
        assert!(
            matches!(e, SourceError::ThroughPooler { .. }),
            "{msg}: {e:?}"
        );
        assert!(e.is_definite() && e.to_string().contains("pooler"), "{e}");
    }
    // A protocol violation that names no replication parameter stays transient.
    assert!(!server("protocol violation (SQLSTATE 08P01)").is_definite());
    // Outside the replication path, 42704 is an ordinary definite error.
    let e = classify(
        Some("42704"),
        "replication slot \"s\" does not exist".into(),
        None,
    );
    assert!(matches!(e, SourceError::Definite(_)), "{e:?}");
}

#[test]
fn a_table_without_a_replica_identity_is_named_with_both_fixes() {
    // The server's bare 55000 was all an operator got from `prune`.
    let e = classify(
        Some("55000"),
        "deleting a batch of outbox rows: cannot delete from table \"outbox\" because it does \
         not have a replica identity and publishes deletes (SQLSTATE 55000)"
            .into(),
        None,
    );
    assert!(e.is_definite(), "{e:?}");
    let e = e.to_string();
    for fix in [
        "has no replica identity",
        "ALTER TABLE outbox REPLICA IDENTITY DEFAULT",
        "SET (publish = 'insert')",
        "WHERE tablename = 'outbox' AND pubdelete",
    ] {
        assert!(e.contains(fix), "{fix}: {e}");
    }
    let e = classify(
        Some("55000"),
        "cannot update table \"it's\" because it does not have a replica identity and \
         publishes updates (SQLSTATE 55000)"
            .into(),
        None,
    )
    .to_string();
    assert!(
        e.contains(r#"ALTER TABLE "it's" REPLICA IDENTITY"#)
            && e.contains("refuses every UPDATE")
            && e.contains("tablename = 'it''s' AND pubupdate"),
        "{e}"
    );
    // Another 55000 keeps the server's words alone.
    let e = classify(Some("55000"), "x (SQLSTATE 55000)".into(), None);
    assert_eq!(e.to_string(), "x (SQLSTATE 55000)");
}

#[test]
fn the_server_refusing_the_client_certificate_is_definite_and_names_sslcert() {
    // Retried forever before (the alert read as a lost connection), and
    // an expired client certificate got the server certificate's hint.
    for (alert, names) in [
        ("UnknownCA", "ssl_ca_file"),
        ("CertificateExpired", "renew"),
        ("CertificateRevoked", "ssl_crl_file"),
        ("UnsupportedCertificate", "clientAuth"),
        ("DecryptError", "sslkey"),
        ("BadCertificate", "ssl_ca_file"),
        ("CertificateUnknown", "ssl_ca_file"),
    ] {
        let words = format!("received fatal alert: {alert}");
        // The side connection (tokio-postgres), and the replication
        // transport: in the handshake (TLS 1.2) or on the first read
        // after it (TLS 1.3).
        let side = format!("connecting to h (--database-url): error communicating: {words}");
        let hint = connect_hint(None, &side).unwrap_or_else(|| panic!("a hint for {side}"));
        let io = PgWireError::Io(std::sync::Arc::new(std::io::Error::other(words.clone())));
        let tls = PgWireError::Tls(format!("TLS handshake failed: {words}"));
        for e in [
            SourceError::transport(&io, "s"),
            SourceError::transport(&tls, "s"),
        ] {
            assert!(e.is_definite(), "{e}");
            assert!(e.to_string().ends_with(hint), "{e}");
        }
        assert!(
            hint.contains("relay's client certificate (sslcert)") && hint.contains(names),
            "{alert}: {hint}"
        );
        assert!(!hint.contains("server's certificate"), "{alert}: {hint}");
    }
    // rustls's verdict on the server's certificate keeps the server's hint.
    let hint = tls_hint(
        "invalid peer certificate: certificate expired: verification time 1 (UNIX), but \
         certificate is not valid after 0 (1 seconds ago)",
    )
    .unwrap_or_default();
    assert!(
        hint.contains("renew it on the server (ssl_cert_file)") && !hint.contains("sslcert"),
        "{hint}"
    );
    // Other alerts, and other I/O errors, say nothing of a certificate.
    for words in [
        "received fatal alert: HandshakeFailure",
        "received fatal alert: InternalError",
        "connection reset by peer",
    ] {
        let io = PgWireError::Io(std::sync::Arc::new(std::io::Error::other(words)));
        assert!(!SourceError::transport(&io, "s").is_definite(), "{words}");
    }
}

#[test]
fn tls_hints_name_the_fix_of_the_case_at_hand() {
    for (msg, names, not) in [
        // Was "check sslrootcert and sslmode in the URL".
        (
            "invalid peer certificate: certificate does not allow extended key usage for \
             server authentication, allows client authentication",
            "extendedKeyUsage = serverAuth",
            "sslrootcert",
        ),
        // Named only the subjectAltName.
        (
            "invalid peer certificate: certificate not valid for name \"127.0.0.1\"; \
             certificate is not valid for any names (according to its subjectAltName \
             extension)",
            "by its common name",
            "sslcert",
        ),
        // Said nothing of a missing intermediate.
        (
            "invalid peer certificate: UnknownIssuer",
            "ssl_cert_file may lack the intermediate CA certificates",
            "sslcert",
        ),
        // An expired root got the missing-intermediates hint.
        (
            "invalid peer certificate: UnknownIssuer (sslrootcert has no usable root: its \
             self-signed certificates cannot be roots: CN=root: expired on 2026-12-01)",
            "put a valid root CA certificate in the file",
            "intermediate",
        ),
        // Was a kilobyte of algorithm identifiers and "check sslrootcert".
        (
            "invalid peer certificate: UnsupportedSignatureAlgorithm (a certificate of the \
             chain is signed with an algorithm, or by a key, the relay's TLS library does not \
             accept: SHA-1, RSA below 2048 bits, P-521 or Ed448)",
            "SHA-256 (or stronger) signature",
            "check sslrootcert",
        ),
        (
            "invalid peer certificate: BadSignature",
            "RSA below 2048 bits",
            "check sslrootcert",
        ),
        // Usable roots beside unusable ones (a system bundle with expired
        // roots): the issuer is missing, not every root.
        (
            "invalid peer certificate: UnknownIssuer (none of sslrootcert's 140 usable roots \
             issued the server's chain; its self-signed certificates that cannot be roots: \
             CN=old: expired on 2020-01-01)",
            "not signed by a CA in sslrootcert",
            "put a valid root CA",
        ),
        (
            "invalid peer certificate: PathLenConstraintViolated (sslrootcert's root allows 0 \
             CA certificate(s) below it, pathlen:0; the server's chain has 1)",
            "pathLenConstraint allows",
            "sslcert",
        ),
        // Said only "set sslmode=require", wrong when no line names ::1.
        (
            "no pg_hba.conf entry for host \"::1\", user \"cdc_relay\", database \"orders\", \
             no encryption (SQLSTATE 28000)",
            "add one for it to pg_hba.conf",
            "sslcert",
        ),
        (
            "no pg_hba.conf entry for host \"127.0.0.1\", user \"cdc_relay\", database \
             \"orders\", no encryption (SQLSTATE 28000)",
            "sslmode=require",
            "sslcert",
        ),
    ] {
        let hint = tls_hint(msg).unwrap_or_else(|| panic!("a hint for {msg}"));
        assert!(hint.contains(names) && !hint.contains(not), "{msg}: {hint}");
    }
}

#[test]
fn a_tls_parameter_from_the_environment_is_noted_where_the_message_names_it() {
    let env = [("sslrootcert", "PGSSLROOTCERT"), ("sslcert", "PGSSLCERT")];
    let e = SourceError::Definite(
        "invalid peer certificate: UnknownIssuer. set sslrootcert in the URL".into(),
    )
    .noting_env(&env);
    assert_eq!(
        e.to_string(),
        "invalid peer certificate: UnknownIssuer. set sslrootcert in the URL (sslrootcert came \
         from PGSSLROOTCERT in the environment)"
    );
    let plain = SourceError::Transient("connection refused".into()).noting_env(&env);
    assert_eq!(plain.to_string(), "connection refused");
}
