//! The broker-kept store (`store.kind = "broker"`) against a real Apache
//! Kafka: pending messages live in a compacted state topic, so losing an
//! instance together with its disk loses nothing. Instances are killed with
//! their WAL directory deleted, stopped while holding messages, or all
//! restarted from empty disks; every message still arrives, none early,
//! duplicates counted.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::kafka::{
    self, assert_none_early, collect_counting, wait_assigned, KafkaRoute, Producer, Reader, Record,
};
use common::{now_ms, Delayd};

/// Lateness allowed when instances leave cleanly: a rebalance and a
/// restore, far from a session timeout's, with room for this noisy machine.
const ON_TIME_MS: i64 = 15_000;

/// One Kafka → Kafka route whose state is kept in the broker.
struct StoreRoute {
    kafka: KafkaRoute,
    /// State topics of this test start with this.
    prefix: String,
}

impl StoreRoute {
    async fn new(test: &str, partitions: i32) -> StoreRoute {
        StoreRoute {
            kafka: KafkaRoute::new(test, partitions).await,
            prefix: format!("delayd-it.state.{}.", common::unique_suffix()),
        }
    }

    fn state_topic(&self) -> String {
        format!("{}{}", self.prefix, self.kafka.route)
    }

    async fn start(&self) -> Delayd {
        let store = format!(
            "[store]\nkind = \"broker\"\ntopic_prefix = {}\n",
            common::toml_string(&self.prefix)
        );
        self.kafka.start_with_sections(&store, "").await
    }

    /// Sends `total` records (value = index) with delays drawn in
    /// `delays_ms`; returns (send time, delay) per record.
    async fn send(&self, total: u32, delays_ms: std::ops::Range<u64>) -> Vec<(u64, u64)> {
        let producer = Producer::new();
        let span = delays_ms.end - delays_ms.start;
        let mut sent = Vec::with_capacity(total as usize);
        for i in 0..total {
            // Spread over the range, in an order unrelated to the index.
            let delay = delays_ms.start + (u64::from(i) * 7919) % span;
            let record = Record::new(&format!("k{}", i % 97), format!("{i}").as_bytes())
                .header("x-delay", Some(delay.to_string().as_bytes()));
            sent.push((now_ms(), delay));
            producer.send(&self.kafka.from, &record).await;
        }
        sent
    }
}

/// Waits until the instances together have stored `total` messages.
async fn wait_scheduled(instances: &[&Delayd], total: u32) {
    common::wait_for("every record stored", Duration::from_secs(60), || async {
        let stored: f64 = instances
            .iter()
            .map(|d| d.metric("delayd_scheduled_total"))
            .sum();
        (stored >= f64::from(total)).then_some(())
    })
    .await;
}

/// Session timeout of the test consumers (`common::kafka`): a killed
/// instance's partitions move once it has passed.
const SESSION_TIMEOUT_MS: u64 = 6_000;

/// Prints lateness percentiles and returns the worst. A message's lateness
/// is its fire time less its due time, or less `since_ms` if that is later
/// (when the disruption that held it ended; 0 if none did).
fn lateness(got: &HashMap<u32, Record>, sent: &[(u64, u64)], since_ms: u64) -> i64 {
    let mut late: Vec<i64> = sent
        .iter()
        .enumerate()
        .map(|(i, &(at, delay))| {
            let fired = got[&(i as u32)].timestamp_ms.expect("a timestamp");
            fired - (at + delay).max(since_ms) as i64
        })
        .collect();
    late.sort_unstable();
    let at = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
    eprintln!(
        "lateness ms: p50 {} p99 {} max {}",
        at(0.5),
        at(0.99),
        at(1.0)
    );
    at(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_with_its_disk_loses_nothing() {
    let r = StoreRoute::new("store-kill", 4).await;
    let mut a = r.start().await;
    wait_assigned(&a).await;
    let b = r.start().await;
    // Both hold partitions: the group has split the topic between them.
    wait_assigned(&b).await;
    let total = 2000;
    let sent = r.send(total, 5000..20_000).await;
    wait_scheduled(&[&a, &b], total).await;
    let held = a.pending();
    assert!(held > 0, "the instance to kill holds no message");
    let wal = a.wal_dir();
    a.kill_9();
    let killed_ms = now_ms();
    std::fs::remove_dir_all(&wal).expect("delete the killed instance's WAL");
    eprintln!("killed an instance holding {held} messages and deleted its WAL");
    // The other instance takes its partitions once its session expires
    // and restores their pending messages from the state topic.
    let (got, duplicates) =
        collect_counting(&Reader::new(&r.kafka.to), total, Duration::from_secs(120));
    assert_none_early(&got, &sent);
    // Late by at most a rebalance and a restore after the session expired.
    let worst = lateness(&got, &sent, killed_ms + SESSION_TIMEOUT_MS);
    assert!(worst <= ON_TIME_MS, "a message fired {worst} ms late");
    eprintln!("duplicates: {duplicates}");
    assert!(
        b.metric("delayd_store_restored_total") >= held as f64,
        "the survivor restored fewer messages than the killed instance held ({held})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_restarted_without_its_wal_delivers_everything() {
    let r = StoreRoute::new("store-restart", 3).await;
    let mut a = r.start().await;
    wait_assigned(&a).await;
    let ready = a.readyz();
    assert_eq!(ready["store"]["kind"], "broker", "{ready}");
    assert_eq!(
        ready["store"]["routes"][&r.kafka.route]["state_topic"],
        r.state_topic().as_str(),
        "{ready}"
    );
    let total = 600;
    // Due 10 s on at the earliest: none may fire before the state topic is
    // inspected (with 4 s, one did once under the whole test command).
    let sent = r.send(total, 10_000..18_000).await;
    wait_scheduled(&[&a], total).await;
    let held = a.pending();
    assert_eq!(
        held,
        u64::from(total),
        "every message pending before the kill"
    );
    // The state topic holds each of them, as `delayd store inspect` reads it.
    let config = a.config_path().to_str().expect("UTF-8 path").to_owned();
    let (ok, out, err) = common::delayd_cli("store", &["inspect", "--config", &config, "--json"]);
    assert!(ok, "store inspect failed: {err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    // Anything that fired meanwhile may have its state record tombstoned.
    let fired = a.metric("delayd_fired_total") as u64;
    let inspected = report[&r.kafka.route]["pending"].as_u64().expect("pending");
    assert!(
        inspected <= u64::from(total) && inspected + fired >= u64::from(total),
        "{inspected} pending in the state topic of {total} ({fired} fired meanwhile): {report}"
    );
    let wal = a.wal_dir();
    a.kill_9();
    std::fs::remove_dir_all(&wal).expect("delete the WAL");
    // The same instance comes back with an empty disk: everything pending
    // is read back from the state topic.
    a.restart().await;
    let restarted_ms = now_ms();
    let (got, duplicates) =
        collect_counting(&Reader::new(&r.kafka.to), total, Duration::from_secs(90));
    assert_none_early(&got, &sent);
    // Late by at most a rebalance and a restore after the restart.
    let worst = lateness(&got, &sent, restarted_ms);
    assert!(worst <= ON_TIME_MS, "a message fired {worst} ms late");
    eprintln!("duplicates: {duplicates}");
    assert!(
        a.metric("delayd_store_restored_total") >= held as f64,
        "restored fewer than the {held} pending"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_down_hands_pending_messages_to_the_instance_left() {
    let r = StoreRoute::new("store-scale", 6).await;
    let a = r.start().await;
    wait_assigned(&a).await;
    let mut b = r.start().await;
    let mut c = r.start().await;
    wait_assigned(&b).await;
    wait_assigned(&c).await;
    let total = 1500;
    let sent = r.send(total, 4000..10_000).await;
    wait_scheduled(&[&a, &b, &c], total).await;
    let held = b.pending() + c.pending();
    assert!(held > 0, "the instances to stop hold no message");
    for d in [&mut b, &mut c] {
        let status = d.sigterm_and_wait(Duration::from_secs(30)).await;
        assert!(status.success(), "SIGTERM exit: {status}");
    }
    eprintln!("stopped two instances holding {held} messages");
    let (got, duplicates) =
        collect_counting(&Reader::new(&r.kafka.to), total, Duration::from_secs(90));
    assert_none_early(&got, &sent);
    let worst = lateness(&got, &sent, 0);
    eprintln!("duplicates: {duplicates}");
    // On time: a rebalance and a restore, not a session timeout. Generous
    // for this noisy machine, but finite.
    assert!(worst <= ON_TIME_MS, "a message fired {worst} ms late");
}

/// The sum of `name`'s samples whose labels include `label`.
fn metric_with(delayd: &Delayd, name: &str, label: &str) -> f64 {
    let (_, text) = delayd.http_get("/metrics").expect("GET /metrics");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_message_stays_cancelled_after_a_restore() {
    let r = StoreRoute::new("store-cancel", 2).await;
    let mut a = r.start().await;
    wait_assigned(&a).await;
    let producer = Producer::new();
    for (key, delay) in [("gone", "8000"), ("kept", "10000")] {
        let record = Record::new(key, key.as_bytes()).header("x-delay", Some(delay.as_bytes()));
        producer.send(&r.kafka.from, &record).await;
    }
    wait_scheduled(&[&a], 2).await;
    let path = format!("/v1/messages?route={}&key=gone", r.kafka.route);
    let (status, body) = a.api("DELETE", &path, None);
    assert_eq!(status, 200, "{body}");
    // Its state record is tombstoned once the local Done is durable.
    common::wait_for(
        "the cancel's tombstone",
        Duration::from_secs(10),
        || async {
            (metric_with(&a, "delayd_store_writes_total", "kind=\"tombstone\"") >= 1.0)
                .then_some(())
        },
    )
    .await;
    let wal = a.wal_dir();
    a.kill_9();
    std::fs::remove_dir_all(&wal).expect("delete the WAL");
    a.restart().await;
    let reader = Reader::new(&r.kafka.to);
    let first = reader
        .next(std::time::Instant::now() + Duration::from_secs(60))
        .expect("the message not cancelled arrives");
    assert_eq!(first.key.as_deref(), Some(&b"kept"[..]));
    // Only the message not cancelled came back from the state topic.
    assert_eq!(a.metric("delayd_store_restored_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_at_run_time_get_their_state_partitions() {
    let r = StoreRoute::new("store-grow", 1).await;
    let mut a = r.start().await;
    wait_assigned(&a).await;
    kafka::add_partitions(&r.kafka.from, 3).await;
    // delayd's consumer notices the new partitions at its next metadata
    // refresh (10 s) and the group rebalances; the store grows the state
    // topic before it consumes them.
    common::wait_for(
        "the new partitions assigned",
        Duration::from_secs(60),
        || async { a.log_tail(200).contains("partition=2").then_some(()) },
    )
    .await;
    let producer = Producer::new();
    let mut sent = Vec::new();
    for i in 0..30u32 {
        let record = Record::new(&format!("k{i}"), format!("{i}").as_bytes())
            .header("x-delay", Some(b"6000"));
        sent.push((now_ms(), 6000));
        producer
            .send_to(&r.kafka.from, (i % 3) as i32, &record)
            .await;
    }
    wait_scheduled(&[&a], 30).await;
    // Held in all three state partitions: they survive the disk's loss.
    let wal = a.wal_dir();
    a.kill_9();
    std::fs::remove_dir_all(&wal).expect("delete the WAL");
    a.restart().await;
    let (got, _) = collect_counting(&Reader::new(&r.kafka.to), 30, Duration::from_secs(90));
    assert_none_early(&got, &sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_a_route_to_the_broker_store_keeps_what_the_wal_held() {
    let r = StoreRoute::new("store-switch", 2).await;
    // Until now the route kept its state in the WAL only.
    let mut a = r.kafka.start("").await;
    wait_assigned(&a).await;
    let total = 300;
    let sent = r.send(total, 6000..12_000).await;
    wait_scheduled(&[&a], total).await;
    let held = a.pending();
    let status = a.sigterm_and_wait(Duration::from_secs(30)).await;
    assert!(status.success(), "SIGTERM exit: {status}");
    // The same instance, its WAL kept, now with the broker-kept store: what
    // the WAL holds goes to the state topic before it is released there.
    let config = std::fs::read_to_string(a.config_path()).expect("read the config");
    let store = format!(
        "[store]\nkind = \"broker\"\ntopic_prefix = {}\n\n",
        common::toml_string(&r.prefix)
    );
    std::fs::write(a.config_path(), format!("{store}{config}")).expect("write the config");
    a.restart().await;
    let (got, duplicates) =
        collect_counting(&Reader::new(&r.kafka.to), total, Duration::from_secs(90));
    assert_none_early(&got, &sent);
    eprintln!("duplicates: {duplicates}");
    // They went through the state topic: written there at start, then
    // restored from it when the group assigned the partitions.
    assert!(
        a.metric("delayd_store_restored_total") >= held as f64,
        "restored fewer than the {held} the WAL held"
    );
    // Back to the local store on this WAL: refused, since a stopping
    // instance leaves its messages in the state topic, never read then.
    let status = a.sigterm_and_wait(Duration::from_secs(30)).await;
    assert!(status.success(), "SIGTERM exit: {status}");
    std::fs::write(a.config_path(), config).expect("write the config");
    let path = a.config_path().to_str().expect("UTF-8 path").to_owned();
    let run = tokio::task::spawn_blocking(move || common::delayd_cli("run", &["--config", &path]));
    let (ok, _, err) = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("delayd started on the local store instead of refusing")
        .expect("run delayd");
    assert!(!ok, "delayd started on the local store");
    assert!(
        err.contains("store.kind") && err.contains(&r.kafka.route),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_former_owner_only_adds_duplicates() {
    let r = StoreRoute::new("store-zombie", 4).await;
    let a = r.start().await;
    wait_assigned(&a).await;
    let b = r.start().await;
    wait_assigned(&b).await;
    let total = 600;
    let sent = r.send(total, 8000..14_000).await;
    wait_scheduled(&[&a, &b], total).await;
    let held = a.pending();
    assert!(held > 0, "the instance to pause holds no message");
    // A is frozen with its partitions: its session expires, B takes them
    // and restores their messages. Then A wakes up, still holding them.
    a.signal("-STOP");
    let restored_before = b.metric("delayd_store_restored_total");
    common::wait_for(
        "B restoring A's partitions",
        Duration::from_secs(60),
        || async {
            (b.metric("delayd_store_restored_total") >= restored_before + held as f64).then_some(())
        },
    )
    .await;
    a.signal("-CONT");
    let (got, duplicates) =
        collect_counting(&Reader::new(&r.kafka.to), total, Duration::from_secs(90));
    assert_none_early(&got, &sent);
    eprintln!("{held} held by the paused instance; duplicates: {duplicates}");
}
