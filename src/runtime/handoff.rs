//! Hand-off on shutdown (`engine.handoff`): once consuming and firing have
//! stopped, every waiting message goes back to its route's own ingress (the
//! AMQP queue, through the default exchange so no other binding sees it; the
//! Kafka topic it came from), marked with its due time (see
//! [`crate::route::handoff`]). Only a publish the broker confirmed is followed
//! by a Done. Whatever is not handed back within the time allowed stays in
//! the WAL, as without hand-off. Another instance consumes the copies and
//! fires them at their original due time: none early, none lost; a crash
//! between a confirm and its Done leaves a copy on both sides (a duplicate).

use crate::id::MessageId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::{PublishOutcome, Target};
use tokio::task::JoinSet;

use crate::engine::{Engine, PendingInfo};
use crate::route::{handoff, BrokerKind, Route};
use crate::wal::Record;

use super::brokers::Brokers;

/// Publishes awaiting their confirm at once.
const IN_FLIGHT: usize = 256;

#[derive(Debug, Default, Clone, Copy)]
pub struct HandoffReport {
    /// Confirmed by the broker and retired here.
    pub handed: u64,
    /// Still in the WAL (not confirmed in time, or refused).
    pub left: u64,
}

/// Hand every waiting message back, in due order, for at most `within`.
pub async fn hand_off(
    engine: &Engine,
    routes: &HashMap<String, Arc<Route>>,
    brokers: &Brokers,
    within: Duration,
) -> HandoffReport {
    let waiting = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.waiting())
            .await
            .unwrap_or_default()
    };
    let total = waiting.len() as u64;
    if total == 0 {
        return HandoffReport::default();
    }
    tracing::info!(
        messages = total,
        "handing pending messages back to their routes' ingress"
    );
    let deadline = tokio::time::Instant::now() + within;
    let mut report = HandoffReport::default();
    let mut tasks = JoinSet::new();
    let mut next = waiting.into_iter();
    let mut out_of_time = false;
    loop {
        while tasks.len() < IN_FLIGHT && !out_of_time {
            let Some(info) = next.next() else { break };
            let Some(route) = routes.get(&*info.route).cloned() else {
                continue; // no longer configured: it stays in the WAL
            };
            // Started here, in due order: publishes are queued in call order.
            match start(engine, &route, brokers, info) {
                Some(task) => {
                    tasks.spawn(task);
                }
                None => continue,
            }
        }
        let finished = tokio::select! {
            done = tasks.join_next() => done,
            _ = tokio::time::sleep_until(deadline) => {
                out_of_time = true;
                None
            }
        };
        match finished {
            Some(Ok(true)) => report.handed += 1,
            Some(_) => {}
            None if tasks.is_empty() || out_of_time => break,
            None => {}
        }
    }
    if out_of_time {
        tracing::warn!("hand-off out of time (engine.shutdown_grace); the rest stays in the WAL");
        tasks.abort_all();
    }
    report.left = engine.pending();
    metrics::counter!("delayd_handoff_messages_total").increment(report.handed);
    report
}

/// Queue the publish of one message's hand-off copy; the task resolves to
/// whether it was confirmed and retired.
fn start(
    engine: &Engine,
    route: &Route,
    brokers: &Brokers,
    info: PendingInfo,
) -> Option<impl std::future::Future<Output = bool> + Send + 'static> {
    let record = match engine.record_of(&info) {
        Ok(Some(record)) => record,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(id = info.id, error = %e, "cannot read a message to hand it off; it stays");
            return None;
        }
    };
    let Record::Schedule {
        message, uid, id, ..
    } = record
    else {
        return None;
    };
    let mut message = match delayd_adapters::decode(&message) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(id = info.id, error = %e, "cannot decode a message to hand it off; it stays");
            return None;
        }
    };
    handoff::prepare(&mut message, info.due_ms, MessageId::or_legacy(uid, id));
    let from = &route.config.from;
    let target = match route.from_kind {
        BrokerKind::Amqp => Target::queue(from.queue.clone().unwrap_or_default()),
        BrokerKind::Kafka => {
            let topic = if from.topics.contains(&message.source) {
                message.source.clone()
            } else {
                from.topics.first().cloned().unwrap_or_default()
            };
            Target::exchange(topic)
        }
    };
    let publish = brokers.publish(&from.broker, message, target);
    let engine = engine.clone();
    Some(async move {
        match publish.await {
            Ok(PublishOutcome::Delivered) => match engine.retire_handed_off(info.id).await {
                Ok(retired) => retired,
                Err(e) => {
                    tracing::error!(id = info.id, error = %e, "handed off, but its Done failed; it may fire twice");
                    false
                }
            },
            Ok(PublishOutcome::Unroutable) => {
                tracing::warn!(
                    id = info.id,
                    "the route's ingress did not take the hand-off; it stays"
                );
                false
            }
            Err(e) => {
                tracing::warn!(id = info.id, error = %e, "hand-off publish failed; it stays");
                false
            }
        }
    })
}
