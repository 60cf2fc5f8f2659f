//! A RabbitMQ stream as a route's ingress (`from.queue_type = "stream"`):
//! every message has an exact identity, (stream, offset), so byte-identical
//! messages published back to back (twins) are two messages through a
//! kill -9, each under its own `x-delayd-id`; and a stream whose retention
//! removed messages delayd had not read says so loudly.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{
    assert_confirmed, now_ms, seeded, wait_for, Delayd, DelaydOptions, Names, Setup, DEADLINE,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

const ROUTING_KEY: &str = "order.recompute";

/// A test's route reading a stream (`from_extra`: more keys of its
/// `from`), its target declared, and delayd consuming.
async fn setup(test: &str, from_extra: &str) -> Setup {
    let names = Names::new(test);
    let opts = DelaydOptions {
        from_extra: format!(", queue_type = \"stream\"{from_extra}"),
        ..DelaydOptions::default()
    };
    let cleanup = names.cleanup();
    let client = common::Client::connect(&format!("delayd-it-{}", names.route)).await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    // A stream's consumers are not counted by a passive declare: wait for
    // delayd's own report instead.
    let delayd =
        Delayd::start_with(|wal, http| common::config_toml(&names, wal, http, &opts)).await;
    wait_consuming(&delayd, &names.route).await;
    Setup {
        names,
        _cleanup: cleanup,
        delayd,
        client,
    }
}

/// Wait until `/readyz` says the route consumes.
async fn wait_consuming(delayd: &Delayd, route: &str) {
    wait_for("the stream route to consume", DEADLINE, || {
        let state = delayd.readyz()["routes"][route].clone();
        async move { (state == "consuming").then_some(()) }
    })
    .await;
}

/// Start delayd again and wait until its route consumes.
async fn restart(s: &mut Setup) {
    s.delayd.restart().await;
    wait_consuming(&s.delayd, &s.names.route).await;
}

/// The pair's body and delay (1–3 s).
fn twin(k: u64) -> (Vec<u8>, u64) {
    (
        format!("recompute order {k}").into_bytes(),
        1000 + (k * 37) % 2000,
    )
}

fn twin_properties(delay_ms: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(delay_ms as i64),
    );
    headers.insert(
        ShortString::from("tenant"),
        AMQPValue::LongString(LongString::from("eu-1")),
    );
    // No message_id: the two copies are the same bytes.
    BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_headers(headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_on_a_stream_ingress_arrive_under_their_own_ids_through_kill_9() {
    const PAIRS: u64 = 400;
    let kill_after = seeded("stream twins: kill after pairs", 40..300);
    let mut s = setup("stream-twins", "").await;
    let exchange = s.names.from_exchange.clone();

    // Received copies by pair: (x-delayd-id, arrival ms).
    let collector = {
        let queue = s.names.target_queue.clone();
        tokio::spawn(async move {
            let client = common::Client::connect("delayd-it-stream-twins-collector").await;
            let mut receiver = client.consume(&queue).await;
            let mut copies: BTreeMap<u64, Vec<(String, u64)>> = BTreeMap::new();
            let deadline = Instant::now() + Duration::from_secs(90);
            let complete = |c: &BTreeMap<u64, Vec<(String, u64)>>| {
                c.len() as u64 == PAIRS
                    && c.values()
                        .all(|v| v.iter().map(|(id, _)| id).collect::<BTreeSet<_>>().len() >= 2)
            };
            while !complete(&copies) {
                let Some(m) = receiver.next(deadline).await else {
                    break;
                };
                assert!(
                    m.header("x-stream-offset").is_none(),
                    "the stream's offset header reached the consumer: {:?}",
                    m.properties()
                );
                assert_eq!(m.header_text("tenant").as_deref(), Some("eu-1"));
                let body = String::from_utf8(m.delivery.data.clone()).expect("UTF-8 body");
                let k: u64 = body
                    .strip_prefix("recompute order ")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("unexpected body {body:?}"));
                let id = m.header_text("x-delayd-id").expect("x-delayd-id");
                copies.entry(k).or_default().push((id, m.at_ms));
            }
            receiver.close().await;
            client.close().await;
            copies
        })
    };

    let mut sent_ms = Vec::new();
    for k in 0..PAIRS {
        if k == kill_after {
            s.delayd.kill_9();
            // Publishing goes on while delayd is down: the stream keeps it.
        }
        if k == kill_after + 40 {
            restart(&mut s).await;
        }
        let (body, delay) = twin(k);
        sent_ms.push(now_ms());
        // Back to back, the confirms awaited after both: the broker may
        // stamp both copies in one millisecond.
        let first = s
            .client
            .publish_unconfirmed(&exchange, ROUTING_KEY, &body, twin_properties(delay))
            .await;
        let second = s
            .client
            .publish_unconfirmed(&exchange, ROUTING_KEY, &body, twin_properties(delay))
            .await;
        assert_confirmed(first).await;
        assert_confirmed(second).await;
        if k % 10 == 9 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    if kill_after + 40 >= PAIRS {
        restart(&mut s).await;
    }

    let copies = collector.await.expect("collector");
    let mut lost = Vec::new();
    let mut other_id = Vec::new();
    let mut same_id = 0;
    let mut early = Vec::new();
    for k in 0..PAIRS {
        let got = copies.get(&k).cloned().unwrap_or_default();
        let ids: BTreeSet<&String> = got.iter().map(|(id, _)| id).collect();
        if ids.len() < 2 {
            lost.push((k, got.len()));
        }
        if ids.len() > 2 {
            other_id.push((k, ids.len()));
        }
        same_id += got.len().saturating_sub(ids.len());
        let due = sent_ms[k as usize] + twin(k).1;
        if let Some(at) = got.iter().map(|(_, at)| *at).filter(|at| *at < due).min() {
            early.push((k, due - at));
        }
    }
    println!(
        "stream twins: {PAIRS} pairs, kill -9 after {kill_after}: lost {}, early {}, \
         same-id duplicates {same_id}, copies under a third id {}",
        lost.len(),
        early.len(),
        other_id.len()
    );
    assert!(
        lost.is_empty(),
        "pairs that lost a copy (pair, copies): {lost:?}"
    );
    assert!(early.is_empty(), "copies early (pair, ms): {early:?}");
    assert!(
        other_id.is_empty(),
        "pairs with copies under more than two ids (pair, ids): {other_id:?}"
    );
    let checkpoint = s
        .delayd
        .wal_dir()
        .join("streams")
        .join(format!("{}.offset", s.names.route));
    assert!(
        checkpoint.exists(),
        "no stream checkpoint at {}",
        checkpoint.display()
    );
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_truncated_while_delayd_was_down_is_reported_not_skipped() {
    // Tiny segments and a tiny size limit: retention removes the head of
    // the stream as soon as a few segments are written.
    let mut s = setup(
        "stream-truncated",
        ", queue_arguments = { \"x-max-length-bytes\" = 20000, \"x-stream-max-segment-size-bytes\" = 4000 }",
    )
    .await;
    let exchange = s.names.from_exchange.clone();
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let props = |seq: u64| {
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from("x-delay"), AMQPValue::LongLongInt(100));
        headers.insert(ShortString::from("seq"), AMQPValue::LongLongInt(seq as i64));
        BasicProperties::default().with_headers(headers)
    };
    s.client
        .publish(&exchange, ROUTING_KEY, b"before", props(0))
        .await;
    receiver
        .expect("the message published before the stop")
        .await;
    let route = s.names.route.clone();
    wait_for("the checkpoint past the first message", DEADLINE, || {
        let path = s
            .delayd
            .wal_dir()
            .join("streams")
            .join(format!("{route}.offset"));
        async move {
            std::fs::read_to_string(path)
                .ok()
                .filter(|t| t.contains("\"next\":1"))
        }
    })
    .await;
    s.delayd.sigterm_and_wait(DEADLINE).await;

    // While delayd is down: 200 messages of 500 bytes, 100 KB in a stream
    // that keeps about 20 KB.
    let body = vec![b'x'; 500];
    for seq in 1..=200 {
        s.client
            .publish(&exchange, ROUTING_KEY, &body, props(seq))
            .await;
    }
    s.delayd.restart().await;
    let route = s.names.route.clone();
    let delayd = &s.delayd;
    wait_for("the route to report the truncation", DEADLINE, || {
        let state = delayd.readyz()["routes"][&route].clone();
        async move { (state == "truncated").then_some(()) }
    })
    .await;
    let lost = s.delayd.metric("delayd_stream_truncated_offsets_total");
    assert!(lost > 0.0, "no delayd_stream_truncated_offsets_total");
    let log = s.delayd.full_log();
    assert!(
        log.contains("retention removed messages delayd had not read yet"),
        "no loud log line:\n{}",
        s.delayd.log_tail(40)
    );
    assert_eq!(
        s.delayd.readyz()["ready"],
        false,
        "a truncated route is not ready"
    );
    // What the stream still held is delivered: the last message arrives.
    let deadline = Instant::now() + DEADLINE;
    let mut last_seen = false;
    while !last_seen {
        let m = receiver
            .next(deadline)
            .await
            .expect("the stream's remaining messages within the deadline");
        last_seen = m.header("seq") == Some(&AMQPValue::LongLongInt(200));
    }
    let line = log
        .lines()
        .find(|l| l.contains("retention removed"))
        .unwrap_or_default();
    println!("stream truncated: {lost} offsets reported lost to retention: {line}");
    receiver.close().await;
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_reads_a_stream_from_its_checkpoint_exactly() {
    // A segment per message: each segment starts with a tracking chunk that
    // takes an offset, so the offset after the checkpoint holds no message.
    // That gap must not pass for a truncation.
    let mut s = setup(
        "stream-resume",
        ", queue_arguments = { \"x-stream-max-segment-size-bytes\" = 4000 }",
    )
    .await;
    let exchange = s.names.from_exchange.clone();
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let body = vec![b'y'; 3500];
    let publish = |seq: i64| {
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from("x-delay"), AMQPValue::LongLongInt(50));
        headers.insert(ShortString::from("seq"), AMQPValue::LongLongInt(seq));
        BasicProperties::default().with_headers(headers)
    };
    let mut copies: BTreeMap<i64, u32> = BTreeMap::new();
    let deadline = Instant::now() + DEADLINE;
    let mut collect = async |copies: &mut BTreeMap<i64, u32>, until: i64| {
        while copies.len() < until as usize {
            let m = receiver
                .next(deadline)
                .await
                .expect("every message in time");
            let Some(AMQPValue::LongLongInt(seq)) = m.header("seq") else {
                panic!("no seq: {:?}", m.properties())
            };
            *copies.entry(*seq).or_default() += 1;
        }
    };
    for seq in 0..50 {
        s.client
            .publish(&exchange, ROUTING_KEY, &body, publish(seq))
            .await;
    }
    collect(&mut copies, 50).await;
    // A clean stop writes the checkpoint past everything stored.
    s.delayd.sigterm_and_wait(DEADLINE).await;
    for seq in 50..100 {
        s.client
            .publish(&exchange, ROUTING_KEY, &body, publish(seq))
            .await;
    }
    restart(&mut s).await;
    collect(&mut copies, 100).await;
    // Anything read twice would arrive within its 50 ms delay: give it time.
    while let Some(m) = receiver
        .next(Instant::now() + Duration::from_millis(1500))
        .await
    {
        let Some(AMQPValue::LongLongInt(seq)) = m.header("seq") else {
            panic!("no seq: {:?}", m.properties())
        };
        *copies.entry(*seq).or_default() += 1;
    }
    let twice: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "read again after a clean restart (seq, copies): {twice:?}"
    );
    assert_eq!(s.delayd.readyz()["routes"][&s.names.route], "consuming");
    assert_eq!(
        s.delayd.metric("delayd_stream_truncated_offsets_total"),
        0.0
    );
    receiver.close().await;
    s.client.close().await;
}
