//! The broker connections and sinks of a running delayd, by broker name.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use delayd_adapters::amqp::{AmqpSink, BrokerConnections, Endpoints, SinkConfig};
use delayd_adapters::kafka::{KafkaClientConfig, KafkaSink};
use delayd_adapters::{BoxFuture, Message, PublishOutcome, Sink, SinkError, Target};

use crate::config::{BrokerConnection, Config};
use crate::status::BrokerStatus;

/// What a route's source needs to consume from a broker.
pub enum BrokerHandle {
    Amqp { connections: BrokerConnections },
    Kafka { client: KafkaClientConfig },
}

/// Every configured broker, connected lazily (and reconnected) by the adapters.
#[derive(Clone, Default)]
pub struct Brokers {
    by_name: Arc<HashMap<String, BrokerHandle>>,
    /// Where due and parked messages go, by broker name.
    sinks: Arc<HashMap<String, Arc<dyn Sink>>>,
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
        let mut sinks: HashMap<String, Arc<dyn Sink>> = HashMap::new();
        for (name, connection) in config.connections()? {
            let (handle, sink): (BrokerHandle, Arc<dyn Sink>) = match connection {
                BrokerConnection::Amqp(settings) => {
                    let endpoints = Arc::new(
                        Endpoints::new(&settings).with_context(|| format!("brokers.{name}"))?,
                    );
                    if endpoints.unverified() {
                        tracing::warn!(broker = %name,
                            "brokers.{name}.tls.verify_peer = false: the broker's certificate is not verified, \
                             so anyone between delayd and the broker can read and change messages");
                    }
                    let connections = BrokerConnections::with_endpoints(endpoints);
                    let sink = AmqpSink::new(connections.publish.clone(), SinkConfig::default());
                    (BrokerHandle::Amqp { connections }, Arc::new(sink))
                }
                BrokerConnection::Kafka(client) => {
                    // The producer is shared by every route of the broker.
                    let sink = KafkaSink::new(&client.named(format!("delayd-{name}")))
                        .with_context(|| format!("brokers.{name}: cannot create the producer"))?;
                    (BrokerHandle::Kafka { client }, Arc::new(sink))
                }
            };
            by_name.insert(name.clone(), handle);
            sinks.insert(name.clone(), sink);
        }
        let sources = config
            .routes
            .iter()
            .map(|r| r.from.broker.clone())
            .collect();
        Ok(Brokers {
            by_name: Arc::new(by_name),
            sinks: Arc::new(sinks),
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
        self.send(broker, message, target, None)
    }

    /// [`Brokers::publish`], sent only while `fence` holds (see
    /// [`delayd_adapters::Sink::publish_fenced`]).
    pub fn publish_fenced(
        &self,
        broker: &str,
        message: Message,
        target: Target,
        fence: delayd_adapters::Fence,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        self.send(broker, message, target, Some(fence))
    }

    fn send(
        &self,
        broker: &str,
        message: Message,
        target: Target,
        fence: Option<delayd_adapters::Fence>,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        match (self.sinks.get(broker), fence) {
            (Some(sink), None) => sink.publish(message, target),
            (Some(sink), Some(fence)) => sink.publish_fenced(message, target, fence),
            (None, _) => {
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
        match self.sinks.get(broker) {
            Some(sink) => sink.declare_destination(queue).await?,
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
        match self.sinks.get(broker) {
            Some(sink) => sink.target_exists(target).await,
            None => Ok(true),
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
            if let BrokerHandle::Amqp { connections } = handle {
                connections.close().await;
            }
        }
        for sink in self.sinks.values() {
            let sink = sink.clone();
            let flushed = tokio::task::spawn_blocking(move || sink.flush(Duration::from_secs(5)));
            let _ = flushed.await;
        }
    }
}
