//! Declaring what delayd needs on a RabbitMQ broker: durable queues (a
//! route's source queue, `delayd.invalid`, `delayd.unroutable`) and a route's
//! optional source exchange bound to its queue.
//!
//! Declarations run on a short-lived channel of their own, so a refused
//! declaration (the broker closes the channel on any error) never takes down
//! a consuming or publishing channel.
//!
//! A queue that already exists with other arguments (say a quorum queue, or
//! one with a length limit) makes RabbitMQ refuse the plain durable
//! declaration with `PRECONDITION_FAILED`; delayd then only checks that the
//! queue exists and uses it as it is.

use std::fmt;
use std::str::FromStr;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{Channel, ErrorKind, ExchangeKind};
use tracing::{debug, warn};

use super::connection::{AmqpError, Broker};
use super::convert::{short_string, table_to_amqp};

/// Type of an exchange delayd declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeType {
    /// Exact routing-key match.
    Direct,
    /// Routing-key patterns (`*`, `#`). The default.
    #[default]
    Topic,
    /// Every bound queue gets every message.
    Fanout,
    /// Routing on header values.
    Headers,
    /// `x-consistent-hash` (the `rabbitmq_consistent_hash_exchange` plugin,
    /// shipped with RabbitMQ): each routing key goes to one bound queue,
    /// in proportion to the binding keys, read as weights.
    ConsistentHash,
}

impl ExchangeType {
    /// The AMQP name (`direct`, `topic`, `fanout`, `headers`).
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeType::Direct => "direct",
            ExchangeType::Topic => "topic",
            ExchangeType::Fanout => "fanout",
            ExchangeType::Headers => "headers",
            ExchangeType::ConsistentHash => "x-consistent-hash",
        }
    }

    /// The binding key DESIGN prescribes for a source exchange: `""` for
    /// fanout, `#` otherwise (which for a direct exchange matches only the
    /// routing key `#` literally: set explicit binding keys there).
    pub fn default_binding_key(self) -> &'static str {
        match self {
            ExchangeType::Fanout => "",
            // A weight: every partition's queue gets an equal share.
            ExchangeType::ConsistentHash => "1",
            _ => "#",
        }
    }

    fn kind(self) -> ExchangeKind {
        match self {
            ExchangeType::Direct => ExchangeKind::Direct,
            ExchangeType::Topic => ExchangeKind::Topic,
            ExchangeType::Fanout => ExchangeKind::Fanout,
            ExchangeType::Headers => ExchangeKind::Headers,
            ExchangeType::ConsistentHash => ExchangeKind::Custom(self.as_str().into()),
        }
    }
}

impl fmt::Display for ExchangeType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An exchange type name that is not one of the four standard ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown exchange type {0:?} (expected direct, topic, fanout, headers or x-consistent-hash)"
)]
pub struct UnknownExchangeType(pub String);

impl FromStr for ExchangeType {
    type Err = UnknownExchangeType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "direct" => Ok(ExchangeType::Direct),
            "topic" => Ok(ExchangeType::Topic),
            "fanout" => Ok(ExchangeType::Fanout),
            "headers" => Ok(ExchangeType::Headers),
            "x-consistent-hash" => Ok(ExchangeType::ConsistentHash),
            _ => Err(UnknownExchangeType(s.to_owned())),
        }
    }
}

/// Whether `error` is the broker closing the channel with `kind`.
pub(crate) fn is_soft_error(error: &lapin::Error, kind: AMQPSoftError) -> bool {
    matches!(error.kind(), ErrorKind::ProtocolError(e) if *e.kind() == AMQPErrorKind::Soft(kind))
}

fn topology_error(what: String) -> impl FnOnce(lapin::Error) -> AmqpError {
    move |source| AmqpError::Topology { what, source }
}

async fn open(broker: &Broker, what: &str) -> Result<Channel, AmqpError> {
    broker.try_channel().await.map_err(|error| {
        debug!(%error, what, "no channel for declaration");
        error
    })
}

async fn close(channel: Channel) {
    if channel.status().connected() {
        if let Err(error) = channel.close(200, "OK".into()).await {
            debug!(%error, "closing declaration channel");
        }
    }
}

/// Declares a durable queue with `arguments` on `channel`.
pub async fn declare_queue_on(
    channel: &Channel,
    queue: &str,
    arguments: &crate::FieldTable,
) -> Result<(), AmqpError> {
    let arguments = table_to_amqp(arguments)?;
    channel
        .queue_declare(
            short_string(queue, "queue name")?,
            QueueDeclareOptions::durable(),
            arguments,
        )
        .await
        .map(drop)
        .map_err(topology_error(format!("declaring queue {queue:?}")))
}

/// Declares a durable exchange of `kind` on `channel`.
pub async fn declare_exchange_on(
    channel: &Channel,
    exchange: &str,
    kind: ExchangeType,
) -> Result<(), AmqpError> {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            short_string(exchange, "exchange name")?,
            kind.kind(),
            options,
            FieldTable::default(),
        )
        .await
        .map_err(topology_error(format!(
            "declaring {kind} exchange {exchange:?}"
        )))
}

/// Binds `queue` to `exchange` with `binding_key` on `channel`.
pub async fn bind_queue_on(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    binding_key: &str,
) -> Result<(), AmqpError> {
    channel
        .queue_bind(
            short_string(queue, "queue name")?,
            short_string(exchange, "exchange name")?,
            short_string(binding_key, "binding key")?,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(topology_error(format!(
            "binding queue {queue:?} to exchange {exchange:?} with key {binding_key:?}"
        )))
}

/// Makes sure the durable queue `queue` exists (declared with `arguments`),
/// on a channel of its own. A queue that exists with other arguments is
/// accepted as it is.
pub async fn ensure_queue(
    broker: &Broker,
    queue: &str,
    arguments: &crate::FieldTable,
) -> Result<(), AmqpError> {
    let channel = open(broker, "queue").await?;
    match declare_queue_on(&channel, queue, arguments).await {
        Ok(()) => {
            close(channel).await;
            Ok(())
        }
        Err(AmqpError::Topology { source, .. })
            if is_soft_error(&source, AMQPSoftError::PRECONDITIONFAILED) =>
        {
            warn!(queue, error = %source,
                  "queue exists with other arguments than delayd's; using it as it is");
            let channel = open(broker, "queue").await?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let result = channel
                .queue_declare(
                    short_string(queue, "queue name")?,
                    passive,
                    FieldTable::default(),
                )
                .await
                .map(drop)
                .map_err(topology_error(format!("checking queue {queue:?}")));
            close(channel).await;
            result
        }
        Err(error) => Err(error),
    }
}

/// Makes sure `queue` exists and, when `exchange` is given, that the durable
/// exchange of type `kind` exists and is bound to the queue with each of
/// `binding_keys`.
pub async fn ensure_bound_queue(
    broker: &Broker,
    queue: &str,
    arguments: &crate::FieldTable,
    exchange: Option<(&str, ExchangeType, &[String])>,
) -> Result<(), AmqpError> {
    ensure_queue(broker, queue, arguments).await?;
    let Some((exchange, kind, binding_keys)) = exchange else {
        return Ok(());
    };
    let channel = open(broker, "exchange").await?;
    let result = async {
        declare_exchange_on(&channel, exchange, kind).await?;
        for key in binding_keys {
            bind_queue_on(&channel, queue, exchange, key).await?;
        }
        Ok(())
    }
    .await;
    close(channel).await;
    result
}

/// Declare `queue` and bind it to `exchange`, which must exist already and
/// is not declared (so its type and arguments stay as they are).
pub async fn bind_existing(
    broker: &Broker,
    queue: &str,
    arguments: &crate::FieldTable,
    exchange: &str,
    binding_keys: &[String],
) -> Result<(), AmqpError> {
    ensure_queue(broker, queue, arguments).await?;
    let channel = open(broker, "binding").await?;
    let mut result = Ok(());
    for key in binding_keys {
        result = bind_queue_on(&channel, queue, exchange, key).await;
        if result.is_err() {
            break;
        }
    }
    close(channel).await;
    result
}

/// Checks that `exchange` exists, without creating it.
pub async fn exchange_exists(broker: &Broker, exchange: &str) -> Result<bool, AmqpError> {
    let channel = open(broker, "exchange check").await?;
    let options = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    let result = channel
        .exchange_declare(
            short_string(exchange, "exchange name")?,
            ExchangeKind::Direct,
            options,
            FieldTable::default(),
        )
        .await;
    match result {
        Ok(()) => {
            close(channel).await;
            Ok(true)
        }
        Err(error) if is_soft_error(&error, AMQPSoftError::NOTFOUND) => Ok(false),
        Err(source) => Err(AmqpError::Topology {
            what: format!("checking exchange {exchange:?}"),
            source,
        }),
    }
}

/// What a passive `queue.declare` tells of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueState {
    /// Messages ready for delivery (not those delivered and unacked).
    pub messages: u32,
    pub consumers: u32,
}

/// `queue`'s state, or `None` if it does not exist: a passive declare on a
/// channel of its own (RabbitMQ closes the channel of one that fails).
pub async fn queue_state(broker: &Broker, queue: &str) -> Result<Option<QueueState>, AmqpError> {
    let channel = open(broker, "queue check").await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let result = channel
        .queue_declare(
            short_string(queue, "queue name")?,
            passive,
            FieldTable::default(),
        )
        .await;
    match result {
        Ok(q) => {
            close(channel).await;
            Ok(Some(QueueState {
                messages: q.message_count(),
                consumers: q.consumer_count(),
            }))
        }
        Err(error) if is_soft_error(&error, AMQPSoftError::NOTFOUND) => Ok(None),
        Err(source) => Err(AmqpError::Topology {
            what: format!("checking queue {queue:?}"),
            source,
        }),
    }
}

/// Removes the binding of `queue` to `exchange` with `binding_key` (a
/// missing binding is fine).
pub async fn unbind_queue(
    broker: &Broker,
    queue: &str,
    exchange: &str,
    binding_key: &str,
) -> Result<(), AmqpError> {
    let channel = open(broker, "unbinding").await?;
    let result = channel
        .queue_unbind(
            short_string(queue, "queue name")?,
            short_string(exchange, "exchange name")?,
            short_string(binding_key, "binding key")?,
            FieldTable::default(),
        )
        .await
        .map_err(topology_error(format!(
            "unbinding queue {queue:?} from exchange {exchange:?}"
        )));
    close(channel).await;
    result
}

/// Deletes `queue` only if it holds no message and has no consumer, which
/// the broker checks atomically: `Ok(false)` if it refused for that reason.
/// A missing queue counts as deleted.
pub async fn delete_queue_if_idle(broker: &Broker, queue: &str) -> Result<bool, AmqpError> {
    let channel = open(broker, "queue delete").await?;
    let result = channel
        .queue_delete(
            short_string(queue, "queue name")?,
            lapin::options::QueueDeleteOptions {
                if_unused: true,
                if_empty: true,
                nowait: false,
            },
        )
        .await;
    match result {
        Ok(_) => {
            close(channel).await;
            Ok(true)
        }
        Err(error) if is_soft_error(&error, AMQPSoftError::PRECONDITIONFAILED) => Ok(false),
        Err(error) if is_soft_error(&error, AMQPSoftError::NOTFOUND) => Ok(true),
        Err(source) => Err(AmqpError::Topology {
            what: format!("deleting queue {queue:?}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_types_parse_and_print() {
        for t in [
            ExchangeType::Direct,
            ExchangeType::Topic,
            ExchangeType::Fanout,
            ExchangeType::Headers,
        ] {
            assert_eq!(t.as_str().parse::<ExchangeType>(), Ok(t));
            assert_eq!(t.to_string(), t.as_str());
        }
        assert_eq!("TOPIC".parse::<ExchangeType>(), Ok(ExchangeType::Topic));
        assert!("x-delayed-message".parse::<ExchangeType>().is_err());
        assert_eq!(ExchangeType::Fanout.default_binding_key(), "");
        assert_eq!(ExchangeType::Topic.default_binding_key(), "#");
    }
}
