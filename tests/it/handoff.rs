//! Hand-off on shutdown (`engine.handoff = true`): two instances share a
//! route; one is stopped with SIGTERM while it holds pending messages. It
//! gives them back to the route's queue marked with their due times, the
//! other instance takes them, and every message arrives once, none early,
//! byte-equal, without hand-off headers, under the `x-delayd-id` the admin
//! API listed for it before the hand-off: one identity per message, across
//! two replicas and the copy one gives the other.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{
    config_toml, now_ms, wait_for, Client, Delayd, DelaydOptions, Names, DEADLINE, LATE_MS,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_instance_hands_its_messages_to_another() {
    const COUNT: usize = 300;
    let names = Names::new("handoff");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-handoff").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let opts = DelaydOptions {
        prefetch: 50,
        ..DelaydOptions::default()
    };
    let with_handoff = |wal: &std::path::Path, http| {
        config_toml(&names, wal, http, &opts).replace("[engine]\n", "[engine]\nhandoff = true\n")
    };
    let mut leaving = Delayd::start_consuming(with_handoff, &names.from_queue).await;
    let staying = Delayd::start_consuming(
        |wal, http| config_toml(&names, wal, http, &opts),
        &names.from_queue,
    )
    .await;
    wait_for("two consumers on the route's queue", DEADLINE, || async {
        let (_, consumers) = client.queue_counts(&names.from_queue).await?;
        (consumers == 2).then_some(())
    })
    .await;

    // Delays of 4-7 s, each message with its own body and headers.
    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let delay = 4000 + (i as i64 * 37) % 3000;
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from("x-delay"), AMQPValue::LongLongInt(delay));
        headers.insert(ShortString::from("n"), AMQPValue::LongInt(i as i32));
        let id = format!("handoff-{i}");
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(headers);
        sent.insert(id, (now_ms(), delay as u64, i));
        client
            .publish(
                &names.from_exchange,
                "k",
                format!("body {i}").as_bytes(),
                props,
            )
            .await;
    }
    wait_for("all stored by the two", DEADLINE, || async {
        (leaving.pending() + staying.pending() == COUNT as u64).then_some(())
    })
    .await;
    let held = leaving.pending();
    assert!(
        held > 0,
        "the leaving instance holds nothing; the test proves nothing"
    );
    // Each message's id as both instances list it: distinct messages,
    // distinct ids, whichever replica stored them.
    let mut listed: BTreeMap<String, String> = BTreeMap::new();
    for instance in [&leaving, &staying] {
        let (status, page) = instance.api("GET", "/v1/messages?limit=1000", None);
        assert_eq!(status, 200, "{page}");
        for item in page["items"].as_array().expect("items") {
            let message_id = item["message_id"].as_str().expect("message_id").to_owned();
            let id = item["id"].as_str().expect("id").to_owned();
            assert!(
                listed.insert(message_id, id).is_none(),
                "{item} listed twice"
            );
        }
    }
    assert_eq!(listed.len(), COUNT);
    let distinct: std::collections::BTreeSet<&String> = listed.values().collect();
    assert_eq!(
        distinct.len(),
        COUNT,
        "two replicas gave distinct messages the same id"
    );

    // Consuming from before anything falls due: receive times are arrival times.
    let mut receiver = client.consume(&names.target_queue).await;
    let status = leaving.sigterm_and_wait(Duration::from_secs(20)).await;
    let handed_off_ms = now_ms();
    assert_eq!(status.code(), Some(0), "log:\n{}", leaving.log_tail(40));
    let log = leaving.log_tail(40);
    assert!(
        log.contains(&format!("handed_off={held}")) && log.contains("left_in_wal=0"),
        "not all {held} handed off:\n{log}"
    );

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut arrived = BTreeMap::new();
    while arrived.len() < COUNT {
        let received = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {COUNT} arrived", arrived.len()));
        let id = received.message_id().unwrap_or_default().to_owned();
        let (at, delay, i) = sent[&id];
        assert!(received.at_ms >= at + delay, "{id} arrived early");
        // A message handed off after its due time leaves once the other
        // instance has it: bounded by the later of the two.
        let bound = (at + delay).max(handed_off_ms) + LATE_MS;
        assert!(
            received.at_ms < bound,
            "{id} arrived {} ms late",
            received.at_ms - (bound - LATE_MS)
        );
        assert_eq!(received.delivery.data, format!("body {i}").as_bytes());
        assert_eq!(
            received.header_text("x-delayd-id").as_ref(),
            Some(&listed[&id]),
            "{id} left under another id than the one listed before the hand-off"
        );
        let headers = received.properties().headers().clone().unwrap_or_default();
        for key in headers.inner().keys() {
            assert!(
                !key.as_str().starts_with("x-delayd-handoff") && key.as_str() != "x-deliver-at",
                "{id} carries {key}"
            );
        }
        assert!(
            arrived.insert(id.clone(), ()).is_none(),
            "{id} arrived twice"
        );
    }
    receiver.close().await;
    client.close().await;
    drop(staying);
}
