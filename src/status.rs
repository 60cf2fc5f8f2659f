//! What the runtime says about itself, for the admin API's `/readyz`.
//!
//! It sits below both: the runtime implements [`RuntimeStatus`] and hands
//! the admin API an `Arc<dyn RuntimeStatus>`, so the admin API never
//! imports the runtime that mounts it.

use std::collections::BTreeMap;

use crate::engine::Pressure;

/// Connection state of one broker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BrokerStatus {
    pub name: String,
    /// Consuming connection (only checked for brokers some route reads from).
    pub consume: &'static str,
    /// Publishing connection: opened on first publish, so "idle" is fine.
    pub publish: &'static str,
    pub ready: bool,
}

/// A route's intake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteIntake {
    /// Its exchange, queue, binding or consumer does not exist yet: a
    /// message published to it now could be dropped unbound.
    Starting,
    /// Broker-kept store: a partition's pending messages are being read
    /// back from the state topic before it is consumed.
    Restoring,
    /// Broker-kept store, RabbitMQ: another instance owns the route; this
    /// one waits to take over (ready: nothing is lost by waiting).
    Standby,
    /// Broker-kept store, RabbitMQ: a state stream the route's pointer
    /// names is missing; the route is not consumed rather than started
    /// without its pending messages (not ready).
    StateMissing,
    /// A stream ingress found messages its retention removed before delayd
    /// read them: they are lost. It goes on consuming, and is not ready
    /// until restarted, so someone looks.
    Truncated,
    Consuming,
}

pub trait RuntimeStatus: Send + Sync + 'static {
    /// Every broker's connections.
    fn brokers(&self) -> Vec<BrokerStatus>;
    /// Every route's intake, by route name.
    fn routes(&self) -> BTreeMap<String, RouteIntake>;
    /// Routes whose intake is paused by backpressure, and why.
    fn paused(&self) -> BTreeMap<String, Pressure>;
    /// False once shutdown has begun.
    fn accepting(&self) -> bool;
    /// Where pending messages are kept: `local`, or `broker` with each
    /// route's state topic.
    fn store(&self) -> serde_json::Value {
        serde_json::json!({ "kind": "local" })
    }
}
