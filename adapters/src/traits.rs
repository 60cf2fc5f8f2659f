//! The contracts between delayd's core and a broker adapter.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::message::Message;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Whether a publish may still be sent (see [`Sink::publish_fenced`]).
pub type Fence = Arc<dyn Fn() -> bool + Send + Sync>;

/// Why a fenced publish was not sent.
pub const FENCED: &str = "not sent: its fence fell (the route moved to another instance)";

/// Where a message is published: an AMQP exchange (with routing key) or a
/// Kafka topic (the routing key is then unused).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// Exchange name (AMQP; `""` is the default exchange) or topic (Kafka).
    pub destination: String,
    /// AMQP routing key. `None` keeps the message's own routing key.
    pub routing_key: Option<String>,
}

impl Target {
    pub fn exchange(name: impl Into<String>) -> Self {
        Self {
            destination: name.into(),
            routing_key: None,
        }
    }

    /// A target that publishes straight to a queue through the default exchange.
    pub fn queue(name: impl Into<String>) -> Self {
        Self {
            destination: String::new(),
            routing_key: Some(name.into()),
        }
    }
}

/// Settles one consumed message with its broker.
pub trait AckHandle: Send {
    /// The message is safe with delayd: the broker may forget it.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>>;
    /// delayd could not take the message now: the broker keeps it and redelivers.
    fn requeue(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>>;
}

/// One message taken from a source, to be acknowledged once it is durable.
pub struct Delivery {
    pub message: Message,
    /// The broker says it may have delivered this message before.
    pub redelivered: bool,
    /// The source's channel session it came on (AMQP: one per channel set
    /// up, counting from 1; Kafka: 0). A broker redelivers only what an
    /// earlier session left unsettled, so a redelivery can repeat only a
    /// delivery of an earlier session.
    pub session: u64,
    pub ack: Box<dyn AckHandle>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("message", &self.message)
            .field("redelivered", &self.redelivered)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    /// The broker connection is gone. From an ack: the ack was not sent,
    /// so the broker will redeliver the message.
    #[error("broker connection lost: {0}")]
    Connection(String),
    /// An ack was sent, and the broker may or may not have applied it (the
    /// channel failed before answering a method sent after it).
    #[error("ack in doubt: {0}")]
    AckInDoubt(String),
    #[error("source closed")]
    Closed,
    #[error("{0}")]
    Other(String),
}

/// Whether a source is consuming, shared with whoever reports readiness.
/// AMQP: its queue, exchange and binding are declared and its consumer is
/// registered (or deliberately paused) on a live channel. Kafka: it is
/// subscribed (records wait in the topic until the group assigns them).
#[derive(Debug, Clone, Default)]
pub struct Consuming(Arc<ConsumingState>);

#[derive(Debug, Default)]
struct ConsumingState {
    on: AtomicBool,
    /// Messages a stream's retention removed before they were read.
    truncated: AtomicU64,
}

impl Consuming {
    pub fn set(&self, on: bool) {
        self.0.on.store(on, Ordering::Release);
    }

    pub fn get(&self) -> bool {
        self.0.on.load(Ordering::Acquire)
    }

    /// A stream ingress found `lost` offsets removed by retention before
    /// delayd read them. The route stays unready until a restart.
    pub fn set_truncated(&self, lost: u64) {
        self.0.truncated.fetch_add(lost, Ordering::AcqRel);
    }

    /// Messages lost to a stream's retention so far (0: none).
    pub fn truncated(&self) -> u64 {
        self.0.truncated.load(Ordering::Acquire)
    }
}

/// A stream of deliveries from one route's ingress (queue or topics).
/// Implementations reconnect on their own; `next` only returns an error when
/// the source is shut down or cannot recover.
pub trait Source: Send {
    fn next(&mut self) -> BoxFuture<'_, Result<Delivery, SourceError>>;
    /// Stop taking new messages from the broker (backpressure); messages wait there.
    fn pause(&mut self) -> BoxFuture<'_, Result<(), SourceError>>;
    /// Resume after [`Source::pause`].
    fn resume(&mut self) -> BoxFuture<'_, Result<(), SourceError>>;
    /// The source's consuming state, to watch from elsewhere.
    fn consuming(&self) -> Consuming;
    /// Stop for good once every delivery handed out has been settled:
    /// commit what can be committed and leave the broker cleanly.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

/// What the broker did with a published message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Confirmed and routed to at least one queue (or written to the topic).
    Delivered,
    /// Confirmed, but the broker could not route it (AMQP `basic.return`, unknown topic).
    Unroutable,
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Worth retrying: nack, timeout, a channel closed under this publish.
    #[error("transient publish failure: {0}")]
    Transient(String),
    /// The broker cannot be reached (no connection): nothing is wrong with
    /// the message, and every other publish to this broker fails the same
    /// way until it is back.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// Retrying will not help (the message is malformed for this broker).
    #[error("permanent publish failure: {0}")]
    Permanent(String),
    /// The target (exchange, topic) does not exist. It may appear soon (a
    /// deploy in progress), so the core retries a few times before parking.
    #[error("unknown target: {0}")]
    UnknownTarget(String),
}

/// Publishes messages to one broker. Safe to share between tasks.
pub trait Sink: Send + Sync {
    /// Queue `message` for `target` before returning: publishes queued in
    /// order reach the broker in that order (per AMQP routing key, per
    /// Kafka partition). The future says what the broker did with it.
    fn publish(
        &self,
        message: Message,
        target: Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>>;

    /// [`Sink::publish`], sent only if `fence` still holds when it is: a
    /// publish that waited for a channel (a broker outage) after its route
    /// moved to another instance fails as [`SinkError::Transient`] instead
    /// of adding a copy beside the next owner's. The default looks once,
    /// at the call.
    fn publish_fenced(
        &self,
        message: Message,
        target: Target,
        fence: Fence,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        if !fence() {
            return Box::pin(async { Err(SinkError::Transient(FENCED.to_owned())) });
        }
        self.publish(message, target)
    }

    /// Make sure a parking destination exists: an AMQP queue, a Kafka topic.
    fn declare_destination<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), SinkError>>;

    /// Whether `target` exists, looked up ahead of the first publish so a
    /// missing one is reported at start. A broker that cannot tell says yes.
    fn target_exists<'a>(&'a self, _target: &'a Target) -> BoxFuture<'a, Result<bool, SinkError>> {
        Box::pin(async { Ok(true) })
    }

    /// Wait (blocking) up to `timeout` for what is queued to reach the
    /// broker, before the process exits.
    fn flush(&self, _timeout: std::time::Duration) {}
}
