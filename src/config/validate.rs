//! Semantic checks on a parsed config, with errors that name the key and file.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    AmqpAuth, BrokerConfig, Config, DestinationConfig, ExchangeKind, Mode, QueueArgument,
    QueueKind, RouteConfig, StoreKind,
};

/// Longest duration a key may hold: far beyond any real delay, and small
/// enough that epoch milliseconds plus it never overflow a u64 (nor f64
/// seconds a `Duration`).
const MAX_DURATION: Duration = Duration::from_secs(1000 * 366 * 86400);

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    Missing(PathBuf),
    #[error("{}", render(.errors))]
    Parse { errors: Vec<String> },
    #[error("config error in {}: `{key}`: {message}", where_(.file))]
    Invalid {
        key: String,
        file: Option<PathBuf>,
        message: String,
    },
}

fn too_long(value: Duration) -> String {
    format!("{value:?} is too long: at most 1000 years")
}

fn render(errors: &[String]) -> String {
    errors.join("\n")
}

fn where_(file: &Option<PathBuf>) -> String {
    file.as_ref()
        .map(|f| f.display().to_string())
        .unwrap_or_else(|| "config".into())
}

impl ConfigError {
    pub fn from_figment(err: figment::Error, file: Option<&Path>) -> Self {
        let errors = err
            .into_iter()
            .map(|e| {
                let key = e.path.join(".");
                let source = e
                    .metadata
                    .as_ref()
                    .and_then(|m| m.source.as_ref().map(|s| s.to_string()))
                    .or_else(|| e.metadata.as_ref().map(|m| m.name.to_string()))
                    .or_else(|| file.map(|f| f.display().to_string()))
                    .unwrap_or_else(|| "config".into());
                let kind = if e.path.first().is_some_and(|p| p == "brokers") {
                    without_value(&e.kind)
                } else {
                    e.kind.to_string()
                };
                if key.is_empty() {
                    format!("config error in {source}: {kind}")
                } else {
                    format!("config error in {source}: `{key}`: {kind}")
                }
            })
            .collect();
        ConfigError::Parse { errors }
    }
}

/// The AMQP section's own rules (what its files hold is checked when they
/// are read, see `connections`). Errors are (key under the broker, message).
fn check_amqp(amqp: &super::AmqpBrokerConfig) -> Result<(), (&'static str, String)> {
    let given = [
        amqp.url.is_some(),
        !amqp.urls.is_empty(),
        amqp.url_file.is_some(),
    ];
    match given.iter().filter(|g| **g).count() {
        1 => {}
        0 => return Err(("url", "set url, urls or url_file".into())),
        _ => return Err(("url", "set only one of url, urls and url_file".into())),
    }
    let Some(tls) = &amqp.tls else {
        return Ok(());
    };
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        return Err((
            "tls.cert_file",
            "a client certificate needs tls.key_file, and a key tls.cert_file".into(),
        ));
    }
    if tls.auth == AmqpAuth::External && tls.cert_file.is_none() {
        return Err((
            "tls.auth",
            "auth = \"external\" logs in with the client certificate: set tls.cert_file and tls.key_file".into(),
        ));
    }
    if tls.auth == AmqpAuth::External && amqp.password_file.is_some() {
        return Err((
            "password_file",
            "auth = \"external\" sends no password; leave password_file out".into(),
        ));
    }
    if tls
        .server_name
        .as_deref()
        .is_some_and(|n| n.trim().is_empty())
    {
        return Err(("tls.server_name", "is empty".into()));
    }
    Ok(())
}

/// A figment error about a broker, without the value it found: that may be
/// a URL with its password or a Kafka secret given the wrong type.
fn without_value(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        Kind::InvalidType(_, expected) => format!("invalid type: expected {expected}"),
        Kind::InvalidValue(_, expected) => format!("invalid value: expected {expected}"),
        Kind::Unsupported(_) => "unsupported type".into(),
        other => other.to_string(),
    }
}

/// Kafka's rule for topic names: at most 249 of `[A-Za-z0-9._-]`.
fn valid_topic_name(name: &str) -> bool {
    name.len() <= 249
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Config {
    /// `from.queue_type = "stream"`: its checkpoint is a file in the WAL's
    /// directory, so it needs the local store and one consumer per stream.
    fn check_stream_ingress(&self, route: &RouteConfig) -> Result<(), (&'static str, String)> {
        let broker_kept = self.store.kind == StoreKind::Broker;
        if self.handoff() && !broker_kept {
            return Err(("from.queue_type", "a stream ingress keeps its read position beside the WAL; engine.handoff = true is for a WAL that does not survive the pod, and a new instance would read the whole stream again (give delayd a volume and set engine.handoff = false, or use a classic or quorum queue)".into()));
        }
        if route.partitions.is_some() && !broker_kept {
            return Err(("partitions", "a stream ingress is read whole by every consumer, and with the local store every instance consumes every partition: each message would be stored by each instance. Partitions of a stream ingress need store.kind = \"broker\", where one instance owns each partition (or use classic or quorum partitions)".into()));
        }
        if route.mode != Mode::Delay {
            return Err(("mode", "a stream ingress works with mode = \"delay\" (ttl and retry modes read a queue's dead-lettering)".into()));
        }
        match route.from.queue_arguments.get("x-max-age") {
            None => {}
            Some(QueueArgument::Str(age)) if super::stream::max_age(age).is_some() => {}
            Some(other) => {
                return Err(("from.queue_arguments", format!("x-max-age = {other:?}: RabbitMQ takes a whole number and a unit, Y, M, D, h, m or s, such as \"7D\"")));
            }
        }
        match route.from.queue_arguments.get("x-max-length-bytes") {
            None | Some(QueueArgument::Int(1..)) => {}
            Some(other) => {
                return Err((
                    "from.queue_arguments",
                    format!("x-max-length-bytes = {other:?}: a number of bytes above 0"),
                ));
            }
        }
        Ok(())
    }

    /// `store.kind = "broker"`: the route's state topic (Kafka) or state
    /// streams (RabbitMQ) are named `store.topic_prefix` + the route name,
    /// which must be a valid name for both.
    /// With the broker-kept store, a RabbitMQ route keeps its state in
    /// streams named from its own: the pointer `<prefix><route>`, its copy
    /// `.pointer`, the lock queue `.lock`, generation `n` as `.<n>`, and a
    /// partitioned route's presence queue `<prefix><group>.members`. A
    /// route (or partition) named `<other>.3` would take route `<other>`'s
    /// generation 3 for its pointer: each would delete and refill the
    /// other's streams, and `<other>`'s messages were lost. The other route
    /// and the stream they would share, if any.
    fn state_stream_clash(&self, route: &RouteConfig) -> Option<(String, String)> {
        if self.store.kind != StoreKind::Broker {
            return None;
        }
        let amqp = |r: &RouteConfig| {
            matches!(self.broker(&r.from.broker), Some(BrokerConfig::Amqp { .. }))
        };
        if !amqp(route) {
            return None;
        }
        // Each route's own names: its partitions', or its own.
        let names = |r: &RouteConfig| -> Vec<String> {
            match r.partitions {
                Some(n) => (0..n)
                    .map(|i| super::partitions::name(&r.name, i))
                    .collect(),
                None => vec![r.name.clone()],
            }
        };
        let derived = |suffix: &str| {
            matches!(suffix, "lock" | "pointer" | "members")
                || (!suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()))
        };
        for other in self
            .routes
            .iter()
            .filter(|r| amqp(r) && r.name != route.name)
        {
            let mut theirs = names(other);
            if other.partitions.is_some() {
                theirs.push(other.name.clone());
            }
            for mine in names(route) {
                for base in &theirs {
                    let clash = mine
                        .strip_prefix(base.as_str())
                        .and_then(|rest| rest.strip_prefix('.'))
                        .is_some_and(derived);
                    if clash {
                        return Some((other.name.clone(), self.store.topic(&mine)));
                    }
                }
            }
        }
        None
    }

    fn check_broker_store(&self, route: &RouteConfig) -> Result<(), (String, String)> {
        let topic = self.store.topic(&route.name);
        if !valid_topic_name(&topic) {
            return Err((
                "store.topic_prefix".into(),
                format!(
                    "route {:?} would keep its state in {topic:?}, which is not a valid Kafka \
                     topic or RabbitMQ stream name (at most 249 letters, digits, '.', '_', \
                     '-'); rename the route",
                    route.name
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn validate(&self, file: Option<&Path>) -> Result<(), ConfigError> {
        let err = |key: String, message: String| ConfigError::Invalid {
            key,
            file: file.map(Path::to_path_buf),
            message,
        };
        if self.wal.segment_bytes < 4096 || self.wal.segment_bytes > (1 << 31) {
            return Err(err(
                "wal.segment_bytes".into(),
                "must be between 4096 and 2 GiB".into(),
            ));
        }
        if self.wal.reserve_bytes > (1 << 30) {
            return Err(err(
                "wal.reserve_bytes".into(),
                "must be at most 1 GiB (0 keeps no reserve)".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.wal.compact_below) {
            return Err(err(
                "wal.compact_below".into(),
                "must be between 0 and 1".into(),
            ));
        }
        for (key, value) in [
            ("engine.max_delay", self.engine.max_delay),
            ("engine.retry_initial", self.engine.retry_initial),
            ("engine.retry_max", self.engine.retry_max),
        ] {
            if value > MAX_DURATION {
                return Err(err(key.into(), too_long(value)));
            }
        }
        if self.engine.max_in_flight == 0 {
            return Err(err(
                "engine.max_in_flight".into(),
                "must be at least 1".into(),
            ));
        }
        if self.engine.max_bytes_in_flight == 0 {
            return Err(err(
                "engine.max_bytes_in_flight".into(),
                "must be at least 1".into(),
            ));
        }
        if !self.engine.horizon.is_zero() && self.engine.horizon < Duration::from_secs(1) {
            return Err(err(
                "engine.horizon".into(),
                format!(
                    "{} is too short: 0 (no far tier) or at least 1s",
                    humantime::format_duration(self.engine.horizon)
                ),
            ));
        }
        if self.engine.max_disk > 0 && self.engine.max_disk < 2 * self.wal.segment_bytes {
            return Err(err(
                "engine.max_disk".into(),
                format!(
                    "{} bytes is less than two WAL segments (2 x wal.segment_bytes = {}); \
                     the head segment is always on disk, so delayd could never resume",
                    self.engine.max_disk,
                    2 * self.wal.segment_bytes
                ),
            ));
        }
        if !self.http.listen.is_empty() {
            let addr: SocketAddr = self.http.listen.parse().map_err(|e| {
                err(
                    "http.listen".into(),
                    format!("{:?} is not an address:port ({e})", self.http.listen),
                )
            })?;
            if !addr.ip().is_loopback()
                && self
                    .http
                    .token
                    .as_deref()
                    .is_none_or(|t| t.trim().is_empty())
                && self.http.token_file.is_none()
            {
                return Err(err(
                    "http.listen".into(),
                    format!(
                        "{addr} is reachable from other hosts, so the admin API needs a bearer token: \
                         set http.token_file or DELAYD_HTTP__TOKEN, or listen on 127.0.0.1"
                    ),
                ));
            }
        }
        for (name, broker) in &self.brokers {
            match broker {
                BrokerConfig::Amqp(amqp) => {
                    check_amqp(amqp).map_err(|(k, m)| err(format!("brokers.{name}.{k}"), m))?
                }
                BrokerConfig::Kafka(kafka) => {
                    if kafka.bootstrap.trim().is_empty() {
                        return Err(err(format!("brokers.{name}.bootstrap"), "is empty".into()));
                    }
                    if kafka
                        .client_id
                        .as_deref()
                        .is_some_and(|c| c.trim().is_empty())
                    {
                        return Err(err(format!("brokers.{name}.client_id"), "is empty".into()));
                    }
                }
            }
        }
        if self.store.replication_factor == Some(0) {
            return Err(err(
                "store.replication_factor".into(),
                "must be at least 1".into(),
            ));
        }
        if self.store.kind == StoreKind::Broker && !valid_topic_name(&self.store.topic_prefix) {
            return Err(err(
                "store.topic_prefix".into(),
                format!(
                    "{:?} cannot begin a Kafka topic name (letters, digits, '.', '_', '-')",
                    self.store.topic_prefix
                ),
            ));
        }
        if self.store.write_timeout < std::time::Duration::from_secs(1) {
            return Err(err(
                "store.write_timeout".into(),
                "must be at least 1s: a state write waits for the broker's confirm".into(),
            ));
        }
        if !(std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(60))
            .contains(&self.store.lease)
        {
            return Err(err(
                "store.lease".into(),
                format!(
                    "{:?} is outside 1s..=60s: pings come every fifth of it, and a new owner waits it out before it reads",
                    self.store.lease
                ),
            ));
        }
        if self.store.checkpoint_records < 100 {
            return Err(err(
                "store.checkpoint_records".into(),
                format!(
                    "{} is too small: a checkpoint would follow every few writes (at least 100)",
                    self.store.checkpoint_records
                ),
            ));
        }
        let mut names = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let key = |field: &str| format!("routes[{i}].{field}");
            if route.name.trim().is_empty() {
                return Err(err(key("name"), "must not be empty".into()));
            }
            if !names.insert(route.name.as_str()) {
                return Err(err(
                    key("name"),
                    format!("route name {:?} is used twice", route.name),
                ));
            }
            if let Some(n) = route.partitions {
                self.check_partitions(route, n, &names)
                    .map_err(|m| err(key("partitions"), m))?;
            }
            if let Some((other, stream)) = self.state_stream_clash(route) {
                return Err(err(
                    key("name"),
                    format!(
                        "route {:?} would keep its state in streams named like route                          {other:?}'s ({stream:?}) with store.kind = \"broker\": one route's                          checkpoint would delete and refill the other's; rename one of them",
                        route.name
                    ),
                ));
            }
            if let Some(w) = route.weight {
                if !(1..=super::MAX_ROUTE_WEIGHT).contains(&w) {
                    return Err(err(
                        key("weight"),
                        format!("{w}: a route's weight is 1 to {}", super::MAX_ROUTE_WEIGHT),
                    ));
                }
            }
            if let Some(max) = route.max_delay.filter(|d| *d > MAX_DURATION) {
                return Err(err(key("max_delay"), too_long(max)));
            }
            self.check_mode(route)
                .map_err(|(field, m)| err(key(field), m))?;
            let from = self.broker(&route.from.broker).ok_or_else(|| {
                err(
                    key("from.broker"),
                    format!("no broker named {:?} under [brokers]", route.from.broker),
                )
            })?;
            let to = self.broker(&route.to.broker).ok_or_else(|| {
                err(
                    key("to.broker"),
                    format!("no broker named {:?} under [brokers]", route.to.broker),
                )
            })?;
            if self.store.kind == StoreKind::Broker {
                self.check_broker_store(route)
                    .map_err(|(field, m)| err(field, m))?;
            }
            if let BrokerConfig::Amqp { .. } = from {
                if route.from.queue.as_deref().is_none_or(str::is_empty) {
                    return Err(err(
                        key("from.queue"),
                        "an AMQP route needs the queue delayd consumes".into(),
                    ));
                }
                if route.from.prefetch == Some(0) {
                    return Err(err(key("from.prefetch"), "must be at least 1".into()));
                }
                if route.from.queue_type.is_some()
                    && route.from.queue_arguments.contains_key("x-queue-type")
                {
                    return Err(err(
                        key("from.queue_arguments"),
                        "x-queue-type is set by from.queue_type; give it once".into(),
                    ));
                }
                if route.from.queue_type == Some(QueueKind::Stream) {
                    self.check_stream_ingress(route)
                        .map_err(|(field, m)| err(key(field), m))?;
                }
            }
            if route.mode != Mode::Delay && matches!(from, BrokerConfig::Kafka { .. }) {
                return Err(err(
                    key("mode"),
                    "ttl and retry modes work on RabbitMQ messages; a Kafka route uses mode = \"delay\"".into(),
                ));
            }
            if let BrokerConfig::Kafka { .. } = from {
                if route.from.topics.is_empty() || route.from.topics.iter().any(|t| t.is_empty()) {
                    return Err(err(
                        key("from.topics"),
                        "a Kafka route needs the topics delayd consumes".into(),
                    ));
                }
                if route.from.group.as_deref().is_none_or(str::is_empty) {
                    return Err(err(
                        key("from.group"),
                        "a Kafka route needs a consumer group".into(),
                    ));
                }
                if route.from.prefetch == Some(0) {
                    return Err(err(key("from.prefetch"), "must be at least 1".into()));
                }
            } else if route.cancel_on_tombstone {
                return Err(err(
                    key("cancel_on_tombstone"),
                    "tombstones (null values) only exist on Kafka sources".into(),
                ));
            }
            match to {
                BrokerConfig::Amqp { .. } if route.to.exchange.is_none() => {
                    return Err(err(
                        key("to.exchange"),
                        "an AMQP target needs an exchange (\"\" for the default exchange)".into(),
                    ));
                }
                BrokerConfig::Kafka { .. }
                    if route.to.topic.as_deref().is_none_or(str::is_empty) =>
                {
                    return Err(err(key("to.topic"), "a Kafka target needs a topic".into()));
                }
                _ => {}
            }
            for (field, dest, default_broker) in [
                ("invalid", &route.invalid, &route.from.broker),
                ("unroutable", &route.unroutable, &route.to.broker),
                ("park", &route.park, &route.from.broker),
            ] {
                if let Some(d) = dest {
                    self.check_destination(d, default_broker)
                        .map_err(|m| err(key(field), m))?;
                }
            }
        }
        Ok(())
    }

    pub fn broker(&self, name: &str) -> Option<&BrokerConfig> {
        self.brokers.get(name)
    }

    /// Keys that belong to one mode, and the retry policy's sanity.
    /// Errors are (key under the route, message).
    fn check_mode(&self, route: &RouteConfig) -> Result<(), (&'static str, String)> {
        let only = |mode: &str| format!("is only used with mode = \"{mode}\"");
        if route.mode != Mode::Ttl {
            if route.message_ttl.is_some() {
                return Err(("message_ttl", only("ttl")));
            }
            if route.dead_letter_queue.is_some() {
                return Err(("dead_letter_queue", only("ttl")));
            }
        }
        if route.mode != Mode::Retry {
            if route.retry.is_some() {
                return Err(("retry", only("retry")));
            }
            if route.park.is_some() {
                return Err(("park", only("retry")));
            }
        }
        let max_delay = route.max_delay.unwrap_or(self.engine.max_delay);
        if let Some(ttl) = route.message_ttl {
            if ttl > max_delay {
                return Err((
                    "message_ttl",
                    format!("{ttl:?} is over max_delay ({max_delay:?})"),
                ));
            }
        }
        if route.mode != Mode::Retry {
            return Ok(());
        }
        let Some(retry) = &route.retry else {
            return Err((
                "retry",
                "mode = \"retry\" needs [routes.retry] with delays = [...] or backoff = { ... }"
                    .into(),
            ));
        };
        match (&retry.backoff, retry.delays.is_empty()) {
            (Some(_), false) => {
                return Err((
                    "retry.delays",
                    "set either retry.delays or retry.backoff, not both".into(),
                ))
            }
            (None, true) => {
                return Err((
                    "retry.delays",
                    "set a non-empty retry.delays list or retry.backoff".into(),
                ))
            }
            (None, false) => {
                if let Some(d) = retry.delays.iter().find(|d| **d > max_delay) {
                    return Err((
                        "retry.delays",
                        format!("{d:?} is over max_delay ({max_delay:?})"),
                    ));
                }
            }
            (Some(b), true) => {
                if b.initial.is_zero() {
                    return Err(("retry.backoff.initial", "must be above 0".into()));
                }
                if !(b.multiplier.is_finite() && b.multiplier >= 1.0) {
                    return Err(("retry.backoff.multiplier", "must be at least 1".into()));
                }
                if b.max < b.initial || b.max > max_delay {
                    return Err((
                        "retry.backoff.max",
                        format!("must be between backoff.initial and max_delay ({max_delay:?})"),
                    ));
                }
                if !(0.0..=1.0).contains(&b.jitter) {
                    return Err(("retry.backoff.jitter", "must be between 0 and 1".into()));
                }
                if retry.max_attempts.is_none() {
                    return Err((
                        "retry.max_attempts",
                        "is required with retry.backoff".into(),
                    ));
                }
            }
        }
        if retry.max_attempts == Some(0) {
            return Err(("retry.max_attempts", "must be at least 1".into()));
        }
        Ok(())
    }

    fn check_destination(&self, d: &DestinationConfig, default_broker: &str) -> Result<(), String> {
        let name = d.broker.as_deref().unwrap_or(default_broker);
        let Some(broker) = self.broker(name) else {
            return Err(format!("no broker named {name:?} under [brokers]"));
        };
        match broker {
            BrokerConfig::Kafka { .. } => {
                if d.topic.as_deref().is_none_or(str::is_empty)
                    || d.queue.is_some()
                    || d.exchange.is_some()
                {
                    return Err(format!(
                        "broker {name:?} is Kafka: set `topic` (not queue or exchange)"
                    ));
                }
            }
            BrokerConfig::Amqp { .. } => {
                let set = [d.queue.is_some(), d.exchange.is_some()];
                if d.topic.is_some() || set.iter().filter(|&&x| x).count() != 1 {
                    return Err(format!(
                        "broker {name:?} is AMQP: set exactly one of `queue` or `exchange`"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Config {
    /// `partitions = n` on `route`: a RabbitMQ route with an exchange for
    /// producers, and partition names no other route has.
    fn check_partitions(
        &self,
        route: &super::RouteConfig,
        n: u16,
        names: &HashSet<&str>,
    ) -> Result<(), String> {
        use super::partitions::{name, MAX_PARTITIONS};
        if n == 0 || n > MAX_PARTITIONS {
            return Err(format!("{n}: must be between 1 and {MAX_PARTITIONS}"));
        }
        if !matches!(
            self.broker(&route.from.broker),
            Some(BrokerConfig::Amqp { .. })
        ) {
            return Err("partitions are for RabbitMQ routes (a Kafka topic has its own)".into());
        }
        if route.from.exchange.is_none() {
            return Err(
                "a partitioned route needs from.exchange: producers publish there, and delayd declares it as the consistent-hash exchange in front of the partitions".into(),
            );
        }
        if !matches!(
            route.from.exchange_type,
            ExchangeKind::Topic | ExchangeKind::ConsistentHash
        ) {
            return Err(format!(
                "from.exchange_type {:?}: a partitioned route's exchange is declared x-consistent-hash",
                route.from.exchange_type
            ));
        }
        let taken = self
            .routes
            .iter()
            .map(|r| r.name.as_str())
            .chain(names.iter().copied());
        for other in taken {
            if (0..n).any(|i| name(&route.name, i) == other) {
                return Err(format!(
                    "partition route {other:?} would have the name of another route"
                ));
            }
        }
        Ok(())
    }
}
