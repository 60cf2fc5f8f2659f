//! [`KafkaSource`]: consumes a consumer group's topics.
//!
//! A poll thread of its own drives librdkafka's `BaseConsumer`, so the
//! rebalance callback may block (to let records being stored finish and
//! commit them) without holding up the async runtime.
//!
//! * Records go to the core through a bounded channel. When it is full, the
//!   thread keeps what it polled in a local backlog; once that holds a few
//!   bursts it pauses its partitions until the backlog is empty, so it keeps
//!   polling (group membership and callbacks stay alive) without reading
//!   further. Pausing for every momentarily full channel would cost a
//!   refetch each time (librdkafka drops its prefetched records).
//! * Offsets are committed by hand (synchronously, at most once every
//!   [`KafkaSourceConfig::commit_interval`], covering every record settled
//!   meanwhile), never automatically: in order
//!   per partition and only past records the core has stored (see
//!   [`crate::offsets`]). An ack resolves once its offset is committed.
//! * On revoke, the thread drops its backlog for those partitions, waits up
//!   to [`KafkaSourceConfig::revoke_timeout`] for records being stored, and
//!   commits synchronously before the partitions are given up.
//! * `requeue` seeks the partition back to the record, so it and the records
//!   after it are read again (the core recognises those it already stored).
//! * `pause`/`resume` pause and resume every assigned partition, including
//!   partitions assigned while paused.
//! * Partitions added to a subscribed topic are picked up at the next
//!   metadata refresh (`topic.metadata.refresh.interval.ms`, 10 s by
//!   default here), which rebalances the group.
//!
//! Every record is handed out as possibly redelivered: Kafka has no
//! redelivered flag, and after a crash or rebalance the records past the last
//! commit are read again.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot};

use super::convert::message_from_record;
use super::state::PartitionListener;
use super::{KafkaClientConfig, Role};
use crate::offsets::{OffsetTracker, TopicPartition};
use crate::traits::{AckHandle, BoxFuture, Consuming, Delivery, Source, SourceError};

/// What a [`KafkaSource`] consumes and how.
#[derive(Clone)]
pub struct KafkaSourceConfig {
    pub topics: Vec<String>,
    /// Consumer group (`group.id`).
    pub group: String,
    /// Records handed out and not yet taken by the core. Default 1000.
    pub capacity: usize,
    /// How often settled offsets are committed. Default 20 ms.
    pub commit_interval: Duration,
    /// On revoke, how long to wait for records being stored. Default 10 s.
    pub revoke_timeout: Duration,
    /// Start a new group at the end of each topic instead of its beginning:
    /// the high watermarks are committed for the group before it joins, so
    /// every record produced after `start` returns is read (a load
    /// generator's reader). Default false.
    pub start_at_end: bool,
    /// Told of partitions assigned and revoked, on the poll thread (the
    /// broker-kept store restores and releases their pending messages).
    pub listener: Option<Arc<dyn PartitionListener>>,
}

impl std::fmt::Debug for KafkaSourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSourceConfig")
            .field("topics", &self.topics)
            .field("group", &self.group)
            .field("capacity", &self.capacity)
            .field("commit_interval", &self.commit_interval)
            .field("revoke_timeout", &self.revoke_timeout)
            .field("start_at_end", &self.start_at_end)
            .field("listener", &self.listener.is_some())
            .finish()
    }
}

impl KafkaSourceConfig {
    pub fn new(topics: Vec<String>, group: impl Into<String>) -> Self {
        Self {
            topics,
            group: group.into(),
            capacity: 1000,
            commit_interval: Duration::from_millis(20),
            revoke_timeout: Duration::from_secs(10),
            start_at_end: false,
            listener: None,
        }
    }
}

/// A record polled but not yet in the channel.
struct Polled {
    tp: TopicPartition,
    offset: i64,
    epoch: u64,
    delivery: Delivery,
}

/// State shared by the poll thread, its rebalance callbacks and the acks.
struct Shared {
    tracker: Mutex<OffsetTracker>,
    /// Signalled when an ack settles (the revoke callback waits on it).
    settled: Condvar,
    backlog: Mutex<VecDeque<Polled>>,
    /// Requeued records: seek back to them.
    rewinds: Mutex<Vec<(TopicPartition, i64, u64)>>,
    /// Partitions are paused (by the core or for lack of room).
    paused: AtomicBool,
    revoke_timeout: Duration,
    listener: Option<Arc<dyn PartitionListener>>,
}

impl Shared {
    fn tracker(&self) -> MutexGuard<'_, OffsetTracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn backlog(&self) -> MutexGuard<'_, VecDeque<Polled>> {
        self.backlog.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct SourceContext {
    shared: Arc<Shared>,
}

impl ClientContext for SourceContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        super::log_to_tracing(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "Kafka consumer error");
    }
}

impl ConsumerContext for SourceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let tps = partitions(tpl);
            tracing::info!(partitions = ?tps, "Kafka partitions revoked; committing");
            self.give_up(consumer, &tps);
            if let Some(listener) = &self.shared.listener {
                listener.revoked(&tps);
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            tracing::info!(partitions = ?partitions(tpl), "Kafka partitions assigned");
            if self.shared.paused.load(Ordering::Acquire) {
                if let Err(e) = consumer.pause(tpl) {
                    tracing::warn!(error = %e, "cannot pause newly assigned partitions");
                }
            }
            // Nothing of these partitions is handed out before this returns.
            if let Some(listener) = &self.shared.listener {
                listener.assigned(&partitions(tpl));
            }
        }
    }
}

impl SourceContext {
    /// Drop the backlog of `tps`, let records being stored finish, commit.
    fn give_up(&self, consumer: &BaseConsumer<Self>, tps: &[TopicPartition]) {
        let shared = &self.shared;
        {
            let mut backlog = shared.backlog();
            let mut tracker = shared.tracker();
            backlog.retain(|p| {
                let keep = !tps.contains(&p.tp);
                if !keep {
                    tracker.abandon(&p.tp, p.offset, p.epoch);
                }
                keep
            });
        }
        let deadline = Instant::now() + shared.revoke_timeout;
        let mut tracker = shared.tracker();
        while tracker.has_outstanding(tps) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "records still being stored when their partitions were revoked; \
                     the new owner will read them again"
                );
                break;
            }
            tracker = shared
                .settled
                .wait_timeout(tracker, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let commits = tracker.final_commits(tps);
        drop(tracker);
        commit_sync(consumer, &shared.tracker, &commits);
        let mut tracker = shared.tracker();
        for tp in tps {
            tracker.revoke(tp);
        }
    }
}

/// Commit each partition's high watermark for the consumer's group.
fn commit_high_watermarks<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topics: &[&str],
) -> KafkaResult<()> {
    let timeout = Duration::from_secs(10);
    let mut tpl = TopicPartitionList::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
        for t in metadata.topics() {
            for p in t.partitions() {
                let (_, high) = consumer.fetch_watermarks(topic, p.id(), timeout)?;
                tpl.add_partition_offset(topic, p.id(), Offset::Offset(high))?;
            }
        }
    }
    if tpl.count() > 0 {
        consumer.commit(&tpl, CommitMode::Sync)?;
    }
    Ok(())
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

fn offsets_list(commits: &[(TopicPartition, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offset) in commits {
        if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(error = %e, topic, partition, "cannot build offset list");
        }
    }
    tpl
}

fn commit_sync<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    tracker: &Mutex<OffsetTracker>,
    commits: &[(TopicPartition, i64)],
) {
    if commits.is_empty() {
        return;
    }
    let result = consumer.commit(&offsets_list(commits), CommitMode::Sync);
    let mut tracker = tracker.lock().unwrap_or_else(|e| e.into_inner());
    match result {
        Ok(()) => {
            for (tp, offset) in commits {
                tracker.committed(tp, *offset);
            }
        }
        Err(e) => tracing::warn!(error = %e, "final Kafka offset commit failed"),
    }
}

enum Command {
    Pause,
    Resume,
}

/// delayd's settings of a source's consumer, under the user's properties.
fn consumer_defaults(consumer_protocol: bool) -> Vec<(&'static str, &'static str)> {
    let mut defaults = vec![
        ("auto.offset.reset", "earliest"),
        // Partitions added to a source topic are noticed (and the group
        // rebalanced) within 10 s, not librdkafka's default 5 minutes. A
        // Metadata request every 10 s is cheap.
        ("topic.metadata.refresh.interval.ms", "10000"),
    ];
    if !consumer_protocol {
        // An instance killed with kill -9 leaves the group only when its
        // session times out: librdkafka's 45 s would hold its partitions,
        // and their due messages, that long. 6 s is the brokers' default
        // minimum (group.min.session.timeout.ms). Under KIP-848's protocol
        // the broker sets both (`group.consumer.session.timeout.ms`), and
        // librdkafka refuses a consumer that sets them.
        defaults.push(("session.timeout.ms", "6000"));
        defaults.push(("heartbeat.interval.ms", "1500"));
    }
    defaults
}

/// A [`Source`] over a consumer group's topics.
pub struct KafkaSource {
    rx: mpsc::Receiver<Delivery>,
    commands: std_mpsc::Sender<Command>,
    stop: Arc<AtomicBool>,
    consuming: Consuming,
    thread: Option<JoinHandle<()>>,
}

impl KafkaSource {
    /// Join the group and start polling. Fails on a bad configuration; an
    /// unreachable broker is retried by librdkafka.
    pub fn start(client: &KafkaClientConfig, config: KafkaSourceConfig) -> KafkaResult<Self> {
        let shared = Arc::new(Shared {
            tracker: Mutex::new(OffsetTracker::default()),
            settled: Condvar::new(),
            backlog: Mutex::new(VecDeque::new()),
            rewinds: Mutex::new(Vec::new()),
            paused: AtomicBool::new(false),
            revoke_timeout: config.revoke_timeout,
            listener: config.listener.clone(),
        });
        let consumer: BaseConsumer<SourceContext> = client
            .client_config(
                Role::Consumer,
                &consumer_defaults(client.consumer_protocol()),
                &[
                    ("group.id", &config.group),
                    ("enable.auto.commit", "false"),
                    ("enable.auto.offset.store", "false"),
                    ("enable.partition.eof", "false"),
                ],
            )
            .create_with_context(SourceContext {
                shared: shared.clone(),
            })
            .map_err(super::without_value)?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        if config.start_at_end {
            commit_high_watermarks(&consumer, &topics)?;
        }
        consumer.subscribe(&topics)?;
        let (tx, rx) = mpsc::channel(config.capacity.max(1));
        let (commands, command_rx) = std_mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let poller = Poller {
            consumer,
            shared,
            tx,
            commands: command_rx,
            stop: stop.clone(),
            commit_interval: config.commit_interval,
            user_paused: false,
            flow_paused: false,
        };
        let thread = std::thread::Builder::new()
            .name(format!("kafka-{}", config.group))
            .spawn(move || poller.run())
            .map_err(|e| KafkaError::Subscription(format!("cannot start poll thread: {e}")))?;
        // Subscribed: records published from now on wait in the topic
        // until the group assigns their partition.
        let consuming = Consuming::default();
        consuming.set(true);
        Ok(Self {
            rx,
            commands,
            stop,
            consuming,
            thread: Some(thread),
        })
    }
}

impl Source for KafkaSource {
    fn next(&mut self) -> BoxFuture<'_, Result<Delivery, SourceError>> {
        Box::pin(async move { self.rx.recv().await.ok_or(SourceError::Closed) })
    }

    fn consuming(&self) -> Consuming {
        self.consuming.clone()
    }

    fn pause(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        let sent = self.commands.send(Command::Pause);
        Box::pin(async move { sent.map_err(|_| SourceError::Closed) })
    }

    fn resume(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        let sent = self.commands.send(Command::Resume);
        Box::pin(async move { sent.map_err(|_| SourceError::Closed) })
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.take();
        Box::pin(async move {
            if let Some(thread) = thread {
                let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            }
        })
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // Without close(): the thread commits and leaves the group on its own.
        self.stop.store(true, Ordering::Release);
    }
}

/// Records polled back to back before the poll loop commits, flushes its
/// backlog and applies commands again.
const POLL_BURST: usize = 500;

/// Records kept in the local backlog (the channel to the core being full)
/// before the partitions are paused; they resume once it is empty.
const PAUSE_BACKLOG: usize = 4 * POLL_BURST;

struct Poller {
    consumer: BaseConsumer<SourceContext>,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Delivery>,
    commands: std_mpsc::Receiver<Command>,
    stop: Arc<AtomicBool>,
    commit_interval: Duration,
    user_paused: bool,
    flow_paused: bool,
}

impl Poller {
    fn run(mut self) {
        let mut last_error: Option<Instant> = None;
        let mut last_commit = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            self.apply_commands();
            self.apply_rewinds();
            self.flush_backlog();
            self.set_paused();
            // A synchronous commit is a broker round trip: at most one per
            // interval, however many records settled meanwhile.
            if last_commit.elapsed() >= self.commit_interval {
                self.commit_settled();
                last_commit = Instant::now();
            }
            // Wait for a record, then take what is ready without waiting,
            // up to a burst, before the housekeeping above runs again.
            let mut wait = self.commit_interval;
            for _ in 0..POLL_BURST {
                match self.consumer.poll(wait) {
                    Some(Ok(record)) => {
                        take(&self.shared, &record);
                        wait = Duration::ZERO;
                    }
                    // Broker down, unknown topic...: librdkafka retries; say
                    // so at most every 10 s.
                    Some(Err(e)) => {
                        if last_error.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                            tracing::warn!(error = %e, "Kafka consumer");
                            last_error = Some(Instant::now());
                        }
                        break;
                    }
                    None => break,
                }
            }
        }
        self.shutdown();
    }

    fn apply_commands(&mut self) {
        while let Ok(command) = self.commands.try_recv() {
            self.user_paused = matches!(command, Command::Pause);
        }
    }

    /// Seek back to requeued records.
    fn apply_rewinds(&mut self) {
        let rewinds = std::mem::take(
            &mut *self
                .shared
                .rewinds
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for (tp, offset, epoch) in rewinds {
            if !self.shared.tracker().is_current(&tp, offset, epoch) {
                continue;
            }
            let (topic, partition) = &tp;
            match self.consumer.seek(
                topic,
                *partition,
                Offset::Offset(offset),
                Duration::from_secs(5),
            ) {
                Ok(()) => {
                    let mut backlog = self.shared.backlog();
                    backlog.retain(|p| !(p.tp == tp && p.offset >= offset));
                    self.shared.tracker().rewind(&tp, offset);
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic, partition, offset, "cannot seek back to a requeued record; retrying");
                    self.shared
                        .rewinds
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((tp, offset, epoch));
                }
            }
        }
    }

    fn flush_backlog(&mut self) {
        let mut backlog = self.shared.backlog();
        while let Some(polled) = backlog.pop_front() {
            match self.tx.try_send(polled.delivery) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(delivery)) => {
                    backlog.push_front(Polled { delivery, ..polled });
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    // The core stopped taking records: this one is read again later.
                    self.stop.store(true, Ordering::Release);
                    self.shared
                        .tracker()
                        .abandon(&polled.tp, polled.offset, polled.epoch);
                    break;
                }
            }
        }
        // Pausing makes librdkafka drop what it prefetched and fetch it
        // again on resume: only worth it when the core falls well behind,
        // not for a momentarily full channel.
        if backlog.len() >= PAUSE_BACKLOG {
            self.flow_paused = true;
        } else if backlog.is_empty() {
            self.flow_paused = false;
        }
    }

    /// Pause the assignment while the core asked so or there is no room.
    fn set_paused(&mut self) {
        let want = self.user_paused || self.flow_paused;
        if want == self.shared.paused.load(Ordering::Acquire) {
            return;
        }
        let assignment = match self.consumer.assignment() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the Kafka assignment");
                return;
            }
        };
        let result = if want {
            self.consumer.pause(&assignment)
        } else {
            self.consumer.resume(&assignment)
        };
        match result {
            Ok(()) => {
                tracing::debug!(
                    paused = want,
                    by_core = self.user_paused,
                    "Kafka partitions paused/resumed"
                );
                self.shared.paused.store(want, Ordering::Release)
            }
            Err(e) => {
                tracing::warn!(error = %e, paused = want, "cannot pause/resume Kafka partitions")
            }
        }
    }

    /// Commit what was settled since the last commit. Synchronous: a broker
    /// round trip every `commit_interval` at most, and no reliance on
    /// commit callbacks.
    fn commit_settled(&mut self) {
        let commits = self.shared.tracker().take_commits();
        if commits.is_empty() {
            return;
        }
        tracing::trace!(?commits, "committing Kafka offsets");
        match self
            .consumer
            .commit(&offsets_list(&commits), CommitMode::Sync)
        {
            Ok(()) => {
                let mut tracker = self.shared.tracker();
                for (tp, offset) in &commits {
                    tracker.committed(tp, *offset);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "Kafka offset commit failed; retrying");
                let mut tracker = self.shared.tracker();
                for (tp, _) in &commits {
                    tracker.commit_failed(tp);
                }
            }
        }
    }

    /// Commit what the core stored, then leave the group (on drop).
    fn shutdown(self) {
        {
            let mut backlog = self.shared.backlog();
            let mut tracker = self.shared.tracker();
            for p in backlog.drain(..) {
                tracker.abandon(&p.tp, p.offset, p.epoch);
            }
        }
        let commits = self.shared.tracker().all_final_commits();
        commit_sync(&self.consumer, &self.shared.tracker, &commits);
        tracing::debug!(?commits, "Kafka source stopped");
    }
}

/// Track a polled record and queue it for the core.
fn take(shared: &Arc<Shared>, record: &rdkafka::message::BorrowedMessage<'_>) {
    let tp = (record.topic().to_owned(), record.partition());
    let offset = record.offset();
    let message = message_from_record(record);
    let epoch = shared.tracker().delivered(&tp, offset);
    let ack = KafkaAck {
        shared: shared.clone(),
        tp: tp.clone(),
        offset,
        epoch,
    };
    let delivery = Delivery {
        message,
        redelivered: true,
        session: 0,
        ack: Box::new(ack),
    };
    shared.backlog().push_back(Polled {
        tp,
        offset,
        epoch,
        delivery,
    });
}

struct KafkaAck {
    shared: Arc<Shared>,
    tp: TopicPartition,
    offset: i64,
    epoch: u64,
}

impl AckHandle for KafkaAck {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        let (tx, rx) = oneshot::channel();
        self.shared
            .tracker()
            .settle(&self.tp, self.offset, self.epoch, tx);
        self.shared.settled.notify_all();
        Box::pin(async move {
            match rx.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(SourceError::Other(e)),
                Err(_) => Err(SourceError::Closed),
            }
        })
    }

    fn requeue(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        self.shared
            .rewinds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((self.tp.clone(), self.offset, self.epoch));
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::BaseConsumer;

    use super::*;

    /// `group.protocol = "consumer"` (KIP-848) in the user's properties
    /// makes a consumer librdkafka accepts: delayd's session and heartbeat
    /// are left out (it refused one with them: "`session.timeout.ms` is not
    /// supported for `group.protocol=consumer`").
    #[test]
    fn a_consumer_of_the_new_group_protocol_is_accepted() {
        let mut client = KafkaClientConfig::new("127.0.0.1:1");
        client
            .consumer
            .insert("group.protocol".into(), "consumer".into());
        assert!(client.consumer_protocol());
        let config = client.client_config(
            Role::Consumer,
            &consumer_defaults(client.consumer_protocol()),
            &[("group.id", "delayd-test")],
        );
        assert_eq!(config.get("session.timeout.ms"), None);
        if let Err(e) = config
            .create::<BaseConsumer>()
            .map_err(crate::kafka::without_value)
        {
            panic!("librdkafka refused the consumer: {e}");
        }

        // The classic protocol keeps delayd's 6 s session.
        let classic = KafkaClientConfig::new("127.0.0.1:1");
        assert!(!classic.consumer_protocol());
        let config = classic.client_config(
            Role::Consumer,
            &consumer_defaults(classic.consumer_protocol()),
            &[("group.id", "delayd-test")],
        );
        assert_eq!(config.get("session.timeout.ms"), Some("6000"));
    }
}
