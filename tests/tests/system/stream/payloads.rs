//! Payloads and event types that must reach the sink exactly as PostgreSQL
//! stored them: JSON shapes, numbers beyond f64, unicode, `json` columns,
//! SQL NULL, control characters, a 10 MB TOASTed value, and session
//! settings that must not change a byte.

use harness::oracle::{Expected, arrival_ids, body_id};
use harness::{Inbox, PgCluster, Scenario};

/// JSON shapes, unicode, huge numbers and deep nesting: `data` is the
/// payload's text exactly as PostgreSQL prints it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_are_sent_byte_identical_to_payload_text() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let deep_array = format!("{}1{}", "[".repeat(1000), "]".repeat(1000));
    let deep_object = format!("{}null{}", r#"{"a":"#.repeat(1000), "}".repeat(1000));
    let payloads: Vec<String> = [
        // Objects (key order and whitespace normalised by jsonb), arrays.
        r#"{"b": 1, "a": [1, 2, {"c": null}], "nested": {"x": "y", "aa": {}}}"#,
        r#"{ "spaced" :  [ 1 , 2 ] , "dup": 1, "dup": 2 }"#,
        "{}",
        "[]",
        r#"[1, "two", 3.0, null, true, false, [], {}]"#,
        // Scalars: strings, JSON null, booleans.
        r#""just a string""#,
        r#""quotes \" backslash \\ slash \/ controls \b\f\n\r\t \u0001 \u001f""#,
        "null",
        "true",
        "false",
        // Numbers beyond f64 and long decimals.
        "9007199254740993",
        "123456789012345678901234567890123456789012345678901234567890",
        "-9223372036854775809",
        "3.14159265358979323846264338327950288419716939937510582097494459230781640628",
        "0.000000000000000000000000000000000000001",
        "1.10000000000000000001",
        "1E+2",
        "1e400",
        "-0",
        "-0.0",
        r#"{"big": 18446744073709551617, "neg": -1.5e-300, "exact": 0.1}"#,
        // Unicode: combining marks, ZWJ emoji, U+2028/2029, BOM, astral,
        // escapes that jsonb decodes (and prints raw).
        "\"e\u{301} a\u{308}\u{323} \u{1F469}\u{200D}\u{1F469}\u{200D}\u{1F467}\u{200D}\u{1F466} \u{1F600}\"",
        "{\"ls\": \"a\u{2028}b\u{2029}c\", \"bom\": \"\u{FEFF}\", \"astral\": \"\u{1D11E}\u{10FFFD}\"}",
        r#"{"escaped": "\u2028 \u00e9 \ud83d\ude00 \u0000x"}"#,
        "{\"\u{1F600}key\": \"\u{05D0}\u{05D1} rtl \u{202E}override\"}",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([deep_array, deep_object])
    .collect();

    let mut expected = Vec::new();
    let mut rejected = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let agg = s.insert_order().await?;
        match s.insert_event(agg, "Shape", Some(p)).await {
            Ok(e) => expected.push(e),
            // jsonb refuses some inputs (\u0000); nothing to relay then.
            Err(err) => rejected.push(format!("#{i} {p:.40}: {err}")),
        }
    }
    assert_eq!(rejected.len(), 1, "only \\u0000 is refused: {rejected:?}");
    s.expect_exactly(&expected).await?;
    // The deep payloads really are 1,000 levels deep.
    let depth: i32 =
        s.db.query_one(
            "SELECT max(jsonb_array_length(payload #> array_fill('0'::text, ARRAY[999]))) \
             FROM outbox WHERE jsonb_typeof(payload) = 'array' AND payload::text LIKE '[[[%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(depth, 1);
    s.finish().await
}

/// A `json` (not `jsonb`) payload column keeps the text as written:
/// whitespace, key order, duplicate keys, `\u0000` escapes. The relay must
/// still send it verbatim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_typed_payload_is_sent_verbatim() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE json USING payload::json")
        .await?;
    let agg = s.insert_order().await?;
    let mut expected = Vec::new();
    for p in [
        "{ \"b\" : 1,\n\t\"a\":[ 1e400 , -0.0, 1.10000000000000000001 ], \"b\": 2 }",
        r#"{"nul": "\u0000", "esc": "\ud83d\ude00 \u2028", "solidus": "\/"}"#,
        "  [ ]  ",
        "\"e\u{301}\u{2028}\u{1F600}\"",
    ] {
        let row =
            s.db.query_one(
                "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), $1, 'Json', $2::text::json) \
                 RETURNING id::text, event_type, payload::text, aggregate_id::text",
                &[&agg, &p],
            )
            .await?;
        let e = Expected::from_row(&row);
        assert_eq!(e.payload.as_deref(), Some(p), "json keeps the text");
        expected.push(e);
    }
    s.expect_exactly(&expected).await?;
    s.finish().await
}

/// SQL NULL in the payload column is `"data":null`, never `""` or missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_null_payload_is_sent_as_json_null() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    s.db.batch_execute("ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL")
        .await?;
    let agg = s.insert_order().await?;
    let sql_null = s.insert_event(agg, "SqlNull", None).await?;
    assert_eq!(sql_null.payload, None);
    let json_null = s.insert_event(agg, "JsonNull", Some("null")).await?;
    let empty_string = s.insert_event(agg, "EmptyString", Some(r#""""#)).await?;
    // No aggregate key at all (NULL): delivered, just without an ordering key.
    s.db.batch_execute("ALTER TABLE outbox ALTER COLUMN aggregate_id DROP NOT NULL")
        .await?;
    let row =
        s.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), NULL, 'NoAggregate', NULL) RETURNING id::text",
            &[],
        )
        .await?;
    let no_aggregate = Expected {
        id: row.get(0),
        event_type: "NoAggregate".into(),
        payload: None,
        aggregate: String::new(),
    };
    let expected = [sql_null.clone(), json_null, empty_string, no_aggregate];
    s.expect_exactly(&expected).await?;
    let got = s
        .sink()
        .received()
        .into_iter()
        .find(|r| body_id(&r.body).as_deref() == Some(sql_null.id.as_str()))
        .expect("delivered");
    assert_eq!(
        std::str::from_utf8(&got.body)?,
        format!(r#"{{"id":"{}","type":"SqlNull","data":null}}"#, sql_null.id)
    );
    s.finish().await
}

/// Quotes, backslashes and control characters in `event_type`: the body is
/// valid JSON with exactly the three keys and `type` equal to the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_types_with_quotes_and_control_characters_are_escaped() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let all_controls: String = (1u8..0x20).chain([0x7f]).map(char::from).collect();
    let types = [
        r#"Order"Created"#.to_owned(),
        r#"back\slash\"#.to_owned(),
        "new\nline\r\nX-Injected: yes".to_owned(),
        "tab\there".to_owned(),
        all_controls,
        r#"","data":{"injected":true},"x":""#.to_owned(),
        r#"\u0000 \" not an escape"#.to_owned(),
        "</script><!--".to_owned(),
        "line\u{2028}sep\u{2029} e\u{301} \u{1F600}".to_owned(),
        String::new(),
        " ".repeat(3),
        // 100 KB of quotes, backslashes, newlines and control characters.
        "\"\\\n\u{1}x".repeat(20_000),
    ];
    let mut expected = Vec::new();
    for t in &types {
        let agg = s.insert_order().await?;
        expected.push(s.insert_event(agg, t, Some(r#"{"ok":true}"#)).await?);
    }
    s.expect_exactly(&expected).await?;
    for got in s.sink().received() {
        let v: serde_json::Value = serde_json::from_slice(&got.body)?;
        let obj = v.as_object().expect("a JSON object");
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["data", "id", "type"]);
        let id = obj["id"].as_str().expect("id is a string");
        let exp = expected.iter().find(|e| e.id == id).expect("known id");
        assert_eq!(obj["type"].as_str(), Some(exp.event_type.as_str()));
        assert_eq!(obj["data"], serde_json::json!({"ok": true}));
    }
    s.finish().await
}

/// A 10 MB incompressible payload (stored out of line in TOAST) arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_toasted_payload_arrives_whole() -> anyhow::Result<()> {
    let s = Scenario::start(Inbox::Scripted).await?;
    let agg = s.insert_order().await?;
    let before = s
        .insert_event(agg, "Small", Some(r#"{"before":true}"#))
        .await?;
    // 8,000,000 pseudo-random bytes as base64 (newlines removed): 10.7 MB
    // of text that pglz cannot shrink, so it is stored out of line as is.
    let row = s
        .db
        .query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), $1, 'Huge', jsonb_build_object( \
                        'blob', translate(encode(decode(string_agg(md5(random()::text), ''), 'hex'), 'base64'), E'\\n', ''), \
                        'n', 1) \
             FROM generate_series(1, 500000) \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    let huge = Expected::from_row(&row);
    let huge_len = huge.payload.as_ref().map_or(0, String::len);
    assert!(huge_len > 10 * 1024 * 1024, "payload is {huge_len} bytes");
    let stored: i32 =
        s.db.query_one(
            "SELECT pg_column_size(payload) FROM outbox WHERE id = $1::text::uuid",
            &[&huge.id],
        )
        .await?
        .get(0);
    assert!(
        stored > 10 * 1024 * 1024,
        "stored compressed: {stored} bytes"
    );
    let after = s
        .insert_event(agg, "Small", Some(r#"{"after":true}"#))
        .await?;
    s.expect_exactly(&[before, huge.clone(), after]).await?;
    let ids = arrival_ids(&s.sink().received());
    assert_eq!(ids[1], huge.id, "per-aggregate order around the huge event");
    s.finish().await
}

/// DateStyle, TimeZone, IntervalStyle and extra_float_digits set on the
/// orders database (and on the relay role in it) change nothing the relay
/// sends. Per-database settings, so nothing leaks into other tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_and_role_settings_do_not_change_bodies() -> anyhow::Result<()> {
    let stack = PgCluster::shared().create_stack().await?;
    {
        let admin = stack.orders_admin().await?;
        let db = &stack.orders_db;
        admin
            .batch_execute(&format!(
                "ALTER DATABASE {db} SET DateStyle = 'SQL, DMY'; \
                 ALTER DATABASE {db} SET TimeZone = 'Pacific/Chatham'; \
                 ALTER DATABASE {db} SET IntervalStyle = 'sql_standard'; \
                 ALTER DATABASE {db} SET extra_float_digits = -15; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET DateStyle = 'German, YMD'; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET TimeZone = 'Asia/Kathmandu'; \
                 ALTER ROLE cdc_relay IN DATABASE {db} SET bytea_output = 'escape'"
            ))
            .await?;
    }
    let s = Scenario::plan(Inbox::Scripted).on(stack).start().await?;
    let shown: String = s.db.query_one("SHOW TimeZone", &[]).await?.get(0);
    assert_eq!(
        shown, "Pacific/Chatham",
        "database settings apply to new sessions"
    );
    let agg = s.insert_order().await?;
    let mut expected = Vec::new();
    for payload in [
        r#"{"at": "2024-02-29T23:59:59.123456+00:00", "n": 12.50, "f": 0.1}"#,
        r#"[1.0, 1e-7, 100000000000000000000.000000000000000001]"#,
    ] {
        expected.push(s.insert_event(agg, "Settings", Some(payload)).await?);
    }
    // Values rendered by this session's settings into the payload.
    let row =
        s.db.query_one(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), $1, 'Rendered', jsonb_build_object( \
                 'ts', '2024-02-29 23:59:59.123456+00'::timestamptz, 'd', date '2024-03-05', \
                 'iv', interval '1 day 2:03:04', 'f8', 0.1::float8, 'now', now())) \
             RETURNING id::text, event_type, payload::text, aggregate_id::text",
            &[&agg],
        )
        .await?;
    expected.push(Expected::from_row(&row));
    assert!(
        expected[2]
            .payload
            .as_deref()
            .unwrap_or("")
            .contains("+13:45"),
        "{:?}",
        expected[2].payload
    );
    s.expect_exactly(&expected).await?;
    s.finish().await
}
