//! Hierarchical timing wheel: the in-memory index of pending delayed messages.
//!
//! # Layout
//!
//! Time is in milliseconds (1 ms ticks) and is passed in by the caller; there is no
//! clock and no I/O. A deadline is read as 11 base-64 digits and there are 11 levels of
//! 64 slots: level `l` covers digit `l` (bits `6l..6l+6`), so a slot at level `l` spans
//! `64^l` ms and the wheel spans the whole `u64` range. Each level has a `u64`
//! occupancy bitmap, so the next occupied slot is one mask plus `trailing_zeros`.
//!
//! The wheel keeps an internal time `elapsed` (at most [`TimingWheel::now`]). An entry with
//! `deadline >= elapsed` is stored at `level_for(elapsed, deadline)`: the level of the most
//! significant digit where the two differ, in the slot given by that digit of the deadline
//! (`slot_for`). Hence each level only holds deadlines
//! inside the 64-slot block of `elapsed`, ahead of `elapsed`'s own slot, and every
//! level-0 slot holds exactly one deadline. The earliest occupied slot of the lowest
//! non-empty level is the earliest slot overall.
//!
//! Polling moves `elapsed` from occupied slot to occupied slot (found through the
//! bitmaps, never by stepping over empty slots): a level-0 slot is popped, a higher slot
//! is *cascaded*, i.e. its entries are re-stored relative to the new `elapsed`, which puts
//! them at lower levels. A deadline arbitrarily far ahead is therefore reached after at
//! most 11 cascades of its entry, and an entry can always be found again from its deadline
//! and the current `elapsed` (this is how cancel locates it).
//!
//! Entries inserted with `deadline < elapsed` (already overdue) go to a small ordered map
//! `deadline -> slot` that is drained before the wheel; its deadlines are all below
//! `elapsed`, the wheel's are all at or above it.
//!
//! # Ordering rule
//!
//! Expired entries come out in ascending deadline, and for equal deadlines in insertion
//! order, with no per-entry sequence number. Slots are append-only vectors (a cancelled
//! entry stays in place, marked in a bitset, until its slot drops it), and entries at different levels never meet out of order: while an entry
//! for deadline `d` waits in a slot at level `l`, `elapsed` is still before that slot,
//! so any later insert for `d` also lands at level `l` in the same slot, after it. When
//! `elapsed` reaches the slot, it is cascaded at once (before any further insert) into
//! lower slots that are all empty at that moment, keeping its order. So every slot is
//! in insertion order, and a level-0 slot, which holds a single deadline, is popped front
//! to back.
//!
//! # Memory
//!
//! Entries live in a slab of 32-byte nodes (with a 12-byte `T`) reused through a free
//! list, plus one "cancelled" bit per node. A slot stores 8-byte items: the slab index and
//! the low 32 bits of the deadline, so cascades below level 6 never read the slab, and
//! cancel needs no position kept in the node. The id index (see `index.rs`) is an
//! open-addressing table of `u32` cells at most 13/16 full (about 2/3 after
//! [`TimingWheel::with_capacity`]). That is about 32 + 8 + 5.7..10 bytes per entry plus
//! spare vector capacity; see [`TimingWheel::heap_bytes`].
//!
//! # Cache misses
//!
//! At steady state an expiring entry costs two random memory accesses: its node and its
//! id-index cell. Both are loaded when its level-1 slot is cascaded to level 0, in tight
//! loops over the whole slot so that the misses overlap, about 64 ms (in wheel time)
//! before they are needed.

mod index;
mod level;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use self::index::IdIndex;
use self::level::{level_for, slot_for, slot_start, Level, Slot, LEVELS};

/// An entry as returned by the wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expired<T> {
    pub id: u64,
    pub deadline: u64,
    pub data: T,
}

/// `insert` was given an id that is already pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DuplicateId(pub u64);

impl fmt::Display for DuplicateId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "timer id {} is already scheduled", self.0)
    }
}

impl std::error::Error for DuplicateId {}

/// End of the slab free list.
const NIL: u32 = u32::MAX;
/// `min_hint` value meaning "not known, recompute".
const UNKNOWN: u64 = u64::MAX;
/// Highest level whose slots keep, in an item's low 32 deadline bits, every bit that can
/// differ from the slot start (bits below `6 * (level + 1) <= 32`).
const LO_LEVELS: usize = 5;

/// Aligned so that a 32-byte node never straddles two cache lines.
#[derive(Debug, Clone, Copy)]
#[repr(align(32))]
struct Node<T> {
    /// The entry's id while pending; the next free node while free.
    id: u64,
    deadline: u64,
    data: T,
}

impl<T: Copy> Node<T> {
    fn expired(&self) -> Expired<T> {
        Expired {
            id: self.id,
            deadline: self.deadline,
            data: self.data,
        }
    }
}

/// Node storage: a vector reused through a free list, plus one bit per node marking
/// cancelled entries that a slot still refers to (freed when the slot drops them).
struct Slab<T> {
    nodes: Vec<Node<T>>,
    free: u32,
    cancelled: Vec<u64>,
    /// Number of bits set in `cancelled`.
    unswept: usize,
}

impl<T: Copy> Slab<T> {
    fn with_capacity(capacity: usize) -> Self {
        Slab {
            nodes: Vec::with_capacity(capacity),
            free: NIL,
            cancelled: Vec::with_capacity(capacity.div_ceil(64)),
            unswept: 0,
        }
    }

    /// Nodes allocated, free or not.
    fn len(&self) -> usize {
        self.nodes.len()
    }

    fn node(&self, idx: u32) -> &Node<T> {
        &self.nodes[idx as usize]
    }

    fn id(&self, idx: u32) -> u64 {
        self.nodes[idx as usize].id
    }

    fn alloc(&mut self, node: Node<T>) -> u32 {
        if self.free == NIL {
            if self.nodes.len() == self.nodes.capacity() {
                // Grow by a small fraction rather than doubling: the slab is most of the
                // memory, and large reallocations are cheap (the allocator remaps pages).
                let cap = self.nodes.capacity();
                let step = if cap >= 1 << 16 { cap / 64 } else { cap / 8 };
                self.nodes.reserve_exact(step.max(16));
            }
            if self.nodes.len() == self.cancelled.len() * 64 {
                self.cancelled.push(0);
            }
            // The slab holds fewer nodes than 8/7 of the peak entry count (see
            // `TimingWheel::alloc`), which the index caps well below u32::MAX.
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        } else {
            let idx = self.free;
            self.free = self.nodes[idx as usize].id as u32;
            self.nodes[idx as usize] = node;
            idx
        }
    }

    fn release(&mut self, idx: u32) {
        self.nodes[idx as usize].id = u64::from(self.free);
        self.free = idx;
    }

    fn cancel(&mut self, idx: u32) {
        self.cancelled[idx as usize / 64] |= 1 << (idx % 64);
        self.unswept += 1;
    }

    fn is_cancelled(&self, idx: u32) -> bool {
        self.unswept != 0 && self.cancelled[idx as usize / 64] & (1 << (idx % 64)) != 0
    }

    /// Called when a slot drops its reference to `idx`: if the entry was cancelled, frees
    /// the node and returns true.
    fn sweep(&mut self, idx: u32) -> bool {
        if !self.is_cancelled(idx) {
            return false;
        }
        self.cancelled[idx as usize / 64] &= !(1 << (idx % 64));
        self.unswept -= 1;
        self.release(idx);
        true
    }

    fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node<T>>() + self.cancelled.capacity() * 8
    }
}

/// A hierarchical timing wheel keyed by `u64` id. See the [module docs](self).
pub struct TimingWheel<T: Copy> {
    nodes: Slab<T>,
    index: IdIndex,
    levels: Vec<Level>,
    /// Entries with `deadline < elapsed`, by deadline.
    overdue: BTreeMap<u64, Slot>,
    overdue_len: usize,
    /// Internal wheel time; every wheel entry has `deadline >= elapsed`.
    elapsed: u64,
    now: u64,
    /// Exact minimum deadline in the wheel (not `overdue`), or `UNKNOWN`. Caches the slot
    /// scan of `next_deadline`; atomic only to stay `Sync` behind a `&self` method.
    min_hint: AtomicU64,
}

impl<T: Copy> fmt::Debug for TimingWheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimingWheel")
            .field("now", &self.now)
            .field("elapsed", &self.elapsed)
            .field("len", &self.len())
            .field("overdue", &self.overdue_len)
            .finish_non_exhaustive()
    }
}

impl<T: Copy> TimingWheel<T> {
    pub fn new(now_ms: u64) -> Self {
        Self::with_capacity(now_ms, 0)
    }

    /// Nodes the slab has room for (tests of its growth policy).
    #[cfg(test)]
    fn slab_capacity(&self) -> usize {
        self.nodes.nodes.capacity()
    }

    /// A wheel that holds `capacity` entries without reallocating its slab or index.
    pub fn with_capacity(now_ms: u64, capacity: usize) -> Self {
        TimingWheel {
            nodes: Slab::with_capacity(capacity),
            // 1/16 spare keeps the table near 2/3 load when full, where probing is short.
            index: IdIndex::with_capacity(capacity.saturating_add(capacity / 16)),
            levels: (0..LEVELS).map(|_| Level::new()).collect(),
            overdue: BTreeMap::new(),
            overdue_len: 0,
            elapsed: now_ms,
            now: now_ms,
            min_hint: AtomicU64::new(UNKNOWN),
        }
    }

    /// Current wheel time: the latest `now_ms` seen.
    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Schedules `id` at `deadline_ms`. O(1) (amortized, for table growth) unless the
    /// deadline is already behind internal time, where it is O(log distinct overdue deadlines).
    ///
    /// A deadline <= now() is already expired: it is returned by the next `poll_expired`,
    /// in (deadline, insertion) order with the other expired entries.
    pub fn insert(&mut self, id: u64, deadline_ms: u64, data: T) -> Result<(), DuplicateId> {
        let slab = &self.nodes;
        self.index.reserve_one(|i| slab.id(i));
        let vacant = match self.index.probe(id, |i| slab.id(i)) {
            Ok(_) => return Err(DuplicateId(id)),
            Err(vacant) => vacant,
        };
        if deadline_ms >= self.elapsed {
            let hint = self.min_hint.get_mut();
            if self.index.len() == self.overdue_len {
                *hint = deadline_ms; // the wheel part was empty
            } else if *hint != UNKNOWN {
                *hint = (*hint).min(deadline_ms);
            }
        }
        let idx = self.alloc(Node {
            id,
            deadline: deadline_ms,
            data,
        });
        self.index.fill(vacant, idx);
        self.place(idx, deadline_ms);
        if self.index.starts_block(id) {
            // Ids are usually sequential: load the next block's home cells ahead of use.
            black_box(
                self.index
                    .peek_home(id.wrapping_add(self.index.block_len())),
            );
        }
        Ok(())
    }

    /// Removes `id`, returning it; `None` if it is not pending. O(1).
    pub fn cancel(&mut self, id: u64) -> Option<Expired<T>> {
        let slab = &self.nodes;
        let idx = self.index.remove(id, |i| slab.id(i))?;
        let node = *self.nodes.node(idx);
        self.nodes.cancel(idx);
        self.unlink(node.deadline);
        Some(node.expired())
    }

    pub fn get(&self, id: u64) -> Option<Expired<T>> {
        self.lookup(id).map(|i| self.nodes.node(i).expired())
    }

    /// The payload of `id`, e.g. to move its WAL position after compaction.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let idx = self.lookup(id)?;
        Some(&mut self.nodes.nodes[idx as usize].data)
    }

    pub fn contains(&self, id: u64) -> bool {
        self.lookup(id).is_some()
    }

    /// Earliest deadline of any entry (exact), or `None` if empty.
    ///
    /// Found through the bitmaps; if the first occupied slot is above level 0 its live
    /// entries are scanned once and the result is cached until that minimum is removed.
    pub fn next_deadline(&self) -> Option<u64> {
        if let Some((&deadline, _)) = self.overdue.first_key_value() {
            return Some(deadline);
        }
        if self.index.len() == self.overdue_len {
            return None;
        }
        let hint = self.min_hint.load(Relaxed);
        if hint != UNKNOWN {
            return Some(hint);
        }
        let (level, slot, start) = self.next_expiration()?;
        let min = if level == 0 {
            start
        } else {
            let items = self.levels[level].slot(slot).items();
            let live = items.iter().filter(|i| !self.nodes.is_cancelled(i.idx));
            let deadlines = live.map(|i| self.nodes.node(i.idx).deadline);
            deadlines.min().unwrap_or(start)
        };
        self.min_hint.store(min, Relaxed);
        Some(min)
    }

    /// Advances wheel time to `max(now(), now_ms)` and moves up to `max` expired entries
    /// (deadline <= now) into `out` in (deadline, insertion) order. Returns how many were
    /// moved. Entries left over because of `max` stay first in line for the next call.
    pub fn poll_expired(&mut self, now_ms: u64, max: usize, out: &mut Vec<Expired<T>>) -> usize {
        self.now = self.now.max(now_ms);
        let mut moved = 0;
        // Overdue entries are all earlier than anything in the wheel.
        while moved < max {
            let Some(mut first) = self.overdue.first_entry() else {
                break;
            };
            let slab = &mut self.nodes;
            let popped = first.get_mut().pop_front(|i| slab.sweep(i));
            if first.get().live() == 0 {
                first.get_mut().reset(|i| slab.sweep(i));
                first.remove();
            }
            if let Some(idx) = popped {
                self.overdue_len -= 1;
                self.emit(idx, out);
                moved += 1;
            }
        }
        while moved < max {
            match self.next_expiration() {
                Some((level, slot, start)) if start <= self.now => {
                    self.elapsed = start;
                    if level == 0 {
                        moved += self.pop_slot(slot, max - moved, out);
                    } else {
                        self.cascade(level, slot);
                    }
                }
                _ => {
                    // Nothing else due: skip straight to `now`, whatever the distance.
                    self.elapsed = self.now;
                    break;
                }
            }
        }
        moved
    }

    /// All entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = Expired<T>> + '_ {
        self.index.iter().map(move |i| self.nodes.node(i).expired())
    }

    /// Visit the pending entries among slab nodes `from..from + max`, and
    /// return where the next call should start (`None` at the end). Nodes
    /// never move, so a scan in steps (releasing a lock between them) sees
    /// every entry pending throughout it exactly once, whatever is inserted,
    /// fired or cancelled in between.
    pub fn scan(
        &self,
        from: usize,
        max: usize,
        mut visit: impl FnMut(Expired<T>),
    ) -> Option<usize> {
        let end = from.saturating_add(max).min(self.nodes.len());
        for idx in from..end {
            let idx = idx as u32;
            let node = self.nodes.node(idx);
            // Free nodes hold a free-list link in `id`; cancelled ones wait
            // for their slot to drop them. Only the index knows who is live.
            if !self.nodes.is_cancelled(idx) && self.lookup(node.id) == Some(idx) {
                visit(node.expired());
            }
        }
        (end < self.nodes.len()).then_some(end)
    }

    /// Heap memory held, from vector capacities (the overdue map is estimated).
    pub fn heap_bytes(&self) -> usize {
        // The overdue map's B-tree nodes hold 11 entries and are about half
        // full when filled in time order, as overdue deadlines come (78
        // bytes an entry measured, against 80 here; filled in random order,
        // about 64). tests/wheel_memory.rs checks it against the allocator.
        let overdue_node = 2 * std::mem::size_of::<(u64, Slot)>();
        self.nodes.heap_bytes()
            + self.index.heap_bytes()
            + self.levels.capacity() * std::mem::size_of::<Level>()
            + self.levels.iter().map(Level::heap_bytes).sum::<usize>()
            + self
                .overdue
                .values()
                .map(|s| s.heap_bytes() + overdue_node)
                .sum::<usize>()
    }

    fn lookup(&self, id: u64) -> Option<u32> {
        self.index.find(id, |i| self.nodes.id(i))
    }

    /// Allocates a node. Cancelled nodes are freed lazily, when their slot drops them;
    /// if they make up 1/8 of the slab when it would grow, all slots are swept first, so
    /// the slab stays below 8/7 of the peak entry count.
    fn alloc(&mut self, node: Node<T>) -> u32 {
        let slab = &mut self.nodes;
        if slab.free == NIL && slab.unswept > 0 && slab.unswept * 8 >= slab.len() {
            let slots = self
                .levels
                .iter_mut()
                .flat_map(|l| l.slots_mut().iter_mut());
            for slot in slots.chain(self.overdue.values_mut()) {
                slot.compact(|i| slab.sweep(i));
            }
            debug_assert_eq!(slab.unswept, 0);
        }
        slab.alloc(node)
    }

    /// Stores node `idx` where `deadline` (its deadline) belongs relative to `elapsed`.
    /// Returns the level, or `LEVELS` for the overdue map.
    fn place(&mut self, idx: u32, deadline: u64) -> usize {
        if deadline < self.elapsed {
            self.overdue_len += 1;
            self.overdue
                .entry(deadline)
                .or_default()
                .push(idx, deadline);
            LEVELS
        } else {
            let level = level_for(self.elapsed, deadline);
            self.levels[level].push(slot_for(deadline, level), idx, deadline);
            level
        }
    }

    /// Accounts for a cancelled entry with `deadline` in its slot (found as in `place`).
    fn unlink(&mut self, deadline: u64) {
        let slab = &mut self.nodes;
        if deadline < self.elapsed {
            self.overdue_len -= 1;
            let Some(slot) = self.overdue.get_mut(&deadline) else {
                unreachable!("overdue entry without its slot");
            };
            if slot.kill() {
                slot.compact(|i| slab.sweep(i));
            }
            if slot.live() == 0 {
                slot.reset(|i| slab.sweep(i));
                self.overdue.remove(&deadline);
            }
        } else {
            if deadline <= *self.min_hint.get_mut() {
                *self.min_hint.get_mut() = UNKNOWN;
            }
            let level = level_for(self.elapsed, deadline);
            let slot_no = slot_for(deadline, level);
            let slot = self.levels[level].slot_mut(slot_no);
            if slot.kill() {
                slot.compact(|i| slab.sweep(i));
            }
            self.levels[level].settle(slot_no, |i| slab.sweep(i));
        }
    }

    /// Drops node `idx`'s index entry and frees it, reporting it in `out`.
    fn emit(&mut self, idx: u32, out: &mut Vec<Expired<T>>) {
        let node = *self.nodes.node(idx);
        let slab = &self.nodes;
        let removed = self.index.remove(node.id, |i| slab.id(i));
        debug_assert_eq!(removed, Some(idx));
        self.nodes.release(idx);
        out.push(node.expired());
    }

    /// Earliest occupied slot as (level, slot, start time). The lowest non-empty level
    /// always has it: higher levels only hold slots after the current block of lower ones.
    fn next_expiration(&self) -> Option<(usize, usize, u64)> {
        self.levels.iter().enumerate().find_map(|(level, l)| {
            let slot = l.next_occupied(self.elapsed, level)?;
            Some((level, slot, slot_start(self.elapsed, level, slot)))
        })
    }

    /// Pops up to `budget` entries from level-0 slot `slot` (all share one deadline).
    fn pop_slot(&mut self, slot: usize, budget: usize, out: &mut Vec<Expired<T>>) -> usize {
        *self.min_hint.get_mut() = UNKNOWN; // the minimum is being removed
        let mut moved = 0;
        while moved < budget {
            let slab = &mut self.nodes;
            let level0 = &mut self.levels[0];
            let popped = level0.slot_mut(slot).pop_front(|i| slab.sweep(i));
            level0.settle(slot, |i| slab.sweep(i));
            let Some(idx) = popped else { break };
            self.emit(idx, out);
            moved += 1;
        }
        moved
    }

    /// Re-stores the entries of a higher-level slot relative to `elapsed` (its start).
    ///
    /// Up to `LO_LEVELS` the deadlines come from the items, so the slab is not read. Entries
    /// that reach level 0 expire within 64 ms: their node and id-index cell are loaded now,
    /// all at once, so that those cache misses overlap instead of stalling each expiry.
    fn cascade(&mut self, level: usize, slot: usize) {
        let (items, head) = self.levels[level].take(slot);
        let high = self.elapsed >> 32 << 32;
        for item in &items[head..] {
            if self.nodes.sweep(item.idx) {
                continue;
            }
            let deadline = if level <= LO_LEVELS {
                high | u64::from(item.lo)
            } else {
                self.nodes.node(item.idx).deadline
            };
            debug_assert_eq!(deadline, self.nodes.node(item.idx).deadline);
            debug_assert!(level_for(self.elapsed, deadline) < level);
            self.place(item.idx, deadline);
        }
        if level == 1 {
            // Two tight passes so that the misses of each overlap.
            let live = &items[head..];
            let mut warm = 0u64;
            for item in live {
                warm = warm.wrapping_add(self.nodes.id(item.idx));
            }
            for item in live {
                let id = self.nodes.id(item.idx);
                warm = warm.wrapping_add(u64::from(self.index.peek_home(id)));
            }
            black_box(warm);
        }
        self.levels[level].slot_mut(slot).recycle(items);
    }
}
