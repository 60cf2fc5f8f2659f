//! Routes: where a message comes from, when it is due, where it goes.
//! Compiled once from the config; pure logic, no broker I/O.

pub mod bridge;
pub mod clock;
pub mod delay;
pub mod handoff;
pub mod retry;
pub mod rewrite;
pub mod ttl;

use std::time::Duration;

use delayd_adapters::{Message, Target, Value};

use crate::config::{BrokerConfig, Config, DelayFrom, DestinationConfig, Mode, RouteConfig};
use crate::id::MessageId;

pub use delay::InvalidDelay;
pub use ttl::InvalidTtl;

pub const DEFAULT_INVALID_QUEUE: &str = "delayd.invalid";
pub const DEFAULT_UNROUTABLE_QUEUE: &str = "delayd.unroutable";
pub const DEFAULT_PARK_QUEUE: &str = "delayd.parked";

/// Why a message cannot be scheduled: it goes to the invalid destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unschedulable {
    #[error(transparent)]
    Delay(#[from] InvalidDelay),
    #[error(transparent)]
    Ttl(#[from] InvalidTtl),
    /// The WAL could store them but never read them back.
    #[error(transparent)]
    Headers(#[from] delayd_adapters::CodecError),
}

/// What intake does with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Store it, due at this epoch ms.
    Due(u64),
    /// Retry mode, out of attempts: send it to the park destination now.
    Park,
}

/// Per-message target headers, honoured when the route allows overrides.
pub const X_TARGET_EXCHANGE: &str = "x-target-exchange";
pub const X_TARGET_ROUTING_KEY: &str = "x-target-routing-key";
pub const X_TARGET_TOPIC: &str = "x-target-topic";

/// Which protocol a broker speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    Amqp,
    Kafka,
}

impl BrokerKind {
    fn of(config: &Config, broker: &str) -> BrokerKind {
        match config.broker(broker) {
            Some(BrokerConfig::Kafka { .. }) => BrokerKind::Kafka,
            _ => BrokerKind::Amqp,
        }
    }
}

/// A destination on a named broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub broker: String,
    pub target: Target,
    /// A queue to declare (AMQP) or topic to create (Kafka) before publishing
    /// there (the default invalid/unroutable destinations).
    pub declare_queue: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub config: RouteConfig,
    pub from_kind: BrokerKind,
    pub to_kind: BrokerKind,
    pub max_delay: Duration,
    pub to: Destination,
    pub invalid: Destination,
    pub unroutable: Destination,
    /// Where retry mode parks a message after its last attempt.
    pub park: Destination,
    pub mode: RouteMode,
}

/// How a route computes due times and rewrites due messages, compiled from
/// its `mode` and the keys that go with it.
#[derive(Debug, Clone)]
pub enum RouteMode {
    /// `x-delay` / `x-deliver-at`; republished with `x-delay` negated.
    Delay,
    /// The `expiration` property and/or the route's TTL; dead-lettered as
    /// RabbitMQ would, naming `dead_letter_queue` in `x-death`.
    Ttl {
        message_ttl: Option<Duration>,
        dead_letter_queue: String,
    },
    /// Back-off by attempt, parked after the last one.
    Retry(retry::Policy),
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
            config,
            route.invalid.as_ref(),
            &route.from.broker,
            DEFAULT_INVALID_QUEUE,
        );
        let unroutable = destination(
            config,
            route.unroutable.as_ref(),
            &route.to.broker,
            DEFAULT_UNROUTABLE_QUEUE,
        );
        let park = destination(
            config,
            route.park.as_ref(),
            &route.from.broker,
            DEFAULT_PARK_QUEUE,
        );
        Route {
            config: route.clone(),
            from_kind: BrokerKind::of(config, &route.from.broker),
            to_kind: BrokerKind::of(config, &route.to.broker),
            max_delay: route.max_delay.unwrap_or(config.engine.max_delay),
            to,
            invalid,
            unroutable,
            park,
            mode: match route.mode {
                Mode::Delay => RouteMode::Delay,
                Mode::Ttl => RouteMode::Ttl {
                    message_ttl: route.message_ttl,
                    dead_letter_queue: route
                        .dead_letter_queue
                        .clone()
                        .or_else(|| route.from.queue.clone())
                        .unwrap_or_default(),
                },
                // Validation guarantees a policy; without one, park at once.
                Mode::Retry => RouteMode::Retry(route.retry.as_ref().map_or(
                    retry::Policy {
                        backoff: retry::Backoff::List(Vec::new()),
                        max_attempts: 1,
                        work_queue: None,
                    },
                    retry::Policy::from_config,
                )),
            },
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// When the message is due, by the route's mode. Retry mode may instead
    /// park it, and writes the new attempt number (and the park reason and
    /// count) on the message. Delays and TTLs count from the route's
    /// `delay_from` (see [`clock`]); `now_ms` is delayd's clock.
    pub fn plan(&self, message: &mut Message, now_ms: u64) -> Result<Plan, Unschedulable> {
        delayd_adapters::check_nesting(&message.headers)?;
        let since = match self.config.delay_from {
            DelayFrom::Broker => {
                clock::watch_skew(self.name(), message, now_ms);
                clock::counts_from(message, now_ms)
            }
            DelayFrom::Intake => now_ms,
        };
        match &self.mode {
            RouteMode::Delay => Ok(Plan::Due(delay::due_from_headers(
                &message.headers,
                since,
                self.max_delay,
            )?)),
            RouteMode::Ttl { message_ttl, .. } => Ok(Plan::Due(ttl::due(
                message.properties.expiration.as_deref(),
                *message_ttl,
                since,
                self.max_delay,
            )?)),
            RouteMode::Retry(policy) => Ok(
                match policy.decide(&message.headers, retry::random_unit()) {
                    retry::Decision::Retry { delay, attempt } => {
                        message
                            .headers
                            .insert(retry::X_DELAYD_ATTEMPT, Value::I64(attempt as i64));
                        let delay = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
                        Plan::Due(now_ms.saturating_add(delay))
                    }
                    retry::Decision::Park { attempts } => {
                        let reason = format!(
                            "gave up after {attempts} failed attempts (retry.max_attempts = {})",
                            policy.max_attempts
                        );
                        message.headers.insert(
                            retry::X_DELAYD_PARK_REASON,
                            Value::LongString(reason.into_bytes()),
                        );
                        message
                            .headers
                            .insert(retry::X_DELAYD_ATTEMPTS, Value::I64(attempts as i64));
                        Plan::Park
                    }
                },
            ),
        }
    }

    /// Rewrite a due message for republishing, by the route's mode.
    pub fn for_delivery(&self, message: &mut Message, id: MessageId, now_ms: u64) {
        match &self.mode {
            RouteMode::Delay => rewrite::for_delivery(message, id),
            RouteMode::Ttl {
                dead_letter_queue, ..
            } => {
                ttl::dead_letter(
                    message,
                    ttl::Death {
                        queue: dead_letter_queue,
                        reason: ttl::EXPIRED,
                        time_s: now_ms / 1000,
                        replaces_routing_key: self.to.target.routing_key.is_some(),
                    },
                );
                rewrite::add_id(message, id);
            }
            RouteMode::Retry(_) => rewrite::add_id(message, id),
        }
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

/// A parking destination. The default is a queue (AMQP) or a topic (Kafka)
/// named `default_queue`, which delayd declares or creates.
fn destination(
    all: &Config,
    config: Option<&DestinationConfig>,
    default_broker: &str,
    default_queue: &str,
) -> Destination {
    let Some(d) = config else {
        let target = match BrokerKind::of(all, default_broker) {
            BrokerKind::Amqp => Target::queue(default_queue),
            BrokerKind::Kafka => Target::exchange(default_queue),
        };
        return Destination {
            broker: default_broker.to_owned(),
            target,
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
    // A Kafka parking topic is created when missing, like the default one.
    let declare_queue = match BrokerKind::of(all, &broker) {
        BrokerKind::Kafka => d.topic.clone(),
        BrokerKind::Amqp => None,
    };
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
        declare_queue,
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
    fn ttl_route_plans_from_expiration_and_dead_letters_with_its_queue() {
        let r = route("mode = \"ttl\"\nmessage_ttl = \"2s\"");
        let mut m = Message::with_body("x");
        m.properties.expiration = Some("500".into());
        assert_eq!(r.plan(&mut m, 1000), Ok(Plan::Due(1500)));
        r.for_delivery(&mut m, MessageId::legacy(7), 5_000_000);
        assert_eq!(m.properties.expiration, None);
        assert_eq!(
            m.headers
                .get(ttl::X_LAST_DEATH_QUEUE)
                .and_then(Value::as_text),
            Some("q")
        );
        assert!(m.headers.get(rewrite::X_DELAYD_ID).is_some());
        // x-death's time is in seconds.
        let Some(Value::Array(deaths)) = m.headers.get(ttl::X_DEATH) else {
            panic!("no x-death: {:?}", m.headers);
        };
        let Value::Table(death) = &deaths[0] else {
            panic!("x-death entry {:?}", deaths[0]);
        };
        assert_eq!(death.get("time"), Some(&Value::Timestamp(5_000)));
        let mut bad = Message::with_body("x");
        bad.properties.expiration = Some("soon".into());
        assert!(matches!(
            r.plan(&mut bad, 0),
            Err(Unschedulable::Ttl(InvalidTtl::Expiration(_)))
        ));
    }

    #[test]
    fn retry_route_marks_the_attempt_or_parks() {
        let r = route("mode = \"retry\"\n[routes.retry]\ndelays = [\"1s\"]\nmax_attempts = 2");
        assert_eq!(r.park.target, Target::queue(DEFAULT_PARK_QUEUE));
        let mut m = Message::with_body("x");
        assert_eq!(r.plan(&mut m, 0), Ok(Plan::Due(1000)));
        assert_eq!(m.headers.get(retry::X_DELAYD_ATTEMPT), Some(&Value::I64(2)));
        // Attempt 2 failed too: out of attempts.
        assert_eq!(r.plan(&mut m, 0), Ok(Plan::Park));
        assert_eq!(
            m.headers.get(retry::X_DELAYD_ATTEMPTS),
            Some(&Value::I64(2))
        );
        assert!(m.headers.get(retry::X_DELAYD_PARK_REASON).is_some());
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

    /// Kafka allows a header name more than once; the last one wins, as
    /// Java's `Headers.lastHeader()` reads it.
    #[test]
    fn with_repeated_kafka_headers_the_last_one_wins() {
        let text = |s: &str| Value::LongString(s.as_bytes().to_vec());
        let mut m = Message {
            headers: delayd_adapters::FieldTable(vec![
                (delay::X_DELAY.into(), text("1000")),
                (X_TARGET_TOPIC.into(), text("first")),
                (X_TARGET_ROUTING_KEY.into(), text("k1")),
                (delay::X_DELAY.into(), text("5000")),
                (X_TARGET_TOPIC.into(), text("last")),
                (X_TARGET_ROUTING_KEY.into(), text("k2")),
            ]),
            ..Message::default()
        };
        let r = route("allow_target_override = true");
        assert_eq!(r.plan(&mut m, 0), Ok(Plan::Due(5000)));
        assert_eq!(
            r.target_for(&m),
            Target {
                destination: "last".into(),
                routing_key: Some("k2".into())
            }
        );
        // The x-delay that counted is the one negated on the way out.
        r.for_delivery(&mut m, MessageId::legacy(1), 5000);
        assert_eq!(m.headers.0[0].1, text("1000"));
        assert_eq!(m.headers.0[3].1, Value::I32(-5000));

        let mut at = Message::default();
        at.headers
            .0
            .push((delay::X_DELIVER_AT.into(), text("2000")));
        at.headers
            .0
            .push((delay::X_DELIVER_AT.into(), text("9000")));
        assert_eq!(r.plan(&mut at, 0), Ok(Plan::Due(9000)));
    }

    /// The WAL codec refuses headers nested deeper than 64 levels when it
    /// reads them back, so intake must refuse them before they are stored:
    /// otherwise the message would be acked and could never be delivered.
    #[test]
    fn headers_too_deep_for_the_wal_are_unschedulable() {
        let nested = |levels: usize| {
            let mut v = Value::Void;
            for _ in 0..levels {
                v = Value::Table(delayd_adapters::FieldTable(vec![("t".into(), v)]));
            }
            let mut m = Message::with_body("x");
            m.headers.insert("deep", v);
            m
        };
        let r = route("");
        let mut ok = nested(64);
        assert_eq!(r.plan(&mut ok, 0), Ok(Plan::Due(0)));
        assert!(delayd_adapters::decode(&delayd_adapters::encode(&ok)).is_ok());
        let mut deep = nested(65);
        assert!(delayd_adapters::decode(&delayd_adapters::encode(&deep)).is_err());
        let e = r.plan(&mut deep, 0).unwrap_err();
        assert!(e.to_string().contains("nested deeper than 64"), "{e}");
    }

    #[test]
    fn a_kafka_source_gets_default_topics_on_its_broker() {
        let c = Config::from_toml_str(
            r#"
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[brokers.kafka]
kind = "kafka"
bootstrap = "127.0.0.1:9092"
[[routes]]
name = "from-kafka"
from = { broker = "kafka", topics = ["in"], group = "delayd" }
to = { broker = "rabbit", exchange = "out" }
"#,
        )
        .unwrap();
        let r = Route::compile(&c.routes[0], &c);
        assert_eq!(r.name(), "from-kafka");
        assert_eq!(
            (r.from_kind, r.to_kind),
            (BrokerKind::Kafka, BrokerKind::Amqp)
        );
        assert_eq!(r.invalid.broker, "kafka");
        assert_eq!(r.invalid.target, Target::exchange(DEFAULT_INVALID_QUEUE));
        assert_eq!(
            r.invalid.declare_queue.as_deref(),
            Some(DEFAULT_INVALID_QUEUE)
        );
        assert_eq!(r.unroutable.broker, "rabbit");
        assert_eq!(r.unroutable.target, Target::queue(DEFAULT_UNROUTABLE_QUEUE));
    }
}
