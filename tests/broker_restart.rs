//! Order and lateness across a RabbitMQ restart: the delayed-message
//! plugin's own case `node_restart_before_delay_expires`. Delays of 1–15 s;
//! the broker restarts (`rabbitmqctl stop_app` / `start_app`) before the
//! first is due. Every message arrives in due order, none early, and the
//! ones that fell due during the outage leave as soon as the broker is back.
//!
//! In a test binary of its own: restarting the broker would break the
//! connections of any test running beside it.

#[path = "it/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{now_ms, Client, Delayd, DelaydOptions, Names};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .status()
        .expect("cannot run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?}: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_before_the_delays_expire_keeps_due_order() {
    let names = Names::new("restart");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-restart").await;
    // Durable: the target must outlive the restart.
    client
        .declare_durable_target(&names.to_exchange, &names.target_queue)
        .await;
    let _delayd = Delayd::start(&names, DelaydOptions::default()).await;
    // The plugin's delays, published out of order.
    let delays: [u64; 7] = [2000, 3000, 10000, 4000, 5000, 1000, 15000];
    let mut sent = Vec::new();
    for delay in delays {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-delay"),
            AMQPValue::LongLongInt(delay as i64),
        );
        let props = BasicProperties::default()
            .with_message_id(delay.to_string().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let at = now_ms();
        client
            .publish(&names.from_exchange, "k", b"restart", props)
            .await;
        sent.push((delay, at));
    }
    // Stored and acked before the broker goes away (else the broker would
    // redeliver them after its restart, with a later due time).
    common::wait_for("all 7 stored", common::DEADLINE, || async {
        (_delayd.pending() == 7).then_some(())
    })
    .await;
    client.close().await;
    let stopped = Instant::now();
    rabbitmqctl(&["stop_app"]);
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);
    let back_ms = now_ms();
    eprintln!("broker down for {:?}", stopped.elapsed());

    let client = Client::connect("delayd-it-restart-after").await;
    let mut receiver = client.consume(&names.target_queue).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut order = Vec::new();
    while order.len() < delays.len() {
        let Some(got) = receiver.next(deadline).await else {
            panic!("only {order:?} arrived");
        };
        let delay: u64 = got.message_id().expect("message_id").parse().unwrap();
        if order.contains(&delay) {
            continue; // a duplicate after the restart: allowed, not counted
        }
        let published = sent.iter().find(|(d, _)| *d == delay).unwrap().1;
        let due = published + delay;
        assert!(
            got.at_ms >= due,
            "{delay} ms message early by {} ms",
            due - got.at_ms
        );
        // Due during the outage: out soon after the broker is back; due
        // later: on time. Generous for this noisy machine, but finite.
        let bound = due.max(back_ms) + 3000;
        assert!(
            got.at_ms <= bound,
            "{delay} ms message {} ms late (broker back at {back_ms}, due {due})",
            got.at_ms - due
        );
        order.push(delay);
    }
    let mut sorted = delays.to_vec();
    sorted.sort_unstable();
    assert_eq!(order, sorted, "arrival order");
    receiver.close().await;
    client.close().await;
}
