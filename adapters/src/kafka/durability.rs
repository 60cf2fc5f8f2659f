//! How many copies of a topic a write with `acks=all` reaches, checked at
//! start: the topic's replicas, its `min.insync.replicas`, and how many
//! brokers the cluster has.
//!
//! delayd's promise that an acknowledged message is not lost rests, on the
//! broker-kept store and on Kafka targets, on the broker keeping what it
//! acknowledged. With `acks=all` the leader acknowledges once every *in-sync*
//! replica has the record, and with `min.insync.replicas = 1` that may be
//! the leader alone: a replicated topic then still loses acknowledged records
//! when that one broker dies. [`TopicDurability::warnings`] says so.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};

use super::{KafkaClientConfig, Role};

/// A topic's replication as the cluster reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicDurability {
    /// Fewest replicas of any partition.
    pub replicas: usize,
    /// The topic's `min.insync.replicas` (`None` if it could not be read).
    pub min_insync: Option<i32>,
    /// Brokers in the cluster.
    pub brokers: usize,
}

impl TopicDurability {
    /// What is worth a warning about `topic`.
    pub fn warnings(&self, topic: &str) -> Vec<String> {
        let mut out = Vec::new();
        if self.replicas > 1 && self.min_insync.is_some_and(|m| m <= 1) {
            out.push(format!(
                "Kafka topic {topic:?} has {} replicas but min.insync.replicas = 1: a write \
                 acknowledged by its leader alone is lost if that broker dies; set \
                 min.insync.replicas to 2 or more (kafka-configs --alter --entity-type topics \
                 --entity-name {topic} --add-config min.insync.replicas=2)",
                self.replicas
            ));
        }
        if self.replicas == 1 && self.brokers > 1 {
            out.push(format!(
                "Kafka topic {topic:?} has a single replica on a cluster of {} brokers: what \
                 it holds is lost with that broker",
                self.brokers
            ));
        }
        out
    }
}

/// Whether a cluster of `brokers` can hold `wanted` replicas; the error
/// says what to change. `setting` names where `wanted` came from.
pub fn check_replication(wanted: usize, brokers: usize, setting: &str) -> Result<(), String> {
    if wanted <= brokers {
        return Ok(());
    }
    Err(format!(
        "{setting} asks for {wanted} replicas but the cluster has {brokers} broker{}: \
         lower it or add brokers (delayd does not fall back to fewer replicas)",
        if brokers == 1 { "" } else { "s" }
    ))
}

/// Brokers in the cluster (blocking).
pub fn broker_count(client: &KafkaClientConfig) -> Result<usize, String> {
    let consumer: BaseConsumer = client
        .client_config(Role::Admin, &[], &[])
        .create()
        .map_err(super::without_value)
        .map_err(|e| format!("cannot create a metadata client: {e}"))?;
    let metadata = consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .map_err(|e| format!("cannot read the cluster's metadata: {e}"))?;
    Ok(metadata.brokers().len())
}

/// The replication of `topic` as the cluster reports it.
pub async fn topic_durability(
    client: &KafkaClientConfig,
    topic: &str,
) -> Result<TopicDurability, String> {
    let metadata_client = client.clone();
    let name = topic.to_owned();
    let (replicas, brokers) = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = metadata_client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| format!("cannot create a metadata client: {e}"))?;
        let metadata = consumer
            .fetch_metadata(Some(&name), Duration::from_secs(10))
            .map_err(|e| format!("cannot read its metadata: {e}"))?;
        let replicas = metadata
            .topics()
            .iter()
            .find(|t| t.name() == name)
            .and_then(|t| t.partitions().iter().map(|p| p.replicas().len()).min())
            .unwrap_or(0);
        Ok::<_, String>((replicas, metadata.brokers().len()))
    })
    .await
    .map_err(|e| e.to_string())??;
    let admin: AdminClient<DefaultClientContext> = client
        .client_config(Role::Admin, &[], &[])
        .create()
        .map_err(super::without_value)
        .map_err(|e| format!("cannot create an admin client: {e}"))?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let min_insync = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &options)
        .await
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|resource| {
            resource
                .get("min.insync.replicas")
                .and_then(|e| e.value.as_deref()?.parse().ok())
        });
    Ok(TopicDurability {
        replicas,
        min_insync,
        brokers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(replicas: usize, min_insync: Option<i32>, brokers: usize) -> TopicDurability {
        TopicDurability {
            replicas,
            min_insync,
            brokers,
        }
    }

    #[test]
    fn one_in_sync_replica_of_several_is_a_warning() {
        let w = d(3, Some(1), 3).warnings("t");
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("min.insync.replicas = 1"), "{w:?}");
        assert!(d(3, Some(2), 3).warnings("t").is_empty());
        assert!(d(3, None, 3).warnings("t").is_empty());
    }

    #[test]
    fn a_single_replica_is_fine_only_on_a_single_broker() {
        assert!(d(1, Some(1), 1).warnings("t").is_empty());
        let w = d(1, Some(1), 3).warnings("t");
        assert!(w[0].contains("single replica"), "{w:?}");
    }

    #[test]
    fn more_replicas_than_brokers_is_refused_with_the_setting() {
        assert!(check_replication(1, 1, "x").is_ok());
        assert!(check_replication(3, 3, "x").is_ok());
        let e = check_replication(3, 1, "store.replication_factor").unwrap_err();
        assert!(
            e.contains("store.replication_factor asks for 3 replicas")
                && e.contains("has 1 broker:"),
            "{e}"
        );
    }
}
