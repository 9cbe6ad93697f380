//! What to change, for errors whose fix is a setting, a grant or a
//! table's state: TLS failures and refusals that depend on TLS, privilege
//! errors (42501), and a table a statement needs otherwise (55000).

/// What to change in the database URL for a TLS failure or a refusal
/// that depends on TLS, by the words of the error (an alert the server
/// sent about the relay's client certificate, rustls's verdicts on the
/// server's certificate, PostgreSQL's `pg_hba.conf` refusals); `None` for
/// any other.
pub(crate) fn tls_hint(msg: &str) -> Option<&'static str> {
    // Before the words below: "received fatal alert: CertificateExpired"
    // is about the relay's certificate, not the server's.
    if let Some(hint) = client_cert_hint(msg) {
        return Some(hint);
    }
    let lower = msg.to_ascii_lowercase();
    let has = |s: &str| lower.contains(s);
    // The root file's own self-signed certificates could not be roots
    // (expired, not a CA, …; the message says which and why): the file is
    // what to fix, not the server's chain.
    let roots_unusable = has("has no usable root");
    Some(if roots_unusable {
        "No certificate in sslrootcert can be a root (the message says why for each: expired, \
         not yet valid, not a CA, a keyUsage without keyCertSign or an extendedKeyUsage \
         without serverAuth): put a valid root CA certificate in the file sslrootcert names"
    } else if has("unknownissuer") || has("unknown issuer") {
        "The server's certificate is not signed by a CA in sslrootcert: set sslrootcert in \
         the URL to the CA certificate that issued it. If sslrootcert holds the root CA already, \
         the server's ssl_cert_file may lack the intermediate CA certificates between them: \
         put the chain in it (the server's certificate, then each intermediate)"
    } else if has("not valid for name") || has("notvalidforname") {
        "The server's certificate does not carry the URL's host name: connect by a name in \
         its subjectAltName (or, when it has no subjectAltName entry of the host's type, DNS \
         for a name and IP for an address, by its common name), reissue it for this host, or \
         use sslmode=verify-ca to check the chain only"
    } else if has("expired") {
        "The server's certificate has expired: renew it on the server (ssl_cert_file) and \
         reload the server's configuration; if it is not expired, check this machine's clock"
    } else if has("notvalidyet") || has("not valid yet") || has("not valid before") {
        "The server's certificate is not valid yet: check this machine's clock and the \
         certificate's notBefore"
    } else if has("unsupportedcertversion") {
        "A certificate is X.509 version 1 (openssl x509 -req without -extfile makes one), which \
         the relay's TLS library refuses even where nothing is verified: reissue it as version \
         3, with a subjectAltName"
    } else if has("causedasendentity") || has("ca used as end entity") {
        "The server presents a CA certificate (basicConstraints CA:TRUE) as its own: issue \
         the server a leaf certificate signed by that CA (CA:FALSE, with a subjectAltName) \
         for ssl_cert_file, and keep the CA in sslrootcert"
    } else if has("extended key usage") || has("invalidpurpose") {
        "The server's certificate is not issued for server authentication (its \
         extendedKeyUsage lacks serverAuth): reissue it with extendedKeyUsage = serverAuth \
         and install it on the server (ssl_cert_file)"
    } else if has("handshakefailure") || has("peerincompatible") || has("peer is incompatible") {
        "The server and the relay share no TLS version, cipher suite, key exchange group or \
         signature scheme (the relay speaks TLS 1.2 and 1.3 with AEAD cipher suites, X25519, \
         P-256 and P-384, and RSA, ECDSA P-256/P-384 or Ed25519 server keys): check the \
         server's ssl_ciphers, ssl_ecdh_curve, ssl_min_protocol_version and its key's type"
    } else if has("keyusage") {
        "The server's certificate is not issued for a TLS server: reissue it with keyUsage \
         digitalSignature (and keyEncipherment for RSA) and extendedKeyUsage serverAuth"
    } else if has("pathlenconstraint") {
        "The server's chain has more intermediate CA certificates below the root than the \
         root's pathLenConstraint allows (as OpenSSL refuses it): reissue the root with a \
         larger pathlen, or none, or issue the server's certificate from a CA fewer levels \
         below the root"
    } else if has("unsupportedsignaturealgorithm") {
        "Reissue the server's certificate (or the CA certificate named) with a SHA-256 (or \
         stronger) signature and an RSA key of at least 2048 bits, an ECDSA P-256 or P-384 key, \
         or an Ed25519 key"
    } else if has("badsignature") {
        "A signature of the server's chain or handshake did not verify: most often a key the \
         relay's TLS library refuses (RSA below 2048 bits; P-521 and Ed448 keys), else a \
         certificate altered or not issued by the CA it names. Check the server's ssl_cert_file \
         and ssl_key_file (openssl x509 -noout -text) and reissue with a supported key"
    } else if has("invalid peer certificate") {
        "The server's certificate could not be verified: check sslrootcert and sslmode in the \
         URL"
    } else if has("server does not support tls") || has("sslrequest refused") {
        "The server has ssl = off: connect with sslmode=disable (or allow, prefer), or enable \
         TLS on the server"
    } else if has("no encryption") {
        "No line of the server's pg_hba.conf admits this role, from the address the server \
         names, over a connection without TLS: if a hostssl line admits it from that address, \
         set sslmode=require (or stronger) in the URL; if no line covers that address at all \
         (a host name can resolve to ::1 where the lines name 127.0.0.1), add one for it to \
         pg_hba.conf, or connect to an address a line names"
    } else if has("valid client certificate") || has("certificate authentication failed") {
        "The server's pg_hba.conf asks this role for a client certificate: set sslcert and \
         sslkey in the URL to a certificate whose common name is the role, signed by a CA \
         in the server's ssl_ca_file"
    } else if has("sslcert=") || has("sslkey=") || has("sslrootcert=") {
        "Fix the named file or the URL parameter that names it"
    } else {
        return None;
    })
}

/// rustls's words for an alert the peer sent: `received fatal alert:
/// UnknownCA`. An alert rustls sends itself (it refused the server's
/// certificate) is reported as `invalid peer certificate: …` instead.
const ALERT_RECEIVED: &str = "received fatal alert: ";

/// What to change when the server refused the relay's client certificate
/// (`sslcert`, `sslkey`): the alert OpenSSL, the server's TLS library,
/// sends for it (`ssl_verify_alarm_type` in its `ssl/statem/statem_lib.c`
/// maps each certificate verification error to one; DecryptError also
/// answers a handshake signature that `sslkey` made but `sslcert` does not
/// verify). `None` for any other error: no other alert the server sends
/// is about a certificate (AccessDenied is not among them).
pub(super) fn client_cert_hint(msg: &str) -> Option<&'static str> {
    let (_, alert) = msg.split_once(ALERT_RECEIVED)?;
    let alert = alert
        .split(|c: char| !c.is_ascii_alphanumeric())
        .next()
        .unwrap_or_default();
    Some(match alert {
        "UnknownCA" => {
            "The server refused the relay's client certificate (sslcert): it is not signed by a \
             CA in the server's ssl_ca_file. Sign it with a CA in the server's ssl_ca_file (or \
             add its CA there and reload the server's configuration); if an intermediate CA \
             signed it, put the chain (the certificate, then each intermediate) in the sslcert \
             file"
        }
        "CertificateExpired" => {
            "The server refused the relay's client certificate (sslcert) as expired: renew it \
             (a new sslcert and sslkey, signed by a CA in the server's ssl_ca_file); if it is \
             not expired, check the server's clock"
        }
        "CertificateRevoked" => {
            "The server refused the relay's client certificate (sslcert) as revoked (its \
             ssl_crl_file or ssl_crl_dir lists it): issue the relay a new sslcert and sslkey, \
             signed by a CA in the server's ssl_ca_file"
        }
        "UnsupportedCertificate" => {
            "The server refused the relay's client certificate (sslcert) for its purpose: \
             reissue it with extendedKeyUsage = clientAuth (or without extendedKeyUsage), \
             signed by a CA in the server's ssl_ca_file"
        }
        "DecryptError" => {
            "The server refused the relay's client certificate (sslcert): a signature did not \
             verify. Check that sslkey is the key of sslcert, and that sslcert is signed by a \
             CA in the server's ssl_ca_file"
        }
        "BadCertificate" | "CertificateUnknown" => {
            "The server refused the relay's client certificate (sslcert); the server's log \
             says why (not valid yet, malformed, not trusted). Issue the relay a certificate \
             (sslcert, its key in sslkey) signed by a CA in the server's ssl_ca_file, valid now"
        }
        _ => return None,
    })
}

/// Where a hint names the role of the connection that failed; a
/// replication connection's errors name it, and so do `setup`'s
/// ([`super::SourceError::naming_role`]).
pub(crate) const ROLE: &str = "<the URL's role>";

/// What to grant for a privilege error (42501), by its words (`msg`;
/// `lower` is the same in lower case); `None` when they say nothing the
/// relay knows. The REPLICATION and ownership hints hold [`ROLE`].
pub(super) fn privilege_hint(msg: &str, lower: &str) -> Option<String> {
    if let Some(at) = lower.find(NOT_OWNER) {
        return Some(ownership_hint(&msg[at + NOT_OWNER.len()..]));
    }
    privilege_grant_hint(lower).map(str::to_owned)
}

/// PostgreSQL's words for an action only an object's owner may take
/// (`must be owner of table outbox`; 42501).
const NOT_OWNER: &str = "must be owner of ";

/// The hint for `must be owner of <what>` (`what`: the kind and the name,
/// `table outbox`, as the server gives them, then perhaps ` (SQLSTATE
/// 42501)`): who may, and the two fixes, the second as the command that
/// makes the connecting role the owner.
fn ownership_hint(what: &str) -> String {
    let what = what
        .split(" (")
        .next()
        .unwrap_or_default()
        .trim_end_matches(['.', ' ']);
    let (kind, name) = what.split_once(' ').unwrap_or(("table", what));
    let alter = match kind {
        "table" | "relation" => Some("TABLE"),
        "publication" => Some("PUBLICATION"),
        "schema" => Some("SCHEMA"),
        _ => None,
    };
    let give = match alter {
        Some(stmt) => format!(
            "or make the role that runs it the owner: ALTER {stmt} {} OWNER TO {ROLE}",
            ident(name)
        ),
        None => format!("or make {ROLE} the owner of {what}"),
    };
    format!(
        "The role this command connects as ({ROLE}) does not own {what}, and only its owner \
         (or a superuser) may do this: run the command as the owner (for `cdc-relay setup`, \
         the role that created the table), {give}"
    )
}

/// `name` as SQL writes it: bare when it is a plain lower-case
/// identifier, else double-quoted.
pub(super) fn ident(name: &str) -> String {
    let plain = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if plain {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

/// The grant that a privilege error other than ownership asks for.
fn privilege_grant_hint(lower: &str) -> Option<&'static str> {
    // PostgreSQL 15: "must be superuser or replication role to start
    // walsender"; 16 and later: "permission denied to start WAL sender".
    if lower.contains("replication") || lower.contains("walsender") || lower.contains("wal sender")
    {
        Some(
            "The relay's role needs the REPLICATION attribute: ALTER ROLE <the URL's role> \
             REPLICATION (sql/roles.sql does it for cdc_relay), and a pg_hba.conf line that \
             admits it",
        )
    } else if lower.contains("permission denied for") {
        Some(
            "Grant what the relay's role lacks: apply sql/roles.sql again (it grants cdc_relay \
             SELECT on outbox and what the dead-letter and progress tables need), or the same \
             grants to the role in --database-url. Pruning (`prune`, `run --prune-older-than`) \
             also needs DELETE on the outbox, which sql/roles.sql does not grant",
        )
    } else {
        None
    }
}

/// What to change for an object not in the state a statement needs
/// (55000), by its words (`msg`); `None` when they say nothing the relay
/// knows.
pub(super) fn state_hint(msg: &str) -> Option<String> {
    replica_identity_hint(msg)
}

/// PostgreSQL's words for an UPDATE or DELETE on a table that has no
/// replica identity while a publication that includes it publishes that
/// statement: `cannot delete from table "outbox" because it does not have
/// a replica identity and publishes deletes` (55000; its own hint, "set
/// REPLICA IDENTITY using ALTER TABLE", does not reach the relay).
const NO_REPLICA_IDENTITY: &str = "\" because it does not have a replica identity and publishes ";

/// The hint for [`NO_REPLICA_IDENTITY`]: the cause in words and both
/// fixes, a replica identity for the table or a publication that publishes
/// only inserts (all the relay streams), with the query that finds which.
fn replica_identity_hint(msg: &str) -> Option<String> {
    let (head, tail) = msg.split_once(NO_REPLICA_IDENTITY)?;
    let (_, name) = head.rsplit_once("table \"")?;
    let (what, statement, column) = if tail.starts_with("updates") {
        ("updates", "UPDATE", "pubupdate")
    } else {
        ("deletes", "DELETE", "pubdelete")
    };
    let table = ident(name);
    let literal = name.replace('\'', "''");
    Some(format!(
        "The table {table} has no replica identity (no primary key, or REPLICA IDENTITY \
         NOTHING) and a publication that includes it publishes {what}, so the server refuses \
         every {statement} on it (pruning's included). Either give it a replica identity: \
         ALTER TABLE {table} REPLICA IDENTITY DEFAULT, with a primary key (ALTER TABLE {table} \
         ADD PRIMARY KEY (<its event id column>)); or publish only inserts, all the relay \
         streams: ALTER PUBLICATION <name> SET (publish = 'insert') for each publication this \
         lists: SELECT pubname FROM pg_publication_tables JOIN pg_publication USING (pubname) \
         WHERE tablename = '{literal}' AND {column}"
    ))
}
