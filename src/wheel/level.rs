//! Wheel arithmetic and per-level slot storage.
//!
//! A deadline is read as 11 base-64 digits. Level `l` owns digit `l`, i.e. bits
//! `6l .. 6l+6`; a slot at level `l` spans `64^l` ms.

/// Bits of a deadline consumed per level.
pub(super) const LEVEL_BITS: u32 = 6;
/// Slots per level; one bit each in the occupancy bitmap.
pub(super) const SLOTS: usize = 1 << LEVEL_BITS;
const SLOT_MASK: u64 = SLOTS as u64 - 1;
/// 11 levels of 6 bits cover all 64 bits of a deadline (the top level uses 4).
pub(super) const LEVELS: usize = 11;

/// Slots whose vector grew beyond this give the memory back once drained.
const RETAIN_CAPACITY: usize = 1024;
/// Compaction is skipped while fewer tombstones than this accumulated.
const MIN_DEAD_TO_COMPACT: u32 = 16;

/// Level at which `when` is stored while wheel time is `elapsed` (`when >= elapsed`):
/// the level owning the most significant digit in which the two differ.
pub(super) fn level_for(elapsed: u64, when: u64) -> usize {
    // `| SLOT_MASK` maps "equal" and "differ only in digit 0" to level 0.
    let masked = (elapsed ^ when) | SLOT_MASK;
    let significant = 63 - masked.leading_zeros();
    (significant / LEVEL_BITS) as usize
}

/// Digit `level` of `when`.
pub(super) fn slot_for(when: u64, level: usize) -> usize {
    ((when >> (LEVEL_BITS * level as u32)) & SLOT_MASK) as usize
}

/// First millisecond of `slot` at `level` inside the level block that contains `elapsed`.
pub(super) fn slot_start(elapsed: u64, level: usize, slot: usize) -> u64 {
    let block_shift = LEVEL_BITS * (level as u32 + 1);
    // The top level's block is the whole u64 range (a shift by >= 64 would overflow).
    let block = if block_shift >= 64 {
        0
    } else {
        elapsed >> block_shift << block_shift
    };
    block | ((slot as u64) << (LEVEL_BITS * level as u32))
}

/// One slot entry: a slab index and the low 32 bits of its deadline.
///
/// Carrying the deadline bits lets a cascade re-store entries without reading the slab:
/// below level 6 every deadline bit that can differ from the slot start is in `lo`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Item {
    pub(super) idx: u32,
    pub(super) lo: u32,
}

/// Entries sharing a slot, in the order they arrived (which is insertion order).
///
/// A cancelled entry stays in place (the wheel marks its node, so no position is kept
/// per entry) and only the count of such entries is kept here; they are dropped when
/// met by `pop_front`, a cascade, or a compaction once they outnumber live entries.
/// `swept(idx)` callbacks report whether `idx` was cancelled, freeing its node if so.
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// Entries; those before `head` were already popped.
    items: Vec<Item>,
    head: u32,
    /// Cancelled entries at or after `head`.
    dead: u32,
}

impl Slot {
    pub(super) fn live(&self) -> usize {
        self.items.len() - self.head as usize - self.dead as usize
    }

    /// Appends slab index `idx` with deadline `deadline`.
    pub(super) fn push(&mut self, idx: u32, deadline: u64) {
        if self.items.len() == self.items.capacity() {
            // Grow by 1/4, or 1/8 once large, instead of doubling: big slots hold a large
            // share of all entries.
            let cap = self.items.capacity();
            let step = if cap >= 4096 { cap / 8 } else { cap / 4 };
            self.items.reserve_exact(step.max(8));
        }
        self.items.push(Item {
            idx,
            lo: deadline as u32,
        });
    }

    /// Next live entry, dropping cancelled ones on the way.
    pub(super) fn pop_front(&mut self, mut swept: impl FnMut(u32) -> bool) -> Option<u32> {
        while let Some(&item) = self.items.get(self.head as usize) {
            self.head += 1;
            if !swept(item.idx) {
                return Some(item.idx);
            }
            self.dead -= 1;
        }
        None
    }

    /// Entries not yet popped, cancelled ones included.
    pub(super) fn items(&self) -> &[Item] {
        &self.items[self.head as usize..]
    }

    /// Counts one more cancelled entry. Returns true if the slot should be compacted.
    pub(super) fn kill(&mut self) -> bool {
        self.dead += 1;
        debug_assert!(self.dead as usize + self.head as usize <= self.items.len());
        self.dead >= MIN_DEAD_TO_COMPACT && self.dead as usize * 2 >= self.live()
    }

    /// Drops popped and cancelled entries.
    pub(super) fn compact(&mut self, mut swept: impl FnMut(u32) -> bool) {
        if self.dead == 0 && self.head == 0 {
            return;
        }
        self.items.drain(..self.head as usize);
        if self.dead > 0 {
            self.items.retain(|item| !swept(item.idx));
        }
        self.head = 0;
        self.dead = 0;
    }

    /// Empties a slot with no live entries left, keeping a small allocation for reuse.
    pub(super) fn reset(&mut self, swept: impl FnMut(u32) -> bool) {
        debug_assert_eq!(self.live(), 0);
        self.compact(swept);
        let items = std::mem::take(&mut self.items);
        self.recycle(items);
    }

    /// Removes everything, returning the vector and the position of the first unpopped item.
    /// Cancelled entries are left for the caller to sweep.
    pub(super) fn take(&mut self) -> (Vec<Item>, usize) {
        let head = self.head as usize;
        self.head = 0;
        self.dead = 0;
        (std::mem::take(&mut self.items), head)
    }

    /// Gives a vector from `take` back to an empty slot so its allocation can be reused.
    pub(super) fn recycle(&mut self, mut items: Vec<Item>) {
        debug_assert!(self.items.is_empty());
        self.head = 0;
        self.dead = 0;
        if items.capacity() <= RETAIN_CAPACITY {
            items.clear();
            self.items = items;
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.items.capacity() * std::mem::size_of::<Item>()
    }
}

/// One level: 64 slots and a bitmap with bit `s` set iff slot `s` has a live entry.
#[derive(Debug)]
pub(super) struct Level {
    occupied: u64,
    slots: [Slot; SLOTS],
}

impl Level {
    pub(super) fn new() -> Self {
        Level {
            occupied: 0,
            slots: std::array::from_fn(|_| Slot::default()),
        }
    }

    pub(super) fn push(&mut self, slot: usize, idx: u32, deadline: u64) {
        self.occupied |= 1 << slot;
        self.slots[slot].push(idx, deadline);
    }

    pub(super) fn slot(&self, slot: usize) -> &Slot {
        &self.slots[slot]
    }

    pub(super) fn slot_mut(&mut self, slot: usize) -> &mut Slot {
        &mut self.slots[slot]
    }

    /// Call after removing from `slot`: clears it and its bit once nothing live is left.
    pub(super) fn settle(&mut self, slot: usize, swept: impl FnMut(u32) -> bool) {
        if self.slots[slot].live() == 0 {
            self.slots[slot].reset(swept);
            self.occupied &= !(1 << slot);
        }
    }

    /// Removes all entries of `slot` (see [`Slot::take`]).
    pub(super) fn take(&mut self, slot: usize) -> (Vec<Item>, usize) {
        self.occupied &= !(1 << slot);
        self.slots[slot].take()
    }

    /// First occupied slot at or after the digit of `elapsed` at this level.
    ///
    /// Slots before that digit are always empty: entries live in the level block of the
    /// current time and are cascaded or popped once time reaches their slot.
    pub(super) fn next_occupied(&self, elapsed: u64, level: usize) -> Option<usize> {
        let digit = slot_for(elapsed, level);
        debug_assert_eq!(self.occupied & !(u64::MAX << digit), 0, "slot behind time");
        let ahead = self.occupied & (u64::MAX << digit);
        (ahead != 0).then(|| ahead.trailing_zeros() as usize)
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.slots.iter().map(Slot::heap_bytes).sum()
    }

    pub(super) fn slots_mut(&mut self) -> &mut [Slot; SLOTS] {
        &mut self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::Slot;

    /// A slot grows by 1/4, then 1/8 past 4096 entries, never doubling (a
    /// big slot holds a large share of all entries), in few steps.
    #[test]
    fn a_slot_grows_by_a_fraction_in_few_steps() {
        let mut slot = Slot::default();
        let (mut last_cap, mut grew) = (slot.items.capacity(), 0);
        for idx in 0..50_000u32 {
            slot.push(idx, u64::from(idx));
            let cap = slot.items.capacity();
            if cap != last_cap {
                grew += 1;
                let held = idx as usize + 1;
                let allowed = if held > 4096 { held / 8 } else { held / 4 } + 8;
                assert!(
                    cap - held <= allowed + held / 64,
                    "{held} held, room for {cap}"
                );
                last_cap = cap;
            }
        }
        assert!(grew <= 60, "the slot grew {grew} times for 50000 pushes");
        assert_eq!(slot.live(), 50_000);
    }
}
