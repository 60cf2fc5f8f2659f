//! A route's broker-kept store, whichever broker it reads: the calls the
//! intake, the deliverer, the cancel hook and `/readyz` make on it.

use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::kafka::offsets::TopicPartition;
use delayd_adapters::{BoxFuture, Message};

use super::store::KafkaStore;
use super::stream_store::{Phase, StreamStore};
use crate::engine::{EngineError, Stored};
use crate::id::MessageId;

#[derive(Clone)]
pub enum RouteStore {
    /// A compacted state topic, restored per partition.
    Kafka(Arc<KafkaStore>),
    /// State streams, owned by one instance at a time.
    Stream(Arc<StreamStore>),
}

/// The state write owed once a message has left (delivered or parked).
pub enum PendingDone {
    Kafka(Arc<KafkaStore>, u64, TopicPartition, Vec<u8>),
    Stream(Arc<StreamStore>, u64),
}

impl PendingDone {
    pub async fn write(self) {
        match self {
            PendingDone::Kafka(store, id, tp, key) => store.done(id, tp, key).await,
            PendingDone::Stream(store, id) => store.done(id),
        }
    }
}

impl RouteStore {
    /// Store a consumed delivery here and in the broker.
    pub fn store(
        &self,
        message: &Message,
        due_ms: u64,
        uid: MessageId,
        encoded: Vec<u8>,
        redelivered: bool,
    ) -> BoxFuture<'static, Result<Stored, EngineError>> {
        // A redelivery whose original is still being written waits for it
        // (see `Engine::wait_for_original`), as `Engine::store` does.
        let (engine, route) = match self {
            RouteStore::Kafka(s) => (&s.engine, &s.route),
            RouteStore::Stream(s) => (&s.engine, &s.route),
        };
        if let Some(wait) = engine.wait_for_original(route, &encoded, redelivered) {
            let (this, message) = (self.clone(), message.clone());
            return Box::pin(async move {
                wait.await;
                this.store(&message, due_ms, uid, encoded, redelivered)
                    .await
            });
        }
        match self {
            RouteStore::Kafka(s) => s.store(message, due_ms, uid, encoded, redelivered),
            RouteStore::Stream(s) => s.store(due_ms, uid, encoded, redelivered),
        }
    }

    /// What to write once fired message `id` (decoded: `message`) has left.
    pub fn pending_done(&self, id: u64, message: &Message) -> Option<PendingDone> {
        match self {
            RouteStore::Kafka(s) => KafkaStore::key_of(message)
                .map(|(tp, key)| PendingDone::Kafka(s.clone(), id, tp, key)),
            RouteStore::Stream(s) => Some(PendingDone::Stream(s.clone(), id)),
        }
    }

    /// A pending message was cancelled (its local Done is durable):
    /// resolves once its removal from the store is durable too.
    pub fn cancelled(&self, id: u64, stored: &[u8]) -> BoxFuture<'static, Result<(), String>> {
        match self {
            RouteStore::Kafka(s) => s.cancelled(id, stored),
            RouteStore::Stream(s) => s.cancelled(id),
        }
    }

    /// Whether this instance may publish the route's due message `id` now.
    pub fn may_fire(&self, id: u64) -> bool {
        match self {
            RouteStore::Kafka(_) => true,
            RouteStore::Stream(s) => s.may_fire(id),
        }
    }

    pub fn restoring(&self) -> bool {
        match self {
            RouteStore::Kafka(s) => s.restoring(),
            RouteStore::Stream(s) => s.restoring(),
        }
    }

    /// Another instance owns the route (RabbitMQ); this one waits.
    pub fn standby(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.phase() == Phase::Standby)
    }

    /// The route's state streams are incomplete: not consumed, not ready.
    pub fn state_missing(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.state_missing())
    }

    /// Whether this instance owns the route is not known yet (RabbitMQ).
    pub fn electing(&self) -> bool {
        matches!(self, RouteStore::Stream(s) if s.phase() == Phase::Electing)
    }

    /// For `/readyz`.
    pub fn describe(&self) -> serde_json::Value {
        match self {
            RouteStore::Kafka(s) => {
                serde_json::json!({ "state_topic": s.topic(), "restoring": s.restoring() })
            }
            RouteStore::Stream(s) => serde_json::json!({
                "state_stream": s.stream(),
                "restoring": s.restoring(),
                "owner": matches!(s.phase(), Phase::Restoring | Phase::Active),
                "state_missing": s.state_missing(),
            }),
        }
    }

    /// At shutdown, once in-flight publishes are done.
    pub async fn flush(&self, timeout: Duration) {
        match self {
            RouteStore::Kafka(s) => s.flush(timeout),
            RouteStore::Stream(s) => s.flush(timeout).await,
        }
    }
}
