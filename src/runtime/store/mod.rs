//! The broker-kept store (`[store] kind = "broker"`, docs/broker-store.md):
//! a route's pending messages kept in its broker, so that any instance,
//! even one with an empty disk, can restore them. The local WAL is then a
//! working copy.
//!
//! * [`kafka`]: a compacted state topic per route, co-partitioned with the
//!   source; its wire format and I/O are `delayd_adapters::kafka::state`.
//! * [`rabbitmq`]: one owner per route (a lock queue held as a lease) and
//!   state streams in generations; its wire format and I/O are
//!   `delayd_adapters::amqp::state`.
//! * [`mirrored`]: which routes a WAL directory last kept in the broker.
//! * [`owed`]: the Dones a RabbitMQ route's former owner still writes.
//! * [`warm`]: a RabbitMQ route's state as a standby keeps it read.
//! * Here: [`RouteStore`], the calls the intake, the deliverer, the cancel
//!   hook and `/readyz` make on either, and [`open_stores`].

mod departed;
mod kafka;
mod mirrored;
mod owed;
mod partitions;
mod rabbitmq;
mod warm;

use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::offsets::TopicPartition;
use delayd_adapters::{BoxFuture, Message};

use std::collections::HashMap;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::brokers::{BrokerHandle, Brokers};
use crate::config::{Config, StoreKind};
use crate::engine::Engine;
use crate::engine::{Arrival, EngineError, Stored};
use crate::id::MessageId;
use kafka::KafkaStore;
use partitions::PartitionGroup;
use rabbitmq::{Phase, StreamStore};

#[derive(Clone)]
pub enum RouteStore {
    /// A compacted state topic, restored per partition.
    Kafka(Arc<KafkaStore>),
    /// State streams, owned by one instance at a time.
    Stream(Arc<StreamStore>),
}

/// The state write owed once a message has left (delivered or parked).
pub enum PendingDone {
    Kafka(Arc<KafkaStore>, u64, TopicPartition, Vec<u8>),
    Stream(Arc<StreamStore>, u64),
}

impl PendingDone {
    pub async fn write(self) {
        match self {
            PendingDone::Kafka(store, id, tp, key) => store.done(id, tp, key).await,
            PendingDone::Stream(store, id) => store.done(id),
        }
    }
}

impl RouteStore {
    /// Store a consumed delivery here and in the broker.
    pub fn store(
        &self,
        message: &Message,
        due_ms: u64,
        uid: MessageId,
        encoded: Vec<u8>,
        arrival: Arrival,
    ) -> BoxFuture<'static, Result<Stored, EngineError>> {
        // A redelivery whose original is still being written waits for it
        // (see `Engine::wait_for_original`), as `Engine::store` does.
        let (engine, route) = match self {
            RouteStore::Kafka(s) => (&s.engine, &s.route),
            RouteStore::Stream(s) => (&s.engine, &s.route),
        };
        if let Some(wait) = engine.wait_for_original(route, &encoded, arrival.redelivered) {
            let (this, message) = (self.clone(), message.clone());
            return Box::pin(async move {
                wait.await;
                this.store(&message, due_ms, uid, encoded, arrival).await
            });
        }
        match self {
            RouteStore::Kafka(s) => s.store(message, due_ms, uid, encoded, arrival),
            RouteStore::Stream(s) => s.store(due_ms, uid, encoded, arrival),
        }
    }

    /// What to write once fired message `id` (decoded: `message`) has left.
    pub fn pending_done(&self, id: u64, message: &Message) -> Option<PendingDone> {
        match self {
            RouteStore::Kafka(s) => KafkaStore::key_of(message)
                .map(|(tp, key)| PendingDone::Kafka(s.clone(), id, tp, key)),
            RouteStore::Stream(s) => Some(PendingDone::Stream(s.clone(), id)),
        }
    }

    /// A pending message was cancelled (its local Done is durable):
    /// resolves once its removal from the store is durable too.
    pub fn cancelled(&self, id: u64, stored: &[u8]) -> BoxFuture<'static, Result<(), String>> {
        match self {
            RouteStore::Kafka(s) => s.cancelled(id, stored),
            RouteStore::Stream(s) => s.cancelled(id, stored),
        }
    }

    /// Whether this instance may publish the route's due message `id` now.
    pub fn may_fire(&self, id: u64) -> bool {
        match self {
            RouteStore::Kafka(_) => true,
            RouteStore::Stream(s) => s.may_fire(id),
        }
    }

    pub fn restoring(&self) -> bool {
        match self {
            RouteStore::Kafka(s) => s.restoring(),
            RouteStore::Stream(s) => s.restoring(),
        }
    }

    /// Another instance owns the route (RabbitMQ); this one waits.
    pub fn standby(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.phase() == Phase::Standby)
    }

    /// The route's state streams are incomplete: not consumed, not ready.
    pub fn state_missing(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.state_missing())
    }

    /// Whether this instance owns the route is not known yet (RabbitMQ).
    pub fn electing(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.phase() == Phase::Electing)
    }

    /// For `/readyz`.
    pub fn describe(&self) -> serde_json::Value {
        match self {
            RouteStore::Kafka(s) => {
                serde_json::json!({ "state_topic": s.topic(), "restoring": s.restoring() })
            }
            RouteStore::Stream(s) => serde_json::json!({
                "state_stream": s.stream(),
                "restoring": s.restoring(),
                "owner": matches!(s.phase(), Phase::Restoring | Phase::Active),
                "state_missing": s.state_missing(),
            }),
        }
    }

    /// At shutdown, once in-flight publishes are done.
    pub async fn flush(&self, timeout: Duration) {
        match self {
            RouteStore::Kafka(s) => s.flush(timeout),
            RouteStore::Stream(s) => s.flush(timeout).await,
        }
    }
}

/// `store.kind = "broker"`: each Kafka route's state topic, opened (and
/// created if missing), each RabbitMQ route's state streams (opened by
/// whichever instance owns the route), and what the local WAL still held
/// for those routes released before anything fires.
pub(super) async fn open_stores(
    config: &Config,
    brokers: &Brokers,
    engine: &Engine,
    stop: &CancellationToken,
) -> anyhow::Result<HashMap<String, RouteStore>> {
    let mut stores = HashMap::new();
    if config.store.kind != StoreKind::Broker {
        refuse_to_strand(config)?;
        return Ok(stores);
    }
    // Routes whose state this WAL last kept in the broker.
    let mirrored = mirrored::mirrored_routes(&config.wal.dir)?;
    let mut groups: HashMap<String, Arc<PartitionGroup>> = HashMap::new();
    for route in &config.routes {
        let topic = config.store.topic(&route.name);
        let was_mirrored = mirrored.contains(&route.name);
        let opened = match brokers.get(&route.from.broker) {
            Some(BrokerHandle::Kafka { client }) => {
                let client = client.named(format!("delayd-{}", route.name));
                let replication = config.store.replication_factor;
                open_kafka_store(
                    &client,
                    &topic,
                    route,
                    engine,
                    stop,
                    was_mirrored,
                    replication,
                )
                .await
            }
            Some(BrokerHandle::Amqp { connections }) => {
                let endpoints = connections.consume.endpoints().clone();
                let group = route.partition.as_ref().map(|p| {
                    groups
                        .entry(p.group.clone())
                        .or_insert_with(|| {
                            let group = PartitionGroup::new(&p.group, p.count);
                            let broker = delayd_adapters::amqp::Broker::with_endpoints(
                                endpoints.clone(),
                                delayd_adapters::amqp::BrokerOptions::named(format!(
                                    "delayd-members-{}",
                                    p.group
                                )),
                            );
                            let queue = format!("{}.members", config.store.topic(&p.group));
                            tokio::spawn(group.clone().run_presence(broker, queue, stop.clone()));
                            group
                        })
                        .clone()
                });
                open_stream_store(
                    endpoints,
                    &topic,
                    route,
                    engine,
                    was_mirrored,
                    config,
                    group,
                )
                .await
            }
            None => continue,
        };
        stores.insert(
            route.name.clone(),
            opened.with_context(|| format!("route {}: store.kind = \"broker\"", route.name))?,
        );
    }
    // Kafka routes are marked now (their WAL copies are in the state topic
    // already); RabbitMQ routes once they have no local-only message left
    // (see `StreamStore::adopt_cached`). Routes no longer broker-kept lose
    // their mark.
    let routes: Vec<&str> = stores
        .iter()
        .filter(|(name, store)| {
            matches!(store, RouteStore::Kafka(_)) || mirrored.contains(name.as_str())
        })
        .map(|(name, _)| name.as_str())
        .collect();
    mirrored::mark_mirrored(&config.wal.dir, &routes)?;
    for store in stores.values() {
        if let RouteStore::Stream(s) = store {
            s.mark_if_drained()?;
        }
    }
    Ok(stores)
}

async fn open_kafka_store(
    client: &delayd_adapters::kafka::KafkaClientConfig,
    topic: &str,
    route: &crate::config::RouteConfig,
    engine: &Engine,
    stop: &CancellationToken,
    mirrored: bool,
    replication_factor: Option<u16>,
) -> anyhow::Result<RouteStore> {
    let store = KafkaStore::open(
        client,
        topic,
        &route.name,
        &route.from.topics,
        replication_factor,
        engine.clone(),
        stop.clone(),
    )
    .await?;
    let (written, released) = store
        .adopt_cached(mirrored)
        .await
        .context("moving the local copies")?;
    if written > 0 {
        tracing::info!(route = %route.name, written, "messages kept locally until now written to the state topic");
    }
    if released > 0 {
        tracing::info!(route = %route.name, released, "local copies released; the state topic is restored per partition as the group assigns them");
    }
    Ok(RouteStore::Kafka(store))
}

async fn open_stream_store(
    endpoints: std::sync::Arc<delayd_adapters::amqp::Endpoints>,
    stream: &str,
    route: &crate::config::RouteConfig,
    engine: &Engine,
    mirrored: bool,
    config: &Config,
    group: Option<Arc<PartitionGroup>>,
) -> anyhow::Result<RouteStore> {
    let (settings, wal_dir) = (&config.store, &config.wal.dir);
    let names = delayd_adapters::amqp::state::StateNames::new(stream)
        .with_replicas(settings.replication_factor)
        .with_append_timeout(settings.write_timeout)
        .with_lease(settings.lease);
    let store = StreamStore::new(
        endpoints,
        names,
        &route.name,
        engine.clone(),
        settings.checkpoint_records,
        wal_dir.to_owned(),
        group,
    )?;
    let (released, kept) = store.adopt_cached(mirrored).await?;
    if released > 0 {
        tracing::info!(route = %route.name, released, "local copies released; the route's owner restores them from its state streams");
    }
    if kept > 0 {
        tracing::warn!(route = %route.name, kept, "messages stored before the route kept its state in the broker stay in this WAL and fire from here");
    }
    Ok(RouteStore::Stream(store))
}

/// `store.kind = "local"` on a WAL that mirrored routes' state topics:
/// their pending messages are in those topics (a stopping instance leaves
/// its partitions' messages there for the next owner), and a local store
/// would never read them. Refuse, naming what to do.
fn refuse_to_strand(config: &Config) -> anyhow::Result<()> {
    let mirrored = mirrored::mirrored_routes(&config.wal.dir)?;
    let stranded: Vec<&str> = config
        .routes
        .iter()
        .map(|r| r.name.as_str())
        .filter(|r| mirrored.contains(*r))
        .collect();
    if stranded.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "store.kind = \"local\", but routes {stranded:?} kept their pending messages in their \
         Kafka state topics (store.kind = \"broker\") until now, and a local store never reads \
         them: keep store.kind = \"broker\" until those topics are empty (delayd store inspect), \
         then delete {} to switch",
        config.wal.dir.join(mirrored::MIRRORED_FILE).display()
    )
}

/// Releases in flight at once when messages are given up.
const RELEASE_CONCURRENCY: usize = 256;

/// Release `ids` from the engine, many at once: one group commit covers
/// many releases. One at a time, each waited for a group commit of its own:
/// 100,000 messages given up took minutes, and a restart that released its
/// 10,408 local copies took 71 s before its admin API listened (the long
/// `redeploy` run of scripts/cluster-faults.sh, 2026-12-01).
async fn release_all(
    engine: &Engine,
    ids: impl IntoIterator<Item = u64>,
) -> Vec<(u64, Result<bool, EngineError>)> {
    use futures_util::StreamExt as _;
    futures_util::stream::iter(ids)
        .map(|id| {
            let engine = engine.clone();
            async move { (id, engine.release(id).await) }
        })
        .buffer_unordered(RELEASE_CONCURRENCY)
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, SystemClock};
    use crate::wal::WalConfig;

    /// Releases share group commits: a restart released its WAL's copies
    /// one commit each (71 s for 10,408 on a loaded machine).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn releases_share_group_commits() {
        const N: u64 = 400;
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::new(WalConfig::new(dir.path()));
        let (engine, _) = Engine::open(config, Arc::new(SystemClock)).unwrap();
        let far = engine.now_ms() + 3_600_000;
        let mut ids = Vec::new();
        for i in 0..N {
            ids.push(
                engine
                    .schedule("r", far, format!("m{i}").into_bytes())
                    .await
                    .unwrap(),
            );
        }
        let before = engine.wal().fsyncs();
        let outcomes = release_all(&engine, ids).await;
        assert_eq!(outcomes.len() as u64, N);
        assert!(outcomes.iter().all(|(_, o)| matches!(o, Ok(true))));
        let commits = engine.wal().fsyncs() - before;
        eprintln!("{commits} group commits for {N} releases");
        // One each, one at a time; batched, 110 of 400 on an idle machine.
        assert!(commits <= N / 2, "{commits} group commits for {N} releases");
        assert_eq!(engine.waiting().len(), 0);
    }
}
