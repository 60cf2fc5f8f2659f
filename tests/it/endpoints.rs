//! Several endpoints per RabbitMQ broker (`urls = [...]`): with the first
//! one down delayd connects to the second, for consuming and publishing
//! alike; and on the three-node RabbitMQ 4.3 cluster (`RABBITMQ=cluster
//! scripts/rabbitmq.sh`), when the node delayd is connected to dies, it
//! moves to the next one with nothing lost and nothing early.

use crate::common;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::tls::{wait_log_line, wait_readyz};
use common::{
    amqp_url, config_toml, must_replace, now_ms, seeded, toml_string, Client, Delayd,
    DelaydOptions, Names, DEADLINE, LATE_MS,
};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};

fn delayed(id: &str, delay_ms: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms as i64));
    BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(headers)
        .with_delivery_mode(2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_first_endpoint_down_delayd_uses_the_second() {
    let names = Names::new("endpoints");
    let url_line = format!("url = {}", toml_string(&amqp_url()));
    // Port 1 on localhost: refused at once, as a node that is down.
    let urls = format!(
        "urls = [\"amqp://guest:guest@127.0.0.1:1/%2f\", {}]",
        toml_string(&amqp_url())
    );
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-endpoints").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let delayd = Delayd::start_consuming(
        |wal, http| {
            must_replace(
                &config_toml(&names, wal, http, &DelaydOptions::default()),
                &url_line,
                &urls,
            )
        },
        &names.from_queue,
    )
    .await;
    let line = wait_log_line(
        &delayd,
        &["AMQP endpoint failed; trying the next", "127.0.0.1:1/"],
        DEADLINE,
    )
    .await;
    assert!(
        !line.contains("guest:guest"),
        "credentials in the log: {line}"
    );

    let sent = now_ms();
    client
        .publish(
            &names.from_exchange,
            "k",
            b"second endpoint",
            delayed("e1", 400),
        )
        .await;
    let mut receiver = client.consume(&names.target_queue).await;
    let got = receiver.collect_by_message_id(&["e1"]).await;
    assert!(got[0].at_ms >= sent + 400, "early");
    receiver.close().await;
    // Both connections (consume and publish) are on the second endpoint.
    for name in ["delayd-consume", "delayd-publish"] {
        wait_log_line(
            &delayd,
            &["AMQP connection open", name, &amqp_url_endpoint()],
            DEADLINE,
        )
        .await;
    }
    drop(delayd);
    client.close().await;
}

/// `host:port/vhost` of the harness's broker, as delayd logs it.
fn amqp_url_endpoint() -> String {
    let url = amqp_url();
    let rest = url.split_once("://").expect("a URL").1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let (host, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let vhost = vhost.replace("%2f", "/").replace("%2F", "/");
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5672")
    };
    let sep = if vhost.starts_with('/') { "" } else { "/" };
    format!("{host}{sep}{vhost}")
}

// ------------------------------------------------------------------ cluster

const CLUSTER_PORTS: [u16; 3] = [5681, 5682, 5683];

fn cluster_url(port: u16) -> String {
    format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
}

fn cluster_script(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .env("RABBITMQ", "cluster")
        .status()
        .expect("cannot run scripts/rabbitmq.sh");
    assert!(status.success(), "scripts/rabbitmq.sh {args:?} failed");
}

/// Starts cluster node `n` again when dropped (also when the test fails), so
/// the cluster is whole for the next test.
struct Revive(u8);

impl Drop for Revive {
    fn drop(&mut self) {
        let n = self.0.to_string();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq.sh");
        let _ = Command::new("bash")
            .arg(script)
            .args(["cluster-start", &n])
            .env("RABBITMQ", "cluster")
            .status();
    }
}

/// Durable topic exchange and quorum queue bound to it with `#`.
async fn declare_quorum_target(client: &Client, exchange: &str, queue: &str) {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    client
        .channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("exchange.declare");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    client
        .channel
        .queue_declare(queue.into(), durable, args)
        .await
        .expect("queue.declare");
    client
        .channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue.bind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_its_cluster_node_dies_delayd_moves_on_with_none_lost_and_none_early() {
    let names = Names::new("cluster-failover");
    // The test's own client is on node 3, which stays up.
    let client = Client::try_connect_to(&cluster_url(5683), "delayd-it-cluster")
        .await
        .expect("the cluster (RABBITMQ=cluster scripts/rabbitmq.sh) on 127.0.0.1:5683");
    declare_quorum_target(&client, &names.to_exchange, &names.target_queue).await;
    let urls: Vec<String> = CLUSTER_PORTS
        .iter()
        .map(|p| toml_string(&cluster_url(*p)))
        .collect();
    let url_line = format!("url = {}", toml_string(&amqp_url()));
    let opts = DelaydOptions {
        // A quorum queue holds what it handed to a consumer on a node it
        // lost for x-consumer-disconnected-timeout (60 s by default: the
        // node may come back) before handing it to another: 5 s here.
        from_extra: ", queue_type = \"quorum\", \
                     queue_arguments = { \"x-consumer-disconnected-timeout\" = 5000 }"
            .into(),
        ..DelaydOptions::default()
    };
    let delayd = Delayd::start_with(|wal, http| {
        must_replace(
            &config_toml(&names, wal, http, &opts),
            &url_line,
            &format!("urls = [{}]", urls.join(", ")),
        )
    })
    .await;
    wait_readyz(&delayd).await;
    wait_log_line(
        &delayd,
        &["AMQP connection open", "delayd-consume", "127.0.0.1:5681/"],
        DEADLINE,
    )
    .await;

    // Messages before the kill (pending in delayd when node 1 dies) and
    // after it (taken in through the next node).
    let total = 300u32;
    let kill_after = seeded("cluster kill after message", 100..200) as u32;
    let mut sent: HashMap<String, (u64, u64, u64)> = HashMap::new();
    let mut slowest_publish = 0;
    let mut revive = None;
    for i in 0..total {
        if i == kill_after {
            // Everything so far is stored (acked to the broker): the kill
            // tests the outgoing side as well as the intake.
            common::wait_for("delayd to store what was sent", DEADLINE, || async {
                (delayd.metric("delayd_scheduled_total") as u32 >= i).then_some(())
            })
            .await;
            cluster_script(&["cluster-kill", "1"]);
            revive = Some(Revive(1));
        }
        let delay = 2000 + u64::from(i % 7) * 500;
        let id = format!("c{i}");
        let at = now_ms();
        client
            .publish(
                &names.from_exchange,
                "k",
                id.as_bytes(),
                delayed(&id, delay),
            )
            .await;
        // The broker took it between `at` and now: early counts from `at`,
        // late from now (a publish waits while queue leaders move).
        let confirmed = now_ms();
        slowest_publish = slowest_publish.max(confirmed - at);
        sent.insert(id, (at, confirmed, delay));
    }
    println!("slowest publish (confirm) took {slowest_publish} ms");
    let moved = wait_log_line(
        &delayd,
        &["AMQP connection open", "delayd-consume", "127.0.0.1:5682/"],
        Duration::from_secs(60),
    )
    .await;
    println!("moved: {moved}");

    let mut receiver = client.consume(&names.target_queue).await;
    let ids: Vec<&str> = sent.keys().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut copies = 0;
    while seen.len() < ids.len() {
        let Some(got) = receiver.next(deadline).await else {
            let lost: Vec<_> = ids.iter().filter(|id| !seen.contains_key(**id)).collect();
            panic!("{} of {total} arrived; lost {lost:?}", seen.len());
        };
        copies += 1;
        let id = got.message_id().unwrap_or_default().to_owned();
        let &(at, confirmed, delay) = sent.get(&id).expect("one of ours");
        assert!(
            got.at_ms >= at + delay,
            "{id} early: sent {at}, delay {delay}, received {}",
            got.at_ms
        );
        seen.entry(id)
            .or_insert(got.at_ms.saturating_sub(confirmed + delay));
    }
    let mut lateness: Vec<(u64, &String)> = seen.iter().map(|(id, late)| (*late, id)).collect();
    lateness.sort();
    println!(
        "latest (ms, id): {:?}",
        &lateness[lateness.len().saturating_sub(5)..]
    );
    let latest = seen.values().max().copied().unwrap_or(0);
    println!(
        "{total} arrived, {} duplicate copies, none early; latest {latest} ms late (node killed before message {kill_after})",
        copies - total
    );
    // Late by at most the failover (the node's death noticed, queue leaders
    // elected, what delayd's consumer held there returned after the queue's
    // disconnected-consumer timeout, the reconnect) on top of the usual margin.
    assert!(latest < LATE_MS + 10_000, "{latest} ms late");
    receiver.close().await;
    drop(delayd);
    for q in [&names.from_queue, &names.target_queue] {
        let _ = client
            .channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for e in [&names.from_exchange, &names.to_exchange] {
        let _ = client
            .channel
            .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    client.close().await;
    drop(revive);
}
