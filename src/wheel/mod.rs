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
//! order, with no per-entry sequence number. Slots are append-only vectors (cancel leaves a
//! tombstone), and entries at different levels never meet out of order: while an entry
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
//! list. A slot stores `u32` slab indices, and the id index (see `index.rs`) is an
//! open-addressing table of `u32` cells at most 3/4 full. That is about 32 + 4 + 5.3..10.7
//! bytes per entry plus spare vector capacity; see [`TimingWheel::heap_bytes`].

mod index;
mod level;
#[cfg(test)]
mod tests;

use std::collections::btree_map::{self, BTreeMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use self::index::IdIndex;
use self::level::{level_for, slot_for, slot_start, Level, Slot, DEAD, LEVELS};

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

#[derive(Debug, Clone, Copy)]
struct Node<T> {
    id: u64,
    deadline: u64,
    data: T,
    /// Position in its slot vector while pending; next free node while free.
    pos: u32,
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

/// A hierarchical timing wheel keyed by `u64` id. See the [module docs](self).
pub struct TimingWheel<T: Copy> {
    nodes: Vec<Node<T>>,
    free: u32,
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

    /// A wheel that holds `capacity` entries without reallocating its slab or index.
    pub fn with_capacity(now_ms: u64, capacity: usize) -> Self {
        TimingWheel {
            nodes: Vec::with_capacity(capacity),
            free: NIL,
            index: IdIndex::with_capacity(capacity),
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
        let nodes = &self.nodes;
        self.index.reserve_one(|i| nodes[i as usize].id);
        let vacant = match self.index.probe(id, |i| nodes[i as usize].id) {
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
            pos: NIL,
        });
        self.index.fill(vacant, idx);
        self.place(idx);
        Ok(())
    }

    /// Removes `id`, returning it; `None` if it is not pending. O(1).
    pub fn cancel(&mut self, id: u64) -> Option<Expired<T>> {
        let nodes = &self.nodes;
        let idx = self.index.remove(id, |i| nodes[i as usize].id)?;
        let node = self.nodes[idx as usize];
        self.unlink(&node);
        self.release(idx);
        Some(node.expired())
    }

    pub fn get(&self, id: u64) -> Option<Expired<T>> {
        self.lookup(id).map(|i| self.nodes[i as usize].expired())
    }

    /// The payload of `id`, e.g. to move its WAL position after compaction.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let idx = self.lookup(id)?;
        Some(&mut self.nodes[idx as usize].data)
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
            let slot = self.levels[level].slot(slot);
            let deadlines = slot.live_items().map(|i| self.nodes[i as usize].deadline);
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
            let popped = first.get_mut().pop_front();
            if first.get().live() == 0 {
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
        self.index
            .iter()
            .map(move |i| self.nodes[i as usize].expired())
    }

    /// Heap memory held, from vector capacities (the overdue map is estimated).
    pub fn heap_bytes(&self) -> usize {
        let overdue_node = std::mem::size_of::<(u64, Slot)>() + 8;
        self.nodes.capacity() * std::mem::size_of::<Node<T>>()
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
        self.index.find(id, |i| self.nodes[i as usize].id)
    }

    fn alloc(&mut self, node: Node<T>) -> u32 {
        if self.free == NIL {
            // Grow by 1/8 rather than doubling: the slab is most of the memory, and
            // large reallocations are cheap (the allocator remaps pages).
            if self.nodes.len() == self.nodes.capacity() {
                self.nodes
                    .reserve_exact((self.nodes.capacity() / 8).max(16));
            }
            // The index caps the entry count well below u32::MAX, and the slab never
            // holds more nodes than the peak entry count.
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        } else {
            let idx = self.free;
            self.free = self.nodes[idx as usize].pos;
            self.nodes[idx as usize] = node;
            idx
        }
    }

    fn release(&mut self, idx: u32) {
        self.nodes[idx as usize].pos = self.free;
        self.free = idx;
    }

    /// Stores node `idx` where its deadline belongs relative to `elapsed`.
    fn place(&mut self, idx: u32) {
        let deadline = self.nodes[idx as usize].deadline;
        let pos = if deadline < self.elapsed {
            self.overdue_len += 1;
            self.overdue.entry(deadline).or_default().push(idx)
        } else {
            let level = level_for(self.elapsed, deadline);
            self.levels[level].push(slot_for(deadline, level), idx)
        };
        self.nodes[idx as usize].pos = pos;
    }

    /// Removes `node` from its slot (recomputed from its deadline, as in `place`).
    fn unlink(&mut self, node: &Node<T>) {
        let nodes = &mut self.nodes;
        if node.deadline < self.elapsed {
            self.overdue_len -= 1;
            let btree_map::Entry::Occupied(mut entry) = self.overdue.entry(node.deadline) else {
                unreachable!("overdue entry without its slot");
            };
            let slot = entry.get_mut();
            if slot.kill(node.pos) {
                slot.compact(|i, pos| nodes[i as usize].pos = pos);
            }
            if slot.live() == 0 {
                entry.remove();
            }
        } else {
            if node.deadline <= *self.min_hint.get_mut() {
                *self.min_hint.get_mut() = UNKNOWN;
            }
            let level = level_for(self.elapsed, node.deadline);
            let slot_no = slot_for(node.deadline, level);
            let slot = self.levels[level].slot_mut(slot_no);
            if slot.kill(node.pos) {
                slot.compact(|i, pos| nodes[i as usize].pos = pos);
            }
            self.levels[level].settle(slot_no);
        }
    }

    /// Drops node `idx`'s index entry and frees it, reporting it in `out`.
    fn emit(&mut self, idx: u32, out: &mut Vec<Expired<T>>) {
        let node = self.nodes[idx as usize];
        let nodes = &self.nodes;
        let removed = self.index.remove(node.id, |i| nodes[i as usize].id);
        debug_assert_eq!(removed, Some(idx));
        self.release(idx);
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
            let level0 = &mut self.levels[0];
            let popped = level0.slot_mut(slot).pop_front();
            level0.settle(slot);
            let Some(idx) = popped else { break };
            self.emit(idx, out);
            moved += 1;
        }
        moved
    }

    /// Re-stores the entries of a higher-level slot relative to `elapsed` (its start).
    fn cascade(&mut self, level: usize, slot: usize) {
        let (items, head) = self.levels[level].take(slot);
        for &idx in &items[head..] {
            if idx != DEAD {
                debug_assert!(level_for(self.elapsed, self.nodes[idx as usize].deadline) < level);
                self.place(idx);
            }
        }
        self.levels[level].slot_mut(slot).recycle(items);
    }
}
