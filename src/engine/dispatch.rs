//! The dispatcher: pops due messages, publishes them with a bounded number in
//! flight, writes Done on success and re-arms with back-off on failure.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::finisher::Finisher;
use crate::id::MessageId;
use crate::wal::{Record, WalError, WalPos};
use crate::wheel::Expired;

use super::state::Slot;
use super::{BoxFuture, Inner};

/// A due message, read back from the WAL.
#[derive(Debug, Clone)]
pub struct Fired {
    pub id: u64,
    /// The message's identity (`x-delayd-id`).
    pub uid: MessageId,
    pub route: Arc<str>,
    /// The due time it was scheduled for.
    pub due_ms: u64,
    /// When the engine handed it over (wall clock).
    pub fired_ms: u64,
    /// The encoded message, as stored.
    pub message: Vec<u8>,
    /// 0 on the first try.
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It left delayd (published, or routed to an invalid/unroutable place).
    Done,
    /// Try again later, after back-off.
    Retry(String),
    /// Not this instance's to fire any more: its route moved to another
    /// instance, which holds it too (the broker-kept store). Taken out here
    /// as [`Engine::release`](super::Engine::release) does, unsent. A
    /// publish in flight when the route moved ends this way; retried, it
    /// stayed pending here and fired again once the route came back.
    Release(String),
    /// The route's target broker cannot be reached. The route's due messages
    /// wait, in due order, while one of them probes the broker now and then
    /// (250 ms, doubling to 5 s); once a probe gets through they all go at
    /// once, in due order. Other routes are not held up.
    Unavailable(String),
}

/// Where due messages go. Implemented by the runtime with the broker sinks.
///
/// `deliver` is called in fire order (deadline, then arrival). An
/// implementation that must keep that order on the wire (Kafka per-key order)
/// enqueues the publish before returning the future.
pub trait Dispatch: Send + Sync + 'static {
    fn deliver(&self, fired: Fired) -> BoxFuture<'static, Outcome>;
}

/// Pops at most this many per lock hold, so producers are not starved.
pub(super) const BATCH: usize = 256;

pub(crate) async fn run(
    inner: Arc<Inner>,
    dispatch: Arc<dyn Dispatch>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let mut dispatcher = Dispatcher::new(inner, dispatch);
    let mut batch: Vec<Expired<Slot>> = Vec::with_capacity(BATCH);
    let mut last_gauges = 0u64;
    while !shutdown.is_cancelled() {
        // Wait for room before popping, so popped messages never queue up here.
        let first = tokio::select! {
            p = dispatcher.permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = shutdown.cancelled() => break,
        };
        let now = dispatcher.inner.clock.now_ms();
        let next = dispatcher.take_due(now, &mut batch);
        if now >= last_gauges + 1000 {
            dispatcher.inner.publish_gauges();
            last_gauges = now;
        }
        if batch.is_empty() {
            drop(first);
            if !dispatcher.sleep(now, next, &shutdown).await {
                break;
            }
            continue;
        }
        if dispatcher.fire(&mut batch, first).await.is_err() {
            return;
        }
    }
    dispatcher.drain(grace).await;
}

/// The dispatcher's limits, kept across rounds.
struct Dispatcher {
    inner: Arc<Inner>,
    dispatch: Arc<dyn Dispatch>,
    /// One per message being published (`max_in_flight`).
    permits: Arc<Semaphore>,
    /// One per byte being published (`max_bytes_in_flight`).
    bytes: Arc<Semaphore>,
    budget: usize,
    /// Paces messages that were already overdue at start-up.
    limiter: RateLimiter,
    /// Where publishes are completed (settled), together in one task.
    completing: Finisher,
}

/// A semaphore was closed: the dispatcher is going away.
struct Closed;

impl Dispatcher {
    fn new(inner: Arc<Inner>, dispatch: Arc<dyn Dispatch>) -> Self {
        let permits = Arc::new(Semaphore::new(inner.config.max_in_flight.max(1)));
        // Semaphore permits are u32: the byte budget is capped at 4 GiB.
        let budget = inner.config.max_bytes_in_flight.clamp(1, u32::MAX as usize);
        let limiter = RateLimiter::new(inner.config.overdue_rate);
        Self {
            inner,
            dispatch,
            permits,
            bytes: Arc::new(Semaphore::new(budget)),
            budget,
            limiter,
            completing: Finisher::start(),
        }
    }

    /// Under one lock hold: pop what is due (as much as there is room for),
    /// hold back what waits for an unreachable target, add due probes, and
    /// begin their flights. Returns the next deadline.
    fn take_due(&self, now: u64, batch: &mut Vec<Expired<Slot>>) -> Option<u64> {
        let mut state = self.inner.state();
        let room = self.permits.available_permits() + 1;
        // Read under the state lock: a claim closes only after its message
        // is armed, under this lock.
        let claims: Vec<(u16, (u64, u64))> = self
            .inner
            .wal
            .first_claimed_by_route()
            .into_iter()
            .filter_map(|(name, first)| Some((state.route_id(&name)?, first)))
            .collect();
        let claimed = |route: u16| claims.iter().find(|c| c.0 == route).map(|c| c.1);
        state.pop_due(now, room.min(BATCH), &claimed, batch);
        state.hold_blocked(now, batch);
        let probes = batch.len();
        state.take_probes(now, batch);
        state.begin_flights(batch, probes);
        let next = state.next_deadline();
        // Published under the lock that computed it: an appender arming
        // an earlier message after this sees it and wakes us; one that
        // armed before is in `next`. Stored after the lock, a wake-up
        // could be lost and the message be up to a second late.
        let planned = if batch.is_empty() {
            next.unwrap_or(u64::MAX)
        } else {
            0
        };
        self.inner.planned_wake.store(planned, Ordering::Release);
        drop(state);
        // Tests stop here, just after the lock, where a thread can be
        // descheduled before it sleeps.
        #[cfg(test)]
        if batch.is_empty() {
            self.pass_idle_gate();
        }
        next
    }

    /// Tests only: wait at the gate a test set up, once.
    #[cfg(test)]
    fn pass_idle_gate(&self) {
        let gate = self.inner.idle_gate.lock().expect("gate").take();
        if let Some(gate) = gate {
            gate.reached.store(true, Ordering::Release);
            drop(gate.open.lock().expect("gate"));
        }
    }

    /// Nothing due: sleep until the next deadline, an earlier arrival, or
    /// a second at most (so the gauges settle once idle). False on shutdown.
    async fn sleep(&self, now: u64, next: Option<u64>, shutdown: &CancellationToken) -> bool {
        let most = Duration::from_secs(1);
        let wait = match next {
            // Already due (no room to fire it yet): look again shortly.
            Some(d) if d <= now => Duration::from_millis(1),
            // To the microsecond: a sleep of whole milliseconds counted from
            // `now` would end up to a millisecond late. Never early: a wake
            // before the deadline pops nothing and sleeps again.
            Some(d) => self
                .inner
                .clock
                .until(d)
                .clamp(Duration::from_micros(50), most),
            None => most,
        };
        let go_on = tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            _ = self.inner.wake.notified() => true,
            _ = shutdown.cancelled() => false,
        };
        self.inner.planned_wake.store(0, Ordering::Release);
        go_on
    }

    /// Read the batch back in fire order, a few blocking calls of at most
    /// a quarter of the byte budget each (so big messages are not all read
    /// into memory at once), and hand each to the sink in that order.
    async fn fire(
        &mut self,
        batch: &mut Vec<Expired<Slot>>,
        first: OwnedSemaphorePermit,
    ) -> Result<(), Closed> {
        let mut wanted: VecDeque<Wanted> = {
            let state = self.inner.state();
            batch
                .drain(..)
                .map(|entry| Wanted {
                    entry,
                    route: state.route_name(entry.data.route),
                    attempt: state.in_flight(entry.id).map_or(0, |f| f.attempt),
                })
                .collect()
        };
        let mut first = Some(first);
        let chunk = (self.budget as u64 / 4).max(1);
        while !wanted.is_empty() {
            // Most due messages are still in the page cache: read those here
            // and take the hop to a blocking thread only for the disk.
            let wal = self.inner.wal.clone();
            let mut records = read_front(wanted.iter().map(|w| w.entry.data.pos), chunk, |pos| {
                wal.read_cached(pos)
            });
            if records.is_empty() {
                let positions: Vec<WalPos> = wanted.iter().map(|w| w.entry.data.pos).collect();
                records = tokio::task::spawn_blocking(move || {
                    read_front(positions, chunk, |pos| Some(wal.read(pos)))
                })
                .await
                .unwrap_or_default();
            }
            if records.is_empty() {
                // The read task failed: settle one so the loop moves on.
                let w = wanted.pop_front().expect("not empty");
                let permit = self.permit(&mut first).await?;
                let settle = Settle {
                    id: w.entry.id,
                    route: w.route,
                    key: None,
                };
                let delivery = failed("WAL read task failed".to_string());
                self.completing.run(complete(
                    self.inner.clone(),
                    settle,
                    delivery,
                    (permit, None),
                ));
                continue;
            }
            for record in records {
                let w = wanted.pop_front().expect("read in order");
                if w.entry.deadline <= self.inner.overdue_until {
                    self.limiter.wait().await;
                }
                let permit = self.permit(&mut first).await?;
                // Room for its bytes too, while earlier ones are published.
                let size = match &record {
                    Ok(Record::Schedule { message, .. }) => message.len().clamp(1, self.budget),
                    _ => 1,
                };
                let byte_permit = self
                    .bytes
                    .clone()
                    .acquire_many_owned(size as u32)
                    .await
                    .map_err(|_| Closed)?;
                self.deliver(w, record, (permit, Some(byte_permit)));
            }
        }
        Ok(())
    }

    /// The batch's first permit (taken before popping), then one each.
    async fn permit(
        &self,
        first: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<OwnedSemaphorePermit, Closed> {
        match first.take() {
            Some(p) => Ok(p),
            None => self
                .permits
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| Closed),
        }
    }

    /// Call `deliver` now, in fire order; the publish completes in its own task.
    fn deliver(
        &self,
        w: Wanted,
        record: Result<Record, crate::wal::WalError>,
        permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
    ) {
        let fired_ms = self.inner.clock.now_ms();
        let Wanted {
            entry,
            route,
            attempt,
        } = w;
        let mut key = None;
        let delivery = match record {
            Ok(Record::Schedule {
                due_ms,
                uid,
                message,
                ..
            }) => {
                key = (self.inner.config.key_of)(&message)
                    .map(|k| super::key_hash(entry.data.route, k));
                if attempt == 0 {
                    let late = fired_ms.saturating_sub(due_ms) as f64 / 1000.0;
                    metrics::histogram!("delayd_lateness_seconds", "route" => route.to_string())
                        .record(late);
                }
                self.dispatch.deliver(Fired {
                    id: entry.id,
                    uid: MessageId::or_legacy(uid, entry.id),
                    route: route.clone(),
                    due_ms,
                    fired_ms,
                    message,
                    attempt,
                })
            }
            Ok(Record::Done { .. } | Record::Acked { .. } | Record::Remembered { .. }) => failed(
                format!("WAL position {:?} holds no Schedule", entry.data.pos),
            ),
            Err(e) => failed(format!("cannot read message from the WAL: {e}")),
        };
        let settle = Settle {
            id: entry.id,
            route,
            key,
        };
        self.completing
            .run(complete(self.inner.clone(), settle, delivery, permits));
    }

    /// Let in-flight publishes finish (their Done records get written).
    async fn drain(&self, grace: Duration) {
        let all = self.inner.config.max_in_flight.max(1) as u32;
        if tokio::time::timeout(grace, self.permits.acquire_many(all))
            .await
            .is_err()
        {
            tracing::warn!("shutdown grace period over with publishes still in flight; they will be retried after restart");
        }
        self.inner.publish_gauges();
    }
}

/// A popped entry on its way out, with what its delivery needs.
struct Wanted {
    entry: Expired<Slot>,
    route: Arc<str>,
    attempt: u32,
}

/// Read the front of `positions` with `read`, up to `chunk` bytes; stops
/// early at the first position `read` gives up on.
fn read_front(
    positions: impl IntoIterator<Item = WalPos>,
    chunk: u64,
    mut read: impl FnMut(WalPos) -> Option<Result<Record, crate::wal::WalError>>,
) -> Vec<Result<Record, crate::wal::WalError>> {
    let mut out = Vec::new();
    let mut total = 0u64;
    for pos in positions {
        let Some(record) = read(pos) else { break };
        if let Ok(Record::Schedule { message, .. }) = &record {
            total += message.len() as u64;
        }
        out.push(record);
        if total >= chunk {
            break;
        }
    }
    out
}

fn failed(reason: String) -> BoxFuture<'static, Outcome> {
    Box::pin(async move { Outcome::Retry(reason) })
}

/// A message being published: what `complete` needs to settle it.
struct Settle {
    id: u64,
    route: Arc<str>,
    /// Its key-index hash, to unindex it once it left.
    key: Option<u64>,
}

/// Wait for the publish, then write Done or re-arm with back-off.
async fn complete(
    inner: Arc<Inner>,
    settle: Settle,
    delivery: BoxFuture<'static, Outcome>,
    // Released once settled: a slot of `max_in_flight` and the message's
    // share of `max_bytes_in_flight`.
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
) {
    let Settle { id, route, key } = settle;
    let started = std::time::Instant::now();
    let outcome = delivery.await;
    // With `max_in_flight` publishes at most, this bounds the firing rate.
    metrics::histogram!("delayd_publish_seconds", "route" => route.to_string())
        .record(started.elapsed().as_secs_f64());
    let mut state = inner.state();
    let Some(flight) = state.land(id) else {
        return;
    };
    let route_id = flight.slot.route;
    if !matches!(outcome, Outcome::Unavailable(_)) && state.is_blocked(route_id) {
        // The target answered (a probe, or a publish that started before
        // the route was blocked): what waits goes out now, in due order.
        state.unblock(route_id);
        tracing::info!(route = %route, "target reachable again; releasing held messages");
        inner.wake.notify_one();
    }
    match outcome {
        Outcome::Done | Outcome::Release(_) => {
            state.retire(id, &flight);
            if let Outcome::Release(reason) = &outcome {
                // It lives on elsewhere, not left (see `Engine::release`).
                state.unconfirmed.pending_again(id);
                tracing::debug!(id, route = %route, %reason, "released in flight");
                metrics::counter!("delayd_released_total", "route" => route.to_string())
                    .increment(1);
            }
            if let Some(hash) = key {
                state.unindex_key(hash, id);
            }
            // Compaction may have moved the record: `flight.slot.pos` is current.
            match inner.wal.append_fired(id, flight.slot.pos) {
                Ok(()) => {}
                // The stop's reason was logged once; one line per message adds nothing.
                Err(WalError::Stopped) => tracing::debug!(id, "no Done record: the WAL is stopped"),
                // The message went out; without its Done it is sent again after a restart.
                Err(e) => tracing::error!(id, error = %e, "cannot write Done record"),
            }
        }
        Outcome::Unavailable(reason) => {
            if !state.is_blocked(route_id) {
                tracing::warn!(route = %route, %reason, "target unreachable; holding the route's due messages until it is back");
            }
            let now = inner.clock.now_ms();
            let entry = Expired {
                id,
                deadline: flight.deadline,
                data: flight.slot,
            };
            state.block(now, entry, flight.probe);
            drop(state);
            inner.wake.notify_one();
        }
        Outcome::Retry(reason) => {
            let backoff = backoff(&inner.config, flight.attempt + 1);
            let at = inner.clock.now_ms() + backoff.as_millis() as u64;
            let attempt = state.rearm_after_failure(id, &flight, at);
            drop(state);
            tracing::warn!(id, route = %route, attempt, retry_in_ms = backoff.as_millis() as u64, %reason, "publish failed; will retry");
            metrics::counter!("delayd_publish_retries_total", "route" => route.to_string())
                .increment(1);
            if at < inner.planned_wake.load(Ordering::Acquire) {
                inner.wake.notify_one();
            }
        }
    }
}

fn backoff(config: &super::EngineConfig, attempt: u32) -> Duration {
    let factor = 1u32 << attempt.saturating_sub(1).min(20);
    config
        .retry_initial
        .saturating_mul(factor)
        .min(config.retry_max)
}

/// Token bucket for messages that were overdue at start-up.
struct RateLimiter {
    per_sec: u32,
    tokens: f64,
    last: tokio::time::Instant,
}

impl RateLimiter {
    fn new(per_sec: u32) -> Self {
        Self {
            per_sec,
            tokens: per_sec as f64 / 10.0,
            last: tokio::time::Instant::now(),
        }
    }

    async fn wait(&mut self) {
        if self.per_sec == 0 {
            return;
        }
        loop {
            let now = tokio::time::Instant::now();
            let burst = (self.per_sec as f64 / 10.0).max(1.0);
            self.tokens = (self.tokens
                + now.duration_since(self.last).as_secs_f64() * self.per_sec as f64)
                .min(burst);
            self.last = now;
            if self.tokens >= 1.0 {
                self.tokens -= 1.0;
                return;
            }
            let need = (1.0 - self.tokens) / self.per_sec as f64;
            tokio::time::sleep(Duration::from_secs_f64(need)).await;
        }
    }
}
