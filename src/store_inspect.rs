//! `delayd store inspect --config FILE`: what the broker-kept store holds
//! (`store.kind = "broker"`): per route and state partition (Kafka) or
//! current generation stream (RabbitMQ), the pending messages a restore
//! would bring back and their due-time range. It reads the state from its
//! start and changes nothing, but for the read markers it appends to
//! RabbitMQ streams (recovery skips them).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use delayd_adapters::kafka::state::decode_value;
use delayd_adapters::kafka::StateTopic;
use serde::Serialize;

use crate::config::{Config, StoreKind};

#[derive(Debug, Default, Serialize)]
struct PartitionReport {
    pending: u64,
    /// Bytes of the live records' values.
    bytes: u64,
    oldest_due_ms: Option<u64>,
    newest_due_ms: Option<u64>,
    /// Live records delayd cannot read (another version).
    unreadable: u64,
}

#[derive(Debug, Serialize)]
struct RouteReport {
    /// The Kafka state topic, or the RabbitMQ pointer stream.
    state_topic: String,
    pending: u64,
    /// Kafka: by state partition. RabbitMQ: one entry, the current
    /// generation's number.
    partitions: BTreeMap<i32, PartitionReport>,
    /// RabbitMQ state streams (the text output says "generation").
    #[serde(skip)]
    streams: bool,
}

impl PartitionReport {
    fn add(&mut self, due: Option<u64>, bytes: usize) {
        self.bytes += bytes as u64;
        let Some(due) = due else {
            self.unreadable += 1;
            return;
        };
        self.pending += 1;
        self.oldest_due_ms = Some(self.oldest_due_ms.map_or(due, |d| d.min(due)));
        self.newest_due_ms = Some(self.newest_due_ms.map_or(due, |d| d.max(due)));
    }
}

pub fn run(config: &Config, json: bool) -> anyhow::Result<()> {
    if config.store.kind != StoreKind::Broker {
        anyhow::bail!(
            "store.kind is \"local\": pending messages are in the WAL (delayd wal inspect {})",
            config.wal.dir.display()
        );
    }
    let mut report = BTreeMap::new();
    for route in &config.routes {
        let topic = config.store.topic(&route.name);
        let r = match config.connection(&route.from.broker)? {
            crate::config::BrokerConnection::Amqp(settings) => {
                inspect_streams(&settings, &topic)
                    .with_context(|| format!("route {}: reading {topic}", route.name))?
            }
            crate::config::BrokerConnection::Kafka(client) => {
                inspect_topic(&client.named("delayd-store-inspect"), &topic)?
            }
        };
        report.insert(route.name.clone(), r);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for (name, r) in &report {
        println!(
            "route {name}: {} pending in {}{}",
            r.pending,
            r.state_topic,
            if r.streams {
                String::new()
            } else {
                format!(" ({} partitions)", r.partitions.len())
            }
        );
        for (partition, p) in &r.partitions {
            println!(
                "  {} {partition}: {} pending, {} bytes, due {} .. {}{}",
                if r.streams { "generation" } else { "partition" },
                p.pending,
                p.bytes,
                due(p.oldest_due_ms),
                due(p.newest_due_ms),
                if p.unreadable > 0 {
                    format!(", {} unreadable", p.unreadable)
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(())
}

fn inspect_topic(
    client: &delayd_adapters::kafka::KafkaClientConfig,
    topic: &str,
) -> anyhow::Result<RouteReport> {
    let state = StateTopic::connect(client, topic)?;
    let mut r = RouteReport {
        state_topic: topic.to_owned(),
        pending: 0,
        partitions: BTreeMap::new(),
        streams: false,
    };
    for partition in 0..state.partitions()? {
        let live = state.read_partition(partition, Duration::from_secs(30))?;
        let mut p = PartitionReport::default();
        for value in live.values() {
            p.add(decode_value(value).map(|v| v.due_ms), value.len());
        }
        r.pending += p.pending;
        r.partitions.insert(partition, p);
    }
    Ok(r)
}

/// The live set of the generation the pointer names (a checkpoint being
/// written at this moment is not looked at).
fn inspect_streams(
    settings: &delayd_adapters::amqp::AmqpSettings,
    pointer: &str,
) -> anyhow::Result<RouteReport> {
    use delayd_adapters::amqp::state::{LiveSet, StateNames, StateSession};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let endpoints = delayd_adapters::amqp::Endpoints::new(settings)?;
        let broker = delayd_adapters::amqp::Broker::with_endpoints(
            std::sync::Arc::new(endpoints),
            delayd_adapters::amqp::BrokerOptions::named("delayd-store-inspect"),
        );
        let names = StateNames::new(pointer);
        let session = StateSession::observe(broker.open_dedicated().await?, &names).await?;
        let mut r = RouteReport {
            state_topic: pointer.to_owned(),
            pending: 0,
            partitions: BTreeMap::new(),
            streams: true,
        };
        if let (Some(generation), _) = session.current_generation().await? {
            let mut set = LiveSet::default();
            session
                .read_into(&names.generation(generation), &mut set)
                .await?;
            let mut p = PartitionReport::default();
            for record in set.live() {
                p.add(Some(record.due_ms), record.message.len());
            }
            r.pending = p.pending;
            r.partitions.insert(generation as i32, p);
        }
        session.close().await;
        Ok(r)
    })
}

fn due(ms: Option<u64>) -> String {
    ms.and_then(|ms| chrono::DateTime::from_timestamp_millis(ms as i64))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| "-".into())
}
