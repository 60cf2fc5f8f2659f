//! The engine's [`Dispatch`]: republish a due message to its route's target,
//! and send unroutable ones to the route's unroutable destination.

use std::collections::HashMap;
use std::sync::Arc;

use delayd_adapters::{BoxFuture, Message, PublishOutcome, SinkError};
use tracing::Instrument;

use crate::engine::{Dispatch, Fired, Outcome};
use crate::id::MessageId;
use crate::route::{bridge, rewrite, BrokerKind, Route};

use super::brokers::Brokers;
use super::park::park;
use super::store::RouteStore;

/// Publish attempts against a missing exchange or topic before the message
/// is parked as unroutable (with the default back-off, about 6 s).
const MISSING_TARGET_ATTEMPTS: u32 = 6;

/// Why a message is released rather than published (broker-kept store).
const MOVED: &str = "this instance no longer owns the route";

pub struct Deliverer {
    pub routes: Arc<HashMap<String, Arc<Route>>>,
    pub brokers: Brokers,
    /// Broker-kept stores by route: a delivered message is tombstoned there.
    pub stores: Arc<HashMap<String, RouteStore>>,
}

impl Dispatch for Deliverer {
    /// Decodes and starts the publish before returning, so Kafka records
    /// reach their partition in fire order (per-key order for equal due times).
    fn deliver(&self, fired: Fired) -> BoxFuture<'static, Outcome> {
        let brokers = self.brokers.clone();
        let Some(route) = self.routes.get(&*fired.route).cloned() else {
            let reason = format!(
                "route {:?} is no longer in the config; the message waits until it is back",
                fired.route
            );
            return Box::pin(async move { Outcome::Retry(reason) });
        };
        if self
            .stores
            .get(route.name())
            .is_some_and(|s| !s.may_fire(fired.id))
        {
            // The route moved: the next owner fires this one.
            return Box::pin(async move { Outcome::Release(MOVED.to_owned()) });
        }
        let decoded = delayd_adapters::decode(&fired.message);
        // Where its state record is (broker-kept store), read before the
        // message is rewritten for delivery.
        let state = match (self.stores.get(route.name()), &decoded) {
            (Some(store), Ok(m)) => store.pending_done(fired.id, m),
            _ => None,
        };
        let message = match decoded.map(|m| for_delivery(&route, m, fired.uid)) {
            Ok(m) => m,
            Err(e) => {
                // Our own encoding failed to decode: keep the raw bytes visible.
                let mut raw = Message::with_body(fired.message);
                rewrite::with_error(&mut raw, &format!("stored message cannot be decoded: {e}"));
                return Box::pin(async move {
                    park(&brokers, &route.unroutable, &raw, &route, "unroutable").await
                });
            }
        };
        let target = route.target_for(&message);
        let routing_key = message.routing_key.clone();
        // The message moves into the publish (no copy of its body); the
        // stored bytes stay for the rare message that must be parked.
        let publish = match self.stores.get(route.name()) {
            // A broker-kept store's route: not sent once the route has
            // moved, even if the publish waited for a reconnect meanwhile
            // (the next owner fires it; a late copy from here is a
            // duplicate: a cut link made 1.8 % of them).
            Some(store) => {
                let (store, id) = (store.clone(), fired.id);
                let fence: delayd_adapters::Fence = Arc::new(move || store.may_fire(id));
                brokers.publish_fenced(&route.to.broker, message, target.clone(), fence)
            }
            None => brokers.publish(&route.to.broker, message, target.clone()),
        };
        let store = self.stores.get(route.name()).cloned();
        let id = fired.id;
        let may_fire = move || store.as_ref().is_none_or(|s| s.may_fire(id));
        let span = tracing::debug_span!("deliver", id = %fired.uid, route = %route.name());
        Box::pin(
            async move {
                let aside = |reason: &str| {
                    let mut message = prepared(&route, &fired)
                        .unwrap_or_else(|_| Message::with_body(fired.message.clone()));
                    rewrite::with_error(&mut message, reason);
                    message
                };
                let result = publish.await;
                let outcome = match result {
                    Ok(PublishOutcome::Delivered) => {
                        metrics::counter!("delayd_fired_total", "route" => route.name().to_owned())
                            .increment(1);
                        tracing::debug!("delivered");
                        Outcome::Done
                    }
                    Ok(PublishOutcome::Unroutable) => {
                        let key = target.routing_key.as_deref().unwrap_or(&routing_key);
                        let reason = format!(
                            "unroutable: exchange {:?} has no queue bound for routing key {key:?}",
                            target.destination
                        );
                        tracing::warn!(id = %fired.uid, %reason, "message unroutable");
                        let message = aside(&reason);
                        park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                    }
                    Err(SinkError::UnknownTarget(e))
                        if fired.attempt + 1 >= MISSING_TARGET_ATTEMPTS =>
                    {
                        let reason = format!("unknown target: {e}");
                        tracing::warn!(id = %fired.uid, %reason, "target missing; parking the message");
                        let message = aside(&reason);
                        park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                    }
                    Err(SinkError::UnknownTarget(e)) => {
                        Outcome::Retry(format!("unknown target: {e}"))
                    }
                    // Not sent (its fence fell at send), or sent or not while
                    // the route moved: the next owner has it either way.
                    Err(SinkError::Transient(_)) if !may_fire() => Outcome::Release(MOVED.to_owned()),
                    Err(SinkError::Transient(e)) => Outcome::Retry(e),
                    Err(SinkError::Unavailable(e)) => Outcome::Unavailable(e),
                    Err(SinkError::Permanent(e)) => {
                        // Retrying cannot help: park it with the broker's reason.
                        let reason = format!("cannot publish: {e}");
                        tracing::warn!(id = %fired.uid, %reason, "message cannot be published; parking it");
                        let mut message = aside(&reason);
                        rewrite::strip_checked_properties(&mut message);
                        park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                    }
                };
                if let (Outcome::Done, Some(done)) = (&outcome, state) {
                    done.write().await;
                }
                outcome
            }
            .instrument(span),
        )
    }
}

/// Cross-broker mapping and the Kafka timestamp rule.
fn prepare_for_target(route: &Route, message: &mut Message) {
    match (route.from_kind, route.to_kind) {
        (BrokerKind::Amqp, BrokerKind::Kafka) => bridge::amqp_to_kafka(message),
        (BrokerKind::Kafka, BrokerKind::Amqp) => bridge::kafka_to_amqp(message),
        _ => {}
    }
    if route.to_kind == BrokerKind::Kafka && !route.config.to.keep_timestamp {
        // The record is stamped with the time it is published (fire time).
        message.timestamp_ms = None;
    }
}

/// The stored message as it goes out: decoded, rewritten for delivery
/// (`x-delay` negated, the delayd id added) and mapped for the target broker.
fn prepared(route: &Route, fired: &Fired) -> Result<Message, delayd_adapters::CodecError> {
    let message = delayd_adapters::decode(&fired.message)?;
    Ok(for_delivery(route, message, fired.uid))
}

/// A decoded stored message, rewritten and mapped for delivery.
fn for_delivery(route: &Route, mut message: Message, id: MessageId) -> Message {
    let now_ms = chrono::Utc::now().timestamp_millis().max(0) as u64;
    route.for_delivery(&mut message, id, now_ms);
    prepare_for_target(route, &mut message);
    message
}
