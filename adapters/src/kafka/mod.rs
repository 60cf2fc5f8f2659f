//! Kafka adapter (via rdkafka / librdkafka).
//!
//! One job per file:
//!
//! * [`convert`]: Kafka record ⇄ [`Message`](crate::Message): key, value,
//!   headers (bytes), partition, timestamp; typed values written as text.
//! * [`source`]: [`KafkaSource`], a [`Source`](crate::Source) consuming a
//!   consumer group's topics on a poll thread of its own; commits on revoke.
//! * [`sink`]: [`KafkaSink`], an idempotent `acks=all` producer that keeps
//!   the call order on the wire and places keyed records with Java's murmur2.
//! * [`murmur2`]: Java-compatible murmur2 partitioning, to check placement.
//! * [`durability`]: replicas, `min.insync.replicas` and broker count of a
//!   topic, checked at start.
//! * [`state`]: [`StateTopic`], the broker-kept store's compacted state
//!   topic, and the [`PartitionListener`] a source tells of its partitions.

pub mod convert;
pub mod durability;
pub mod murmur2;
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
#[derive(Clone, Default)]
pub struct KafkaClientConfig {
    /// Comma-separated `host:port` list (`bootstrap.servers`).
    pub bootstrap: String,
    /// `client.id` of every client made from this config (the user's).
    pub client_id: Option<String>,
    /// `client.id` when neither `client_id` nor the properties set one
    /// (delayd's name for this use: `delayd-<route>`).
    pub default_client_id: Option<String>,
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

impl std::fmt::Debug for KafkaClientConfig {
    // Property values may be secrets (sasl.password, ssl.key.pem, ...):
    // only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("KafkaClientConfig")
            .field("bootstrap", &self.bootstrap)
            .field("client_id", &self.client_id)
            .field("default_client_id", &self.default_client_id)
            .field("properties", &keys(&self.properties))
            .field("consumer", &keys(&self.consumer))
            .field("producer", &keys(&self.producer))
            .finish()
    }
}

impl KafkaClientConfig {
    pub fn new(bootstrap: impl Into<String>) -> Self {
        Self {
            bootstrap: bootstrap.into(),
            ..Self::default()
        }
    }

    /// This config, its clients named `id` unless the user named them.
    pub fn named(&self, id: impl Into<String>) -> Self {
        Self {
            default_client_id: Some(id.into()),
            ..self.clone()
        }
    }

    /// Whether consumers join with KIP-848's protocol (`group.protocol =
    /// "consumer"`): the session and heartbeat are then the broker's, and
    /// librdkafka refuses a consumer that sets them.
    pub fn consumer_protocol(&self) -> bool {
        self.consumer
            .get("group.protocol")
            .or(self.properties.get("group.protocol"))
            .is_some_and(|p| p.eq_ignore_ascii_case("consumer"))
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
        if let Some(id) = self.client_id.as_ref().or(self.default_client_id.as_ref()) {
            c.set("client.id", id);
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

/// A client config error without the value it names. librdkafka's error
/// carries the value of the property it refuses, so a refused
/// `sasl.password` or `sasl.oauthbearer.client.secret` showed in delayd's
/// error output (an OIDC secret, on a librdkafka built without libcurl).
/// Every client is created through this.
pub(crate) fn without_value(e: KafkaError) -> KafkaError {
    match e {
        KafkaError::ClientConfig(code, desc, key, value) => {
            let desc = if value.is_empty() {
                desc
            } else {
                desc.replace(&value, REDACTED)
            };
            KafkaError::ClientConfig(code, desc, key, REDACTED.to_owned())
        }
        other => other,
    }
}

const REDACTED: &str = "<redacted>";

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

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::producer::BaseProducer;

    #[test]
    fn a_refused_client_setting_is_named_without_its_value() {
        let secret = "s3cr3t-value-in-a-refused-setting";
        let refused = |c: &ClientConfig| c.create::<BaseProducer>().err().expect("refused");
        let mut config = ClientConfig::new();
        config.set("security.protocol", secret);
        assert!(
            refused(&config).to_string().contains(secret),
            "librdkafka's own error shows the value"
        );
        let shown = without_value(refused(&config)).to_string();
        assert!(!shown.contains(secret), "{shown}");
        assert!(shown.contains("security.protocol"), "{shown}");
    }
}
