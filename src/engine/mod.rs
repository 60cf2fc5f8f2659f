//! The engine: owns the WAL and the timing wheel.
//!
//! `schedule` appends a Schedule record, waits for group commit, then arms the
//! message in the wheel. The dispatcher sleeps until the next deadline, reads
//! due messages back from the WAL and hands them to a [`Dispatch`] with a
//! bounded number in flight; a Done is written when it confirms, and a failure
//! re-arms the message with back-off without holding up anything else. A
//! background task deletes dead segments and compacts sparse ones.
//!
//! Restart: the WAL is replayed into a fresh wheel. Messages that fell due
//! while delayd was down fire at `overdue_rate` per second, not all at once.

mod clock;
mod compact;
mod dedup;
mod dispatch;
mod state;

pub use clock::{Clock, ManualClock, SystemClock};
pub use dedup::fingerprint;
pub use dispatch::{Dispatch, Fired, Outcome};
pub use state::Phase;

use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::wal::{
    Record, RecordRef, RecoveryReport, SpaceReport, Wal, WalConfig, WalError, WalPos,
};

use self::state::{Slot, State};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub wal: WalConfig,
    /// Most messages being published at once.
    pub max_in_flight: usize,
    /// Messages per second for those already overdue when delayd started.
    pub overdue_rate: u32,
    /// First retry delay after a failed publish; doubles up to `retry_max`.
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// How many unconfirmed fingerprints to keep for redelivery detection.
    pub dedup_window: usize,
    /// How often dead segments are deleted and sparse ones compacted.
    pub gc_interval: Duration,
}

impl EngineConfig {
    pub fn new(wal: WalConfig) -> Self {
        Self {
            wal,
            max_in_flight: 1024,
            overdue_rate: 5000,
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
            dedup_window: 100_000,
            gc_interval: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error("the WAL writer went away")]
    WriterGone,
    #[error("too many routes (at most 65536)")]
    TooManyRoutes,
    #[error("message {0} is being published and can no longer be cancelled")]
    InFlight(u64),
}

/// Outcome of storing a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Durable, armed, with this id.
    New(u64),
    /// A redelivery of a message already stored: nothing new was written.
    Duplicate,
}

/// A pending message, for listing.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PendingInfo {
    pub id: u64,
    pub route: Arc<str>,
    /// When it fires next (its due time, or the next retry after a failure).
    pub due_ms: u64,
    pub phase: Phase,
    #[serde(skip)]
    pub pos: WalPos,
}

/// Filter and page for [`Engine::list`]. Results are ordered by (due, id);
/// `after` is the (due, id) of the last item of the previous page.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub route: Option<String>,
    pub due_from: Option<u64>,
    pub due_to: Option<u64>,
    pub after: Option<(u64, u64)>,
    pub limit: usize,
}

/// Handle to the engine. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    config: EngineConfig,
    wal: Wal,
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    /// Wakes the dispatcher when an earlier deadline arrives.
    wake: Notify,
    /// The deadline the dispatcher sleeps until (u64::MAX when idle).
    planned_wake: AtomicU64,
    /// Messages due at or before this (the start time) are rate limited.
    overdue_until: u64,
}

impl Engine {
    /// Open the WAL, rebuild the wheel from it, and return the engine.
    pub fn open(
        config: EngineConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(Engine, RecoveryReport), EngineError> {
        let now = clock.now_ms();
        let mut state = State::new(now, config.dedup_window);
        let mut recent =
            std::collections::VecDeque::with_capacity(config.dedup_window.min(1 << 16));
        let mut too_many_routes = false;
        let (wal, report) = Wal::open(config.wal.clone(), |record, pos| match record {
            RecordRef::Schedule {
                id,
                due_ms,
                route,
                message,
                ..
            } => {
                let Some(route_id) = state.intern(route) else {
                    too_many_routes = true;
                    return;
                };
                state.arm(
                    id,
                    due_ms,
                    Slot {
                        pos,
                        route: route_id,
                    },
                );
                if config.dedup_window > 0 {
                    if recent.len() == config.dedup_window {
                        recent.pop_front();
                    }
                    recent.push_back(fingerprint(route, message));
                }
            }
            RecordRef::Done { id, .. } => {
                state.disarm(id);
            }
        })?;
        if too_many_routes {
            return Err(EngineError::TooManyRoutes);
        }
        for fp in recent {
            state.unconfirmed.add(fp);
        }
        wal.set_live_counts(state.wheel.iter().map(|e| e.data.pos));
        let engine = Engine {
            inner: Arc::new(Inner {
                config,
                wal,
                state: Mutex::new(state),
                clock,
                wake: Notify::new(),
                planned_wake: AtomicU64::new(u64::MAX),
                overdue_until: now,
            }),
        };
        engine.publish_gauges();
        Ok((engine, report))
    }

    pub fn wal(&self) -> &Wal {
        &self.inner.wal
    }

    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Store a message durably and arm it. Returns its id.
    pub async fn schedule(
        &self,
        route: &str,
        due_ms: u64,
        message: Vec<u8>,
    ) -> Result<u64, EngineError> {
        let route_id = self
            .state()
            .intern(route)
            .ok_or(EngineError::TooManyRoutes)?;
        let appended = self
            .inner
            .wal
            .append_schedule(due_ms, route, message)?
            .await
            .map_err(|_| EngineError::WriterGone)??;
        let slot = Slot {
            pos: appended.pos,
            route: route_id,
        };
        self.state().arm(appended.id, due_ms, slot);
        if due_ms < self.inner.planned_wake.load(Ordering::Acquire) {
            self.inner.wake.notify_one();
        }
        Ok(appended.id)
    }

    /// Store a consumed delivery. A `redelivered` one that matches a stored,
    /// unconfirmed message is reported as a duplicate and not stored again.
    /// Call [`Engine::confirm_ack`] once the source ack succeeded.
    pub async fn store(
        &self,
        route: &str,
        due_ms: u64,
        message: Vec<u8>,
        redelivered: bool,
    ) -> Result<Stored, EngineError> {
        let fp = fingerprint(route, &message);
        if redelivered && self.state().unconfirmed.take(fp) {
            metrics::counter!("delayd_redeliveries_deduplicated_total", "route" => route.to_owned())
                .increment(1);
            return Ok(Stored::Duplicate);
        }
        let id = self.schedule(route, due_ms, message).await?;
        // Until the source ack is confirmed, a redelivery of it is a duplicate.
        self.state().unconfirmed.add(fp);
        Ok(Stored::New(id))
    }

    /// The source ack for this message reached the broker.
    pub fn confirm_ack(&self, route: &str, message: &[u8]) {
        self.state()
            .unconfirmed
            .confirm(fingerprint(route, message));
    }

    /// Cancel a pending message: it never fires. `Ok(false)` if unknown.
    pub fn cancel(&self, id: u64) -> Result<bool, EngineError> {
        let mut state = self.state();
        if state.in_flight.contains_key(&id) {
            return Err(EngineError::InFlight(id));
        }
        let Some(entry) = state.disarm(id) else {
            return Ok(false);
        };
        // Written under the lock so it is ordered before any compaction copy.
        self.inner.wal.append_done(id, entry.data.pos)?;
        metrics::counter!("delayd_cancelled_total", "route" => state.route_name(entry.data.route).to_string())
            .increment(1);
        Ok(true)
    }

    /// The stored record of a pending message: (route, due, encoded message).
    pub fn read(&self, id: u64) -> Result<Option<(PendingInfo, Record)>, EngineError> {
        let found = {
            let state = self.state();
            state.locate(id).map(|(slot, deadline, phase)| PendingInfo {
                id,
                route: state.route_name(slot.route),
                due_ms: deadline,
                phase,
                pos: slot.pos,
            })
        };
        let Some(info) = found else {
            return Ok(None);
        };
        let record = self.inner.wal.read(info.pos)?;
        Ok(Some((info, record)))
    }

    /// Pending messages matching the query, ordered by (due, id).
    pub fn list(&self, query: &ListQuery) -> Vec<PendingInfo> {
        let state = self.state();
        let route = match &query.route {
            Some(name) => match state.route_id(name) {
                Some(r) => Some(r),
                None => return Vec::new(),
            },
            None => None,
        };
        let limit = query.limit.max(1);
        // Keep the `limit` smallest (due, id) keys with a bounded max-heap.
        let mut heap: BinaryHeap<(u64, u64, Slot, Phase)> = BinaryHeap::new();
        for (id, due, slot, phase) in state.all() {
            if route.is_some_and(|r| r != slot.route)
                || query.due_from.is_some_and(|f| due < f)
                || query.due_to.is_some_and(|t| due > t)
                || query.after.is_some_and(|a| (due, id) <= a)
            {
                continue;
            }
            if heap.len() < limit {
                heap.push((due, id, slot, phase));
            } else if heap.peek().is_some_and(|top| (due, id) < (top.0, top.1)) {
                heap.pop();
                heap.push((due, id, slot, phase));
            }
        }
        let mut out: Vec<PendingInfo> = heap
            .into_iter()
            .map(|(due, id, slot, phase)| PendingInfo {
                id,
                route: state.route_name(slot.route),
                due_ms: due,
                phase,
                pos: slot.pos,
            })
            .collect();
        out.sort_by_key(|p| (p.due_ms, p.id));
        out
    }

    /// Pending messages per route, O(routes).
    pub fn counts(&self) -> Vec<(Arc<str>, u64)> {
        self.state().counts_by_route()
    }

    pub fn pending(&self) -> u64 {
        self.state().pending()
    }

    pub fn space(&self) -> SpaceReport {
        self.inner.wal.space()
    }

    /// Fire due messages into `dispatch` until `shutdown`, then wait up to
    /// `grace` for in-flight publishes. Also runs segment GC and compaction.
    pub async fn run(
        &self,
        dispatch: Arc<dyn Dispatch>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let gc = tokio::spawn(compact::run(self.inner.clone(), shutdown.clone()));
        dispatch::run(self.inner.clone(), dispatch, shutdown, grace).await;
        let _ = gc.await;
    }

    /// Make the dispatcher look at the clock again (after a clock change).
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Flush and stop the WAL writer.
    pub async fn close(&self) -> Result<(), EngineError> {
        let wal = self.inner.wal.clone();
        tokio::task::spawn_blocking(move || wal.close())
            .await
            .map_err(|_| EngineError::WriterGone)??;
        Ok(())
    }

    /// One round of segment GC and compaction (also run periodically by `run`).
    pub async fn compact_now(&self) -> Result<(), EngineError> {
        compact::once(&self.inner).await
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state()
    }

    fn publish_gauges(&self) {
        self.inner.publish_gauges();
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("engine state poisoned")
    }

    fn publish_gauges(&self) {
        let counts = self.state().counts_by_route();
        let mut total = 0;
        for (route, n) in counts {
            total += n;
            metrics::gauge!("delayd_pending_messages", "route" => route.to_string()).set(n as f64);
        }
        metrics::gauge!("delayd_pending_messages_total").set(total as f64);
        let space = self.wal.space();
        metrics::gauge!("delayd_wal_bytes").set(space.bytes as f64);
        metrics::gauge!("delayd_wal_live_bytes").set(space.live_bytes as f64);
        metrics::gauge!("delayd_wal_segments").set(space.segments as f64);
    }
}

#[cfg(test)]
mod tests;
