//! Secrets reloaded on SIGHUP, by the relay (`EVENT_SECRET_FILE`, a routes
//! file's references) and by Billing, and what SIGHUP does not apply.

use super::*;

/// A routes file's per-endpoint `secret_file` and `previous_secret_file`
/// are read again on SIGHUP, as `EVENT_SECRET_FILE` is: an event before the
/// rotation is signed with the old key, one after it with the new key and
/// the old one. Same process, same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_a_routes_files_secret_files() -> anyhow::Result<()> {
    let (stack, sink) = stack_and_sink().await?;
    app::relay_setup(&stack).await?;
    let dir = tempfile::tempdir()?;
    let (old, new) = (new_whsec(), new_whsec());
    let (old_key, new_key) = (whsec_key(&old), whsec_key(&new));
    let current = write(dir.path(), "current", &format!("{old}\n"))?;
    let previous = write(dir.path(), "previous", "")?;
    let routes = write(
        dir.path(),
        "routes.toml",
        &format!(
            "[[endpoint]]\nname = \"billing\"\nurl = {:?}\nevent_types = [\"*\"]\n\
             secret_file = {:?}\nprevious_secret_file = {:?}\n",
            sink.url,
            path_str(&current)?,
            path_str(&previous)?
        ),
    )?;
    let relay = app::start_relay_with_routes(&stack, &routes, &[], &[]).await?;
    app::wait_streaming(&relay).await?;
    let db = stack.orders_admin().await?;
    let before = wait_delivered(&sink, app::insert_order_event(&db).await?).await?;
    assert_eq!(signed_by(&before, &[&old_key, &new_key]), [vec![0], vec![]]);

    write(dir.path(), "current", &new)?;
    write(dir.path(), "previous", &old)?;
    relay.process.sighup();
    wait_reloads(&relay, "ok", 1.0).await?;
    let after = wait_delivered(&sink, app::insert_order_event(&db).await?).await?;
    assert_eq!(
        signed_by(&after, &[&new_key, &old_key]),
        [vec![0], vec![1]],
        "the new key first, then the previous one"
    );
    assert!(
        !relay.process.logs().contains("routes file changed"),
        "the file did not change: {}",
        relay.process.logs()
    );

    // The file edited (another URL) and SIGHUP sent to apply it: only the
    // secrets are reloaded, and the relay says so (it said "event secrets
    // reloaded" and nothing else: a tester's).
    let text = std::fs::read_to_string(&routes)?;
    std::fs::write(
        &routes,
        text.replace(&sink.url, "http://127.0.0.1:9/elsewhere"),
    )?;
    relay.process.sighup();
    let line = relay
        .process
        .wait_for_line(
            "the routes file changed since the start",
            std::time::Duration::from_secs(10),
        )
        .await?;
    assert!(line.contains("changed: billing"), "{line}");
    assert!(line.contains("restart the relay"), "{line}");
    wait_delivered(&sink, app::insert_order_event(&db).await?).await?;
    Ok(())
}

/// The rotation on the relay's side, mid-stream, by SIGHUP: a delivery in
/// flight at the reload finishes with the keys it started with (and is
/// delivered once), an event that was failing retries with the new keys (its
/// legacy signature too, though it was prepared before), and new events are
/// signed with the new key and the previous one; emptying the previous file
/// and SIGHUP ends the rotation. Same process, same session throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_the_relays_keys_mid_stream_without_a_restart_or_a_lost_delivery()
-> anyhow::Result<()> {
    let (stack, sink) = stack_and_sink().await?;
    let dir = tempfile::tempdir()?;
    let (old, new) = (new_whsec(), new_whsec());
    let (old_key, new_key) = (whsec_key(&old), whsec_key(&new));
    let current = write(dir.path(), "current", &format!("{old}\n"))?;
    let previous = write(dir.path(), "previous", "")?;
    let relay = relay(
        &stack,
        &sink,
        &[],
        &[
            ("EVENT_SECRET_FILE", path_str(&current)?),
            ("EVENT_SECRET_PREVIOUS_FILE", path_str(&previous)?),
        ],
    )
    .await?;
    let pid = relay.process.pid();
    let db = stack.orders_admin().await?;

    // In flight at the reload: held by the sink for 3 s.
    sink.set_delay(Duration::from_secs(3));
    let in_flight = app::insert_order_event(&db).await?;
    wait_until("the request in flight", WAIT, || async {
        sink.in_progress() == 1
    })
    .await?;
    // Failing at the reload (its first attempts wait on the held one: one
    // attempt at a time until the sink answers).
    let failing = Uuid::new_v4();
    sink.reject(&failing.to_string(), 503);
    app::insert_order_event_with_id(&db, failing).await?;
    // Both received (so prepared under the old keys) before the reload.
    wait_until("both events pending in the relay", WAIT, || async {
        relay
            .gauge("cdc_relay_pending_events")
            .await
            .map(|v| v == Some(2.0))
    })
    .await?;

    write(dir.path(), "current", &new)?;
    write(dir.path(), "previous", &old)?;
    relay.process.sighup();
    wait_reloads(&relay, "ok", 1.0).await?;
    sink.set_delay(Duration::ZERO);

    let held = wait_delivered(&sink, in_flight).await?;
    assert_eq!(requests_for(&sink, in_flight).len(), 1, "delivered once");
    assert_eq!(
        signed_by(&held, &[&old_key]),
        [vec![0]],
        "{:?}",
        held.webhook
    );
    assert_eq!(
        held.signature.as_deref(),
        Some(sign_key(&old_key, &held.body).as_str())
    );

    wait_until(
        "a refused attempt of the failing event after the reload",
        WAIT,
        || async {
            requests_for(&sink, failing)
                .iter()
                .any(|r| r.signature.as_deref() == Some(sign_key(&new_key, &r.body).as_str()))
        },
    )
    .await?;
    sink.clear_rejections();
    let retried = wait_delivered(&sink, failing).await?;
    assert_eq!(
        retried.signature.as_deref(),
        Some(sign_key(&new_key, &retried.body).as_str())
    );
    assert_eq!(
        signed_by(&retried, &[&new_key, &old_key]),
        [vec![0], vec![1]]
    );

    let after = app::insert_order_event(&db).await?;
    let r = wait_delivered(&sink, after).await?;
    assert_eq!(signed_by(&r, &[&new_key, &old_key]), [vec![0], vec![1]]);
    assert_eq!(
        r.signature.as_deref(),
        Some(sign_key(&new_key, &r.body).as_str())
    );

    // The rotation ends: the previous key is dropped.
    write(dir.path(), "previous", "")?;
    relay.process.sighup();
    wait_reloads(&relay, "ok", 2.0).await?;
    let last = app::insert_order_event(&db).await?;
    let r = wait_delivered(&sink, last).await?;
    let w = r.webhook.as_ref().context("webhook")?;
    assert_eq!(w.entries().count(), 1, "{}", w.signature);
    assert_eq!(r.standard_matches(&new_key), [0]);

    assert_eq!(relay.process.pid(), pid);
    assert_eq!(
        app::sessions(&relay),
        1,
        "one replication session throughout"
    );
    Ok(())
}

/// A secret file that does not load at a SIGHUP (here: too short) changes
/// nothing: the relay keeps signing with the keys in use, says why in its
/// log and counts the failed reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_that_does_not_load_on_sighup_leaves_the_keys_in_use() -> anyhow::Result<()> {
    let (stack, sink) = stack_and_sink().await?;
    let dir = tempfile::tempdir()?;
    let current = write(dir.path(), "current", TEST_SECRET)?;
    let relay = relay(
        &stack,
        &sink,
        &[],
        &[("EVENT_SECRET_FILE", path_str(&current)?)],
    )
    .await?;
    write(dir.path(), "current", "too-short")?;
    relay.process.sighup();
    wait_reloads(&relay, "error", 1.0).await?;
    let line = relay.process.wait_for_line("NOT reloaded", WAIT).await?;
    assert!(
        line.contains("EVENT_SECRET_FILE") && line.contains("9 bytes long"),
        "{line}"
    );
    assert!(
        !line.contains("too-short"),
        "the secret is not logged: {line}"
    );
    let id = app::insert_order_event(&stack.orders_admin().await?).await?;
    let r = wait_delivered(&sink, id).await?;
    assert!(r.signature_valid(TEST_SECRET));
    assert_eq!(r.standard_matches(TEST_SECRET.as_bytes()), [0]);
    assert_eq!(reloads(&relay, "ok").await?, 0.0);
    Ok(())
}

/// Billing's side of a rotation by SIGHUP: the new secret and the previous
/// one are both accepted after the reload, the previous one no longer once
/// its file is emptied, and a file that does not load leaves the keys in
/// use. Same process throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_reloads_its_secrets_on_sighup() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    let dir = tempfile::tempdir()?;
    let (old, new) = (TEST_SECRET, PLAIN);
    let current = write(dir.path(), "current", old)?;
    let previous = write(dir.path(), "previous", "")?;
    let billing = app::start_billing_with(
        &stack,
        &[],
        &[
            ("EVENT_SECRET_FILE", path_str(&current)?),
            ("EVENT_SECRET_PREVIOUS_FILE", path_str(&previous)?),
            ("RUST_LOG", "info"),
        ],
    )
    .await?;
    let pid = billing.process.pid();
    let http = reqwest::Client::new();
    let post = |secret: &'static str| {
        let body = serde_json::json!({
            "id": Uuid::new_v4(), "type": "OrderCreated",
            "data": {"order_id": Uuid::new_v4(), "amount_cents": 100, "currency": "EUR"}
        })
        .to_string();
        http.post(billing.inbox())
            .header("content-type", "application/json")
            .header("x-event-signature", sign(secret, body.as_bytes()))
            .body(body)
            .send()
    };
    let reloaded = |result: &'static str, n: f64| {
        let billing = &billing;
        async move {
            wait_until("Billing's reload counter", WAIT, || async {
                billing.metrics().await.map(|m| {
                    m.value("billing_secret_reloads_total", &[("result", result)]) == Some(n)
                })
            })
            .await
        }
    };
    assert_eq!(post(old).await?.status(), StatusCode::NO_CONTENT);
    assert_eq!(post(new).await?.status(), StatusCode::UNAUTHORIZED);

    write(dir.path(), "current", new)?;
    write(dir.path(), "previous", old)?;
    billing.process.sighup();
    reloaded("ok", 1.0).await?;
    assert_eq!(post(new).await?.status(), StatusCode::NO_CONTENT);
    assert_eq!(post(old).await?.status(), StatusCode::NO_CONTENT);

    write(dir.path(), "previous", "\n")?;
    billing.process.sighup();
    reloaded("ok", 2.0).await?;
    assert_eq!(post(new).await?.status(), StatusCode::NO_CONTENT);
    assert_eq!(post(old).await?.status(), StatusCode::UNAUTHORIZED);

    write(dir.path(), "current", &format!("{new},{old}"))?;
    billing.process.sighup();
    reloaded("error", 1.0).await?;
    let line = billing.process.wait_for_line("NOT reloaded", WAIT).await?;
    assert!(
        line.contains("EVENT_SECRET_FILE") && line.contains("contains a comma"),
        "{line}"
    );
    assert_eq!(post(new).await?.status(), StatusCode::NO_CONTENT);
    assert_eq!(billing.process.pid(), pid);
    Ok(())
}
