//! End-to-end tests of `delayd run` as a RabbitMQ sidecar, against the real
//! broker at 127.0.0.1:5672 (guest/guest; override with `AMQP_URL`).
//!
//! Each test starts the delayd binary as a child process with a route of its
//! own (see `common`), publishes to the route's source exchange with a plain
//! lapin client and reads the target exchange through a queue bound to it.
//! "Never early" is checked in whole wall-clock milliseconds: a message
//! published at `sent_ms` with an `x-delay` of `d` must not be received before
//! `sent_ms + d` (delayd measures the delay from its own, later, arrival time).
//!
//! Run with `cargo test --test rabbitmq_sidecar -- --test-threads=2`.

use crate::common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    assert_confirmed, delayd_command, now_ms, seeded, toml_string, wait_for, Client, Delayd,
    DelaydOptions, Names, Received, Setup, DEADLINE, LATE_MS,
};
use lapin::options::QueueDeleteOptions;
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use lapin::BasicProperties;

/// Routing key of every test message; delayd must keep it.
const ROUTING_KEY: &str = "order.created.eu";

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (key, value) in entries {
        t.insert(ShortString::from(key), value);
    }
    t
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Headers of `props` without `key`.
fn headers_without(props: &BasicProperties, key: &str) -> FieldTable {
    let mut t = FieldTable::default();
    if let Some(headers) = props.headers() {
        for (k, v) in headers {
            if k.as_str() != key {
                t.insert(k.clone(), v.clone());
            }
        }
    }
    t
}

/// Asserts `x-delayd-id` is a long string of 32 hex digits (128 bits), and
/// returns it.
fn assert_delayd_id(received: &Received) -> u128 {
    let id = received
        .header_text("x-delayd-id")
        .unwrap_or_else(|| panic!("no long-string x-delayd-id in {:?}", received.properties()));
    assert_eq!(id.len(), 32, "x-delayd-id {id:?} is not 32 hex digits");
    u128::from_str_radix(&id, 16).unwrap_or_else(|e| panic!("x-delayd-id {id:?} is not hex: {e}"))
}

/// Like [`setup`], with an invalid queue of the test's own (so tests running
/// side by side never read each other's invalid messages). Returns its name.
async fn with_own_invalid_queue(test: &str, mut opts: DelaydOptions) -> (Setup, String) {
    let names = Names::new(test);
    let invalid = format!("{}.invalid", names.from_queue);
    opts.route_extra.push_str(&format!(
        "invalid = {{ queue = {} }}\n",
        common::toml_string(&invalid)
    ));
    (Setup::start(names, &[&invalid], opts).await, invalid)
}

/// An unroutable queue of the test's own (tests running side by side never
/// read each other's parked messages), named after its source queue.
fn own_unroutable_queue(names: &Names) -> String {
    format!("{}.unroutable", names.from_queue)
}

/// Default options with the route's unroutable destination set to `queue`.
fn with_unroutable_queue(queue: &str) -> DelaydOptions {
    DelaydOptions {
        route_extra: format!("unroutable = {{ queue = {} }}\n", toml_string(queue)),
        ..DelaydOptions::default()
    }
}

/// The message `id` parked in `queue` (read once the queue exists), with
/// its `x-delayd-error`.
async fn parked(client: &Client, queue: &str, id: &str) -> (Received, String) {
    wait_for("the parking queue to exist", DEADLINE, || async {
        client.queue_counts(queue).await
    })
    .await;
    let mut receiver = client.consume(queue).await;
    let mut found = receiver.collect_by_message_id(&[id]).await;
    receiver.close().await;
    let received = found.remove(0);
    let error = received
        .header_text("x-delayd-error")
        .unwrap_or_else(|| panic!("no x-delayd-error in {:?}", received.properties()));
    (received, error)
}

/// A test's route with its target queue declared, and delayd consuming.
async fn setup(test: &str, opts: DelaydOptions) -> Setup {
    Setup::start(Names::new(test), &[], opts).await
}

// ----------------------------------------------------------------- 1. delays

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_x_delay_type_arrives_after_its_delay() {
    let s = setup("types", DelaydOptions::default()).await;
    // (case, x-delay header, whole ms delayd must wait)
    let cases: Vec<(&str, Option<AMQPValue>, u64)> = vec![
        ("short-short-int", Some(AMQPValue::ShortShortInt(120)), 120),
        (
            "short-short-uint",
            Some(AMQPValue::ShortShortUInt(250)),
            250,
        ),
        ("short-int", Some(AMQPValue::ShortInt(700)), 700),
        ("short-uint", Some(AMQPValue::ShortUInt(800)), 800),
        ("long-int", Some(AMQPValue::LongInt(900)), 900),
        ("long-uint", Some(AMQPValue::LongUInt(1000)), 1000),
        ("long-long-int", Some(AMQPValue::LongLongInt(1100)), 1100),
        ("float", Some(AMQPValue::Float(1200.75)), 1200),
        ("double", Some(AMQPValue::Double(1300.9)), 1300),
        ("numeric-string", Some(long_string("300")), 300),
        ("float-string", Some(long_string("250.9")), 250),
        (
            "decimal",
            Some(AMQPValue::DecimalValue(lapin::types::DecimalValue {
                scale: 1,
                value: 4005,
            })),
            400,
        ),
        (
            "byte-array",
            Some(AMQPValue::ByteArray(lapin::types::ByteArray::from(
                b"450".to_vec(),
            ))),
            450,
        ),
        ("absent", None, 0),
        ("zero", Some(AMQPValue::LongInt(0)), 0),
        ("negative", Some(AMQPValue::LongInt(-500)), 0),
    ];

    let mut sent_ms = BTreeMap::new();
    for (case, delay, _) in &cases {
        let headers = match delay {
            Some(v) => table(vec![("x-delay", v.clone())]),
            None => FieldTable::default(),
        };
        let props = BasicProperties::default()
            .with_message_id((*case).into())
            .with_headers(headers);
        sent_ms.insert(*case, now_ms());
        s.client
            .publish(&s.names.from_exchange, ROUTING_KEY, case.as_bytes(), props)
            .await;
    }

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let mut arrived: BTreeMap<String, Received> = BTreeMap::new();
    while arrived.len() < cases.len() {
        let received = receiver
            .next(Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|| {
                panic!(
                    "only {:?} of {} messages arrived within {DEADLINE:?}",
                    arrived.keys().collect::<Vec<_>>(),
                    cases.len()
                )
            });
        let id = received
            .message_id()
            .expect("every test message has a message_id")
            .to_owned();
        assert!(
            !arrived.contains_key(&id),
            "{id} arrived twice (no restart happened)"
        );
        arrived.insert(id, received);
    }

    for (case, delay, wait_ms) in &cases {
        let received = &arrived[*case];
        let due = sent_ms[case] + wait_ms;
        assert!(
            received.at_ms >= due,
            "{case}: received at {} ms, {} ms before its due time {due}",
            received.at_ms,
            due - received.at_ms
        );
        // Generous on a noisy 2-core machine, but finite: a regression that
        // made every delivery seconds late fails here.
        assert!(
            received.at_ms < due + LATE_MS,
            "{case}: received {} ms after its due time",
            received.at_ms - due
        );
        assert_eq!(received.delivery.data, case.as_bytes(), "{case}: body");
        assert_eq!(
            received.delivery.routing_key.as_str(),
            ROUTING_KEY,
            "{case}: routing key"
        );
        assert_delayd_id(received);
        let egress_delay = received.header("x-delay");
        match delay {
            None => assert_eq!(egress_delay, None, "{case}: x-delay must stay absent"),
            Some(_) if *wait_ms > 0 => assert_eq!(
                egress_delay,
                Some(&AMQPValue::LongInt(-(*wait_ms as i32))),
                "{case}: x-delay must be negated"
            ),
            // Only a positive delay is negated: 0 and negative values leave
            // exactly as they came, type included.
            Some(sent) => assert_eq!(
                egress_delay,
                Some(sent),
                "{case}: x-delay must stay unchanged"
            ),
        }
    }
    receiver.close().await;
    s.client.close().await;
}

/// An AMQP timestamp (what Java's `Date` and pika's `datetime` headers
/// become) in `x-deliver-at` is epoch seconds: the message waits for that
/// second, not a moment in 1970.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_timestamp_is_epoch_seconds() {
    let s = setup("deliver-at-ts", DelaydOptions::default()).await;
    let at_s = now_ms() / 1000 + 3;
    let props = BasicProperties::default()
        .with_message_id("deliver-at-ts".into())
        .with_headers(table(vec![("x-deliver-at", AMQPValue::Timestamp(at_s))]));
    s.client
        .publish(&s.names.from_exchange, ROUTING_KEY, b"at", props)
        .await;

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let received = receiver
        .next(Instant::now() + DEADLINE)
        .await
        .expect("the message arrives");
    receiver.close().await;
    let due = at_s * 1000;
    assert!(
        received.at_ms >= due,
        "received at {} ms, {} ms before its x-deliver-at second",
        received.at_ms,
        due - received.at_ms
    );
    assert!(
        received.at_ms < due + 5000,
        "received {} ms after its x-deliver-at second",
        received.at_ms - due
    );
    assert_eq!(received.delivery.data, b"at");
    s.client.close().await;
}

/// `x-deliver-at` in each form a producer sends: epoch ms, RFC 3339 text,
/// in the past (at once), and together with an `x-delay` it wins over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_in_every_form_and_over_x_delay() {
    let s = setup("deliver-at-forms", DelaydOptions::default()).await;
    let now = now_ms();
    let rfc3339 = |ms: u64| {
        chrono::DateTime::from_timestamp_millis(ms as i64)
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    };
    // (case, headers, due time in epoch ms, x-delay on the way out)
    let cases: Vec<(&str, FieldTable, u64, Option<AMQPValue>)> = vec![
        (
            "epoch-ms",
            table(vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt((now + 1500) as i64),
            )]),
            now + 1500,
            None,
        ),
        (
            "rfc3339",
            table(vec![("x-deliver-at", long_string(&rfc3339(now + 1700)))]),
            now + 1700,
            None,
        ),
        (
            "past",
            table(vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt((now - 10_000) as i64),
            )]),
            now,
            None,
        ),
        (
            // x-deliver-at sets the due time; the x-delay it overrode is
            // still negated on the way out, as every positive x-delay is.
            "wins-over-x-delay",
            table(vec![
                ("x-delay", AMQPValue::LongInt(60_000)),
                ("x-deliver-at", AMQPValue::LongLongInt((now + 1200) as i64)),
            ]),
            now + 1200,
            Some(AMQPValue::LongInt(-60_000)),
        ),
    ];
    for (case, headers, _, _) in &cases {
        let props = BasicProperties::default()
            .with_message_id((*case).into())
            .with_headers(headers.clone());
        s.client
            .publish(&s.names.from_exchange, ROUTING_KEY, case.as_bytes(), props)
            .await;
    }
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let ids: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let found = receiver.collect_by_message_id(&ids).await;
    receiver.close().await;
    for (case, _, due, x_delay) in &cases {
        let received = found
            .iter()
            .find(|r| r.message_id() == Some(case))
            .expect("collected");
        assert!(
            received.at_ms >= *due,
            "{case}: {} ms early",
            due - received.at_ms
        );
        assert!(
            received.at_ms < due + LATE_MS,
            "{case}: {} ms late",
            received.at_ms - due
        );
        assert_eq!(received.delivery.data, case.as_bytes());
        assert_eq!(
            received.header("x-delay"),
            x_delay.as_ref(),
            "{case}: outgoing x-delay"
        );
    }
    s.client.close().await;
}

// ------------------------------------------------------ 2. byte-equal egress

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_properties_and_headers_arrive_byte_equal() {
    let s = setup("byte-equal", DelaydOptions::default()).await;
    const DELAY: i32 = 400;
    let nested_table = table(vec![
        ("inner-int", AMQPValue::LongInt(-7)),
        ("inner-string", long_string("ünïcödé")),
        (
            "inner-table",
            AMQPValue::FieldTable(table(vec![("deep", AMQPValue::Boolean(false))])),
        ),
    ]);
    let headers = table(vec![
        ("bool", AMQPValue::Boolean(true)),
        ("i8", AMQPValue::ShortShortInt(-128)),
        ("u8", AMQPValue::ShortShortUInt(255)),
        ("i16", AMQPValue::ShortInt(-32768)),
        ("u16", AMQPValue::ShortUInt(65535)),
        ("i32", AMQPValue::LongInt(i32::MIN)),
        ("u32", AMQPValue::LongUInt(u32::MAX)),
        ("i64", AMQPValue::LongLongInt(i64::MIN)),
        ("f32", AMQPValue::Float(-1.5e-3)),
        ("f64", AMQPValue::Double(std::f64::consts::PI)),
        (
            "decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 3,
                value: 1_234_567,
            }),
        ),
        ("utf8", long_string("héllo, wörld")),
        (
            "non-utf8",
            AMQPValue::LongString(LongString::from(vec![0xff, 0xfe, 0x00, 0x80, b'a'])),
        ),
        ("empty", long_string("")),
        (
            "array",
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::LongInt(1),
                long_string("two"),
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(true)])),
                AMQPValue::FieldTable(table(vec![("k", AMQPValue::Double(0.25))])),
                AMQPValue::Void,
            ])),
        ),
        ("table", AMQPValue::FieldTable(nested_table)),
        ("timestamp", AMQPValue::Timestamp(1_700_000_000)),
        (
            "bytes",
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 2, 254, 255])),
        ),
        ("void", AMQPValue::Void),
        ("x-delay", AMQPValue::LongInt(DELAY)),
    ]);
    let sent = BasicProperties::default()
        .with_content_type("application/octet-stream".into())
        .with_content_encoding("identity".into())
        .with_headers(headers.clone())
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr-42".into())
        .with_reply_to("replies.here".into())
        .with_message_id("byte-equal-1".into())
        .with_timestamp(1_700_000_123)
        .with_type("order.created".into())
        .with_user_id("guest".into())
        .with_app_id("delayd-it".into())
        .with_cluster_id("cluster-x".into());
    let body: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();

    // Consuming before publishing: the receive time is the arrival time.
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let sent_ms = now_ms();
    s.client
        .publish(&s.names.from_exchange, ROUTING_KEY, &body, sent.clone())
        .await;
    let received = receiver.expect("the delayed message").await;

    assert!(
        received.at_ms >= sent_ms + DELAY as u64,
        "received {} ms early",
        sent_ms + DELAY as u64 - received.at_ms
    );
    assert!(
        received.at_ms < sent_ms + DELAY as u64 + LATE_MS,
        "received {} ms after its due time",
        received.at_ms - (sent_ms + DELAY as u64)
    );
    assert_eq!(received.delivery.data, body, "body must be byte-equal");
    assert_eq!(received.delivery.routing_key.as_str(), ROUTING_KEY);
    assert_eq!(
        received.delivery.exchange.as_str(),
        s.names.to_exchange,
        "republished to to.exchange"
    );
    assert_delayd_id(&received);

    let mut expected_headers = headers;
    expected_headers.insert("x-delay".into(), AMQPValue::LongInt(-DELAY));
    let expected = sent.with_headers(expected_headers);
    let mut actual = received
        .properties()
        .clone()
        .with_headers(headers_without(received.properties(), "x-delayd-id"));
    // A broker with the set_header_timestamp interceptor (the 4.3 test
    // broker, scripts/rabbitmq/delayd.conf) adds its `timestamp_in_ms`
    // header to the producer's message; with `overwrite = false` it keeps
    // the producer's `timestamp` property, which must arrive unchanged.
    if actual
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key("timestamp_in_ms"))
    {
        let headers = headers_without(&actual, "timestamp_in_ms");
        actual = actual.with_headers(headers);
    }
    assert_eq!(
        actual.timestamp(),
        expected.timestamp(),
        "the producer's timestamp property (a broker with set_header_timestamp.overwrite = true replaces it: restart the test broker, scripts/rabbitmq.sh restart)"
    );
    assert_eq!(
        actual, expected,
        "properties and headers (x-delay negated, x-delayd-id aside)"
    );
    receiver.close().await;
    s.client.close().await;
}

/// Unlike the plugin, which fires at once any `x-delay` above 2^32-1 ms,
/// delayd keeps it, due that long after arrival (seen through the admin
/// API's `due_ms`); a delay above the route's `max_delay` goes to the
/// invalid queue saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delays_past_32_bits_are_kept_and_past_max_delay_refused() {
    let opts = DelaydOptions {
        route_extra: "max_delay = \"400d\"\n".into(),
        ..DelaydOptions::default()
    };
    let (s, invalid) = with_own_invalid_queue("long-delays", opts).await;
    let suffix = common::unique_suffix();
    let long_id = format!("long.{suffix}");
    let too_long_id = format!("too-long.{suffix}");
    const LONG: i64 = (1 << 32) + 5_000; // 49.7 days and 5 s
    const TOO_LONG: i64 = 401 * 86_400_000;
    let sent_ms = now_ms();
    for (id, delay) in [(&long_id, LONG), (&too_long_id, TOO_LONG)] {
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(table(vec![("x-delay", AMQPValue::LongLongInt(delay))]));
        s.client
            .publish(&s.names.from_exchange, ROUTING_KEY, b"later", props)
            .await;
    }
    let (_, error) = parked(&s.client, &invalid, &too_long_id).await;
    assert!(error.contains("max_delay"), "x-delayd-error {error:?}");

    let path = format!("/v1/messages?route={}&message_id={long_id}", s.names.route);
    let items = wait_for("the long delay to be listed", DEADLINE, || async {
        let (status, page) = s.delayd.api("GET", &path, None);
        let items = page["items"].as_array().cloned().unwrap_or_default();
        (status == 200 && !items.is_empty()).then_some(items)
    })
    .await;
    let listed_at = now_ms();
    let due = items[0]["due_ms"].as_u64().expect("due_ms");
    assert!(
        due >= sent_ms + LONG as u64 && due <= listed_at + LONG as u64,
        "due_ms {due} is not {LONG} ms after arrival (sent at {sent_ms})"
    );
    assert_eq!(s.delayd.pending(), 1, "only the long delay waits");
    s.client.close().await;
}

// ----------------------------------------------------------- 3. bad delays

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_delay_goes_to_invalid_queue_with_reason() {
    let (s, invalid) = with_own_invalid_queue("invalid", DelaydOptions::default()).await;
    let suffix = common::unique_suffix();
    let text_id = format!("invalid-text.{suffix}");
    let bool_id = format!("invalid-bool.{suffix}");
    // A timestamp is a point in time, not a delay (x-deliver-at takes it).
    let timestamp_id = format!("invalid-timestamp.{suffix}");
    let cases = [
        (text_id.as_str(), long_string("soon"), "\"soon\""),
        (bool_id.as_str(), AMQPValue::Boolean(true), "boolean"),
        (
            timestamp_id.as_str(),
            AMQPValue::Timestamp(now_ms() / 1000 + 3600),
            "timestamp",
        ),
    ];
    for (id, delay, _) in &cases {
        let props = BasicProperties::default()
            .with_message_id((*id).into())
            .with_content_type("text/plain".into())
            .with_headers(table(vec![
                ("x-delay", delay.clone()),
                ("keep", long_string("me")),
            ]));
        s.client
            .publish(&s.names.from_exchange, ROUTING_KEY, id.as_bytes(), props)
            .await;
    }

    // delayd declares the queue when it parks the first invalid message.
    wait_for("the invalid queue to exist", DEADLINE, || async {
        s.client.queue_counts(&invalid).await
    })
    .await;
    let mut receiver = s.client.consume(&invalid).await;
    let found = receiver
        .collect_by_message_id(&[text_id.as_str(), bool_id.as_str(), timestamp_id.as_str()])
        .await;
    receiver.close().await;

    for (id, delay, reason_mentions) in &cases {
        let received = found
            .iter()
            .find(|r| r.message_id() == Some(*id))
            .expect("collected above");
        let error = received
            .header_text("x-delayd-error")
            .unwrap_or_else(|| panic!("{id}: no x-delayd-error in {:?}", received.properties()));
        assert!(
            error.contains("x-delay") && error.contains(reason_mentions),
            "{id}: x-delayd-error {error:?} should name x-delay and {reason_mentions}"
        );
        assert_eq!(
            received.delivery.data,
            id.as_bytes(),
            "{id}: body unchanged"
        );
        assert_eq!(
            received.header("x-delay"),
            Some(delay),
            "{id}: x-delay kept"
        );
        assert_eq!(
            received.header_text("keep").as_deref(),
            Some("me"),
            "{id}: other headers kept"
        );
        assert_eq!(
            received
                .properties()
                .content_type()
                .as_ref()
                .map(ShortString::as_str),
            Some("text/plain"),
            "{id}: properties kept"
        );
    }
    // Nothing reached the target.
    assert_eq!(
        s.client.queue_counts(&s.names.target_queue).await,
        Some((0, 0)),
        "an invalid message reached the target queue"
    );
    s.client.close().await;
}

/// delayd declares its invalid queue once, not per message; if the queue is
/// deleted while delayd runs, the next invalid message is not lost: the
/// publish comes back unroutable, and delayd declares the queue again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_queue_deleted_while_running_is_declared_again() {
    let names = Names::new("invalid-redeclare");
    let invalid = format!("{}.invalid", names.target_queue);
    let opts = DelaydOptions {
        route_extra: format!("invalid = {{ queue = {} }}", toml_string(&invalid)),
        ..DelaydOptions::default()
    };
    let s = Setup::start(names, &[&invalid], opts).await;
    let bad = |id: &str| {
        BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(table(vec![("x-delay", long_string("later"))]))
    };
    let holds_one = || async {
        s.client
            .queue_counts(&invalid)
            .await
            .is_some_and(|(ready, _)| ready == 1)
            .then_some(())
    };

    s.client
        .publish(&s.names.from_exchange, ROUTING_KEY, b"first", bad("first"))
        .await;
    wait_for("the first invalid message", DEADLINE, holds_one).await;
    s.client
        .channel
        .queue_delete(invalid.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("queue.delete");

    s.client
        .publish(
            &s.names.from_exchange,
            ROUTING_KEY,
            b"second",
            bad("second"),
        )
        .await;
    wait_for(
        "the second invalid message, in the declared-again queue",
        DEADLINE,
        holds_one,
    )
    .await;
    let mut receiver = s.client.consume(&invalid).await;
    let found = receiver.collect_by_message_id(&["second"]).await;
    receiver.close().await;
    assert_eq!(found[0].delivery.data, b"second");
    assert_eq!(s.delayd.pending(), 0);
    s.client.close().await;
}

/// A message over `wal.max_message_bytes` is not stored: it goes to the
/// invalid queue, unchanged, with the reason, and is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_message_goes_to_invalid_queue() {
    let opts = DelaydOptions {
        max_message_bytes: 4096,
        ..DelaydOptions::default()
    };
    let (s, invalid) = with_own_invalid_queue("oversized", opts).await;
    let id = format!("oversized.{}", common::unique_suffix());
    let body: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let props = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_headers(table(vec![("x-delay", AMQPValue::LongInt(100))]));
    s.client
        .publish(&s.names.from_exchange, ROUTING_KEY, &body, props)
        .await;
    wait_for("the invalid queue to exist", DEADLINE, || async {
        s.client.queue_counts(&invalid).await
    })
    .await;
    let mut receiver = s.client.consume(&invalid).await;
    let found = receiver.collect_by_message_id(&[id.as_str()]).await;
    receiver.close().await;
    let received = &found[0];
    let error = received
        .header_text("x-delayd-error")
        .expect("x-delayd-error on the oversized message");
    assert!(error.contains("max_message_bytes"), "{error}");
    assert_eq!(received.delivery.data, body, "body unchanged");
    assert_eq!(
        s.client.queue_counts(&s.names.target_queue).await,
        Some((0, 0)),
        "the oversized message reached the target"
    );
    s.client.close().await;
}

// -------------------------------------------------------------- 4. unroutable

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_goes_to_unroutable_queue() {
    let names = Names::new("unroutable");
    let unroutable = own_unroutable_queue(&names);
    let mut cleanup = names.cleanup();
    cleanup.queues.push(unroutable.clone());
    let client = Client::connect("delayd-it-unroutable").await;
    // The target exchange exists, but no queue is bound to it.
    client.declare_exchange(&names.to_exchange).await;
    let _delayd = Delayd::start(&names, with_unroutable_queue(&unroutable)).await;

    let id = format!("unroutable.{}", common::unique_suffix());
    let props = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_headers(table(vec![("x-delay", AMQPValue::LongInt(200))]));
    client
        .publish(&names.from_exchange, ROUTING_KEY, b"nobody listens", props)
        .await;

    let (received, error) = parked(&client, &unroutable, &id).await;
    assert!(
        error.contains("unroutable") && error.contains(&names.to_exchange),
        "x-delayd-error {error:?} should say unroutable and name {}",
        names.to_exchange
    );
    assert_eq!(received.delivery.data, b"nobody listens", "body unchanged");
    client.close().await;
}

/// A target exchange that does not exist (a typo, a deploy not done yet):
/// the sink reports it as an unknown target, delayd retries a few times
/// with back-off (it may appear), then parks the message in the route's
/// unroutable queue with the broker's reason, body unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_target_exchange_is_parked_after_a_few_tries() {
    let names = Names::new("no-target");
    let _cleanup = names.cleanup();
    let unroutable = format!("{}.unroutable", names.from_queue);
    let client = Client::connect("delayd-it-no-target").await;
    // The queue exists so it can be read; the target exchange never does.
    client
        .declare_bound_queue(
            &unroutable,
            FieldTable::default(),
            "amq.direct",
            &unroutable,
        )
        .await;
    let opts = DelaydOptions {
        route_extra: format!(
            "unroutable = {{ queue = {} }}\n",
            common::toml_string(&unroutable)
        ),
        ..DelaydOptions::default()
    };
    let delayd = Delayd::start(&names, opts).await;
    let id = format!("no-target.{}", common::unique_suffix());
    let props = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_headers(table(vec![("x-delay", AMQPValue::LongInt(100))]));
    client
        .publish(&names.from_exchange, ROUTING_KEY, b"to nowhere", props)
        .await;

    let (received, error) = parked(&client, &unroutable, &id).await;
    assert!(
        error.contains("unknown target") && error.contains(&names.to_exchange),
        "x-delayd-error {error:?} should say unknown target and name {}",
        names.to_exchange
    );
    assert_eq!(received.delivery.data, b"to nowhere", "body unchanged");
    // It was tried again before being parked (the exchange might appear).
    let retries = delayd.metric("delayd_publish_retries_total");
    assert!(retries >= 5.0, "parked after {retries} retries");
    client.close().await;
}

/// A republish the broker refuses for good is parked, not retried forever
/// (every try cost a channel). Here the producer logs in as another user and
/// sets `user_id` to it, as RabbitMQ requires; delayd republishes as guest,
/// so the broker answers 406 PRECONDITION_FAILED. The message lands in the
/// unroutable queue with the broker's reason, body unchanged, and `user_id`
/// kept in a header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_broker_refuses_is_parked_with_its_reason() {
    const USER: &str = "delayd-it-producer";
    const PASSWORD: &str = "delayd-it-producer";
    let rabbitmqctl = |args: &[&str]| {
        std::process::Command::new("rabbitmqctl")
            .args(args)
            .output()
            .expect("rabbitmqctl")
    };
    // add_user fails if the user exists (an earlier run): then it is there.
    rabbitmqctl(&["add_user", USER, PASSWORD]);
    let perms = rabbitmqctl(&["set_permissions", "-p", "/", USER, ".*", ".*", ".*"]);
    assert!(perms.status.success(), "set_permissions: {perms:?}");

    let names = Names::new("refused");
    let unroutable = own_unroutable_queue(&names);
    let mut cleanup = names.cleanup();
    cleanup.queues.push(unroutable.clone());
    let client = Client::connect("delayd-it-refused").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let delayd = Delayd::start(&names, with_unroutable_queue(&unroutable)).await;
    let producer = Client::connect_as("delayd-it-refused-producer", USER, PASSWORD).await;
    let id = format!("refused.{}", common::unique_suffix());
    let props = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_user_id(USER.into())
        .with_headers(table(vec![("x-delay", AMQPValue::LongInt(200))]));
    producer
        .publish(&names.from_exchange, ROUTING_KEY, b"refused body", props)
        .await;

    let (received, error) = parked(&client, &unroutable, &id).await;
    assert!(
        error.contains("PRECONDITION_FAILED"),
        "x-delayd-error {error:?}"
    );
    assert_eq!(
        received.header_text("x-delayd-user-id").as_deref(),
        Some(USER)
    );
    assert_eq!(received.delivery.data, b"refused body", "body unchanged");
    wait_for("nothing pending", DEADLINE, || async {
        (delayd.pending() == 0).then_some(())
    })
    .await;
    producer.close().await;
    client.close().await;
}

// ------------------------------------------------------------ load helpers

/// The `x-delay` of load message `seq`: 1 to 4 s, spread over the range.
fn load_delay_ms(seq: usize) -> u64 {
    1000 + (seq as u64 * 7919) % 3001
}

/// How a load publisher paces itself.
struct Load {
    exchange: String,
    total: usize,
    /// Messages per tick.
    batch: usize,
    interval: Duration,
    /// Published (and confirmed) so far.
    published: Arc<AtomicUsize>,
    /// While `hold` is set, publishing pauses once `hold_at` messages are
    /// out, so a disruption is sure to happen mid-stream.
    hold_at: usize,
    hold: Arc<AtomicBool>,
}

/// Publishes `total` messages (header `seq`, x-delay [`load_delay_ms`]) at
/// a steady rate, in batches of `batch` every `interval`, waiting for each
/// batch's confirms. Returns each message's send time (ms).
fn spawn_publisher(load: Load) -> tokio::task::JoinHandle<Vec<u64>> {
    let Load {
        exchange,
        total,
        batch,
        interval,
        published,
        hold_at,
        hold,
    } = load;
    tokio::spawn(async move {
        let client = Client::connect("delayd-it-load-publisher").await;
        let mut sent_ms = Vec::with_capacity(total);
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while sent_ms.len() < total {
            if sent_ms.len() >= hold_at {
                wait_for("the test to release the publisher", DEADLINE, || async {
                    (!hold.load(Ordering::Acquire)).then_some(())
                })
                .await;
            }
            ticks.tick().await;
            let mut confirms = Vec::with_capacity(batch);
            for seq in sent_ms.len()..(sent_ms.len() + batch).min(total) {
                let props = BasicProperties::default()
                    .with_message_id(seq.to_string().into())
                    .with_delivery_mode(2)
                    .with_headers(table(vec![
                        ("seq", AMQPValue::LongLongInt(seq as i64)),
                        ("x-delay", AMQPValue::LongInt(load_delay_ms(seq) as i32)),
                    ]));
                sent_ms.push(now_ms());
                let body = format!("load message {seq}");
                confirms.push(
                    client
                        .publish_unconfirmed(&exchange, ROUTING_KEY, body.as_bytes(), props)
                        .await,
                );
            }
            for confirm in confirms {
                assert_confirmed(confirm).await;
            }
            published.store(sent_ms.len(), Ordering::Release);
        }
        client.close().await;
        sent_ms
    })
}

/// Arrivals of load messages: first receive time and copies, by seq.
struct Arrivals {
    first_ms: Vec<Option<u64>>,
    copies: Vec<u32>,
    /// The `x-delayd-id` each seq first arrived with. A later copy must
    /// carry the same one: the same stored record published again (its
    /// Done lost in a crash), never the message stored twice.
    delayd_ids: Vec<Option<u128>>,
}

/// Reads `queue` until every one of `total` seqs arrived or `deadline`.
fn spawn_collector(
    queue: String,
    total: usize,
    deadline: Instant,
    received: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<Arrivals> {
    tokio::spawn(async move {
        let client = Client::connect("delayd-it-load-consumer").await;
        let mut receiver = client.consume(&queue).await;
        let mut arrivals = Arrivals {
            first_ms: vec![None; total],
            copies: vec![0; total],
            delayd_ids: vec![None; total],
        };
        let mut distinct = 0;
        while distinct < total {
            let Some(message) = receiver.next(deadline).await else {
                break;
            };
            let seq = match message.header("seq") {
                Some(AMQPValue::LongLongInt(seq)) => *seq as usize,
                other => panic!("load message without an i64 seq header: {other:?}"),
            };
            assert!(seq < total, "unknown seq {seq}");
            arrivals.copies[seq] += 1;
            let id = assert_delayd_id(&message);
            match arrivals.delayd_ids[seq] {
                None => arrivals.delayd_ids[seq] = Some(id),
                Some(first) => assert_eq!(
                    first, id,
                    "seq {seq} arrived twice with different x-delayd-ids: stored twice"
                ),
            }
            if arrivals.first_ms[seq].is_none() {
                arrivals.first_ms[seq] = Some(message.at_ms);
                distinct += 1;
                received.store(distinct, Ordering::Release);
            }
        }
        receiver.close().await;
        client.close().await;
        arrivals
    })
}

/// How late a load message may arrive: generous (a 2-core machine under
/// load, a restart or reconnect behind it), but finite.
const LOAD_LATE_MS: u64 = 8000;

/// Asserts every message arrived, none before its due time, and none more
/// than [`LOAD_LATE_MS`] after its delay counted from the later of its
/// publish and `settled_ms`, when delayd was back after the disruption (a
/// message that waited in the broker meanwhile is due its delay after
/// delayd took it; one stored before and due meanwhile leaves then);
/// returns the number of duplicate copies.
fn check_arrivals(sent_ms: &[u64], arrivals: &Arrivals, settled_ms: u64) -> u32 {
    let missing: Vec<usize> = (0..sent_ms.len())
        .filter(|&seq| arrivals.first_ms[seq].is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} messages never arrived, e.g. seq {:?}",
        missing.len(),
        sent_ms.len(),
        &missing[..missing.len().min(20)]
    );
    let early: Vec<(usize, u64)> = (0..sent_ms.len())
        .filter_map(|seq| {
            let due = sent_ms[seq] + load_delay_ms(seq);
            let at = arrivals.first_ms[seq].expect("checked above");
            (at < due).then(|| (seq, due - at))
        })
        .collect();
    assert!(
        early.is_empty(),
        "{} messages arrived early, (seq, ms early): {:?}",
        early.len(),
        &early[..early.len().min(20)]
    );
    // (seq, ms past its delay after the later of its publish and `settled_ms`)
    let lateness: Vec<(usize, u64)> = (0..sent_ms.len())
        .map(|seq| {
            let due = sent_ms[seq].max(settled_ms) + load_delay_ms(seq);
            let at = arrivals.first_ms[seq].expect("checked above");
            (seq, at.saturating_sub(due))
        })
        .collect();
    let latest = lateness.iter().map(|&(_, ms)| ms).max().unwrap_or(0);
    println!("latest arrival: {latest} ms late (counted from the disruption's end if later)");
    let late: Vec<(usize, u64)> = lateness
        .into_iter()
        .filter(|&(_, ms)| ms > LOAD_LATE_MS)
        .collect();
    assert!(
        late.is_empty(),
        "{} messages arrived more than {LOAD_LATE_MS} ms late, (seq, ms late): {:?}",
        late.len(),
        &late[..late.len().min(20)]
    );
    arrivals.copies.iter().map(|&c| c.saturating_sub(1)).sum()
}

/// A load run: a paced publisher plus a collector on the target queue.
struct LoadRun {
    total: usize,
    start: Instant,
    published: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
    hold: Arc<AtomicBool>,
    publisher: tokio::task::JoinHandle<Vec<u64>>,
    collector: tokio::task::JoinHandle<Arrivals>,
}

impl LoadRun {
    /// Publish `total` messages, `batch` every 100 ms, pausing at `hold_at`
    /// until [`LoadRun::release`].
    fn start(s: &Setup, total: usize, batch: usize, hold_at: usize) -> LoadRun {
        let start = Instant::now();
        let published = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(AtomicUsize::new(0));
        let hold = Arc::new(AtomicBool::new(true));
        let publisher = spawn_publisher(Load {
            exchange: s.names.from_exchange.clone(),
            total,
            batch,
            interval: Duration::from_millis(100),
            published: published.clone(),
            hold_at,
            hold: hold.clone(),
        });
        let collector = spawn_collector(
            s.names.target_queue.clone(),
            total,
            start + Duration::from_secs(45),
            received.clone(),
        );
        LoadRun {
            total,
            start,
            published,
            received,
            hold,
            publisher,
            collector,
        }
    }

    fn published(&self) -> usize {
        self.published.load(Ordering::Acquire)
    }

    fn received(&self) -> usize {
        self.received.load(Ordering::Acquire)
    }

    /// Let the publisher go past `hold_at`.
    fn release(&self) {
        self.hold.store(false, Ordering::Release);
    }

    /// Wait for every message; assert none lost, early, or late (see
    /// [`check_arrivals`] for `settled_ms`). Returns duplicates.
    async fn finish(self, settled_ms: u64) -> u32 {
        let sent_ms = self.publisher.await.expect("publisher task");
        let arrivals = self.collector.await.expect("collector task");
        assert_eq!(sent_ms.len(), self.total);
        check_arrivals(&sent_ms, &arrivals, settled_ms)
    }
}

// ------------------------------------------------------------- 5. SIGKILL

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_nothing_acked() {
    const TOTAL: usize = 3000;
    // Anywhere from the first deliveries to well into the load.
    let kill_after = seeded("sigkill: kill after published", 200..2000) as usize;
    // Publishing goes on while delayd is down and restarting, up to here.
    let hold_at = kill_after + 500;
    let mut s = setup("sigkill", DelaydOptions::default()).await;
    // 500 messages/s: 6 s of publishing.
    let load = LoadRun::start(&s, TOTAL, 50, hold_at);
    wait_for("the kill point", DEADLINE, || async {
        (load.published() >= kill_after).then_some(())
    })
    .await;
    let stored_before_kill = s.delayd.pending();
    let killed_at = load.published();
    s.delayd.kill_9();
    s.delayd.restart().await;
    let restarted_ms = now_ms();
    load.release();

    let start = load.start;
    let duplicates = load.finish(restarted_ms).await;
    // Deliveries stored but unacked at the kill come back from the broker
    // marked redelivered; delayd recognises them rather than storing twice
    // (the collector checked that every duplicate is one stored record).
    let deduplicated = s.delayd.metric("delayd_redeliveries_deduplicated_total");
    println!(
        "sigkill: {TOTAL} messages, SIGKILL after {killed_at} published \
         ({stored_before_kill} pending in delayd), {duplicates} duplicates, \
         {deduplicated} redeliveries recognised, {:?}",
        start.elapsed()
    );
    s.client.close().await;
}

// ------------------------------------------------- 6. connection close

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_mid_stream_reconnects_without_loss() {
    const TOTAL: usize = 2000;
    // Anywhere from the first due messages (about 400 published by then)
    // to well into the load.
    let close_after = seeded("reconnect: close after published", 100..1600) as usize;
    // Publishing goes on while the connections are closed, up to here.
    let hold_at = close_after + 500;
    let s = setup("reconnect", DelaydOptions::default()).await;
    // 400 messages/s: 5 s of publishing.
    let load = LoadRun::start(&s, TOTAL, 40, hold_at);

    // Close once delayd both consumes and publishes (so both connections exist).
    wait_for(
        "delayd to publish its first due message",
        DEADLINE,
        || async { (load.received() > 0 && load.published() >= close_after).then_some(()) },
    )
    .await;
    let closed_at = load.published();
    let closed = s.delayd.close_broker_connections();
    let closed_ms = now_ms();
    load.release();
    assert_eq!(
        closed, 2,
        "expected delayd's consume and publish connections to be closed"
    );

    let start = load.start;
    let duplicates = load.finish(closed_ms).await;
    // The same process throughout, so its counters cover the whole run.
    // Deliveries stored but not yet acked when the consuming connection
    // closed come back from the broker marked redelivered: each must be
    // recognised as stored, never stored a second time (the collector also
    // checked that every copy of a message carries one x-delayd-id).
    let scheduled = s.delayd.metric("delayd_scheduled_total");
    let deduplicated = s.delayd.metric("delayd_redeliveries_deduplicated_total");
    let fired = s.delayd.metric("delayd_fired_total");
    println!(
        "reconnect: {TOTAL} messages, {closed} connections closed after {closed_at} published, \
         {duplicates} duplicates, {deduplicated} redeliveries recognised, {:?}",
        start.elapsed()
    );
    assert_eq!(
        scheduled, TOTAL as f64,
        "delayd_scheduled_total: every message stored exactly once \
         ({deduplicated} redeliveries recognised)"
    );
    // A publish whose confirm was lost with the connection is published
    // again (a duplicate at the target), but counted once, when confirmed.
    assert_eq!(
        fired, TOTAL as f64,
        "delayd_fired_total: every message published to its target once"
    );
    s.client.close().await;
}

// --------------------------------------------------------------- 7. SIGTERM

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_and_keeps_pending() {
    const COUNT: usize = 20;
    const DELAY_MS: u64 = 10_000;
    let opts = DelaydOptions {
        shutdown_grace: "5s".into(),
        ..DelaydOptions::default()
    };
    let mut s = setup("sigterm", opts).await;
    // When each publish was sent and when the broker confirmed it: the
    // broker's own stamp, which the delay counts from, lies between.
    let mut sent_ms = Vec::new();
    for i in 0..COUNT {
        let props = BasicProperties::default()
            .with_message_id(i.to_string().into())
            .with_headers(table(vec![(
                "x-delay",
                AMQPValue::LongInt(DELAY_MS as i32),
            )]));
        let before = now_ms();
        s.client
            .publish(&s.names.from_exchange, ROUTING_KEY, b"pending", props)
            .await;
        sent_ms.push((before, now_ms()));
    }
    wait_for("delayd to store every message", DEADLINE, || async {
        (s.delayd.pending() == COUNT as u64).then_some(())
    })
    .await;

    let status = s.delayd.sigterm_and_wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0), "SIGTERM must exit 0, got {status}");
    assert_eq!(
        s.client.queue_counts(&s.names.from_queue).await,
        Some((0, 0)),
        "every message was acked (stored), and delayd stopped consuming"
    );

    s.delayd.restart().await;
    let restarted_ms = now_ms();
    assert_eq!(
        s.delayd.pending(),
        COUNT as u64,
        "the restarted delayd recovers every pending message from its WAL"
    );
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    // Every copy of each message (by message_id), with its x-delayd-id.
    let mut arrived: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let check = |received: &Received| -> (usize, String) {
        let i: usize = received
            .message_id()
            .and_then(|id| id.parse().ok())
            .expect("numeric message_id");
        let (sent, confirmed) = sent_ms[i];
        assert!(
            received.at_ms >= sent + DELAY_MS,
            "message {i} arrived {} ms early",
            sent + DELAY_MS - received.at_ms
        );
        // Late by at most LATE_MS past its due time, or past the restart
        // if it fell due while delayd was down.
        let bound = (confirmed + DELAY_MS).max(restarted_ms) + LATE_MS;
        assert!(
            received.at_ms <= bound,
            "message {i} arrived {} ms late",
            received.at_ms - (bound - LATE_MS)
        );
        let uid = received
            .header_text("x-delayd-id")
            .unwrap_or_else(|| panic!("message {i} has no x-delayd-id"));
        (i, uid)
    };
    while arrived.len() < COUNT {
        let received = receiver
            .next(Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|| panic!("only {} of {COUNT} arrived", arrived.len()));
        let (i, uid) = check(&received);
        arrived.entry(i).or_default().push(uid);
    }
    // Every publish confirmed (nothing left to send again), then a last
    // look for copies still on their way.
    wait_for("delayd to retire every message", DEADLINE, || async {
        (s.delayd.pending() == 0).then_some(())
    })
    .await;
    let settle = Instant::now() + Duration::from_secs(2);
    while let Some(received) = receiver.next(settle).await {
        let (i, uid) = check(&received);
        arrived.entry(i).or_default().push(uid);
    }
    // A clean stop and start with nothing in flight: no message was
    // published before the SIGTERM, and the restarted delayd publishes
    // each once, so no duplicate of any kind is allowed.
    let copies: BTreeMap<usize, usize> = arrived.iter().map(|(i, c)| (*i, c.len())).collect();
    assert!(
        copies.values().all(|&n| n == 1),
        "copies per message: {copies:?}"
    );
    let uids: HashSet<&String> = arrived.values().flatten().collect();
    assert_eq!(uids.len(), COUNT, "distinct messages share an x-delayd-id");
    receiver.close().await;
    s.client.close().await;
}

// ----------------------------------------------------------- 8. delayd check

#[test]
fn check_command_reports_key_and_file() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let write = |name: &str, to_broker: &str| {
        let path = dir.path().join(name);
        let text = format!(
            r#"[wal]
dir = "data/wal"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

[[routes]]
name = "orders"
from = {{ broker = "rabbit", queue = "delayd.orders", exchange = "orders.delayed" }}
to = {{ broker = "{to_broker}", exchange = "orders" }}
"#
        );
        std::fs::write(&path, text).expect("write config");
        path
    };

    let good = write("good.toml", "rabbit");
    let output = delayd_command(&[
        OsStr::new("check"),
        OsStr::new("--config"),
        good.as_os_str(),
    ]);
    assert!(
        output.status.success(),
        "a valid config must pass: {}",
        String::from_utf8_lossy(&output.stderr)
    );

    let bad = write("bad.toml", "nowhere");
    let output = delayd_command(&[OsStr::new("check"), OsStr::new("--config"), bad.as_os_str()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "an unknown to.broker must fail the check; stderr: {stderr}"
    );
    assert!(
        stderr.contains("routes[0].to.broker"),
        "stderr should name the key routes[0].to.broker: {stderr}"
    );
    assert!(
        stderr.contains(&bad.display().to_string()),
        "stderr should name the file {}: {stderr}",
        bad.display()
    );
    assert!(
        stderr.contains("nowhere"),
        "stderr should name the unknown broker: {stderr}"
    );
}

// ------------------------------------------------------------- 9. /readyz

/// `/readyz` should answer 200 once the WAL is recovered and delayd is
/// connected and consuming, whether or not anything fell due yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_ready_before_the_first_publish() {
    let s = setup("readyz", DelaydOptions::default()).await;
    let body = wait_for("/readyz to answer 200", Duration::from_secs(10), || async {
        match s.delayd.http_get("/readyz") {
            Ok((200, body)) => Some(body),
            _ => None,
        }
    })
    .await;
    assert!(body.contains("\"ready\":true"), "{body}");
    s.client.close().await;
}

/// `/readyz` is 200 only once every route consumes: its exchange, queue,
/// binding and consumer exist. Here the route's exchange cannot be declared
/// (it exists with another type) while the broker connection is fine; delayd
/// used to say ready, and a message published then was dropped unbound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_until_every_route_consumes() {
    let names = Names::new("readyz-route");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-readyz-route").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    // delayd declares a topic exchange; a direct one is in the way.
    client
        .channel
        .exchange_declare(
            names.from_exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            lapin::options::ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the conflicting exchange");
    let opts = DelaydOptions::default();
    let delayd = Delayd::start_consuming(
        |wal, http| common::config_toml(&names, wal, http, &opts),
        "",
    )
    .await;

    let body = wait_for("the consuming connection to be up", DEADLINE, || async {
        let body = delayd.readyz();
        (body["brokers"][0]["consume"] == "connected").then_some(body)
    })
    .await;
    let (status, _) = delayd.http_get("/readyz").expect("GET /readyz");
    assert_eq!(status, 503, "ready while the route cannot consume: {body}");
    assert_eq!(body["routes"][names.route.as_str()], "starting", "{body}");

    // The conflict goes: delayd declares, binds and consumes, then is ready.
    client
        .channel
        .exchange_delete(
            names.from_exchange.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("delete the conflicting exchange");
    wait_for("/readyz to answer 200", DEADLINE, || async {
        matches!(delayd.http_get("/readyz"), Ok((200, _))).then_some(())
    })
    .await;
    let id = format!("readyz-route.{}", common::unique_suffix());
    let props = BasicProperties::default()
        .with_message_id(id.as_str().into())
        .with_headers(table(vec![("x-delay", AMQPValue::LongInt(100))]));
    client
        .publish(&names.from_exchange, ROUTING_KEY, b"ready", props)
        .await;
    let mut receiver = client.consume(&names.target_queue).await;
    let found = receiver.collect_by_message_id(&[id.as_str()]).await;
    assert_eq!(found[0].delivery.data, b"ready");
    receiver.close().await;
    client.close().await;
}

/// Messages due at the same instant leave in arrival order per routing key
/// (as from a TTL queue), also when many keys share the route and the sink
/// publishes on several channels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_due_times_keep_arrival_order_per_routing_key() {
    const KEYS: usize = 20;
    const PER_KEY: usize = 30;
    let s = setup("keyorder", DelaydOptions::default()).await;
    // Far enough ahead that all are stored before they fall due.
    let due = now_ms() + 8000;
    let mut publishes = Vec::new();
    for seq in 0..PER_KEY {
        for key in 0..KEYS {
            let props = BasicProperties::default()
                .with_message_id(format!("{key}.{seq}").into())
                .with_headers(table(vec![(
                    "x-deliver-at",
                    AMQPValue::LongLongInt(due as i64),
                )]));
            publishes.push(
                s.client
                    .publish_unconfirmed(&s.names.from_exchange, &format!("key.{key}"), b"o", props)
                    .await,
            );
        }
    }
    for confirm in publishes {
        common::assert_confirmed(confirm).await;
    }
    wait_for("all stored", DEADLINE, || async {
        (s.delayd.pending() == (KEYS * PER_KEY) as u64).then_some(())
    })
    .await;
    assert!(now_ms() < due, "not all stored before they fell due");
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut by_key: HashMap<String, Vec<usize>> = HashMap::new();
    let mut seen = HashSet::new();
    while seen.len() < KEYS * PER_KEY {
        let Some(got) = receiver.next(deadline).await else {
            panic!("{} of {} arrived", seen.len(), KEYS * PER_KEY);
        };
        assert!(got.at_ms >= due, "early by {} ms", due - got.at_ms);
        assert!(
            got.at_ms < due + LATE_MS,
            "{} ms after the common due time",
            got.at_ms - due
        );
        let id = got.message_id().expect("message_id").to_owned();
        if !seen.insert(id.clone()) {
            continue;
        }
        let (key, seq) = id.split_once('.').expect("key.seq");
        by_key
            .entry(key.to_owned())
            .or_default()
            .push(seq.parse().expect("seq"));
    }
    let inversions: usize = by_key
        .values()
        .map(|seqs| seqs.windows(2).filter(|w| w[0] > w[1]).count())
        .sum();
    assert_eq!(inversions, 0, "order per routing key: {by_key:?}");
    receiver.close().await;
}
