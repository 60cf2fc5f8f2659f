//! The engine's in-memory index: the timing wheel plus the few side tables
//! needed for messages that are being published, re-armed or held back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::wal::WalPos;
use crate::wheel::{Expired, TimingWheel};

use super::dedup::Unconfirmed;
use super::keys::KeyIndex;

/// What the wheel keeps per pending message besides its id and deadline:
/// 12 bytes, so a pending message costs a small constant whatever its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Slot {
    pub pos: WalPos,
    pub route: u16,
}

/// A message handed to the sink and not yet confirmed.
#[derive(Debug, Clone, Copy)]
pub struct InFlight {
    pub slot: Slot,
    pub deadline: u64,
    pub attempt: u32,
    /// Sent to find out whether its blocked route's target is back.
    pub probe: bool,
}

/// Where a pending message is right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Waiting,
    Publishing,
}

/// A route whose target broker cannot be reached: its due messages wait
/// here, in (deadline, id) order, until a probe message gets through.
#[derive(Debug, Default)]
pub struct Blocked {
    pub waiting: BTreeMap<(u64, u64), Slot>,
    /// When the next probe may go out, and the wait after that one.
    pub probe_at: u64,
    pub backoff_ms: u64,
    /// A probe is being published: the rest stay here until it settles.
    pub probing: bool,
}

/// First wait between probes of an unreachable broker, and the longest.
pub const PROBE_INITIAL_MS: u64 = 250;
pub const PROBE_MAX_MS: u64 = 5000;

pub struct State {
    pub wheel: TimingWheel<Slot>,
    pub in_flight: HashMap<u64, InFlight>,
    /// Popped from the wheel while the wall clock is behind their deadline
    /// (the clock stepped back): they wait here, keyed by (deadline, id).
    pub held: BTreeMap<(u64, u64), Slot>,
    /// Id → deadline of every held entry, so finding one is O(1).
    held_at: HashMap<u64, u64>,
    /// Publish attempts so far, for messages re-armed after a failure.
    pub attempts: HashMap<u64, u32>,
    pub counts: Vec<u64>,
    pub routes: Vec<Arc<str>>,
    route_index: HashMap<Arc<str>, u16>,
    pub unconfirmed: Unconfirmed,
    /// Pending messages by lookup key (message_id / Kafka key).
    pub keys: KeyIndex,
    /// Deliveries admitted under the backpressure limits and being stored.
    pub reserved: u64,
    /// Routes whose target is unreachable, and where each waiting id is.
    pub blocked: HashMap<u16, Blocked>,
    blocked_ids: HashMap<u64, (u16, u64)>,
}

impl State {
    pub fn new(now_ms: u64, dedup_window: usize) -> Self {
        Self {
            wheel: TimingWheel::new(now_ms),
            in_flight: HashMap::new(),
            held: BTreeMap::new(),
            held_at: HashMap::new(),
            attempts: HashMap::new(),
            counts: Vec::new(),
            routes: Vec::new(),
            route_index: HashMap::new(),
            unconfirmed: Unconfirmed::new(dedup_window),
            keys: KeyIndex::default(),
            reserved: 0,
            blocked: HashMap::new(),
            blocked_ids: HashMap::new(),
        }
    }

    /// The index of a route name, added on first sight (at most 65536 routes).
    pub fn intern(&mut self, route: &str) -> Option<u16> {
        if let Some(&i) = self.route_index.get(route) {
            return Some(i);
        }
        let i = u16::try_from(self.routes.len()).ok()?;
        let name: Arc<str> = Arc::from(route);
        self.routes.push(name.clone());
        self.route_index.insert(name, i);
        self.counts.push(0);
        Some(i)
    }

    pub fn route_id(&self, route: &str) -> Option<u16> {
        self.route_index.get(route).copied()
    }

    pub fn route_name(&self, route: u16) -> Arc<str> {
        self.routes
            .get(route as usize)
            .cloned()
            .unwrap_or_else(|| Arc::from("?"))
    }

    pub fn counts_by_route(&self) -> Vec<(Arc<str>, u64)> {
        self.routes
            .iter()
            .cloned()
            .zip(self.counts.iter().copied())
            .collect()
    }

    pub fn pending(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Arm a message: into the wheel, counted against its route.
    /// Arm `id` (replacing an earlier arming of it, as a compaction copy
    /// replaces the original at recovery). Returns the replaced slot.
    pub fn arm(&mut self, id: u64, deadline: u64, slot: Slot) -> Option<Slot> {
        let old = self.wheel.cancel(id);
        if let Some(old) = &old {
            self.counts[old.data.route as usize] -= 1;
        }
        if self.wheel.insert(id, deadline, slot).is_ok() {
            self.counts[slot.route as usize] += 1;
        }
        old.map(|o| o.data)
    }

    /// Take a waiting message out (cancel or recovery Done). In-flight ones stay.
    pub fn disarm(&mut self, id: u64) -> Option<Expired<Slot>> {
        let found = self
            .wheel
            .cancel(id)
            .or_else(|| {
                let deadline = *self.held_at.get(&id)?;
                let data = self.unhold(deadline, id)?;
                Some(Expired { id, deadline, data })
            })
            .or_else(|| self.unblock_one(id))?;
        self.counts[found.data.route as usize] -= 1;
        self.attempts.remove(&id);
        Some(found)
    }

    /// The message's current WAL position and phase, wherever it is.
    pub fn locate(&self, id: u64) -> Option<(Slot, u64, Phase)> {
        if let Some(e) = self.wheel.get(id) {
            return Some((e.data, e.deadline, Phase::Waiting));
        }
        if let Some(f) = self.in_flight.get(&id) {
            return Some((f.slot, f.deadline, Phase::Publishing));
        }
        if let Some((slot, deadline)) = self.blocked_slot(id) {
            return Some((slot, deadline, Phase::Waiting));
        }
        let deadline = *self.held_at.get(&id)?;
        let slot = *self.held.get(&(deadline, id))?;
        Some((slot, deadline, Phase::Waiting))
    }

    /// Hold back an entry the clock has not reached (it stepped back).
    pub fn hold(&mut self, deadline: u64, id: u64, slot: Slot) {
        self.held.insert((deadline, id), slot);
        self.held_at.insert(id, deadline);
    }

    /// Take a held entry out.
    pub fn unhold(&mut self, deadline: u64, id: u64) -> Option<Slot> {
        self.held_at.remove(&id);
        self.held.remove(&(deadline, id))
    }

    /// Hold a due message of `route` until the route's target is reachable.
    /// `probe` says it was the route's probe (its failure doubles the wait).
    pub fn block(&mut self, now: u64, entry: Expired<Slot>, probe: bool) {
        let route = entry.data.route;
        let blocked = self.blocked.entry(route).or_insert_with(|| Blocked {
            probe_at: now + PROBE_INITIAL_MS,
            backoff_ms: PROBE_INITIAL_MS,
            ..Blocked::default()
        });
        if probe {
            blocked.probing = false;
            blocked.backoff_ms = (blocked.backoff_ms * 2).min(PROBE_MAX_MS);
            blocked.probe_at = now + blocked.backoff_ms;
        }
        blocked
            .waiting
            .insert((entry.deadline, entry.id), entry.data);
        self.blocked_ids.insert(entry.id, (route, entry.deadline));
    }

    pub fn is_blocked(&self, route: u16) -> bool {
        self.blocked.contains_key(&route)
    }

    /// Routes whose probe is due: take the first waiting message of each.
    pub fn take_probes(&mut self, now: u64, out: &mut Vec<Expired<Slot>>) {
        for blocked in self.blocked.values_mut() {
            if blocked.probing || blocked.probe_at > now {
                continue;
            }
            if let Some(((deadline, id), data)) = blocked.waiting.pop_first() {
                self.blocked_ids.remove(&id);
                blocked.probing = true;
                out.push(Expired { id, deadline, data });
            }
        }
    }

    /// The earliest probe time of a blocked route not probing now.
    pub fn next_probe(&self) -> Option<u64> {
        self.blocked
            .values()
            .filter(|b| !b.probing)
            .map(|b| b.probe_at)
            .min()
    }

    /// The route's target answered: its waiting messages go back into the
    /// wheel with their deadlines (past ones fire at once, in order).
    pub fn unblock(&mut self, route: u16) {
        let Some(blocked) = self.blocked.remove(&route) else {
            return;
        };
        for ((deadline, id), slot) in blocked.waiting {
            self.blocked_ids.remove(&id);
            // Still counted against the route: insert without re-counting.
            let _ = self.wheel.insert(id, deadline, slot);
        }
    }

    fn blocked_slot(&self, id: u64) -> Option<(Slot, u64)> {
        let &(route, deadline) = self.blocked_ids.get(&id)?;
        let slot = *self.blocked.get(&route)?.waiting.get(&(deadline, id))?;
        Some((slot, deadline))
    }

    fn unblock_one(&mut self, id: u64) -> Option<Expired<Slot>> {
        let (route, deadline) = self.blocked_ids.remove(&id)?;
        let data = self
            .blocked
            .get_mut(&route)?
            .waiting
            .remove(&(deadline, id))?;
        Some(Expired { id, deadline, data })
    }

    /// Whether `id` is pending (waiting, held back or being published).
    pub fn is_pending(&self, id: u64) -> bool {
        self.blocked_ids.contains_key(&id)
            || self.wheel.get(id).is_some()
            || self.in_flight.contains_key(&id)
            || self.held_at.contains_key(&id)
    }

    /// Drop key-index entries of messages that are no longer pending.
    pub fn sweep_keys(&mut self) {
        let mut keys = std::mem::take(&mut self.keys);
        keys.retain(|id| self.is_pending(id));
        self.keys = keys;
    }

    /// Point a message at a new WAL position (after compaction copied it).
    pub fn relocate(&mut self, id: u64, pos: WalPos) -> bool {
        if let Some(slot) = self.wheel.get_mut(id) {
            slot.pos = pos;
            return true;
        }
        if let Some(f) = self.in_flight.get_mut(&id) {
            f.slot.pos = pos;
            return true;
        }
        if let Some(&(route, deadline)) = self.blocked_ids.get(&id) {
            if let Some(slot) = self
                .blocked
                .get_mut(&route)
                .and_then(|b| b.waiting.get_mut(&(deadline, id)))
            {
                slot.pos = pos;
                return true;
            }
        }
        if let Some(&deadline) = self.held_at.get(&id) {
            if let Some(slot) = self.held.get_mut(&(deadline, id)) {
                slot.pos = pos;
                return true;
            }
        }
        false
    }
}
