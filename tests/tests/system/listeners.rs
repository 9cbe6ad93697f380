//! Every listener survives a connection flood (issue 18, item 1): Orders,
//! Billing and the relay's admin endpoint, each flooded with more silent
//! and half-sent connections than its cap, while a real order goes through
//! Orders, the relay delivers it to Billing, and the admin endpoint answers.
//!
//! What is asserted, per listener:
//!
//! - the real requests succeed (Orders 201, Billing invoices the relay's
//!   delivery, the admin endpoint 200) while the flood is on;
//! - the process never holds more sockets than three times its cap (its
//!   slots and the lobby of connections that have not spoken yet, plus
//!   what it held before the flood), sampled from `/proc/<pid>/fd` throughout;
//! - every flood socket is closed by the server within the header-read
//!   timeout (plus a margin): a full lobby's longest-silent connection
//!   gives way to a new one, and at the cap a connection with a request
//!   takes the place of the one waiting longest for a complete head
//!   (issue 30), so none waits in the backlog for a slot to time out;
//! - Billing runs with a descriptor limit (`ulimit -n`) below the flood's
//!   size, as a unit's `LimitNOFILE=` would set it: without the cap its
//!   `accept` fails with "Too many open files" and real requests fail.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::harness::app::{self, Running, TEST_SECRET};
use ::harness::{PgCluster, ServiceProcess, bins, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Header-read (and idle) timeout given to Orders and Billing.
const SERVICE_TIMEOUT: Duration = Duration::from_secs(2);
/// Connection cap given to Orders and Billing.
const SERVICE_CAP: usize = 24;
/// The relay's admin endpoint: its fixed header-read timeout and default cap.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
const ADMIN_CAP: usize = 16;
/// Billing's descriptor limit: below Billing's flood, above what its
/// listener holds (three times its cap) plus what it needs otherwise.
const BILLING_NOFILE: usize = 128;
/// Slack for descriptors a process opens besides the flood's (a pooled
/// database connection, a sink connection) while the flood is on.
const FD_SLACK: usize = 8;
/// Scheduling margin on a shared, loaded host.
const MARGIN: Duration = Duration::from_secs(4);

/// What a flood left behind: for each socket, how long after it connected
/// the server closed it (from its own connect, not the flood's start:
/// opening a thousand sockets on a loaded host takes seconds).
struct Flood {
    closed: Vec<tokio::task::JoinHandle<Duration>>,
}

/// Opens `n` connections to `addr` (`host:port`): even ones send nothing,
/// odd ones half a request head. Each is watched until the server closes it.
async fn flood(addr: &str, n: usize) -> Flood {
    let mut closed = Vec::with_capacity(n);
    for i in 0..n {
        let mut socket = TcpStream::connect(addr).await.expect("connect");
        let started = Instant::now();
        if i % 2 == 1 {
            socket
                .write_all(b"POST /inbox HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("half a head");
        }
        closed.push(tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            loop {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => return started.elapsed(),
                    Ok(_) => {}
                }
            }
        }));
    }
    Flood { closed }
}

impl Flood {
    /// Waits (bounded by `within`) for every socket to be closed by the
    /// server; their closing times, sorted.
    async fn all_closed(self, within: Duration) -> Vec<Duration> {
        let mut times = Vec::new();
        for handle in self.closed {
            let time = tokio::time::timeout(within, handle)
                .await
                .unwrap_or_else(|_| panic!("a flood socket still open after {within:?}"))
                .expect("watcher");
            times.push(time);
        }
        times.sort();
        times
    }
}

/// Checks a flood's closing times against the listener's timeout and cap:
/// beyond what the listener holds (`cap` slots and twice as many in the
/// lobby), the oldest waiting sockets gave way to newer ones (closed before
/// the timeout), and the last `3 × cap` or fewer were closed by it; none
/// outlived it.
fn assert_reaped(name: &str, times: &[Duration], timeout: Duration, cap: usize) {
    let held = 3 * cap;
    assert!(times.len() > cap, "{name}: the flood must exceed the cap");
    let evicted = times.iter().filter(|t| **t < timeout).count();
    assert!(
        evicted >= times.len().saturating_sub(held),
        "{name}: {} sockets for {cap} slots and {} in the lobby: at least {} should have given way before the {timeout:?} timeout, {evicted} did",
        times.len(),
        2 * cap,
        times.len().saturating_sub(held)
    );
    let last = times[times.len() - 1];
    assert!(
        last <= timeout + MARGIN,
        "{name}: {} sockets: none should wait for a slot, yet the last closed after {last:?}",
        times.len()
    );
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Samples the descriptor count of each pid every 20 ms; the peaks.
fn sample_fds(pids: Vec<u32>) -> (Arc<Mutex<HashMap<u32, usize>>>, tokio::task::JoinHandle<()>) {
    let peaks = Arc::new(Mutex::new(HashMap::new()));
    let task = tokio::spawn({
        let peaks = Arc::clone(&peaks);
        async move {
            loop {
                for &pid in &pids {
                    let n = open_fds(pid);
                    let mut peaks = peaks.lock().unwrap();
                    let peak = peaks.entry(pid).or_insert(0);
                    *peak = (*peak).max(n);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    (peaks, task)
}

fn host_port(url: &str) -> &str {
    url.trim_start_matches("http://").trim_end_matches('/')
}

/// Billing under `ulimit -n BILLING_NOFILE`, as `LimitNOFILE=` would run it.
async fn start_billing_limited(stack: &::harness::Stack, args: &[&str]) -> Running {
    let mut command = std::process::Command::new("sh");
    command
        .arg("-c")
        .arg(format!("ulimit -n {BILLING_NOFILE} && exec \"$0\" \"$@\""))
        .arg(bins::path("billing"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("BILLING_DATABASE_URL", &stack.billing_app_url)
        .env("EVENT_SECRET", TEST_SECRET)
        .env("BILLING_ADMIN_LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "warn");
    let process = ServiceProcess::from_command(command).expect("spawn billing");
    let url = process
        .listen_addr(Duration::from_secs(30))
        .await
        .expect("billing listens");
    Running::service(process, url)
        .await
        .expect("admin endpoint")
}

#[tokio::test]
async fn floods_beyond_the_cap_leave_requests_and_deliveries_working_and_are_reaped() {
    let stack = PgCluster::shared().create_stack().await.unwrap();
    app::relay_setup(&stack).await.unwrap();
    let timeout_arg = format!("{}s", SERVICE_TIMEOUT.as_secs());
    let cap_arg = SERVICE_CAP.to_string();
    let limits = [
        "--header-read-timeout",
        timeout_arg.as_str(),
        "--max-connections",
        cap_arg.as_str(),
    ];
    let billing = start_billing_limited(&stack, &limits).await;
    let orders = app::start_orders_with(&stack, &limits, &[]).await.unwrap();
    let relay = app::start_relay(&stack, &billing.inbox(), &[])
        .await
        .unwrap();
    app::wait_streaming(&relay).await.unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let billing_db = stack.billing_admin().await.unwrap();
    let invoiced = |order_id: String| {
        let billing_db = &billing_db;
        async move {
            let id = uuid::Uuid::parse_str(&order_id).unwrap();
            billing_db
                .query_one("SELECT count(*) FROM invoices WHERE order_id = $1", &[&id])
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        }
    };

    // One order end to end before the flood: the path works and the pools
    // are warm, so the baselines below include a database connection each.
    let (before, _) = app::post_order(&http, &orders.url, 100).await.unwrap();
    wait_until("the first invoice", Duration::from_secs(45), || {
        invoiced(before.clone())
    })
    .await
    .unwrap();
    let pids = [
        ("orders", orders.process.pid(), SERVICE_CAP),
        ("billing", billing.process.pid(), SERVICE_CAP),
        ("relay admin", relay.process.pid(), ADMIN_CAP),
    ];
    let baseline: HashMap<u32, usize> = pids.iter().map(|&(_, p, _)| (p, open_fds(p))).collect();
    let (peaks, sampler) = sample_fds(pids.iter().map(|&(_, p, _)| p).collect());

    // Billing's flood alone exceeds its descriptor limit.
    let billing_flood = flood(host_port(&billing.url), BILLING_NOFILE + 22).await;
    let orders_flood = flood(host_port(&orders.url), 3 * SERVICE_CAP).await;
    let admin_flood = flood(host_port(&relay.url), 3 * ADMIN_CAP).await;

    // Real requests while every listener is flooded: they wait in the
    // backlog behind the flood until slots free, then succeed.
    let started = Instant::now();
    let (during, _) = app::post_order(&http, &orders.url, 200)
        .await
        .expect("POST /orders during the flood");
    wait_until(
        "the relay to deliver the order to the flooded Billing",
        Duration::from_secs(60),
        || invoiced(during.clone()),
    )
    .await
    .unwrap();
    let invoices = http
        .get(format!("{}/invoices?order_id={during}", billing.admin_url))
        .send()
        .await
        .expect("GET /invoices during the flood");
    assert_eq!(invoices.status(), 200);
    let metrics = http
        .get(format!("{}/metrics", relay.url))
        .send()
        .await
        .expect("relay /metrics during the flood");
    assert_eq!(metrics.status(), 200);
    eprintln!("real requests done {:?} into the flood", started.elapsed());

    let billing_times = billing_flood.all_closed(Duration::from_secs(60)).await;
    let orders_times = orders_flood.all_closed(Duration::from_secs(60)).await;
    let admin_times = admin_flood.all_closed(Duration::from_secs(60)).await;
    sampler.abort();
    assert_reaped("billing", &billing_times, SERVICE_TIMEOUT, SERVICE_CAP);
    assert_reaped("orders", &orders_times, SERVICE_TIMEOUT, SERVICE_CAP);
    assert_reaped("relay admin", &admin_times, ADMIN_TIMEOUT, ADMIN_CAP);

    let peaks = peaks.lock().unwrap().clone();
    for (name, pid, cap) in pids {
        let (base, peak) = (baseline[&pid], peaks[&pid]);
        assert!(
            peak <= base + 3 * cap + FD_SLACK,
            "{name} held {peak} descriptors during the flood: more than {base} before it + 3 × {cap} (slots and lobby) + {FD_SLACK}"
        );
        assert!(
            peak >= base + cap / 2,
            "{name}: the flood never reached the process ({peak} descriptors, {base} before): the test proves nothing"
        );
    }
    let logs = billing.process.logs();
    assert!(
        !logs.contains("Too many open files"),
        "Billing ran out of descriptors:\n{logs}"
    );

    // After the flood: fresh requests are served at once.
    let quick = Instant::now();
    app::post_order(&http, &orders.url, 300).await.unwrap();
    assert!(quick.elapsed() < SERVICE_TIMEOUT, "{:?}", quick.elapsed());
    for (name, pid, _) in pids {
        let now = open_fds(pid);
        assert!(
            now <= baseline[&pid] + FD_SLACK,
            "{name} still holds {now} descriptors after the flood ({} before)",
            baseline[&pid]
        );
    }
}

/// Issue 30, item 10: Billing with its defaults (cap 512, 10 s header-read
/// timeout), flooded with twice the cap of silent and half-sent sockets,
/// answers a signed delivery within 1 s, and Orders an order, (the bound; 11-17 ms
/// measured), a tenth of the timeout: the
/// flood's oldest sockets give way instead of holding every slot until
/// they time out.
///
/// Fails without the fix: the request waited in the backlog behind the
/// flood until its first sockets timed out (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_and_orders_with_their_defaults_answer_at_once_behind_a_flood_of_twice_the_cap() {
    const DEFAULT_CAP: usize = 512;
    let stack = PgCluster::shared().create_stack().await.unwrap();
    let billing = app::start_billing(&stack, TEST_SECRET).await.unwrap();
    let billing_flood = flood(host_port(&billing.url), 2 * DEFAULT_CAP).await;
    let body = serde_json::json!({
        "id": uuid::Uuid::new_v4().to_string(),
        "type": "OrderCreated",
        "data": {"order_id": uuid::Uuid::new_v4().to_string(), "amount_cents": 1, "currency": "EUR"}
    })
    .to_string();
    let asked = std::time::Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(1),
        reqwest::Client::new()
            .post(billing.inbox())
            .header("content-type", "application/json")
            .header(
                "x-event-signature",
                ::harness::sink::sign(TEST_SECRET, body.as_bytes()),
            )
            .body(body)
            .send(),
    )
    .await
    .expect("Billing answered within 1 s behind the flood, not after its 10 s timeouts")
    .expect("POST /inbox");
    // 11-17 ms measured while another suite loaded the machine.
    eprintln!("answered behind the flood in {:?}", asked.elapsed());
    assert!(answer.status().as_u16() < 500, "{}", answer.status());
    let times = billing_flood.all_closed(Duration::from_secs(60)).await;
    assert_reaped(
        "billing (defaults)",
        &times,
        Duration::from_secs(10),
        DEFAULT_CAP,
    );

    // Orders, with the same listener defaults: an order is taken within
    // 1 s behind the same flood.
    let orders = app::start_orders(&stack).await.unwrap();
    let orders_flood = flood(host_port(&orders.url), 2 * DEFAULT_CAP).await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let asked = std::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(1),
        app::post_order(&http, &orders.url, 100),
    )
    .await
    .expect("Orders answered within 1 s behind the flood, not after its 10 s timeouts")
    .expect("POST /orders");
    eprintln!("Orders answered behind the flood in {:?}", asked.elapsed());
    let times = orders_flood.all_closed(Duration::from_secs(60)).await;
    assert_reaped(
        "orders (defaults)",
        &times,
        Duration::from_secs(10),
        DEFAULT_CAP,
    );
}
