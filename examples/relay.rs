//! The floor under delayd's lateness: a relay that does delayd's AMQP work
//! and nothing else. It consumes a queue bound to an exchange, republishes
//! each message unchanged to another exchange with publisher confirms, and
//! acks the original once the copy is confirmed: the same two broker hops
//! and the same client code (delayd's adapters), without the WAL and the
//! timing wheel, and without applying any delay.
//!
//! Run it instead of delayd and send the bench's messages with no delay, so
//! that their lateness is the time the two hops take (docs/benchmarks.md).
//! If delayd ran the bench route before, delete its queue first: it is
//! bound to the same exchange and would make the broker store a copy of
//! every message. The relay deletes its own queue when it stops.
//!
//! ```text
//! rabbitmqctl delete_queue delayd.bench
//! cargo run --release --example relay -- amqp://guest:guest@127.0.0.1:5672/%2f \
//!     bench.delayed relay.bench bench.out
//! delayd bench --exchange bench.delayed --queue bench.q --bind-to bench.out \
//!     --count 50000 --rate 5000 --delay-min 0 --delay-max 0
//! ```

use std::sync::Arc;

use anyhow::Context;
use delayd_adapters::amqp::topology::ensure_bound_queue;
use delayd_adapters::amqp::{AmqpSink, AmqpSource, BrokerConnections, ExchangeType};
use delayd_adapters::amqp::{SinkConfig, SourceConfig};
use delayd_adapters::{FieldTable, Sink, Source, Target};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, from, queue, to] = args.as_slice() else {
        anyhow::bail!("usage: relay URL FROM_EXCHANGE QUEUE TO_EXCHANGE");
    };
    let conns = BrokerConnections::new(url)?;
    let every_key = ["#".to_owned()];
    let bound = Some((from.as_str(), ExchangeType::Topic, &every_key[..]));
    ensure_bound_queue(&conns.consume, queue, &FieldTable::default(), bound)
        .await
        .with_context(|| format!("binding {queue} to {from}"))?;
    let mut source = AmqpSource::start(conns.consume.clone(), SourceConfig::new(queue))?;
    let sink = Arc::new(AmqpSink::new(conns.publish.clone(), SinkConfig::default()));
    let target = Target::exchange(to.as_str());
    eprintln!("relay: {from} -> {queue} -> {to}; stop with Ctrl-C");
    loop {
        let delivery = tokio::select! {
            d = source.next() => d?,
            _ = tokio::signal::ctrl_c() => break,
        };
        // Queued now, in consumption order; confirmed and acked in the background.
        let published = sink.publish(delivery.message, target.clone());
        let ack = delivery.ack;
        tokio::spawn(async move {
            let settled = match published.await {
                Ok(_) => ack.ack().await,
                Err(_) => ack.requeue().await,
            };
            if let Err(e) = settled {
                eprintln!("relay: settling a delivery failed: {e}");
            }
        });
    }
    Box::new(source).close().await;
    // Bound to `from`, the queue would keep a copy of every message sent
    // there after the relay is gone (delayd's later bench runs included).
    let channel = conns.consume.try_channel().await?;
    channel
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .with_context(|| format!("deleting {queue}"))?;
    conns.close().await;
    Ok(())
}
