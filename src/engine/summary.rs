//! Per-route due-time summary for metrics and the status page: the next
//! due time, the oldest overdue message, and how many fall due within the
//! next minute, hour and day. One walk over every pending message, a chunk
//! of the wheel per lock hold (as [`Engine::list`] does), so a summary of
//! millions never keeps the dispatcher waiting long.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Engine, LIST_CHUNK, LIST_PAUSE};

/// One route's pending messages by due time (ms since the epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DueSummary {
    pub pending: u64,
    /// The earliest due time (or next retry) of a pending message.
    pub next_due_ms: Option<u64>,
    /// The earliest due time among those already due (waiting on a
    /// broker, in a retry back-off, being published, or behind
    /// `overdue_rate`): how long the oldest has been overdue is now minus it.
    pub oldest_overdue_ms: Option<u64>,
    /// Due at or before now.
    pub overdue: u64,
    /// Due after now, within 60 s / 1 h / 24 h (each counts the shorter ones too).
    pub within_minute: u64,
    pub within_hour: u64,
    pub within_day: u64,
}

impl DueSummary {
    fn add(&mut self, due: u64, now: u64) {
        self.add_n(due, 1, now);
    }

    /// `n` messages due at `due`.
    fn add_n(&mut self, due: u64, n: u64, now: u64) {
        if n == 0 {
            return;
        }
        self.pending += n;
        self.next_due_ms = Some(self.next_due_ms.map_or(due, |d| d.min(due)));
        if due <= now {
            self.overdue += n;
            self.oldest_overdue_ms = Some(self.oldest_overdue_ms.map_or(due, |d| d.min(due)));
            return;
        }
        let ahead = due - now;
        self.within_minute += n * u64::from(ahead <= 60_000);
        self.within_hour += n * u64::from(ahead <= 3_600_000);
        self.within_day += n * u64::from(ahead <= 86_400_000);
    }
}

impl Engine {
    /// Every route's [`DueSummary`] at the engine's clock's now, with
    /// routes that have nothing pending included (all zero). The counts
    /// come from a walk, so a message that fires or arrives meanwhile may
    /// be counted or not; `pending` may differ from [`Engine::counts`] by
    /// as much.
    pub fn due_summary(&self) -> (u64, BTreeMap<Arc<str>, DueSummary>) {
        let now = self.inner.clock.now_ms();
        // Held throughout: nothing moves between the tiers meanwhile.
        let far = self.inner.far.as_ref().map(|t| t.store());
        let mut by_id: Vec<DueSummary> = Vec::new();
        let mut names: Vec<Arc<str>> = Vec::new();
        let mut add = |route: u16, name: &dyn Fn() -> Arc<str>, due: u64| {
            let r = route as usize;
            if by_id.len() <= r {
                by_id.resize(r + 1, DueSummary::default());
                names.resize(r + 1, Arc::from(""));
            }
            if names[r].is_empty() {
                names[r] = name();
            }
            by_id[r].add(due, now);
        };
        let mut from = Some(0);
        while let Some(start) = from {
            let state = self.state();
            from = state.scan_armed(start, LIST_CHUNK, |e| {
                add(e.data.route, &|| state.route_name(e.data.route), e.deadline);
            });
            drop(state);
            if from.is_some() {
                std::thread::sleep(LIST_PAUSE);
            }
        }
        let state = self.state();
        for range in state.waiting_aside(None, (0, 0)) {
            for (&(due, _), slot) in range {
                add(slot.route, &|| state.route_name(slot.route), due);
            }
        }
        for (_, flight) in state.flights() {
            let route = flight.slot.route;
            add(route, &|| state.route_name(route), flight.deadline);
        }
        // The far tier by bucket: each message counted at its bucket's start
        // (at most a bucket early; never due within the horizon).
        if let Some(store) = &far {
            for (start, routes) in store.bucket_counts() {
                for (name, &n) in routes {
                    if let Some(r) = state.route_id(name) {
                        let r = r as usize;
                        if by_id.len() <= r {
                            by_id.resize(r + 1, DueSummary::default());
                            names.resize(r + 1, Arc::from(""));
                        }
                        if names[r].is_empty() {
                            names[r] = state.route_name(r as u16);
                        }
                        by_id[r].add_n(start, n, now);
                    }
                }
            }
        }
        let mut out: BTreeMap<Arc<str>, DueSummary> = state
            .counts_by_route()
            .into_iter()
            .map(|(name, _)| (name, DueSummary::default()))
            .collect();
        drop(state);
        for (name, summary) in names.into_iter().zip(by_id) {
            if !name.is_empty() {
                out.insert(name, summary);
            }
        }
        (now, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_the_shorter_horizons_too() {
        let now = 1_000_000_000;
        let mut s = DueSummary::default();
        for due in [
            now - 5_000,
            now,
            now + 1,
            now + 60_000,
            now + 60_001,
            now + 3_600_000,
            now + 86_400_000,
            now + 86_400_001,
        ] {
            s.add(due, now);
        }
        assert_eq!(
            s,
            DueSummary {
                pending: 8,
                next_due_ms: Some(now - 5_000),
                oldest_overdue_ms: Some(now - 5_000),
                overdue: 2,
                within_minute: 2,
                within_hour: 4,
                within_day: 5,
            }
        );
        let mut later = DueSummary::default();
        later.add(now + 10, now);
        assert_eq!(later.oldest_overdue_ms, None);
        assert_eq!(later.next_due_ms, Some(now + 10));
    }
}
