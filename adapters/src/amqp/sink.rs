//! [`AmqpSink`]: publishes delayd's due messages to RabbitMQ with publisher
//! confirms.
//!
//! Every publish is `mandatory`, so a message no queue takes comes back as
//! `basic.return`; the publish reports [`PublishOutcome::Unroutable`] once the
//! broker has confirmed it, [`PublishOutcome::Delivered`] when it was confirmed
//! and not returned, and [`SinkError::Transient`] on a `basic.nack`, a lost
//! channel or connection, or no confirm within
//! [`SinkConfig::confirm_timeout`]. A message AMQP cannot carry (a property or
//! header name over 255 bytes, a `u64` header above `i64::MAX`) is
//! [`SinkError::Permanent`].
//!
//! # Why a pool of channels, one publish in flight on each
//!
//! RabbitMQ does not say which publish a `basic.return` belongs to: it sends
//! the return just before the confirm, and under load it coalesces confirms
//! (`basic.ack` with `multiple`). lapin hands each return to one of the
//! confirms of such a batch, which need not be the returned message's own.
//! Treating a returned message as delivered would lose it, so the sink never
//! lets two publishes share a channel at once: it keeps a pool of up to
//! [`SinkConfig::channels`] confirm-mode channels and a publish borrows one
//! for the round trip. Throughput comes from the number of channels (many
//! publishes in flight) rather than from pipelining on one channel.
//!
//! Channels are opened lazily on the shared publish connection. A channel
//! that fails (or whose publish was abandoned mid-flight) is dropped, which
//! closes it; the next publish that borrows its place opens a fresh one,
//! reconnecting if needed. While the broker is down such publishes fail fast
//! with [`SinkError::Transient`] (the connection's back-off keeps them from
//! hammering the broker) and the caller retries.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Channel, Confirmation};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::connection::{AmqpError, Broker};
use super::convert::{message_properties, short_string, ConvertError};
use super::topology::ensure_queue;
use crate::message::Message;
use crate::traits::{BoxFuture, PublishOutcome, Sink, SinkError, Target};

/// How an [`AmqpSink`] publishes.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// Publishes in flight at once, each on its own confirm-mode channel
    /// (see the module docs). Further publishes wait for a free channel.
    /// Default 128; at least 1.
    pub channels: usize,
    /// How long a publish waits for the broker's confirm before it reports
    /// [`SinkError::Transient`] (the message may then arrive twice, which
    /// delayd's at-least-once contract allows). Default 30 s.
    pub confirm_timeout: Duration,
}

impl Default for SinkConfig {
    fn default() -> Self {
        Self {
            channels: 128,
            confirm_timeout: Duration::from_secs(30),
        }
    }
}

/// A [`Sink`] publishing to one RabbitMQ broker. Share it between tasks
/// (`&self` publishes run concurrently).
pub struct AmqpSink {
    broker: Arc<Broker>,
    config: SinkConfig,
    /// One permit per pooled channel.
    permits: Semaphore,
    /// Idle slots: an open channel, or `None` for one still to be opened.
    idle: Mutex<Vec<Option<Channel>>>,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("broker", &self.broker)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn permanent(error: ConvertError) -> SinkError {
    SinkError::Permanent(error.to_string())
}

impl AmqpSink {
    /// A sink publishing on `broker` (normally
    /// [`BrokerConnections::publish`](super::BrokerConnections)). Connects
    /// lazily on the first publish.
    pub fn new(broker: Arc<Broker>, config: SinkConfig) -> Self {
        let channels = config.channels.max(1);
        Self {
            broker,
            permits: Semaphore::new(channels),
            idle: Mutex::new((0..channels).map(|_| None).collect()),
            config: SinkConfig { channels, ..config },
        }
    }

    /// The broker this sink publishes to.
    pub fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    /// Declares a durable queue (e.g. `delayd.invalid`, `delayd.unroutable`)
    /// on the publish connection. An existing queue with other arguments is
    /// accepted as it is.
    pub async fn declare_queue(&self, queue: &str) -> Result<(), AmqpError> {
        ensure_queue(&self.broker, queue).await
    }

    /// Publishes `message` to `target`; see [`Sink::publish`] and the module docs.
    pub async fn publish_message(
        &self,
        message: &Message,
        target: &Target,
    ) -> Result<PublishOutcome, SinkError> {
        let exchange = short_string(&target.destination, "exchange name").map_err(permanent)?;
        let routing_key = target
            .routing_key
            .as_deref()
            .unwrap_or(&message.routing_key);
        let routing_key = short_string(routing_key, "routing key").map_err(permanent)?;
        let properties = message_properties(message).map_err(permanent)?;

        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| SinkError::Transient("sink closed".to_owned()))?;
        let mut slot = Slot {
            sink: self,
            channel: self.take_idle(),
            in_flight: false,
        };
        let channel = match slot.channel.take() {
            Some(channel) if channel.status().connected() => channel,
            _ => self.open_channel().await?,
        };
        let channel = slot.channel.insert(channel);

        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        slot.in_flight = true;
        let confirm = channel
            .basic_publish(exchange, routing_key, options, &message.body, properties)
            .await
            .map_err(|error| self.failed(&mut slot, "basic.publish", &error))?;
        let confirmation = match tokio::time::timeout(self.config.confirm_timeout, confirm).await {
            Ok(Ok(confirmation)) => confirmation,
            Ok(Err(error)) => return Err(self.failed(&mut slot, "publisher confirm", &error)),
            Err(_) => {
                // A late confirm or return could be taken for the next
                // publish's: give this channel up.
                warn!(target = %target.destination, timeout = ?self.config.confirm_timeout,
                      "no publisher confirm in time; dropping the channel");
                slot.channel = None;
                return Err(SinkError::Transient(format!(
                    "no publisher confirm within {:?}",
                    self.config.confirm_timeout
                )));
            }
        };
        slot.in_flight = false;
        match confirmation {
            Confirmation::Ack(None) => Ok(PublishOutcome::Delivered),
            Confirmation::Ack(Some(returned)) => {
                debug!(exchange = %target.destination, routing_key = %returned.delivery.routing_key,
                       reply_code = returned.reply_code, reply_text = %returned.reply_text,
                       "message returned as unroutable");
                Ok(PublishOutcome::Unroutable)
            }
            Confirmation::Nack(_) => Err(SinkError::Transient(
                "broker nacked the message (basic.nack)".to_owned(),
            )),
            Confirmation::NotRequested => {
                slot.channel = None;
                Err(SinkError::Transient(
                    "channel was not in confirm mode".to_owned(),
                ))
            }
        }
    }

    fn take_idle(&self) -> Option<Channel> {
        // A permit guarantees an idle slot; a poisoned lock only means another
        // publish panicked while pushing, the list itself is intact.
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.pop().flatten()
    }

    fn put_idle(&self, channel: Option<Channel>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(channel);
    }

    async fn open_channel(&self) -> Result<Channel, SinkError> {
        let channel = self
            .broker
            .try_channel()
            .await
            .map_err(|error| SinkError::Transient(error.to_string()))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|error| SinkError::Transient(format!("confirm.select failed: {error}")))?;
        debug!(endpoint = %self.broker.endpoint(), "publisher channel open");
        Ok(channel)
    }

    /// The channel failed under a publish: drop it and report a transient error.
    fn failed(&self, slot: &mut Slot<'_>, what: &str, error: &lapin::Error) -> SinkError {
        if self.broker.is_connected() {
            // The broker closed this channel (e.g. the exchange does not exist).
            warn!(endpoint = %self.broker.endpoint(), %error, "{what} failed; reopening the channel");
        } else {
            // Connection loss: logged once by the broker connection, not per publish.
            debug!(endpoint = %self.broker.endpoint(), %error, "{what} failed; connection down");
        }
        slot.channel = None;
        slot.in_flight = false;
        SinkError::Transient(format!("{what} failed: {error}"))
    }
}

/// A borrowed pool slot; goes back to the pool when dropped. A channel whose
/// publish is still unconfirmed (the future was dropped) is not reused.
struct Slot<'a> {
    sink: &'a AmqpSink,
    channel: Option<Channel>,
    in_flight: bool,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let channel = if self.in_flight {
            None
        } else {
            self.channel.take()
        };
        self.sink.put_idle(channel);
    }
}

impl Sink for AmqpSink {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        target: &'a Target,
    ) -> BoxFuture<'a, Result<PublishOutcome, SinkError>> {
        Box::pin(self.publish_message(message, target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::connection::BrokerOptions;

    fn unreachable_sink() -> AmqpSink {
        let mut options = BrokerOptions::named("test");
        options.backoff_initial = Duration::from_secs(60);
        // Port 1 on localhost: connection refused at once.
        let broker = Broker::new("amqp://guest:guest@127.0.0.1:1/%2f", options).unwrap();
        AmqpSink::new(Arc::new(broker), SinkConfig::default())
    }

    #[tokio::test]
    async fn broker_down_is_transient_and_backs_off() {
        let sink = unreachable_sink();
        let message = Message::with_body("x");
        for _ in 0..3 {
            let outcome = sink.publish(&message, &Target::queue("q")).await;
            assert!(
                matches!(outcome, Err(SinkError::Transient(_))),
                "{outcome:?}"
            );
        }
        // Every slot went back to the pool.
        assert_eq!(sink.permits.available_permits(), sink.config.channels);
        assert_eq!(sink.idle.lock().unwrap().len(), sink.config.channels);
    }

    #[tokio::test]
    async fn messages_amqp_cannot_carry_are_permanent() {
        let sink = unreachable_sink();
        let mut message = Message::with_body("x");
        message.routing_key = "k".repeat(256);
        let outcome = sink.publish(&message, &Target::exchange("x")).await;
        assert!(
            matches!(outcome, Err(SinkError::Permanent(_))),
            "{outcome:?}"
        );

        let mut message = Message::with_body("x");
        message
            .headers
            .insert("big", crate::message::Value::U64(u64::MAX));
        let outcome = sink.publish(&message, &Target::queue("q")).await;
        assert!(
            matches!(outcome, Err(SinkError::Permanent(_))),
            "{outcome:?}"
        );
    }
}
