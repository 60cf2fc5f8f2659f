//! The broker connections and sinks of a running delayd, by broker name.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use delayd_adapters::amqp::{AmqpSink, BrokerConnections, SinkConfig};
use delayd_adapters::{Message, PublishOutcome, Sink, SinkError, Target};

use crate::config::{BrokerConfig, Config};

pub struct BrokerHandle {
    pub connections: BrokerConnections,
    pub sink: Arc<AmqpSink>,
}

/// Every configured broker, connected lazily (and reconnected) by the adapters.
#[derive(Clone, Default)]
pub struct Brokers {
    by_name: Arc<HashMap<String, BrokerHandle>>,
    /// Brokers some route consumes from: their consume connection must be up.
    sources: Arc<std::collections::HashSet<String>>,
}

/// Connection state of one broker, for `/readyz`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BrokerStatus {
    pub name: String,
    /// Consuming connection (only checked for brokers some route reads from).
    pub consume: &'static str,
    /// Publishing connection: opened on first publish, so "idle" is fine.
    pub publish: &'static str,
    pub ready: bool,
}

impl Brokers {
    pub fn from_config(config: &Config) -> anyhow::Result<Brokers> {
        let mut by_name = HashMap::new();
        for (name, broker) in &config.brokers {
            match broker {
                BrokerConfig::Amqp { url } => {
                    let connections = BrokerConnections::new(url)
                        .with_context(|| format!("brokers.{name}.url"))?;
                    let sink = Arc::new(AmqpSink::new(
                        connections.publish.clone(),
                        SinkConfig::default(),
                    ));
                    by_name.insert(name.clone(), BrokerHandle { connections, sink });
                }
                BrokerConfig::Kafka { .. } => {
                    anyhow::bail!("brokers.{name}: Kafka is not supported by this build yet")
                }
            }
        }
        let sources = config
            .routes
            .iter()
            .map(|r| r.from.broker.clone())
            .collect();
        Ok(Brokers {
            by_name: Arc::new(by_name),
            sources: Arc::new(sources),
        })
    }

    pub fn get(&self, name: &str) -> Option<&BrokerHandle> {
        self.by_name.get(name)
    }

    pub async fn publish(
        &self,
        broker: &str,
        message: &Message,
        target: &Target,
    ) -> Result<PublishOutcome, SinkError> {
        let handle = self
            .get(broker)
            .ok_or_else(|| SinkError::Permanent(format!("no broker named {broker:?}")))?;
        handle.sink.publish(message, target).await
    }

    /// Declare a queue on a broker (invalid/unroutable destinations).
    pub async fn declare_queue(&self, broker: &str, queue: &str) -> anyhow::Result<()> {
        let handle = self
            .get(broker)
            .with_context(|| format!("no broker named {broker:?}"))?;
        handle.sink.declare_queue(queue).await?;
        Ok(())
    }

    /// Every broker's connection state. A broker is ready when it is not
    /// consumed from or its consuming connection is open.
    pub fn status(&self) -> Vec<BrokerStatus> {
        let mut v: Vec<_> = self
            .by_name
            .iter()
            .map(|(name, h)| {
                let consuming = self.sources.contains(name);
                let consume_up = h.connections.consume.is_connected();
                BrokerStatus {
                    name: name.clone(),
                    consume: match (consuming, consume_up) {
                        (false, _) => "unused",
                        (true, true) => "connected",
                        (true, false) => "disconnected",
                    },
                    publish: if h.connections.publish.is_connected() {
                        "connected"
                    } else {
                        "idle"
                    },
                    ready: !consuming || consume_up,
                }
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub async fn close(&self) {
        for handle in self.by_name.values() {
            handle.connections.close().await;
        }
    }
}
