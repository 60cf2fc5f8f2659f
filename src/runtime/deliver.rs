//! The engine's [`Dispatch`]: republish a due message to its route's target,
//! and send unroutable ones to the route's unroutable destination.

use std::collections::HashMap;
use std::sync::Arc;

use delayd_adapters::{BoxFuture, Message, PublishOutcome, SinkError};

use crate::engine::{Dispatch, Fired, Outcome};
use crate::route::{rewrite, Destination, Route};

use super::brokers::Brokers;

/// Publish attempts against a missing exchange before the message is parked
/// as unroutable (with the default back-off, about 6 s).
const MISSING_TARGET_ATTEMPTS: u32 = 6;

pub struct Deliverer {
    pub routes: Arc<HashMap<String, Arc<Route>>>,
    pub brokers: Brokers,
}

impl Dispatch for Deliverer {
    fn deliver(&self, fired: Fired) -> BoxFuture<'static, Outcome> {
        let route = self.routes.get(&*fired.route).cloned();
        let brokers = self.brokers.clone();
        Box::pin(async move {
            let Some(route) = route else {
                return Outcome::Retry(format!(
                    "route {:?} is no longer in the config; the message waits until it is back",
                    fired.route
                ));
            };
            let mut message = match delayd_adapters::decode(&fired.message) {
                Ok(m) => m,
                Err(e) => {
                    // Our own encoding failed to decode: keep the raw bytes visible.
                    let mut raw = Message::with_body(fired.message.clone());
                    rewrite::with_error(
                        &mut raw,
                        &format!("stored message cannot be decoded: {e}"),
                    );
                    return park(&brokers, &route.unroutable, &raw, &route, "unroutable").await;
                }
            };
            rewrite::for_delivery(&mut message, fired.id);
            let target = route.target_for(&message);
            let span = tracing::debug_span!("deliver", id = fired.id, route = %route.name());
            let _enter = span.enter();
            match brokers.publish(&route.to.broker, &message, &target).await {
                Ok(PublishOutcome::Delivered) => {
                    metrics::counter!("delayd_fired_total", "route" => route.name().to_owned())
                        .increment(1);
                    tracing::debug!("delivered");
                    Outcome::Done
                }
                Ok(PublishOutcome::Unroutable) => {
                    let key = target
                        .routing_key
                        .as_deref()
                        .unwrap_or(&message.routing_key);
                    let reason = format!(
                        "unroutable: exchange {:?} has no queue bound for routing key {key:?}",
                        target.destination
                    );
                    tracing::warn!(id = fired.id, %reason, "message unroutable");
                    rewrite::with_error(&mut message, &reason);
                    park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                }
                Err(SinkError::Transient(e))
                    if e.contains("NOT_FOUND") && fired.attempt + 1 >= MISSING_TARGET_ATTEMPTS =>
                {
                    // The target exchange has been missing for several attempts:
                    // an unknown target, not a blip during a redeploy.
                    let reason = format!("unknown target: {e}");
                    tracing::warn!(id = fired.id, %reason, "target missing; parking the message");
                    rewrite::with_error(&mut message, &reason);
                    park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                }
                Err(SinkError::Transient(e)) => Outcome::Retry(e),
                Err(SinkError::Permanent(e)) => {
                    let reason = format!("cannot publish: {e}");
                    tracing::warn!(id = fired.id, %reason, "message cannot be published");
                    rewrite::with_error(&mut message, &reason);
                    park(&brokers, &route.unroutable, &message, &route, "unroutable").await
                }
            }
        })
    }
}

/// Publish to an invalid/unroutable destination, counting it.
pub async fn park(
    brokers: &Brokers,
    dest: &Destination,
    message: &Message,
    route: &Route,
    kind: &'static str,
) -> Outcome {
    if let Some(queue) = &dest.declare_queue {
        if let Err(e) = brokers.declare_queue(&dest.broker, queue).await {
            return Outcome::Retry(format!("cannot declare {kind} queue {queue:?}: {e:#}"));
        }
    }
    match brokers.publish(&dest.broker, message, &dest.target).await {
        Ok(PublishOutcome::Delivered) => {
            metrics::counter!(format!("delayd_{kind}_total"), "route" => route.name().to_owned())
                .increment(1);
            Outcome::Done
        }
        Ok(PublishOutcome::Unroutable) => Outcome::Retry(format!(
            "the {kind} destination {:?} is itself unroutable",
            dest.target
        )),
        Err(e) => Outcome::Retry(format!("cannot publish to the {kind} destination: {e}")),
    }
}
