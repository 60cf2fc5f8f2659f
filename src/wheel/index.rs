//! The id → slab index map: open addressing with linear probing over `u32` cells.
//!
//! Ids are not stored here; a candidate is confirmed by reading its id from the slab
//! (the `ids` callbacks). With a table of `2^bits` cells, a cell holds
//! `fingerprint | displacement | slab index`:
//!
//! - the low `bits` bits are the slab index. This needs every slab index below
//!   `2^bits - 1`; it holds because the table never shrinks, stays at most 3/4 full, and
//!   the slab never holds more nodes than the peak number of entries;
//! - up to 5 bits hold the distance from the entry's home cell, saturating. A lookup only
//!   reads ids of cells with the right distance (and fingerprint), and deletion can shift
//!   later cells back (no tombstones) mostly without reading their ids from the slab;
//! - the remaining high bits are a fingerprint from the id's hash.
//!
//! Ids that differ only in their low 4 bits share a hashed block of 16 home cells, so
//! sequential ids (the usual case) are inserted into the same cache line.

/// An unused cell. Never a valid cell: slab indices stay below `2^bits - 1`.
const EMPTY: u32 = u32::MAX;
const MIN_BITS: u32 = 4;
/// Caps the index at 2^31 cells (about 1.6 billion entries).
const MAX_BITS: u32 = 31;
/// Log2 of the number of home cells shared by ids equal but for their low bits.
const BLOCK_BITS: u32 = 4;
const MAX_DISP_BITS: u32 = 5;

#[derive(Debug)]
pub(super) struct IdIndex {
    cells: Vec<u32>,
    bits: u32,
    len: usize,
}

/// Where a missing id would go.
pub(super) struct Vacant {
    cell: usize,
    tag: u32,
}

fn hash(id: u64) -> u64 {
    // Folded 64×64→128 multiply: cheap, and mixes all input bits into both halves.
    let m = u128::from((id >> BLOCK_BITS) ^ 0x243F_6A88_85A3_08D3) * 0x9E37_79B9_7F4A_7C15;
    (m as u64) ^ ((m >> 64) as u64)
}

impl IdIndex {
    pub(super) fn with_capacity(entries: usize) -> Self {
        let mut bits = MIN_BITS;
        while bits < MAX_BITS && Self::max_len(bits) < entries {
            bits += 1;
        }
        IdIndex {
            cells: vec![EMPTY; 1 << bits],
            bits,
            len: 0,
        }
    }

    /// Load limit of 3/4 for a table of `2^bits` cells.
    fn max_len(bits: u32) -> usize {
        (1usize << bits) / 4 * 3
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        (1 << self.bits) - 1
    }

    fn idx_mask(&self) -> u32 {
        self.mask() as u32
    }

    fn disp_bits(&self) -> u32 {
        (32 - self.bits).min(MAX_DISP_BITS)
    }

    /// Saturation value of the displacement field.
    fn disp_sat(&self) -> u32 {
        (1 << self.disp_bits()) - 1
    }

    /// Cell bits above the slab index and displacement.
    fn fp_mask(&self) -> u32 {
        !(self.idx_mask() | (self.disp_sat() << self.bits))
    }

    fn home(&self, id: u64, hash: u64) -> usize {
        let block = (hash >> (64 - self.bits)) as usize & !((1 << BLOCK_BITS) - 1);
        block | (id as usize & ((1 << BLOCK_BITS) - 1))
    }

    /// The tag bits of a cell `disp` cells after the home of an id with `hash`.
    fn tag(&self, hash: u64, disp: usize) -> u32 {
        let disp = (disp as u32).min(self.disp_sat());
        (hash as u32 & self.fp_mask()) | (disp << self.bits)
    }

    /// Finds the cell holding `id`, or where to put it.
    fn locate(&self, id: u64, ids: impl Fn(u32) -> u64) -> Result<usize, Vacant> {
        let h = hash(id);
        let (mask, idx_mask) = (self.mask(), self.idx_mask());
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
            cell = (cell + 1) & mask;
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
        if self.len < Self::max_len(self.bits) {
            return;
        }
        assert!(self.bits < MAX_BITS, "timing wheel capacity overflow");
        let old_mask = self.idx_mask();
        let old = std::mem::replace(&mut self.cells, vec![EMPTY; 1 << (self.bits + 1)]);
        self.bits += 1;
        let mask = self.mask();
        for c in old.into_iter().filter(|&c| c != EMPTY) {
            let idx = c & old_mask;
            let id = ids(idx);
            let h = hash(id);
            let mut cell = self.home(id, h);
            let mut disp = 0;
            while self.cells[cell] != EMPTY {
                cell = (cell + 1) & mask;
                disp += 1;
            }
            self.cells[cell] = self.tag(h, disp) | idx;
        }
    }

    /// Removes `id`, returning its slab index.
    pub(super) fn remove(&mut self, id: u64, ids: impl Fn(u32) -> u64) -> Option<u32> {
        let mut hole = self.locate(id, &ids).ok()?;
        let (mask, idx_mask, sat) = (self.mask(), self.idx_mask(), self.disp_sat());
        let idx = self.cells[hole] & idx_mask;
        // Backward-shift deletion: pull back each later cell of the run whose probe
        // path passes through the hole, so lookups never stop early at a false EMPTY.
        let mut cell = hole;
        loop {
            cell = (cell + 1) & mask;
            let c = self.cells[cell];
            if c == EMPTY {
                break;
            }
            let mut disp = ((c >> self.bits) & sat) as usize;
            if disp == sat as usize {
                // Saturated: the true distance needs the id.
                let id = ids(c & idx_mask);
                disp = cell.wrapping_sub(self.home(id, hash(id))) & mask;
            }
            let gap = cell.wrapping_sub(hole) & mask;
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
        let mask = self.mask() as u32;
        self.cells
            .iter()
            .filter(|&&c| c != EMPTY)
            .map(move |&c| c & mask)
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.cells.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
