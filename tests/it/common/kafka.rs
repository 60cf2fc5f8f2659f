//! Kafka side of the end-to-end harness: a real Apache Kafka at
//! 127.0.0.1:9092 (`KAFKA_BOOTSTRAP` overrides; `scripts/kafka.sh` starts
//! one there), reached with plain rdkafka clients.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

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

    /// The record's timestamp (CreateTime), as a producer on a host with
    /// another clock would set it.
    pub fn at(mut self, timestamp_ms: i64) -> Record {
        self.timestamp_ms = Some(timestamp_ms);
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
        if let Some(ts) = record.timestamp_ms {
            r = r.timestamp(ts);
        }
        let delivery = self
            .inner
            .send(r, Duration::from_secs(30))
            .await
            .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
        delivery.partition
    }
}

/// Reads a topic from the beginning on a thread of its own, which stamps
/// each record as it arrives: `received_ms` is the arrival time however late
/// the test reads the record. Make it before producing.
pub struct Reader {
    records: Mutex<mpsc::Receiver<Record>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    topic: String,
}

impl Reader {
    /// A topic that exists is assigned (every partition, from its
    /// beginning), so the reader is in place when this returns. One that
    /// does not exist yet (delayd creates its invalid and unroutable topics)
    /// is subscribed to with a group of its own, and read once it appears.
    pub fn new(topic: &str) -> Reader {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (topic, stop) = (topic.to_owned(), stop.clone());
            std::thread::spawn(move || {
                let consumer = Reader::consumer(&topic);
                let _ = ready_tx.send(());
                while !stop.load(Ordering::Acquire) {
                    let record = match consumer.poll(Duration::from_millis(100)) {
                        Some(Ok(m)) => Reader::record(&m),
                        Some(Err(e)) => {
                            eprintln!("reader of {topic}: {e}");
                            continue;
                        }
                        None => continue,
                    };
                    if tx.send(record).is_err() {
                        return;
                    }
                }
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("the reader of {topic} did not start: {e}"));
        Reader {
            records: Mutex::new(rx),
            stop,
            thread: Some(thread),
            topic: topic.to_owned(),
        }
    }

    /// A consumer of `topic`, assigned or subscribed (see [`Reader::new`]).
    fn consumer(topic: &str) -> BaseConsumer {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap())
            .set("group.id", format!("delayd-it-reader.{}", unique_suffix()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            // Notice soon a topic delayd creates after the subscription.
            .set("topic.metadata.refresh.interval.ms", "1000")
            .create()
            .expect("Kafka consumer");
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("metadata of {topic}: {e}"));
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        if partitions.is_empty() {
            consumer.subscribe(&[topic]).expect("subscribe");
            return consumer;
        }
        let mut list = TopicPartitionList::new();
        for p in partitions {
            list.add_partition_offset(topic, p, Offset::Beginning)
                .expect("partition offset");
        }
        consumer.assign(&list).expect("assign");
        consumer
    }

    fn record(m: &BorrowedMessage<'_>) -> Record {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        Record {
            key: m.key().map(<[u8]>::to_vec),
            value: m.payload().map(<[u8]>::to_vec),
            headers,
            partition: m.partition(),
            timestamp_ms: m.timestamp().to_millis(),
            received_ms: now_ms(),
        }
    }

    /// The next record, or `None` once `deadline` passes.
    pub fn next(&self, deadline: Instant) -> Option<Record> {
        let left = deadline.saturating_duration_since(Instant::now());
        let records = self.records.lock().expect("reader poisoned");
        match records.recv_timeout(left) {
            Ok(record) => Some(record),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!("the reader of {} stopped", self.topic)
            }
        }
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

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
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
    collect(reader, total, within, false)
}

/// [`collect_counting`] for one instance with its own WAL: a duplicate is
/// the same stored record published again (its Done lost in a crash), so it
/// must carry the `x-delayd-id` of the first copy; another id means the
/// message was stored twice. (Not for several instances: a record stored by
/// one that stopped and read again by another is stored twice on purpose.)
pub fn collect_same_ids(
    reader: &Reader,
    total: u32,
    within: Duration,
) -> (HashMap<u32, Record>, u32) {
    collect(reader, total, within, true)
}

fn collect(
    reader: &Reader,
    total: u32,
    within: Duration,
    same_ids: bool,
) -> (HashMap<u32, Record>, u32) {
    let deadline = Instant::now() + within;
    let mut seen: HashMap<u32, Record> = HashMap::new();
    let mut copies = 0u32;
    while seen.len() < total as usize {
        let Some(g) = reader.next(deadline) else {
            panic!("{} of {total} arrived within {within:?}", seen.len());
        };
        copies += 1;
        let value = value_of(&g);
        if same_ids {
            let id = g.header_text("x-delayd-id");
            assert!(id.is_some(), "record {value} without x-delayd-id: {g:?}");
            if let Some(first) = seen.get(&value) {
                assert_eq!(
                    first.header_text("x-delayd-id"),
                    id,
                    "record {value} arrived twice with different x-delayd-ids: stored twice"
                );
            }
        }
        seen.entry(value).or_insert(g);
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

/// Record `i` (sent at `sent[i].0` with delay `sent[i].1`) left delayd no
/// sooner than `sent + delay`, by its own timestamp (delayd's send time),
/// and reached the reader no sooner either.
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

/// How late a record may reach the reader before a test counts it as a bug
/// (as [`super::LATE_MS`] for RabbitMQ).
pub const LATE_MS: u64 = super::LATE_MS;

/// [`assert_none_early`], and none late: every record `i` reached the reader
/// (made before the records were sent) within `late_ms` of its delay after
/// the later of its send and `since_ms(i)`, when the last disruption that
/// could hold it back ended (a restart, a rebalance; 0 if none): a record
/// read late is due its delay after it was read, and one stored before the
/// disruption fires when it ends.
pub fn assert_on_time(
    got: &HashMap<u32, Record>,
    sent: &[(u64, u64)],
    since_ms: impl Fn(u32) -> u64,
    late_ms: u64,
) {
    assert_none_early(got, sent);
    let mut latest = (0, 0);
    for (i, &(sent_ms, delay)) in sent.iter().enumerate() {
        let g = &got[&(i as u32)];
        let late = g
            .received_ms
            .saturating_sub(sent_ms.max(since_ms(i as u32)) + delay);
        latest = latest.max((late, i));
        assert!(
            late <= late_ms,
            "record {i} late: sent {sent_ms}, delay {delay}, received {} ({late} ms late, more than {late_ms})",
            g.received_ms
        );
    }
    println!(
        "latest of {} records: {} ms late (record {})",
        sent.len(),
        latest.0,
        latest.1
    );
}

/// Polls delayd's log until its consumer holds at least one partition.
pub async fn wait_assigned(delayd: &Delayd) {
    wait_assigned_partitions(delayd, 1).await;
}

/// Polls delayd's log until its latest assignment, since it last started,
/// holds at least `count` partitions.
pub async fn wait_assigned_partitions(delayd: &Delayd, count: usize) {
    let what = format!("a Kafka assignment of {count} partition(s)");
    super::wait_for(&what, Duration::from_secs(30), || async {
        let tail = delayd.log_tail(200);
        // Only this start's lines: an earlier run's assignment says nothing.
        let this_start = tail
            .rfind("===== delayd start")
            .map_or(tail.as_str(), |at| &tail[at..]);
        this_start
            .lines()
            .rev()
            .find(|l| l.contains("Kafka partitions"))
            .filter(|l| l.contains("assigned partitions=[(\"") && l.matches("(\"").count() >= count)
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
