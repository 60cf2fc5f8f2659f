//! One route's intake: consume, work out the due time, store durably, and
//! only then acknowledge. Bad input goes to the route's invalid destination.
//!
//! Records are queued for the WAL in the order they are consumed (the wait
//! for durability runs concurrently), so messages due at the same time keep
//! their source order. A Kafka tombstone on a `cancel_on_tombstone` route
//! waits for every earlier record to be stored, then cancels by key.
//!
//! In retry mode a message out of attempts goes to the park destination.

use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::{AckHandle, BoxFuture, Delivery, Source, SourceError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::engine::{Admission, Engine, EngineError, Outcome, Pressure, Stored};
use crate::route::{rewrite, Destination, Plan, Route};
use crate::wal::WalError;

use super::backpressure::Backpressure;
use super::brokers::Brokers;
use super::deliver::park;

/// A delivery whose WAL record is queued (or that is invalid, or that must
/// go back to the broker).
enum Started {
    Storing {
        message: delayd_adapters::Message,
        due: u64,
        stored: BoxFuture<'static, Result<Stored, EngineError>>,
        /// Counts against `max_pending` until the record is armed.
        admission: Admission,
        ack: Box<dyn AckHandle>,
    },
    Invalid {
        message: delayd_adapters::Message,
        ack: Box<dyn AckHandle>,
    },
    /// Retry mode, out of attempts.
    Park {
        message: delayd_adapters::Message,
        ack: Box<dyn AckHandle>,
    },
    /// At a backpressure limit.
    Refused {
        why: Pressure,
        ack: Box<dyn AckHandle>,
    },
}
/// While paused, how often the intake looks whether it may resume.
const RECHECK: Duration = Duration::from_millis(100);

pub struct Intake {
    pub route: Arc<Route>,
    pub engine: Engine,
    pub brokers: Brokers,
    /// Deliveries being stored at once (group commit batches them).
    pub concurrency: usize,
    /// Cancelled when the process must stop because the WAL failed.
    pub fatal: CancellationToken,
    /// Shared backpressure state (limits, full disk, paused routes).
    pub pressure: Arc<Backpressure>,
}

impl Intake {
    /// Consume until `stop`, then wait for the deliveries being stored.
    ///
    /// Backpressure: at a limit the source is paused (deliveries it had
    /// already received still come through and are stored if there is room,
    /// else returned to the broker); once relieved it resumes.
    pub async fn run(self, mut source: Box<dyn Source>, stop: CancellationToken) {
        let permits = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let this = Arc::new(self);
        let route = this.route.name().to_owned();
        let mut paused: Option<Pressure> = None;
        this.pressure.set_paused(&route, None);
        loop {
            paused = this.apply_backpressure(&mut *source, paused).await;
            let delivery = tokio::select! {
                d = source.next() => d,
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(RECHECK), if paused.is_some() => continue,
            };
            let delivery = match delivery {
                Ok(d) => d,
                Err(SourceError::Closed) => break,
                Err(e) => {
                    tracing::warn!(route = %route, error = %e, "source error");
                    continue;
                }
            };
            if this.is_cancel(&delivery) {
                // Every earlier record must be stored before the cancel looks.
                let Ok(all) = permits.acquire_many(this.concurrency.max(1) as u32).await else {
                    break;
                };
                this.cancel_by_tombstone(delivery).await;
                drop(all);
                continue;
            }
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let span = tracing::debug_span!(
                "intake",
                route = %route,
                redelivered = delivery.redelivered,
                message_id = delivery.message.properties.message_id.as_deref().unwrap_or(""),
            );
            let started = span.in_scope(|| this.start(delivery));
            let this = this.clone();
            tokio::spawn(
                async move {
                    this.finish(started).await;
                    drop(permit);
                }
                .instrument(span),
            );
        }
        if let Err(e) = source.pause().await {
            tracing::debug!(error = %e, "pausing source at shutdown");
        }
        // Deliveries already taken finish storing and get acked.
        let _ = permits.acquire_many(this.concurrency.max(1) as u32).await;
        this.pressure.set_paused(&route, None);
        source.close().await;
    }

    /// Pause the source at a limit, resume it once relieved. Returns the
    /// new state (why it is paused, or `None`).
    async fn apply_backpressure(
        &self,
        source: &mut dyn Source,
        paused: Option<Pressure>,
    ) -> Option<Pressure> {
        let route = self.route.name();
        match paused {
            None => {
                let why = self.pressure.reason(&self.engine)?;
                tracing::warn!(route, reason = %why, pending = self.engine.pending(), "backpressure: pausing consumption; messages wait in the broker");
                if let Err(e) = source.pause().await {
                    tracing::warn!(route, error = %e, "cannot pause the source");
                }
                self.pressure.set_paused(route, Some(why));
                Some(why)
            }
            Some(why) => {
                if !self.pressure.relieved(&self.engine, why) {
                    return Some(why);
                }
                tracing::info!(route, reason = %why, pending = self.engine.pending(), "backpressure relieved: resuming consumption");
                if let Err(e) = source.resume().await {
                    tracing::warn!(route, error = %e, "cannot resume the source");
                    return Some(why);
                }
                self.pressure.set_paused(route, None);
                None
            }
        }
    }

    fn is_cancel(&self, delivery: &Delivery) -> bool {
        self.route.config.cancel_on_tombstone
            && delivery.message.null_value
            && delivery.message.key.is_some()
    }

    /// A tombstone: cancel the pending messages with its key, then ack it.
    async fn cancel_by_tombstone(&self, delivery: Delivery) {
        let route = self.route.name();
        let key = delivery.message.key.clone().unwrap_or_default();
        match self.engine.cancel_by_key(route, &key).await {
            // Every match being published already: too late, as with DELETE.
            Ok(_) | Err(EngineError::InFlight(_)) => {
                tracing::debug!(route, "tombstone");
                if let Err(e) = delivery.ack.ack().await {
                    tracing::warn!(route, error = %e, "ack of tombstone failed");
                }
            }
            Err(e) => {
                tracing::error!(route, error = %e, "cannot cancel by tombstone; it will be read again");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = delivery.ack.requeue().await;
            }
        }
    }

    /// Work out the due time and queue the WAL record, in consumption order.
    fn start(&self, delivery: Delivery) -> Started {
        let route = self.route.name();
        let Delivery {
            mut message,
            redelivered,
            ack,
        } = delivery;
        let now = self.engine.now_ms();
        match self.route.plan(&mut message, now) {
            Ok(Plan::Park) => Started::Park { message, ack },
            Ok(Plan::Due(due)) => {
                // At a limit the message goes back to the broker; the intake
                // loop pauses the source before taking more.
                let admission = match self.engine.admit() {
                    Ok(a) => a,
                    Err(why) => return Started::Refused { why, ack },
                };
                let encoded = delayd_adapters::encode(&message);
                let stored = self.engine.store(route, due, encoded, redelivered);
                Started::Storing {
                    message,
                    due,
                    stored: Box::pin(stored),
                    admission,
                    ack,
                }
            }
            Err(reason) => {
                tracing::warn!(route, %reason, "invalid delay; sending to the invalid destination");
                rewrite::with_error(&mut message, &reason.to_string());
                Started::Invalid { message, ack }
            }
        }
    }

    /// Wait for the record to be durable, then ack (or park, or requeue).
    async fn finish(&self, started: Started) {
        let route = self.route.name();
        let (mut message, due, stored, admission, ack) = match started {
            Started::Invalid { message, ack } => return self.reject(message, ack).await,
            Started::Park { message, ack } => {
                tracing::info!(route, "out of retry attempts; parking the message");
                return self
                    .send_aside(message, ack, &self.route.park, "parked")
                    .await;
            }
            Started::Refused { why, ack } => {
                tracing::debug!(route, reason = %why, "at a backpressure limit; returning the message to the broker");
                metrics::counter!("delayd_backpressure_requeued_total", "route" => route.to_owned())
                    .increment(1);
                if let Err(e) = ack.requeue().await {
                    tracing::warn!(route, error = %e, "requeue failed; the broker redelivers the message");
                }
                return;
            }
            Started::Storing {
                message,
                due,
                stored,
                admission,
                ack,
            } => (message, due, stored, admission, ack),
        };
        let result = stored.await;
        drop(admission);
        match result {
            Ok(stored) => {
                self.pressure.stored();
                if let Stored::New(id) = stored {
                    metrics::counter!("delayd_scheduled_total", "route" => route.to_owned())
                        .increment(1);
                    tracing::debug!(route, id, due, "scheduled");
                }
                match ack.ack().await {
                    Ok(()) => {
                        if let Stored::New(id) = stored {
                            self.engine.confirm_ack(id);
                        }
                    }
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
            Err(EngineError::Wal(WalError::DiskFull(dir))) => {
                tracing::error!(route, dir = %dir.display(), "DISK FULL: cannot store message; returning it to the broker");
                metrics::counter!("delayd_store_failures_total", "route" => route.to_owned())
                    .increment(1);
                self.pressure.disk_full();
                let _ = ack.requeue().await;
            }
            Err(EngineError::Wal(e)) if e.is_fatal() => {
                tracing::error!(route, error = %e, "WAL failed; stopping");
                let _ = ack.requeue().await;
                self.fatal.cancel();
            }
            Err(e) => {
                // A passing failure: the broker keeps it.
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
        self.send_aside(message, ack, &self.route.invalid, "invalid")
            .await
    }

    /// Publish to an invalid or park destination (`kind` names it in logs
    /// and the `delayd_{kind}_total` metric); ack only once that is confirmed.
    async fn send_aside(
        &self,
        message: delayd_adapters::Message,
        ack: Box<dyn delayd_adapters::AckHandle>,
        dest: &Destination,
        kind: &'static str,
    ) {
        match park(&self.brokers, dest, &message, &self.route, kind).await {
            Outcome::Done => {
                if let Err(e) = ack.ack().await {
                    tracing::warn!(route = %self.route.name(), error = %e, kind, "ack of message sent aside failed");
                }
            }
            Outcome::Retry(reason) | Outcome::Unavailable(reason) => {
                tracing::error!(route = %self.route.name(), %reason, kind, "cannot publish the message aside; requeueing it");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = ack.requeue().await;
            }
        }
    }
}
