//! The same floor as `examples/relay.rs`, without delayd's code: a relay on
//! lapin alone. Each delivery is republished at once (publishes pipelined,
//! each confirm awaited on its own, no batches) and acked once its copy is
//! confirmed. If this relay's lateness matches `relay.rs`'s, the time goes
//! to the broker hops, not to delayd's adapters (docs/benchmarks.md).
//!
//! ```text
//! rabbitmqctl delete_queue delayd.bench
//! cargo run --release --example relay_lapin -- amqp://guest:guest@127.0.0.1:5672/%2f \
//!     bench.delayed relay.bench bench.out
//! delayd bench --exchange bench.delayed --queue bench.q --bind-to bench.out \
//!     --count 50000 --rate 5000 --delay-min 0 --delay-max 0
//! ```

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, from, queue, to] = args.as_slice() else {
        anyhow::bail!("usage: relay_lapin URL FROM_EXCHANGE QUEUE TO_EXCHANGE");
    };
    let consume = Connection::connect(url, ConnectionProperties::default()).await?;
    let publish = Connection::connect(url, ConnectionProperties::default()).await?;
    let consuming = consume.create_channel().await?;
    // The exchange as delayd's bench route declares it; the queue durable.
    consuming
        .exchange_declare(
            from.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    consuming
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    consuming
        .queue_bind(
            queue.as_str().into(),
            from.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    consuming
        .basic_qos(1000, BasicQosOptions::default())
        .await?;
    let publishing = publish.create_channel().await?;
    publishing
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut consumer = consuming
        .basic_consume(
            queue.as_str().into(),
            "relay".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let to = to.clone();
    loop {
        let d = tokio::select! {
            d = consumer.next() => match d { Some(d) => d?, None => break },
            _ = tokio::signal::ctrl_c() => break,
        };
        let confirm = publishing
            .basic_publish(
                to.as_str().into(),
                d.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &d.data,
                d.properties.clone(),
            )
            .await?;
        // A copy not confirmed leaves its original unacked: the broker
        // gives it back when the relay stops.
        tokio::spawn(async move {
            if confirm.await.is_ok() {
                let _ = d.acker.ack(BasicAckOptions::default()).await;
            }
        });
    }
    // Bound to `from`, the queue would keep a copy of every later message.
    consuming
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    Ok(())
}
