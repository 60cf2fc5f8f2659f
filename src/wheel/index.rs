//! The id → slab index map: open addressing with linear probing over `u32` cells.
//!
//! Ids are not stored here; a candidate is confirmed by reading its id from the slab
//! (the `ids` callbacks). With a table of `2^bits` cells the low `bits` bits of a cell
//! hold the slab index and the remaining high bits hold a fingerprint of the id's hash,
//! so most non-matching cells are skipped without touching the slab. This needs every
//! slab index below `2^bits - 1`; it holds because the table never shrinks, stays at
//! most 3/4 full, and the slab never holds more nodes than the peak number of entries.
//! Deletion shifts later cells back (no tombstones), so probes stay short under churn.

/// An unused cell. Never a valid cell: slab indices stay below `2^bits - 1`.
const EMPTY: u32 = u32::MAX;
const MIN_BITS: u32 = 4;
/// Caps the index at 2^31 cells (about 1.6 billion entries).
const MAX_BITS: u32 = 31;

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
    let m = u128::from(id ^ 0x243F_6A88_85A3_08D3) * 0x9E37_79B9_7F4A_7C15;
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

    fn home(&self, hash: u64) -> usize {
        (hash >> (64 - self.bits)) as usize
    }

    /// Fingerprint bits: the cell bits above the slab index, taken from the low hash half.
    fn tag(&self, hash: u64) -> u32 {
        (hash as u32) & !(self.mask() as u32)
    }

    /// Finds `id`: `Ok(slab index)` if present, else where to put it.
    pub(super) fn probe(&self, id: u64, ids: impl Fn(u32) -> u64) -> Result<u32, Vacant> {
        let h = hash(id);
        let (mask, tag) = (self.mask(), self.tag(h));
        let mut cell = self.home(h);
        loop {
            let c = self.cells[cell];
            if c == EMPTY {
                return Err(Vacant { cell, tag });
            }
            if c & !(mask as u32) == tag && ids(c & mask as u32) == id {
                return Ok(c & mask as u32);
            }
            cell = (cell + 1) & mask;
        }
    }

    pub(super) fn find(&self, id: u64, ids: impl Fn(u32) -> u64) -> Option<u32> {
        self.probe(id, ids).ok()
    }

    /// Stores slab index `idx` at a cell returned by `probe` (no growth in between).
    pub(super) fn fill(&mut self, vacant: Vacant, idx: u32) {
        debug_assert!((idx as usize) < self.mask());
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
        let old_mask = self.mask() as u32;
        let old = std::mem::replace(&mut self.cells, vec![EMPTY; 1 << (self.bits + 1)]);
        self.bits += 1;
        let mask = self.mask();
        for c in old.into_iter().filter(|&c| c != EMPTY) {
            let idx = c & old_mask;
            let h = hash(ids(idx));
            let mut cell = self.home(h);
            while self.cells[cell] != EMPTY {
                cell = (cell + 1) & mask;
            }
            self.cells[cell] = self.tag(h) | idx;
        }
    }

    /// Removes `id`, returning its slab index.
    pub(super) fn remove(&mut self, id: u64, ids: impl Fn(u32) -> u64) -> Option<u32> {
        let h = hash(id);
        let (mask, tag) = (self.mask(), self.tag(h));
        let mut hole = self.home(h);
        let idx = loop {
            let c = self.cells[hole];
            if c == EMPTY {
                return None;
            }
            if c & !(mask as u32) == tag && ids(c & mask as u32) == id {
                break c & mask as u32;
            }
            hole = (hole + 1) & mask;
        };
        // Backward-shift deletion: pull back each later cell of the run whose probe
        // path passes through the hole, so lookups never stop early at a false EMPTY.
        let mut cell = hole;
        loop {
            cell = (cell + 1) & mask;
            let c = self.cells[cell];
            if c == EMPTY {
                break;
            }
            let home = self.home(hash(ids(c & mask as u32)));
            if cell.wrapping_sub(home) & mask >= cell.wrapping_sub(hole) & mask {
                self.cells[hole] = c;
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
