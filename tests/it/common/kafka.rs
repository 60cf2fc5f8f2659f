//! Kafka side of the end-to-end harness: a real Apache Kafka at
//! 127.0.0.1:9092 (`KAFKA_BOOTSTRAP` overrides; `scripts/kafka.sh` starts
//! one there), reached with plain rdkafka clients.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message};

use super::{now_ms, toml_string, unique_suffix, Delayd};

pub fn bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A topic name no other test uses.
pub fn topic(test: &str, role: &str) -> String {
    format!("delayd-it.{test}.{role}.{}", unique_suffix())
}

fn admin() -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .expect("Kafka admin client")
}

pub async fn create_topic(name: &str, partitions: i32) {
    let results = admin()
        .create_topics(
            [&NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {name}: {e}"));
    for r in results {
        r.unwrap_or_else(|e| panic!("create topic {name}: {e:?}"));
    }
}

/// Grows `name` to `partitions` partitions.
pub async fn add_partitions(name: &str, partitions: usize) {
    let results = admin()
        .create_partitions(
            [&NewPartitions::new(name, partitions)],
            &AdminOptions::new(),
        )
        .await
        .unwrap_or_else(|e| panic!("add partitions to {name}: {e}"));
    for r in results {
        r.unwrap_or_else(|e| panic!("add partitions to {name}: {e:?}"));
    }
}

/// Does the cluster's metadata list topic `name`?
pub async fn topic_exists(name: &str) -> bool {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .create()
            .expect("Kafka client");
        let metadata = consumer
            .fetch_metadata(None, Duration::from_secs(10))
            .expect("Kafka metadata");
        metadata.topics().iter().any(|t| t.name() == name)
    })
    .await
    .expect("metadata task")
}

/// Members of consumer group `group`, as the broker reports them.
pub fn group_members(group: &str) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .create()
        .expect("Kafka client");
    match consumer.fetch_group_list(Some(group), Duration::from_secs(5)) {
        Ok(list) => list
            .groups()
            .iter()
            .find(|g| g.name() == group)
            .map_or(0, |g| g.members().len()),
        Err(e) => panic!("describe group {group}: {e}"),
    }
}

/// A record as the tests send and receive it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub partition: i32,
    pub timestamp_ms: Option<i64>,
    /// When the test's consumer got it (wall clock, ms).
    pub received_ms: u64,
}

impl Record {
    pub fn new(key: &str, value: &[u8]) -> Record {
        Record {
            key: Some(key.as_bytes().to_vec()),
            value: Some(value.to_vec()),
            ..Record::default()
        }
    }

    pub fn header(mut self, name: &str, value: Option<&[u8]>) -> Record {
        self.headers
            .push((name.to_owned(), value.map(<[u8]>::to_vec)));
        self
    }

    pub fn header_text(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

/// An idempotent, `acks=all` producer, partitioning like Java's client.
pub struct Producer {
    inner: FutureProducer,
}

impl Producer {
    pub fn new() -> Producer {
        let inner = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .create()
            .expect("Kafka producer");
        Producer { inner }
    }

    /// Sends and waits for the broker; returns the partition.
    pub async fn send(&self, topic: &str, record: &Record) -> i32 {
        self.send_inner(topic, None, record).await
    }

    /// Sends to `partition` (not where the key would put it) and waits.
    pub async fn send_to(&self, topic: &str, partition: i32, record: &Record) -> i32 {
        self.send_inner(topic, Some(partition), record).await
    }

    async fn send_inner(&self, topic: &str, partition: Option<i32>, record: &Record) -> i32 {
        let mut headers = OwnedHeaders::new();
        for (name, value) in &record.headers {
            headers = headers.insert(Header {
                key: name,
                value: value.as_deref(),
            });
        }
        let mut r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = &record.key {
            r = r.key(k);
        }
        if let Some(v) = &record.value {
            r = r.payload(v);
        }
        if let Some(p) = partition {
            r = r.partition(p);
        }
        let delivery = self
            .inner
            .send(r, Duration::from_secs(30))
            .await
            .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
        delivery.partition
    }
}

/// Reads a topic from the beginning with a group of its own.
pub struct Reader {
    consumer: BaseConsumer,
    topic: String,
}

impl Reader {
    pub fn new(topic: &str) -> Reader {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("group.id", format!("delayd-it-reader.{}", unique_suffix()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            // Notice soon a topic delayd creates after the subscription.
            .set("topic.metadata.refresh.interval.ms", "1000")
            .create()
            .expect("Kafka consumer");
        consumer.subscribe(&[topic]).expect("subscribe");
        Reader {
            consumer,
            topic: topic.to_owned(),
        }
    }

    /// The next record, or `None` once `deadline` passes.
    pub fn next(&self, deadline: Instant) -> Option<Record> {
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.consumer.poll(left.min(Duration::from_millis(100))) {
                Some(Ok(m)) => {
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                .collect()
                        })
                        .unwrap_or_default();
                    return Some(Record {
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                        headers,
                        partition: m.partition(),
                        timestamp_ms: m.timestamp().to_millis(),
                        received_ms: now_ms(),
                    });
                }
                Some(Err(e)) => eprintln!("reader of {}: {e}", self.topic),
                None => {}
            }
        }
        None
    }

    /// Reads until `count` records arrived; panics at `within`.
    pub fn collect(&self, count: usize, within: Duration) -> Vec<Record> {
        let deadline = Instant::now() + within;
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            match self.next(deadline) {
                Some(r) => out.push(r),
                None => panic!(
                    "{} of {count} records arrived on {} within {within:?}",
                    out.len(),
                    self.topic
                ),
            }
        }
        out
    }

    /// Every record that arrives before `deadline`.
    pub fn drain_until(&self, deadline: Instant) -> Vec<Record> {
        std::iter::from_fn(|| self.next(deadline)).collect()
    }
}

/// The config of a delayd with one Kafka → Kafka route, plus `extra` route
/// keys (e.g. `cancel_on_tombstone = true`).
pub fn config(
    wal_dir: &Path,
    http: SocketAddr,
    route: &str,
    from_topic: &str,
    group: &str,
    to_topic: &str,
    extra: &str,
) -> String {
    format!(
        r#"[wal]
dir = {wal}
create_dir = true

[http]
listen = "{http}"

[log]
level = "info"

[brokers.kafka]
kind = "kafka"
bootstrap = {bootstrap}
# A killed instance's group membership expires quickly (tests restart them);
# frequent heartbeats keep a live member well inside that window.
properties = {{ "session.timeout.ms" = "6000", "heartbeat.interval.ms" = "1000" }}

[[routes]]
name = {route}
from = {{ broker = "kafka", topics = [{from}], group = {group} }}
to = {{ broker = "kafka", topic = {to} }}
{extra}
"#,
        wal = toml_string(wal_dir.to_str().expect("UTF-8 temp path")),
        bootstrap = toml_string(&bootstrap()),
        route = toml_string(route),
        from = toml_string(from_topic),
        group = toml_string(group),
        to = toml_string(to_topic),
    )
}

/// Reads until every value `0..total` arrived. Returns the first copy of
/// each, by value; panics naming how many arrived.
pub fn collect_unique(reader: &Reader, total: u32, within: Duration) -> HashMap<u32, Record> {
    collect_counting(reader, total, within).0
}

/// [`collect_unique`], with the number of duplicate copies read meanwhile.
pub fn collect_counting(
    reader: &Reader,
    total: u32,
    within: Duration,
) -> (HashMap<u32, Record>, u32) {
    let deadline = Instant::now() + within;
    let mut seen: HashMap<u32, Record> = HashMap::new();
    let mut copies = 0u32;
    while seen.len() < total as usize {
        let Some(g) = reader.next(deadline) else {
            panic!("{} of {total} arrived within {within:?}", seen.len());
        };
        copies += 1;
        seen.entry(value_of(&g)).or_insert(g);
    }
    let duplicates = copies - total;
    eprintln!("{total} records arrived, {duplicates} duplicate copies");
    (seen, duplicates)
}

pub fn value_of(g: &Record) -> u32 {
    String::from_utf8_lossy(g.value.as_deref().expect("a value"))
        .parse()
        .expect("a numeric value")
}

/// Record `i` (sent at `sent[i].0` with delay `sent[i].1`) left delayd (its
/// timestamp is delayd's send time) and reached the reader no sooner than
/// `sent + delay`.
pub fn assert_none_early(got: &HashMap<u32, Record>, sent: &[(u64, u64)]) {
    for (i, &(sent_ms, delay)) in sent.iter().enumerate() {
        let g = &got[&(i as u32)];
        let fired = g.timestamp_ms.expect("a timestamp") as u64;
        assert!(
            fired >= sent_ms + delay && g.received_ms >= sent_ms + delay,
            "record {i} early: sent {sent_ms}, delay {delay}, fired {fired}, received {}",
            g.received_ms
        );
    }
}

/// Polls delayd's log until its consumer holds at least one partition.
pub async fn wait_assigned(delayd: &Delayd) {
    super::wait_for("a Kafka assignment", Duration::from_secs(30), || async {
        delayd
            .log_tail(50)
            .lines()
            .rev()
            .find(|l| l.contains("Kafka partitions"))
            .filter(|l| l.contains("assigned partitions=[(\""))
            .map(|_| ())
    })
    .await;
}

/// A Kafka → Kafka route of one test: its topics (created), group and name.
pub struct KafkaRoute {
    pub from: String,
    pub to: String,
    pub group: String,
    pub route: String,
}

impl KafkaRoute {
    pub async fn new(test: &str, partitions: i32) -> KafkaRoute {
        let r = KafkaRoute {
            from: topic(test, "in"),
            to: topic(test, "out"),
            group: format!("delayd-it.{test}.{}", unique_suffix()),
            route: format!("it-{test}"),
        };
        create_topic(&r.from, partitions).await;
        create_topic(&r.to, partitions).await;
        r
    }

    /// Starts a delayd on the route, with `extra` route keys.
    pub async fn start(&self, extra: &str) -> Delayd {
        self.start_with_sections("", extra).await
    }

    /// [`KafkaRoute::start`] with top-level `sections` (e.g. `[store]`)
    /// ahead of the rest of the config.
    pub async fn start_with_sections(&self, sections: &str, extra: &str) -> Delayd {
        Delayd::start_with(|wal, http| {
            let rest = config(
                wal,
                http,
                &self.route,
                &self.from,
                &self.group,
                &self.to,
                extra,
            );
            format!("{sections}\n{rest}")
        })
        .await
    }
}
