//! The dispatcher: pops due messages, publishes them with a bounded number in
//! flight, writes Done on success and re-arms with back-off on failure.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::wal::{Record, WalPos};
use crate::wheel::Expired;

use super::state::{InFlight, Slot};
use super::Inner;

/// A due message, read back from the WAL.
#[derive(Debug, Clone)]
pub struct Fired {
    pub id: u64,
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
const BATCH: usize = 256;

/// Most entries one pop takes to finish a group of equal deadlines.
const MAX_GROUP: usize = 16 * BATCH;

pub(crate) async fn run(
    inner: Arc<Inner>,
    dispatch: Arc<dyn Dispatch>,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let permits = Arc::new(Semaphore::new(inner.config.max_in_flight.max(1)));
    // Semaphore permits are u32: the byte budget is capped at 4 GiB.
    let budget = inner.config.max_bytes_in_flight.clamp(1, u32::MAX as usize);
    let bytes = Arc::new(Semaphore::new(budget));
    let mut limiter = RateLimiter::new(inner.config.overdue_rate);
    let mut batch: Vec<Expired<Slot>> = Vec::with_capacity(BATCH);
    let mut last_gauges = 0u64;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        // Wait for room before popping, so popped messages never queue up here.
        let first = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = shutdown.cancelled() => break,
        };
        let now = inner.clock.now_ms();
        let next = {
            let mut state = inner.state();
            let room = permits.available_permits() + 1;
            pop_due(&mut state, now, room.min(BATCH), &mut batch);
            hold_blocked(&mut state, now, &mut batch);
            let probes = batch.len();
            state.take_probes(now, &mut batch);
            for (i, e) in batch.iter().enumerate() {
                let attempt = state.attempts.get(&e.id).copied().unwrap_or(0);
                state.in_flight.insert(
                    e.id,
                    InFlight {
                        slot: e.data,
                        deadline: e.deadline,
                        attempt,
                        probe: i >= probes,
                    },
                );
            }
            let next = next_deadline(&state);
            // Published under the lock that computed it: an appender arming
            // an earlier message after this sees it and wakes us; one that
            // armed before is in `next`. Stored after the lock, a wake-up
            // could be lost and the message be up to a second late.
            let planned = if batch.is_empty() {
                next.unwrap_or(u64::MAX)
            } else {
                0
            };
            inner.planned_wake.store(planned, Ordering::Release);
            next
        };
        if now >= last_gauges + 1000 {
            inner.publish_gauges();
            last_gauges = now;
        }
        if batch.is_empty() {
            drop(first);
            // At least once a second, so the pending gauges settle once idle.
            let wait = next.map_or(1000, |d| d.saturating_sub(now).min(1000));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(wait.max(1))) => {}
                _ = inner.wake.notified() => {}
                _ = shutdown.cancelled() => break,
            }
            inner.planned_wake.store(0, Ordering::Release);
            continue;
        }
        // Read the batch back in fire order, a few blocking calls of at most
        // a quarter of the byte budget each, so big messages are not all
        // read into memory at once.
        let mut wanted: std::collections::VecDeque<(Expired<Slot>, WalPos, Arc<str>, u32)> = {
            let state = inner.state();
            batch
                .drain(..)
                .map(|e| {
                    let attempt = state.in_flight.get(&e.id).map(|f| f.attempt).unwrap_or(0);
                    (e, e.data.pos, state.route_name(e.data.route), attempt)
                })
                .collect()
        };
        let mut first = Some(first);
        while !wanted.is_empty() {
            let wal = inner.wal.clone();
            let positions: Vec<WalPos> = wanted.iter().map(|w| w.1).collect();
            let chunk = (budget as u64 / 4).max(1);
            let records = tokio::task::spawn_blocking(move || read_chunk(&wal, positions, chunk))
                .await
                .unwrap_or_default();
            if records.is_empty() {
                // The read task failed: settle one so the loop moves on.
                let (entry, _, route, _) = wanted.pop_front().expect("not empty");
                let permit = match first.take() {
                    Some(p) => p,
                    None => match permits.clone().acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                };
                let settle = Settle {
                    id: entry.id,
                    route,
                    key: None,
                };
                let delivery = failed("WAL read task failed".to_string());
                tokio::spawn(complete(inner.clone(), settle, delivery, (permit, None)));
                continue;
            }
            for record in records {
                let (entry, pos, route, attempt) = wanted.pop_front().expect("read in order");
                if entry.deadline <= inner.overdue_until {
                    limiter.wait().await;
                }
                let permit = match first.take() {
                    Some(p) => p,
                    None => match permits.clone().acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                };
                // Room for its bytes too, while earlier ones are published.
                let size = match &record {
                    Ok(Record::Schedule { message, .. }) => message.len().clamp(1, budget),
                    _ => 1,
                };
                let byte_permit = match bytes.clone().acquire_many_owned(size as u32).await {
                    Ok(p) => p,
                    Err(_) => return,
                };
                let fired_ms = inner.clock.now_ms();
                // `deliver` is called here, in fire order; the publish completes in its own task.
                let mut key = None;
                let delivery = match record {
                    Ok(Record::Schedule {
                        due_ms, message, ..
                    }) => {
                        key = delayd_adapters::lookup_key(&message)
                            .map(|k| super::key_hash(entry.data.route, k));
                        if attempt == 0 {
                            let late = fired_ms.saturating_sub(due_ms) as f64 / 1000.0;
                            metrics::histogram!("delayd_lateness_seconds", "route" => route.to_string())
                                .record(late);
                        }
                        dispatch.deliver(Fired {
                            id: entry.id,
                            route: route.clone(),
                            due_ms,
                            fired_ms,
                            message,
                            attempt,
                        })
                    }
                    Ok(Record::Done { .. }) => failed(format!("WAL position {pos:?} holds a Done")),
                    Err(e) => failed(format!("cannot read message from the WAL: {e}")),
                };
                tokio::spawn(complete(
                    inner.clone(),
                    Settle {
                        id: entry.id,
                        route,
                        key,
                    },
                    delivery,
                    (permit, Some(byte_permit)),
                ));
            }
        }
    }
    // Let in-flight publishes finish (their Done records get written).
    let all = inner.config.max_in_flight.max(1) as u32;
    if tokio::time::timeout(grace, permits.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace period over with publishes still in flight; they will be retried after restart");
    }
    inner.publish_gauges();
}

/// The earliest deadline in the wheel or the held set, or probe time.
fn next_deadline(state: &super::State) -> Option<u64> {
    let next_held = state.held.keys().next().map(|k| k.0);
    [state.wheel.next_deadline(), next_held, state.next_probe()]
        .into_iter()
        .flatten()
        .min()
}

/// Due messages of blocked routes wait with their route instead of going out.
fn hold_blocked(state: &mut super::State, now: u64, batch: &mut Vec<Expired<Slot>>) {
    if state.blocked.is_empty() {
        return;
    }
    let mut kept = Vec::with_capacity(batch.len());
    for e in batch.drain(..) {
        if state.is_blocked(e.data.route) {
            state.block(now, e, false);
        } else {
            kept.push(e);
        }
    }
    *batch = kept;
}

/// Move due entries from the wheel (and from the held set) into `out`. An
/// entry whose deadline is ahead of the wall clock (the clock stepped back
/// after the wheel advanced) is held until the clock reaches it.
fn pop_due(state: &mut super::State, now: u64, max: usize, out: &mut Vec<Expired<Slot>>) {
    while let Some((&(deadline, id), _)) = state.held.iter().next() {
        if deadline > now || out.len() >= max {
            break;
        }
        if let Some(slot) = state.unhold(deadline, id) {
            out.push(Expired {
                id,
                deadline,
                data: slot,
            });
        }
    }
    let start = out.len();
    state.wheel.poll_expired(now, max - out.len(), out);
    // The wheel gives equal deadlines in the order they were armed, which
    // is not quite id order (appends complete concurrently). A batch that
    // stopped inside a group of equal deadlines takes the rest of the group
    // (up to a cap), so the sort below orders the whole group by id.
    if out.len() == max {
        if let Some(last) = out.last().map(|e| e.deadline) {
            while out.len() < MAX_GROUP {
                if state.wheel.poll_expired(now, 1, out) == 0 {
                    break;
                }
                if out.last().is_some_and(|e| e.deadline != last) {
                    break;
                }
            }
        }
    }
    let mut i = start;
    while i < out.len() {
        if out[i].deadline > now {
            let e = out.remove(i);
            state.hold(e.deadline, e.id, e.data);
        } else {
            i += 1;
        }
    }
    // Messages due in the same millisecond go out in id (= WAL append =
    // consumption) order, whatever order their appends completed in.
    out.sort_by_key(|e| (e.deadline, e.id));
}

/// Read records at `positions` in order until their bytes reach `chunk`
/// (at least one).
fn read_chunk(
    wal: &crate::wal::Wal,
    positions: Vec<WalPos>,
    chunk: u64,
) -> Vec<Result<Record, crate::wal::WalError>> {
    let mut out = Vec::new();
    let mut total = 0u64;
    for pos in positions {
        let record = wal.read(pos);
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
    let outcome = delivery.await;
    let mut state = inner.state();
    let Some(flight) = state.in_flight.remove(&id) else {
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
        Outcome::Done => {
            state.counts[route_id as usize] -= 1;
            state.attempts.remove(&id);
            if let Some(hash) = key {
                state.keys.remove(hash, id);
            }
            // Compaction may have moved the record: `flight.slot.pos` is current.
            if let Err(e) = inner.wal.append_done(id, flight.slot.pos) {
                // The message went out; without its Done it is sent again after a restart.
                tracing::error!(id, error = %e, "cannot write Done record");
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
            let attempt = flight.attempt + 1;
            let backoff = backoff(&inner.config, attempt);
            let at = inner.clock.now_ms() + backoff.as_millis() as u64;
            tracing::warn!(id, route = %route, attempt, retry_in_ms = backoff.as_millis() as u64, %reason, "publish failed; will retry");
            metrics::counter!("delayd_publish_retries_total", "route" => route.to_string())
                .increment(1);
            state.attempts.insert(id, attempt);
            let _ = state.wheel.insert(id, at, flight.slot);
            drop(state);
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
