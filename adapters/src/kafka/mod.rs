//! Kafka adapter (via rdkafka / librdkafka).
//!
//! One job per file:
//!
//! * [`convert`]: Kafka record ⇄ [`Message`](crate::Message): key, value,
//!   headers (bytes), partition, timestamp; typed values written as text.
//! * [`offsets`]: which offsets may be committed, in order per partition,
//!   only once every earlier record is durable in delayd.
//! * [`source`]: [`KafkaSource`], a [`Source`](crate::Source) consuming a
//!   consumer group's topics on a poll thread of its own; commits on revoke.
//! * [`sink`]: [`KafkaSink`], an idempotent `acks=all` producer that keeps
//!   the call order on the wire and places keyed records with Java's murmur2.
//! * [`murmur2`]: Java-compatible murmur2 partitioning, to check placement.
//! * [`state`]: [`StateTopic`], the broker-kept store's compacted state
//!   topic, and the [`PartitionListener`] a source tells of its partitions.

pub mod convert;
pub mod murmur2;
pub mod offsets;
pub mod sink;
pub mod source;
pub mod state;

use std::collections::BTreeMap;

use rdkafka::ClientConfig;

pub use rdkafka::error::KafkaError;
pub use sink::KafkaSink;
pub use source::{KafkaSource, KafkaSourceConfig};
pub use state::{PartitionListener, StateError, StateTopic};

/// How to reach one Kafka cluster.
#[derive(Debug, Clone, Default)]
pub struct KafkaClientConfig {
    /// Comma-separated `host:port` list (`bootstrap.servers`).
    pub bootstrap: String,
    /// Extra librdkafka properties for every client (`security.protocol`,
    /// `sasl.*`, ...). They override delayd's defaults, except the few its
    /// guarantees rest on.
    pub properties: BTreeMap<String, String>,
    /// Extra properties for the consumer only (`fetch.wait.max.ms`,
    /// `session.timeout.ms`, ...), over `properties`.
    pub consumer: BTreeMap<String, String>,
    /// Extra properties for the producer only (`linger.ms`, ...), over
    /// `properties`.
    pub producer: BTreeMap<String, String>,
}

/// Which client a configuration is for (the role-specific properties).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Consumer,
    Producer,
    Admin,
}

impl KafkaClientConfig {
    pub fn new(bootstrap: impl Into<String>) -> Self {
        Self {
            bootstrap: bootstrap.into(),
            properties: BTreeMap::new(),
            consumer: BTreeMap::new(),
            producer: BTreeMap::new(),
        }
    }

    /// `defaults`, then the user's properties (shared, then the role's), then
    /// `required`.
    fn client_config(
        &self,
        role: Role,
        defaults: &[(&str, &str)],
        required: &[(&str, &str)],
    ) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap);
        for (k, v) in defaults {
            c.set(*k, *v);
        }
        let own = match role {
            Role::Consumer => Some(&self.consumer),
            Role::Producer => Some(&self.producer),
            Role::Admin => None,
        };
        for (k, v) in self.properties.iter().chain(own.into_iter().flatten()) {
            c.set(k, v);
        }
        for (k, v) in required {
            c.set(*k, *v);
        }
        c
    }
}

/// librdkafka's log lines, into tracing.
fn log_to_tracing(level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
    use rdkafka::config::RDKafkaLogLevel as L;
    match level {
        L::Emerg | L::Alert | L::Critical | L::Error => {
            tracing::error!(target: "librdkafka", facility, "{message}")
        }
        L::Warning => tracing::warn!(target: "librdkafka", facility, "{message}"),
        L::Notice | L::Info => tracing::info!(target: "librdkafka", facility, "{message}"),
        L::Debug => tracing::debug!(target: "librdkafka", facility, "{message}"),
    }
}
