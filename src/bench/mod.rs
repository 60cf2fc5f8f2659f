//! `delayd bench`: a load generator for delayed delivery.
//!
//! It publishes `--count` messages with `x-delay` spread uniformly over
//! `[--delay-min, --delay-max]` at `--rate` per second and consumes where
//! they should arrive, measuring each message's lateness against the due
//! time it carries. It reports publish and delivery rates, lateness
//! p50/p99/max, and the lost, early and duplicate counts.
//!
//! The run itself is broker-neutral (any [`Sink`] in, any [`Source`] out);
//! [`amqp`] and [`kafka`] only say where to publish and what to consume:
//! an exchange and a queue (delayd's ingress exchange or a plugin
//! `x-delayed-message` exchange alike), or a delay topic and a target topic.

mod amqp;
mod fill;
mod kafka;
pub mod scrape;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use delayd_adapters::{
    BoxFuture, FieldTable, Message, Properties, PublishOutcome, Sink, Source, Target, Value,
};
use hdrhistogram::Histogram;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::engine::{Clock, SystemClock};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// AMQP URL of the broker. Repeat it for a cluster's nodes: the bench
    /// connects to the first that answers and moves on when its node goes.
    #[arg(long = "url", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub urls: Vec<String>,
    /// AMQP: the type of `--queue` when the bench declares it (`--bind-to`):
    /// `quorum` for a cluster whose nodes the run stops.
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    pub queue_type: String,
    /// AMQP: exchange to publish the delayed messages to.
    #[arg(long, required_unless_present_any = ["kafka", "fill"])]
    pub exchange: Option<String>,
    /// AMQP: routing key to publish with.
    #[arg(long, default_value = "bench")]
    pub routing_key: String,
    /// AMQP: spread the publishes over this many routing keys
    /// (`<routing-key>.<n>`), as a partitioned route's producers would.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub routing_keys: u64,
    /// AMQP: queue to consume the delivered messages from.
    #[arg(long, required_unless_present_any = ["kafka", "fill"])]
    pub queue: Option<String>,
    /// AMQP: declare `--queue` and bind it to this exchange with key `#`
    /// first. An exchange that exists is used as it is (a plugin exchange,
    /// say); a missing one is declared as a topic exchange.
    #[arg(long)]
    pub bind_to: Option<String>,
    /// AMQP: `--exchange` delays messages itself (the delayed-message
    /// plugin's `x-delayed-message`). Such an exchange routes a message only
    /// when it falls due, so the broker returns every mandatory publish as
    /// unroutable: a confirmed publish counts as published all the same.
    #[arg(long, conflicts_with = "kafka")]
    pub delaying_exchange: bool,
    /// delayd's `/metrics` (`http://127.0.0.1:9464/metrics`): scraped before
    /// and after the run to report delayd's CPU per message and its RSS.
    #[arg(long, value_name = "URL")]
    pub metrics: Option<String>,
    /// Kafka instead of AMQP: the bootstrap servers (`host:port,...`).
    #[arg(long, conflicts_with_all = ["exchange", "queue", "bind_to"])]
    pub kafka: Option<String>,
    /// Kafka: the delay topic to publish to (a delayd route's `from.topics`).
    #[arg(long, requires = "kafka")]
    pub topic: Option<String>,
    /// Kafka: the topic delivered records arrive on (the route's `to.topic`).
    #[arg(long, requires = "kafka")]
    pub target_topic: Option<String>,
    /// Kafka: create `--topic` and `--target-topic` first, with this many partitions.
    #[arg(long, requires = "kafka")]
    pub create_topics: Option<i32>,
    /// Kafka: an extra librdkafka property for both clients (repeatable).
    #[arg(long = "kafka-property", value_name = "KEY=VALUE", requires = "kafka")]
    pub kafka_properties: Vec<String>,
    /// Messages to publish.
    #[arg(long, default_value_t = 10_000)]
    pub count: u64,
    /// Publish rate, messages per second.
    #[arg(long, default_value_t = 1000)]
    pub rate: u64,
    /// Smallest delay, ms.
    #[arg(long, default_value_t = 1000)]
    pub delay_min: u64,
    /// Largest delay, ms.
    #[arg(long, default_value_t = 5000)]
    pub delay_max: u64,
    /// Body size, bytes.
    #[arg(long, default_value_t = 256)]
    pub body_bytes: usize,
    /// Twins: every N-th sequence number is published twice, back to back,
    /// as the same bytes (a producer sending one event twice on purpose).
    /// Each copy is its own message: both must arrive, under two
    /// `x-delayd-id`s. 0 publishes no twins.
    #[arg(long, default_value_t = 0, conflicts_with = "burst")]
    pub twins: u64,
    /// Publishes awaiting a confirm at once.
    #[arg(long, default_value_t = 256)]
    pub in_flight: usize,
    /// Give up waiting this long after the last message fell due.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Only publish (e.g. to fill delayd with pending messages); no consumer.
    #[arg(long)]
    pub publish_only: bool,
    /// A burst: every message due at the same instant (`x-deliver-at`;
    /// with `--delaying-exchange`, which knows only `x-delay`, the delay
    /// left until that instant), `--delay-min` ms after the last one is
    /// published. The report's
    /// `delivery_rate` is then the release rate, and `out_of_order` counts
    /// arrivals that overtook an earlier-published message (equal due
    /// times leave in arrival order).
    #[arg(long, conflicts_with = "kafka")]
    pub burst: bool,
    /// Fill mode: store this many messages through the engine's own API
    /// into the WAL `--config` names, as an intake would, without a broker
    /// (delayd must be stopped). Delays spread over `--delay-min` ..
    /// `--delay-max` ms, `--body-bytes` each, `--in-flight` stores at once;
    /// `--exchange` and `--routing-key` are recorded as their source.
    #[arg(long, requires = "config", conflicts_with_all = ["kafka", "burst", "publish_only"])]
    pub fill: Option<u64>,
    /// Fill mode: delayd's configuration file (its `wal` and `[engine]`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Fill mode: the route the messages are stored for.
    #[arg(long, default_value = "bench")]
    pub route: String,
    /// Fill mode: then this many more, already due, so that the next start
    /// on the store fires at once (to time restart to first fire).
    #[arg(long, default_value_t = 0)]
    pub overdue: u64,
    /// Write every first copy that arrived at least a second after its due
    /// time to this file, one line each: sequence number, due and arrival
    /// (epoch ms). Where a fault's lateness comes from.
    #[arg(long, value_name = "FILE")]
    pub late_log: Option<std::path::PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Hide the progress bars.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub published: u64,
    pub publish_rate: f64,
    pub received: u64,
    pub delivery_rate: f64,
    /// Confirmed by the broker and never received.
    pub lost: u64,
    /// Publishes the broker did not confirm (not counted as published; they
    /// may still arrive).
    pub publish_failures: u64,
    pub early: u64,
    /// Copies beyond the first (not counting the bench's own redeliveries).
    pub duplicates: u64,
    /// Of those, copies with the first copy's `x-delayd-id` (one message
    /// sent twice: acceptable, a consumer deduplicates them) ...
    pub duplicates_same_id: u64,
    /// ... and copies under another id (one message stored twice: a bug,
    /// a consumer that deduplicates on the id sees two messages).
    pub duplicates_different_id: u64,
    /// The first few of those: sequence number, the first copy's id, the
    /// other copy's id (a minted id's high half names the process).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub different_id_examples: Vec<(u64, String, String)>,
    /// The first few same-id copies: sequence number and id (to look up in
    /// delayd's logs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub same_id_examples: Vec<(u64, String)>,
    /// Copies the broker redelivered to the bench after its ack was lost.
    pub redelivered_to_bench: u64,
    /// `--twins`: sequence numbers published twice as the same bytes.
    pub twins: u64,
    /// Of the twins' confirmed copies, those that never arrived (one twin
    /// taken for the other's redelivery, issue #37). Not in `lost`.
    pub twin_copies_lost: u64,
    /// Twins whose second copy arrived under the first one's id: delayd
    /// kept it so when its sibling's ack was in doubt (or it was lost
    /// beside a same-id copy of its sibling: from outside the two look
    /// alike; delayd counts the first in `delayd_redeliveries_in_doubt_total`).
    /// Counted among the same-id duplicates too.
    pub twins_under_one_id: u64,
    /// The first few twins that lost a copy: sequence number (its
    /// `message_id` is `bench-<seq>` in delayd's debug logs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub twin_lost_examples: Vec<u64>,
    /// `--burst`: first copies that arrived after a later-published one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_of_order: Option<u64>,
    pub lateness_p50_ms: u64,
    pub lateness_p99_ms: u64,
    pub lateness_max_ms: u64,
    /// Lateness counted from the broker's `timestamp_in_ms` stamp plus
    /// `x-delay` (what delayd counts from), when deliveries carry both:
    /// the broker's own wait before it took a publish in is not in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lateness_by_stamp_p99_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lateness_by_stamp_max_ms: Option<u64>,
    /// First copies that arrived before their due time by the stamp.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_by_stamp: Option<u64>,
    /// With `--metrics`: delayd's CPU time over the run per message received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delayd_cpu_us_per_message: Option<f64>,
    /// With `--metrics`: delayd's resident memory at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delayd_resident_bytes: Option<f64>,
    /// The bench's own CPU time over the run per message received: the
    /// same client's cost to publish with confirms and to consume.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bench_cpu_us_per_message: Option<f64>,
}

const RUN: &str = "x-bench-run";
const SEQ: &str = "x-bench-seq";
const DUE: &str = "x-bench-due";
const DELAYD_ID: &str = crate::route::rewrite::X_DELAYD_ID;

struct Tally {
    seen: Vec<u64>, // bitset of sequence numbers
    /// The `x-delayd-id` each sequence number first arrived with.
    first_ids: Vec<Option<Box<str>>>,
    /// `--twins`: every this many sequence numbers one is a twin (0: none).
    twin_every: u64,
    /// A twin's second id, once a copy arrived under another id than its
    /// first.
    second_ids: std::collections::HashMap<u64, Box<str>>,
    /// Twins whose first id arrived again.
    first_id_again: std::collections::HashSet<u64>,
    /// Highest sequence number received so far, and first copies that
    /// arrived after a higher one.
    highest_seq: Option<u64>,
    out_of_order: u64,
    received: u64,
    duplicates: u64,
    duplicates_different_id: u64,
    different_id_examples: Vec<(u64, String, String)>,
    same_id_examples: Vec<(u64, String)>,
    /// Seen again, flagged redelivered by the broker: the bench's ack was
    /// lost, not a duplicate from delayd.
    redelivered_to_bench: u64,
    early: u64,
    lateness: Histogram<u64>,
    lateness_by_stamp: Histogram<u64>,
    early_by_stamp: u64,
    /// First copies a second or more late: (seq, due, arrived, due by the
    /// broker's stamp), epoch ms.
    late: Vec<(u64, i64, u64, Option<i64>)>,
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Tally {
    /// For sequence numbers `0..count`, every `twin_every`th published twice.
    fn new(count: u64, twin_every: u64) -> anyhow::Result<Self> {
        Ok(Tally {
            seen: vec![0; count.div_ceil(64) as usize],
            first_ids: vec![None; count as usize],
            twin_every,
            second_ids: std::collections::HashMap::new(),
            first_id_again: std::collections::HashSet::new(),
            highest_seq: None,
            out_of_order: 0,
            received: 0,
            duplicates: 0,
            duplicates_different_id: 0,
            different_id_examples: Vec::new(),
            same_id_examples: Vec::new(),
            redelivered_to_bench: 0,
            early: 0,
            lateness: Histogram::new(3)?,
            lateness_by_stamp: Histogram::new(3)?,
            early_by_stamp: 0,
            late: Vec::new(),
            first: None,
            last: None,
        })
    }

    fn is_twin(&self, seq: u64) -> bool {
        is_twin(seq, self.twin_every)
    }

    /// One copy of sequence number `seq` arrived (`now` and `due` in epoch
    /// ms) with `x-delayd-id` `id`, `redelivered` if the broker flagged it
    /// (the bench's own ack was lost). True if it is a copy not counted
    /// before: a first arrival, or a twin's other copy.
    fn receive(
        &mut self,
        seq: i64,
        id: Option<Box<str>>,
        redelivered: bool,
        now: u64,
        due: Due,
    ) -> bool {
        let t = self;
        let (word, bit) = ((seq as u64 / 64) as usize, seq as u64 % 64);
        if word >= t.seen.len() || t.seen[word] & (1 << bit) != 0 {
            let first = t.first_ids.get(seq as usize).cloned().flatten();
            let seq = seq as u64;
            // A twin's copy under an id of its own is its other copy even
            // when flagged redelivered: the bench never saw that id (it may
            // have been on its way when the broker restarted). Under the
            // first id it may be the first copy again: not counted.
            let other_twin = t.is_twin(seq) && first != id && !t.second_ids.contains_key(&seq);
            if redelivered && !other_twin {
                t.redelivered_to_bench += 1;
                return false;
            }
            // The publisher sends each sequence number once, as one
            // broker message (it never publishes again after a lost
            // confirm), so every further copy is delayd's. Its broker
            // stamp cannot tell: the broker stamps delayd's publish
            // to the target anew.
            if other_twin {
                // The other twin, under an id of its own.
                if let Some(id) = id {
                    t.second_ids.insert(seq, id);
                }
                t.arrived(seq, now, due);
                return true;
            }
            if t.is_twin(seq) && id.is_some() && t.second_ids.get(&seq) == id.as_ref() {
                t.duplicates += 1;
                return false;
            }
            if t.is_twin(seq) && first == id {
                t.first_id_again.insert(seq);
            }
            t.duplicates += 1;
            if first != id {
                t.duplicates_different_id += 1;
                if t.different_id_examples.len() < 20 {
                    let text = |id: Option<Box<str>>| id.map(String::from).unwrap_or_default();
                    t.different_id_examples.push((seq, text(first), text(id)));
                }
            } else if t.same_id_examples.len() < 20 {
                t.same_id_examples
                    .push((seq, id.map(String::from).unwrap_or_default()));
            }
            return false;
        }
        t.seen[word] |= 1 << bit;
        if t.highest_seq.is_some_and(|h| h > seq as u64) {
            t.out_of_order += 1;
        }
        t.highest_seq = t.highest_seq.max(Some(seq as u64));
        if let Some(first) = t.first_ids.get_mut(seq as usize) {
            *first = id;
        }
        t.arrived(seq as u64, now, due);
        true
    }

    /// A copy of message `seq` not received before (`now` in epoch ms).
    fn arrived(&mut self, seq: u64, now: u64, due: Due) {
        let Due { due, by_stamp } = due;
        if let Some(by_stamp) = by_stamp {
            match (now as i64).checked_sub(by_stamp) {
                Some(late) if late >= 0 => {
                    let _ = self.lateness_by_stamp.record(late as u64);
                }
                _ => self.early_by_stamp += 1,
            }
        }
        self.received += 1;
        let at = Instant::now();
        self.first.get_or_insert(at);
        self.last = Some(at);
        if (now as i64) < due {
            self.early += 1;
        } else {
            let late = (now as i64 - due) as u64;
            let _ = self.lateness.record(late);
            if late >= 1000 {
                self.late.push((seq, due, now, by_stamp));
            }
        }
    }
}

/// When a message is due (epoch ms): by the bench's clock when it sent it,
/// and by the broker's `timestamp_in_ms` stamp plus its `x-delay`, which
/// delayd counts from (`delay_from = "broker"`). The two differ by how long
/// the broker took to take the publish in.
#[derive(Clone, Copy, Debug, Default)]
struct Due {
    due: i64,
    by_stamp: Option<i64>,
}

impl Due {
    fn of(headers: &FieldTable) -> Option<Self> {
        let due = number(headers.get(DUE))?;
        let stamp = number(headers.get(crate::route::clock::TIMESTAMP_IN_MS));
        // delayd delivers `x-delay` negated, as the plugin does.
        let delay = number(headers.get("x-delay")).map(i64::abs);
        let by_stamp = stamp.zip(delay).map(|(at, after)| at + after);
        Some(Self { due, by_stamp })
    }
}

/// `--twins N`: sequence numbers 0, N, 2N, ... are published twice.
fn is_twin(seq: u64, every: u64) -> bool {
    every > 0 && seq.is_multiple_of(every)
}

/// How many of `count` sequence numbers are twins.
fn twin_count(count: u64, every: u64) -> u64 {
    if every == 0 {
        0
    } else {
        count.div_ceil(every)
    }
}

/// Where one run publishes and what it consumes, whatever the broker.
struct Endpoints {
    sink: Arc<dyn Sink>,
    target: Target,
    source: Box<dyn Source>,
    /// Leave the broker cleanly once the run is over.
    close: BoxFuture<'static, ()>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.delay_max >= args.delay_min,
        "--delay-max must be >= --delay-min"
    );
    if let Some(count) = args.fill {
        let report = fill::run(&args, count).await?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("{report:#?}");
        }
        return Ok(());
    }
    anyhow::ensure!(
        args.rate > 0 && args.count > 0,
        "--rate and --count must be positive"
    );
    let own_cpu_before = scrape::own_cpu_seconds();
    let scraper = args
        .metrics
        .as_deref()
        .map(scrape::Scraper::new)
        .transpose()?;
    let before = match &scraper {
        Some(s) => Some(s.sample().await?),
        None => None,
    };
    let run_id = format!("{}-{}", std::process::id(), SystemClock.now_ms());
    // Consumer first, so nothing delivered early is missed.
    let Endpoints {
        sink,
        target,
        mut source,
        close,
    } = match &args.kafka {
        Some(bootstrap) => kafka::endpoints(&args, bootstrap, &run_id).await?,
        None => amqp::endpoints(&args).await?,
    };
    let tally = Arc::new(Mutex::new(Tally::new(args.count, args.twins)?));

    let bars = MultiProgress::new();
    if args.quiet || args.json {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>9} {bar:40} {pos}/{len} {per_sec}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    let publishes = args.count + twin_count(args.count, args.twins);
    let pub_bar = bars.add(
        ProgressBar::new(publishes)
            .with_style(style.clone())
            .with_prefix("published"),
    );
    let recv_bar = bars.add(
        ProgressBar::new(publishes)
            .with_style(style)
            .with_prefix("received"),
    );

    let consumer = {
        let tally = tally.clone();
        let run_id = run_id.clone();
        let recv_bar = recv_bar.clone();
        let count = args.count + twin_count(args.count, args.twins);
        // AMQP flags a broker redelivery (the bench's own ack was lost), which
        // is not a second copy published by delayd. Kafka flags every record.
        let amqp = args.kafka.is_none();
        tokio::spawn(async move {
            loop {
                let Ok(d) = source.next().await else { break };
                let redelivered = amqp && d.redelivered;
                let h = &d.message.headers;
                let ours = h.get(RUN).and_then(|v| v.as_text()) == Some(run_id.as_str());
                // Settled in the background: a Kafka ack resolves only once
                // its offset is committed, which must not pace the consumer.
                tokio::spawn(d.ack.ack());
                if !ours {
                    continue;
                }
                let now = SystemClock.now_ms();
                let (Some(seq), Some(due)) = (number(h.get(SEQ)), Due::of(h)) else {
                    continue;
                };
                let id = h
                    .get(DELAYD_ID)
                    .and_then(|v| v.as_text())
                    .map(Box::<str>::from);
                let mut t = tally.lock().expect("tally");
                if t.receive(seq, id, redelivered, now, due) {
                    recv_bar.inc(1);
                    if t.received == count {
                        break;
                    }
                }
            }
        })
    };

    // Publisher: paced, many confirms in flight.
    let failures = Arc::new(AtomicU64::new(0));
    // Which sequence numbers the broker confirmed: only those can be lost.
    // A publish that failed may still have landed (its confirm was lost in
    // a broker restart); it counts as received if it arrives, never as lost.
    let bitset = || -> Arc<Vec<AtomicU64>> {
        Arc::new(
            (0..args.count.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        )
    };
    let confirmed = bitset();
    // A twin's second publish.
    let confirmed_twin = bitset();
    // A twin takes two permits at once.
    let in_flight = args.in_flight.max(if args.twins > 0 { 2 } else { 1 });
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let started = Instant::now();
    let spread = args.delay_max - args.delay_min;
    let mut last_due = 0u64;
    let burst_at = args
        .burst
        .then(|| SystemClock.now_ms() + args.count * 1000 / args.rate + args.delay_min);
    for seq in 0..args.count {
        let at = started + Duration::from_secs_f64(seq as f64 / args.rate as f64);
        tokio::time::sleep_until(at.into()).await;
        let permit = permits.clone().acquire_owned().await?;
        let twin_permit = match is_twin(seq, args.twins) {
            true => Some(permits.clone().acquire_owned().await?),
            false => None,
        };
        // Spread delays evenly but interleaved (a cheap deterministic shuffle).
        let delay = args.delay_min
            + if spread == 0 {
                0
            } else {
                (seq.wrapping_mul(2_654_435_761)) % (spread + 1)
            };
        // The clock starts when the publish is queued in the client, which
        // `Sink::publish` does before it returns: time the bench spends
        // before that (waiting for a permit, a task to be scheduled) is the
        // bench's, not the lateness of what it measures.
        let (due, when) = match burst_at {
            Some(at) => (
                at,
                burst_timing(at, SystemClock.now_ms(), args.delaying_exchange),
            ),
            None => (SystemClock.now_ms() + delay, When::After(delay)),
        };
        last_due = last_due.max(due);
        let message = bench_message(&run_id, seq, when, due, args.body_bytes);
        let target = if args.routing_keys > 1 {
            Target {
                destination: target.destination.clone(),
                routing_key: Some(format!("{}.{}", args.routing_key, seq % args.routing_keys)),
            }
        } else {
            target.clone()
        };
        // A twin's two publishes go out back to back, with no confirm
        // awaited between them (so a broker's millisecond stamp is equal too).
        let twin = twin_permit.map(|p| (sink.publish(message.clone(), target.clone()), p));
        let publish = sink.publish(message, target);
        for (publish, confirmed) in [
            (Some((publish, permit)), confirmed.clone()),
            (twin, confirmed_twin.clone()),
        ] {
            let Some((publish, permit)) = publish else {
                continue;
            };
            let (failures, bar) = (failures.clone(), pub_bar.clone());
            let delaying_exchange = args.delaying_exchange;
            tokio::spawn(async move {
                let published = match publish.await {
                    Ok(PublishOutcome::Delivered) => true,
                    Ok(PublishOutcome::Unroutable) => delaying_exchange,
                    Err(_) => false,
                };
                if published {
                    confirmed[(seq / 64) as usize].fetch_or(1 << (seq % 64), Ordering::Relaxed);
                    bar.inc(1);
                } else {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                drop(permit);
            });
        }
    }
    let _ = permits.acquire_many(in_flight as u32).await?;
    let publish_secs = started.elapsed().as_secs_f64();
    pub_bar.finish();

    if args.publish_only {
        consumer.abort();
        let published = publishes - failures.load(Ordering::Relaxed);
        println!(
            "published {published} ({:.0} msg/s)",
            published as f64 / publish_secs.max(1e-9)
        );
        close.await;
        return Ok(());
    }
    // Wait for every message, or at least every confirmed one (an
    // unconfirmed publish may never arrive), until the drain timeout.
    let wait_until = last_due + args.drain_timeout.as_millis() as u64;
    let all_confirmed_seen = || {
        let t = tally.lock().expect("tally");
        let twins_seen = (0..args.count)
            .step_by(args.twins.max(1) as usize)
            .filter(|_| args.twins > 0)
            .all(|seq| {
                !bit(&confirmed_twin, seq)
                    || t.second_ids.contains_key(&seq)
                    || t.first_id_again.contains(&seq)
            });
        twins_seen
            && confirmed
                .iter()
                .zip(&t.seen)
                .all(|(c, seen)| c.load(Ordering::Relaxed) & !seen == 0)
    };
    let mut consumer = consumer;
    loop {
        let now = SystemClock.now_ms();
        if now >= wait_until || (now >= last_due && all_confirmed_seen()) {
            consumer.abort();
            break;
        }
        let tick = Duration::from_millis((wait_until - now).min(200));
        if tokio::time::timeout(tick, &mut consumer).await.is_ok() {
            break;
        }
    }
    recv_bar.finish();

    let published = publishes - failures.load(Ordering::Relaxed);
    let mut report = summarise(
        &tally.lock().expect("tally"),
        &confirmed,
        &confirmed_twin,
        published,
        failures.load(Ordering::Relaxed),
        publish_secs,
    );
    if args.burst {
        report.out_of_order = Some(tally.lock().expect("tally").out_of_order);
    }
    if let (Some(scraper), Some(before)) = (scraper, before) {
        let after = scraper.sample().await?;
        report.delayd_cpu_us_per_message =
            scrape::cpu_us_per_message(before, after, report.received);
        report.delayd_resident_bytes = Some(after.resident_bytes);
    }
    if let (Some(before), Some(after)) = (own_cpu_before, scrape::own_cpu_seconds()) {
        report.bench_cpu_us_per_message = scrape::us_per_message(after - before, report.received);
    }
    if let Some(path) = &args.late_log {
        let t = tally.lock().expect("tally");
        let lines: String = t
            .late
            .iter()
            .map(|(seq, due, at, by_stamp)| {
                let by_stamp = by_stamp.map_or("-".to_string(), |ms| ms.to_string());
                format!("{seq} {due} {at} {by_stamp}\n")
            })
            .collect();
        std::fs::write(path, lines)
            .map_err(|e| anyhow::anyhow!("cannot write --late-log {}: {e}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "published {} ({:.0} msg/s; {} not confirmed), received {} ({:.0} msg/s)\nlateness p50 {} ms, p99 {} ms, max {} ms\nlost {}, early {}, duplicates {} ({} same id, {} different id)",
            report.published,
            report.publish_rate,
            report.publish_failures,
            report.received,
            report.delivery_rate,
            report.lateness_p50_ms,
            report.lateness_p99_ms,
            report.lateness_max_ms,
            report.lost,
            report.early,
            report.duplicates,
            report.duplicates_same_id,
            report.duplicates_different_id
        );
        if let Some(rss) = report.delayd_resident_bytes {
            match report.delayd_cpu_us_per_message {
                Some(cpu) => println!(
                    "delayd: {cpu:.1} us CPU per message, {:.1} MB resident",
                    rss / 1e6
                ),
                None => println!(
                    "delayd: {:.1} MB resident (CPU per message needs a run of at least {} s of CPU)",
                    rss / 1e6,
                    scrape::MIN_CPU_SECONDS
                ),
            }
        }
        if let Some(own) = report.bench_cpu_us_per_message {
            match report.delayd_cpu_us_per_message {
                Some(cpu) => println!(
                    "bench: {own:.1} us CPU per message (delayd/bench {:.2})",
                    cpu / own.max(1e-9)
                ),
                None => println!("bench: {own:.1} us CPU per message"),
            }
        }
    }
    close.await;
    anyhow::ensure!(
        report.published > 0,
        "the broker confirmed none of {} publishes as routed; an exchange that \
         delays by itself (the plugin's x-delayed-message) returns every one: \
         pass --delaying-exchange",
        args.count
    );
    anyhow::ensure!(
        report.lost == 0 && report.early == 0,
        "{} lost, {} early",
        report.lost,
        report.early
    );
    Ok(())
}

/// A header the bench wrote as an integer: AMQP keeps the type, Kafka
/// carries it as decimal text.
fn number(value: Option<&Value>) -> Option<i64> {
    match value? {
        Value::I64(n) => Some(*n),
        Value::U64(n) => i64::try_from(*n).ok(),
        Value::I32(n) => Some(i64::from(*n)),
        Value::U32(n) => Some(i64::from(*n)),
        other => other.as_text()?.parse().ok(),
    }
}

/// Whether bit `n` of a bitset of sequence numbers is set.
fn bit(set: &[AtomicU64], n: u64) -> bool {
    set[(n / 64) as usize].load(Ordering::Relaxed) & (1 << (n % 64)) != 0
}

fn summarise(
    t: &Tally,
    confirmed: &[AtomicU64],
    confirmed_twin: &[AtomicU64],
    published: u64,
    failures: u64,
    publish_secs: f64,
) -> BenchReport {
    let mut lost = 0;
    let (mut twins, mut twin_copies_lost, mut twins_under_one_id) = (0, 0, 0);
    let mut twin_lost_examples = Vec::new();
    for seq in 0..t.first_ids.len() as u64 {
        let seen = t.seen[(seq / 64) as usize] & (1 << (seq % 64)) != 0;
        if t.is_twin(seq) {
            twins += 1;
            // Each confirmed copy must arrive: under an id of its own, or
            // under its sibling's (see `twins_under_one_id`).
            let copies = u64::from(bit(confirmed, seq)) + u64::from(bit(confirmed_twin, seq));
            let under_one_id = !t.second_ids.contains_key(&seq) && t.first_id_again.contains(&seq);
            twins_under_one_id += u64::from(under_one_id);
            let ids = u64::from(seen) + u64::from(t.second_ids.contains_key(&seq) || under_one_id);
            twin_copies_lost += copies.saturating_sub(ids);
            if copies > ids && twin_lost_examples.len() < 20 {
                twin_lost_examples.push(seq);
            }
        } else if bit(confirmed, seq) && !seen {
            lost += 1;
        }
    }
    let span = match (t.first, t.last) {
        (Some(a), Some(b)) if b > a => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    BenchReport {
        published,
        publish_rate: published as f64 / publish_secs.max(1e-9),
        received: t.received,
        delivery_rate: if span > 0.0 {
            t.received as f64 / span
        } else {
            0.0
        },
        lost,
        publish_failures: failures,
        early: t.early,
        duplicates: t.duplicates,
        duplicates_same_id: t.duplicates - t.duplicates_different_id,
        duplicates_different_id: t.duplicates_different_id,
        different_id_examples: t.different_id_examples.clone(),
        same_id_examples: t.same_id_examples.clone(),
        redelivered_to_bench: t.redelivered_to_bench,
        twins,
        twin_copies_lost,
        twins_under_one_id,
        twin_lost_examples,
        out_of_order: None,
        lateness_p50_ms: t.lateness.value_at_quantile(0.5),
        lateness_p99_ms: t.lateness.value_at_quantile(0.99),
        lateness_max_ms: t.lateness.max(),
        lateness_by_stamp_p99_ms: (!t.lateness_by_stamp.is_empty())
            .then(|| t.lateness_by_stamp.value_at_quantile(0.99)),
        lateness_by_stamp_max_ms: (!t.lateness_by_stamp.is_empty())
            .then(|| t.lateness_by_stamp.max()),
        early_by_stamp: (!t.lateness_by_stamp.is_empty() || t.early_by_stamp > 0)
            .then_some(t.early_by_stamp),
        delayd_cpu_us_per_message: None,
        delayd_resident_bytes: None,
        bench_cpu_us_per_message: None,
    }
}

/// A burst message's due instant `at`, as sent at `now`: `x-deliver-at`,
/// or for an exchange that delays by itself (the plugin, which reads only
/// `x-delay` and counts it from when it receives the message) the delay
/// left until `at`.
fn burst_timing(at: u64, now: u64, delaying_exchange: bool) -> When {
    match delaying_exchange {
        true => When::After(at.saturating_sub(now)),
        false => When::At(at),
    }
}

/// How a bench message says when it is due.
#[derive(Debug, PartialEq)]
enum When {
    /// `x-delay`, ms.
    After(u64),
    /// `x-deliver-at`, epoch ms.
    At(u64),
}

fn bench_message(run_id: &str, seq: u64, when: When, due: u64, body_bytes: usize) -> Message {
    let timing = match when {
        When::After(ms) => ("x-delay".into(), Value::I64(ms as i64)),
        When::At(epoch_ms) => ("x-deliver-at".into(), Value::I64(epoch_ms as i64)),
    };
    Message {
        body: vec![b'x'; body_bytes],
        headers: FieldTable(vec![
            timing,
            (RUN.into(), Value::LongString(run_id.as_bytes().to_vec())),
            (SEQ.into(), Value::I64(seq as i64)),
            (DUE.into(), Value::I64(due as i64)),
        ]),
        properties: Properties {
            delivery_mode: Some(2),
            // Names the message in delayd's debug logs.
            message_id: Some(format!("bench-{seq}")),
            ..Properties::default()
        },
        ..Message::default()
    }
}

#[cfg(test)]
mod timing_tests {
    use super::*;

    #[test]
    fn a_burst_to_a_delaying_exchange_counts_its_delay_to_the_instant() {
        assert_eq!(burst_timing(10_000, 4_000, true), When::After(6_000));
        // Sent after the instant: due at once, never a wrapped delay.
        assert_eq!(burst_timing(10_000, 12_000, true), When::After(0));
        assert_eq!(burst_timing(10_000, 4_000, false), When::At(10_000));
    }

    #[test]
    fn a_delivered_message_is_due_by_its_stamp_plus_its_negated_delay() {
        let mut delivered = bench_message("r", 7, When::After(5_000), 1_005_000, 0);
        crate::route::rewrite::for_delivery(&mut delivered, crate::id::MessageId::from_u128(1));
        let due = Due::of(&delivered.headers).expect("due");
        assert_eq!((due.due, due.by_stamp), (1_005_000, None), "no stamp");
        // The broker took it in 2.5 s after the bench sent it.
        delivered
            .headers
            .insert(crate::route::clock::TIMESTAMP_IN_MS, Value::I64(1_002_500));
        let due = Due::of(&delivered.headers).expect("due");
        assert_eq!((due.due, due.by_stamp), (1_005_000, Some(1_007_500)));
    }
}

#[cfg(test)]
mod tally_tests {
    use super::*;

    fn id(s: &str) -> Option<Box<str>> {
        Some(s.into())
    }

    /// The broker restarted while the twin's second copy, under an id of
    /// its own, was on its way to the bench: it comes flagged redelivered,
    /// yet the bench never saw it. Skipped as the bench's own redelivery,
    /// the twin looked lost (CI, 2026-11-28: 1 of 480 in `broker`).
    #[test]
    fn a_twin_s_other_copy_counts_even_when_flagged_redelivered() {
        let mut t = Tally::new(10, 1).unwrap();
        assert!(t.receive(3, id("a"), false, 10, Due::default()));
        assert!(
            t.receive(3, id("b"), true, 11, Due::default()),
            "the other twin"
        );
        assert_eq!(t.second_ids.get(&3).map(|s| &**s), Some("b"));
        assert!(
            !t.receive(3, id("b"), true, 12, Due::default()),
            "now the bench's own redelivery"
        );
        assert!(!t.receive(3, id("a"), true, 13, Due::default()));
        assert_eq!(
            (t.received, t.duplicates, t.redelivered_to_bench),
            (2, 0, 2)
        );
    }

    /// Under the first copy's id a redelivered copy may be that copy again:
    /// not counted, so a lost twin is never hidden.
    #[test]
    fn a_redelivery_under_the_first_id_is_not_a_second_copy() {
        let mut t = Tally::new(10, 1).unwrap();
        assert!(t.receive(4, id("a"), false, 10, Due::default()));
        assert!(!t.receive(4, id("a"), true, 11, Due::default()));
        assert!(t.first_id_again.is_empty());
        assert_eq!(
            (t.received, t.duplicates, t.redelivered_to_bench),
            (1, 0, 1)
        );
        // Not a twin: a copy under another id is delayd's duplicate.
        let mut t = Tally::new(10, 0).unwrap();
        assert!(t.receive(5, id("a"), false, 10, Due::default()));
        assert!(!t.receive(5, id("b"), false, 11, Due::default()));
        assert!(!t.receive(5, id("b"), true, 12, Due::default()));
        assert_eq!(
            (
                t.duplicates,
                t.duplicates_different_id,
                t.redelivered_to_bench
            ),
            (1, 1, 1)
        );
    }
}
