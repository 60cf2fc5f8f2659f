//! delayd end to end against a real Apache Kafka (KRaft, single node, via
//! `scripts/kafka.sh`, or any Kafka at `KAFKA_BOOTSTRAP`), and across to
//! RabbitMQ: delays honoured and never early, records byte-equal, Java
//! murmur2 placement, per-key order, tombstone cancel, SIGKILL, group
//! members stopping (the leader included), partitions added at run time,
//! three instances joining and leaving under load, invalid and unroutable
//! topics created by delayd, cross-broker routes.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use common::kafka::{
    self, assert_on_time, collect_same_ids, collect_unique, create_topic, value_of, wait_assigned,
    wait_assigned_partitions, KafkaRoute, Producer, Reader, Record, LATE_MS,
};
use common::{now_ms, seeded, wait_for, Delayd, DEADLINE};
use delayd_adapters::kafka::murmur2::partition_for_key;

/// A member killed with SIGKILL holds its partitions until its session
/// expires (`session.timeout.ms` in the harness's config): records on them
/// wait that long more before another member, or its restart, takes them.
const SESSION_MS: u64 = 6000;

/// Headers delayd adds or rewrites on the way out.
fn without_delayd_headers(headers: &[(String, Option<Vec<u8>>)]) -> Vec<(String, Option<Vec<u8>>)> {
    headers
        .iter()
        .filter(|(n, _)| n != "x-delay" && n != "x-delayd-id")
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delays_are_honoured_and_records_arrive_byte_equal_where_java_puts_them() {
    let r = KafkaRoute::new("bytes", 4).await;
    let delayd = r.start("").await;
    // delayd consumes, and the reader reads, before anything is sent: due
    // and arrival times are measured from the send.
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let mut sent = Vec::new();
    for i in 0..40u32 {
        let delay = 300 + (i % 8) * 250;
        let record = Record::new(&format!("order-{i}"), &[i as u8, 0, 255, b'{'])
            .header("x-delay", Some(delay.to_string().as_bytes()))
            .header("trace", Some(&[0xde, 0xad, 0xbe, 0xef]))
            .header("trace", Some(b"second value, same name"))
            .header("empty", Some(b""))
            .header("null", None);
        let published = now_ms();
        producer.send(&r.from, &record).await;
        sent.push((record, published, delay as u64));
    }
    let got = reader.collect(sent.len(), Duration::from_secs(60));
    for (record, published, delay) in &sent {
        let out = got
            .iter()
            .find(|g| g.key == record.key)
            .unwrap_or_else(|| panic!("{:?} did not arrive", record.key));
        assert!(
            out.received_ms >= published + delay,
            "early: published {published}, delay {delay}, received {}",
            out.received_ms
        );
        assert!(
            out.received_ms < published + delay + LATE_MS,
            "late: published {published}, delay {delay}, received {}",
            out.received_ms
        );
        assert_eq!(out.value, record.value, "value byte-equal");
        assert_eq!(
            without_delayd_headers(&out.headers),
            without_delayd_headers(&record.headers),
            "headers byte-equal, in order, duplicates and nulls kept"
        );
        assert_eq!(out.header_text("x-delay"), Some(format!("-{delay}")));
        assert!(out.header_text("x-delayd-id").is_some());
        let key = record.key.as_deref().unwrap();
        assert_eq!(
            out.partition,
            partition_for_key(key, 4),
            "Java murmur2 placement"
        );
        let ts = out.timestamp_ms.expect("a timestamp") as u64;
        assert!(ts >= published + delay, "the timestamp is the fire time");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_due_times_keep_per_key_order() {
    let r = KafkaRoute::new("order", 3).await;
    let delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let due = now_ms() + 6000;
    let keys = 6;
    let per_key = 40;
    for seq in 0..per_key {
        for k in 0..keys {
            let record = Record::new(&format!("key-{k}"), format!("{seq}").as_bytes())
                .header("x-deliver-at", Some(due.to_string().as_bytes()));
            producer.send(&r.from, &record).await;
        }
    }
    // Every record must be stored before the common due time, or the later
    // ones fire as they arrive and the test says nothing of equal deadlines.
    wait_for("delayd to store every record", DEADLINE, || async {
        (delayd.pending() == (keys * per_key) as u64).then_some(())
    })
    .await;
    assert!(
        now_ms() < due,
        "storing took {} ms past the due time: equal deadlines not exercised",
        now_ms() - due
    );
    let got = reader.collect(keys * per_key, Duration::from_secs(60));
    let mut by_key: BTreeMap<Vec<u8>, Vec<u32>> = BTreeMap::new();
    for g in &got {
        // delayd stamps the record when it publishes it.
        let fired = g.timestamp_ms.expect("a timestamp") as u64;
        assert!(fired >= due, "early by {} ms", due - fired);
        assert!(
            g.received_ms >= due && g.received_ms < due + LATE_MS,
            "received {} ms after the common due time",
            g.received_ms as i64 - due as i64
        );
        let seq: u32 = String::from_utf8_lossy(g.value.as_deref().unwrap())
            .parse()
            .unwrap();
        by_key.entry(g.key.clone().unwrap()).or_default().push(seq);
    }
    assert_eq!(by_key.len(), keys);
    for (key, seqs) in by_key {
        let expected: Vec<u32> = (0..per_key as u32).collect();
        assert_eq!(seqs, expected, "order of {}", String::from_utf8_lossy(&key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_cancels_the_pending_message_with_its_key() {
    let r = KafkaRoute::new("tombstone", 2).await;
    let delayd = r.start("cancel_on_tombstone = true").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let due = now_ms() + 4000;
    for key in ["cancel-me", "keep-me"] {
        let record =
            Record::new(key, b"payload").header("x-deliver-at", Some(due.to_string().as_bytes()));
        producer.send(&r.from, &record).await;
    }
    let tombstone = Record {
        key: Some(b"cancel-me".to_vec()),
        value: None,
        ..Record::default()
    };
    producer.send(&r.from, &tombstone).await;
    let kept = reader.collect(1, Duration::from_secs(30));
    assert_eq!(kept[0].key.as_deref(), Some(&b"keep-me"[..]));
    assert!(
        kept[0].received_ms >= due && kept[0].received_ms < due + LATE_MS,
        "kept record received {} ms after its due time",
        kept[0].received_ms as i64 - due as i64
    );
    // Both were due at the same instant. delayd cancelled one and published
    // one, and holds nothing more: the cancelled one can never arrive.
    wait_for("the cancel and the fire counted", DEADLINE, || async {
        (delayd.metric("delayd_cancelled_total") >= 1.0
            && delayd.metric("delayd_fired_total") >= 1.0)
            .then_some(())
    })
    .await;
    assert_eq!(delayd.metric("delayd_cancelled_total"), 1.0, "cancelled");
    assert_eq!(delayd.metric("delayd_fired_total"), 1.0, "fired");
    assert_eq!(delayd.pending(), 0);
    // Had the cancel failed, the cancelled record would leave at its due
    // time and arrive within LATE_MS, as the kept one did: watch the
    // target topic until then.
    let watch_until =
        Instant::now() + Duration::from_millis((due + LATE_MS).saturating_sub(now_ms()));
    let extra = reader.drain_until(watch_until);
    assert!(extra.is_empty(), "cancelled message arrived: {extra:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_delays_go_to_the_invalid_topic_with_a_reason() {
    let r = KafkaRoute::new("invalid", 1).await;
    let invalid = kafka::topic("invalid", "parked");
    let _delayd = r
        .start(&format!(
            "invalid = {{ topic = {} }}",
            common::toml_string(&invalid)
        ))
        .await;
    let producer = Producer::new();
    let record = Record::new("bad", b"body").header("x-delay", Some(b"soon"));
    producer.send(&r.from, &record).await;
    let parked = Reader::new(&invalid).collect(1, Duration::from_secs(30));
    assert_eq!(parked[0].value.as_deref(), Some(&b"body"[..]));
    assert_eq!(parked[0].key.as_deref(), Some(&b"bad"[..]));
    let reason = parked[0].header_text("x-delayd-error").expect("a reason");
    assert!(reason.contains("x-delay"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_nothing_acknowledged() {
    let r = KafkaRoute::new("sigkill", 4).await;
    let mut delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let total = 1500u32;
    let kill_at = seeded("kafka sigkill: kill at record", 100..1400) as u32;
    // Per record: the wall clock just before it was sent (delayd cannot have
    // seen it earlier), and its delay.
    let mut sent = Vec::new();
    for i in 0..total {
        if i == kill_at {
            delayd.kill_9();
        }
        let delay = 1000 + u64::from(i % 20) * 100;
        let record = Record::new(&format!("k{}", i % 50), format!("{i}").as_bytes())
            .header("x-delay", Some(delay.to_string().as_bytes()));
        sent.push((now_ms(), delay));
        producer.send(&r.from, &record).await;
    }
    // Restarted at once: the broker rebalances the group when the killed
    // member's session expires, and the new one takes its partitions.
    delayd.restart().await;
    wait_assigned(&delayd).await;
    let assigned_ms = now_ms();
    // One instance with its own WAL: a record comes twice only as the same
    // stored record published again (its Done lost), with the same id.
    let (got, duplicates) = collect_same_ids(&reader, total, Duration::from_secs(90));
    println!("kafka sigkill: killed at record {kill_at}, {duplicates} duplicates");
    // Whatever was due or sent while delayd was down leaves once the
    // restarted instance holds the partitions.
    assert_on_time(&got, &sent, |_| assigned_ms, LATE_MS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_leader_stopping_loses_nothing() {
    let r = KafkaRoute::new("group", 4).await;
    // `leader` joins first, so the broker makes it the group leader.
    let mut leader = r.start("").await;
    wait_assigned(&leader).await;
    let other = r.start("").await;
    // Both hold partitions: the group has split the topic between them.
    wait_assigned(&other).await;
    wait_assigned(&leader).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let total = 600u32;
    let half = total / 2;
    let mut sent = Vec::new();
    let mut stopped_ms = 0;
    for i in 0..total {
        if i == half {
            // The leader leaves with records pending in it and in flight to
            // both; the other member takes its partitions.
            let status = leader.sigterm_and_wait(Duration::from_secs(30)).await;
            assert!(status.success(), "SIGTERM exit: {status}");
            stopped_ms = now_ms();
        }
        let record = Record::new(&format!("k{}", i % 40), format!("{i}").as_bytes())
            .header("x-delay", Some(b"300"));
        sent.push((now_ms(), 300));
        producer.send(&r.from, &record).await;
    }
    // Everything sent after the stop can only go through the member left.
    let mut got: HashMap<u32, Record> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (half..total).any(|i| !got.contains_key(&i)) {
        let Some(g) = reader.next(deadline) else {
            let missing = (half..total).filter(|i| !got.contains_key(i)).count();
            panic!("{missing} records sent after the stop never arrived");
        };
        got.entry(value_of(&g)).or_insert(g);
    }
    // What the stopped leader had stored waits in its WAL until it is back.
    leader.restart().await;
    let restarted_ms = now_ms();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < total as usize {
        let Some(g) = reader.next(deadline) else {
            panic!("{} of {total} arrived after the restart", got.len());
        };
        got.entry(value_of(&g)).or_insert(g);
    }
    // A record sent before the stop may have waited in the leader's WAL
    // until its restart (its stored messages fire as it starts); one sent
    // after, only for the member left to take the leader's partitions (it
    // left the group cleanly, so no session has to expire).
    assert_on_time(
        &got,
        &sent,
        |i| if i < half { restarted_ms } else { stopped_ms },
        LATE_MS,
    );
    drop(other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_at_run_time_are_consumed() {
    let r = KafkaRoute::new("grow", 1).await;
    let delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    kafka::add_partitions(&r.from, 3).await;
    // A producer made after the change sees all three partitions.
    let producer = Producer::new();
    let mut sent = Vec::new();
    for i in 0..30u32 {
        let record = Record::new(&format!("k{i}"), format!("{i}").as_bytes())
            .header("x-delay", Some(b"200"));
        sent.push((now_ms(), 200));
        producer.send_to(&r.from, (i % 3) as i32, &record).await;
    }
    // delayd's consumer notices the new partitions at its next metadata
    // refresh (10 s by default) and the group rebalances; records on them
    // wait for that, the others not.
    wait_assigned_partitions(&delayd, 3).await;
    let grown_ms = now_ms();
    let got = collect_unique(&reader, 30, Duration::from_secs(60));
    assert_on_time(
        &got,
        &sent,
        |i| if i % 3 == 0 { 0 } else { grown_ms },
        LATE_MS,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_joining_and_leaving_under_load_lose_nothing() {
    let r = KafkaRoute::new("churn", 6).await;
    let mut a = r.start("").await;
    wait_assigned(&a).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let total = 2400u32;
    // Between A leaving and A coming back.
    let kill_b_at = seeded("kafka churn: kill b at record", 1150..1750) as u32;
    let mut sent = Vec::new();
    let mut b: Option<Delayd> = None;
    let mut c: Option<Delayd> = None;
    for i in 0..total {
        // Membership changes at points in the stream, with records pending
        // and in flight: B joins, C joins, A leaves, B is killed (at a
        // seeded point), A comes back, B comes back.
        match i {
            300 => b = Some(r.start("").await),
            700 => c = Some(r.start("").await),
            1100 => {
                let status = a.sigterm_and_wait(Duration::from_secs(30)).await;
                assert!(status.success(), "SIGTERM exit: {status}");
            }
            i if i == kill_b_at => b.as_mut().expect("b started").kill_9(),
            1800 => a.restart().await,
            2100 => b.as_mut().expect("b started").restart().await,
            _ => {}
        }
        let delay = 500 + u64::from(i % 16) * 150;
        let record = Record::new(&format!("k{}", i % 64), format!("{i}").as_bytes())
            .header("x-delay", Some(delay.to_string().as_bytes()));
        sent.push((now_ms(), delay));
        producer.send(&r.from, &record).await;
    }
    // The last change: B back (with what its WAL held since the kill) and
    // the group settled.
    let b = b.expect("b started");
    wait_assigned(&b).await;
    let settled_ms = now_ms();
    let got = collect_unique(&reader, total, Duration::from_secs(120));
    // Bounded by the last change, plus a session timeout: a rebalance may
    // still wait for a member's session to expire.
    assert_on_time(&got, &sent, |_| settled_ms, SESSION_MS + LATE_MS);
    drop(c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_and_unroutable_topics_are_created_by_delayd() {
    // The test broker runs with auto.create.topics.enable=false, so only an
    // explicit CreateTopics makes these exist.
    let r = KafkaRoute::new("park", 2).await;
    let invalid = kafka::topic("park", "invalid");
    let unroutable = kafka::topic("park", "unroutable");
    let missing = kafka::topic("park", "missing");
    assert!(!kafka::topic_exists(&invalid).await);
    assert!(!kafka::topic_exists(&unroutable).await);
    let _delayd = r
        .start(&format!(
            "invalid = {{ topic = {} }}\nunroutable = {{ topic = {} }}\nallow_target_override = true",
            common::toml_string(&invalid),
            common::toml_string(&unroutable)
        ))
        .await;
    let producer = Producer::new();
    let bad = Record::new("bad", b"bad body").header("x-delay", Some(b"later"));
    producer.send(&r.from, &bad).await;
    let lost = Record::new("lost", b"nowhere to go")
        .header("x-delay", Some(b"100"))
        .header("x-target-topic", Some(missing.as_bytes()));
    producer.send(&r.from, &lost).await;
    let parked = Reader::new(&invalid).collect(1, Duration::from_secs(30));
    assert_eq!(parked[0].value.as_deref(), Some(&b"bad body"[..]));
    let reason = parked[0].header_text("x-delayd-error").expect("a reason");
    assert!(reason.contains("x-delay"), "{reason}");
    let parked = Reader::new(&unroutable).collect(1, Duration::from_secs(60));
    assert_eq!(parked[0].value.as_deref(), Some(&b"nowhere to go"[..]));
    assert_eq!(parked[0].key.as_deref(), Some(&b"lost"[..]));
    let reason = parked[0].header_text("x-delayd-error").expect("a reason");
    assert!(reason.contains(&missing), "{reason}");
    assert!(
        !kafka::topic_exists(&missing).await,
        "delayd must not create a target topic"
    );
}

/// A delayd with both brokers and one route `from` → `to` (TOML inline tables).
async fn start_cross(route: &str, from: &str, to: &str) -> Delayd {
    Delayd::start_with(|wal, http| {
        format!(
            r#"[wal]
dir = {wal}
create_dir = true

[http]
listen = "{http}"

[brokers.kafka]
kind = "kafka"
bootstrap = {bootstrap}

[brokers.rabbit]
kind = "amqp"
url = {url}

[[routes]]
name = {route}
from = {from}
to = {to}
"#,
            wal = common::toml_string(wal.to_str().unwrap()),
            bootstrap = common::toml_string(&kafka::bootstrap()),
            url = common::toml_string(&common::amqp_url()),
            route = common::toml_string(route),
        )
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_to_rabbitmq_maps_key_and_amqp_headers() {
    let from = kafka::topic("k2r", "in");
    create_topic(&from, 1).await;
    let names = common::Names::new("k2r");
    let _cleanup = names.cleanup();
    let client = common::Client::connect("delayd-it-k2r").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let delayd = start_cross(
        "it-k2r",
        &format!(
            "{{ broker = \"kafka\", topics = [{}], group = {} }}",
            common::toml_string(&from),
            common::toml_string(&format!("delayd-it.k2r.{}", common::unique_suffix()))
        ),
        &format!(
            "{{ broker = \"rabbit\", exchange = {} }}",
            common::toml_string(&names.to_exchange)
        ),
    )
    .await;
    // delayd consumes, and the test too, before the record is sent.
    wait_assigned(&delayd).await;
    let mut receiver = client.consume(&names.target_queue).await;
    let record = Record::new("order.7", b"{\"id\":7}")
        .header("x-delay", Some(b"400"))
        .header("amqp.content_type", Some(b"application/json"))
        .header("amqp.priority", Some(b"5"))
        .header("amqp.message_id", Some(b"order-7"))
        .header("tenant", Some(&[0x61, 0xff]));
    let published = now_ms();
    Producer::new().send(&from, &record).await;
    let got = receiver.expect("the record, as an AMQP message").await;
    assert!(got.at_ms >= published + 400, "early");
    assert!(
        got.at_ms < published + 400 + LATE_MS,
        "{} ms late",
        got.at_ms - published - 400
    );
    assert_eq!(got.delivery.data, b"{\"id\":7}");
    assert_eq!(
        got.delivery.routing_key.as_str(),
        "order.7",
        "routing key = Kafka key"
    );
    let p = got.properties();
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(*p.priority(), Some(5));
    assert_eq!(got.message_id(), Some("order-7"));
    assert_eq!(
        *p.delivery_mode(),
        Some(2),
        "persistent unless told otherwise"
    );
    match got.header("tenant") {
        Some(lapin::types::AMQPValue::LongString(s)) => assert_eq!(s.as_bytes(), &[0x61, 0xff]),
        other => panic!("tenant header: {other:?}"),
    }
    assert!(
        got.header("amqp.priority").is_none(),
        "mapped headers are removed"
    );
    assert!(got.header("x-delayd-id").is_some());
    receiver.close().await;
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_to_kafka_maps_message_id_properties_and_typed_headers() {
    use lapin::types::{AMQPValue, FieldTable as AmqpTable, ShortString};
    let to = kafka::topic("r2k", "out");
    create_topic(&to, 3).await;
    let names = common::Names::new("r2k");
    let _cleanup = names.cleanup();
    let _delayd = start_cross(
        "it-r2k",
        &format!(
            "{{ broker = \"rabbit\", queue = {}, exchange = {} }}",
            common::toml_string(&names.from_queue),
            common::toml_string(&names.from_exchange)
        ),
        &format!(
            "{{ broker = \"kafka\", topic = {} }}",
            common::toml_string(&to)
        ),
    )
    .await;
    let client = common::Client::connect("delayd-it-r2k").await;
    common::wait_for("delayd consuming its queue", common::DEADLINE, || async {
        match client.queue_counts(&names.from_queue).await {
            Some((_, consumers)) if consumers > 0 => Some(()),
            _ => None,
        }
    })
    .await;
    let mut headers = AmqpTable::default();
    headers.insert(ShortString::from("x-delay"), AMQPValue::LongInt(400));
    headers.insert(ShortString::from("count"), AMQPValue::LongInt(42));
    headers.insert(ShortString::from("flag"), AMQPValue::Boolean(true));
    let properties = lapin::BasicProperties::default()
        .with_message_id("m-1".into())
        .with_content_type("text/plain".into())
        .with_headers(headers);
    let reader = Reader::new(&to);
    let published = now_ms();
    client
        .publish(&names.from_exchange, "audit.created", b"hello", properties)
        .await;
    let got = reader.collect(1, Duration::from_secs(30));
    let r = &got[0];
    let fired = r.timestamp_ms.expect("a timestamp") as u64;
    assert!(
        r.received_ms >= published + 400 && fired >= published + 400,
        "early"
    );
    assert!(
        r.received_ms < published + 400 + LATE_MS,
        "{} ms late",
        r.received_ms - published - 400
    );
    assert_eq!(r.value.as_deref(), Some(&b"hello"[..]));
    assert_eq!(r.key.as_deref(), Some(&b"m-1"[..]), "key = message_id");
    assert_eq!(r.partition, partition_for_key(b"m-1", 3));
    assert_eq!(r.header_text("amqp.message_id").as_deref(), Some("m-1"));
    assert_eq!(
        r.header_text("amqp.content_type").as_deref(),
        Some("text/plain")
    );
    assert_eq!(r.header_text("count").as_deref(), Some("42"));
    assert_eq!(r.header_text("flag").as_deref(), Some("true"));
    assert_eq!(r.header_text("x-delay").as_deref(), Some("-400"));
    client.close().await;
}
