//! The baseline: a Rust port of the tutorial's polling relay (`relay.php`),
//! run by the benchmark as a child process (`bench baseline-worker …`) so its
//! CPU and memory are measured exactly like cdc-relay's.
//!
//! Per worker, in a loop, as the tutorial does:
//! 1. one short transaction claims ONE due row — unpublished, `available_at`
//!    reached, lease free or expired — oldest `occurred_at` first, `FOR UPDATE
//!    SKIP LOCKED`, setting `claimed_by`, a 20 s lease and `attempts + 1`;
//! 2. nothing claimed: sleep the poll interval (250 ms in the tutorial);
//! 3. the HTTP POST happens outside any transaction (1 s connect, 5 s total
//!    timeout), signed with HMAC-SHA256 of the exact body;
//! 4. 2xx: mark published, only if this worker still owns an unexpired lease;
//!    otherwise release the claim and push `available_at` out by
//!    `min(60, 2^min(attempts, 6))` seconds.
//!
//! Differences from the PHP, each in the baseline's favour: statements are
//! prepared once per connection (PDO re-prepares them every iteration), and
//! the HTTP client keeps connections alive (curl_close drops them). Several
//! workers are tasks with a connection each in one process, not processes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio_postgres::Client;
use uuid::Uuid;

const CLAIM: &str = "WITH picked AS (
        SELECT id FROM outbox
        WHERE published_at IS NULL
          AND available_at <= now()
          AND (lease_until IS NULL OR lease_until < now())
        ORDER BY occurred_at
        FOR UPDATE SKIP LOCKED
        LIMIT 1
     )
     UPDATE outbox AS o
     SET claimed_by = $1, lease_until = now() + interval '20 seconds',
         attempts = attempts + 1
     FROM picked
     WHERE o.id = picked.id
     RETURNING o.id, o.event_type, o.payload::text, o.attempts";

const RELEASE: &str = "UPDATE outbox SET claimed_by = NULL, lease_until = NULL
     WHERE id = $1 AND claimed_by = $2 AND published_at IS NULL";

const DONE: &str = "UPDATE outbox
     SET published_at = now(), claimed_by = NULL, lease_until = NULL
     WHERE id = $1 AND claimed_by = $2 AND lease_until > now()";

const RETRY: &str = "UPDATE outbox
     SET claimed_by = NULL, lease_until = NULL,
         available_at = now() + CAST($1 AS integer) * interval '1 second'
     WHERE id = $2 AND claimed_by = $3";

/// Settings of `bench baseline-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct BaselineArgs {
    /// Orders database (a role with SELECT and UPDATE on outbox).
    #[arg(long)]
    pub db_url: String,
    /// Inbox URL.
    #[arg(long)]
    pub sink_url: String,
    /// Workers (each with its own connection).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Sleep when nothing was claimed, milliseconds.
    #[arg(long, default_value_t = 250)]
    pub poll_ms: u64,
}

/// Runs the workers until SIGTERM/SIGINT; prints `baseline ready` once every
/// worker is connected.
pub async fn run(args: BaselineArgs) -> anyhow::Result<()> {
    let secret = std::env::var("EVENT_SECRET").context("EVENT_SECRET is required")?;
    let stopping = Arc::new(AtomicBool::new(false));
    for kind in [
        tokio::signal::unix::SignalKind::terminate(),
        tokio::signal::unix::SignalKind::interrupt(),
    ] {
        let mut sig = tokio::signal::unix::signal(kind)?;
        let stopping = Arc::clone(&stopping);
        tokio::spawn(async move {
            sig.recv().await;
            stopping.store(true, Ordering::SeqCst);
        });
    }
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(5))
        .build()?;
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "host".into());
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let worker = Worker {
            db: connect(&args.db_url).await?,
            http: http.clone(),
            url: args.sink_url.clone(),
            secret: secret.clone(),
            name: format!("{}:{}:{i}", host.trim(), std::process::id()),
            poll: Duration::from_millis(args.poll_ms),
            stopping: Arc::clone(&stopping),
        };
        workers.push(worker);
    }
    println!("baseline ready");
    let mut set = tokio::task::JoinSet::new();
    for mut worker in workers {
        let url = args.db_url.clone();
        set.spawn(async move {
            // relay.php dies on a database error and its supervisor restarts it.
            while !worker.stopping.load(Ordering::SeqCst) {
                if let Err(err) = worker.run().await {
                    eprintln!("baseline worker {}: {err:#}", worker.name);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if let Ok(db) = connect(&url).await {
                        worker.db = db;
                    }
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    Ok(())
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let db = harness::connect(url).await?;
    db.batch_execute("SET statement_timeout = '3000ms'; SET lock_timeout = '1000ms'")
        .await?;
    Ok(db)
}

struct Worker {
    db: Client,
    http: reqwest::Client,
    url: String,
    secret: String,
    name: String,
    poll: Duration,
    stopping: Arc<AtomicBool>,
}

impl Worker {
    async fn run(&mut self) -> anyhow::Result<()> {
        let claim = self.db.prepare(CLAIM).await?;
        let release = self.db.prepare(RELEASE).await?;
        let done = self.db.prepare(DONE).await?;
        let retry = self.db.prepare(RETRY).await?;
        while !self.stopping.load(Ordering::SeqCst) {
            let tx = self.db.transaction().await?;
            let row = tx.query_opt(&claim, &[&self.name]).await?;
            tx.commit().await?;
            let Some(row) = row else {
                tokio::time::sleep(self.poll).await;
                continue;
            };
            let id: Uuid = row.get(0);
            let event_type: String = row.get(1);
            let payload: String = row.get(2);
            let attempts: i32 = row.get(3);
            if self.stopping.load(Ordering::SeqCst) {
                self.db.execute(&release, &[&id, &self.name]).await?;
                break;
            }
            let data: serde_json::Value = serde_json::from_str(&payload)?;
            let body = serde_json::to_string(&serde_json::json!({
                "id": id.to_string(),
                "type": event_type,
                "data": data,
            }))?;
            let mut mac = Hmac::<Sha256>::new_from_slice(self.secret.as_bytes())?;
            mac.update(body.as_bytes());
            let signature = hex::encode(mac.finalize().into_bytes());
            let ok = match self
                .http
                .post(&self.url)
                .header("content-type", "application/json")
                .header("x-event-signature", signature)
                .body(body)
                .send()
                .await
            {
                Ok(resp) => {
                    let ok = resp.status().is_success();
                    // Read the body so the connection can be reused.
                    let _ = resp.bytes().await;
                    ok
                }
                Err(_) => false,
            };
            if ok {
                self.db.execute(&done, &[&id, &self.name]).await?;
            } else {
                let delay = backoff_seconds(attempts);
                self.db.execute(&retry, &[&delay, &id, &self.name]).await?;
            }
        }
        Ok(())
    }
}

/// The tutorial's retry delay: `min(60, 2^min(attempts, 6))` seconds.
pub fn backoff_seconds(attempts: i32) -> i32 {
    60.min(1 << attempts.clamp(0, 6))
}

#[cfg(test)]
mod tests {
    use super::backoff_seconds;

    #[test]
    fn tutorial_backoff() {
        let got: Vec<i32> = (0..=8).map(backoff_seconds).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }
}
