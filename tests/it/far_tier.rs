//! The far tier end to end (issue #29). With `engine.horizon = "1s"`,
//! messages delayed by seconds wait on disk, not in memory: they are listed
//! and cancelled there, survive a kill -9, and arrive through RabbitMQ on
//! time, byte-equal, none early, each once.

use std::collections::HashMap;
use std::time::Duration;

use std::time::Instant;

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

use crate::common::*;

const COUNT: u64 = 40;
const ROUTING_KEY: &str = "order.created";

fn props(i: u64, delay_ms: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(delay_ms as i64),
    );
    headers.insert(
        ShortString::from("x-order"),
        AMQPValue::LongLongInt(i as i64),
    );
    BasicProperties::default()
        .with_message_id(format!("far-{i}").into())
        .with_content_type("text/plain".into())
        .with_headers(headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn far_messages_are_listed_cancelled_and_survive_kill_9_arriving_on_time() {
    let opts = DelaydOptions {
        engine_extra: "horizon = \"1s\"".into(),
        ..DelaydOptions::default()
    };
    let mut s = Setup::start(Names::new("far-tier"), &[], opts).await;
    let route = s.names.route.clone();
    // Published with `(sent before, confirmed after)`: the delay counts from
    // the broker's stamp, which lies between.
    let mut sent = HashMap::new();
    for i in 0..COUNT {
        let delay = 8_000 + (i * 97) % 4_000;
        let before = now_ms();
        s.client
            .publish(
                &s.names.from_exchange,
                ROUTING_KEY,
                format!("body-{i}").as_bytes(),
                props(i, delay),
            )
            .await;
        sent.insert(format!("far-{i}"), (before + delay, now_ms() + delay));
    }
    wait_for(
        "every message spilled to the far tier",
        DEADLINE,
        || async { (s.delayd.metric("delayd_far_messages") == COUNT as f64).then_some(()) },
    )
    .await;

    // Listed from the buckets in due order; one cancelled by its id.
    let (status, page) = s.delayd.api(
        "GET",
        &format!("/v1/messages?route={route}&limit=1000"),
        None,
    );
    assert_eq!(status, 200, "{page}");
    let items = page["items"].as_array().expect("items").clone();
    assert_eq!(items.len() as u64, COUNT, "{page}");
    let dues: Vec<u64> = items
        .iter()
        .map(|i| i["due_ms"].as_u64().unwrap())
        .collect();
    assert!(
        dues.windows(2).all(|w| w[0] <= w[1]),
        "not in due order: {dues:?}"
    );
    let doomed = items
        .iter()
        .find(|i| i["message_id"] == "far-7")
        .expect("far-7 listed");
    let id = doomed["id"].as_str().unwrap();
    let (status, body) = s.delayd.api("DELETE", &format!("/v1/messages/{id}"), None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(s.delayd.metric("delayd_far_messages"), (COUNT - 1) as f64);

    s.delayd.kill_9();
    s.delayd.restart().await;
    assert_eq!(
        s.delayd.pending(),
        COUNT - 1,
        "recovered from the checkpoint"
    );

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let last_due = sent.values().map(|(_, late)| *late).max().unwrap();
    let mut got = HashMap::new();
    let deadline = Instant::now() + Duration::from_millis(last_due + 10_000 - now_ms());
    while let Some(m) = receiver.next(deadline).await {
        let arrived = m.at_ms;
        let key = m.message_id().unwrap_or_default().to_owned();
        let (earliest, latest) = sent[&key];
        assert!(
            arrived >= earliest,
            "{key} arrived {} ms early",
            earliest - arrived
        );
        assert!(
            arrived <= latest + LATE_MS,
            "{key} arrived {} ms late",
            arrived - latest
        );
        let i: u64 = key["far-".len()..].parse().unwrap();
        assert_eq!(m.delivery.data, format!("body-{i}").as_bytes());
        assert_eq!(m.header("x-order"), Some(&AMQPValue::LongLongInt(i as i64)));
        assert_eq!(
            m.properties().content_type().as_ref().map(|c| c.as_str()),
            Some("text/plain")
        );
        assert!(
            got.insert(key.clone(), arrived).is_none(),
            "{key} arrived twice"
        );
        if got.len() as u64 == COUNT - 1 && now_ms() > last_due + 2_000 {
            break;
        }
    }
    assert_eq!(got.len() as u64, COUNT - 1, "missing: {:?}", {
        let mut missing: Vec<_> = sent.keys().filter(|k| !got.contains_key(*k)).collect();
        missing.sort();
        missing
    });
    assert!(!got.contains_key("far-7"), "the cancelled message arrived");
    assert!(s.delayd.metric("delayd_far_loaded_total") >= 1.0);
    assert_eq!(s.delayd.pending(), 0);
}
