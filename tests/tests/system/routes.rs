//! Several endpoints from one slot (`run --routes`, issue 15's first
//! slice): fan-out, unrouted dead letters, one endpoint down while the
//! others keep receiving, per-endpoint secrets, `routes check`, and the
//! dead-letter commands' `--endpoint`.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use ::harness::app::{self, Running};
use ::harness::oracle::{self, Expected};
use ::harness::sink::ScriptedSink;
use ::harness::stack::Stack;
use ::harness::{PgCluster, wait_until};
use tokio_postgres::Client;

/// Bound for expected deliveries to arrive.
const DELIVER: Duration = Duration::from_secs(45);

const SECRETS: [(&str, &str); 3] = [
    (
        "ROUTE_SECRET_BILLING",
        "billing-secret-0123456789abcdef0123",
    ),
    (
        "ROUTE_SECRET_SHIPPING",
        "shipping-secret-0123456789abcdef012",
    ),
    ("ROUTE_SECRET_AUDIT", "audit-secret-0123456789abcdef0123456"),
];

/// The endpoints: (name, the event types it takes).
const ROUTES: [(&str, &[&str]); 3] = [
    ("billing", &["OrderCreated", "Invoice*"]),
    ("shipping", &["OrderCreated", "Shipment*"]),
    ("audit", &["Refund*"]),
];

/// Types the test commits, in a cycle; `Mystery` matches no endpoint.
const TYPES: [&str; 5] = [
    "OrderCreated",
    "InvoicePaid",
    "ShipmentSent",
    "RefundIssued",
    "Mystery",
];

fn routes_file(dir: &std::path::Path, sinks: &[ScriptedSink]) -> std::path::PathBuf {
    let mut text = String::from("unrouted = \"dead-letter\"\n");
    for (i, (name, types)) in ROUTES.iter().enumerate() {
        let types: Vec<String> = types.iter().map(|t| format!("{t:?}")).collect();
        text += &format!(
            "\n[[endpoint]]\nname = {name:?}\nurl = {:?}\nevent_types = [{}]\nsecret_env = {:?}\nmax_in_flight = 8\n",
            sinks[i].url,
            types.join(", "),
            SECRETS[i].0
        );
    }
    let path = dir.join("routes.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn takes(endpoint: usize, event_type: &str) -> bool {
    ROUTES[endpoint]
        .1
        .iter()
        .any(|p| match p.strip_suffix('*') {
            Some(prefix) => event_type.starts_with(prefix),
            None => *p == event_type,
        })
}

/// Commits `txs` transactions of two events each over four aggregates,
/// types cycling through [`TYPES`]; returns the events in commit order.
async fn commit_events(db: &Client, txs: usize) -> Vec<Expected> {
    let mut aggregates = Vec::new();
    for _ in 0..4 {
        aggregates.push(oracle::expected::insert_order(db).await.unwrap());
    }
    let mut out = Vec::new();
    for t in 0..txs {
        db.batch_execute("BEGIN").await.unwrap();
        for j in 0..2 {
            let n = t * 2 + j;
            let e = oracle::expected::insert_event(
                db,
                aggregates[n % 4],
                TYPES[n % TYPES.len()],
                Some(&format!("{{\"n\":{n}}}")),
            )
            .await
            .unwrap();
            out.push(e);
        }
        db.batch_execute("COMMIT").await.unwrap();
    }
    out
}

/// Every request `sink` received is for an event it takes, correctly
/// signed with its own secret; each aggregate's requests (retries
/// included) never go back in commit order; returns the ids it got a 2xx
/// for.
fn check_endpoint(i: usize, sink: &ScriptedSink, events: &[Expected]) -> BTreeSet<String> {
    let place: HashMap<&str, (usize, &Expected)> = events
        .iter()
        .enumerate()
        .map(|(n, e)| (e.id.as_str(), (n, e)))
        .collect();
    let name = ROUTES[i].0;
    let mut last: HashMap<&str, usize> = HashMap::new();
    for r in sink.received() {
        let id = r.id();
        let (n, e) = place
            .get(id.as_str())
            .unwrap_or_else(|| panic!("{name} got an event never committed: {id}"));
        assert!(
            takes(i, &e.event_type),
            "{name} got {} {id}, a type it does not take",
            e.event_type
        );
        assert!(
            r.signature_valid(SECRETS[i].1),
            "{name}: {id} not signed with its own secret"
        );
        let prev = last.insert(e.aggregate.as_str(), *n).unwrap_or(0);
        assert!(
            *n >= prev,
            "{name}: aggregate {} went back in commit order (event #{n} after #{prev})",
            e.aggregate
        );
    }
    sink.delivered().iter().map(|r| r.id()).collect()
}

fn expected_at(i: usize, events: &[Expected]) -> BTreeSet<String> {
    events
        .iter()
        .filter(|e| takes(i, &e.event_type))
        .map(|e| e.id.clone())
        .collect()
}

async fn start(stack: &Stack, path: &std::path::Path) -> Running {
    let relay = app::start_relay_with_routes(stack, path, &["--backoff-cap", "200ms"], &SECRETS)
        .await
        .unwrap();
    app::wait_streaming(&relay).await.unwrap();
    relay
}

#[tokio::test]
async fn three_endpoints_fan_out_unrouted_and_one_down_then_back() {
    let stack = PgCluster::shared().create_stack().await.unwrap();
    app::relay_setup(&stack).await.unwrap();
    let sinks = vec![
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = routes_file(dir.path(), &sinks);
    let relay = start(&stack, &path).await;
    let db = stack.orders_admin().await.unwrap();

    // shipping is down (503) from the start.
    sinks[1].set_status(503);
    let events = commit_events(&db, 20).await;
    let after = oracle::wal_position(&db).await.unwrap();
    for i in [0, 2] {
        let want = expected_at(i, &events);
        wait_until(
            &format!("{} to get its events while shipping is down", ROUTES[i].0),
            DELIVER,
            || async {
                let got: BTreeSet<String> = sinks[i].delivered().iter().map(|r| r.id()).collect();
                want.is_subset(&got)
            },
        )
        .await
        .unwrap();
    }
    assert!(
        sinks[1].delivered().is_empty(),
        "shipping answered only 503"
    );
    assert!(sinks[1].count() > 0, "shipping was tried");
    // `status` names each endpoint's circuit (it said the relay-wide
    // "circuit closed", the gauge of an endpoint a routes file has not).
    wait_until("shipping's circuit opens", DELIVER, || async {
        relay.metrics().await.map(|m| {
            m.value(
                "cdc_relay_endpoint_circuit_state",
                &[("endpoint", "shipping")],
            ) == Some(1.0)
        })
    })
    .await
    .unwrap();
    let status = relay.status(&stack).await.unwrap();
    assert!(
        status
            .text()
            .contains("circuits: audit closed, billing closed, shipping OPEN"),
        "{}",
        status.text()
    );
    // Not "healthy": one endpoint gets nothing (it was exit 0).
    assert_eq!(status.code(), Some(10), "{}", status.text());
    assert!(
        status.text().contains("problem (exit 10): relay at"),
        "{}",
        status.text()
    );
    assert!(
        status
            .text()
            .contains("endpoint shipping's circuit is open"),
        "{}",
        status.text()
    );
    let slot = oracle::slot_position(&db, &stack.slot).await.unwrap();
    assert!(
        slot.confirmed < after,
        "the slot passed transactions shipping has not taken"
    );

    // shipping is back: it gets its whole backlog, in order.
    sinks[1].set_status(204);
    oracle::settle(&db, &stack.slot).await.unwrap();
    for (i, sink) in sinks.iter().enumerate() {
        let got = check_endpoint(i, sink, &events);
        assert_eq!(
            got,
            expected_at(i, &events),
            "{}: exactly its events",
            ROUTES[i].0
        );
    }
    let fanned = events
        .iter()
        .filter(|e| e.event_type == "OrderCreated")
        .count();
    assert!(fanned >= 8, "OrderCreated went to two endpoints");

    // The unrouted ones, and only they, are dead letters without endpoint.
    let rows = db
        .query(
            "SELECT event_id, error, endpoint FROM cdc_relay_dead_letter ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    // Written up to 4 at a time: compared as sets.
    let unrouted: BTreeSet<String> = events
        .iter()
        .filter(|e| e.event_type == "Mystery")
        .map(|e| e.id.clone())
        .collect();
    let ids: BTreeSet<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, unrouted);
    assert_eq!(rows.len(), unrouted.len(), "one dead letter each");
    for r in &rows {
        assert!(r.get::<_, String>(1).starts_with("unrouted: "));
        assert_eq!(r.get::<_, Option<String>>(2), None);
    }

    let m = relay.metrics().await.unwrap();
    for (i, (name, _)) in ROUTES.iter().enumerate() {
        let n = m
            .value(
                "cdc_relay_endpoint_events_delivered_total",
                &[("endpoint", name)],
            )
            .unwrap();
        assert_eq!(n as usize, expected_at(i, &events).len(), "{name} metric");
    }
    assert_eq!(
        m.value(
            "cdc_relay_unrouted_events_total",
            &[("action", "dead_letter")]
        ),
        Some(unrouted.len() as f64)
    );
    assert!(
        m.value(
            "cdc_relay_endpoint_retries_total",
            &[("endpoint", "shipping"), ("reason", "http_5xx")]
        )
        .unwrap()
            > 0.0
    );
    drop(relay);
}

#[tokio::test]
async fn poison_names_its_endpoint_and_replays_there() {
    let stack = PgCluster::shared().create_stack().await.unwrap();
    app::relay_setup(&stack).await.unwrap();
    let sinks = vec![
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = routes_file(dir.path(), &sinks);
    let relay = start(&stack, &path).await;
    let db = stack.orders_admin().await.unwrap();
    // shipping refuses everything as poison (422) while this one event is
    // committed; billing takes it.
    sinks[1].set_status(422);
    let aggregate = oracle::expected::insert_order(&db).await.unwrap();
    let second = oracle::expected::insert_event(&db, aggregate, "OrderCreated", Some("{}"))
        .await
        .unwrap();
    oracle::settle(&db, &stack.slot).await.unwrap();
    drop(relay);
    let rows = db
        .query(
            "SELECT event_id, endpoint FROM cdc_relay_dead_letter WHERE event_id = $1",
            &[&second.id],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "shipping refused it once");
    assert_eq!(
        rows[0].get::<_, Option<String>>(1).as_deref(),
        Some("shipping")
    );
    assert!(
        sinks[0].delivered().iter().any(|r| r.id() == second.id),
        "billing took the event shipping refused"
    );

    let url = stack.relay_url.clone();
    let list = app::relay_command(
        &stack,
        &url,
        &["dead-letter", "list", "--json", "--endpoint", "billing"],
        &[],
    )
    .await
    .unwrap();
    assert!(list.success(), "{}", list.text());
    assert_eq!(list.stdout.trim(), "[]", "billing refused nothing");
    let text = app::relay_command(&stack, &url, &["dead-letter", "list"], &[])
        .await
        .unwrap();
    let row = text
        .stdout
        .lines()
        .find(|l| l.contains(&second.id))
        .unwrap_or_else(|| panic!("{}", text.text()));
    assert!(
        row.split_whitespace().any(|w| w == "shipping"),
        "the text list names the endpoint: {row}"
    );

    sinks[1].set_status(204);
    let before = sinks[1].count();
    let path_s = path.to_str().unwrap();
    let no_endpoint = app::relay_command(
        &stack,
        &url,
        &["dead-letter", "replay", "--all", "--routes", path_s],
        &SECRETS,
    )
    .await
    .unwrap();
    assert_eq!(no_endpoint.code(), Some(2), "{}", no_endpoint.text());
    assert!(
        no_endpoint.stderr.contains("--endpoint"),
        "{}",
        no_endpoint.text()
    );
    let replay = app::relay_command(
        &stack,
        &url,
        &[
            "dead-letter",
            "replay",
            "--all",
            "--endpoint",
            "shipping",
            "--routes",
            path_s,
        ],
        &SECRETS,
    )
    .await
    .unwrap();
    assert!(replay.success(), "{}", replay.text());
    let again = sinks[1].received_from(before);
    assert!(!again.is_empty(), "the replay went to shipping");
    assert!(again.iter().all(|r| r.signature_valid(SECRETS[1].1)));
    let left: i64 = db
        .query_one(
            "SELECT count(*) FROM cdc_relay_dead_letter WHERE endpoint = 'shipping'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "replayed rows are removed");
}

#[tokio::test]
async fn routes_check_prints_the_routing_and_refuses_a_bad_file() {
    let stack = PgCluster::shared().create_stack().await.unwrap();
    let sinks = vec![
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
        ScriptedSink::start().await.unwrap(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = routes_file(dir.path(), &sinks);
    // The last endpoint (audit) takes batches.
    let mut text = std::fs::read_to_string(&path).unwrap();
    text += "batch_max_events = 16\n";
    std::fs::write(&path, text).unwrap();
    let db = stack.orders_admin().await.unwrap();
    commit_events(&db, 5).await;
    let url = stack.orders_admin_url.clone();
    let path_s = path.to_str().unwrap();
    let out = app::relay_command(&stack, &url, &["routes", "check", path_s], &SECRETS)
        .await
        .unwrap();
    assert!(out.success(), "{}", out.text());
    let line = |ty: &str| {
        out.stdout
            .lines()
            .find(|l| l.trim_start().starts_with(ty))
            .unwrap_or_else(|| panic!("no line for {ty}:\n{}", out.stdout))
            .to_owned()
    };
    assert!(
        line("OrderCreated").ends_with("-> billing, shipping"),
        "{}",
        out.stdout
    );
    assert!(line("RefundIssued").ends_with("-> audit"), "{}", out.stdout);
    assert!(line("Mystery").contains("UNROUTED"), "{}", out.stdout);
    // Each endpoint says how its requests carry events.
    assert!(
        line("billing").ends_with("; one event per request"),
        "{}",
        out.stdout
    );
    assert!(
        line("audit").ends_with("; batches of up to 16 events and 48.0 KiB"),
        "{}",
        out.stdout
    );

    // A secret missing from the environment, an inline secret: exit 2,
    // naming the file, the endpoint and the key; `run` refuses alike.
    let missing = app::relay_command(&stack, &url, &["routes", "check", path_s], &[])
        .await
        .unwrap();
    assert_eq!(missing.code(), Some(2), "{}", missing.text());
    assert!(
        missing.stderr.contains(path_s)
            && missing.stderr.contains("endpoint \"billing\"")
            && missing.stderr.contains("secret_env"),
        "{}",
        missing.text()
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[endpoint]]\nname = \"x\"\nurl = \"http://127.0.0.1:1/\"\nevent_types = [\"*\"]\nsecret = \"whsec_abc\"\n",
    )
    .unwrap();
    let bad_s = bad.to_str().unwrap();
    for args in [
        vec!["routes", "check", bad_s],
        vec!["run", "--routes", bad_s],
    ] {
        let out = app::relay_command(&stack, &url, &args, &[]).await.unwrap();
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.text());
        assert!(
            out.stderr.contains(bad_s)
                && out.stderr.contains("endpoint \"x\"")
                && out.stderr.contains("`secret`"),
            "{args:?}: {}",
            out.text()
        );
    }

    // Settings valid alone but not over run's flags: `routes check`
    // refuses each as `run` does, naming the key. (check said "valid" and
    // run exited 2.)
    for (setting, key) in [
        ("poison_statuses = [500]", "poison_statuses"),
        (
            "backoff_base = \"5s\"\nbackoff_cap = \"1s\"",
            "backoff_base",
        ),
        ("request_timeout = \"10s\"", "request_timeout"),
    ] {
        let over = dir.path().join("over.toml");
        std::fs::write(
            &over,
            format!(
                "[[endpoint]]\nname = \"billing\"\nurl = \"http://127.0.0.1:1/\"\nevent_types = [\"*\"]\nsecret_env = \"ROUTE_SECRET_BILLING\"\n{setting}\n"
            ),
        )
        .unwrap();
        let over_s = over.to_str().unwrap();
        for args in [
            vec!["routes", "check", "--offline", over_s],
            vec!["run", "--routes", over_s],
        ] {
            let out = app::relay_command(&stack, &url, &args, &SECRETS)
                .await
                .unwrap();
            assert!(
                out.code() == Some(2) && out.stderr.contains(&format!("`{key}`")),
                "{setting}: {args:?}: {}",
                out.text()
            );
        }
    }
}
