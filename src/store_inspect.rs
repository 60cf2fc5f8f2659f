//! `delayd store inspect --config FILE`: what the broker-kept store holds
//! (`store.kind = "broker"`): per route and state partition, the pending
//! messages a restore would bring back and their due-time range. It reads
//! the state topics from their start and changes nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use delayd_adapters::kafka::state::decode_value;
use delayd_adapters::kafka::StateTopic;
use serde::Serialize;

use crate::config::{Config, StoreKind};
use crate::runtime::kafka_client;

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
    state_topic: String,
    pending: u64,
    partitions: BTreeMap<i32, PartitionReport>,
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
        let client = config
            .broker(&route.from.broker)
            .and_then(kafka_client)
            .with_context(|| format!("route {}: not a Kafka route", route.name))?;
        let topic = config.store.topic(&route.name);
        let state = StateTopic::connect(&client, &topic)?;
        let mut r = RouteReport {
            state_topic: topic.clone(),
            pending: 0,
            partitions: BTreeMap::new(),
        };
        for partition in 0..state.partitions()? {
            let live = state.read_partition(partition, Duration::from_secs(30))?;
            let mut p = PartitionReport::default();
            for value in live.values() {
                p.bytes += value.len() as u64;
                let Some((due, _)) = decode_value(value) else {
                    p.unreadable += 1;
                    continue;
                };
                p.pending += 1;
                p.oldest_due_ms = Some(p.oldest_due_ms.map_or(due, |d| d.min(due)));
                p.newest_due_ms = Some(p.newest_due_ms.map_or(due, |d| d.max(due)));
            }
            r.pending += p.pending;
            r.partitions.insert(partition, p);
        }
        report.insert(route.name.clone(), r);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for (name, r) in &report {
        println!(
            "route {name}: {} pending in {} ({} partitions)",
            r.pending,
            r.state_topic,
            r.partitions.len()
        );
        for (partition, p) in &r.partitions {
            println!(
                "  partition {partition}: {} pending, {} bytes, due {} .. {}{}",
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

fn due(ms: Option<u64>) -> String {
    ms.and_then(|ms| chrono::DateTime::from_timestamp_millis(ms as i64))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| "-".into())
}
