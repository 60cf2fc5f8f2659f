//! The bench over AMQP: publish to an exchange, consume a queue.

use std::sync::Arc;

use anyhow::Context;
use delayd_adapters::amqp::topology::{bind_existing, ensure_bound_queue, exchange_exists};
use delayd_adapters::amqp::{
    AmqpSettings, AmqpSink, AmqpSource, BrokerConnections, Endpoints as AmqpEndpoints,
    ExchangeType, SinkConfig, SourceConfig,
};
use delayd_adapters::Target;

use super::{BenchArgs, Endpoints};

pub(super) async fn endpoints(args: &BenchArgs) -> anyhow::Result<Endpoints> {
    let (Some(exchange), Some(queue)) = (&args.exchange, &args.queue) else {
        anyhow::bail!("--exchange and --queue are required (or --kafka)");
    };
    let settings = AmqpSettings {
        urls: args.urls.clone(),
        ..AmqpSettings::default()
    };
    let conns = BrokerConnections::with_endpoints(Arc::new(AmqpEndpoints::new(&settings)?));
    if let Some(bind_to) = &args.bind_to {
        let mut arguments = delayd_adapters::FieldTable::default();
        if args.queue_type != "classic" {
            arguments.insert(
                "x-queue-type",
                delayd_adapters::Value::LongString(args.queue_type.as_str().into()),
            );
        }
        let every_key = ["#".to_string()];
        // An existing exchange keeps its type (a plugin exchange would
        // refuse a redeclaration as topic); a missing one becomes a topic.
        let bound = if exchange_exists(&conns.consume, bind_to).await? {
            bind_existing(&conns.consume, queue, &arguments, bind_to, &every_key).await
        } else {
            let topic = Some((bind_to.as_str(), ExchangeType::Topic, &every_key[..]));
            ensure_bound_queue(&conns.consume, queue, &arguments, topic).await
        };
        bound.with_context(|| format!("binding {queue} to {bind_to}"))?;
    }
    // A missing exchange would close the publish channel on every message.
    if !exchange_exists(&conns.publish, exchange)
        .await
        .with_context(|| format!("checking exchange {exchange:?}"))?
    {
        anyhow::bail!(
            "exchange {exchange:?} does not exist: start delayd with a route whose \
             `from.exchange` is {exchange:?} first, or give an existing exchange"
        );
    }
    let source = AmqpSource::start(conns.consume.clone(), SourceConfig::new(queue))?;
    let sink = AmqpSink::new(
        conns.publish.clone(),
        SinkConfig {
            batch: args.in_flight.max(1),
            // One broker message per sequence number: a second copy that
            // arrives is delayd's (see `Tally`), never a publish sent again.
            republish_unconfirmed: false,
            ..SinkConfig::default()
        },
    );
    Ok(Endpoints {
        sink: Arc::new(sink),
        target: Target {
            destination: exchange.clone(),
            routing_key: Some(args.routing_key.clone()),
        },
        source: Box::new(source),
        close: Box::pin(async move { conns.close().await }),
    })
}
