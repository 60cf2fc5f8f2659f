//! Configuration: built-in defaults < TOML file < `DELAYD_` environment
//! (`__` separates nesting levels, e.g. `DELAYD_WAL__DIR=/var/lib/delayd`).
//!
//! Errors name the key and where its value came from (file or variable).

mod connections;
mod duration;
pub mod partitions;
mod secrets;
pub mod stream;
mod validate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::wal::OnCorruption;

pub use connections::{describe_broker, BrokerConnection};
pub use validate::ConfigError;

/// The whole configuration. Every field has a default except `routes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub wal: WalSection,
    pub store: StoreSection,
    pub http: HttpSection,
    pub engine: EngineSection,
    pub log: LogSection,
    pub brokers: BTreeMap<String, BrokerConfig>,
    pub routes: Vec<RouteConfig>,
    /// The file this was loaded from, for errors found after loading.
    #[serde(skip)]
    pub file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalSection {
    /// Directory of the write-ahead log. Must exist unless `create_dir`.
    pub dir: PathBuf,
    /// Create `dir` if it is missing. Off by default: a missing WAL
    /// directory may be an unmounted volume, and starting empty there would
    /// lose every pending message without a word.
    pub create_dir: bool,
    /// Segment size before a new one is started, bytes.
    pub segment_bytes: u64,
    /// Largest message accepted (encoded body + headers), bytes. Larger ones
    /// go to the route's invalid destination.
    pub max_message_bytes: u32,
    /// Compact a sealed segment when its live fraction falls below this.
    pub compact_below: f64,
    /// `skip` (report and carry on) or `refuse` (do not start) on corruption.
    pub on_corruption: OnCorruption,
    /// Bytes of the WAL's volume kept free, in a ballast file
    /// (`<dir>/reserve`), for the writes that free space: on a full disk it
    /// is released to fired messages' Dones, a new segment, the far tier's
    /// checkpoint and loads, never to new messages. At most an eighth of
    /// the volume is taken. 0 keeps none.
    pub reserve_bytes: u64,
    /// How long a group commit waits for more records before its
    /// fdatasync. Fewer fdatasyncs, acks that much later; due times count
    /// from arrival, so deliveries are not delayed by it. Default 5 ms.
    #[serde(with = "duration")]
    pub commit_delay: Duration,
    /// How long a delivered message's Done may wait, unwritten, to ride the
    /// next group commit instead of costing an fdatasync of its own. A Done
    /// not durable when delayd is killed is a duplicate after the restart
    /// (same `x-delayd-id`). Default 2 ms.
    #[serde(with = "duration")]
    pub done_wait: Duration,
}

impl Default for WalSection {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("data/wal"),
            create_dir: false,
            segment_bytes: 64 << 20,
            max_message_bytes: 16 << 20,
            compact_below: 0.5,
            on_corruption: OnCorruption::Skip,
            reserve_bytes: 16 << 20,
            commit_delay: Duration::from_millis(5),
            done_wait: Duration::from_millis(2),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Admin and metrics listener. Empty string disables it.
    pub listen: String,
    /// Bearer token required on `/v1/*` (also `DELAYD_HTTP__TOKEN`).
    pub token: Option<String>,
    /// File holding the bearer token (first line).
    pub token_file: Option<PathBuf>,
}

impl HttpSection {
    /// The bearer token: `token` (also `DELAYD_HTTP__TOKEN`), else the first
    /// line of `token_file`. An empty `token` counts as none (an exported
    /// but empty variable, say).
    pub fn bearer_token(&self) -> Result<Option<String>, ConfigError> {
        if let Some(t) = self
            .token
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            return Ok(Some(t.to_owned()));
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let invalid = |message: String| ConfigError::Invalid {
            key: "http.token_file".into(),
            file: None,
            message,
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
        let t = text.lines().next().unwrap_or("").trim().to_owned();
        if t.is_empty() {
            return Err(invalid(format!("{} is empty", path.display())));
        }
        Ok(Some(t))
    }
}

impl Default for HttpSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            token: None,
            token_file: None,
        }
    }
}

/// Where the durable record of a pending message lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The WAL on this instance's disk (the default).
    #[default]
    Local,
    /// The source broker: a compacted state topic per Kafka route, state
    /// streams per RabbitMQ route (see docs/broker-store.md); the local WAL
    /// is then a working copy.
    Broker,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    /// `local` or `broker`.
    pub kind: StoreKind,
    /// Kafka state topics and RabbitMQ state streams are named this
    /// followed by the route name.
    pub topic_prefix: String,
    /// RabbitMQ state streams: a generation is checkpointed (its live
    /// records copied into a new one, the old one deleted) once it holds
    /// more than twice the live set plus this many records.
    pub checkpoint_records: u64,
    /// Kafka state topics delayd creates get this many replicas. Unset: the
    /// cluster's `default.replication.factor`. Either way a cluster that
    /// cannot meet it is an error at start, never a quiet single replica.
    /// RabbitMQ state streams delayd creates get this
    /// `x-initial-cluster-size`. Unset: every node of the cluster (RabbitMQ's
    /// default); RabbitMQ caps it at the cluster's size.
    pub replication_factor: Option<u16>,
    /// RabbitMQ state streams: how long a state write may wait for the
    /// broker's confirm (a broker that blocks publishers, a lost node)
    /// before the owner gives the route up and tries again.
    #[serde(with = "duration")]
    pub write_timeout: Duration,
    /// RabbitMQ routes: how long an owner holds the route's lock past the
    /// sending of its last ping that came back, and what a new owner waits
    /// (plus a twentieth) before it reads; a quarter of it is the lock
    /// queue's `x-consumer-disconnected-timeout`. Sets the time a route has
    /// no owner after its owner or the owner's node dies.
    #[serde(with = "duration")]
    pub lease: Duration,
}

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            kind: StoreKind::Local,
            topic_prefix: "delayd.state.".into(),
            checkpoint_records: 20_000,
            replication_factor: None,
            write_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(5),
        }
    }
}

impl StoreSection {
    /// The state topic of `route` (broker store, Kafka).
    pub fn topic(&self, route: &str) -> String {
        format!("{}{route}", self.topic_prefix)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Most messages being published at once.
    pub max_in_flight: usize,
    /// On SIGTERM, give every waiting message back to its route's ingress
    /// (marked with its due time) for another instance to fire, instead of
    /// keeping it in the local WAL. For instances whose disk does not
    /// outlive them. Default: true with `store.kind = "broker"`, else false.
    pub handoff: Option<bool>,
    /// Most bytes of message bodies being stored at once (intake, all routes
    /// together) and, separately, being published at once. One message
    /// bigger than this is taken alone. Default 64 MiB.
    pub max_bytes_in_flight: u64,
    /// Messages per second for those already overdue at start-up.
    pub overdue_rate: u32,
    /// Longest delay accepted; longer ones are invalid. Default 10 years.
    #[serde(with = "duration")]
    pub max_delay: Duration,
    /// First retry after a failed publish, doubling up to `retry_max`.
    #[serde(with = "duration")]
    pub retry_initial: Duration,
    #[serde(with = "duration")]
    pub retry_max: Duration,
    /// On SIGTERM, how long to wait for in-flight publishes.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
    /// Unacknowledged fingerprints kept to recognise broker redeliveries.
    pub dedup_window: usize,
    /// Backpressure: at this many pending messages delayd stops consuming
    /// (messages wait in the broker) and resumes below 90%. 0 = no limit.
    pub max_pending: u64,
    /// Backpressure: the same for WAL bytes on disk. 0 = no limit.
    pub max_disk: u64,
    /// Messages due further ahead than this wait on disk in the far tier
    /// (`<wal.dir>/far`), not in memory; they come back into memory an
    /// horizon before they are due. 0 = keep every pending message in
    /// memory. With `store.kind = "broker"` nothing new goes there.
    #[serde(with = "duration")]
    pub horizon: Duration,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            max_in_flight: 1024,
            handoff: None,
            max_bytes_in_flight: 64 << 20,
            overdue_rate: 5000,
            max_delay: Duration::from_secs(10 * 365 * 24 * 3600),
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            dedup_window: 100_000,
            max_pending: 0,
            max_disk: 0,
            horizon: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// `pretty` or `json`.
    pub format: LogFormat,
    /// tracing filter, e.g. `info` or `delayd=debug`; `RUST_LOG` wins if set.
    pub level: String,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BrokerConfig {
    Amqp(AmqpBrokerConfig),
    Kafka(KafkaBrokerConfig),
}

/// `[brokers.NAME]` with `kind = "amqp"`: one RabbitMQ broker or cluster.
/// Give exactly one of `url`, `urls` or `url_file`.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpBrokerConfig {
    /// amqp://user:pass@host:port/vhost (vhost `/` is `%2f`), or amqps://.
    #[serde(default)]
    pub url: Option<String>,
    /// Several endpoints (a cluster's nodes): each (re)connect tries them in
    /// order and keeps the first that answers.
    #[serde(default)]
    pub urls: Vec<String>,
    /// A file holding the URL, or several, one per line (a mounted secret).
    #[serde(default)]
    pub url_file: Option<PathBuf>,
    /// A file holding the password (its first line), used with every URL,
    /// which then carries none.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// TLS for amqps:// URLs (without it: the system's CAs, no client
    /// certificate).
    #[serde(default)]
    pub tls: Option<AmqpTlsConfig>,
}

impl std::fmt::Debug for AmqpBrokerConfig {
    // URLs may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use delayd_adapters::amqp::redact_url;
        f.debug_struct("AmqpBrokerConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field(
                "urls",
                &self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
            )
            .field("url_file", &self.url_file)
            .field("password_file", &self.password_file)
            .field("tls", &self.tls)
            .finish()
    }
}

/// How delayd logs in to RabbitMQ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AmqpAuth {
    /// User name and password (SASL PLAIN), from the URL and `password_file`.
    #[default]
    Plain,
    /// The TLS client certificate names the user (SASL EXTERNAL, RabbitMQ's
    /// `rabbitmq_auth_mechanism_ssl` plugin).
    External,
}

/// `[brokers.NAME.tls]`: what an amqps:// connection trusts and presents.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpTlsConfig {
    /// CA certificates (PEM) the broker's certificate must chain to,
    /// instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM, leaf first), for brokers that verify
    /// peers and for `auth = "external"`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM, unencrypted).
    pub key_file: Option<PathBuf>,
    /// The name the broker's certificate must be valid for, when it is not
    /// the URL's host (an IP address, a load balancer).
    pub server_name: Option<String>,
    /// `plain` (user and password) or `external` (the client certificate).
    pub auth: AmqpAuth,
    /// Verify the broker's certificate. Turning it off accepts any
    /// certificate (a man in the middle too) and logs a warning at start.
    pub verify_peer: bool,
}

impl Default for AmqpTlsConfig {
    fn default() -> Self {
        Self {
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            auth: AmqpAuth::Plain,
            verify_peer: true,
        }
    }
}

/// `[brokers.NAME]` with `kind = "kafka"`. Property values may be
/// `${file:PATH}` or `${env:NAME}` (the whole value), read at start.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaBrokerConfig {
    /// Comma-separated host:port list.
    pub bootstrap: String,
    /// librdkafka `client.id` of every client of this broker. Default:
    /// `delayd-<route>` for a route's consumer and state topic,
    /// `delayd-<broker>` for the producer the routes share.
    #[serde(default)]
    pub client_id: Option<String>,
    /// Extra librdkafka properties (`security.protocol`, `sasl.*`,
    /// ...), for both consumer and producer.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Consumer-only librdkafka properties (`fetch.wait.max.ms`,
    /// `session.timeout.ms`, ...), over `properties`.
    #[serde(default)]
    pub consumer_properties: BTreeMap<String, String>,
    /// Producer-only librdkafka properties (`linger.ms`, ...), over
    /// `properties`.
    #[serde(default)]
    pub producer_properties: BTreeMap<String, String>,
}

impl std::fmt::Debug for KafkaBrokerConfig {
    // Properties may hold secrets (sasl.password, ssl.key.pem, ...).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("KafkaBrokerConfig")
            .field("bootstrap", &self.bootstrap)
            .field("client_id", &self.client_id)
            .field("properties", &keys(&self.properties))
            .field("consumer_properties", &keys(&self.consumer_properties))
            .field("producer_properties", &keys(&self.producer_properties))
            .finish()
    }
}

/// Type of a source exchange delayd declares (names as AMQP spells them).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeKind {
    Direct,
    #[default]
    Topic,
    Fanout,
    Headers,
    /// The `rabbitmq_consistent_hash_exchange` plugin's type; what a
    /// route with `partitions` declares.
    #[serde(rename = "x-consistent-hash")]
    ConsistentHash,
}

/// Type of a source queue delayd declares (its `x-queue-type`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum QueueKind {
    Classic,
    Quorum,
    /// Read from an offset: exact identity (see `delayd_adapters::amqp::stream`).
    Stream,
}

impl QueueKind {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueKind::Classic => "classic",
            QueueKind::Quorum => "quorum",
            QueueKind::Stream => "stream",
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Delay from `x-delay` / `x-deliver-at` headers.
    #[default]
    Delay,
    /// Delay from the `expiration` property / `message_ttl` (TTL + DLX emulation).
    Ttl,
    /// Retry with back-off and a bounded number of attempts.
    Retry,
}

/// What a route's delays count from (`delay_from`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DelayFrom {
    /// When the broker took the message, where it says: a Kafka record's
    /// timestamp, RabbitMQ's `timestamp_in_ms` header; else as `intake`.
    #[default]
    Broker,
    /// When delayd read the message.
    Intake,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    #[serde(default)]
    pub mode: Mode,
    /// What `x-delay` and a TTL count from (see `route::clock`). A restart,
    /// a rebalance or a backlog shifts no due time with `broker`.
    #[serde(default)]
    pub delay_from: DelayFrom,
    pub from: FromConfig,
    pub to: ToConfig,
    /// Where messages that cannot be scheduled go (default: queue `delayd.invalid`
    /// on the source broker).
    #[serde(default)]
    pub invalid: Option<DestinationConfig>,
    /// Where unroutable messages go (default: queue `delayd.unroutable` on the
    /// target broker).
    #[serde(default)]
    pub unroutable: Option<DestinationConfig>,
    /// Honour per-message `x-target-*` headers.
    #[serde(default)]
    pub allow_target_override: bool,
    /// Kafka: a record with key K and a null value cancels the pending
    /// message with key K on this route (instead of being delayed itself).
    #[serde(default)]
    pub cancel_on_tombstone: bool,
    /// Overrides `engine.max_delay` for this route.
    #[serde(default, with = "duration::option")]
    pub max_delay: Option<Duration>,
    /// `ttl` mode: the queue's TTL, like `x-message-ttl`. With a per-message
    /// `expiration` too, the lower wins.
    #[serde(default, with = "duration::option")]
    pub message_ttl: Option<Duration>,
    /// `ttl` mode: the queue name written in `x-death` (default `from.queue`),
    /// so consumers that count deaths of their old wait queue keep working.
    #[serde(default)]
    pub dead_letter_queue: Option<String>,
    /// `retry` mode: back-off, attempt counting and parking.
    #[serde(default)]
    pub retry: Option<RetryConfig>,
    /// `retry` mode: where a message goes after `retry.max_attempts`
    /// (default: durable queue `delayd.parked` on the source broker).
    #[serde(default)]
    pub park: Option<DestinationConfig>,
    /// RabbitMQ: split the route into this many partitions, routes
    /// `<name>.0` .. `<name>.<N-1>` consuming queues `<from.queue>.0` ..,
    /// bound to `from.exchange` declared as a consistent-hash exchange: a
    /// routing key always lands in one partition. Each partition has its
    /// own owner (and state streams) with the broker store, and the
    /// instances share the partitions out evenly. See `config::partitions`.
    #[serde(default)]
    pub partitions: Option<u16>,
    /// Its share of the dispatcher when several routes have messages due
    /// at once: per round it sends up to `weight` of its messages for
    /// every one of a weight-1 route's (default 1: all routes equal; at
    /// most [`MAX_ROUTE_WEIGHT`]). A partitioned route's partitions each
    /// have it.
    #[serde(default)]
    pub weight: Option<u32>,
    /// Set on the routes a partitioned one expands into (not a key).
    #[serde(skip)]
    pub partition: Option<partitions::Partition>,
}

/// The largest `weight` a route may have.
pub const MAX_ROUTE_WEIGHT: u32 = 1000;

/// `[routes.retry]`: how long to wait before each retry and when to give up.
/// Set either `delays` or `backoff`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Delay before retry 1, 2, ...; the last one repeats.
    #[serde(default, with = "duration::vec")]
    pub delays: Vec<Duration>,
    /// Exponential back-off instead of a list.
    #[serde(default)]
    pub backoff: Option<BackoffConfig>,
    /// Processing attempts in all, the first included. Default: the number
    /// of `delays` + 1; required with `backoff`.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// The work queue whose `x-death` count (reason `rejected`) counts failed
    /// attempts. Default: any queue's rejections. `x-delayd-attempt` is used
    /// as well (RabbitMQ 4.x ignores client-set `x-death`).
    #[serde(default)]
    pub work_queue: Option<String>,
}

/// Exponential back-off: `initial * multiplier^(retry-1)`, at most `max`,
/// then spread by up to `jitter` (a fraction, 0.1 = ±10%).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffConfig {
    #[serde(with = "duration")]
    pub initial: Duration,
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
    #[serde(with = "duration")]
    pub max: Duration,
    #[serde(default)]
    pub jitter: f64,
}

fn default_multiplier() -> f64 {
    2.0
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FromConfig {
    pub broker: String,
    /// AMQP: the durable queue delayd consumes.
    #[serde(default)]
    pub queue: Option<String>,
    /// AMQP: an exchange delayd declares and binds to `queue` (key `#`, or "" for fanout).
    #[serde(default)]
    pub exchange: Option<String>,
    /// AMQP: type of `exchange`: direct, topic (default), fanout or headers.
    #[serde(default)]
    pub exchange_type: ExchangeKind,
    /// AMQP: unacknowledged deliveries per consumer (basic.qos).
    #[serde(default)]
    pub prefetch: Option<u16>,
    /// AMQP: type of `queue` when delayd declares it: "classic", "quorum" or
    /// "stream" (unset: the vhost's default). Sets the `x-queue-type`
    /// argument. A stream is read from an offset delayd keeps, so every
    /// message has an exact identity.
    #[serde(default)]
    pub queue_type: Option<QueueKind>,
    /// AMQP: further arguments of the queue's declaration, such as
    /// `x-delivery-limit` (integers, strings or booleans).
    #[serde(default)]
    pub queue_arguments: BTreeMap<String, QueueArgument>,
    /// Kafka: topics to consume.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Kafka: consumer group.
    #[serde(default)]
    pub group: Option<String>,
}

/// One value of `from.queue_arguments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum QueueArgument {
    Bool(bool),
    Int(i64),
    Str(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ToConfig {
    pub broker: String,
    /// AMQP target exchange ("" is the default exchange).
    #[serde(default)]
    pub exchange: Option<String>,
    /// AMQP routing key; the message's own key is kept when unset.
    #[serde(default)]
    pub routing_key: Option<String>,
    /// Kafka target topic.
    #[serde(default)]
    pub topic: Option<String>,
    /// Kafka: keep the record's original timestamp instead of the fire time.
    #[serde(default)]
    pub keep_timestamp: bool,
}

/// An invalid/unroutable destination: a queue, an exchange (+ key) or a topic.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct DestinationConfig {
    /// Broker name; defaults to the source (invalid) or target (unroutable) broker.
    #[serde(default)]
    pub broker: Option<String>,
    #[serde(default)]
    pub queue: Option<String>,
    #[serde(default)]
    pub exchange: Option<String>,
    #[serde(default)]
    pub routing_key: Option<String>,
    #[serde(default)]
    pub topic: Option<String>,
}

impl Config {
    /// `engine.handoff`, defaulting to on with the broker-kept store.
    pub fn handoff(&self) -> bool {
        self.engine
            .handoff
            .unwrap_or(self.store.kind == StoreKind::Broker)
    }

    /// Defaults, then `file` (if any), then the `DELAYD_` environment; then
    /// semantic checks. Errors name the key and the file.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Missing(path.to_path_buf()));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        // DELAYD_CONFIG names the file (the CLI reads it), it is not a key.
        figment = figment.merge(Env::prefixed("DELAYD_").ignore(&["config"]).split("__"));
        let mut config: Config = figment
            .extract()
            .map_err(|e| ConfigError::from_figment(e, file))?;
        config.file = file.map(Path::to_path_buf);
        config.validate(file)?;
        config.routes = partitions::expand(std::mem::take(&mut config.routes));
        // Read every secret and certificate file now, so `delayd check`
        // and `delayd run` both fail on a missing one, naming it.
        config.connections()?;
        Ok(config)
    }

    /// Parse and check a TOML string, without reading the files it names
    /// (tests; [`Config::connections`] reads them).
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| ConfigError::from_figment(e, None))?;
        config.validate(None)?;
        let mut config = config;
        config.routes = partitions::expand(std::mem::take(&mut config.routes));
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
