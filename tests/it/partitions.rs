//! A partitioned RabbitMQ route (`partitions = 6`, issue #29) on the
//! broker-kept store, shared by three instances. Each partition always has
//! at most one owner and, once settled, exactly one; the instances own two
//! each. A kill -9 moves the dead instance's partitions to the others, and
//! a new instance takes its share back. Every message arrives, none early,
//! byte-equal, duplicates (same id only) at most 0.1 %.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

use crate::common::{self, config_toml, now_ms, Cleanup, Client, Delayd, DelaydOptions, Names};

const PARTS: u16 = 6;
const PER_BATCH: usize = 2000;
/// How long the partitions may take to settle: an election waits out the
/// lock's lease (6 s), and a share may change hands twice.
const SETTLE: Duration = Duration::from_secs(120);

struct Partitioned {
    names: Names,
    prefix: String,
    client: Client,
    /// `partitions` of the route.
    parts: u16,
    /// More keys of the route's `from`.
    from_extra: String,
}

impl Partitioned {
    fn config(&self, wal: &std::path::Path, http: std::net::SocketAddr) -> String {
        self.config_with(self.parts, wal, http)
    }

    fn config_with(&self, parts: u16, wal: &std::path::Path, http: std::net::SocketAddr) -> String {
        let opts = DelaydOptions {
            prefetch: 200,
            route_extra: format!("partitions = {parts}\n"),
            from_extra: self.from_extra.clone(),
            ..DelaydOptions::default()
        };
        format!(
            "{}\n[store]\nkind = \"broker\"\ntopic_prefix = {}\n",
            config_toml(&self.names, wal, http, &opts),
            common::toml_string(&self.prefix)
        )
    }

    fn partition(&self, i: u16) -> String {
        format!("{}.{i}", self.names.route)
    }

    /// Partitions each instance consumes (owns); panics if a partition has
    /// two owners.
    fn shares(&self, instances: &[&Delayd]) -> (Vec<usize>, usize) {
        let states: Vec<serde_json::Value> = instances.iter().map(|d| d.readyz()).collect();
        let mut shares = vec![0; instances.len()];
        let mut owned = 0;
        for p in 0..self.parts {
            let name = self.partition(p);
            let owners: Vec<usize> = (0..instances.len())
                .filter(|&i| states[i]["routes"][&name] == "consuming")
                .collect();
            assert!(owners.len() <= 1, "partition {name} has owners {owners:?}");
            for i in owners {
                shares[i] += 1;
                owned += 1;
            }
        }
        (shares, owned)
    }

    /// Waits until every partition has an owner and each instance owns
    /// `share`, checking all along that no partition has two.
    async fn settle(&self, instances: &[&Delayd], share: usize) {
        let start = Instant::now();
        loop {
            let (shares, owned) = self.shares(instances);
            // Ready too: one that leaves the other partitions to the others
            // reports them as a standby does, not as starting.
            let ready = instances.iter().all(|d| d.readyz()["ready"] == true);
            if owned == self.parts as usize && shares.iter().all(|&s| s == share) && ready {
                eprintln!("settled in {:?}: {shares:?}", start.elapsed());
                return;
            }
            assert!(
                start.elapsed() < SETTLE,
                "not settled after {SETTLE:?}: shares {shares:?}, {owned} of {} owned, ready {ready}",
                self.parts
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Publishes a batch over 40 routing keys; returns (sent, delay) by id.
    async fn send(&self, tag: &str, sent: &mut BTreeMap<String, (u64, u64)>) {
        let mut confirms = Vec::with_capacity(PER_BATCH);
        for i in 0..PER_BATCH {
            let delay = 3_000 + (i as u64 * 7919) % 5_000;
            let id = format!("{tag}-{i}");
            let props = common::delayed(&id, delay);
            sent.insert(id.clone(), (now_ms(), delay));
            confirms.push(
                self.client
                    .publish_unconfirmed(
                        &self.names.from_exchange,
                        &format!("key-{}", i % 40),
                        format!("body {id}").as_bytes(),
                        props,
                    )
                    .await,
            );
        }
        for c in confirms {
            common::assert_confirmed(c).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_share_six_partitions_through_a_kill_and_an_addition() {
    let names = Names::new("partitions");
    let prefix = format!("delayd-it.state.{}.", common::unique_suffix());
    let client = Client::connect("delayd-it-partitions").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let cleanup = cleanup_for(&names, &prefix, PARTS);
    let r = Partitioned {
        names,
        prefix,
        client,
        parts: PARTS,
        from_extra: String::new(),
    };

    let a = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    let b = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    let mut c = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&a, &b, &c], 2).await;
    let mut sent = BTreeMap::new();
    r.send("one", &mut sent).await;

    c.kill_9();
    r.settle(&[&a, &b], 3).await;
    r.send("two", &mut sent).await;

    let d = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&a, &b, &d], 2).await;
    r.send("three", &mut sent).await;

    let mut receiver = r.client.consume(&r.names.target_queue).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first: HashMap<String, String> = HashMap::new();
    let mut copies: HashMap<String, u32> = HashMap::new();
    let (mut duplicates, mut other_id) = (0, 0);
    while first.len() < sent.len() {
        let m = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {} arrived", first.len(), sent.len()));
        let id = m.message_id().unwrap_or_default().to_owned();
        let (at, delay) = sent[&id];
        assert!(
            m.at_ms >= at + delay,
            "{id} arrived {} ms early",
            at + delay - m.at_ms
        );
        assert_eq!(m.delivery.data, format!("body {id}").as_bytes());
        let uid = m.header_text("x-delayd-id").expect("x-delayd-id");
        match first.get(&id) {
            None => {
                first.insert(id, uid);
            }
            Some(earlier) => {
                duplicates += 1;
                if *earlier != uid {
                    other_id += 1;
                }
                *copies.entry(id).or_default() += 1;
            }
        }
    }
    receiver.close().await;
    eprintln!(
        "{} arrived, {duplicates} duplicates ({other_id} under another id)",
        sent.len()
    );
    assert_eq!(other_id, 0, "a message stored twice");
    // One kill costs a message at most one copy: the killed instance's
    // delivery whose ack it never sent comes back, and the next owner,
    // which restored the message, stores it again under its id (it may be
    // a twin published on purpose: dropped, a twin was lost). So the count
    // is bounded by what the killed instance held unacknowledged, not by
    // a rate.
    let most = copies.values().max().copied().unwrap_or(0);
    assert!(
        most <= 1,
        "a message arrived {} times after one kill",
        most + 1
    );
    drop((a, b, c, d));
    drop(cleanup);
}

/// Partitions of a stream ingress on the broker-kept store (#37): one
/// stream per partition, bound to the consistent-hash exchange, each read
/// by its owner from the offset kept in that partition's state stream.
/// Two instances share four; one is killed with its disk, the other takes
/// its partitions and reads their streams on from their offsets: every
/// message arrives, none early, byte-equal, any copy under its first id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_partitions_are_shared_and_a_kill_loses_nothing() {
    const STREAM_PARTS: u16 = 4;
    let names = Names::new("partitions-stream");
    let prefix = format!("delayd-it.state.{}.", common::unique_suffix());
    let client = Client::connect("delayd-it-partitions-stream").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let cleanup = cleanup_for(&names, &prefix, STREAM_PARTS);
    let r = Partitioned {
        names,
        prefix,
        client,
        parts: STREAM_PARTS,
        from_extra: ", queue_type = \"stream\"".into(),
    };
    let mut a = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    let b = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&a, &b], 2).await;
    let mut sent = BTreeMap::new();
    r.send("one", &mut sent).await;
    let wal = a.wal_dir();
    a.kill_9();
    std::fs::remove_dir_all(&wal).expect("delete the killed instance's WAL");
    r.settle(&[&b], STREAM_PARTS as usize).await;
    r.send("two", &mut sent).await;
    receive_all(&r.client, &r.names.target_queue, &sent).await;
    drop((a, b));
    drop(cleanup);
}

/// Names a partitioned test route has on the broker, for its cleanup.
fn cleanup_for(names: &Names, prefix: &str, parts: u16) -> Cleanup {
    let mut cleanup: Cleanup = names.cleanup();
    for p in 0..parts {
        cleanup.queues.push(format!("{}.{p}", names.from_queue));
        let pointer = format!("{prefix}{}.{p}", names.route);
        cleanup.queues.push(format!("{pointer}.pointer"));
        cleanup.queues.push(format!("{pointer}.lock"));
        cleanup
            .queues
            .extend((0..8).map(|g| format!("{pointer}.{g}")));
        cleanup.queues.push(pointer);
    }
    cleanup
        .queues
        .push(format!("{prefix}{}.members", names.route));
    cleanup
}

/// Publishes `count` messages over 64 routing keys with `delay` ms, ids
/// `<tag>-<i>`; records (sent at, delay) by id.
async fn send_keys(
    client: &Client,
    exchange: &str,
    tag: &str,
    count: usize,
    delay: u64,
    sent: &mut BTreeMap<String, (u64, u64)>,
) {
    let mut confirms = Vec::with_capacity(count);
    for i in 0..count {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-delay"),
            AMQPValue::LongLongInt(delay as i64),
        );
        let id = format!("{tag}-{i}");
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(headers);
        sent.insert(id.clone(), (now_ms(), delay));
        confirms.push(
            client
                .publish_unconfirmed(
                    exchange,
                    &format!("key-{}", i % 64),
                    format!("body {id}").as_bytes(),
                    props,
                )
                .await,
        );
    }
    for c in confirms {
        common::assert_confirmed(c).await;
    }
}

/// Every message of `sent` arrives at `queue`, none early, byte-equal;
/// duplicates only under the same id.
async fn receive_all(client: &Client, queue: &str, sent: &BTreeMap<String, (u64, u64)>) {
    let mut receiver = client.consume(queue).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first: HashMap<String, String> = HashMap::new();
    while first.len() < sent.len() {
        let Some(m) = receiver.next(deadline).await else {
            let missing: Vec<&String> = sent.keys().filter(|id| !first.contains_key(*id)).collect();
            panic!(
                "only {} of {} arrived; missing e.g. {:?}",
                first.len(),
                sent.len(),
                &missing[..missing.len().min(10)]
            );
        };
        let id = m.message_id().unwrap_or_default().to_owned();
        let (at, delay) = sent[&id];
        assert!(
            m.at_ms >= at + delay,
            "{id} arrived {} ms early",
            at + delay - m.at_ms
        );
        assert_eq!(m.delivery.data, format!("body {id}").as_bytes());
        let uid = m.header_text("x-delayd-id").expect("x-delayd-id");
        if let Some(earlier) = first.insert(id.clone(), uid.clone()) {
            assert_eq!(earlier, uid, "{id} stored twice under two ids");
        }
    }
    receiver.close().await;
}

/// Issue #36, item 7 (DESIGN guarantee 8): lowering `partitions` from 6 to
/// 4 on the broker store, with messages pending in partitions 4 and 5 (in
/// their state streams, stored before a kill -9, and in their ingress
/// queues, published after). The start with 4 is refused before it
/// consumes anything, naming the key, the count before and the queues,
/// and so is `delayd check`; back at 6, every message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_partitions_with_messages_pending_is_refused_naming_the_key() {
    let names = Names::new("partitions-lower");
    let prefix = format!("delayd-it.state.{}.", common::unique_suffix());
    let client = Client::connect("delayd-it-partitions-lower").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let cleanup = cleanup_for(&names, &prefix, PARTS);
    let r = Partitioned {
        names,
        prefix,
        client,
        parts: PARTS,
        from_extra: String::new(),
    };
    const PER_SEND: usize = 300;
    const DELAY_MS: u64 = 20_000;

    let mut a = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&a], PARTS as usize).await;
    let mut sent = BTreeMap::new();
    send_keys(
        &r.client,
        &r.names.from_exchange,
        "before",
        PER_SEND,
        DELAY_MS,
        &mut sent,
    )
    .await;
    // Stored and acked (the ack follows the state record): the state
    // streams of partitions 4 and 5 hold theirs.
    common::wait_for(
        "every message stored and acked",
        Duration::from_secs(60),
        || async {
            let settled = (0..PARTS).all(|p| {
                Client::queue_unsettled(&format!("{}.{p}", r.names.from_queue)) == Some((0, 0))
            });
            (a.pending() == PER_SEND as u64 && settled).then_some(())
        },
    )
    .await;
    a.kill_9();
    // Published with no instance running: they wait in all six queues.
    send_keys(
        &r.client,
        &r.names.from_exchange,
        "after",
        PER_SEND,
        DELAY_MS,
        &mut sent,
    )
    .await;

    // The start with 4 partitions is refused, naming the key and the queues.
    let lowered_dir = tempfile::tempdir().expect("tempdir");
    let lowered = r.config_with(
        4,
        &lowered_dir.path().join("wal"),
        "127.0.0.1:0".parse().unwrap(),
    );
    let (ok, output) = common::run_until_exit(&lowered, Duration::from_secs(60)).await;
    assert!(
        !ok,
        "a start with fewer partitions must be refused:\n{output}"
    );
    for needle in [
        "routes[0].partitions = 4".to_owned(),
        format!("route {:?} had 6 partitions", r.names.route),
        format!("queue {}.4", r.names.from_queue),
        format!("queue {}.5", r.names.from_queue),
        format!("{}{}.5", r.prefix, r.names.route),
        "Set routes[0].partitions = 6 (or more) again".to_owned(),
    ] {
        assert!(output.contains(&needle), "{needle:?} is not in:\n{output}");
    }
    // Refused before consuming: every message published after the kill
    // still waits in its queue.
    let mut ready = 0;
    for p in 0..PARTS {
        let (messages, consumers) = r
            .client
            .queue_counts(&format!("{}.{p}", r.names.from_queue))
            .await
            .expect("partition queue");
        assert_eq!(consumers, 0);
        ready += messages as usize;
    }
    assert_eq!(ready, PER_SEND, "the refused start consumed messages");

    // `delayd check` sees the same.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("delayd.toml");
    std::fs::write(&path, &lowered).expect("write config");
    let (ok, _, stderr) = common::delayd_cli("check", &["--config", path.to_str().unwrap()]);
    assert!(!ok, "delayd check must refuse fewer partitions:\n{stderr}");
    eprintln!("delayd check: {stderr}");
    assert!(
        stderr.contains("routes[0].partitions = 4") && stderr.contains("had 6 partitions"),
        "{stderr}"
    );
    let (ok, _, stderr) =
        common::delayd_cli("check", &["--offline", "--config", path.to_str().unwrap()]);
    assert!(
        ok,
        "delayd check --offline does not look at the broker:\n{stderr}"
    );

    // Back at 6 partitions (a fresh disk: restored from the broker),
    // nothing was lost.
    let b = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&b], PARTS as usize).await;
    receive_all(&r.client, &r.names.target_queue, &sent).await;
    drop((a, b));
    drop(cleanup);
}

/// Lowering `partitions` when the partitions dropped are empty (stopped
/// cleanly: nothing pending, their queues empty): the start removes their
/// queues and state streams, so no routing key hashes to a queue nobody
/// reads, and every message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_partitions_that_are_empty_removes_them_and_loses_nothing() {
    let names = Names::new("partitions-empty");
    let prefix = format!("delayd-it.state.{}.", common::unique_suffix());
    let client = Client::connect("delayd-it-partitions-empty").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let cleanup = cleanup_for(&names, &prefix, PARTS);
    let mut r = Partitioned {
        names,
        prefix,
        client,
        parts: PARTS,
        from_extra: String::new(),
    };

    let mut a = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&a], PARTS as usize).await;
    let mut sent = BTreeMap::new();
    send_keys(&r.client, &r.names.from_exchange, "six", 128, 0, &mut sent).await;
    receive_all(&r.client, &r.names.target_queue, &sent).await;
    assert!(a.sigterm_and_wait(Duration::from_secs(60)).await.success());
    // The dropped partitions exist, empty.
    for p in 4..PARTS {
        let queue = format!("{}.{p}", r.names.from_queue);
        assert_eq!(r.client.queue_counts(&queue).await, Some((0, 0)), "{queue}");
    }

    r.parts = 4;
    let b = Delayd::start_with(|wal, http| r.config(wal, http)).await;
    r.settle(&[&b], 4).await;
    let log = b.full_log();
    assert!(
        log.contains("removed an empty partition the route no longer has"),
        "{log}"
    );
    for p in 4..PARTS {
        let queue = format!("{}.{p}", r.names.from_queue);
        assert_eq!(r.client.queue_counts(&queue).await, None, "{queue} is left");
        let pointer = format!("{}{}.{p}", r.prefix, r.names.route);
        for name in [
            pointer.clone(),
            format!("{pointer}.pointer"),
            format!("{pointer}.lock"),
        ] {
            assert_eq!(r.client.queue_counts(&name).await, None, "{name} is left");
        }
    }
    // Every key reaches a consumed partition.
    let mut sent = BTreeMap::new();
    send_keys(
        &r.client,
        &r.names.from_exchange,
        "four",
        128,
        1_000,
        &mut sent,
    )
    .await;
    receive_all(&r.client, &r.names.target_queue, &sent).await;
    drop((a, b));
    drop(cleanup);
}
