//! The broker-kept store (`[store] kind = "broker"`), Kafka routes: the
//! durable record of a pending message is a record in the route's
//! compacted state topic (see `delayd_adapters::kafka::state` and
//! docs/broker-store.md). The local WAL still holds the bodies the wheel
//! fires from, but it is no longer the truth.
//!
//! Rules, each keeping "nothing lost, nothing early":
//! * Intake: the state record is queued after the redelivery check and
//!   before the message is armed, so its tombstone can only be queued after
//!   it (one idempotent producer: same order on the broker). The source
//!   offset is committed only once both the WAL record and the state record
//!   are durable.
//! * Delivered (or parked): a tombstone. If it is lost, the message is
//!   restored and fired again later: a duplicate, never a loss.
//! * Cancelled (API, Kafka tombstone): a tombstone too, queued once the
//!   local Done is durable.
//! * Partition assigned: before any of its records is consumed, its state
//!   partition is read to the high watermark and every live message is
//!   stored and armed here with its original due time.
//! * Partition revoked (rebalance, shutdown): its messages are released
//!   here (Done in the local WAL only); the next owner restores them.
//! * Start: whatever the local WAL holds for these routes is released
//!   first. The partitions may be another instance's by now, and what is
//!   ours is restored from the state topic on assignment. A route whose
//!   state was local until now (no mark in the WAL directory) first has
//!   every message the WAL holds written to the state topic.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use delayd_adapters::kafka::state::{decode_value, encode_value, key_topic, state_key};
use delayd_adapters::kafka::{KafkaClientConfig, PartitionListener, StateTopic};
use delayd_adapters::offsets::TopicPartition;
use delayd_adapters::{BoxFuture, Message};
use tokio_util::sync::CancellationToken;

use crate::engine::{Arrival, Engine, EngineError, Stored, Storing};
use crate::id::MessageId;

/// A restore that makes no progress this long is started again.
const RESTORE_STALL: Duration = Duration::from_secs(30);

/// A failed state write (Schedule) is tried again after this.
const WRITE_RETRY: Duration = Duration::from_millis(500);

/// How long a tombstone may take before it is given up (the message is
/// then restored and fired again by whoever restores its partition).
const TOMBSTONE_TIMEOUT: Duration = Duration::from_secs(10);

/// Restored records stored in the WAL per batch.
const RESTORE_BATCH: usize = 4096;

/// One Kafka route's broker-kept store.
pub struct KafkaStore {
    pub(super) route: String,
    pub(super) engine: Engine,
    state: StateTopic,
    runtime: tokio::runtime::Handle,
    /// Engine ids of the pending messages read from each source partition
    /// this instance holds.
    owned: Mutex<HashMap<TopicPartition, HashSet<u64>>>,
    /// Partitions being restored now (`/readyz` waits for 0).
    restoring: AtomicUsize,
    /// Set at shutdown: restores and write retries give up.
    stop: CancellationToken,
}

impl KafkaStore {
    /// Open (creating if needed) the state topic of `route`, with a
    /// partition for each partition of its source topics.
    pub async fn open(
        client: &KafkaClientConfig,
        topic: &str,
        route: &str,
        source_topics: &[String],
        replication_factor: Option<u16>,
        engine: Engine,
        stop: CancellationToken,
    ) -> anyhow::Result<Arc<Self>> {
        let partitions = StateTopic::partitions_of(client, source_topics).await?;
        let state = StateTopic::open(client, topic, partitions, replication_factor).await?;
        tracing::info!(
            route,
            topic,
            partitions,
            "broker-kept store: Kafka state topic ready"
        );
        Ok(Arc::new(Self {
            route: route.to_owned(),
            engine,
            state,
            runtime: tokio::runtime::Handle::current(),
            owned: Mutex::new(HashMap::new()),
            restoring: AtomicUsize::new(0),
            stop,
        }))
    }

    pub fn topic(&self) -> &str {
        self.state.topic()
    }

    /// Is a partition being restored now?
    pub fn restoring(&self) -> bool {
        self.restoring.load(Ordering::Acquire) > 0
    }

    fn owned(&self) -> MutexGuard<'_, HashMap<TopicPartition, HashSet<u64>>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// At start, before anything fires: take what the local WAL holds for
    /// this route out of it. If the WAL was last used with this route's
    /// state in the broker (`mirrored`), the state topic has every one of
    /// them. If not (the route kept its state locally until now), each is
    /// first written to the state topic, and only released once Kafka has
    /// them all: switching a route to the broker store loses nothing.
    /// Returns (written to the state topic, released).
    pub async fn adopt_cached(&self, mirrored: bool) -> anyhow::Result<(u64, u64)> {
        let engine = self.engine.clone();
        let route = self.route.clone();
        let stored = tokio::task::spawn_blocking(move || -> Result<_, EngineError> {
            let mut out = Vec::new();
            for info in engine.waiting().iter().filter(|i| *i.route == *route) {
                if let Some(crate::wal::Record::Schedule {
                    due_ms,
                    uid,
                    message,
                    ..
                }) = engine.record_of(info)?
                {
                    let uid = MessageId::or_legacy(uid, info.id);
                    out.push((info.id, due_ms, uid, message));
                }
            }
            Ok(out)
        })
        .await??;
        let mut written = 0;
        if !mirrored {
            let mut puts = Vec::new();
            for (_, due_ms, uid, message) in &stored {
                let key = delayd_adapters::decode(message)
                    .ok()
                    .as_ref()
                    .and_then(state_key);
                let Some((partition, key)) = key else {
                    anyhow::bail!(
                        "route {}: a stored message has no Kafka source coordinates; \
                         cannot move it to the state topic",
                        self.route
                    );
                };
                puts.push(self.state.put(
                    partition,
                    &key,
                    &encode_value(*due_ms, uid.as_u128(), message),
                ));
            }
            for put in puts {
                put.await?;
                written += 1;
            }
        }
        let mut released = 0;
        let ids = stored.into_iter().map(|(id, _, _, _)| id);
        for (_, outcome) in super::release_all(&self.engine, ids).await {
            if outcome? {
                released += 1;
            }
        }
        Ok((written, released))
    }

    /// Store a consumed record: its WAL record and its state record, both
    /// durable when the future resolves (and the message armed).
    pub fn store(
        self: &Arc<Self>,
        message: &Message,
        due_ms: u64,
        uid: MessageId,
        encoded: Vec<u8>,
        arrival: Arrival,
    ) -> BoxFuture<'static, Result<Stored, EngineError>> {
        let Some((partition, key)) = state_key(message) else {
            // Not from Kafka (config validation prevents it): local only.
            return Box::pin(
                self.engine
                    .store(&self.route, due_ms, uid, encoded, arrival),
            );
        };
        let value = encode_value(due_ms, uid.as_u128(), &encoded);
        let wal = match self
            .engine
            .begin_store(&self.route, due_ms, uid, encoded, arrival)
        {
            Storing::Duplicate => return Box::pin(async { Ok(Stored::Duplicate) }),
            // The state value carries the delivery's own identity, which is
            // a copy's sibling's too: a Kafka record's identity follows from
            // its coordinates, and its stored bytes carry its offset, so
            // only a record read again equals a stored one (no
            // `Record::Copy` needed, unlike the RabbitMQ store).
            Storing::New(wal) => wal,
            Storing::Copy(wal, sibling) => {
                debug_assert_eq!(sibling, uid, "a Kafka copy of another record");
                wal
            }
        };
        // Queued before the message can be armed (see the module doc).
        let put = self.state.put(partition, &key, &value);
        let tp = (message.source.clone(), partition);
        let this = self.clone();
        Box::pin(async move {
            let written = match wal.await {
                Ok(w) => w,
                Err(e) => {
                    if is_too_large(&e) {
                        // It goes to the invalid destination: not pending anywhere.
                        this.forget(partition, &key).await;
                    }
                    return Err(e);
                }
            };
            this.own(tp, written.id);
            this.settle_put(put, partition, &key, &value, written.id)
                .await?;
            Ok(written.commit())
        })
    }

    /// Tombstone a state record whose message is not pending (best effort).
    async fn forget(&self, partition: i32, key: &[u8]) {
        if let Err(e) = self.state.delete(partition, key).await {
            tracing::warn!(route = %self.route, error = %e, "cannot tombstone a state record");
        }
    }

    fn own(&self, tp: TopicPartition, id: u64) {
        self.owned().entry(tp).or_default().insert(id);
    }

    /// Wait for a Schedule to be written, writing it again after a failure
    /// for as long as the message is pending here.
    async fn settle_put(
        &self,
        mut put: BoxFuture<'static, Result<(), delayd_adapters::kafka::StateError>>,
        partition: i32,
        key: &[u8],
        value: &[u8],
        id: u64,
    ) -> Result<(), EngineError> {
        loop {
            let Err(e) = put.await else {
                metrics::counter!("delayd_store_writes_total", "route" => self.route.clone(), "kind" => "schedule").increment(1);
                return Ok(());
            };
            metrics::counter!("delayd_store_write_failures_total", "route" => self.route.clone())
                .increment(1);
            if !self.engine.is_pending(id) {
                // Fired (its tombstone was queued after this failed write) or released.
                return Ok(());
            }
            tracing::warn!(route = %self.route, error = %e, "cannot write the state record; the delivery is held until it is written");
            tokio::select! {
                _ = tokio::time::sleep(WRITE_RETRY) => {}
                _ = self.stop.cancelled() => {
                    return Err(EngineError::Interrupted("the state record was not written before shutdown"));
                }
            }
            put = self.state.put(partition, key, value);
        }
    }

    /// The state key of a stored message, if it came from Kafka.
    pub fn key_of(message: &Message) -> Option<(TopicPartition, Vec<u8>)> {
        let (partition, key) = state_key(message)?;
        Some(((message.source.clone(), partition), key))
    }

    /// Message `id` was delivered or parked: tombstone its state record.
    pub async fn done(&self, id: u64, tp: TopicPartition, key: Vec<u8>) {
        if let Some(ids) = self.owned().get_mut(&tp) {
            ids.remove(&id);
        }
        let route = self.route.clone();
        match tokio::time::timeout(TOMBSTONE_TIMEOUT, self.state.delete(tp.1, &key)).await {
            Ok(Ok(())) => {
                metrics::counter!("delayd_store_writes_total", "route" => route, "kind" => "tombstone").increment(1);
            }
            Ok(Err(e)) => {
                metrics::counter!("delayd_store_write_failures_total", "route" => route)
                    .increment(1);
                tracing::warn!(route = %self.route, id, error = %e, "cannot write the tombstone: the message will be fired again after a restore");
            }
            Err(_) => {
                metrics::counter!("delayd_store_write_failures_total", "route" => route)
                    .increment(1);
                tracing::warn!(route = %self.route, id, "tombstone timed out: the message will be fired again after a restore");
            }
        }
    }

    /// A pending message was cancelled (its local Done is durable):
    /// tombstone its state record, or a restore would bring it back. The
    /// tombstone is queued now, after its Schedule; the future resolves
    /// once it is written (bounded by [`TOMBSTONE_TIMEOUT`]), so the cancel
    /// (an API call, a source tombstone's offset) is acknowledged only then.
    pub fn cancelled(&self, id: u64, stored: &[u8]) -> BoxFuture<'static, Result<(), String>> {
        let Some((tp, key)) = delayd_adapters::decode(stored)
            .ok()
            .as_ref()
            .and_then(Self::key_of)
        else {
            return Box::pin(async { Ok(()) });
        };
        if let Some(ids) = self.owned().get_mut(&tp) {
            ids.remove(&id);
        }
        let write = self.state.delete(tp.1, &key);
        let route = self.route.clone();
        Box::pin(async move {
            let result = match tokio::time::timeout(TOMBSTONE_TIMEOUT, write).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within {TOMBSTONE_TIMEOUT:?}")),
            };
            match &result {
                Ok(()) => {
                    metrics::counter!("delayd_store_writes_total", "route" => route, "kind" => "tombstone").increment(1);
                }
                Err(e) => {
                    metrics::counter!("delayd_store_write_failures_total", "route" => route.clone()).increment(1);
                    tracing::error!(route, error = %e, "cannot tombstone a cancelled message's state record: it comes back after a restore");
                }
            }
            result
        })
    }

    /// Read source partition `tp`'s pending messages from the state topic
    /// and arm them here. Returns how many.
    async fn restore(&self, tp: &TopicPartition) -> anyhow::Result<u64> {
        // A partition added to the source topic at run time needs its state
        // partition before anything of it is stored.
        self.state.ensure_partitions(tp.1 + 1).await?;
        let state = self.state.clone();
        let partition = tp.1;
        let live =
            tokio::task::spawn_blocking(move || state.read_partition(partition, RESTORE_STALL))
                .await??;
        let mut restored = 0u64;
        let mut batch = Vec::with_capacity(RESTORE_BATCH.min(live.len()));
        for (key, value) in &live {
            if key_topic(key) != Some(tp.0.as_bytes()) {
                continue; // another source topic's partition of the same number
            }
            let Some(value) = decode_value(value) else {
                tracing::error!(route = %self.route, key = %String::from_utf8_lossy(key), "state record of an unknown format; left in place");
                continue;
            };
            // A version 1 value has no identity: the record's own, from
            // its source coordinates.
            let uid = match value.uid {
                Some(uid) => MessageId::from_u128(uid),
                None => delayd_adapters::decode(value.encoded)
                    .map(|m| crate::runtime::identity::identity_of(&m))
                    .unwrap_or_else(|_| MessageId::mint()),
            };
            // Not a redelivery: stored whatever the local WAL had (released).
            let stored = self.engine.store(
                &self.route,
                value.due_ms,
                uid,
                value.encoded.to_vec(),
                false,
            );
            batch.push((key, stored));
            if batch.len() == RESTORE_BATCH {
                restored += self.settle_restored(tp, &mut batch).await?;
            }
        }
        restored += self.settle_restored(tp, &mut batch).await?;
        Ok(restored)
    }

    /// Wait for a batch of restored records; each stored one is owned
    /// (released on revoke, or before a failed restore is tried again).
    async fn settle_restored(
        &self,
        tp: &TopicPartition,
        batch: &mut Vec<(
            &Vec<u8>,
            impl std::future::Future<Output = Result<Stored, EngineError>>,
        )>,
    ) -> Result<u64, EngineError> {
        let mut n = 0;
        for (key, stored) in batch.drain(..) {
            match stored.await {
                Ok(Stored::New(id) | Stored::Copy { id, .. }) => {
                    self.own(tp.clone(), id);
                    n += 1;
                }
                Ok(Stored::Duplicate) => {}
                Err(e) if is_too_large(&e) => {
                    // Only a smaller wal.max_message_bytes than when it was
                    // written gets here: say so, and keep the record.
                    tracing::error!(route = %self.route, key = %String::from_utf8_lossy(key), error = %e, "a restored message is larger than wal.max_message_bytes; it stays in the state topic");
                }
                Err(e) => return Err(e),
            }
        }
        // Per batch, so the metric shows how far a long restore has come.
        metrics::counter!("delayd_store_restored_total", "route" => self.route.clone())
            .increment(n);
        Ok(n)
    }

    /// Release the messages of `tp` held here.
    async fn release(&self, tp: &TopicPartition) -> u64 {
        let ids = self.owned().remove(tp).unwrap_or_default();
        let mut released = 0;
        for (id, outcome) in super::release_all(&self.engine, ids).await {
            match outcome {
                Ok(true) => released += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(route = %self.route, id, error = %e, "cannot release a message of a revoked partition; it may fire here too")
                }
            }
        }
        released
    }

    /// Wait up to `timeout` for queued state writes (at shutdown).
    pub fn flush(&self, timeout: Duration) {
        self.state.flush(timeout);
    }
}

impl PartitionListener for KafkaStore {
    /// Restore each partition before its records are consumed: blocks the
    /// source's poll thread, retrying until done or shutdown.
    fn assigned(&self, partitions: &[TopicPartition]) {
        self.restoring.fetch_add(1, Ordering::AcqRel);
        let gauge =
            metrics::gauge!("delayd_store_restoring_partitions", "route" => self.route.clone());
        gauge.increment(partitions.len() as f64);
        for tp in partitions {
            loop {
                let started = std::time::Instant::now();
                match self.runtime.block_on(self.restore(tp)) {
                    Ok(n) => {
                        tracing::info!(route = %self.route, topic = %tp.0, partition = tp.1, restored = n, elapsed_ms = started.elapsed().as_millis() as u64, "partition restored from the state topic");
                        break;
                    }
                    Err(e) => {
                        tracing::error!(route = %self.route, topic = %tp.0, partition = tp.1, error = %e, "cannot restore the partition; trying again");
                        // What this attempt stored would be stored twice.
                        self.runtime.block_on(self.release(tp));
                        if self.stop.is_cancelled() {
                            break;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            }
            gauge.decrement(1.0);
        }
        self.restoring.fetch_sub(1, Ordering::AcqRel);
    }

    fn revoked(&self, partitions: &[TopicPartition]) {
        for tp in partitions {
            let released = self.runtime.block_on(self.release(tp));
            if released > 0 {
                tracing::info!(route = %self.route, topic = %tp.0, partition = tp.1, released, "partition revoked; its pending messages are left to its next owner");
            }
        }
    }
}

fn is_too_large(e: &EngineError) -> bool {
    matches!(e, EngineError::Wal(crate::wal::WalError::TooLarge { .. }))
}
