//! Producers that speak AMQP 1.0, which RabbitMQ 4 speaks natively: the
//! delay comes as the message annotations `x-opt-delivery-delay` (ms) and
//! `x-opt-delivery-time` (a timestamp), as Tanzu RabbitMQ's delayed queues
//! take it, or `x-delay` as an application property. RabbitMQ hands both to
//! delayd's AMQP 0-9-1 consumer as headers.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{now_ms, DelaydOptions, Names, Setup, LATE_MS};
use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Data, Message, MessageAnnotations, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, SimpleValue, Symbol, Timestamp, Value};
use fe2o3_amqp::{Connection, Sender, Session};

/// Send `message` and wait until the broker accepted it.
async fn send(sender: &mut Sender, message: Message<Data>) {
    sender
        .send(message)
        .await
        .expect("send")
        .accepted_or_else(|state| state)
        .expect("accepted");
}

/// What was sent: the earliest and latest acceptable arrival (epoch ms).
type Window = (u64, u64);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_1_0_delivery_delay_and_time_annotations_are_honoured() {
    if common::rabbitmq_major().is_some_and(|v| v < 4) {
        eprintln!("skipped: RabbitMQ 3.x speaks AMQP 1.0 only through a plugin");
        return;
    }
    let s = Setup::start(Names::new("amqp10"), &[], DelaydOptions::default()).await;
    let url = common::amqp_url().replace("/%2f", "");
    let mut connection = Connection::builder()
        .container_id("delayd-it-amqp10")
        .hostname("vhost:/")
        .open(url.as_str())
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut connection).await.expect("session");
    let address = format!("/exchanges/{}/k", s.names.from_exchange);
    let mut sender = Sender::attach(&mut session, "delayd-it-amqp10-sender", address)
        .await
        .expect("attach a sender");

    let mut expected: BTreeMap<String, Window> = BTreeMap::new();
    for i in 0..10u64 {
        let id = format!("amqp10-{i}");
        let sent = now_ms();
        let (annotation, value, window) = if i % 2 == 0 {
            let delay = 1500 + i * 100;
            let window = (sent + delay, sent + delay + LATE_MS);
            ("x-opt-delivery-delay", Value::Long(delay as i64), window)
        } else {
            // Whole seconds after conversion: never early, at most a
            // second late.
            let at = sent + 2000 + i * 100;
            let ts = Timestamp::from_milliseconds(at as i64);
            (
                "x-opt-delivery-time",
                Value::Timestamp(ts),
                (at, at + 999 + LATE_MS),
            )
        };
        let message = Message::builder()
            .properties(Properties::builder().message_id(id.clone()).build())
            .message_annotations(
                MessageAnnotations::builder()
                    .insert(Symbol::from(annotation), value)
                    .build(),
            )
            .body(Data(Binary::from(id.clone().into_bytes())))
            .build();
        send(&mut sender, message).await;
        expected.insert(id, window);
    }
    // x-delay as an application property, as a 0-9-1 producer's header.
    let id = "amqp10-property".to_owned();
    let sent = now_ms();
    let message = Message::builder()
        .properties(Properties::builder().message_id(id.clone()).build())
        .application_properties(
            ApplicationProperties::builder()
                .insert("x-delay", SimpleValue::Long(1800))
                .build(),
        )
        .body(Data(Binary::from(id.clone().into_bytes())))
        .build();
    send(&mut sender, message).await;
    expected.insert(id, (sent + 1800, sent + 1800 + LATE_MS));
    sender.close().await.expect("close sender");
    session.end().await.expect("end session");
    connection.close().await.expect("close connection");

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut arrived = BTreeMap::new();
    while arrived.len() < expected.len() {
        let received = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {} arrived", arrived.len(), expected.len()));
        let id = received.message_id().unwrap_or_default().to_owned();
        let &(earliest, latest) = expected
            .get(&id)
            .unwrap_or_else(|| panic!("unexpected message {id:?}"));
        assert!(
            received.at_ms >= earliest,
            "{id} arrived {} ms early",
            earliest - received.at_ms
        );
        assert!(
            received.at_ms <= latest,
            "{id} arrived {} ms late",
            received.at_ms - earliest
        );
        assert_eq!(received.delivery.data, id.as_bytes(), "{id}: body changed");
        assert!(
            arrived.insert(id.clone(), ()).is_none(),
            "{id} arrived twice"
        );
    }
    receiver.close().await;
}
