//! Integration tests of the RabbitMQ adapter against a real broker at
//! 127.0.0.1:5672 (guest/guest; override with `AMQP_URL`). Every test uses
//! queue and exchange names of its own and deletes them at the end.
//!
//! The reconnect test closes every connection of the broker with
//! `rabbitmqctl close_all_connections`, so it takes a write lock that the
//! other tests hold for reading: it never cuts into them.
#![cfg(feature = "amqp")]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use delayd_adapters::amqp::{
    AmqpSink, AmqpSource, BrokerConnections, ExchangeType, SinkConfig, SourceConfig,
};
use delayd_adapters::{Delivery, Message, PublishOutcome, Sink, Source, Target, Value};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable as AmqpTable, LongString,
};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::RwLock;

/// Taken for writing by the test that closes every broker connection.
static BROKER: RwLock<()> = RwLock::const_new(());

const DEADLINE: Duration = Duration::from_secs(30);

fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A name no other test (or earlier run) uses.
fn unique(what: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("delayd-test.{what}.{}.{nanos}.{n}", std::process::id())
}

/// Adapter logs in the test output (shown for failing tests); `RUST_LOG` filters.
fn logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "delayd_adapters=debug".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A plain lapin connection and channel, independent of the adapter.
async fn plain() -> (Connection, Channel) {
    let props = ConnectionProperties::default().with_connection_name("delayd-test-plain".into());
    let conn = Connection::connect(&url(), props).await.expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    (conn, channel)
}

async fn declare_queue(channel: &Channel, queue: &str) {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            AmqpTable::default(),
        )
        .await
        .expect("queue.declare");
}

async fn declare_exchange(channel: &Channel, exchange: &str, kind: ExchangeKind) {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(exchange.into(), kind, options, AmqpTable::default())
        .await
        .expect("exchange.declare");
}

async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            AmqpTable::default(),
        )
        .await
        .expect("queue.bind");
}

async fn cleanup(queues: &[&str], exchanges: &[&str]) {
    let (conn, channel) = plain().await;
    for queue in queues {
        channel
            .queue_delete((*queue).into(), QueueDeleteOptions::default())
            .await
            .expect("queue.delete");
    }
    for exchange in exchanges {
        channel
            .exchange_delete((*exchange).into(), ExchangeDeleteOptions::default())
            .await
            .expect("exchange.delete");
    }
    conn.close(200, "bye".into()).await.expect("close");
}

/// (messages, consumers) of a queue.
async fn queue_counts(queue: &str) -> (u32, u32) {
    let (conn, channel) = plain().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let q = channel
        .queue_declare(queue.into(), passive, AmqpTable::default())
        .await
        .expect("passive queue.declare");
    conn.close(200, "bye".into()).await.expect("close");
    (q.message_count(), q.consumer_count())
}

/// Polls `check` until it holds or the deadline passes.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn next(source: &mut AmqpSource) -> Delivery {
    tokio::time::timeout(DEADLINE, source.next())
        .await
        .expect("no delivery before the deadline")
        .expect("source error")
}

async fn publish_plain(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .expect("basic.publish");
}

/// Gets one message from `queue` with plain lapin, polling until there is one.
async fn get_one(channel: &Channel, queue: &str) -> lapin::message::BasicGetMessage {
    let start = Instant::now();
    loop {
        let got = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get");
        if let Some(message) = got {
            return message;
        }
        assert!(start.elapsed() < DEADLINE, "nothing arrived in {queue}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every AMQP field type RabbitMQ carries, nested ones included.
/// A new queue named after `what`, holding `bodies` (published to it
/// directly), and the plain connection that filled it.
async fn queue_holding(what: &str, bodies: &[&[u8]]) -> (String, Connection, Channel) {
    let queue = unique(what);
    let (conn, channel) = plain().await;
    declare_queue(&channel, &queue).await;
    for body in bodies {
        publish_plain(&channel, "", &queue, body, BasicProperties::default()).await;
    }
    (queue, conn, channel)
}

/// A source on a new queue bound to a new fanout exchange (both named after
/// `what`), once its consumer is registered: (queue, exchange, source).
async fn fanout_source(rabbit: &BrokerConnections, what: &str) -> (String, String, AmqpSource) {
    let queue = unique(what);
    let exchange = unique(&format!("{what}-x"));
    let config = SourceConfig::new(&queue).with_exchange(&exchange, ExchangeType::Fanout);
    let source = AmqpSource::start(rabbit.consume.clone(), config).unwrap();
    eventually("the source's consumer", || async {
        rabbit.consume.is_connected() && queue_counts(&queue).await.1 == 1
    })
    .await;
    (queue, exchange, source)
}

fn every_header() -> AmqpTable {
    let mut inner = BTreeMap::new();
    inner.insert("inner-long".into(), AMQPValue::LongLongInt(-42));
    inner.insert(
        "inner-string".into(),
        AMQPValue::LongString(LongString::from(&b"nested"[..])),
    );
    let mut deeper = BTreeMap::new();
    deeper.insert("deep".into(), AMQPValue::Boolean(false));
    inner.insert(
        "inner-table".into(),
        AMQPValue::FieldTable(AmqpTable::from(deeper)),
    );
    let inner = AmqpTable::from(inner);

    let mut headers = BTreeMap::new();
    let mut put = |k: &str, v: AMQPValue| {
        headers.insert(k.into(), v);
    };
    put("bool", AMQPValue::Boolean(true));
    put("i8", AMQPValue::ShortShortInt(-8));
    put("u8", AMQPValue::ShortShortUInt(250));
    put("i16", AMQPValue::ShortInt(-16_000));
    put("u16", AMQPValue::ShortUInt(65_000));
    put("i32", AMQPValue::LongInt(-2_000_000_000));
    put("u32", AMQPValue::LongUInt(4_000_000_000));
    put("i64", AMQPValue::LongLongInt(-9_000_000_000_000));
    put("f32", AMQPValue::Float(3.25));
    put("f64", AMQPValue::Double(-1.0e300));
    put(
        "decimal",
        AMQPValue::DecimalValue(DecimalValue {
            scale: 2,
            value: 12_345,
        }),
    );
    put(
        "long-utf8",
        AMQPValue::LongString(LongString::from("grüße")),
    );
    put(
        "long-binary",
        AMQPValue::LongString(LongString::from(vec![0xff, 0xfe, 0x00, 0xc3, 0x28])),
    );
    put(
        "array",
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::LongString(LongString::from("two")),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void])),
            AMQPValue::FieldTable(inner.clone()),
        ])),
    );
    put("timestamp", AMQPValue::Timestamp(1_700_000_000));
    put("table", AMQPValue::FieldTable(inner));
    put(
        "bytes",
        AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 2, 0xff])),
    );
    put("void", AMQPValue::Void);
    put("x-delay", AMQPValue::LongInt(5000));
    AmqpTable::from(headers)
}

/// The header a broker with the set_header_timestamp interceptor stamps.
const STAMP: &str = "timestamp_in_ms";

/// `props` without the `timestamp_in_ms` header a broker with the
/// set_header_timestamp interceptor adds to a message that has none (with
/// `overwrite = false`, scripts/rabbitmq/delayd.conf, it keeps the
/// sender's `timestamp` property: that must come through as sent).
fn without_broker_stamp(props: BasicProperties) -> BasicProperties {
    let Some(headers) = props.headers().clone() else {
        return props;
    };
    if !headers.inner().contains_key(STAMP) {
        return props;
    }
    let mut kept = AmqpTable::default();
    for (k, v) in headers.inner() {
        if k.as_str() != STAMP {
            kept.insert(k.clone(), v.clone());
        }
    }
    props.with_headers(kept)
}

fn every_property() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/octet-stream".into())
        .with_content_encoding("identity".into())
        .with_headers(every_header())
        .with_delivery_mode(2)
        .with_priority(5)
        .with_correlation_id("corr-42".into())
        .with_reply_to("replies".into())
        .with_expiration("3600000".into())
        .with_message_id("msg-42".into())
        .with_timestamp(1_700_000_123)
        .with_type("order.created".into())
        // RabbitMQ checks user_id against the connection's user.
        .with_user_id("guest".into())
        .with_app_id("shop".into())
        .with_cluster_id("cluster-7".into())
}

#[tokio::test]
async fn every_type_and_property_survives_consume_and_republish() {
    logs();
    let _shared = BROKER.read().await;
    let queue_in = unique("in");
    let exchange_in = unique("in-x");
    let queue_out = unique("out");
    let exchange_out = unique("out-x");

    let rabbit = BrokerConnections::new(&url()).unwrap();
    let config = SourceConfig::new(&queue_in).with_exchange(&exchange_in, ExchangeType::Topic);
    let mut source = AmqpSource::start(rabbit.consume.clone(), config).unwrap();
    // The source is set up once its consumer is on the queue.
    eventually("the source's consumer", || async {
        rabbit.consume.is_connected() && queue_counts(&queue_in).await.1 == 1
    })
    .await;

    let (conn, channel) = plain().await;
    declare_exchange(&channel, &exchange_out, ExchangeKind::Fanout).await;
    declare_queue(&channel, &queue_out).await;
    bind(&channel, &queue_out, &exchange_out, "").await;

    let body: Vec<u8> = vec![0x00, 0xff, 0x80, b'h', b'i', 0xc3, 0x28];
    publish_plain(
        &channel,
        &exchange_in,
        "eu.orders.created",
        &body,
        every_property(),
    )
    .await;

    let delivery = next(&mut source).await;
    assert!(!delivery.redelivered);
    let message = &delivery.message;
    // A broker with the set_header_timestamp interceptor (the 4.3 test
    // broker) adds its `timestamp_in_ms` header; with `overwrite = false`
    // it keeps the sender's `timestamp`: the rest must come through as sent.
    let stamped = message.headers.get(STAMP).is_some();
    assert_eq!(message.body, body);
    assert_eq!(message.source, exchange_in);
    assert_eq!(message.routing_key, "eu.orders.created");
    assert_eq!(message.properties.kind.as_deref(), Some("order.created"));
    assert_eq!(message.properties.user_id.as_deref(), Some("guest"));
    assert_eq!(
        message.properties.timestamp,
        Some(1_700_000_123),
        "the producer's timestamp property (a broker whose set_header_timestamp interceptor has overwrite = true replaces it: restart the test broker with scripts/rabbitmq/delayd.conf)"
    );
    assert_eq!(message.headers.get("u8"), Some(&Value::U8(250)));
    assert_eq!(message.headers.get("u16"), Some(&Value::U16(65_000)));
    assert_eq!(message.headers.get("u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(message.headers.get("f32"), Some(&Value::F32(3.25)));
    assert_eq!(
        message.headers.get("decimal"),
        Some(&Value::Decimal {
            scale: 2,
            value: 12_345
        })
    );
    assert_eq!(
        message.headers.get("long-binary"),
        Some(&Value::LongString(vec![0xff, 0xfe, 0x00, 0xc3, 0x28]))
    );
    assert_eq!(
        message.headers.get("timestamp"),
        Some(&Value::Timestamp(1_700_000_000))
    );
    assert_eq!(message.headers.get("void"), Some(&Value::Void));
    assert!(matches!(message.headers.get("table"), Some(Value::Table(t)) if t.len() == 3));
    assert_eq!(
        message.headers.len(),
        every_header().inner().len() + usize::from(stamped)
    );

    // The stored form (WAL codec) keeps all of it too.
    let stored = delayd_adapters::decode(&delayd_adapters::encode(message)).unwrap();
    assert_eq!(&stored, message);

    let sink = AmqpSink::new(rabbit.publish.clone(), SinkConfig::default());
    let outcome = sink
        .publish(stored.clone(), Target::exchange(&exchange_out))
        .await
        .expect("publish");
    assert_eq!(outcome, PublishOutcome::Delivered);
    delivery.ack.ack().await.expect("ack");

    let got = get_one(&channel, &queue_out).await;
    assert_eq!(got.delivery.data, body);
    assert_eq!(got.delivery.exchange.as_str(), exchange_out);
    assert_eq!(got.delivery.routing_key.as_str(), "eu.orders.created");
    let got_properties = without_broker_stamp(got.delivery.properties.clone());
    assert_eq!(got_properties, every_property());
    assert_eq!(got_properties.headers(), &Some(every_header()));

    // Acked: nothing left behind in the source queue.
    eventually("the source queue to drain", || async {
        queue_counts(&queue_in).await.0 == 0
    })
    .await;

    drop(source);
    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue_in, &queue_out], &[&exchange_in, &exchange_out]).await;
}

#[tokio::test]
async fn unroutable_messages_are_reported_even_among_concurrent_publishes() {
    logs();
    let _shared = BROKER.read().await;
    let lonely = unique("lonely-x");
    let routed_exchange = unique("routed-x");
    let queue = unique("routed");

    let (conn, channel) = plain().await;
    declare_exchange(&channel, &lonely, ExchangeKind::Topic).await;
    declare_exchange(&channel, &routed_exchange, ExchangeKind::Direct).await;
    declare_queue(&channel, &queue).await;
    bind(&channel, &queue, &routed_exchange, "yes").await;

    let rabbit = BrokerConnections::new(&url()).unwrap();
    let sink = Arc::new(AmqpSink::new(
        rabbit.publish.clone(),
        SinkConfig {
            channels: 16,
            ..SinkConfig::default()
        },
    ));
    let message = Message::with_body(b"hello".to_vec());

    // An exchange with no binding, and the default exchange to a missing queue.
    let outcome = sink
        .publish(message.clone(), Target::exchange(&lonely))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Unroutable);
    let outcome = sink
        .publish(message.clone(), Target::queue(unique("missing-queue")))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Unroutable);

    // A missing exchange: the broker closes that publish's channel; only
    // that publish fails, typed as an unknown target, the others go on.
    let outcome = sink
        .publish(message.clone(), Target::exchange(unique("missing-x")))
        .await;
    match outcome {
        Err(delayd_adapters::SinkError::UnknownTarget(text)) => {
            assert!(text.contains("NOT_FOUND"), "{text}")
        }
        other => panic!("expected an unknown target, got {other:?}"),
    }

    // Many publishes at once, routable and not interleaved: each gets its own
    // outcome. A few go to a missing exchange in the same batches: only those
    // fail, the broker closing their channel does not fail the others.
    let mut tasks = Vec::new();
    let missing = unique("missing-x2");
    for i in 0..400u32 {
        let sink = sink.clone();
        let routed_exchange = routed_exchange.clone();
        let missing = missing.clone();
        tasks.push(tokio::spawn(async move {
            let routable = i % 3 != 0;
            let mut message = Message::with_body(i.to_be_bytes().to_vec());
            message.routing_key = if routable { "yes" } else { "no" }.to_owned();
            let to_missing = i % 97 == 5;
            let target = Target::exchange(if to_missing {
                &missing
            } else {
                &routed_exchange
            });
            let outcome = sink.publish(message.clone(), target.clone()).await;
            (i, routable, to_missing, outcome)
        }));
    }
    // Every outcome is checked here, and all wrong ones are reported at once.
    let mut routed = 0;
    let mut wrong = Vec::new();
    for task in tasks {
        let (i, routable, to_missing, outcome) = task.await.unwrap();
        let right = match (&outcome, to_missing, routable) {
            (Err(delayd_adapters::SinkError::UnknownTarget(_)), true, _) => true,
            (Ok(PublishOutcome::Delivered), false, true) => {
                routed += 1;
                true
            }
            (Ok(PublishOutcome::Unroutable), false, false) => true,
            _ => false,
        };
        if !right {
            wrong.push(format!(
                "#{i} (routable {routable}, missing exchange {to_missing}): {outcome:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of 400 publishes had the wrong outcome:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // At least every routable one: when the broker closes a channel over the
    // missing exchange, routed publishes on it whose confirm was lost are sent
    // again (at-least-once), so a few may be there twice.
    eventually("every routable message in the queue", || async {
        let n = queue_counts(&queue).await.0;
        n >= routed && n <= routed + 256
    })
    .await;

    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue], &[&lonely, &routed_exchange]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_to_a_missing_exchange_fail_with_not_found_and_the_sink_keeps_publishing() {
    logs();
    let _shared = BROKER.read().await;
    let missing = unique("missing-x");
    let queue = unique("after-missing");
    let (conn, channel) = plain().await;
    declare_queue(&channel, &queue).await;

    let rabbit = BrokerConnections::new(&url()).unwrap();
    let sink = Arc::new(AmqpSink::new(rabbit.publish.clone(), SinkConfig::default()));
    // More than a connection's 2047 channels: were each to cost a channel
    // the broker closes, lapin would run out of channel ids.
    let publishes: Vec<_> = (0..3000)
        .map(|i| {
            let (sink, target) = (sink.clone(), Target::exchange(&missing));
            tokio::spawn(async move {
                sink.publish(Message::with_body(format!("m{i}")), target.clone())
                    .await
            })
        })
        .collect();
    for publish in publishes {
        match publish.await.unwrap() {
            Err(delayd_adapters::SinkError::UnknownTarget(why)) => assert!(
                why.contains("NOT_FOUND - no exchange") && why.contains(&missing),
                "{why}"
            ),
            other => panic!("publish to a missing exchange gave {other:?}"),
        }
    }
    let outcome = sink
        .publish(Message::with_body("after"), Target::queue(&queue))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Delivered);
    assert_eq!(get_one(&channel, &queue).await.data, b"after");

    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue], &[]).await;
}

#[tokio::test]
async fn close_gives_unacked_deliveries_back_and_leaves_the_connection_open() {
    logs();
    let _shared = BROKER.read().await;
    let (queue, conn, _channel) = queue_holding("close", &[b"a", b"b", b"c"]).await;
    let rabbit = BrokerConnections::new(&url()).unwrap();
    let mut source = AmqpSource::start(rabbit.consume.clone(), SourceConfig::new(&queue)).unwrap();
    let unacked = next(&mut source).await;
    Box::new(source).close().await;
    // The channel is closed (not just abandoned while the connection lives
    // on): no consumer, and every message back in the queue.
    eventually("the consumer gone and 3 messages ready", || async {
        queue_counts(&queue).await == (3, 0)
    })
    .await;
    drop(unacked);
    assert!(
        rabbit.consume.is_connected(),
        "close took the connection down"
    );
    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue], &[]).await;
}

#[tokio::test]
async fn channels_keep_opening_after_the_broker_closed_thousands() {
    logs();
    let _shared = BROKER.read().await;
    let missing = unique("never-declared-x");
    let rabbit = BrokerConnections::new(&url()).unwrap();
    // lapin keeps the id of every channel the broker closed; past
    // channel_max (2047 on RabbitMQ) the connection must be replaced.
    for i in 0..2200 {
        let channel = rabbit
            .publish
            .try_channel()
            .await
            .unwrap_or_else(|e| panic!("channel {i}: {e}"));
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declared = channel
            .exchange_declare(
                missing.as_str().into(),
                ExchangeKind::Direct,
                passive,
                AmqpTable::default(),
            )
            .await;
        assert!(declared.is_err(), "{missing} exists");
    }
    rabbit.close().await;
}

#[tokio::test]
async fn declare_queue_creates_durable_queues_and_accepts_existing_ones() {
    logs();
    let _shared = BROKER.read().await;
    let fresh = unique("invalid");
    let existing = unique("unroutable");
    let (conn, channel) = plain().await;
    let mut args = AmqpTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1000));
    channel
        .queue_declare(
            existing.as_str().into(),
            QueueDeclareOptions::durable(),
            args,
        )
        .await
        .unwrap();

    let rabbit = BrokerConnections::new(&url()).unwrap();
    let sink = AmqpSink::new(rabbit.publish.clone(), SinkConfig::default());
    sink.declare_queue(&fresh).await.expect("declare new queue");
    sink.declare_queue(&existing)
        .await
        .expect("queue with other arguments is accepted");
    assert_eq!(queue_counts(&fresh).await, (0, 0));

    // The sink still publishes after the refused declaration.
    let outcome = sink
        .publish(Message::with_body("x"), Target::queue(&fresh))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Delivered);

    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&fresh, &existing], &[]).await;
}

#[tokio::test]
async fn pause_stops_deliveries_and_resume_restarts_them() {
    logs();
    let _shared = BROKER.read().await;
    let rabbit = BrokerConnections::new(&url()).unwrap();
    let (queue, exchange, mut source) = fanout_source(&rabbit, "pause").await;

    let (conn, channel) = plain().await;
    publish_plain(
        &channel,
        &exchange,
        "any",
        b"one",
        BasicProperties::default(),
    )
    .await;
    let first = next(&mut source).await;
    assert_eq!(first.message.body, b"one");
    first.ack.ack().await.unwrap();

    source.pause().await.unwrap();
    assert_eq!(queue_counts(&queue).await.1, 0, "consumer cancelled");
    publish_plain(
        &channel,
        &exchange,
        "any",
        b"two",
        BasicProperties::default(),
    )
    .await;
    eventually("the message to wait in the queue", || async {
        queue_counts(&queue).await.0 == 1
    })
    .await;
    // Nothing arrives while paused (a bounded wait for an absence).
    let while_paused = tokio::time::timeout(Duration::from_millis(500), source.next()).await;
    assert!(while_paused.is_err(), "delivery while paused");
    // Pausing twice is harmless.
    source.pause().await.unwrap();

    source.resume().await.unwrap();
    let second = next(&mut source).await;
    assert_eq!(second.message.body, b"two");
    // Requeue puts it back; it comes again, marked redelivered.
    second.ack.requeue().await.unwrap();
    let again = next(&mut source).await;
    assert_eq!(again.message.body, b"two");
    assert!(again.redelivered);
    again.ack.ack().await.unwrap();
    source.resume().await.unwrap();
    eventually("the queue to drain", || async {
        queue_counts(&queue).await == (0, 1)
    })
    .await;

    drop(source);
    rabbit.close().await;
    conn.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue], &[&exchange]).await;
}

async fn close_all_connections() {
    let status = tokio::task::spawn_blocking(|| {
        std::process::Command::new("rabbitmqctl")
            .args(["close_all_connections", "test"])
            .status()
    })
    .await
    .unwrap()
    .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl close_all_connections failed");
}

#[tokio::test]
async fn source_and_sink_recover_after_the_broker_closes_every_connection() {
    logs();
    let _exclusive = BROKER.write().await;
    let queue = unique("reconnect");
    let target_queue = unique("reconnect-out");
    let rabbit = BrokerConnections::new(&url()).unwrap();
    let mut source = AmqpSource::start(rabbit.consume.clone(), SourceConfig::new(&queue)).unwrap();
    let sink = Arc::new(AmqpSink::new(rabbit.publish.clone(), SinkConfig::default()));
    sink.declare_queue(&target_queue).await.unwrap();
    eventually("the source's consumer", || async {
        rabbit.consume.is_connected() && queue_counts(&queue).await.1 == 1
    })
    .await;

    let (conn, channel) = plain().await;
    publish_plain(&channel, "", &queue, b"before", BasicProperties::default()).await;
    let unacked = next(&mut source).await;
    assert_eq!(unacked.message.body, b"before");
    let outcome = sink
        .publish(Message::with_body("p1"), Target::queue(&target_queue))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Delivered);

    // Publishes keep running while the connections are closed: each one is
    // delivered or fails transiently (or as unavailable while the connection
    // is down), never anything else.
    let stop = Arc::new(AtomicBool::new(false));
    let background = {
        let sink = sink.clone();
        let stop = stop.clone();
        let target = Target::queue(&target_queue);
        tokio::spawn(async move {
            let (mut delivered, mut transient) = (0u32, 0u32);
            while !stop.load(Ordering::Relaxed) {
                match sink.publish(Message::with_body("bg"), target.clone()).await {
                    Ok(PublishOutcome::Delivered) => delivered += 1,
                    Err(
                        delayd_adapters::SinkError::Transient(_)
                        | delayd_adapters::SinkError::Unavailable(_),
                    ) => transient += 1,
                    other => panic!("unexpected publish result {other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (delivered, transient)
        })
    };

    close_all_connections().await;

    // The source keeps going: a message published after the close arrives,
    // and the one left unacked comes back marked redelivered.
    let (conn2, channel2) = plain().await;
    publish_plain(&channel2, "", &queue, b"after", BasicProperties::default()).await;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let delivery = next(&mut source).await;
        seen.push((delivery.message.body.clone(), delivery.redelivered));
        delivery.ack.ack().await.expect("ack on the new channel");
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![(b"after".to_vec(), false), (b"before".to_vec(), true)]
    );
    // The old delivery's channel is gone: its ack fails (the broker redelivered it).
    assert!(unacked.ack.ack().await.is_err());

    // The sink publishes again, possibly after transient errors.
    let start = Instant::now();
    let mut transient = 0;
    loop {
        match sink
            .publish(Message::with_body("p2"), Target::queue(&target_queue))
            .await
        {
            Ok(outcome) => {
                assert_eq!(outcome, PublishOutcome::Delivered);
                break;
            }
            Err(
                delayd_adapters::SinkError::Transient(_)
                | delayd_adapters::SinkError::Unavailable(_),
            ) => transient += 1,
            Err(error) => panic!("unexpected error {error}"),
        }
        assert!(start.elapsed() < DEADLINE, "sink never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let (bg_delivered, bg_transient) = background.await.unwrap();
    eprintln!(
        "sink recovered after {transient} transient error(s); background publisher: \
         {bg_delivered} delivered, {bg_transient} transient"
    );
    // Every confirmed message is in the queue (transient ones may be too).
    let expected = 2 + bg_delivered;
    eventually("every confirmed message in the target queue", || async {
        queue_counts(&target_queue).await.0 >= expected
    })
    .await;
    assert!(rabbit.is_connected());

    drop(source);
    rabbit.close().await;
    drop(conn); // closed by the broker
    conn2.close(200, "bye".into()).await.unwrap();
    cleanup(&[&queue, &target_queue], &[]).await;
}

/// Acks settled concurrently and out of order are coalesced into `multiple`
/// acks without ever naming an unknown delivery tag (which would close the
/// channel and make the broker redeliver everything unacked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_acks_settle_everything_exactly_once() {
    logs();
    let _shared = BROKER.read().await;
    let rabbit = BrokerConnections::new(&url()).unwrap();
    let (queue, exchange, mut source) = fanout_source(&rabbit, "acks").await;
    let (conn, channel) = plain().await;
    const N: u32 = 2000;
    for i in 0..N {
        publish_plain(
            &channel,
            &exchange,
            "",
            &i.to_be_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let mut tasks = Vec::new();
    for i in 0..N {
        let d = next(&mut source).await;
        assert!(
            !d.redelivered,
            "message {i} redelivered: an ack closed the channel"
        );
        // Settle in a scrambled order, some after a short pause.
        let wait = Duration::from_micros(u64::from(i.wrapping_mul(2_654_435_761) % 3000));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            d.ack.ack().await
        }));
    }
    for task in tasks {
        task.await.unwrap().expect("ack");
    }
    eventually(
        "an empty queue with its consumer still attached",
        || async { queue_counts(&queue).await == (0, 1) },
    )
    .await;
    conn.close(200, "bye".into()).await.expect("close");
    drop(source);
    rabbit.close().await;
    cleanup(&[&queue], &[&exchange]).await;
}

/// A TCP proxy in front of the broker that can stop passing the client's
/// bytes on (as a connection dying with frames still unsent does) and then
/// cut every connection it carries. Connections made after a cut pass.
struct CuttableProxy {
    addr: std::net::SocketAddr,
    stalled: Arc<AtomicBool>,
    pumps: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl CuttableProxy {
    async fn start() -> CuttableProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stalled = Arc::new(AtomicBool::new(false));
        let pumps = Arc::new(std::sync::Mutex::new(Vec::new()));
        let accept = tokio::spawn({
            let (stalled, pumps) = (stalled.clone(), pumps.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let broker = tokio::net::TcpStream::connect("127.0.0.1:5672")
                        .await
                        .expect("connect to the broker");
                    let (client_read, client_write) = client.into_split();
                    let (broker_read, broker_write) = broker.into_split();
                    let up = tokio::spawn(pump(client_read, broker_write, Some(stalled.clone())));
                    let down = tokio::spawn(pump(broker_read, client_write, None));
                    pumps.lock().unwrap().extend([up, down]);
                }
            }
        });
        CuttableProxy {
            addr,
            stalled,
            pumps,
            accept,
        }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// From now on the client's bytes are read and dropped.
    fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    /// Close every connection at once (no AMQP close), and pass again.
    fn cut(&self) {
        for pump in self.pumps.lock().unwrap().drain(..) {
            pump.abort();
        }
        self.stalled.store(false, Ordering::SeqCst);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copy `from` to `to`; while `stalled` is set, read and drop instead.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: Option<Arc<AtomicBool>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// An ack that never reached the broker (the connection died with it
/// unsent) must not be reported as done: delayd forgets a stored message
/// once its ack succeeds, and RabbitMQ redelivers this one, which would then
/// be stored and sent a second time. Ok must mean RabbitMQ processed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_lost_with_its_connection_is_not_reported_as_done() {
    logs();
    let _shared = BROKER.read().await;
    let (queue, conn, _channel) = queue_holding("lost-ack", &[b"once"]).await;
    let proxy = CuttableProxy::start().await;
    let rabbit = BrokerConnections::new(&proxy.url()).unwrap();
    let mut source = AmqpSource::start(rabbit.consume.clone(), SourceConfig::new(&queue)).unwrap();
    let first = next(&mut source).await;
    assert!(!first.redelivered);

    // The ack goes into a connection that no longer reaches the broker.
    proxy.stall();
    let mut ack = tokio::spawn(first.ack.ack());
    let early = tokio::time::timeout(Duration::from_secs(2), &mut ack).await;
    assert!(
        early.is_err(),
        "the ack was reported as done ({early:?}) though the broker never got it"
    );
    proxy.cut();
    let result = tokio::time::timeout(DEADLINE, ack)
        .await
        .expect("the ack to end once the connection is cut")
        .unwrap();
    assert!(result.is_err(), "a lost ack must fail, got {result:?}");

    // The broker gives the message back, marked redelivered, on the new connection.
    let again = next(&mut source).await;
    assert!(again.redelivered, "the message comes back redelivered");
    assert_eq!(again.message.body, b"once");
    again.ack.ack().await.expect("ack on the new connection");
    eventually("an empty queue", || async {
        queue_counts(&queue).await.0 == 0
    })
    .await;
    drop(source);
    rabbit.close().await;
    conn.close(200, "bye".into()).await.expect("close");
    cleanup(&[&queue], &[]).await;
}

/// A publish that waited for a connection while its fence fell is never
/// sent. The sink's first endpoint accepts TCP and says nothing (a node
/// behind a cut link), so the sink waits there; the fence falls meanwhile
/// (the route moved to another instance), then that endpoint hangs up and
/// the second, the real broker, must not get the message. Without the
/// check at send time it arrived: a copy beside the next owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_publish_is_not_sent_once_its_fence_fell_while_it_waited() {
    use delayd_adapters::amqp::{AmqpSettings, Broker, BrokerOptions, Endpoints};
    logs();
    let _shared = BROKER.read().await;
    let queue = unique("fenced");
    let (conn, channel) = plain().await;
    declare_queue(&channel, &queue).await;

    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("amqp://guest:guest@{}/%2f", silent.local_addr().unwrap());
    let settings = AmqpSettings {
        urls: vec![silent_url, url()],
        ..AmqpSettings::default()
    };
    let mut options = BrokerOptions::named("fenced-test");
    // Never reached: the silent endpoint hangs up once the fence fell.
    options.connect_timeout = DEADLINE;
    let broker = Arc::new(Broker::with_endpoints(
        Arc::new(Endpoints::new(&settings).unwrap()),
        options,
    ));
    let sink = AmqpSink::new(broker, SinkConfig::default());

    let holds = Arc::new(AtomicBool::new(true));
    let fence: delayd_adapters::Fence = {
        let holds = holds.clone();
        Arc::new(move || holds.load(Ordering::SeqCst))
    };
    let publish = sink.publish_fenced(
        Message::with_body(b"late".to_vec()),
        Target::queue(&queue),
        fence,
    );
    // The sink is connecting to the silent endpoint: the fence falls now.
    let (held, _) = tokio::time::timeout(DEADLINE, silent.accept())
        .await
        .expect("the sink never tried the first endpoint")
        .unwrap();
    holds.store(false, Ordering::SeqCst);
    drop(held);
    let outcome = tokio::time::timeout(DEADLINE, publish)
        .await
        .expect("the publish never ended");
    match outcome {
        Err(delayd_adapters::SinkError::Transient(why)) => {
            assert_eq!(why, delayd_adapters::FENCED)
        }
        other => panic!("a fenced publish ended with {other:?}"),
    }
    // Anything sent would be in the queue by now: the publish only ends
    // after the broker's confirm.
    assert_eq!(
        queue_counts(&queue).await.0,
        0,
        "the fenced message was sent"
    );

    // A fence that holds publishes as usual.
    let outcome = sink
        .publish_fenced(
            Message::with_body(b"on time".to_vec()),
            Target::queue(&queue),
            Arc::new(|| true),
        )
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Delivered);
    eventually("the unfenced message arrives", || async {
        queue_counts(&queue).await.0 == 1
    })
    .await;
    drop(conn);
    cleanup(&[&queue], &[]).await;
}

/// `open_dedicated_from` starts at the endpoint it is given and wraps
/// around, and says which endpoint it reached: the broker-kept store moves
/// its next lock attempt off a node that left a registration unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_connection_starts_at_the_endpoint_asked_for_and_wraps_around() {
    use delayd_adapters::amqp::{AmqpSettings, Broker, BrokerOptions, Endpoints};
    logs();
    let _shared = BROKER.read().await;
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    // Two names of the one broker, and a port that refuses.
    let settings = AmqpSettings {
        urls: vec![
            url(),
            url().replace("127.0.0.1", "localhost"),
            format!("amqp://guest:guest@{refused}/%2f"),
        ],
        ..AmqpSettings::default()
    };
    let broker = Broker::with_endpoints(
        Arc::new(Endpoints::new(&settings).unwrap()),
        BrokerOptions::named("rotate-test"),
    );
    for (first, reached) in [(0, 0), (1, 1), (2, 0), (3, 0), (4, 1)] {
        let (connection, at) = broker.open_dedicated_from(first).await.unwrap();
        assert_eq!(at, reached, "starting at endpoint {first}");
        connection.close(200, "bye".into()).await.unwrap();
    }
    // Both ways round: the refused one is skipped whichever comes first.
    let settings = AmqpSettings {
        urls: vec![format!("amqp://guest:guest@{refused}/%2f"), url()],
        ..AmqpSettings::default()
    };
    let broker = Broker::with_endpoints(
        Arc::new(Endpoints::new(&settings).unwrap()),
        BrokerOptions::named("rotate-test"),
    );
    for first in 0..3 {
        let (connection, at) = broker.open_dedicated_from(first).await.unwrap();
        assert_eq!(at, 1, "starting at endpoint {first}");
        connection.close(200, "bye".into()).await.unwrap();
    }
}
