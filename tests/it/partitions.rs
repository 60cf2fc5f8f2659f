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
}

impl Partitioned {
    fn config(&self, wal: &std::path::Path, http: std::net::SocketAddr) -> String {
        let opts = DelaydOptions {
            prefetch: 200,
            route_extra: format!("partitions = {PARTS}\n"),
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
        for p in 0..PARTS {
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
            if owned == PARTS as usize && shares.iter().all(|&s| s == share) && ready {
                eprintln!("settled in {:?}: {shares:?}", start.elapsed());
                return;
            }
            assert!(
                start.elapsed() < SETTLE,
                "not settled after {SETTLE:?}: shares {shares:?}, {owned} of {PARTS} owned, ready {ready}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Publishes a batch over 40 routing keys; returns (sent, delay) by id.
    async fn send(&self, tag: &str, sent: &mut BTreeMap<String, (u64, u64)>) {
        let mut confirms = Vec::with_capacity(PER_BATCH);
        for i in 0..PER_BATCH {
            let delay = 3_000 + (i as u64 * 7919) % 5_000;
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
    let mut cleanup: Cleanup = names.cleanup();
    for p in 0..PARTS {
        cleanup.queues.push(format!("{}.{p}", names.from_queue));
        let pointer = format!("{prefix}{}.{p}", names.route);
        cleanup.queues.push(format!("{pointer}.pointer"));
        cleanup.queues.push(format!("{pointer}.lock"));
        cleanup
            .queues
            .extend((0..4).map(|g| format!("{pointer}.{g}")));
        cleanup.queues.push(pointer);
    }
    cleanup
        .queues
        .push(format!("{prefix}{}.members", names.route));
    let r = Partitioned {
        names,
        prefix,
        client,
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
            }
        }
    }
    receiver.close().await;
    eprintln!(
        "{} arrived, {duplicates} duplicates ({other_id} under another id)",
        sent.len()
    );
    assert_eq!(other_id, 0, "a message stored twice");
    assert!(
        duplicates * 1000 <= sent.len(),
        "{duplicates} duplicates of {}",
        sent.len()
    );
    drop((a, b, c, d));
    drop(cleanup);
}
