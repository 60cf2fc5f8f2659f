//! The broker-kept store's Kafka side (`[store] kind = "broker"`): one
//! compacted state topic per route, co-partitioned with the route's source
//! topics (state partition *p* holds the pending messages read from source
//! partition *p*), as Kafka Streams keeps a changelog.
//!
//! * A pending message is a record keyed by its source coordinates
//!   (`topic/partition/offset`, see [`state_key`]): the same key whichever
//!   instance restores it and however often the source record is read
//!   again. Its value is a version byte, the due time (epoch ms, big endian)
//!   and the message as delayd encodes it ([`encode_value`]).
//! * Done is a tombstone (a null value) for that key: the log cleaner then
//!   removes both.
//! * Writes go through an idempotent `acks=all` producer of their own, so a
//!   tombstone queued after its Schedule lands after it.
//! * [`StateTopic::read_partition`] reads one partition from its start to
//!   its high watermark and returns what is still live.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rdkafka::admin::{
    AdminClient, AdminOptions, NewPartitions, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use super::durability;
use super::sink::SinkContext;
use super::{KafkaClientConfig, Role};
use crate::message::Message;
use crate::offsets::TopicPartition;
use crate::traits::BoxFuture;

/// Called on a Kafka source's poll thread when its group hands it
/// partitions or takes them away. Both may block: no record of an assigned
/// partition is handed out before `assigned` returns, and a revoked
/// partition is given up only after `revoked` returns.
pub trait PartitionListener: Send + Sync {
    fn assigned(&self, partitions: &[TopicPartition]);
    fn revoked(&self, partitions: &[TopicPartition]);
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("Kafka state topic {topic:?}: {reason}")]
    Topic { topic: String, reason: String },
    #[error("cannot write to Kafka state topic {topic:?}: {source}")]
    Write { topic: String, source: KafkaError },
    #[error("cannot read Kafka state topic {topic:?} partition {partition}: {reason}")]
    Read {
        topic: String,
        partition: i32,
        reason: String,
    },
}

/// Topic settings delayd creates a state topic with: compacted, with
/// segments rolled and cleaned often enough that the topic stays within a
/// small multiple of what is pending (see docs/broker-store.md).
const TOPIC_CONFIG: &[(&str, &str)] = &[
    ("cleanup.policy", "compact"),
    // A segment is cleaned only once rolled: roll often, so what was
    // written and tombstoned since is cleaned soon (the topic's size then
    // follows throughput × this, plus what is pending).
    ("segment.ms", "10000"),
    ("segment.bytes", "16777216"),
    ("min.cleanable.dirty.ratio", "0.5"),
    // How long a tombstone outlives the record it removed. A restore reads a
    // partition in seconds; one that took longer than this could miss a
    // tombstone and fire a delivered message again (a duplicate, never a
    // loss). Kept for a day by default, tombstones would dominate the topic.
    ("delete.retention.ms", "60000"),
];

/// The state record key of a message read from Kafka: its source
/// coordinates. `None` for a message that did not come from Kafka.
pub fn state_key(message: &Message) -> Option<(i32, Vec<u8>)> {
    let partition = message.partition?;
    let offset = message.offset?;
    Some((
        partition,
        format!("{}/{partition}/{offset}", message.source).into_bytes(),
    ))
}

/// The source topic a state key names (topic names have no `/`).
pub fn key_topic(key: &[u8]) -> Option<&[u8]> {
    let mut parts = key.rsplitn(3, |b| *b == b'/');
    let _offset = parts.next()?;
    let _partition = parts.next()?;
    parts.next()
}

/// Version 2 carries the message's identity; version 1 (read only) did not.
const VALUE_VERSION: u8 = 2;
const VALUE_VERSION_1: u8 = 1;

/// A Schedule record's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateValue<'a> {
    pub due_ms: u64,
    /// The message's identity (`x-delayd-id`); `None` in a version 1 value.
    pub uid: Option<u128>,
    pub encoded: &'a [u8],
}

/// A Schedule record's value: version 2, due time, identity, encoded
/// message (big endian).
pub fn encode_value(due_ms: u64, uid: u128, encoded: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(25 + encoded.len());
    out.push(VALUE_VERSION);
    out.extend_from_slice(&due_ms.to_be_bytes());
    out.extend_from_slice(&uid.to_be_bytes());
    out.extend_from_slice(encoded);
    out
}

/// A Schedule record's value, or `None` if it is not one this delayd reads.
pub fn decode_value(value: &[u8]) -> Option<StateValue<'_>> {
    let (&version, rest) = value.split_first()?;
    let due_ms = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    match version {
        VALUE_VERSION_1 => Some(StateValue {
            due_ms,
            uid: None,
            encoded: &rest[8..],
        }),
        VALUE_VERSION => Some(StateValue {
            due_ms,
            uid: Some(u128::from_be_bytes(rest.get(8..24)?.try_into().ok()?)),
            encoded: &rest[24..],
        }),
        _ => None,
    }
}

/// One route's state topic. Cheap to clone: clones share the producer.
#[derive(Clone)]
pub struct StateTopic {
    /// Replaced after a fatal error (see [`StateTopic::replace_if_fatal`]).
    producer: Arc<RwLock<FutureProducer<SinkContext>>>,
    client: KafkaClientConfig,
    topic: String,
    /// Partitions the topic is known to have (at least).
    known_partitions: Arc<AtomicI32>,
}

impl StateTopic {
    /// Make sure `topic` exists with at least `partitions` partitions and
    /// compaction (created so when missing), and open its producer.
    ///
    /// `replication_factor` is the replicas a new topic gets (`None`: the
    /// cluster's `default.replication.factor`); a cluster that cannot meet
    /// it, or an existing topic with fewer, is an error. A replicated topic
    /// with `min.insync.replicas = 1` is logged as a warning.
    pub async fn open(
        client: &KafkaClientConfig,
        topic: &str,
        partitions: i32,
        replication_factor: Option<u16>,
    ) -> Result<Self, StateError> {
        let this = Self::connect(client, topic)?;
        let err = |reason: String| StateError::Topic {
            topic: topic.to_owned(),
            reason,
        };
        this.create(partitions, replication_factor)
            .await
            .map_err(err)?;
        this.check(partitions).await.map_err(err)?;
        this.check_durability(replication_factor)
            .await
            .map_err(err)?;
        this.known_partitions.store(partitions, Ordering::Release);
        Ok(this)
    }

    /// A handle on `topic` without creating or checking it (to read it).
    pub fn connect(client: &KafkaClientConfig, topic: &str) -> Result<Self, StateError> {
        let err = |reason: String| StateError::Topic {
            topic: topic.to_owned(),
            reason,
        };
        let producer = Self::producer_for(client)
            .map_err(|e| err(format!("cannot create a producer: {e}")))?;
        Ok(Self {
            producer: Arc::new(RwLock::new(producer)),
            client: client.clone(),
            topic: topic.to_owned(),
            known_partitions: Arc::new(AtomicI32::new(0)),
        })
    }

    fn producer_for(client: &KafkaClientConfig) -> Result<FutureProducer<SinkContext>, KafkaError> {
        client
            .client_config(
                Role::Producer,
                &[("linger.ms", "2"), ("message.timeout.ms", "30000")],
                &[("enable.idempotence", "true"), ("acks", "all")],
            )
            .create_with_context(SinkContext)
            .map_err(super::without_value)
    }

    fn producer(&self) -> FutureProducer<SinkContext> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// An idempotent producer that hit a fatal error (librdkafka's
    /// `rd_kafka_fatal_error`: a sequence gap it cannot repair, say) fails
    /// every later write. Replace it, once, with a new one (a new producer
    /// id): the writes that failed are retried by their callers.
    fn replace_if_fatal(
        producer: &Arc<RwLock<FutureProducer<SinkContext>>>,
        failed: &FutureProducer<SinkContext>,
        client: &KafkaClientConfig,
        topic: &str,
    ) {
        let Some((code, reason)) = failed.client().fatal_error() else {
            return;
        };
        let mut current = producer.write().unwrap_or_else(|e| e.into_inner());
        if current.client().fatal_error().is_none() {
            return; // already replaced
        }
        match Self::producer_for(client) {
            Ok(fresh) => {
                tracing::error!(
                    topic,
                    ?code,
                    reason,
                    "the Kafka state producer hit a fatal error; a new producer replaces it"
                );
                *current = fresh;
            }
            Err(e) => {
                tracing::error!(topic, ?code, reason, error = %e, "the Kafka state producer hit a fatal error and a new one cannot be created; trying again at the next write")
            }
        }
    }

    /// Grow the topic to at least `partitions` (a source topic gained
    /// partitions at run time: its new partition *p* needs state partition
    /// *p* before it is consumed).
    pub async fn ensure_partitions(&self, partitions: i32) -> Result<(), StateError> {
        if self.known_partitions.load(Ordering::Acquire) >= partitions {
            return Ok(());
        }
        let err = |reason: String| StateError::Topic {
            topic: self.topic.clone(),
            reason,
        };
        let this = self.clone();
        let have = tokio::task::spawn_blocking(move || this.partitions())
            .await
            .map_err(|e| err(e.to_string()))??;
        if have >= partitions {
            self.known_partitions.fetch_max(have, Ordering::AcqRel);
            return Ok(());
        }
        tracing::info!(topic = %self.topic, from = have, to = partitions, "adding partitions to the state topic");
        let admin = self.admin().map_err(err)?;
        let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let results = admin
            .create_partitions(
                [&NewPartitions::new(&self.topic, partitions as usize)],
                &options,
            )
            .await
            .map_err(|e| err(format!("cannot add partitions: {e}")))?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::InvalidPartitions)) => {}
                Err((_, code)) => return Err(err(format!("cannot add partitions: {code}"))),
            }
        }
        // Wait until the metadata shows them (the restore reads them next).
        let this = self.clone();
        let now = tokio::task::spawn_blocking(move || this.partitions())
            .await
            .map_err(|e| err(e.to_string()))??;
        if now < partitions {
            return Err(err(format!(
                "has {now} partitions after growing to {partitions}"
            )));
        }
        self.known_partitions.fetch_max(now, Ordering::AcqRel);
        Ok(())
    }

    /// Partitions of the topic (0 if it does not exist). Blocking.
    pub fn partitions(&self) -> Result<i32, StateError> {
        let consumer: BaseConsumer = self
            .client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| StateError::Topic {
                topic: self.topic.clone(),
                reason: format!("cannot create a metadata client: {e}"),
            })?;
        settled_partition_count(&consumer, &self.topic).map_err(|reason| StateError::Topic {
            topic: self.topic.clone(),
            reason,
        })
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The most partitions any of `topics` has (at least 1): how many the
    /// state topic of a route reading them needs.
    pub async fn partitions_of(
        client: &KafkaClientConfig,
        topics: &[String],
    ) -> Result<i32, StateError> {
        let consumer: BaseConsumer = client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| StateError::Topic {
                topic: topics.join(","),
                reason: format!("cannot create a metadata client: {e}"),
            })?;
        let topics = topics.to_vec();
        tokio::task::spawn_blocking(move || {
            let mut most = 1;
            for topic in &topics {
                let count = settled_partition_count(&consumer, topic).map_err(|reason| {
                    StateError::Topic {
                        topic: topic.clone(),
                        reason: format!("source topic: {reason}"),
                    }
                })?;
                if count == 0 {
                    return Err(StateError::Topic {
                        topic: topic.clone(),
                        reason: "the source topic does not exist; with store.kind = \"broker\" \
                                 it must exist before delayd starts (its partitions size the \
                                 state topic)"
                            .into(),
                    });
                }
                most = most.max(count);
            }
            Ok(most)
        })
        .await
        .map_err(|e| StateError::Topic {
            topic: String::new(),
            reason: e.to_string(),
        })?
    }

    fn admin(&self) -> Result<AdminClient<DefaultClientContext>, String> {
        self.client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| format!("cannot create an admin client: {e}"))
    }

    /// Create the topic unless it exists, with `replication_factor`
    /// replicas or the cluster's default: never quietly fewer.
    async fn create(&self, partitions: i32, replication_factor: Option<u16>) -> Result<(), String> {
        let client = self.client.clone();
        let brokers = tokio::task::spawn_blocking(move || durability::broker_count(&client))
            .await
            .map_err(|e| e.to_string())??;
        if let Some(wanted) = replication_factor {
            durability::check_replication(
                usize::from(wanted),
                brokers,
                "store.replication_factor",
            )?;
        }
        let replicas = replication_factor.map_or(-1, i32::from);
        let admin = self.admin()?;
        let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let mut new = NewTopic::new(&self.topic, partitions, TopicReplication::Fixed(replicas));
        for (k, v) in TOPIC_CONFIG {
            new = new.set(k, v);
        }
        let outcome = match admin.create_topics([&new], &options).await {
            Ok(results) => results.into_iter().next(),
            Err(e) => return Err(format!("cannot create it: {e}")),
        };
        match outcome {
            Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => Ok(()),
            Some(Err((_, RDKafkaErrorCode::InvalidReplicationFactor))) => Err(format!(
                "cannot create it: the cluster's default.replication.factor is more than its \
                 {brokers} broker{}; set store.replication_factor (delayd does not fall back \
                 to fewer replicas)",
                if brokers == 1 { "" } else { "s" }
            )),
            Some(Err((_, code))) => Err(format!("cannot create it: {code}")),
        }
    }

    /// An existing topic must have the replicas asked for; a replicated one
    /// should not acknowledge on a single in-sync replica (a warning).
    async fn check_durability(&self, replication_factor: Option<u16>) -> Result<(), String> {
        let found = durability::topic_durability(&self.client, &self.topic).await?;
        if let Some(wanted) = replication_factor.map(usize::from) {
            if found.replicas < wanted {
                return Err(format!(
                    "it has {} replicas, fewer than store.replication_factor = {wanted}; add \
                     replicas (kafka-reassign-partitions) or lower the setting",
                    found.replicas
                ));
            }
        }
        for warning in found.warnings(&self.topic) {
            tracing::warn!(topic = %self.topic, "{warning}");
        }
        Ok(())
    }

    /// An existing topic must be compacted and have a partition for every
    /// source partition.
    async fn check(&self, partitions: i32) -> Result<(), String> {
        let consumer: BaseConsumer = self
            .client
            .client_config(Role::Admin, &[], &[])
            .create()
            .map_err(super::without_value)
            .map_err(|e| format!("cannot create a metadata client: {e}"))?;
        let topic = self.topic.clone();
        let have = tokio::task::spawn_blocking(move || settled_partition_count(&consumer, &topic))
            .await
            .map_err(|e| e.to_string())??;
        if have < partitions {
            return Err(format!(
                "it has {have} partitions, fewer than the route's source topics ({partitions}); \
                 add partitions to it (kafka-topics --alter --partitions {partitions})"
            ));
        }
        let admin = self.admin()?;
        let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
        let configs = admin
            .describe_configs([&ResourceSpecifier::Topic(&self.topic)], &options)
            .await
            .map_err(|e| format!("cannot read its configuration: {e}"))?;
        for resource in configs.into_iter().flatten() {
            if let Some(policy) = resource.get("cleanup.policy").and_then(|e| e.value.clone()) {
                if !policy.split(',').any(|p| p.trim() == "compact") {
                    return Err(format!(
                        "its cleanup.policy is {policy:?}; a state topic must be compacted \
                         (cleanup.policy=compact), or Done records never free space and \
                         pending ones may be deleted"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Queue a Schedule record now (before returning); the future resolves
    /// once the broker has it (`acks=all`).
    pub fn put(
        &self,
        partition: i32,
        key: &[u8],
        value: &[u8],
    ) -> BoxFuture<'static, Result<(), StateError>> {
        let record = FutureRecord::to(&self.topic)
            .partition(partition)
            .key(key)
            .payload(value);
        self.send(record)
    }

    /// Queue a tombstone for `key` now; the future resolves once it is written.
    pub fn delete(&self, partition: i32, key: &[u8]) -> BoxFuture<'static, Result<(), StateError>> {
        let record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).partition(partition).key(key);
        self.send(record)
    }

    fn send(
        &self,
        record: FutureRecord<'_, [u8], [u8]>,
    ) -> BoxFuture<'static, Result<(), StateError>> {
        let topic = self.topic.clone();
        let producer = self.producer();
        let (shared, client) = (self.producer.clone(), self.client.clone());
        let failed = move |source: KafkaError| {
            Self::replace_if_fatal(&shared, &producer, &client, &topic);
            Err(StateError::Write { topic, source })
        };
        match self.producer().send_result(record) {
            Ok(delivery) => Box::pin(async move {
                match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((source, _))) => failed(source),
                    Err(_) => failed(KafkaError::Canceled),
                }
            }),
            Err((source, _)) => {
                let result = failed(source);
                Box::pin(async move { result })
            }
        }
    }

    /// Blocking: every live record of `partition` (key → Schedule value),
    /// read from the partition's start to its high watermark as it was when
    /// the read began. Fails if no progress is made for `stall`.
    pub fn read_partition(
        &self,
        partition: i32,
        stall: Duration,
    ) -> Result<HashMap<Vec<u8>, Vec<u8>>, StateError> {
        let err = |reason: String| StateError::Read {
            topic: self.topic.clone(),
            partition,
            reason,
        };
        // The partition is assigned by hand: the group is never joined and
        // nothing is committed (librdkafka wants a group.id to assign).
        let consumer: BaseConsumer = self
            .client
            .client_config(
                Role::Admin,
                &[],
                &[
                    ("group.id", "delayd-state-restore"),
                    ("enable.auto.commit", "false"),
                    ("enable.auto.offset.store", "false"),
                    ("enable.partition.eof", "false"),
                ],
            )
            .create()
            .map_err(super::without_value)
            .map_err(|e| err(format!("cannot create a consumer: {e}")))?;
        let (low, high) = consumer
            .fetch_watermarks(&self.topic, partition, Duration::from_secs(10))
            .map_err(|e| err(format!("cannot read its watermarks: {e}")))?;
        let mut live = HashMap::new();
        if high <= low {
            return Ok(live);
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(low))
            .map_err(|e| err(e.to_string()))?;
        consumer.assign(&tpl).map_err(|e| err(e.to_string()))?;
        let mut next = low;
        let mut progress = Instant::now();
        while next < high {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(record)) => {
                    next = record.offset() + 1;
                    progress = Instant::now();
                    let Some(key) = record.key() else { continue };
                    match record.payload() {
                        Some(value) => live.insert(key.to_vec(), value.to_vec()),
                        None => live.remove(key),
                    };
                }
                Some(Err(e)) => {
                    if progress.elapsed() > stall {
                        return Err(err(e.to_string()));
                    }
                }
                None => {
                    // Compaction may have removed the last offsets below
                    // the high watermark: the position says where reading is.
                    if let Ok(position) = consumer.position() {
                        if let Some(e) = position.find_partition(&self.topic, partition) {
                            if let Offset::Offset(o) = e.offset() {
                                next = next.max(o);
                            }
                        }
                    }
                    if next < high && progress.elapsed() > stall {
                        return Err(err(format!(
                            "no progress for {stall:?} at offset {next} of {high}"
                        )));
                    }
                }
            }
        }
        Ok(live)
    }

    /// Wait up to `timeout` for queued writes (at shutdown).
    pub fn flush(&self, timeout: Duration) {
        if let Err(e) = self.producer().flush(timeout) {
            tracing::warn!(error = %e, topic = %self.topic, "Kafka state producer flush");
        }
    }
}

/// Partitions of `topic` (0 if it does not exist), asked until two answers
/// agree: a topic created a moment ago shows up in metadata with fewer
/// partitions, or none, for a while.
fn settled_partition_count(consumer: &BaseConsumer, topic: &str) -> Result<i32, String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = None;
    loop {
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .map_err(|e| format!("cannot read its metadata: {e}"))?;
        let count = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none())
            .map_or(0, |t| {
                t.partitions()
                    .iter()
                    .filter(|p| p.error().is_none() && p.leader() >= 0)
                    .count() as i32
            });
        if last == Some(count) && (count > 0 || Instant::now() >= deadline) {
            return Ok(count);
        }
        if Instant::now() >= deadline {
            return Ok(count);
        }
        last = Some(count);
        std::thread::sleep(Duration::from_millis(if count > 0 { 100 } else { 500 }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_round_trips_and_a_foreign_one_is_refused() {
        let v = encode_value(1_700_000_000_123, 7 << 64 | 9, b"encoded");
        assert_eq!(
            decode_value(&v),
            Some(StateValue {
                due_ms: 1_700_000_000_123,
                uid: Some(7 << 64 | 9),
                encoded: b"encoded"
            })
        );
        assert_eq!(decode_value(&v[..8]), None, "too short");
        assert_eq!(decode_value(&v[..20]), None, "too short for its identity");
        let mut other = v.clone();
        other[0] = 3;
        assert_eq!(decode_value(&other), None, "unknown version");
    }

    /// A version 1 value, as delayd wrote them before identities, spelled
    /// out byte by byte: it still reads, without an identity.
    #[test]
    fn a_version_1_value_still_decodes() {
        let v1 = [&[1u8][..], &1_000u64.to_be_bytes(), b"msg"].concat();
        assert_eq!(
            decode_value(&v1),
            Some(StateValue {
                due_ms: 1_000,
                uid: None,
                encoded: b"msg"
            })
        );
    }

    #[test]
    fn a_key_names_its_source_topic() {
        let m = Message {
            source: "orders.delay".into(),
            partition: Some(3),
            offset: Some(42),
            ..Message::default()
        };
        let (p, key) = state_key(&m).expect("a Kafka message has a key");
        assert_eq!(p, 3);
        assert_eq!(key, b"orders.delay/3/42");
        assert_eq!(key_topic(&key), Some(&b"orders.delay"[..]));
        assert_eq!(key_topic(b"nokey"), None);
        let amqp = Message::default();
        assert_eq!(state_key(&amqp), None);
    }
}
