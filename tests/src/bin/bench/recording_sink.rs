//! The recording sink of scenario j: an HTTP endpoint in a child process of
//! its own (`bench sink-worker`), so that one of them can be frozen with
//! SIGSTOP — a peer that holds its connections, lets the kernel complete new
//! ones and never answers — while the others go on.
//!
//! The worker answers every `POST /inbox` with 204 and notes the event id
//! (the body's `id`) and the wall-clock time of its answer, microseconds
//! since the Unix epoch: the same clock PostgreSQL's commit timestamps come
//! from, so the difference is the event's commit→2xx latency at this
//! endpoint. `GET /count` answers how many it answered, `GET /received`
//! every `<id> <micros>` line. The benchmark side is [`RecordingSink`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use harness::ServiceProcess;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Settings of `bench sink-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct SinkWorkerArgs {
    /// Address to listen on (port 0: a free one, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
}

/// Answers, in arrival order: event id and answer time (Unix µs).
type Answers = Arc<Mutex<Vec<(String, i64)>>>;

/// Runs the worker until it is killed; prints `listening on http://ADDR`
/// once bound (the harness's convention).
pub async fn run(args: SinkWorkerArgs) -> anyhow::Result<()> {
    let answers: Answers = Arc::default();
    let app = Router::new()
        .route("/inbox", post(inbox))
        .route("/count", get(count))
        .route("/received", get(received))
        .with_state(answers);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("{}{}", harness::process::LISTENING, listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

#[derive(serde::Deserialize)]
struct Event {
    id: String,
}

async fn inbox(State(answers): State<Answers>, body: Bytes) -> StatusCode {
    let Ok(event) = serde_json::from_slice::<Event>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    let at = unix_micros();
    lock(&answers).push((event.id, at));
    StatusCode::NO_CONTENT
}

async fn count(State(answers): State<Answers>) -> String {
    lock(&answers).len().to_string()
}

async fn received(State(answers): State<Answers>) -> String {
    let answers = lock(&answers);
    let mut text = String::with_capacity(answers.len() * 54);
    for (id, at) in answers.iter() {
        text.push_str(&format!("{id} {at}\n"));
    }
    text
}

fn lock(answers: &Answers) -> std::sync::MutexGuard<'_, Vec<(String, i64)>> {
    answers
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A recording sink as the benchmark drives it: the child process, its
/// inbox URL, and what it answered.
pub(crate) struct RecordingSink {
    process: ServiceProcess,
    base: String,
    /// `<base>/inbox`, what a routes file names.
    pub(crate) url: String,
}

impl RecordingSink {
    /// Starts a worker on a free port.
    pub(crate) async fn start() -> anyhow::Result<RecordingSink> {
        let exe = std::env::current_exe()?;
        let process = ServiceProcess::spawn(exe, &["sink-worker"], &[])?;
        let base = process.listen_addr(Duration::from_secs(30)).await?;
        Ok(RecordingSink {
            process,
            url: format!("{base}/inbox"),
            base,
        })
    }

    /// Freezes the worker (SIGSTOP): its sockets stay open, the kernel keeps
    /// completing connections to its listener, nothing is read or answered.
    pub(crate) fn freeze(&self) -> anyhow::Result<()> {
        let pid = i32::try_from(self.process.pid())?;
        kill(Pid::from_raw(pid), Signal::SIGSTOP).context("SIGSTOP to the sink")
    }

    /// Whether the worker is still stopped (state `T` in `/proc/<pid>/stat`,
    /// read as `harness::pg` reads a zombie): a frozen run whose sink was
    /// resumed measured nothing.
    pub(crate) fn frozen(&self) -> anyhow::Result<bool> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.process.pid()))?;
        Ok(stat.contains(") T "))
    }

    /// Events answered so far.
    pub(crate) async fn count(&self, http: &reqwest::Client) -> anyhow::Result<u64> {
        let text = http
            .get(format!("{}/count", self.base))
            .send()
            .await?
            .text()
            .await?;
        text.trim().parse().context("the sink's count")
    }

    /// The first answer time (Unix µs) of every event answered.
    pub(crate) async fn answers(
        &self,
        http: &reqwest::Client,
    ) -> anyhow::Result<HashMap<String, i64>> {
        let text = http
            .get(format!("{}/received", self.base))
            .send()
            .await?
            .text()
            .await?;
        let mut first = HashMap::new();
        for line in text.lines() {
            let (id, at) = line.split_once(' ').context("an answer line")?;
            first.entry(id.to_owned()).or_insert(at.parse()?);
        }
        Ok(first)
    }
}
