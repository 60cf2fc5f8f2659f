//! One route's intake: consume, work out the due time, store durably, and
//! only then acknowledge. Bad input goes to the route's invalid destination.

use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::{Delivery, Source, SourceError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::engine::{Engine, EngineError, Outcome, Stored};
use crate::route::{rewrite, Route};
use crate::wal::WalError;

use super::brokers::Brokers;
use super::deliver::park;

pub struct Intake {
    pub route: Arc<Route>,
    pub engine: Engine,
    pub brokers: Brokers,
    /// Deliveries being stored at once (group commit batches them).
    pub concurrency: usize,
    /// Cancelled when the process must stop because the WAL failed.
    pub fatal: CancellationToken,
}

impl Intake {
    /// Consume until `stop`, then wait for the deliveries being stored.
    pub async fn run(self, mut source: Box<dyn Source>, stop: CancellationToken) {
        let permits = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let this = Arc::new(self);
        loop {
            let delivery = tokio::select! {
                d = source.next() => d,
                _ = stop.cancelled() => break,
            };
            let delivery = match delivery {
                Ok(d) => d,
                Err(SourceError::Closed) => break,
                Err(e) => {
                    tracing::warn!(route = %this.route.name(), error = %e, "source error");
                    continue;
                }
            };
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let this = this.clone();
            tokio::spawn(async move {
                this.handle(delivery).await;
                drop(permit);
            });
        }
        if let Err(e) = source.pause().await {
            tracing::debug!(error = %e, "pausing source at shutdown");
        }
        // Deliveries already taken finish storing and get acked.
        let _ = permits.acquire_many(this.concurrency.max(1) as u32).await;
    }

    async fn handle(&self, delivery: Delivery) {
        let route = self.route.name();
        let Delivery {
            mut message,
            redelivered,
            ack,
        } = delivery;
        let now = self.engine.now_ms();
        let due = match self.route.due(&message, now) {
            Ok(due) => due,
            Err(reason) => {
                tracing::warn!(route, %reason, "invalid delay; sending to the invalid destination");
                rewrite::with_error(&mut message, &reason.to_string());
                return self.reject(message, ack).await;
            }
        };
        let encoded = delayd_adapters::encode(&message);
        match self
            .engine
            .store(route, due, encoded.clone(), redelivered)
            .await
        {
            Ok(stored) => {
                if let Stored::New(id) = stored {
                    metrics::counter!("delayd_scheduled_total", "route" => route.to_owned())
                        .increment(1);
                    tracing::debug!(route, id, due, "scheduled");
                }
                match ack.ack().await {
                    Ok(()) => self.engine.confirm_ack(route, &encoded),
                    // Stored, but the broker will redeliver it: dedup catches that.
                    Err(e) => tracing::warn!(route, error = %e, "ack failed after store"),
                }
            }
            Err(EngineError::Wal(WalError::TooLarge { size, max })) => {
                let reason =
                    format!("message of {size} bytes exceeds wal.max_message_bytes ({max})");
                tracing::warn!(route, %reason, "sending to the invalid destination");
                rewrite::with_error(&mut message, &reason);
                self.reject(message, ack).await;
            }
            Err(EngineError::Wal(e)) if e.is_fatal() => {
                tracing::error!(route, error = %e, "WAL failed; stopping");
                let _ = ack.requeue().await;
                self.fatal.cancel();
            }
            Err(e) => {
                // Disk full or another passing failure: the broker keeps it.
                tracing::error!(route, error = %e, "cannot store message; requeueing it");
                metrics::counter!("delayd_store_failures_total", "route" => route.to_owned())
                    .increment(1);
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = ack.requeue().await;
            }
        }
    }

    /// Publish to the invalid destination; ack only once that is confirmed.
    async fn reject(
        &self,
        message: delayd_adapters::Message,
        ack: Box<dyn delayd_adapters::AckHandle>,
    ) {
        match park(
            &self.brokers,
            &self.route.invalid,
            &message,
            &self.route,
            "invalid",
        )
        .await
        {
            Outcome::Done => {
                if let Err(e) = ack.ack().await {
                    tracing::warn!(route = %self.route.name(), error = %e, "ack of invalid message failed");
                }
            }
            Outcome::Retry(reason) => {
                tracing::error!(route = %self.route.name(), %reason, "cannot park invalid message; requeueing it");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = ack.requeue().await;
            }
        }
    }
}
