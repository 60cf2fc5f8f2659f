//! Routes: where a message comes from, when it is due, where it goes.
//! Compiled once from the config; pure logic, no broker I/O.

pub mod delay;
pub mod rewrite;

use std::time::Duration;

use delayd_adapters::{Message, Target};

use crate::config::{Config, DestinationConfig, RouteConfig};

pub use delay::InvalidDelay;

pub const DEFAULT_INVALID_QUEUE: &str = "delayd.invalid";
pub const DEFAULT_UNROUTABLE_QUEUE: &str = "delayd.unroutable";

/// Per-message target headers, honoured when the route allows overrides.
pub const X_TARGET_EXCHANGE: &str = "x-target-exchange";
pub const X_TARGET_ROUTING_KEY: &str = "x-target-routing-key";
pub const X_TARGET_TOPIC: &str = "x-target-topic";

/// A destination on a named broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub broker: String,
    pub target: Target,
    /// A queue to declare before publishing there (invalid/unroutable queues).
    pub declare_queue: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub config: RouteConfig,
    pub max_delay: Duration,
    pub to: Destination,
    pub invalid: Destination,
    pub unroutable: Destination,
}

impl Route {
    pub fn compile(route: &RouteConfig, config: &Config) -> Route {
        let to = Destination {
            broker: route.to.broker.clone(),
            target: Target {
                destination: route
                    .to
                    .exchange
                    .clone()
                    .or_else(|| route.to.topic.clone())
                    .unwrap_or_default(),
                routing_key: route.to.routing_key.clone(),
            },
            declare_queue: None,
        };
        let invalid = destination(
            route.invalid.as_ref(),
            &route.from.broker,
            DEFAULT_INVALID_QUEUE,
        );
        let unroutable = destination(
            route.unroutable.as_ref(),
            &route.to.broker,
            DEFAULT_UNROUTABLE_QUEUE,
        );
        Route {
            config: route.clone(),
            max_delay: route.max_delay.unwrap_or(config.engine.max_delay),
            to,
            invalid,
            unroutable,
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// When the message is due, from its headers.
    pub fn due(&self, message: &Message, now_ms: u64) -> Result<u64, InvalidDelay> {
        delay::due_from_headers(&message.headers, now_ms, self.max_delay)
    }

    /// The target for a due message: the route's, or the message's own
    /// `x-target-*` headers when the route allows overrides.
    pub fn target_for(&self, message: &Message) -> Target {
        let mut target = self.to.target.clone();
        if self.config.allow_target_override {
            let text = |k: &str| {
                message
                    .headers
                    .get(k)
                    .and_then(|v| v.as_text())
                    .map(str::to_owned)
            };
            if let Some(exchange) = text(X_TARGET_EXCHANGE).or_else(|| text(X_TARGET_TOPIC)) {
                target.destination = exchange;
            }
            if let Some(key) = text(X_TARGET_ROUTING_KEY) {
                target.routing_key = Some(key);
            }
        }
        target
    }
}

fn destination(
    config: Option<&DestinationConfig>,
    default_broker: &str,
    default_queue: &str,
) -> Destination {
    let Some(d) = config else {
        return Destination {
            broker: default_broker.to_owned(),
            target: Target::queue(default_queue),
            declare_queue: Some(default_queue.to_owned()),
        };
    };
    let broker = d
        .broker
        .clone()
        .unwrap_or_else(|| default_broker.to_owned());
    if let Some(queue) = &d.queue {
        return Destination {
            broker,
            target: Target::queue(queue.clone()),
            declare_queue: Some(queue.clone()),
        };
    }
    Destination {
        broker,
        target: Target {
            destination: d
                .exchange
                .clone()
                .or_else(|| d.topic.clone())
                .unwrap_or_default(),
            routing_key: d.routing_key.clone(),
        },
        declare_queue: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use delayd_adapters::Value;

    fn route(extra: &str) -> Route {
        let c = Config::from_toml_str(&format!(
            r#"
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[[routes]]
name = "r"
from = {{ broker = "rabbit", queue = "q" }}
to = {{ broker = "rabbit", exchange = "out" }}
{extra}
"#
        ))
        .unwrap();
        Route::compile(&c.routes[0], &c)
    }

    #[test]
    fn defaults_send_bad_input_to_delayd_queues() {
        let r = route("");
        assert_eq!(r.invalid.target, Target::queue("delayd.invalid"));
        assert_eq!(r.unroutable.target, Target::queue("delayd.unroutable"));
        assert_eq!(r.to.target, Target::exchange("out"));
    }

    #[test]
    fn target_override_needs_permission() {
        let mut m = Message::default();
        m.headers
            .insert(X_TARGET_EXCHANGE, Value::LongString(b"elsewhere".to_vec()));
        m.headers
            .insert(X_TARGET_ROUTING_KEY, Value::LongString(b"k".to_vec()));
        assert_eq!(route("").target_for(&m), Target::exchange("out"));
        let allowed = route("allow_target_override = true");
        assert_eq!(
            allowed.target_for(&m),
            Target {
                destination: "elsewhere".into(),
                routing_key: Some("k".into())
            }
        );
    }
}
