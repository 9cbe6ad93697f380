//! Throwaway certificate authorities and certificates for TLS tests, made
//! with the `openssl` command: a CA, server certificates with the names
//! and validity a test needs (an expired one is made under libfaketime),
//! client certificates for `pg_hba.conf`'s `cert` method, and the server
//! key as PostgreSQL insists on it.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Runs `openssl ARGS…`; an error carries its stderr.
pub fn openssl(args: &[&str]) -> anyhow::Result<()> {
    openssl_with(args, &[])
}

fn openssl_with(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<()> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .context("running openssl (the TLS tests need the openssl command)")?;
    anyhow::ensure!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// `p` as UTF-8 (for command lines).
pub fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str().context("a UTF-8 path")
}

const EC: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

/// A certificate authority whose files live in `dir`.
pub struct Ca {
    dir: PathBuf,
    name: String,
    /// The CA certificate, PEM.
    pub cert: PathBuf,
    key: PathBuf,
}

/// A certificate and its key, PEM.
pub struct Issued {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key (mode 0600).
    pub key: PathBuf,
}

/// What to issue.
pub struct Request<'a> {
    /// Subject CN, and file name stem (with `-expired` appended for an
    /// expired certificate, so it does not replace a valid one of the
    /// same name).
    pub name: &'a str,
    /// subjectAltName entries, e.g. `["DNS:localhost", "IP:127.0.0.1"]`
    /// (none for a client certificate).
    pub sans: &'a [&'a str],
    /// A server certificate (`serverAuth`) or a client one (`clientAuth`).
    pub client: bool,
    /// Whether the certificate's validity ended before now.
    pub expired: bool,
}

impl Ca {
    /// A new CA named `name` in `dir` (which must exist), valid for two days.
    pub fn new(dir: &Path, name: &str) -> anyhow::Result<Ca> {
        Ca::self_signed(
            dir,
            name,
            &[
                "basicConstraints=critical,CA:TRUE",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
            None,
        )
    }

    /// A self-signed certificate named `name` with the extensions `exts`
    /// (`-addext` values), made under `faketime` (e.g. `-10d`: expired for
    /// eight days) when given: a root the relay must or must not trust.
    pub fn self_signed(
        dir: &Path,
        name: &str,
        exts: &[&str],
        faketime: Option<&str>,
    ) -> anyhow::Result<Ca> {
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}.key"));
        let subject = format!("/CN={name}");
        let mut args: Vec<&str> = [
            &["req", "-x509", "-days", "2", "-subj"][..],
            &[&subject],
            &EC,
            &["-keyout", path_str(&key)?, "-out", path_str(&cert)?],
        ]
        .concat();
        for ext in exts {
            args.extend(["-addext", ext]);
        }
        match faketime {
            Some(offset) => {
                let lib = crate::debian::libfaketime()?;
                openssl_with(
                    &args,
                    &[("LD_PRELOAD", path_str(&lib)?), ("FAKETIME", offset)],
                )?;
            }
            None => openssl(&args)?,
        }
        Ok(Ca {
            dir: dir.to_owned(),
            name: name.to_owned(),
            cert,
            key,
        })
    }

    /// Issues a certificate as `req` asks.
    pub fn issue(&self, req: &Request<'_>) -> anyhow::Result<Issued> {
        use std::os::unix::fs::PermissionsExt;
        let stem = if req.expired {
            format!("{}-expired", req.name)
        } else {
            req.name.to_owned()
        };
        let p = |ext: &str| self.dir.join(format!("{}.{stem}.{ext}", self.name));
        let (cert, key, csr, extfile) = (p("pem"), p("key"), p("csr"), p("ext"));
        openssl(
            &[
                &["req", "-subj"][..],
                &[&format!("/CN={}", req.name)],
                &EC,
                &["-keyout", path_str(&key)?, "-out", path_str(&csr)?],
            ]
            .concat(),
        )?;
        let mut ext =
            String::from("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n");
        ext.push_str(if req.client {
            "extendedKeyUsage=clientAuth\n"
        } else {
            "extendedKeyUsage=serverAuth\n"
        });
        if !req.sans.is_empty() {
            ext.push_str(&format!("subjectAltName={}\n", req.sans.join(",")));
        }
        std::fs::write(&extfile, ext)?;
        let faked;
        let env: &[(&str, &str)] = if req.expired {
            // Signed ten days ago for two days: expired for eight.
            faked = crate::debian::libfaketime()?;
            &[("LD_PRELOAD", path_str(&faked)?), ("FAKETIME", "-10d")]
        } else {
            &[]
        };
        self.sign(&csr, &extfile, &cert, env)?;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
        std::fs::set_permissions(&cert, std::fs::Permissions::from_mode(0o644))?;
        Ok(Issued { cert, key })
    }
}

impl Ca {
    /// Signs the request `csr` with the extensions in `extfile` into
    /// `out`, valid for two days (from the clock `env` gives openssl).
    fn sign(
        &self,
        csr: &Path,
        extfile: &Path,
        out: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        openssl_with(
            &[
                "x509",
                "-req",
                "-days",
                "2",
                "-in",
                path_str(csr)?,
                "-CA",
                path_str(&self.cert)?,
                "-CAkey",
                path_str(&self.key)?,
                "-CAcreateserial",
                "-extfile",
                path_str(extfile)?,
                "-out",
                path_str(out)?,
            ],
            env,
        )
    }

    /// This CA's own certificate and key, for a server that presents the
    /// CA itself.
    pub fn as_served(&self) -> Issued {
        Issued {
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }

    /// An intermediate CA named `name`, signed by this one.
    pub fn intermediate(&self, name: &str) -> anyhow::Result<Ca> {
        let cert = self.dir.join(format!("{name}.pem"));
        let key = self.dir.join(format!("{name}.key"));
        let csr = self.dir.join(format!("{name}.csr"));
        let extfile = self.dir.join(format!("{name}.ext"));
        openssl(
            &[
                &["req", "-subj"][..],
                &[&format!("/CN={name}")],
                &EC,
                &["-keyout", path_str(&key)?, "-out", path_str(&csr)?],
            ]
            .concat(),
        )?;
        std::fs::write(
            &extfile,
            "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n",
        )?;
        self.sign(&csr, &extfile, &cert, &[])?;
        Ok(Ca {
            dir: self.dir.clone(),
            name: name.to_owned(),
            cert,
            key,
        })
    }
}

impl Issued {
    /// This certificate followed by `issuer`'s (one PEM file, as a server's
    /// `ssl_cert_file` carries its chain), with the same key.
    pub fn with_chain(&self, issuer: &Ca) -> anyhow::Result<Issued> {
        let chain = self.cert.with_extension("chain.pem");
        let mut pem = std::fs::read(&self.cert)?;
        pem.extend(std::fs::read(&issuer.cert)?);
        std::fs::write(&chain, pem)?;
        Ok(Issued {
            cert: chain,
            key: self.key.clone(),
        })
    }
}

/// A self-signed server certificate for the common name `cn` in `dir`, as
/// PostgreSQL's documentation makes one (`openssl req -new -x509 … -subj
/// /CN=…`): no subjectAltName, and a CA (basicConstraints CA:TRUE), which
/// the client then trusts by putting the certificate itself in its root
/// file.
pub fn self_signed_server(dir: &Path, cn: &str) -> anyhow::Result<Issued> {
    use std::os::unix::fs::PermissionsExt;
    let cert = dir.join(format!("self-{cn}.pem"));
    let key = dir.join(format!("self-{cn}.key"));
    openssl(
        &[
            &["req", "-new", "-x509", "-days", "2", "-subj"][..],
            &[&format!("/CN={cn}")],
            &EC,
            &["-keyout", path_str(&key)?, "-out", path_str(&cert)?],
            &["-addext", "basicConstraints=critical,CA:TRUE"],
        ]
        .concat(),
    )?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
    std::fs::set_permissions(&cert, std::fs::Permissions::from_mode(0o644))?;
    Ok(Issued { cert, key })
}

/// A copy of `key` that the PostgreSQL server accepts as `ssl_key_file`:
/// mode 0600, owned by the user the harness runs the server as.
pub fn server_key(key: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let copy = key.with_extension("server.key");
    std::fs::copy(key, &copy)?;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600))?;
    if nix::unistd::Uid::effective().is_root() {
        let pg = nix::unistd::User::from_name(crate::pg::SUPERUSER)?
            .context("the postgres user the harness runs the server as")?;
        nix::unistd::chown(&copy, Some(pg.uid), Some(pg.gid))?;
    }
    Ok(copy)
}

/// A directory for certificates that the server (which may run as
/// `postgres`) can read.
pub fn dir() -> anyhow::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}
