//! Partitions a route no longer has (DESIGN guarantee 8, issue #36).
//!
//! Lowering `partitions` on a RabbitMQ route from M to N leaves partitions
//! N..M-1 on the broker: their ingress queues `<from.queue>.K` stay bound
//! to the consistent-hash exchange (so new messages keep landing there, and
//! nobody consumes them), and, with the broker store, their state streams
//! `<store.topic_prefix><route>.K` (and `.pointer`, `.lock`, the
//! generations `.K.<n>`) hold pending messages nobody restores.
//!
//! So before anything consumes, [`enforce`] looks for them: partition
//! K = N, N+1, ... until one has neither an ingress queue nor a pointer
//! stream (partitions are made in order, so the leftovers of a larger count
//! follow N without a gap). Leftovers that are provably empty (no consumer
//! on their queue or lock, no ready message, no pending state record) are
//! removed: the queue is unbound first and then deleted with `if-empty` and
//! `if-unused`, which the broker checks atomically, then the state streams
//! and lock. Anything else refuses the start, naming the key, the count the
//! route had, and what to do ([`Shrunk`]). `delayd check` runs the same
//! look ([`inspect`]) without changing anything.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use delayd_adapters::amqp::state::{LiveSet, StateError, StateNames, StateSession};
use delayd_adapters::amqp::topology::{self, QueueState};
use delayd_adapters::amqp::{AmqpError, Broker, BrokerOptions, Endpoints, ExchangeType};

use crate::config::partitions::{name, MAX_PARTITIONS};
use crate::config::{BrokerConnection, Config, StoreKind};

/// Errors of looking for (and removing) leftover partitions.
#[derive(Debug, thiserror::Error)]
pub enum LeftoverError {
    /// Leftover partitions that are not provably empty.
    #[error(transparent)]
    Shrunk(#[from] Box<Shrunk>),
    #[error("route {route:?}: cannot look for the partitions it had before: {source}")]
    Amqp {
        route: String,
        #[source]
        source: Box<AmqpError>,
    },
    #[error("route {route:?}: cannot read the state of a partition it had before: {source}")]
    State {
        route: String,
        #[source]
        source: Box<StateError>,
    },
    #[error("route {route:?}: {message}")]
    Config { route: String, message: String },
}

/// The names partition `index` of a partitioned route has on the broker.
#[derive(Debug, Clone)]
pub struct PartitionNames {
    pub index: u16,
    /// Its ingress queue, `<from.queue>.<index>`.
    pub queue: String,
    /// Its state streams and lock (broker store only).
    pub state: Option<StateNames>,
}

impl PartitionNames {
    /// Partition `index` of route `group` consuming `<base_queue>.<index>`;
    /// `state_prefix` is `store.topic_prefix` with the broker store.
    pub fn new(group: &str, base_queue: &str, index: u16, state_prefix: Option<&str>) -> Self {
        Self {
            index,
            queue: name(base_queue, index),
            state: state_prefix.map(|p| StateNames::new(format!("{p}{}", name(group, index)))),
        }
    }
}

/// One leftover partition, as found on the broker.
#[derive(Debug, Clone)]
pub struct Found {
    pub names: PartitionNames,
    /// The ingress queue, if it exists.
    pub queue: Option<QueueState>,
    /// The state queues and streams that exist (pointers, lock).
    pub state: Vec<String>,
    /// Consumers on the lock queue (an instance competing for it).
    pub lock_consumers: u32,
    /// Pending records in the state streams: `None` if not read (or
    /// unreadable: see `unreadable`).
    pub pending: Option<u64>,
    /// Why the state could not be read, if it could not.
    pub unreadable: Option<String>,
}

impl Found {
    /// What keeps this partition from being empty whatever its state
    /// streams hold: consumers, or ready messages.
    fn busy(&self) -> Option<String> {
        let p = &self.names.queue;
        if let Some(q) = self.queue {
            if q.consumers > 0 {
                return Some(format!(
                    "queue {p} has {} consumer(s) (is an instance with the old partitions still running?)",
                    q.consumers
                ));
            }
            if q.messages > 0 {
                return Some(format!("queue {p} holds {} message(s)", q.messages));
            }
        }
        if self.lock_consumers > 0 {
            return Some(format!(
                "lock {} has {} consumer(s) (is an instance with the old partitions still running?)",
                self.state_names().map(|n| n.lock()).unwrap_or_default(),
                self.lock_consumers
            ));
        }
        None
    }

    /// Why this partition cannot be removed as empty, if it cannot.
    pub fn not_empty(&self) -> Option<String> {
        if let Some(why) = self.busy() {
            return Some(why);
        }
        if let Some(why) = &self.unreadable {
            return Some(why.clone());
        }
        match self.pending {
            Some(0) => None,
            Some(n) => Some(format!(
                "{n} message(s) pending in state stream {}",
                self.state_names()
                    .map(|n| n.pointer.as_str())
                    .unwrap_or("?")
            )),
            None if self.state.is_empty() => None,
            None => Some("its state streams were not read".into()),
        }
    }

    fn state_names(&self) -> Option<&StateNames> {
        self.names.state.as_ref()
    }
}

/// Leftover partitions of one partitioned route that are not provably
/// empty: the start is refused. The text names the key, the count the
/// route had, and what to do.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// `routes[<i>].partitions`.
    pub key: String,
    pub route: String,
    pub exchange: String,
    /// `partitions` now.
    pub configured: u16,
    pub found: Vec<Found>,
}

impl std::error::Error for Shrunk {}

impl Shrunk {
    /// How many partitions the route had: the highest leftover + 1.
    pub fn before(&self) -> u16 {
        self.found
            .iter()
            .map(|f| f.names.index + 1)
            .max()
            .unwrap_or(self.configured)
    }
}

impl fmt::Display for Shrunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (key, n, before) = (&self.key, self.configured, self.before());
        write!(
            f,
            "{key} = {n}, but route {:?} had {before} partitions: partition(s) {} are still on the broker and \
             no instance would consume or restore them, so their messages would never be delivered (",
            self.route,
            indices(&self.found),
        )?;
        for (i, found) in self.found.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            let mut parts = Vec::new();
            match found.queue {
                Some(q) => parts.push(format!(
                    "queue {} ({} ready message(s), {} consumer(s))",
                    found.names.queue, q.messages, q.consumers
                )),
                None => parts.push(format!("no queue {}", found.names.queue)),
            }
            if !found.state.is_empty() {
                parts.push(format!("state {}", found.state.join(", ")));
            }
            if let Some(why) = found.not_empty() {
                parts.push(format!("not empty: {why}"));
            }
            write!(f, "partition {}: {}", found.names.index, parts.join(", "))?;
        }
        let queues: Vec<&str> = self.found.iter().map(|f| f.names.queue.as_str()).collect();
        let routes: Vec<String> = self
            .found
            .iter()
            .map(|f| name(&self.route, f.names.index))
            .collect();
        write!(
            f,
            "). Set {key} = {before} (or more) again. To lower it, drain those partitions first: while delayd \
             runs with {before} partitions, unbind queue(s) {} from exchange {:?} (new messages then hash to the \
             others) and wait until they are empty and `delayd store inspect` shows nothing pending for {}; \
             a start with {key} = {n} then removes them itself",
            queues.join(", "),
            self.exchange,
            routes.join(", "),
        )?;
        if let Some(state) = self.found.iter().find_map(|f| f.names.state.as_ref()) {
            write!(
                f,
                " (by hand: the queues, and the streams {0}, {1}, the queue {2} and the generation streams {0}.<n>, \
                 for each partition)",
                state.pointer,
                state.pointer_copy(),
                state.lock()
            )?;
        }
        Ok(())
    }
}

/// "4 and 5", "4, 5 and 6", "4".
fn indices(found: &[Found]) -> String {
    let all: Vec<String> = found.iter().map(|f| f.names.index.to_string()).collect();
    match all.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// One partitioned RabbitMQ route, as configured.
#[derive(Debug, Clone)]
pub struct Group {
    pub route: String,
    pub key: String,
    pub broker: String,
    pub exchange: String,
    pub base_queue: String,
    pub count: u16,
    pub state_prefix: Option<String>,
}

impl Group {
    fn partition(&self, index: u16) -> PartitionNames {
        PartitionNames::new(
            &self.route,
            &self.base_queue,
            index,
            self.state_prefix.as_deref(),
        )
    }
}

/// The partitioned RabbitMQ routes of `config` (after expansion: read from
/// each route's first partition).
pub fn groups(config: &Config) -> Vec<Group> {
    let mut out: BTreeMap<usize, Group> = BTreeMap::new();
    for route in &config.routes {
        let Some(p) = &route.partition else { continue };
        if out.contains_key(&p.route_index) {
            continue;
        }
        let base_queue = route
            .from
            .queue
            .as_deref()
            .and_then(|q| q.strip_suffix(&format!(".{}", p.index)))
            .unwrap_or_default()
            .to_owned();
        out.insert(
            p.route_index,
            Group {
                route: p.group.clone(),
                key: format!("routes[{}].partitions", p.route_index),
                broker: route.from.broker.clone(),
                exchange: route.from.exchange.clone().unwrap_or_default(),
                base_queue,
                count: p.count,
                state_prefix: (config.store.kind == StoreKind::Broker)
                    .then(|| config.store.topic_prefix.clone()),
            },
        );
    }
    out.into_values().collect()
}

/// A connection per broker name, made on first use.
struct Brokers<'a> {
    config: &'a Config,
    open: HashMap<String, Arc<Broker>>,
}

impl Brokers<'_> {
    fn get(&mut self, group: &Group) -> Result<Arc<Broker>, LeftoverError> {
        if let Some(b) = self.open.get(&group.broker) {
            return Ok(b.clone());
        }
        let config_error = |message: String| LeftoverError::Config {
            route: group.route.clone(),
            message,
        };
        let settings = match self.config.connection(&group.broker) {
            Ok(BrokerConnection::Amqp(settings)) => settings,
            Ok(BrokerConnection::Kafka(_)) => {
                return Err(config_error("partitions are for RabbitMQ routes".into()))
            }
            Err(e) => return Err(config_error(e.to_string())),
        };
        let endpoints = Endpoints::new(&settings).map_err(|e| config_error(e.to_string()))?;
        let broker = Arc::new(Broker::with_endpoints(
            Arc::new(endpoints),
            BrokerOptions::named("delayd-partitions-check"),
        ));
        self.open.insert(group.broker.clone(), broker.clone());
        Ok(broker)
    }

    async fn close(self) {
        for broker in self.open.values() {
            broker.close().await;
        }
    }
}

/// Every partitioned route's leftover partitions, looked for on the
/// broker; changes nothing but for the read markers a state read appends.
pub async fn inspect(config: &Config) -> Result<Vec<(Group, Vec<Found>)>, LeftoverError> {
    let mut brokers = Brokers {
        config,
        open: HashMap::new(),
    };
    let result = async {
        let mut out = Vec::new();
        for group in groups(config) {
            let broker = brokers.get(&group)?;
            let found = find(&broker, &group).await?;
            out.push((group, found));
        }
        Ok(out)
    }
    .await;
    brokers.close().await;
    result
}

/// At start, before anything consumes: remove the leftover partitions that
/// are provably empty, refuse if any other is left.
pub async fn enforce(config: &Config) -> Result<(), LeftoverError> {
    let mut brokers = Brokers {
        config,
        open: HashMap::new(),
    };
    let result = async {
        for group in groups(config) {
            let broker = brokers.get(&group)?;
            let found = find(&broker, &group).await?;
            if found.is_empty() {
                continue;
            }
            if found.iter().any(|f| f.not_empty().is_some()) {
                return Err(shrunk(&group, found));
            }
            if let Some(why) = remove(&broker, &group, &found).await? {
                tracing::warn!(route = %group.route, why, "a leftover partition could not be removed");
                let found = find(&broker, &group).await?;
                return Err(shrunk(&group, found));
            }
        }
        Ok(())
    }
    .await;
    brokers.close().await;
    result
}

/// [`enforce`], tried again while the broker cannot be reached (a start
/// does not need the broker up), until `stop`.
pub async fn enforce_until(
    config: &Config,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<(), LeftoverError> {
    if groups(config).is_empty() {
        return Ok(());
    }
    let mut backoff = delayd_adapters::amqp::Backoff::new(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(30),
    );
    loop {
        match enforce(config).await {
            Err(e @ (LeftoverError::Amqp { .. } | LeftoverError::State { .. })) => {
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "cannot look for partitions the routes had before; trying again (nothing is consumed until then)");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => return Err(e),
                }
            }
            other => return other,
        }
    }
}

fn shrunk(group: &Group, found: Vec<Found>) -> LeftoverError {
    LeftoverError::Shrunk(Box::new(Shrunk {
        key: group.key.clone(),
        route: group.route.clone(),
        exchange: group.exchange.clone(),
        configured: group.count,
        found,
    }))
}

/// Partitions `count`, `count + 1`, ... of `group` until one has neither an
/// ingress queue nor a pointer stream.
async fn find(broker: &Broker, group: &Group) -> Result<Vec<Found>, LeftoverError> {
    let amqp = |source| LeftoverError::Amqp {
        route: group.route.clone(),
        source: Box::new(source),
    };
    let exists = |name: String| async move {
        topology::queue_state(broker, &name)
            .await
            .map(|q| q.map(|q| (name, q)))
    };
    let mut out = Vec::new();
    for index in group.count..MAX_PARTITIONS {
        let names = group.partition(index);
        // A passive declare of a missing queue makes the broker close the
        // channel, which lapin logs as an error: the look at the first
        // partition past the count (queue, pointer) is the only such pair
        // a start makes when nothing is left over.
        let queue = topology::queue_state(broker, &names.queue)
            .await
            .map_err(amqp)?;
        let mut state = Vec::new();
        let mut lock_consumers = 0;
        if let Some(s) = &names.state {
            if let Some((pointer, _)) = exists(s.pointer.clone()).await.map_err(amqp)? {
                state.push(pointer);
            }
            if queue.is_some() || !state.is_empty() {
                if let Some((copy, _)) = exists(s.pointer_copy()).await.map_err(amqp)? {
                    state.push(copy);
                }
                if let Some((lock, q)) = exists(s.lock()).await.map_err(amqp)? {
                    lock_consumers = q.consumers;
                    state.push(lock);
                }
            }
        }
        if queue.is_none() && state.is_empty() {
            break;
        }
        tracing::debug!(route = %group.route, index, ?queue, ?state, "a partition the route no longer has");
        let mut found = Found {
            names,
            queue,
            state,
            lock_consumers,
            pending: None,
            unreadable: None,
        };
        // Read the state only if nothing else keeps it from being empty.
        if found.busy().is_none() && !found.state.is_empty() {
            match pending(broker, &found).await {
                Ok(n) => found.pending = Some(n),
                Err(e) => found.unreadable = Some(format!("its state cannot be read: {e}")),
            }
        }
        out.push(found);
    }
    Ok(out)
}

/// Pending records in a leftover partition's state streams, read as
/// recovery reads them (the generation the pointers name and the next).
async fn pending(broker: &Broker, found: &Found) -> Result<u64, StateError> {
    let Some(names) = &found.names.state else {
        return Ok(0);
    };
    let session = StateSession::observe(broker.open_dedicated().await?, names).await?;
    let result = async {
        let pointers = names.pointers();
        if !pointers.iter().all(|p| found.state.contains(p)) {
            // Reading a pointer declares it; one alone is read as recovery
            // would (the other is declared empty).
            tracing::debug!(pointers = ?pointers, "a leftover partition has one pointer stream");
        }
        let (current, _) = session.current_generation().await?;
        let Some(g) = current else { return Ok(0) };
        let stream = names.generation(g);
        if !session.exists(&stream).await? {
            return Err(StateError::Missing {
                stream,
                generation: g,
            });
        }
        let mut set = LiveSet::default();
        for n in [g, g + 1] {
            let stream = names.generation(n);
            if session.exists(&stream).await? {
                session.read_into(&stream, &mut set).await?;
            }
        }
        Ok(set.len() as u64)
    }
    .await;
    session.close().await;
    result
}

/// Remove empty leftover partitions: each queue unbound, then deleted only
/// if still empty and unused, then its state. `Some(why)` if one could not
/// be (it is left as it is, unbound).
async fn remove(
    broker: &Broker,
    group: &Group,
    found: &[Found],
) -> Result<Option<String>, LeftoverError> {
    let amqp = |source| LeftoverError::Amqp {
        route: group.route.clone(),
        source: Box::new(source),
    };
    let key = ExchangeType::ConsistentHash.default_binding_key();
    for f in found {
        if f.queue.is_some() {
            topology::unbind_queue(broker, &f.names.queue, &group.exchange, key)
                .await
                .map_err(amqp)?;
            if !topology::delete_queue_if_idle(broker, &f.names.queue)
                .await
                .map_err(amqp)?
            {
                return Ok(Some(format!(
                    "queue {} got a message or a consumer meanwhile",
                    f.names.queue
                )));
            }
        }
        if let Some(names) = &f.names.state {
            let session =
                StateSession::observe(broker.open_dedicated().await.map_err(amqp)?, names)
                    .await
                    .map_err(|source| LeftoverError::State {
                        route: group.route.clone(),
                        source: Box::new(source),
                    })?;
            let deleted = delete_state(&session, names).await;
            session.close().await;
            deleted.map_err(|source| LeftoverError::State {
                route: group.route.clone(),
                source: Box::new(source),
            })?;
        }
        tracing::info!(
            route = %group.route,
            partition = f.names.index,
            queue = %f.names.queue,
            "removed an empty partition the route no longer has (partitions = {})",
            group.count
        );
    }
    Ok(None)
}

/// The lock, the generations around the current one, then the pointers.
async fn delete_state(session: &StateSession, names: &StateNames) -> Result<(), StateError> {
    session.delete(&names.lock()).await?;
    let (current, _) = session.current_generation().await?;
    if let Some(g) = current {
        for n in g.saturating_sub(1)..=g + 2 {
            session.delete(&names.generation(n)).await?;
        }
    }
    for pointer in names.pointers() {
        session.delete(&pointer).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(index: u16, messages: u32, pending: Option<u64>) -> Found {
        let names = PartitionNames::new("orders", "delayd.orders", index, Some("delayd.state."));
        let state = names
            .state
            .as_ref()
            .map(|s| vec![s.pointer.clone(), s.pointer_copy(), s.lock()])
            .unwrap_or_default();
        Found {
            names,
            queue: Some(QueueState {
                messages,
                consumers: 0,
            }),
            state,
            lock_consumers: 0,
            pending,
            unreadable: None,
        }
    }

    #[test]
    fn partition_names_match_what_the_route_and_its_store_use() {
        let n = PartitionNames::new("orders", "delayd.orders", 5, Some("delayd.state."));
        assert_eq!(n.queue, "delayd.orders.5");
        let s = n.state.expect("broker store");
        assert_eq!(s.pointer, "delayd.state.orders.5");
        assert_eq!(s.pointer_copy(), "delayd.state.orders.5.pointer");
        assert_eq!(s.lock(), "delayd.state.orders.5.lock");
        assert_eq!(s.generation(2), "delayd.state.orders.5.2");
        assert!(PartitionNames::new("orders", "q", 0, None).state.is_none());
    }

    #[test]
    fn groups_come_from_the_expanded_routes_with_their_key() {
        let config = Config::from_toml_str(
            r#"
            [store]
            kind = "broker"
            topic_prefix = "st."
            [brokers.rabbit]
            kind = "amqp"
            url = "amqp://127.0.0.1:5672/%2f"
            [[routes]]
            name = "plain"
            from = { broker = "rabbit", queue = "q.plain" }
            to = { broker = "rabbit", exchange = "out" }
            [[routes]]
            name = "orders"
            partitions = 4
            from = { broker = "rabbit", queue = "delayd.orders", exchange = "orders" }
            to = { broker = "rabbit", exchange = "out" }
            "#,
        )
        .expect("valid config");
        let groups = groups(&config);
        assert_eq!(groups.len(), 1);
        let g = &groups[0];
        assert_eq!(
            (g.route.as_str(), g.key.as_str(), g.count),
            ("orders", "routes[1].partitions", 4)
        );
        assert_eq!(
            (g.base_queue.as_str(), g.exchange.as_str()),
            ("delayd.orders", "orders")
        );
        let p = g.partition(4);
        assert_eq!(p.queue, "delayd.orders.4");
        assert_eq!(p.state.expect("broker").pointer, "st.orders.4");
    }

    #[test]
    fn emptiness_needs_no_message_no_consumer_and_nothing_pending() {
        assert_eq!(found(4, 0, Some(0)).not_empty(), None);
        let full = found(4, 12, Some(0)).not_empty().expect("ready messages");
        assert!(full.contains("delayd.orders.4 holds 12"), "{full}");
        let pending = found(4, 0, Some(3)).not_empty().expect("pending");
        assert!(
            pending.contains("3 message(s) pending in state stream delayd.state.orders.4"),
            "{pending}"
        );
        let mut consumed = found(4, 0, Some(0));
        consumed.lock_consumers = 1;
        assert!(consumed.not_empty().is_some());
        let mut unread = found(4, 0, None);
        assert!(unread.not_empty().is_some(), "state streams not read");
        unread.unreadable = Some("its state cannot be read: x".into());
        assert_eq!(
            unread.not_empty().as_deref(),
            Some("its state cannot be read: x")
        );
    }

    #[test]
    fn the_refusal_names_the_key_the_count_before_and_what_to_do() {
        let shrunk = Shrunk {
            key: "routes[0].partitions".into(),
            route: "orders".into(),
            exchange: "orders.in".into(),
            configured: 4,
            found: vec![found(4, 12, None), found(5, 0, Some(7))],
        };
        assert_eq!(shrunk.before(), 6);
        let text = shrunk.to_string();
        for needle in [
            "routes[0].partitions = 4, but route \"orders\" had 6 partitions",
            "partition(s) 4 and 5 are still on the broker",
            "queue delayd.orders.4 (12 ready message(s), 0 consumer(s))",
            "7 message(s) pending in state stream delayd.state.orders.5",
            "Set routes[0].partitions = 6 (or more) again",
            "unbind queue(s) delayd.orders.4, delayd.orders.5 from exchange \"orders.in\"",
            "nothing pending for orders.4, orders.5",
            "delayd.state.orders.4.lock",
        ] {
            assert!(text.contains(needle), "{needle:?} is not in: {text}");
        }
    }
}
