//! A fresh pair of databases per test — `orders_<pid>_<n>` and
//! `billing_<pid>_<n>` — built from the operator files in `sql/`, with the
//! least-privilege roles and a publication and slot name of its own.
//!
//! The files are read at run time, so tests exercise exactly what an operator
//! applies. Roles are cluster-wide: they are created once per cluster (under a
//! once-cell, so parallel tests do not race) with random passwords; each stack
//! then applies `roles.sql` in its own two databases for the grants.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::OnceCell;
use tokio_postgres::Client;

use crate::pg::{PgCluster, random_token};

/// Publication name used in `sql/publication.sql`; each stack substitutes its own.
pub const FILE_PUBLICATION: &str = "cdc_relay_outbox";

/// The repository's `sql/` directory.
pub fn sql_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sql")
}

/// Per-cluster state behind [`PgCluster::create_stack`]. A standby shares
/// its primary's (cloned): the roles and databases it replicates are the
/// same, so after a promotion new stacks neither reuse a name nor reset a
/// password.
#[derive(Default, Clone)]
pub(crate) struct StackState {
    next: Arc<AtomicU32>,
    roles: Arc<OnceCell<RolePasswords>>,
    /// Suffixes of stacks whose last handle is gone: the next
    /// [`PgCluster::create_stack`] drops their databases and the slots in
    /// them, so a long suite's shared cluster does not keep every test's
    /// WAL (an abandoned logical slot pins all WAL after it) and files.
    retired: Arc<Mutex<Vec<String>>>,
}

/// Held by every clone of a [`Stack`]; the last one to go retires it.
#[derive(Debug)]
struct Lease {
    suffix: String,
    retired: Arc<Mutex<Vec<String>>>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Ok(mut retired) = self.retired.lock() {
            retired.push(std::mem::take(&mut self.suffix));
        }
    }
}

/// Passwords the harness gave the cluster-wide roles.
#[derive(Debug, Clone)]
struct RolePasswords {
    orders_app: String,
    billing_app: String,
    payments_app: String,
    cdc_relay: String,
}

/// One test's databases and the credentials to reach them. When the last
/// clone goes away, the stack is retired: the next `create_stack` on the
/// same cluster drops its databases and their slots (after ending the
/// sessions and walsenders still in them).
#[derive(Debug, Clone)]
pub struct Stack {
    /// Name of the orders database (`orders_<pid>_<n>`).
    pub orders_db: String,
    /// Name of the billing database (`billing_<pid>_<n>`).
    pub billing_db: String,
    /// `orders_app` over TCP (SCRAM) to the orders database.
    pub orders_app_url: String,
    /// `billing_app` over TCP (SCRAM) to the billing database.
    pub billing_app_url: String,
    /// `cdc_relay` (LOGIN REPLICATION) over TCP (SCRAM) to the orders database.
    pub relay_url: String,
    /// The superuser over TCP to the orders database.
    pub orders_admin_url: String,
    /// The superuser over TCP to the billing database.
    pub billing_admin_url: String,
    /// Replication slot name reserved for this stack; nobody creates it here.
    pub slot: String,
    /// Insert-only publication of `public.outbox`, created in the orders
    /// database. Passed verbatim as `--publication`, so a test may make it
    /// a comma-separated list of several (see [`Stack::publications`]).
    pub publication: String,
    _lease: Arc<Lease>,
}

/// How [`PgCluster::create_stack_with`] makes a stack.
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// Server encoding of the orders database (e.g. `SQL_ASCII`), created
    /// from `template0` with the C locale; `None` keeps the cluster's UTF8.
    pub orders_encoding: Option<String>,
}

impl PgCluster {
    /// Creates a new database pair and applies `sql/` to it (orders.sql,
    /// publication.sql under this stack's publication name, roles.sql in the
    /// orders database; billing.sql, roles.sql in the billing database).
    pub async fn create_stack(&self) -> anyhow::Result<Stack> {
        self.create_stack_with(&StackOptions::default()).await
    }

    /// [`create_stack`](Self::create_stack) with `options`.
    pub async fn create_stack_with(&self, options: &StackOptions) -> anyhow::Result<Stack> {
        let passwords = self.ensure_roles().await?;
        let n = self.stacks.next.fetch_add(1, Ordering::Relaxed);
        let suffix = format!("{}_{n}", std::process::id());
        let orders_db = format!("orders_{suffix}");
        let billing_db = format!("billing_{suffix}");

        let admin = self.connect_superuser("postgres").await?;
        self.reap_retired(&admin).await;
        let orders_encoding = match &options.orders_encoding {
            Some(encoding) => {
                format!(" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
            }
            None => String::new(),
        };
        for (db, with) in [(&orders_db, orders_encoding.as_str()), (&billing_db, "")] {
            admin
                .batch_execute(&format!("CREATE DATABASE {db}{with}"))
                .await
                .with_context(|| format!("CREATE DATABASE {db}{with}"))?;
        }

        let stack = Stack {
            orders_app_url: self.url("orders_app", &passwords.orders_app, &orders_db),
            billing_app_url: self.url("billing_app", &passwords.billing_app, &billing_db),
            relay_url: self.url("cdc_relay", &passwords.cdc_relay, &orders_db),
            orders_admin_url: self.superuser_url(&orders_db),
            billing_admin_url: self.superuser_url(&billing_db),
            slot: format!("cdc_relay_slot_{suffix}"),
            publication: format!("{FILE_PUBLICATION}_{suffix}"),
            orders_db,
            billing_db,
            _lease: Arc::new(Lease {
                suffix,
                retired: Arc::clone(&self.stacks.retired),
            }),
        };
        stack.apply_schema().await?;
        Ok(stack)
    }

    /// Drops the databases of retired stacks (orders, billing, payments)
    /// and the logical slots in them, ending their walsenders first. Best
    /// effort: a stack that cannot be reaped now (a standby, a prepared
    /// transaction) is reported on stderr and left alone.
    async fn reap_retired(&self, admin: &Client) {
        let suffixes = std::mem::take(&mut *self.stacks.retired.lock().expect("retired stacks"));
        if suffixes.is_empty() {
            return;
        }
        match admin.query_one("SELECT pg_is_in_recovery()", &[]).await {
            Ok(row) if !row.get::<_, bool>(0) => {}
            _ => {
                // A standby (or a server that cannot say): reap after a promotion.
                self.stacks
                    .retired
                    .lock()
                    .expect("retired stacks")
                    .extend(suffixes);
                return;
            }
        }
        for suffix in suffixes {
            for db in ["orders", "billing", "payments"].map(|kind| format!("{kind}_{suffix}")) {
                if let Err(err) = reap_database(admin, &db).await {
                    eprintln!("harness: could not drop the retired database {db}: {err:#}");
                }
            }
        }
    }

    /// Creates the roles once per cluster and sets their passwords. Running
    /// `roles.sql` in the `postgres` database only ensures the roles: it
    /// leaves a database without our tables alone.
    async fn ensure_roles(&self) -> anyhow::Result<&RolePasswords> {
        self.stacks
            .roles
            .get_or_try_init(|| async {
                let client = self.connect_superuser("postgres").await?;
                client
                    .batch_execute(&read_sql("roles.sql")?)
                    .await
                    .context("applying sql/roles.sql in database postgres")?;
                let passwords = RolePasswords {
                    orders_app: random_token(24),
                    billing_app: random_token(24),
                    payments_app: random_token(24),
                    cdc_relay: random_token(24),
                };
                for (role, password) in [
                    ("orders_app", &passwords.orders_app),
                    ("billing_app", &passwords.billing_app),
                    ("payments_app", &passwords.payments_app),
                    ("cdc_relay", &passwords.cdc_relay),
                ] {
                    client
                        .batch_execute(&format!("ALTER ROLE {role} PASSWORD '{password}'"))
                        .await
                        .with_context(|| format!("setting the password of {role}"))?;
                }
                Ok(passwords)
            })
            .await
    }
}

/// The payment provider's database of a stack (`payments_<pid>_<n>`, from
/// `sql/payments.sql`), made on demand by [`PgCluster::create_payments`]:
/// most tests charge nothing. It keeps its stack from being retired.
#[derive(Debug, Clone)]
pub struct PaymentsDb {
    /// Its name.
    pub db: String,
    /// `payments_app` over TCP (SCRAM).
    pub app_url: String,
    /// The superuser over TCP.
    pub admin_url: String,
    _lease: Arc<Lease>,
}

impl PaymentsDb {
    /// Superuser connection (TCP, SCRAM).
    pub async fn admin(&self) -> anyhow::Result<Client> {
        connect(&self.admin_url).await
    }
}

impl PgCluster {
    /// Creates the payments database of `stack` and applies
    /// `sql/payments.sql` and `sql/roles.sql` to it.
    pub async fn create_payments(&self, stack: &Stack) -> anyhow::Result<PaymentsDb> {
        let passwords = self.ensure_roles().await?;
        let suffix = stack
            .orders_db
            .strip_prefix("orders_")
            .context("a stack's orders database is named orders_<suffix>")?;
        let db = format!("payments_{suffix}");
        let admin = self.connect_superuser("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .with_context(|| format!("CREATE DATABASE {db}"))?;
        let payments = PaymentsDb {
            app_url: self.url("payments_app", &passwords.payments_app, &db),
            admin_url: self.superuser_url(&db),
            db,
            _lease: Arc::clone(&stack._lease),
        };
        let client = payments.admin().await?;
        for file in ["payments.sql", "roles.sql"] {
            client
                .batch_execute(&read_sql(file)?)
                .await
                .with_context(|| format!("applying sql/{file} to {}", payments.db))?;
        }
        Ok(payments)
    }
}

impl Stack {
    /// The publications `--publication` names, one per list item.
    pub fn publications(&self) -> Vec<String> {
        self.publication.split(',').map(str::to_owned).collect()
    }

    /// Superuser connection to the orders database (TCP, SCRAM).
    pub async fn orders_admin(&self) -> anyhow::Result<Client> {
        connect(&self.orders_admin_url).await
    }

    /// Superuser connection to the billing database (TCP, SCRAM).
    pub async fn billing_admin(&self) -> anyhow::Result<Client> {
        connect(&self.billing_admin_url).await
    }

    /// Replaces the (empty) outbox with one partitioned by hash of its id
    /// into two leaves, `outbox_p0` and `outbox_p1`, published through its
    /// root (`publish_via_partition_root`), as `sql/publication.sql` and
    /// `setup` publish a partitioned outbox. The old table stays as
    /// `outbox_plain`.
    pub async fn partition_outbox(&self) -> anyhow::Result<()> {
        self.orders_admin()
            .await?
            .batch_execute(&format!(
                "ALTER PUBLICATION {p} DROP TABLE outbox; \
                 ALTER TABLE outbox RENAME TO outbox_plain; \
                 CREATE TABLE outbox (LIKE outbox_plain INCLUDING DEFAULTS, PRIMARY KEY (id)) \
                   PARTITION BY HASH (id); \
                 CREATE TABLE outbox_p0 PARTITION OF outbox FOR VALUES WITH (MODULUS 2, REMAINDER 0); \
                 CREATE TABLE outbox_p1 PARTITION OF outbox FOR VALUES WITH (MODULUS 2, REMAINDER 1); \
                 GRANT SELECT, INSERT ON outbox TO orders_app; GRANT SELECT ON outbox TO cdc_relay; \
                 ALTER PUBLICATION {p} ADD TABLE outbox; \
                 ALTER PUBLICATION {p} SET (publish_via_partition_root = true)",
                p = self.publication
            ))
            .await?;
        Ok(())
    }

    /// Creates the stack's slot by hand (`pgoutput`, as `cdc-relay setup`
    /// would), for a test that changed the publication first.
    pub async fn create_slot(&self) -> anyhow::Result<()> {
        self.orders_admin()
            .await?
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&self.slot],
            )
            .await
            .context("creating the stack's slot")?;
        Ok(())
    }

    /// Applies the `sql/` files to both databases, exactly as
    /// [`PgCluster::create_stack`] does; every file is re-runnable, so
    /// calling this again changes nothing.
    pub async fn apply_schema(&self) -> anyhow::Result<()> {
        let orders = self.orders_admin().await?;
        for file in ["orders.sql", "publication.sql", "roles.sql"] {
            let sql = read_sql(file)?.replace(FILE_PUBLICATION, &self.publication);
            orders
                .batch_execute(&sql)
                .await
                .with_context(|| format!("applying sql/{file} to {}", self.orders_db))?;
        }
        let billing = self.billing_admin().await?;
        for file in ["billing.sql", "roles.sql"] {
            billing
                .batch_execute(&read_sql(file)?)
                .await
                .with_context(|| format!("applying sql/{file} to {}", self.billing_db))?;
        }
        Ok(())
    }
}

/// Ends the walsenders on `db`'s logical slots (waiting up to 5 s each),
/// drops the slots, then the database and its sessions.
async fn reap_database(admin: &Client, db: &str) -> anyhow::Result<()> {
    admin
        .execute(
            "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots \
             WHERE database = $1 AND active_pid IS NOT NULL",
            &[&db],
        )
        .await
        .context("ending the walsenders of its slots")?;
    admin
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE database = $1",
            &[&db],
        )
        .await
        .context("dropping its slots")?;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .context("DROP DATABASE")?;
    Ok(())
}

/// Connects with a `postgres://` URL (10 s connect timeout, no TLS) and
/// spawns the connection task on the current runtime.
pub async fn connect(url: &str) -> anyhow::Result<Client> {
    let mut config: tokio_postgres::Config = url.parse().context("parsing a postgres URL")?;
    config.connect_timeout(Duration::from_secs(10));
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .with_context(|| {
            format!(
                "connecting as {:?} to {:?}",
                config.get_user(),
                config.get_dbname()
            )
        })?;
    tokio::spawn(async move {
        // The error, if any, surfaces to the client's next call.
        let _ = connection.await;
    });
    Ok(client)
}

/// The first column of every row that `sql` returns, as text, in order:
/// the statements run over the simple query protocol, so `sql` may hold
/// several (`SET …; EXPLAIN …; RESET …`) and every result is text (an
/// `EXPLAIN`'s lines, its JSON). A NULL is left out.
pub async fn first_column(client: &Client, sql: &str) -> anyhow::Result<Vec<String>> {
    Ok(client
        .simple_query(sql)
        .await
        .with_context(|| format!("running {sql:?}"))?
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect())
}

fn read_sql(file: &str) -> anyhow::Result<String> {
    let path = sql_dir().join(file);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}
