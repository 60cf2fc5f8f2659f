//! The broker connections and sinks of a running delayd, by broker name.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use delayd_adapters::amqp::{AmqpSink, BrokerConnections, SinkConfig};
use delayd_adapters::kafka::{KafkaClientConfig, KafkaSink};
use delayd_adapters::{BoxFuture, Message, PublishOutcome, SinkError, Target};

use crate::config::{BrokerConfig, Config};
use crate::status::BrokerStatus;

pub enum BrokerHandle {
    Amqp {
        connections: BrokerConnections,
        sink: Arc<AmqpSink>,
    },
    Kafka {
        client: KafkaClientConfig,
        sink: KafkaSink,
    },
}

/// Every configured broker, connected lazily (and reconnected) by the adapters.
#[derive(Clone, Default)]
pub struct Brokers {
    by_name: Arc<HashMap<String, BrokerHandle>>,
    /// Brokers some route consumes from: their consume connection must be up.
    sources: Arc<HashSet<String>>,
    /// Parking queues/topics declared lately, by (broker, name): a flood of
    /// invalid messages must not cost a declaration each.
    declared: Arc<Mutex<HashMap<(String, String), Instant>>>,
}

/// A parking destination is declared again after this long, in case it was
/// deleted (a publish it cannot take also makes delayd forget it at once).
const REDECLARE_AFTER: Duration = Duration::from_secs(30);

impl Brokers {
    pub fn from_config(config: &Config) -> anyhow::Result<Brokers> {
        let mut by_name = HashMap::new();
        for (name, broker) in &config.brokers {
            let handle = match broker {
                BrokerConfig::Amqp { url } => {
                    let connections = BrokerConnections::new(url)
                        .with_context(|| format!("brokers.{name}.url"))?;
                    let sink = Arc::new(AmqpSink::new(
                        connections.publish.clone(),
                        SinkConfig::default(),
                    ));
                    BrokerHandle::Amqp { connections, sink }
                }
                BrokerConfig::Kafka {
                    bootstrap,
                    properties,
                    consumer_properties,
                    producer_properties,
                } => {
                    let client = KafkaClientConfig {
                        bootstrap: bootstrap.clone(),
                        properties: properties.clone(),
                        consumer: consumer_properties.clone(),
                        producer: producer_properties.clone(),
                    };
                    let sink = KafkaSink::new(&client)
                        .with_context(|| format!("brokers.{name}: cannot create the producer"))?;
                    BrokerHandle::Kafka { client, sink }
                }
            };
            by_name.insert(name.clone(), handle);
        }
        let sources = config
            .routes
            .iter()
            .map(|r| r.from.broker.clone())
            .collect();
        Ok(Brokers {
            by_name: Arc::new(by_name),
            sources: Arc::new(sources),
            declared: Arc::default(),
        })
    }

    pub fn get(&self, name: &str) -> Option<&BrokerHandle> {
        self.by_name.get(name)
    }

    /// Start publishing now and return what the broker did with it. The
    /// publish is queued before this returns, so calls made in order reach a
    /// Kafka partition, or an AMQP channel (one per routing key), in order.
    pub fn publish(
        &self,
        broker: &str,
        message: Message,
        target: Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        match self.get(broker) {
            Some(BrokerHandle::Kafka { sink, .. }) => sink.enqueue(&message, &target),
            // Both queue the publish before returning: calls made in fire
            // order reach the broker in that order (per key).
            Some(BrokerHandle::Amqp { sink, .. }) => sink.enqueue_owned(message, &target),
            None => {
                let e = SinkError::Permanent(format!("no broker named {broker:?}"));
                Box::pin(async move { Err(e) })
            }
        }
    }

    /// Make sure a parking destination exists: declare the queue (AMQP) or
    /// create the topic (Kafka). Skipped when done within [`REDECLARE_AFTER`].
    pub async fn declare_queue(&self, broker: &str, queue: &str) -> anyhow::Result<()> {
        let key = (broker.to_owned(), queue.to_owned());
        if self
            .declared()
            .get(&key)
            .is_some_and(|at| at.elapsed() < REDECLARE_AFTER)
        {
            return Ok(());
        }
        match self.get(broker) {
            Some(BrokerHandle::Amqp { sink, .. }) => sink.declare_queue(queue).await?,
            Some(BrokerHandle::Kafka { sink, .. }) => sink.ensure_topic(queue).await?,
            None => anyhow::bail!("no broker named {broker:?}"),
        }
        self.declared().insert(key, Instant::now());
        Ok(())
    }

    /// Declare `queue` again before the next publish to it (it did not take one).
    pub fn forget_declared(&self, broker: &str, queue: &str) {
        self.declared()
            .remove(&(broker.to_owned(), queue.to_owned()));
    }

    fn declared(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Instant>> {
        self.declared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Look up a Kafka target topic ahead of the first publish (AMQP: no-op).
    pub async fn check_target(&self, broker: &str, target: &Target) -> Result<bool, SinkError> {
        match self.get(broker) {
            Some(BrokerHandle::Kafka { sink, .. }) => sink.topic_exists(&target.destination).await,
            _ => Ok(true),
        }
    }

    /// Every broker's connection state. A broker is ready when it is not
    /// consumed from or its consuming connection is open. Kafka clients
    /// manage their connections inside librdkafka and report no state here.
    pub fn status(&self) -> Vec<BrokerStatus> {
        let mut v: Vec<_> = self
            .by_name
            .iter()
            .map(|(name, h)| {
                let consuming = self.sources.contains(name);
                match h {
                    BrokerHandle::Amqp { connections, .. } => {
                        let consume_up = connections.consume.is_connected();
                        BrokerStatus {
                            name: name.clone(),
                            consume: match (consuming, consume_up) {
                                (false, _) => "unused",
                                (true, true) => "connected",
                                (true, false) => "disconnected",
                            },
                            publish: if connections.publish.is_blocked() {
                                "blocked"
                            } else if connections.publish.is_connected() {
                                "connected"
                            } else {
                                "idle"
                            },
                            ready: !consuming || consume_up,
                        }
                    }
                    BrokerHandle::Kafka { .. } => BrokerStatus {
                        name: name.clone(),
                        consume: if consuming { "managed" } else { "unused" },
                        publish: "managed",
                        ready: true,
                    },
                }
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub async fn close(&self) {
        for handle in self.by_name.values() {
            match handle {
                BrokerHandle::Amqp { connections, .. } => connections.close().await,
                BrokerHandle::Kafka { sink, .. } => {
                    let sink = sink.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        sink.flush(std::time::Duration::from_secs(5))
                    })
                    .await;
                }
            }
        }
    }
}
