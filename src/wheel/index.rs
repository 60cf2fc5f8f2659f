//! The id → slab index map: open addressing with linear probing over `u32` cells.
//!
//! Ids are not stored here; a candidate is confirmed by reading its id from the slab
//! (the `ids` callbacks). The table has `size` cells, a multiple of 16 (not necessarily a
//! power of two, so `with_capacity` can size it closely), stored as 64-byte aligned cache
//! lines. With `2^bits >= size`, a cell holds `fingerprint | displacement | slab index`:
//!
//! - the low `bits` bits are the slab index. This needs every slab index below
//!   `2^bits - 1`; it holds because the table never shrinks, stays at most 13/16 full, and
//!   the slab holds fewer than 8/7 times the peak number of entries;
//! - up to 5 bits hold the distance from the entry's home cell, saturating. A lookup only
//!   reads ids of cells with the right distance (and fingerprint), and deletion can shift
//!   later cells back (no tombstones) mostly without reading their ids from the slab;
//! - the remaining high bits are a fingerprint from the id's hash.
//!
//! Ids that differ only in their low 3 bits share a hashed line of 16 cells, with their
//! homes on every other cell, so sequential ids (the usual case) are inserted into the
//! same cache line while leaving room in it for the runs of other lines' ids.
//!
//! `benches/id_index.rs` compares this table with `hashbrown::HashTable` doing the same
//! job (figures in docs/benchmarks.md): this one is about 20 % smaller and inserts
//! sequential ids faster from 1M entries up; hashbrown finds about 2× and removes about
//! 1.5× faster at every size. Inside the wheel (`benches/wheel.rs`, one insert and one
//! expiry per step) this table made the wheel about twice as fast as hashbrown did, at
//! 1M and at 10M pending, so it stays.

/// An unused cell. Never a valid cell: slab indices stay below `2^bits - 1`.
const EMPTY: u32 = u32::MAX;
const MIN_BITS: u32 = 4;
/// Caps the index at 2^31 cells (about 1.6 billion entries).
const MAX_BITS: u32 = 31;
/// Log2 of the number of ids, equal but for their low bits, that share a line of homes.
const BLOCK_BITS: u32 = 3;
const MAX_DISP_BITS: u32 = 5;

/// Cells per cache line.
const LINE: usize = 16;
/// Cells per line for each id of a block: a block's homes are every other cell of a line.
const SPREAD: usize = LINE >> BLOCK_BITS;

#[derive(Debug, Clone, Copy)]
#[repr(align(64))]
struct Line([u32; LINE]);

/// The cells, stored as aligned cache lines and indexed by cell number.
#[derive(Debug)]
struct Cells(Vec<Line>);

impl Cells {
    fn new(cells: usize) -> Self {
        Cells(vec![Line([EMPTY; LINE]); cells / LINE])
    }

    fn iter(&self) -> impl Iterator<Item = &u32> + '_ {
        self.0.iter().flat_map(|line| line.0.iter())
    }

    fn heap_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<Line>()
    }
}

impl std::ops::Index<usize> for Cells {
    type Output = u32;

    fn index(&self, cell: usize) -> &u32 {
        &self.0[cell / LINE].0[cell % LINE]
    }
}

impl std::ops::IndexMut<usize> for Cells {
    fn index_mut(&mut self, cell: usize) -> &mut u32 {
        &mut self.0[cell / LINE].0[cell % LINE]
    }
}

#[derive(Debug)]
pub(super) struct IdIndex {
    cells: Cells,
    /// Number of cells: a multiple of `LINE`, at most `2^bits`.
    size: usize,
    /// Width of the slab index field.
    bits: u32,
    len: usize,
}

/// Where a missing id would go.
pub(super) struct Vacant {
    cell: usize,
    tag: u32,
}

#[inline]
fn hash(id: u64) -> u64 {
    // Folded 64×64→128 multiply: cheap, and mixes all input bits into both halves.
    let m = u128::from((id >> BLOCK_BITS) ^ 0x243F_6A88_85A3_08D3) * 0x9E37_79B9_7F4A_7C15;
    (m as u64) ^ ((m >> 64) as u64)
}

impl IdIndex {
    /// A table `entries` fill to 3/4; it grows only past 13/16, so an entry count that
    /// hovers around `entries` does not double it.
    pub(super) fn with_capacity(entries: usize) -> Self {
        let lines = (entries.saturating_mul(4) / 3).div_ceil(LINE);
        Self::with_size((lines * LINE).clamp(1 << MIN_BITS, 1 << MAX_BITS))
    }

    fn with_size(size: usize) -> Self {
        IdIndex {
            cells: Cells::new(size),
            size,
            bits: size.next_power_of_two().trailing_zeros(),
            len: 0,
        }
    }

    /// Load limit of 13/16 for a table of `size` cells.
    fn max_len(size: usize) -> usize {
        size / 16 * 13
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn idx_mask(&self) -> u32 {
        ((1u64 << self.bits) - 1) as u32
    }

    /// The cell after `cell`, wrapping around.
    #[inline]
    fn next(&self, cell: usize) -> usize {
        if cell + 1 == self.size {
            0
        } else {
            cell + 1
        }
    }

    /// How many cells `to` is after `from`, wrapping around.
    #[inline]
    fn dist(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.size - from
        }
    }

    #[inline]
    fn disp_bits(&self) -> u32 {
        (32 - self.bits).min(MAX_DISP_BITS)
    }

    /// Saturation value of the displacement field.
    #[inline]
    fn disp_sat(&self) -> u32 {
        (1 << self.disp_bits()) - 1
    }

    /// Cell bits above the slab index and displacement.
    #[inline]
    fn fp_mask(&self) -> u32 {
        !(self.idx_mask() | (self.disp_sat() << self.bits))
    }

    #[inline]
    fn home(&self, id: u64, hash: u64) -> usize {
        // Multiply-shift maps the hash onto the lines without a power-of-two size.
        let line = ((u128::from(hash) * (self.size / LINE) as u128) >> 64) as usize;
        line * LINE + (id as usize & ((1 << BLOCK_BITS) - 1)) * SPREAD
    }

    /// The tag bits of a cell `disp` cells after the home of an id with `hash`.
    #[inline]
    fn tag(&self, hash: u64, disp: usize) -> u32 {
        let disp = (disp as u32).min(self.disp_sat());
        (hash as u32 & self.fp_mask()) | (disp << self.bits)
    }

    /// Finds the cell holding `id`, or where to put it.
    fn locate(&self, id: u64, ids: impl Fn(u32) -> u64) -> Result<usize, Vacant> {
        let h = hash(id);
        let idx_mask = self.idx_mask();
        let mut cell = self.home(id, h);
        for disp in 0.. {
            let c = self.cells[cell];
            let tag = self.tag(h, disp);
            if c == EMPTY {
                return Err(Vacant { cell, tag });
            }
            if c & !idx_mask == tag && ids(c & idx_mask) == id {
                return Ok(cell);
            }
            cell = self.next(cell);
        }
        unreachable!("the table always has an empty cell")
    }

    /// Finds `id`: `Ok(slab index)` if present, else where to put it.
    pub(super) fn probe(&self, id: u64, ids: impl Fn(u32) -> u64) -> Result<u32, Vacant> {
        self.locate(id, ids)
            .map(|cell| self.cells[cell] & self.idx_mask())
    }

    pub(super) fn find(&self, id: u64, ids: impl Fn(u32) -> u64) -> Option<u32> {
        self.probe(id, ids).ok()
    }

    /// Whether `id` is the first of the ids that share a line of home cells.
    pub(super) fn starts_block(&self, id: u64) -> bool {
        id.trailing_zeros() >= BLOCK_BITS
    }

    /// How many consecutive ids share a line of home cells.
    pub(super) fn block_len(&self) -> u64 {
        1 << BLOCK_BITS
    }

    /// Reads the cache line of `id`'s home cells and the next one (where its run may
    /// continue), only to bring them in ahead of use.
    pub(super) fn peek_home(&self, id: u64) -> u32 {
        let home = self.home(id, hash(id));
        self.cells[home] ^ self.cells[self.next(home | (LINE - 1))]
    }

    /// Stores slab index `idx` at a cell returned by `probe` (no growth in between).
    pub(super) fn fill(&mut self, vacant: Vacant, idx: u32) {
        debug_assert!(idx < self.idx_mask());
        self.cells[vacant.cell] = vacant.tag | idx;
        self.len += 1;
    }

    /// Makes room for one more entry, doubling the table if needed.
    ///
    /// # Panics
    /// Beyond 2^31 cells, like `Vec` on capacity overflow.
    pub(super) fn reserve_one(&mut self, ids: impl Fn(u32) -> u64) {
        if self.len < Self::max_len(self.size) {
            return;
        }
        assert!(self.size < 1 << MAX_BITS, "timing wheel capacity overflow");
        let old_mask = self.idx_mask();
        let grown = Self::with_size((self.size * 2).min(1 << MAX_BITS));
        let old = std::mem::replace(self, grown).cells;
        for &c in old.iter().filter(|&&c| c != EMPTY) {
            let idx = c & old_mask;
            let id = ids(idx);
            let h = hash(id);
            let mut cell = self.home(id, h);
            let mut disp = 0;
            while self.cells[cell] != EMPTY {
                cell = self.next(cell);
                disp += 1;
            }
            self.cells[cell] = self.tag(h, disp) | idx;
            self.len += 1;
        }
    }

    /// Removes `id`, returning its slab index.
    pub(super) fn remove(&mut self, id: u64, ids: impl Fn(u32) -> u64) -> Option<u32> {
        let mut hole = self.locate(id, &ids).ok()?;
        let (idx_mask, sat) = (self.idx_mask(), self.disp_sat());
        let idx = self.cells[hole] & idx_mask;
        // Backward-shift deletion: pull back each later cell of the run whose probe
        // path passes through the hole, so lookups never stop early at a false EMPTY.
        let mut cell = hole;
        loop {
            cell = self.next(cell);
            let c = self.cells[cell];
            if c == EMPTY {
                break;
            }
            let mut disp = ((c >> self.bits) & sat) as usize;
            if disp == sat as usize {
                // Saturated: the true distance needs the id.
                let id = ids(c & idx_mask);
                disp = self.dist(self.home(id, hash(id)), cell);
            }
            let gap = self.dist(hole, cell);
            if disp >= gap {
                let disp = ((disp - gap) as u32).min(sat);
                self.cells[hole] = (c & !(sat << self.bits)) | (disp << self.bits);
                hole = cell;
            }
        }
        self.cells[hole] = EMPTY;
        self.len -= 1;
        Some(idx)
    }

    /// Slab indices of all entries, in table order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mask = self.idx_mask();
        self.cells
            .iter()
            .filter(|&&c| c != EMPTY)
            .map(move |&c| c & mask)
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.cells.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A table of one line whose slab index field is `bits` wide, for layout checks
    /// without allocating 2^bits cells.
    fn with_bits(bits: u32) -> IdIndex {
        IdIndex {
            cells: Cells::new(LINE),
            size: LINE,
            bits,
            len: 0,
        }
    }

    /// Ids that differ only in their low `BLOCK_BITS` hash alike (their homes share a
    /// line); every other bit of an id changes both halves of the hash (the home comes
    /// from the high half, the fingerprint from the low one).
    #[test]
    fn hash_ignores_the_block_bits_and_mixes_every_other_bit_into_both_halves() {
        for base in [0u64, 0x0123_4567_89ab_cdef, u64::MAX] {
            let block = base & !((1 << BLOCK_BITS) - 1);
            for low in 0..1 << BLOCK_BITS {
                assert_eq!(hash(block | low), hash(block), "{base:#x} + {low}");
            }
            for bit in BLOCK_BITS..64 {
                let (a, b) = (hash(base), hash(base ^ (1 << bit)));
                assert_ne!(a as u32, b as u32, "{base:#x}, bit {bit}: low half");
                assert_ne!(a >> 32, b >> 32, "{base:#x}, bit {bit}: high half");
            }
        }
    }

    /// The ids of a block have their homes on every other cell of one line, from its
    /// first cell.
    #[test]
    fn a_block_has_its_homes_on_every_other_cell_of_a_line() {
        let t = IdIndex::with_capacity(1000);
        for block in [0u64, 8, 0x1234_5678_9ab0, u64::MAX << BLOCK_BITS] {
            let first = t.home(block, hash(block));
            assert_eq!(first % LINE, 0, "{block:#x}");
            for low in 0..1 << BLOCK_BITS {
                let id = block | low;
                assert_eq!(t.home(id, hash(id)), first + low as usize * SPREAD);
            }
        }
    }

    /// `starts_block` and `block_len` name the runs of ids that hash alike (the
    /// caller loads the next block's line ahead, at `id + block_len`).
    #[test]
    fn blocks_are_the_runs_of_ids_that_hash_alike() {
        let t = IdIndex::with_capacity(0);
        for id in (0..64u64).chain(u64::MAX - 64..=u64::MAX) {
            let starts = t.starts_block(id);
            assert_eq!(starts, id % (1 << BLOCK_BITS) == 0, "{id}");
            if !starts {
                continue;
            }
            for k in 1..t.block_len() {
                assert_eq!(hash(id + k), hash(id), "{id} + {k}");
            }
            if let Some(next) = id.checked_add(t.block_len()) {
                assert_ne!(hash(next), hash(id), "{id}: next block");
            }
        }
    }

    /// The table doubles when the next entry would take it past 13/16 full, and not
    /// before.
    #[test]
    fn the_table_doubles_only_when_13_16_full() {
        let ids: Vec<u64> = (0..5000).collect();
        let mut index = IdIndex::with_capacity(0);
        let mut doublings = 0;
        for (i, &id) in ids.iter().enumerate() {
            let before = index.size;
            index.reserve_one(|i| ids[i as usize]);
            if index.size != before {
                assert_eq!(index.size, 2 * before);
                assert_eq!(i * 16, before * 13, "grew at {i} entries of {before} cells");
                doublings += 1;
            }
            assert!((i + 1) * 16 <= index.size * 13, "{i} + 1 in {}", index.size);
            let Err(vacant) = index.probe(id, |i| ids[i as usize]) else {
                panic!("duplicate id {id}");
            };
            index.fill(vacant, i as u32);
        }
        assert!(doublings >= 8);
    }

    /// Slab index, displacement and fingerprint split the 32 bits of a cell between
    /// them, at every table size; the displacement gets `MAX_DISP_BITS` while the
    /// slab index leaves room for it.
    #[test]
    fn the_cell_fields_partition_32_bits_at_every_size() {
        for bits in MIN_BITS..=MAX_BITS {
            let t = with_bits(bits);
            let idx = t.idx_mask();
            let disp = t.disp_sat() << bits;
            let fp = t.fp_mask();
            assert_eq!(idx, u32::MAX >> (32 - bits), "bits {bits}");
            assert_eq!(disp >> bits, t.disp_sat(), "bits {bits}: displacement cut");
            assert_eq!(idx & disp, 0, "bits {bits}");
            assert_eq!((idx | disp) & fp, 0, "bits {bits}");
            assert_eq!(idx | disp | fp, u32::MAX, "bits {bits}");
            let want = if bits <= 32 - MAX_DISP_BITS {
                MAX_DISP_BITS
            } else {
                32 - bits
            };
            assert_eq!(t.disp_bits(), want, "bits {bits}");
        }
    }

    /// A lookup reads the ids only of cells whose fingerprint and displacement match,
    /// and removal reads none of the cells it shifts back unless their displacement is
    /// saturated: about one read per lookup of an id present, next to none for an id
    /// absent, and none for the shifts of a removal in a table without saturated
    /// displacements.
    #[test]
    fn lookups_and_removals_read_few_ids() {
        // Spread ids, one per block, in a table filled to about 3/8.
        let ids: Vec<u64> = (0..3000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 4)
            .collect();
        let mut index = IdIndex::with_capacity(2 * ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let Err(vacant) = index.probe(id, |i| ids[i as usize]) else {
                panic!("duplicate id {id}");
            };
            index.fill(vacant, i as u32);
        }
        let reads = Cell::new(0usize);
        let counted = |i: u32| {
            reads.set(reads.get() + 1);
            ids[i as usize]
        };
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(index.find(id, counted), Some(i as u32));
        }
        let n = ids.len();
        assert!(
            reads.get() <= n + n / 1000,
            "{} reads for {n} lookups",
            reads.get()
        );
        reads.set(0);
        for &id in &ids {
            assert_eq!(index.find(id ^ (1 << 62), counted), None);
        }
        assert!(
            reads.get() <= n / 1000,
            "{} reads for {n} misses",
            reads.get()
        );
        // Displacements in this table stay below saturation.
        let sat = index.disp_sat();
        assert!(index
            .cells
            .iter()
            .all(|&c| c == EMPTY || (c >> index.bits) & sat < sat));
        reads.set(0);
        for (i, &id) in ids.iter().enumerate().step_by(2) {
            assert_eq!(index.remove(id, counted), Some(i as u32));
        }
        let removed = n.div_ceil(2);
        assert!(
            reads.get() <= removed + removed / 1000,
            "{} reads for {removed} removals",
            reads.get()
        );
        for (i, &id) in ids.iter().enumerate() {
            let want = (i % 2 == 1).then_some(i as u32);
            assert_eq!(index.find(id, |i| ids[i as usize]), want);
        }
    }

    /// 48 ids sharing home cell 0 in a 64-cell table: one run as long as the table is
    /// full, with displacements past the saturation point, removed in several orders.
    #[test]
    fn long_runs_and_saturated_displacements() {
        let probe_table = IdIndex::with_capacity(48);
        assert_eq!(probe_table.bits, 6);
        let slab: Vec<u64> = (0..)
            .map(|i: u64| i << BLOCK_BITS)
            .filter(|&id| probe_table.home(id, hash(id)) == 0)
            .take(48)
            .collect();
        let orders: [Vec<usize>; 3] = [
            (0..48).collect(),
            (0..48).rev().collect(),
            (0..48).map(|i| (i * 29) % 48).collect(),
        ];
        for order in orders {
            let mut index = IdIndex::with_capacity(48);
            for (i, &id) in slab.iter().enumerate() {
                let Err(vacant) = index.probe(id, |i| slab[i as usize]) else {
                    panic!("duplicate id {id}");
                };
                index.fill(vacant, i as u32);
            }
            let sat = index.disp_sat() as usize;
            assert!(sat < 47, "test must reach saturated displacements");
            let mut removed = [false; 48];
            for i in order {
                assert_eq!(index.remove(slab[i], |i| slab[i as usize]), Some(i as u32));
                removed[i] = true;
                for (j, &id) in slab.iter().enumerate() {
                    let want = (!removed[j]).then_some(j as u32);
                    assert_eq!(index.find(id, |i| slab[i as usize]), want);
                }
            }
            assert_eq!(index.len(), 0);
        }
    }
}
