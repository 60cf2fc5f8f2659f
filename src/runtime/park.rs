//! Parking: a message that cannot go where it was meant to is published
//! to its route's invalid, unroutable or park destination instead (used at
//! intake and when a due message fires).

use delayd_adapters::{Message, PublishOutcome, SinkError};

use crate::engine::Outcome;
use crate::route::{Destination, Route};

use super::brokers::Brokers;

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
    let outcome = match brokers
        .publish(&dest.broker, message.clone(), dest.target.clone())
        .await
    {
        Ok(PublishOutcome::Delivered) => {
            metrics::counter!(format!("delayd_{kind}_total"), "route" => route.name().to_owned())
                .increment(1);
            Outcome::Done
        }
        Ok(PublishOutcome::Unroutable) => Outcome::Retry(format!(
            "the {kind} destination {:?} is itself unroutable",
            dest.target
        )),
        Err(SinkError::Unavailable(e)) => {
            Outcome::Unavailable(format!("cannot publish to the {kind} destination: {e}"))
        }
        Err(e) => Outcome::Retry(format!("cannot publish to the {kind} destination: {e}")),
    };
    if let (Outcome::Retry(_), Some(queue)) = (&outcome, &dest.declare_queue) {
        // Perhaps the queue was deleted: declare it again next time.
        brokers.forget_declared(&dest.broker, queue);
    }
    outcome
}
