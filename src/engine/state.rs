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
}

/// Where a pending message is right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Waiting,
    Publishing,
}

pub struct State {
    pub wheel: TimingWheel<Slot>,
    pub in_flight: HashMap<u64, InFlight>,
    /// Popped from the wheel while the wall clock is behind their deadline
    /// (the clock stepped back): they wait here, keyed by (deadline, id).
    pub held: BTreeMap<(u64, u64), Slot>,
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
}

impl State {
    pub fn new(now_ms: u64, dedup_window: usize) -> Self {
        Self {
            wheel: TimingWheel::new(now_ms),
            in_flight: HashMap::new(),
            held: BTreeMap::new(),
            attempts: HashMap::new(),
            counts: Vec::new(),
            routes: Vec::new(),
            route_index: HashMap::new(),
            unconfirmed: Unconfirmed::new(dedup_window),
            keys: KeyIndex::default(),
            reserved: 0,
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
    pub fn arm(&mut self, id: u64, deadline: u64, slot: Slot) {
        if let Some(old) = self.wheel.cancel(id) {
            self.counts[old.data.route as usize] -= 1;
        }
        if self.wheel.insert(id, deadline, slot).is_ok() {
            self.counts[slot.route as usize] += 1;
        }
    }

    /// Take a waiting message out (cancel or recovery Done). In-flight ones stay.
    pub fn disarm(&mut self, id: u64) -> Option<Expired<Slot>> {
        let found = self.wheel.cancel(id).or_else(|| {
            let key = *self.held.keys().find(|(_, held_id)| *held_id == id)?;
            let data = self.held.remove(&key)?;
            Some(Expired {
                id,
                deadline: key.0,
                data,
            })
        })?;
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
        self.held
            .iter()
            .find(|((_, held_id), _)| *held_id == id)
            .map(|(&(deadline, _), &slot)| (slot, deadline, Phase::Waiting))
    }

    /// Whether `id` is pending (waiting, held back or being published).
    pub fn is_pending(&self, id: u64) -> bool {
        self.wheel.get(id).is_some()
            || self.in_flight.contains_key(&id)
            || self.held.keys().any(|&(_, held_id)| held_id == id)
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
        if let Some(slot) = self
            .held
            .iter_mut()
            .find(|((_, held_id), _)| *held_id == id)
            .map(|(_, s)| s)
        {
            slot.pos = pos;
            return true;
        }
        false
    }

    /// Every pending message: (id, deadline, slot, phase), any order.
    pub fn all(&self) -> impl Iterator<Item = (u64, u64, Slot, Phase)> + '_ {
        let waiting = self
            .wheel
            .iter()
            .map(|e| (e.id, e.deadline, e.data, Phase::Waiting));
        let held = self
            .held
            .iter()
            .map(|(&(d, id), &s)| (id, d, s, Phase::Waiting));
        let flying = self
            .in_flight
            .iter()
            .map(|(&id, f)| (id, f.deadline, f.slot, Phase::Publishing));
        waiting.chain(held).chain(flying)
    }
}
