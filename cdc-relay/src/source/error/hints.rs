//! What to change, for errors whose fix is a setting or a grant: TLS
//! failures and refusals that depend on TLS, and privilege errors (42501).

/// What to change in the database URL for a TLS failure or a refusal
/// that depends on TLS, by the words of the error (rustls's certificate
/// errors, PostgreSQL's `pg_hba.conf` refusals); `None` for any other.
pub(crate) fn tls_hint(msg: &str) -> Option<&'static str> {
    let lower = msg.to_ascii_lowercase();
    let has = |s: &str| lower.contains(s);
    Some(if has("unknownissuer") || has("unknown issuer") {
        "The server's certificate is not signed by a CA in sslrootcert: set sslrootcert in \
         the URL to the CA certificate that issued it"
    } else if has("not valid for name") || has("notvalidforname") {
        "The server's certificate does not carry the URL's host name: connect by a name in \
         its subjectAltName, reissue it for this host, or use sslmode=verify-ca to check the \
         chain only"
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
    } else if has("badsignature") || has("invalid peer certificate") {
        "The server's certificate could not be verified: check sslrootcert and sslmode in the \
         URL"
    } else if has("server does not support tls") || has("sslrequest refused") {
        "The server has ssl = off: connect with sslmode=disable (or allow, prefer), or enable \
         TLS on the server"
    } else if has("no encryption") {
        "The server's pg_hba.conf admits this role from here only over TLS (hostssl): set \
         sslmode=require (or stronger) in the URL"
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

/// Where a hint names the role of the connection that failed; a
/// replication connection's errors name it ([`super::SourceError::naming_role`]).
pub(crate) const ROLE: &str = "<the URL's role>";

/// What to grant for a privilege error (42501), by its words (`lower`, in
/// lower case); `None` when they say nothing the relay knows. The
/// REPLICATION hint holds [`ROLE`].
pub(super) fn privilege_hint(lower: &str) -> Option<&'static str> {
    // PostgreSQL 15: "must be superuser or replication role to start
    // walsender"; 16 and later: "permission denied to start WAL sender".
    if lower.contains("replication") || lower.contains("walsender") || lower.contains("wal sender")
    {
        Some(
            "The relay's role needs the REPLICATION attribute: ALTER ROLE <the URL's role> \
             REPLICATION (sql/roles.sql does it for cdc_relay), and a pg_hba.conf line that \
             admits it",
        )
    } else if lower.contains("must be owner") {
        Some(
            "Only the table's owner (or a superuser) may do this: run `cdc-relay setup` as the \
             owner, or ALTER TABLE … OWNER TO the role that runs it",
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
