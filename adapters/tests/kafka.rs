//! The Kafka adapter against a real Kafka-protocol broker at 127.0.0.1:9092
//! (`KAFKA_BOOTSTRAP` overrides; `scripts/kafka.sh` starts Apache Kafka there).
#![cfg(feature = "kafka")]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use delayd_adapters::kafka::murmur2::partition_for_key;

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
use delayd_adapters::kafka::{KafkaClientConfig, KafkaSink, KafkaSource, KafkaSourceConfig};
use delayd_adapters::{Message, PublishOutcome, SinkError, Source, Target, Value};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

fn bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("delayd-test-{name}-{}-{nanos}", std::process::id())
}

async fn create_topic(name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            [&NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .expect("create_topics");
    for r in results {
        r.expect("topic created");
    }
}

fn committed(group: &str, topic: &str, partition: i32) -> Option<i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let c = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .ok()?;
    match c.elements()[0].offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_round_trip_with_key_value_headers_and_commits() {
    init_logs();
    let client = KafkaClientConfig::new(bootstrap());
    let topic = unique("roundtrip");
    create_topic(&topic, 4).await;
    let sink = KafkaSink::new(&client).unwrap();

    let mut sent = Vec::new();
    for i in 0..20u32 {
        let mut m = Message::with_body(format!("body-{i}").into_bytes());
        m.key = Some(format!("key-{i}").into_bytes());
        m.headers
            .0
            .push(("h".into(), Value::LongString(vec![0, 1, 255])));
        m.headers
            .0
            .push(("h".into(), Value::LongString(b"dup".to_vec())));
        m.headers.0.push(("null".into(), Value::Void));
        let outcome = sink.enqueue(&m, &Target::exchange(&topic)).await.unwrap();
        assert_eq!(outcome, PublishOutcome::Delivered);
        sent.push(m);
    }
    let tomb = Message {
        key: Some(b"gone".to_vec()),
        null_value: true,
        ..Message::default()
    };
    sink.enqueue(&tomb, &Target::exchange(&topic))
        .await
        .unwrap();

    let group = unique("group");
    let mut source: Box<dyn Source> = Box::new(
        KafkaSource::start(&client, KafkaSourceConfig::new(vec![topic.clone()], &group)).unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < 21 {
        let left = deadline.saturating_duration_since(Instant::now());
        let d = tokio::time::timeout(left, source.next())
            .await
            .expect("records within 30 s")
            .unwrap();
        got.push(d.message.clone());
        d.ack.ack().await.expect("ack committed");
    }
    for m in &sent {
        let r = got
            .iter()
            .find(|g| g.key == m.key)
            .expect("every record arrives");
        assert_eq!(r.body, m.body);
        assert_eq!(r.headers, m.headers);
        assert!(!r.null_value);
        let key = m.key.as_deref().unwrap();
        assert_eq!(
            r.partition,
            Some(partition_for_key(key, 4)),
            "murmur2 placement"
        );
        assert_eq!(r.source, topic);
    }
    let t = got
        .iter()
        .find(|g| g.key.as_deref() == Some(b"gone"))
        .unwrap();
    assert!(t.null_value && t.body.is_empty());
    source.close().await;
    let total: i64 = (0..4).filter_map(|p| committed(&group, &topic, p)).sum();
    assert_eq!(total, 21, "every offset committed after the acks");
}

async fn next(source: &mut dyn Source) -> delayd_adapters::Delivery {
    tokio::time::timeout(Duration::from_secs(30), source.next())
        .await
        .expect("a record within 30 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_records_are_read_again_by_the_next_consumer() {
    let client = KafkaClientConfig::new(bootstrap());
    let topic = unique("unacked");
    create_topic(&topic, 1).await;
    let sink = KafkaSink::new(&client).unwrap();
    for i in 0..5u32 {
        let m = Message::with_body(format!("{i}").into_bytes());
        sink.enqueue(&m, &Target::exchange(&topic)).await.unwrap();
    }
    let group = unique("group");
    let mut first: Box<dyn Source> = Box::new(
        KafkaSource::start(&client, KafkaSourceConfig::new(vec![topic.clone()], &group)).unwrap(),
    );
    // Ack 0 and 1, leave 2 unsettled, ack 3: only 0..2 may be committed.
    let d0 = next(&mut *first).await;
    let d1 = next(&mut *first).await;
    let d2 = next(&mut *first).await;
    let d3 = next(&mut *first).await;
    d0.ack.ack().await.unwrap();
    d1.ack.ack().await.unwrap();
    let pending = d3.ack.ack();
    drop(d2);
    first.close().await;
    assert!(pending.await.is_err(), "3 cannot be committed past 2");
    assert_eq!(committed(&group, &topic, 0), Some(2));

    let mut second: Box<dyn Source> = Box::new(
        KafkaSource::start(&client, KafkaSourceConfig::new(vec![topic.clone()], &group)).unwrap(),
    );
    let again = next(&mut *second).await;
    assert_eq!(again.message.body, b"2");
    assert!(again.redelivered);
    second.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_topic_is_reported_at_once() {
    let client = KafkaClientConfig::new(bootstrap());
    let sink = KafkaSink::new(&client).unwrap();
    let topic = unique("missing");
    let outcome = sink
        .enqueue(&Message::with_body(&b"x"[..]), &Target::exchange(&topic))
        .await;
    assert!(
        matches!(outcome, Err(SinkError::UnknownTarget(_))),
        "{outcome:?}"
    );
    // Once it exists, the same sink publishes there.
    sink.ensure_topic(&topic).await.unwrap();
    let outcome = sink
        .enqueue(&Message::with_body(&b"x"[..]), &Target::exchange(&topic))
        .await;
    assert_eq!(outcome.unwrap(), PublishOutcome::Delivered);
}
