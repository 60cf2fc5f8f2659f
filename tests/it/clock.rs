//! What a delay counts from (`delay_from = "broker"`, the default): the
//! moment the broker took the message, not the moment delayd read it. With
//! delayd down for 12 s while messages with 4 s delays are published, all
//! leave within 2 s of the restart, none early; counted from the read,
//! they left 4 s after it (12 s late).

use crate::common;

use std::time::{Duration, Instant};

use common::kafka::{collect_unique, wait_assigned, KafkaRoute, Producer, Reader, Record};
use common::{now_ms, wait_for, Client, Delayd, DelaydOptions, Names, DEADLINE};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

const COUNT: usize = 50;
const DELAY_MS: u64 = 4000;
/// How long delayd stays down once the first message is published.
const DOWN_MS: u64 = 12_000;
/// Every message leaves within this of the restarted delayd's first read.
const BACK_WITHIN_MS: u64 = 2000;

/// Sleeps until `DOWN_MS` after `since_ms`: the outage the scenario injects
/// (a fixed span on purpose, not a wait for something to happen).
async fn stay_down(since_ms: u64) {
    let until = since_ms + DOWN_MS;
    let now = now_ms();
    if until > now {
        tokio::time::sleep(Duration::from_millis(until - now)).await;
    }
}

/// Reads record `i` (its value) for each send time `sent[i]`, checks that
/// none left before its `DELAY_MS`, and returns when each arrived.
fn received_none_early(reader: &Reader, sent: &[u64]) -> Vec<u64> {
    let got = collect_unique(reader, sent.len() as u32, Duration::from_secs(30));
    sent.iter()
        .enumerate()
        .map(|(i, &sent_ms)| {
            let received_ms = got[&(i as u32)].received_ms;
            assert!(
                received_ms >= sent_ms + DELAY_MS,
                "record {i} early: sent {sent_ms}, received {received_ms}"
            );
            received_ms
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_delays_count_from_the_record_timestamp() {
    let r = KafkaRoute::new("clock", 2).await;
    let mut delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let status = delayd.sigterm_and_wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "log:\n{}", delayd.log_tail(40));

    // An idempotent producer: its first record waits for a producer id,
    // which must not make it late either (the record's timestamp is when
    // the producer made it).
    let producer = Producer::new();
    let first_ms = now_ms();
    let mut sent = Vec::new();
    for i in 0..COUNT {
        let record = Record::new(&format!("k{i}"), format!("{i}").as_bytes())
            .header("x-delay", Some(DELAY_MS.to_string().as_bytes()));
        sent.push(now_ms());
        producer.send(&r.from, &record).await;
    }
    stay_down(first_ms).await;
    delayd.restart().await;
    wait_assigned(&delayd).await;
    let back_ms = now_ms();
    let worst = received_none_early(&reader, &sent)
        .iter()
        .map(|&received| received.saturating_sub(back_ms))
        .max()
        .unwrap_or(0);
    println!("kafka: last record {worst} ms after the restarted delayd held its partitions");
    assert!(
        worst <= BACK_WITHIN_MS,
        "a record left {worst} ms after the restart: its delay counted from delayd's read"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_delays_count_from_the_broker_s_timestamp() {
    if common::rabbitmq_major().is_some_and(|v| v < 4) {
        // 3.x before 3.12 has no message interceptors: no broker timestamp
        // to count from (docs/headers.md). The 4.3 test broker stamps one.
        eprintln!(
            "skipped: RabbitMQ {:?} stamps no timestamp_in_ms",
            common::rabbitmq_major()
        );
        return;
    }
    let names = Names::new("clock");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-clock").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let mut delayd = Delayd::start(&names, DelaydOptions::default()).await;
    let status = delayd.sigterm_and_wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "log:\n{}", delayd.log_tail(40));

    // delayd declared the exchange and its queue: they wait in the broker.
    let first_ms = now_ms();
    let mut sent = Vec::new();
    for i in 0..COUNT {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-delay"),
            AMQPValue::LongLongInt(DELAY_MS as i64),
        );
        let props = BasicProperties::default()
            .with_message_id(format!("clock-{i}").as_str().into())
            .with_headers(headers);
        sent.push(now_ms());
        client
            .publish(&names.from_exchange, "k", format!("{i}").as_bytes(), props)
            .await;
    }
    let mut receiver = client.consume(&names.target_queue).await;
    stay_down(first_ms).await;
    delayd.restart().await;
    // Consuming again (the broker sees its consumer).
    let restart_ms = now_ms();
    let deadline = Instant::now() + DEADLINE;
    let mut worst = 0;
    let mut arrived = std::collections::BTreeSet::new();
    while arrived.len() < COUNT {
        let received = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {COUNT} arrived", arrived.len()));
        let i: usize = received
            .message_id()
            .and_then(|id| id.strip_prefix("clock-"))
            .and_then(|n| n.parse().ok())
            .expect("one of ours");
        assert!(received.at_ms >= sent[i] + DELAY_MS, "clock-{i} early");
        assert!(
            received.header("timestamp_in_ms").is_some(),
            "the broker stamps no timestamp_in_ms: is the set_header_timestamp interceptor on?"
        );
        worst = worst.max(received.at_ms.saturating_sub(restart_ms));
        arrived.insert(i);
    }
    receiver.close().await;
    println!("rabbitmq: last message {worst} ms after the restart");
    assert!(
        worst <= BACK_WITHIN_MS,
        "a message left {worst} ms after the restart: its delay counted from delayd's read"
    );
    wait_for("nothing pending", DEADLINE, || async {
        (delayd.pending() == 0).then_some(())
    })
    .await;
    client.close().await;
}

/// A consumer that sends a message it got from delayd back for another
/// try, with all its headers and a new `x-delay` (what retry helpers do),
/// brings the broker's stamp of the message's first publish, and the broker
/// keeps it (`overwrite = false`, scripts/rabbitmq/delayd.conf). The new
/// delay must count from the new publish: counted from the old stamp it
/// would be over before the message was sent back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_back_after_delayd_delivered_it_counts_from_its_new_publish() {
    const FIRST_MS: u64 = 500;
    const AGAIN_MS: u64 = 3000;
    if common::rabbitmq_major().is_some_and(|v| v < 4) {
        eprintln!(
            "skipped: RabbitMQ {:?} stamps no timestamp_in_ms",
            common::rabbitmq_major()
        );
        return;
    }
    let names = Names::new("clock-back");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-clock-back").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let delayd = Delayd::start(&names, DelaydOptions::default()).await;
    let mut receiver = client.consume(&names.target_queue).await;
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(FIRST_MS as i64),
    );
    let props = BasicProperties::default()
        .with_message_id("back-1".into())
        .with_headers(headers);
    client
        .publish(&names.from_exchange, "k", b"try me", props)
        .await;
    let first = receiver.expect("the first delivery").await;
    let stamp = first.header("timestamp_in_ms").cloned().expect(
        "the broker stamps no timestamp_in_ms: is the set_header_timestamp interceptor on?",
    );
    assert!(first.header("x-delayd-id").is_some());
    // The consumer works on it for longer than the new delay (a fixed span
    // on purpose: the age of the stamp it sends back).
    tokio::time::sleep(Duration::from_millis(AGAIN_MS + 1000)).await;
    let mut back = first.properties().headers().clone().unwrap_or_default();
    back.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(AGAIN_MS as i64),
    );
    let sent_back_ms = now_ms();
    client
        .publish(
            &names.from_exchange,
            "k",
            b"try me",
            first.properties().clone().with_headers(back),
        )
        .await;
    let again = receiver.expect("the delivery sent back").await;
    assert_eq!(
        again.header("timestamp_in_ms"),
        Some(&stamp),
        "the broker stamped the message sent back anew (set_header_timestamp.overwrite = true?): the case is not exercised"
    );
    assert!(
        again.at_ms >= sent_back_ms + AGAIN_MS,
        "sent back with x-delay {AGAIN_MS} ms, delivered {} ms after: its delay counted from its first publish",
        again.at_ms - sent_back_ms
    );
    receiver.close().await;
    drop(delayd);
    client.close().await;
}

/// A producer whose clock is 10 s ahead of delayd's host: its records'
/// timestamps are in delayd's future. Their delays count from delayd's own
/// clock then (never from a time that has not come), so none leaves early
/// by delayd's clock, and delayd reports the skew
/// (`delayd_clock_behind_broker_seconds`, a warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_time_ahead_of_delayd_s_clock_is_reported_and_never_makes_a_message_early() {
    const AHEAD_MS: i64 = 10_000;
    const COUNT: usize = 5;
    let r = KafkaRoute::new("clock-skew", 1).await;
    let delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let producer = Producer::new();
    let mut sent = Vec::new();
    for i in 0..COUNT {
        let record = Record::new(&format!("k{i}"), format!("{i}").as_bytes())
            .header("x-delay", Some(DELAY_MS.to_string().as_bytes()))
            .at(now_ms() as i64 + AHEAD_MS);
        sent.push(now_ms());
        producer.send(&r.from, &record).await;
    }
    let received = received_none_early(&reader, &sent);
    for (i, (&sent_ms, &received_ms)) in sent.iter().zip(&received).enumerate() {
        // Counted from delayd's read, not from the producer's future time.
        assert!(
            received_ms < sent_ms + DELAY_MS + AHEAD_MS as u64 / 2,
            "record {i} waited for the producer's clock: sent {sent_ms}, received {received_ms}"
        );
    }
    let behind = delayd.metric("delayd_clock_behind_broker_seconds");
    assert!(
        (8.0..=10.5).contains(&behind),
        "delayd_clock_behind_broker_seconds = {behind}"
    );
    assert!(
        delayd
            .log_tail(200)
            .contains("broker time is ahead of this host's clock"),
        "no warning about the clocks:\n{}",
        delayd.log_tail(40)
    );
}
