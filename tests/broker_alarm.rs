//! A RabbitMQ resource alarm: the broker blocks every publishing connection
//! (`connection.blocked`) and stops reading from it. delayd must hold the due
//! messages, say so in `/readyz`, still stop within its grace period on
//! SIGTERM, and deliver everything once the alarm clears: none lost, none
//! early.
//!
//! In a test binary of its own: the alarm blocks every publisher on the
//! broker, including other tests' clients.

#[path = "it/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{now_ms, wait_for, Client, Delayd, DelaydOptions, Names, DEADLINE};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .status()
        .expect("cannot run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?}: {status}");
}

/// A memory alarm for as long as it lives (cleared on drop, also when the
/// test fails, so the broker is left usable).
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> Self {
        rabbitmqctl(&["set_vm_memory_high_watermark", "absolute", "1"]);
        MemoryAlarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["set_vm_memory_high_watermark", "0.4"])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_publishing_connection_holds_messages_and_still_shuts_down() {
    const COUNT: usize = 20;
    const DELAY_MS: u64 = 1500;
    let names = Names::new("alarm");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-alarm").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let opts = DelaydOptions {
        shutdown_grace: "3s".into(),
        ..DelaydOptions::default()
    };
    let mut delayd = Delayd::start(&names, opts).await;
    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("alarm-{i}");
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-delay"),
            AMQPValue::LongLongInt(DELAY_MS as i64),
        );
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(headers);
        sent.insert(id, now_ms());
        client
            .publish(&names.from_exchange, "k", b"alarm", props)
            .await;
    }
    wait_for("all stored", DEADLINE, || async {
        (delayd.pending() == COUNT as u64).then_some(())
    })
    .await;

    let alarm = MemoryAlarm::raise();
    // They fall due while the broker refuses to read from publishers.
    wait_for(
        "/readyz to report the blocked connection",
        DEADLINE,
        || async {
            let body = delayd.readyz();
            (body["brokers"][0]["publish"] == "blocked").then_some(body)
        },
    )
    .await;
    assert_eq!(delayd.pending(), COUNT as u64, "nothing left while blocked");

    // SIGTERM while blocked: delayd stops within its grace period and keeps
    // what it could not deliver.
    let started = Instant::now();
    let status = delayd.sigterm_and_wait(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(0), "log:\n{}", delayd.log_tail(60));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );

    drop(alarm);
    delayd.restart().await;
    let mut receiver = client.consume(&names.target_queue).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut arrived = BTreeMap::new();
    while arrived.len() < COUNT {
        let received = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {COUNT} arrived", arrived.len()));
        let id = received.message_id().unwrap_or_default().to_owned();
        let at = sent[&id];
        assert!(received.at_ms >= at + DELAY_MS, "{id} early");
        *arrived.entry(id).or_insert(0u32) += 1;
    }
    receiver.close().await;
    client.close().await;
}
