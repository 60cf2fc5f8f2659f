//! [`KafkaSink`]: publishes due messages with an idempotent `acks=all`
//! producer.
//!
//! * [`KafkaSink::enqueue`] hands the record to librdkafka at once, before
//!   returning the future that waits for the broker. Calls made in order reach
//!   a partition in that order (idempotence keeps it through retries), which
//!   is how delayd keeps per-key order for messages due at the same time.
//! * Keyed records are placed by `murmur2_random`, Java's default
//!   partitioner, so a keyed message lands where a Java producer would put it.
//!   Records without a key are spread at random.
//! * The record timestamp is the message's `timestamp_ms` when set (the core
//!   clears it unless the route keeps the original), else the send time.
//! * A topic is looked up in the cluster's metadata the first time it is
//!   used (the runtime warms this up for the configured targets at start), so
//!   a missing topic is [`SinkError::UnknownTarget`] at once instead of a
//!   timeout much later. A record the
//!   broker can never take (too large, invalid) is [`SinkError::Permanent`];
//!   anything else (timeouts, broker down, queue full) is
//!   [`SinkError::Transient`] and retried by the core.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientContext;

use super::convert::record_headers;
use super::{KafkaClientConfig, Role};
use crate::message::Message;
use crate::traits::{BoxFuture, PublishOutcome, Sink, SinkError, Target};

pub struct SinkContext;

impl ClientContext for SinkContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        super::log_to_tracing(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "Kafka producer error");
    }
}

/// Cheap to clone: clones share the producer.
#[derive(Clone)]
pub struct KafkaSink {
    producer: FutureProducer<SinkContext>,
    client: KafkaClientConfig,
    /// Topics known to exist (checked or created).
    known: Arc<Mutex<HashSet<String>>>,
}

impl KafkaSink {
    pub fn new(client: &KafkaClientConfig) -> KafkaResult<Self> {
        let producer = client
            .client_config(
                Role::Producer,
                &[
                    ("partitioner", "murmur2_random"),
                    ("linger.ms", "5"),
                    ("message.timeout.ms", "30000"),
                ],
                &[("enable.idempotence", "true"), ("acks", "all")],
            )
            .create_with_context(SinkContext)
            .map_err(super::without_value)?;
        Ok(Self {
            producer,
            client: client.clone(),
            known: Arc::new(Mutex::new(HashSet::new())),
        })
    }

    /// Queue the record now; the future says what the broker did with it.
    pub fn enqueue(
        &self,
        message: &Message,
        target: &Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        if target.destination.is_empty() {
            return Box::pin(async { Err(SinkError::Permanent("no target topic".into())) });
        }
        if !self.known().contains(&target.destination) {
            // First use of this topic: look it up before sending (rare, so
            // the order of these first records is not guaranteed).
            let message = message.clone();
            let target = target.clone();
            let this = self.clone();
            return Box::pin(async move {
                match this.topic_exists(&target.destination).await? {
                    true => this.enqueue(&message, &target).await,
                    false => Err(SinkError::UnknownTarget(format!(
                        "Kafka topic {:?} does not exist",
                        target.destination
                    ))),
                }
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&target.destination).headers(record_headers(message));
        if !message.null_value {
            record = record.payload(&message.body);
        }
        if let Some(key) = &message.key {
            record = record.key(key);
        }
        if let Some(ts) = message.timestamp_ms {
            record = record.timestamp(ts);
        }
        match self.producer.send_result(record) {
            Ok(delivery) => Box::pin(async move {
                match delivery.await {
                    Ok(Ok(_)) => Ok(PublishOutcome::Delivered),
                    Ok(Err((e, _))) => classify(e),
                    Err(_) => Err(SinkError::Transient("Kafka producer closed".into())),
                }
            }),
            Err((e, _)) => {
                let outcome = classify(e);
                Box::pin(async move { outcome })
            }
        }
    }

    /// Create `topic` unless it exists (invalid/unroutable destinations).
    /// Uses the broker's default partitions and replication when it allows,
    /// else one partition with one replica.
    pub async fn ensure_topic(&self, topic: &str) -> Result<(), SinkError> {
        self.create_topic(topic, &[(-1, -1), (1, 1)]).await
    }

    /// Create `topic` with `partitions` unless it exists, with the broker's
    /// default replication when it allows, else one replica.
    pub async fn ensure_topic_with(&self, topic: &str, partitions: i32) -> Result<(), SinkError> {
        self.create_topic(topic, &[(partitions, -1), (partitions, 1)])
            .await
    }

    /// Try each (partitions, replicas) in turn until the topic exists.
    async fn create_topic(&self, topic: &str, attempts: &[(i32, i32)]) -> Result<(), SinkError> {
        if self.known().contains(topic) {
            return Ok(());
        }
        let admin: AdminClient<DefaultClientContext> = self
            .client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| {
                SinkError::Transient(format!("cannot create a Kafka admin client: {e}"))
            })?;
        let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let mut last = String::new();
        for &(partitions, replicas) in attempts {
            let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replicas));
            match admin.create_topics([&new], &options).await {
                Ok(results) => match results.into_iter().next() {
                    Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => {
                        self.known().insert(topic.to_owned());
                        return Ok(());
                    }
                    Some(Err((_, code))) => last = code.to_string(),
                },
                Err(e) => last = e.to_string(),
            }
        }
        Err(SinkError::Transient(format!(
            "cannot create Kafka topic {topic:?}: {last}"
        )))
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Does `topic` exist? Asks the cluster once, then remembers a yes.
    pub async fn topic_exists(&self, topic: &str) -> Result<bool, SinkError> {
        if self.known().contains(topic) {
            return Ok(true);
        }
        let producer = self.producer.clone();
        let name = topic.to_owned();
        let count = tokio::task::spawn_blocking(move || partition_count(&producer, &name))
            .await
            .map_err(|e| SinkError::Transient(format!("metadata lookup failed: {e}")))??;
        if count > 0 && self.known().insert(topic.to_owned()) {
            // Once per topic: a target that acknowledges on one in-sync
            // replica can lose what delayd delivered (and tombstoned).
            let client = self.client.clone();
            let topic = topic.to_owned();
            tokio::spawn(async move {
                if let Ok(found) = super::durability::topic_durability(&client, &topic).await {
                    for warning in found.warnings(&topic) {
                        tracing::warn!(%topic, "{warning}");
                    }
                }
            });
        }
        Ok(count > 0)
    }

    /// Wait for queued records to be delivered (at shutdown).
    pub fn flush(&self, timeout: Duration) {
        if let Err(e) = self.producer.flush(timeout) {
            tracing::warn!(error = %e, "Kafka producer flush");
        }
    }
}

/// Partitions of `topic` from the cluster's metadata; 0 if it does not exist.
fn partition_count(
    producer: &FutureProducer<SinkContext>,
    topic: &str,
) -> Result<usize, SinkError> {
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| SinkError::Transient(format!("metadata of {topic:?}: {e}")))?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map_or(0, |t| t.partitions().len()))
}

fn classify(e: KafkaError) -> Result<PublishOutcome, SinkError> {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => {
            Err(SinkError::UnknownTarget(e.to_string()))
        }
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::TopicAuthorizationFailed,
        ) => Err(SinkError::Permanent(e.to_string())),
        _ => Err(SinkError::Transient(e.to_string())),
    }
}

impl Sink for KafkaSink {
    fn publish(
        &self,
        message: Message,
        target: Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        self.enqueue(&message, &target)
    }

    fn declare_destination<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(self.ensure_topic(name))
    }

    fn target_exists<'a>(&'a self, target: &'a Target) -> BoxFuture<'a, Result<bool, SinkError>> {
        Box::pin(self.topic_exists(&target.destination))
    }

    fn flush(&self, timeout: std::time::Duration) {
        KafkaSink::flush(self, timeout);
    }
}
