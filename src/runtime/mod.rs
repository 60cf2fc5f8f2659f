//! `delayd run`: wire config, engine, brokers, intake and admin together,
//! and shut down in order on SIGTERM/SIGINT.
//!
//! Shutdown: stop consuming (deliveries already taken are stored and acked),
//! let in-flight publishes finish within `engine.shutdown_grace`, flush and
//! close the WAL, close broker connections, exit 0. A fatal WAL error stops
//! the same way but exits non-zero.

mod backpressure;
mod brokers;
mod deliver;
mod handoff;
mod identity;
mod in_hand;
mod ingest;
mod park;
mod store;

pub use backpressure::Backpressure;
pub use brokers::{BrokerHandle, Brokers};

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use delayd_adapters::amqp::{AmqpSource, ExchangeType, SourceConfig};
use delayd_adapters::kafka::{KafkaSource, KafkaSourceConfig};
use delayd_adapters::Source;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::config::{Config, ExchangeKind};
use crate::engine::Pressure;
use crate::engine::{Dispatch, Engine, EngineConfig, FarSettings, SystemClock};
use crate::route::Route;
use crate::status::{BrokerStatus, RouteIntake, RuntimeStatus};
use crate::wal::WalConfig;
use store::{open_stores, RouteStore};

pub fn engine_config(config: &Config) -> EngineConfig {
    let mut wal = WalConfig::new(&config.wal.dir);
    wal.segment_bytes = config.wal.segment_bytes;
    wal.max_message_bytes = config.wal.max_message_bytes;
    wal.compact_below = config.wal.compact_below;
    wal.on_corruption = config.wal.on_corruption;
    wal.create_dir = config.wal.create_dir;
    wal.reserve_bytes = config.wal.reserve_bytes;
    wal.commit_delay = config.wal.commit_delay;
    wal.lazy_done_wait = config.wal.done_wait;
    EngineConfig {
        max_in_flight: config.engine.max_in_flight,
        max_bytes_in_flight: config.engine.max_bytes_in_flight.clamp(1, u32::MAX as u64) as usize,
        overdue_rate: config.engine.overdue_rate,
        retry_initial: config.engine.retry_initial,
        retry_max: config.engine.retry_max,
        dedup_window: config.engine.dedup_window,
        max_pending: config.engine.max_pending,
        max_disk: config.engine.max_disk,
        key_of: delayd_adapters::lookup_key,
        far: Some(FarSettings {
            horizon: if config.engine.horizon.is_zero() {
                std::time::Duration::from_secs(3600)
            } else {
                config.engine.horizon
            },
            near_only: Default::default(),
            // With the broker store every route restores and releases in
            // the wheel; what the tier already holds still loads.
            spill: !config.engine.horizon.is_zero()
                && config.store.kind == crate::config::StoreKind::Local,
            load_chunk_bytes: crate::engine::LOAD_CHUNK_BYTES,
        }),
        // After partitions expand: each partition has its route's weight.
        route_weights: config
            .routes
            .iter()
            .filter_map(|r| Some((r.name.clone(), r.weight?)))
            .collect(),
        ..EngineConfig::new(wal)
    }
}

/// Run until SIGTERM/SIGINT (Ok) or a fatal error (Err).
pub async fn run(config: Config) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let fatal = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());

    let engine_cfg = engine_config(&config);
    tracing::info!(dir = %config.wal.dir.display(), "recovering WAL");
    let (engine, report) =
        tokio::task::spawn_blocking(move || Engine::open(engine_cfg, Arc::new(SystemClock)))
            .await?
            .context("cannot open the WAL")?;
    tracing::info!(
        segments = report.segments,
        pending = engine.pending(),
        truncated_bytes = report.truncated_bytes,
        corruptions = report.corruptions.len(),
        elapsed_ms = report.elapsed.as_millis() as u64,
        "WAL recovered"
    );

    let brokers = Brokers::from_config(&config)?;
    let routes: HashMap<String, Arc<Route>> = config
        .routes
        .iter()
        .map(|r| (r.name.clone(), Arc::new(Route::compile(r, &config))))
        .collect();
    let routes = Arc::new(routes);

    // Stops consuming; also ends state-write retries (held deliveries go back).
    let intake_stop = CancellationToken::new();
    // Partitions a route had before and no longer has: removed if empty,
    // else the start is refused (guarantee 8), before anything consumes.
    crate::partition_leftovers::enforce_until(&config, &shutdown).await?;
    if config.store.kind == crate::config::StoreKind::Broker && engine.far_pending() > 0 {
        // The broker-kept routes know their messages by their ids here; a
        // bucket loaded later would arm them under new ones, which no
        // store knows (the switch from a local store with a far tier).
        let loaded = engine
            .load_all_far()
            .await
            .context("loading the far tier for the broker-kept store")?;
        tracing::info!(
            loaded,
            "far tier loaded into memory: the broker-kept store does not spill"
        );
    }
    let stores = Arc::new(open_stores(&config, &brokers, &engine, &intake_stop).await?);
    if !stores.is_empty() {
        let stores = stores.clone();
        engine.on_cancel(Arc::new(move |route, id, message| {
            match stores.get(route) {
                Some(store) => store.cancelled(id, message),
                None => Box::pin(async { Ok(()) }),
            }
        }));
    }

    let pressure = Arc::new(Backpressure::default());
    let status = Arc::new(Status {
        brokers: brokers.clone(),
        stores: stores.clone(),
        route_brokers: config
            .routes
            .iter()
            .map(|r| (r.name.clone(), r.from.broker.clone()))
            .collect(),
        pressure: pressure.clone(),
        accepting: AtomicBool::new(true),
        consuming: std::sync::Mutex::new(
            config
                .routes
                .iter()
                .map(|r| (r.name.clone(), None))
                .collect(),
        ),
    });
    let admin_task = if config.http.listen.is_empty() {
        None
    } else {
        let state = AdminState::new(engine.clone(), status.clone(), config.http.bearer_token()?)
            .with_routes(routes.clone());
        let listener = tokio::net::TcpListener::bind(&config.http.listen)
            .await
            .with_context(|| format!("http.listen: cannot listen on {}", config.http.listen))?;
        // The bound address, so `listen = "127.0.0.1:0"` shows its port.
        let bound = listener
            .local_addr()
            .map_or_else(|_| config.http.listen.clone(), |a| a.to_string());
        tracing::info!(listen = %bound, "admin API listening");
        let stop = shutdown.clone();
        Some(tokio::spawn(admin::serve(listener, state, stop)))
    };

    check_kafka_targets(&brokers, &routes).await;

    // Due messages out.
    let dispatch: Arc<dyn Dispatch> = Arc::new(deliver::Deliverer {
        routes: routes.clone(),
        brokers: brokers.clone(),
        stores: stores.clone(),
    });
    let dispatch_stop = CancellationToken::new();
    let dispatcher = {
        let engine = engine.clone();
        let stop = dispatch_stop.clone();
        let grace = config.engine.shutdown_grace;
        tokio::spawn(async move { engine.run(dispatch, stop, grace).await })
    };

    // Messages in.
    let mut intakes = Vec::new();
    let byte_budget = config.engine.max_bytes_in_flight.clamp(1, u32::MAX as u64) as usize;
    let intake_bytes = Arc::new(tokio::sync::Semaphore::new(byte_budget));
    let mut streams = Vec::new();
    for route_cfg in &config.routes {
        let route = routes[&route_cfg.name].clone();
        let store = stores.get(&route_cfg.name).cloned();
        let listener = match &store {
            Some(RouteStore::Kafka(s)) => {
                Some(s.clone() as Arc<dyn delayd_adapters::kafka::PartitionListener>)
            }
            _ => None,
        };
        let intake = ingest::Intake {
            route,
            engine: engine.clone(),
            brokers: brokers.clone(),
            concurrency: route_cfg.from.prefetch.unwrap_or(1000) as usize,
            fatal: fatal.clone(),
            pressure: pressure.clone(),
            bytes: intake_bytes.clone(),
            byte_budget,
            store: store.clone(),
            in_hand: Default::default(),
            bursts: Default::default(),
        };
        if let Some(RouteStore::Stream(stream)) = &store {
            // Consumed only while this instance owns the route.
            let (brokers, cfg, status) = (brokers.clone(), route_cfg.clone(), status.clone());
            let lease = config.store.lease;
            let offsets = stream.stream_offsets();
            let start = move |stop: CancellationToken| -> anyhow::Result<_> {
                let source =
                    start_source(&brokers, &cfg, None, Some(lease), Some(offsets.clone()))?;
                status.set_consuming(&cfg.name, Some(source.consuming()));
                Ok(tokio::spawn(intake.clone().run(source, stop)))
            };
            tracing::info!(route = %route_cfg.name, "route started; it is consumed while this instance owns it");
            streams.push(tokio::spawn(stream.clone().run(start, intake_stop.clone())));
            continue;
        }
        let offsets = delayd_adapters::amqp::stream::FileOffsets {
            path: stream_checkpoint(&config.wal.dir, &route_cfg.name),
        };
        let source = start_source(&brokers, route_cfg, listener, None, Some(Arc::new(offsets)))?;
        status.set_consuming(&route_cfg.name, Some(source.consuming()));
        tracing::info!(route = %route_cfg.name, "route started");
        intakes.push(tokio::spawn(intake.run(source, intake_stop.clone())));
    }

    // A fatal WAL error stops delayd even when nothing is being consumed
    // (a Done write after a delivery, a segment that cannot be created).
    let halt = engine.wal().halt().clone();
    let failed = tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = fatal.cancelled() => true,
        reason = halt.stopped() => {
            tracing::error!(%reason, "the WAL stopped after a fatal error; shutting down");
            true
        }
    };
    tracing::info!("shutting down: no longer consuming");
    status.accepting.store(false, Ordering::Release);
    intake_stop.cancel();
    for task in intakes.into_iter().chain(streams) {
        let _ = task.await;
    }
    tracing::info!("finishing in-flight publishes");
    dispatch_stop.cancel();
    let _ = dispatcher.await;
    for store in stores.values() {
        store.flush(config.engine.shutdown_grace).await;
    }
    if config.handoff() && !failed {
        // Routes with a broker-kept store are left out: their partitions'
        // next owners restore them from the state topic.
        let local_routes: HashMap<String, Arc<Route>> = routes
            .iter()
            .filter(|(name, _)| !stores.contains_key(*name))
            .map(|(name, route)| (name.clone(), route.clone()))
            .collect();
        let report = handoff::hand_off(
            &engine,
            &local_routes,
            &brokers,
            config.engine.shutdown_grace,
        )
        .await;
        tracing::info!(
            handed_off = report.handed,
            left_in_wal = report.left,
            "hand-off finished"
        );
    }
    let closed = engine.close().await;
    shutdown.cancel();
    if let Some(task) = admin_task {
        let _ = task.await;
    }
    brokers.close().await;
    if failed {
        anyhow::bail!("stopped after a fatal WAL error");
    }
    closed.context("flushing the WAL")?;
    tracing::info!("stopped cleanly");
    Ok(())
}

/// `owned`: the broker-kept store's lease, for a route only its owner
/// consumes.
fn start_source(
    brokers: &Brokers,
    route: &crate::config::RouteConfig,
    listener: Option<Arc<dyn delayd_adapters::kafka::PartitionListener>>,
    owned: Option<std::time::Duration>,
    stream_offsets: Option<Arc<dyn delayd_adapters::amqp::stream::OffsetStore>>,
) -> anyhow::Result<Box<dyn Source>> {
    let name = &route.name;
    match brokers.get(&route.from.broker) {
        Some(BrokerHandle::Amqp { connections, .. }) => {
            let queue = route.from.queue.clone().unwrap_or_default();
            let mut source_cfg = SourceConfig::new(queue);
            if let Some(exchange) = &route.from.exchange {
                let kind = match route.from.exchange_type {
                    ExchangeKind::Direct => ExchangeType::Direct,
                    ExchangeKind::Topic => ExchangeType::Topic,
                    ExchangeKind::Fanout => ExchangeType::Fanout,
                    ExchangeKind::Headers => ExchangeType::Headers,
                    ExchangeKind::ConsistentHash => ExchangeType::ConsistentHash,
                };
                source_cfg = source_cfg.with_exchange(exchange.clone(), kind);
            }
            if let Some(prefetch) = route.from.prefetch {
                source_cfg.prefetch = prefetch;
            }
            source_cfg.queue_arguments = queue_arguments(&route.from);
            let stream = route.from.queue_type == Some(crate::config::QueueKind::Stream);
            if stream {
                let offsets = stream_offsets
                    .with_context(|| format!("route {name}: no place for its stream offset"))?;
                source_cfg.stream = Some(delayd_adapters::amqp::stream::StreamConfig { offsets });
            }
            // A stream has no single active consumer over AMQP (RabbitMQ
            // refuses the argument): a former owner that still reads it
            // cannot store anything, since every state write checks its
            // lease.
            if let Some(lease) = owned.filter(|_| !stream) {
                owner_only(&mut source_cfg.queue_arguments, &route.from, lease);
            }
            let source = AmqpSource::start(connections.consume.clone(), source_cfg)
                .with_context(|| format!("route {name}: cannot start consuming"))?;
            Ok(Box::new(source))
        }
        Some(BrokerHandle::Kafka { client, .. }) => {
            let group = route.from.group.clone().unwrap_or_default();
            let mut source_cfg = KafkaSourceConfig::new(route.from.topics.clone(), group);
            if let Some(prefetch) = route.from.prefetch {
                source_cfg.capacity = prefetch as usize;
            }
            source_cfg.listener = listener;
            let source = KafkaSource::start(&client.named(format!("delayd-{name}")), source_cfg)
                .with_context(|| format!("route {name}: cannot start consuming"))?;
            Ok(Box::new(source))
        }
        None => anyhow::bail!("route {name}: no broker {:?}", route.from.broker),
    }
}

/// Where a route's stream ingress keeps its next offset.
pub fn stream_checkpoint(wal_dir: &std::path::Path, route: &str) -> std::path::PathBuf {
    wal_dir.join("streams").join(format!("{route}.offset"))
}

/// The delivery limit delayd gives the quorum queues it declares: never
/// reached. Not -1, which RabbitMQ 4 reads as "no limit" but 3.10 as a
/// limit every return exceeds: each delivery a lost connection handed back
/// was dropped (9 of 5,400 messages through 4 kill -9 cycles,
/// docs/fault-campaign.md).
pub const QUORUM_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// How long a quorum queue keeps a consumer on an unreachable node (its
/// messages and, with a single active consumer, its turn).
const CONSUMER_DISCONNECTED: &str = "x-consumer-disconnected-timeout";

/// `from.queue_type` and `from.queue_arguments` as the queue's arguments.
/// A broker-kept store's ingress: one consumer at a time, the route's owner.
/// A quorum queue also gives up a consumer on a lost node after `lease`,
/// as the lock queue does: with RabbitMQ 4.3's default (60 s) the next
/// owner, whose lock moved after the lease, got no delivery until the lost
/// node was back (every message published meanwhile was ~10 s late in the
/// cluster campaign). One the route sets itself is kept.
fn owner_only(
    arguments: &mut delayd_adapters::FieldTable,
    from: &crate::config::FromConfig,
    lease: std::time::Duration,
) {
    use delayd_adapters::Value;
    arguments.insert("x-single-active-consumer", Value::Bool(true));
    let quorum = from.queue_type == Some(crate::config::QueueKind::Quorum);
    if quorum && !from.queue_arguments.contains_key(CONSUMER_DISCONNECTED) {
        arguments.insert(CONSUMER_DISCONNECTED, Value::I64(lease.as_millis() as i64));
    }
}

fn queue_arguments(from: &crate::config::FromConfig) -> delayd_adapters::FieldTable {
    use crate::config::QueueArgument;
    use delayd_adapters::Value;
    let mut table = delayd_adapters::FieldTable::default();
    if let Some(kind) = &from.queue_type {
        table.insert("x-queue-type", Value::LongString(kind.as_str().into()));
        // RabbitMQ 4 gives a quorum queue a delivery limit of 20, and counts
        // a delivery returned by a lost connection (4.3: a crash, a
        // network cut) against it: past it the broker drops the message.
        // delayd never hands a delivery back to be tried later, so the
        // limit can only lose messages here. An explicit one is kept.
        if *kind == crate::config::QueueKind::Quorum
            && !from.queue_arguments.contains_key("x-delivery-limit")
        {
            table.insert("x-delivery-limit", Value::I64(QUORUM_DELIVERY_LIMIT));
        }
        if *kind == crate::config::QueueKind::Stream {
            // The route's own values are added below, over these.
            let retention = crate::config::stream::Retention::of(from);
            table.insert("x-max-age", Value::LongString(retention.max_age.into()));
            table.insert("x-max-length-bytes", Value::I64(retention.max_length_bytes));
        }
    }
    for (name, value) in &from.queue_arguments {
        let value = match value {
            QueueArgument::Bool(b) => Value::Bool(*b),
            QueueArgument::Int(i) => Value::I64(*i),
            QueueArgument::Str(s) => Value::LongString(s.clone().into_bytes()),
        };
        table.insert(name.clone(), value);
    }
    table
}

/// Look the routes' Kafka target topics up before the first publish, so a
/// missing one is reported now and the first records keep their order.
async fn check_kafka_targets(brokers: &Brokers, routes: &HashMap<String, Arc<Route>>) {
    for route in routes.values() {
        if route.to_kind != crate::route::BrokerKind::Kafka {
            continue;
        }
        let check = brokers.check_target(&route.to.broker, &route.to.target);
        match tokio::time::timeout(std::time::Duration::from_secs(10), check).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => tracing::warn!(
                route = %route.name(),
                topic = %route.to.target.destination,
                "the target topic does not exist; due messages wait, then go to the unroutable topic"
            ),
            Ok(Err(e)) => {
                tracing::warn!(route = %route.name(), error = %e, "cannot look up the target topic")
            }
            Err(_) => {
                tracing::warn!(route = %route.name(), "looking up the target topic timed out")
            }
        }
    }
}

fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        }
        shutdown.cancel();
    });
}

/// What `/readyz` reports, as the runtime sees it.
struct Status {
    brokers: Brokers,
    /// Broker-kept stores, by route.
    stores: Arc<HashMap<String, RouteStore>>,
    /// The broker each route reads, by route.
    route_brokers: HashMap<String, String>,
    pressure: Arc<Backpressure>,
    /// False once shutdown has begun.
    accepting: AtomicBool,
    /// Each route's source once it started (None before).
    consuming: std::sync::Mutex<BTreeMap<String, Option<delayd_adapters::Consuming>>>,
}

impl Status {
    fn set_consuming(&self, route: &str, consuming: Option<delayd_adapters::Consuming>) {
        self.consuming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(route.to_owned(), consuming);
    }
}

impl RuntimeStatus for Status {
    fn brokers(&self) -> Vec<BrokerStatus> {
        let mut brokers = self.brokers.status();
        // A standby consumes nothing until it owns its route: a broker read
        // only by standby routes needs no consuming connection yet.
        for broker in &mut brokers {
            let mut readers = self
                .route_brokers
                .iter()
                .filter(|(_, b)| **b == broker.name)
                .map(|(route, _)| route);
            let all_standby = readers.all(|r| self.stores.get(r).is_some_and(RouteStore::standby));
            if all_standby && self.route_brokers.values().any(|b| *b == broker.name) {
                broker.consume = "standby";
                broker.ready = true;
            }
        }
        brokers
    }

    fn routes(&self) -> BTreeMap<String, RouteIntake> {
        self.consuming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(name, c)| {
                let store = self.stores.get(name);
                let restoring = store.is_some_and(RouteStore::restoring);
                let intake = match c {
                    _ if store.is_some_and(RouteStore::state_missing) => RouteIntake::StateMissing,
                    _ if store.is_some_and(RouteStore::standby) => RouteIntake::Standby,
                    _ if store.is_some_and(RouteStore::electing) => RouteIntake::Starting,
                    _ if restoring => RouteIntake::Restoring,
                    Some(c) if c.truncated() > 0 => RouteIntake::Truncated,
                    Some(c) if c.get() => RouteIntake::Consuming,
                    _ => RouteIntake::Starting,
                };
                (name.clone(), intake)
            })
            .collect()
    }

    fn paused(&self) -> BTreeMap<String, Pressure> {
        self.pressure.paused()
    }

    fn accepting(&self) -> bool {
        self.accepting.load(Ordering::Acquire)
    }

    fn store(&self) -> serde_json::Value {
        if self.stores.is_empty() {
            return serde_json::json!({ "kind": "local" });
        }
        let routes: BTreeMap<&str, serde_json::Value> = self
            .stores
            .iter()
            .map(|(name, s)| (name.as_str(), s.describe()))
            .collect();
        serde_json::json!({ "kind": "broker", "routes": routes })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use delayd_adapters::Value;

    use super::*;
    use crate::config::{FromConfig, QueueArgument, QueueKind};

    /// The broker-kept store's ingress moves to the next owner with the
    /// lock: a quorum queue gives a consumer on a lost node up after the
    /// lease, not RabbitMQ's 60 s (the next owner got nothing until the
    /// node was back).
    #[test]
    fn an_owned_quorum_ingress_gives_a_lost_consumer_up_after_the_lease() {
        let quorum = FromConfig {
            queue_type: Some(QueueKind::Quorum),
            ..FromConfig::default()
        };
        let mut args = queue_arguments(&quorum);
        owner_only(&mut args, &quorum, Duration::from_millis(1500));
        assert_eq!(
            args.get("x-single-active-consumer"),
            Some(&Value::Bool(true))
        );
        assert_eq!(args.get(CONSUMER_DISCONNECTED), Some(&Value::I64(1500)));

        // A classic queue has no such argument (RabbitMQ refuses it).
        let classic = FromConfig::default();
        let mut args = queue_arguments(&classic);
        owner_only(&mut args, &classic, Duration::from_secs(5));
        assert_eq!(args.get(CONSUMER_DISCONNECTED), None);

        // The route's own value stays.
        let mut own = quorum.clone();
        own.queue_arguments
            .insert(CONSUMER_DISCONNECTED.into(), QueueArgument::Int(30_000));
        let mut args = queue_arguments(&own);
        owner_only(&mut args, &own, Duration::from_secs(5));
        assert_eq!(args.get(CONSUMER_DISCONNECTED), Some(&Value::I64(30_000)));
    }
}
