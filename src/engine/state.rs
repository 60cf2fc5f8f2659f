//! The engine's in-memory index: the timing wheel plus the few side tables
//! needed for messages that are being published, re-armed or held back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::wal::WalPos;
use crate::wheel::{Expired, TimingWheel};

use super::dedup::{Unconfirmed, Writing};
use super::keys::KeyIndex;
use super::ready::Ready;

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
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
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

/// Entries taken out of the wheel ahead of their turn, at most (and a
/// deadline's rest): about 40 bytes each. A burst at one deadline is taken
/// whole; an overdue backlog spread over more deadlines than this is
/// shared between routes once it is within this many of the others' due
/// messages.
pub const READY_MAX: usize = 1 << 18;

/// The pending set and its side tables. Everything that the pending count
/// depends on is private and changed only through the methods below, which
/// keep the counts, the wheel and the side indexes in step. The two dedup
/// tables are public: they are self-contained types whose own methods keep
/// their invariants, and they count nothing pending.
pub struct State {
    wheel: TimingWheel<Slot>,
    /// Handed to the sink, not yet settled: still pending, not in the wheel.
    in_flight: HashMap<u64, InFlight>,
    /// Popped from the wheel, due (or ahead of a clock that stepped back):
    /// they wait here per route for their turn (see [`Ready`]).
    ready: Ready,
    /// Publish attempts so far, for messages re-armed after a failure.
    attempts: HashMap<u64, u32>,
    /// Pending messages per route: armed, held, blocked or in flight.
    counts: Vec<u64>,
    routes: Vec<Arc<str>>,
    route_index: HashMap<Arc<str>, u16>,
    /// Each interned route's weight (see [`Ready`]), from `weights_by_name`.
    weights: Vec<u32>,
    weights_by_name: HashMap<String, u32>,
    pub unconfirmed: Unconfirmed,
    /// Stores being written, for redeliveries that arrive meanwhile.
    pub writing: Writing,
    /// Pending messages by lookup key (message_id / Kafka key).
    keys: KeyIndex,
    /// Deliveries admitted under the backpressure limits and being stored.
    reserved: u64,
    /// Routes whose target is unreachable, and where each waiting id is.
    blocked: HashMap<u16, Blocked>,
    blocked_ids: HashMap<u64, (u16, u64)>,
    /// Messages due at or after this belong in the far tier (`u64::MAX`:
    /// there is none).
    far_from: u64,
    /// Ids armed at or past `far_from` since the last spill.
    far_candidates: Vec<u64>,
    /// Messages in the far tier, per route.
    far_counts: Vec<u64>,
    /// The largest id ever armed (a cancel by key covers every id up to it).
    max_id: u64,
}

impl State {
    pub fn new(now_ms: u64, dedup_window: usize) -> Self {
        Self {
            wheel: TimingWheel::new(now_ms),
            in_flight: HashMap::new(),
            ready: Ready::default(),
            attempts: HashMap::new(),
            counts: Vec::new(),
            routes: Vec::new(),
            route_index: HashMap::new(),
            weights: Vec::new(),
            weights_by_name: HashMap::new(),
            unconfirmed: Unconfirmed::new(dedup_window),
            writing: Writing::default(),
            keys: KeyIndex::default(),
            reserved: 0,
            blocked: HashMap::new(),
            blocked_ids: HashMap::new(),
            far_from: u64::MAX,
            far_candidates: Vec::new(),
            far_counts: Vec::new(),
            max_id: 0,
        }
    }

    /// The index of a route name, added on first sight (at most 65536 routes).
    pub fn intern(&mut self, route: &str) -> Option<u16> {
        if let Some(&i) = self.route_index.get(route) {
            return Some(i);
        }
        let i = u16::try_from(self.routes.len()).ok()?;
        let name: Arc<str> = Arc::from(route);
        self.weights
            .push(self.weights_by_name.get(route).copied().unwrap_or(1).max(1));
        self.routes.push(name.clone());
        self.route_index.insert(name, i);
        self.counts.push(0);
        self.far_counts.push(0);
        Some(i)
    }

    /// Routes' weights by name (routes not named have 1).
    pub fn set_weights(&mut self, weights: HashMap<String, u32>) {
        for (name, &i) in &self.route_index {
            self.weights[i as usize] = weights.get(&**name).copied().unwrap_or(1).max(1);
        }
        self.weights_by_name = weights;
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
            .zip(self.counts.iter().zip(&self.far_counts).map(|(a, b)| a + b))
            .collect()
    }

    pub fn pending(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.far_counts.iter().sum::<u64>()
    }

    /// Messages in the far tier (all routes).
    pub fn far_pending(&self) -> u64 {
        self.far_counts.iter().sum()
    }

    pub fn max_id(&self) -> u64 {
        self.max_id
    }

    pub fn far_from(&self) -> u64 {
        self.far_from
    }

    pub fn set_far_from(&mut self, far_from: u64) {
        self.far_from = far_from;
    }

    /// Count `n` messages of `route` into (`n > 0`) or out of the far tier.
    pub fn add_far(&mut self, route: u16, n: i64) {
        let c = &mut self.far_counts[route as usize];
        *c = c.saturating_add_signed(n);
    }

    /// `id` was just armed for `deadline`: a spill candidate if that is at
    /// or past the far tier's frontier.
    pub fn note_far_candidate(&mut self, id: u64, deadline: u64) {
        if deadline >= self.far_from {
            self.far_candidates.push(id);
        }
    }

    /// Take every candidate still waiting in the wheel at or past the
    /// frontier out of it, counting it as far. What a spill writes.
    pub fn take_spillable(&mut self) -> Vec<Expired<Slot>> {
        let ids = std::mem::take(&mut self.far_candidates);
        let mut out = Vec::new();
        for id in ids {
            let Some(e) = self.wheel.get(id) else {
                continue; // fired, cancelled, or spilled already
            };
            // Waiting for a retry: its due time has passed, and in a bucket
            // of the retry's time its copy would hide from a cancel that
            // looks in the bucket of its stored due time.
            if e.deadline < self.far_from || self.attempts.contains_key(&id) {
                continue;
            }
            if let Some(e) = self.wheel.cancel(id) {
                self.counts[e.data.route as usize] -= 1;
                self.far_counts[e.data.route as usize] += 1;
                self.attempts.remove(&id);
                out.push(e);
            }
        }
        out
    }

    /// A spill failed: its entries go back into the wheel as they were.
    pub fn unspill(&mut self, entries: &[Expired<Slot>]) {
        for e in entries {
            self.far_counts[e.data.route as usize] -= 1;
            if self.wheel.insert(e.id, e.deadline, e.data).is_ok() {
                self.counts[e.data.route as usize] += 1;
            }
            self.far_candidates.push(e.id);
        }
    }

    /// Candidates waiting in the wheel with a deadline in `[from, to)`,
    /// taken out (a bucket being loaded re-arms them in (due, id) order
    /// with its own records).
    pub fn take_candidates_in(&mut self, from: u64, to: u64) -> Vec<Expired<Slot>> {
        let mut out = Vec::new();
        let mut kept = Vec::with_capacity(self.far_candidates.len());
        for id in std::mem::take(&mut self.far_candidates) {
            match self.wheel.get(id) {
                Some(e) if e.deadline >= from && e.deadline < to => {
                    if let Some(e) = self.wheel.cancel(id) {
                        self.counts[e.data.route as usize] -= 1;
                        out.push(e);
                    }
                }
                Some(_) => kept.push(id),
                None => {}
            }
        }
        self.far_candidates = kept;
        out
    }

    /// Pending messages plus deliveries admitted and still being stored.
    pub fn pending_and_reserved(&self) -> u64 {
        self.pending() + self.reserved
    }

    /// Admit one delivery to be stored if that stays under `max_pending`
    /// (0 = no limit). Each `true` is paired with one [`State::unreserve`].
    pub fn reserve(&mut self, max_pending: u64) -> bool {
        if max_pending > 0 && self.pending_and_reserved() >= max_pending {
            return false;
        }
        self.reserved += 1;
        true
    }

    /// An admitted delivery is stored (now pending) or failed.
    pub fn unreserve(&mut self) {
        debug_assert!(self.reserved > 0, "unreserve without reserve");
        self.reserved = self.reserved.saturating_sub(1);
    }

    /// Index a pending message under its key hash (cancel by key).
    pub fn index_key(&mut self, hash: u64, id: u64) {
        self.keys.insert(hash, id);
    }

    /// Forget a message's key-index entry (it left or was cancelled).
    pub fn unindex_key(&mut self, hash: u64, id: u64) {
        self.keys.remove(hash, id);
    }

    /// Ids indexed under a key hash: candidates, to verify against the WAL.
    pub fn ids_for_key(&self, hash: u64) -> Vec<u64> {
        self.keys.ids(hash)
    }

    /// Key-index entries, live or stale (see [`State::sweep_keys`]).
    pub fn indexed_keys(&self) -> usize {
        self.keys.len()
    }

    /// The entries waiting outside the wheel (taken out due, or on a
    /// blocked route), in (deadline, id) order from `lower` within each
    /// range: each route's due range, then each blocked route's, for the
    /// routes `route` admits (`None`: all).
    pub fn waiting_aside(
        &self,
        route: Option<u16>,
        lower: (u64, u64),
    ) -> impl Iterator<Item = std::collections::btree_map::Range<'_, (u64, u64), Slot>> {
        let ready = self.ready.ranges(route, lower);
        let blocked = self
            .blocked
            .iter()
            .filter(move |(&r, _)| route.is_none_or(|want| want == r))
            .map(move |(_, b)| b.waiting.range(lower..));
        ready.chain(blocked)
    }

    /// How many entries wait in the wheel itself.
    #[cfg(test)]
    pub fn wheel_len(&self) -> usize {
        self.wheel.len()
    }

    /// How many entries were taken out of the wheel and wait their turn.
    #[cfg(test)]
    pub fn held_count(&self) -> usize {
        self.ready.len()
    }

    /// Arm a message: into the wheel, counted against its route.
    /// Arm `id` (replacing an earlier arming of it, as a compaction copy
    /// replaces the original at recovery). Returns the replaced slot.
    pub fn arm(&mut self, id: u64, deadline: u64, slot: Slot) -> Option<Slot> {
        self.max_id = self.max_id.max(id);
        let old = self.wheel.cancel(id).or_else(|| self.ready.remove(id));
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
            .or_else(|| self.ready.remove(id))
            .or_else(|| self.unblock_one(id))?;
        self.counts[found.data.route as usize] -= 1;
        self.attempts.remove(&id);
        Some(found)
    }

    /// Visit up to `max` armed entries from slab node `from` on; returns
    /// where to go on, if anywhere (see [`TimingWheel::scan`]).
    pub fn scan_armed(
        &self,
        from: usize,
        max: usize,
        visit: impl FnMut(Expired<Slot>),
    ) -> Option<usize> {
        self.wheel.scan(from, max, visit)
    }

    /// Every waiting entry: armed in the wheel, taken out due and waiting
    /// its turn, or waiting for its blocked route (not those in flight).
    pub fn scan_waiting(&self, mut visit: impl FnMut(Expired<Slot>)) {
        self.wheel.scan(0, usize::MAX, &mut visit);
        for range in self.waiting_aside(None, (0, 0)) {
            for (&(deadline, id), &data) in range {
                visit(Expired { id, deadline, data });
            }
        }
    }

    /// The WAL position of every armed message.
    pub fn armed_positions(&self) -> impl Iterator<Item = WalPos> + '_ {
        self.wheel.iter().map(|e| e.data.pos)
    }

    /// Take an entry out of the wheel alone, as a pop would (tests).
    #[cfg(test)]
    pub fn unarm_for_test(&mut self, id: u64) -> Option<Expired<Slot>> {
        self.wheel.cancel(id)
    }

    /// Hand popped entries to the sink: each is in flight (still pending,
    /// with its attempt count) until [`State::settle`]. The entries from
    /// `probes_from` on are their blocked routes' probes.
    pub fn begin_flights(&mut self, batch: &[Expired<Slot>], probes_from: usize) {
        for (i, e) in batch.iter().enumerate() {
            let attempt = self.attempts.get(&e.id).copied().unwrap_or(0);
            let flight = InFlight {
                slot: e.data,
                deadline: e.deadline,
                attempt,
                probe: i >= probes_from,
            };
            debug_assert!(!self.in_flight.contains_key(&e.id), "{} flies twice", e.id);
            self.in_flight.insert(e.id, flight);
        }
    }

    pub fn in_flight(&self, id: u64) -> Option<&InFlight> {
        self.in_flight.get(&id)
    }

    pub fn is_in_flight(&self, id: u64) -> bool {
        self.in_flight.contains_key(&id)
    }

    /// Every message being published, with its flight.
    pub fn flights(&self) -> impl Iterator<Item = (u64, &InFlight)> {
        self.in_flight.iter().map(|(&id, f)| (id, f))
    }

    /// A publish finished: the flight ends. `None` if it had already ended.
    pub fn land(&mut self, id: u64) -> Option<InFlight> {
        self.in_flight.remove(&id)
    }

    /// A landed message left delayd: no longer pending on its route.
    pub fn retire(&mut self, id: u64, flight: &InFlight) {
        self.counts[flight.slot.route as usize] -= 1;
        self.attempts.remove(&id);
        self.unconfirmed.left(id);
    }

    /// A landed message failed: back into the wheel at `at`, one attempt
    /// more. Returns that attempt number.
    pub fn rearm_after_failure(&mut self, id: u64, flight: &InFlight, at: u64) -> u32 {
        let attempt = flight.attempt + 1;
        self.attempts.insert(id, attempt);
        let _ = self.wheel.insert(id, at, flight.slot);
        attempt
    }

    /// The earliest deadline in the wheel or the held set, or probe time.
    pub fn next_deadline(&self) -> Option<u64> {
        let next_held = self.ready.first_deadline();
        [self.wheel.next_deadline(), next_held, self.next_probe()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Due messages of blocked routes wait with their route instead of going out.
    pub fn hold_blocked(&mut self, now: u64, batch: &mut Vec<Expired<Slot>>) {
        if self.blocked.is_empty() {
            return;
        }
        let mut kept = Vec::with_capacity(batch.len());
        for e in batch.drain(..) {
            if self.is_blocked(e.data.route) {
                self.block(now, e, false);
            } else {
                kept.push(e);
            }
        }
        *batch = kept;
    }

    /// Move due entries into `out`, up to `max`, a route at a time (see
    /// [`Ready`]): first everything the wheel has due goes to its route's
    /// queue, where it is in (deadline, id) order; then each route with due
    /// work takes its turn. An entry whose deadline is ahead of the wall
    /// clock (the clock stepped back after the wheel advanced) waits there
    /// until the clock reaches it.
    ///
    /// `claimed` gives a route's earliest (due, id) stored but not yet
    /// armed ([`crate::wal::Wal::first_claimed_by_route`]): nothing of that
    /// route after it goes out before it is armed, so a message stored
    /// after its due instant does not overtake an earlier one whose append
    /// resolved later.
    pub fn pop_due(
        &mut self,
        now: u64,
        max: usize,
        claimed: &dyn Fn(u16) -> Option<(u64, u64)>,
        out: &mut Vec<Expired<Slot>>,
    ) {
        self.take_due_from_wheel(now);
        self.ready
            .take_in_turn(now, max, claimed, &self.weights, out);
    }

    /// Everything due in the wheel into the routes' queues, up to
    /// [`READY_MAX`] entries there; past that, only what is not later than
    /// something already there. The wheel gives a deadline's entries in
    /// the order they were armed, not in id order, and an entry armed late
    /// (its claim held the others back) must join its deadline here, so a
    /// deadline is never split between here and the wheel.
    fn take_due_from_wheel(&mut self, now: u64) {
        const CHUNK: usize = 1024;
        let mut taken = Vec::with_capacity(CHUNK);
        loop {
            let room = READY_MAX.saturating_sub(self.ready.len());
            let n = if room > 0 {
                room.min(CHUNK)
            } else {
                match (self.wheel.next_deadline(), self.ready.last_deadline()) {
                    (Some(next), Some(last)) if next <= last => 1,
                    _ => return,
                }
            };
            if self.wheel.poll_expired(now, n, &mut taken) == 0 {
                return;
            }
            for e in taken.drain(..) {
                self.ready.insert(e.deadline, e.id, e.data);
            }
        }
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
        let (slot, deadline) = self.ready.get(id)?;
        Some((slot, deadline, Phase::Waiting))
    }

    /// Hold back an entry the clock has not reached (it stepped back).
    #[cfg(test)]
    pub fn hold(&mut self, deadline: u64, id: u64, slot: Slot) {
        self.ready.insert(deadline, id, slot);
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
            || self.ready.contains(id)
    }

    /// Where a cancel's mark for remembered record `id` is kept: by a Done
    /// naming the segment a restart reads that record back from, so the
    /// mark lasts as long as the record does. `None` (the mark is written
    /// plainly) for a record still pending: that Done would retire its
    /// Schedule at the next restart (sim seed 223542), or if nothing of it
    /// is on disk.
    pub fn cancel_mark_kept_by(&self, id: u64) -> Option<u32> {
        if self.is_pending(id) {
            return None;
        }
        self.unconfirmed.read_back_from(id)
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
        if let Some(slot) = self.ready.get_mut(id) {
            slot.pos = pos;
            return true;
        }
        false
    }
}
