//! The timing wheel's id index (`src/wheel/index.rs`) against `hashbrown::HashTable`
//! doing the same job: map a `u64` id to a `u32` slab index, with the ids kept only in
//! the slab (32-byte nodes, as in the wheel), so a candidate is confirmed by reading its
//! id from the slab. Both tables start empty and grow, as `TimingWheel::new` does.
//!
//! For each N: insert ids 0..N (sequential, as delayd assigns them; each insert first
//! checks for a duplicate), look them all up, then remove them all, lookups and removals
//! in a shuffled order (expiry and cancel order is unrelated to id order). One element
//! = one operation. The bytes per entry are printed after the N inserts.
//!
//! `hashbrown (id, idx)` is a second hashbrown table that stores the id beside the slab
//! index: more memory, no slab read to confirm a match.
//!
//! N = 10k and 1M; 10M too with `DELAYD_BENCH_INDEX_10M=1`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

/// The index module itself (its items are `pub(super)`: visible from this crate root).
/// Bench targets build with `cfg(test)` but without the test harness, so its unit
/// tests compile to nothing and leave their imports unused.
#[allow(dead_code, unused_imports)]
#[path = "../src/wheel/index.rs"]
mod index;

use index::IdIndex;

/// A slab node as in the wheel: the id, the deadline and a 12-byte payload.
#[derive(Clone, Copy)]
struct Node {
    id: u64,
    _deadline: u64,
    _data: [u32; 4],
}

/// Folded 64×64→128 multiply over the whole id (hashbrown takes the bucket from the
/// low bits and the tag from the top 7, so every bit must be mixed into both).
#[inline]
fn hash(id: u64) -> u64 {
    let m = u128::from(id ^ 0x243F_6A88_85A3_08D3) * 0x9E37_79B9_7F4A_7C15;
    (m as u64) ^ ((m >> 64) as u64)
}

/// The operations under test, on a slab whose node `i` has id `i`.
trait Table {
    const NAME: &'static str;
    fn new() -> Self;
    fn insert(&mut self, slab: &[Node], id: u64, idx: u32);
    fn find(&self, slab: &[Node], id: u64) -> Option<u32>;
    fn remove(&mut self, slab: &[Node], id: u64) -> Option<u32>;
    fn heap_bytes(&self) -> usize;
}

impl Table for IdIndex {
    const NAME: &'static str = "IdIndex";

    fn new() -> Self {
        IdIndex::with_capacity(0)
    }

    #[inline]
    fn insert(&mut self, slab: &[Node], id: u64, idx: u32) {
        let ids = |i: u32| slab[i as usize].id;
        self.reserve_one(ids);
        match self.probe(id, ids) {
            Ok(_) => panic!("duplicate id {id}"),
            Err(vacant) => self.fill(vacant, idx),
        }
    }

    #[inline]
    fn find(&self, slab: &[Node], id: u64) -> Option<u32> {
        IdIndex::find(self, id, |i| slab[i as usize].id)
    }

    #[inline]
    fn remove(&mut self, slab: &[Node], id: u64) -> Option<u32> {
        IdIndex::remove(self, id, |i| slab[i as usize].id)
    }

    fn heap_bytes(&self) -> usize {
        IdIndex::heap_bytes(self)
    }
}

/// hashbrown holding slab indices only, like the IdIndex.
struct Hashbrown(HashTable<u32>);

impl Table for Hashbrown {
    const NAME: &'static str = "hashbrown idx";

    fn new() -> Self {
        Hashbrown(HashTable::new())
    }

    #[inline]
    fn insert(&mut self, slab: &[Node], id: u64, idx: u32) {
        let entry = self.0.entry(
            hash(id),
            |&i| slab[i as usize].id == id,
            |&i| hash(slab[i as usize].id),
        );
        match entry {
            Entry::Occupied(_) => panic!("duplicate id {id}"),
            Entry::Vacant(v) => {
                v.insert(idx);
            }
        }
    }

    #[inline]
    fn find(&self, slab: &[Node], id: u64) -> Option<u32> {
        self.0
            .find(hash(id), |&i| slab[i as usize].id == id)
            .copied()
    }

    #[inline]
    fn remove(&mut self, slab: &[Node], id: u64) -> Option<u32> {
        let entry = self.0.find_entry(hash(id), |&i| slab[i as usize].id == id);
        entry.ok().map(|e| e.remove().0)
    }

    fn heap_bytes(&self) -> usize {
        self.0.allocation_size()
    }
}

/// hashbrown holding (id, slab index): never reads the slab.
struct HashbrownWithIds(HashTable<(u64, u32)>);

impl Table for HashbrownWithIds {
    const NAME: &'static str = "hashbrown (id, idx)";

    fn new() -> Self {
        HashbrownWithIds(HashTable::new())
    }

    #[inline]
    fn insert(&mut self, _: &[Node], id: u64, idx: u32) {
        match self.0.entry(hash(id), |e| e.0 == id, |e| hash(e.0)) {
            Entry::Occupied(_) => panic!("duplicate id {id}"),
            Entry::Vacant(v) => {
                v.insert((id, idx));
            }
        }
    }

    #[inline]
    fn find(&self, _: &[Node], id: u64) -> Option<u32> {
        self.0.find(hash(id), |e| e.0 == id).map(|e| e.1)
    }

    #[inline]
    fn remove(&mut self, _: &[Node], id: u64) -> Option<u32> {
        let entry = self.0.find_entry(hash(id), |e| e.0 == id);
        entry.ok().map(|e| e.remove().0 .1)
    }

    fn heap_bytes(&self) -> usize {
        self.0.allocation_size()
    }
}

/// The slab (node `i` has id `i`) and a shuffled order of the ids.
struct Fixture {
    slab: Vec<Node>,
    shuffled: Vec<u64>,
}

impl Fixture {
    fn new(n: usize) -> Self {
        let slab = (0..n as u64)
            .map(|id| Node {
                id,
                _deadline: id,
                _data: [0; 4],
            })
            .collect();
        // Fisher-Yates with xorshift64*.
        let mut shuffled: Vec<u64> = (0..n as u64).collect();
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for i in (1..n).rev() {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let j = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) % (i as u64 + 1)) as usize;
            shuffled.swap(i, j);
        }
        Fixture { slab, shuffled }
    }

    fn filled<T: Table>(&self) -> T {
        let mut t = T::new();
        for (idx, node) in self.slab.iter().enumerate() {
            t.insert(&self.slab, node.id, idx as u32);
        }
        t
    }
}

fn bench_table<T: Table>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    op: &str,
    f: &Fixture,
) {
    let n = f.slab.len();
    let id = BenchmarkId::new(format!("{op}/{}", T::NAME), n);
    match op {
        "insert" => group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let t: T = f.filled();
                    spent += start.elapsed();
                    drop(black_box(t));
                }
                spent
            })
        }),
        "find" => {
            let t: T = f.filled();
            group.bench_function(id, |b| {
                b.iter(|| {
                    for &id in &f.shuffled {
                        black_box(t.find(&f.slab, id));
                    }
                })
            })
        }
        "remove" => group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let mut t: T = f.filled();
                    let start = Instant::now();
                    for &id in &f.shuffled {
                        black_box(t.remove(&f.slab, id));
                    }
                    spent += start.elapsed();
                }
                spent
            })
        }),
        _ => unreachable!(),
    };
}

fn report<T: Table>(f: &Fixture) {
    let t: T = f.filled();
    let n = f.slab.len();
    // Every id is there and maps to its slab index.
    for &id in f.shuffled.iter().step_by(97) {
        assert_eq!(t.find(&f.slab, id), Some(id as u32), "{}", T::NAME);
    }
    let bytes = t.heap_bytes();
    eprintln!(
        "{:>20} at {n:>8} entries: {:>8.2} MiB, {:.2} bytes/entry",
        T::NAME,
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / n as f64
    );
}

fn id_index(c: &mut Criterion) {
    let mut sizes = vec![10_000usize, 1_000_000];
    if std::env::var_os("DELAYD_BENCH_INDEX_10M").is_some() {
        sizes.push(10_000_000);
    }
    for n in sizes {
        let f = Fixture::new(n);
        report::<IdIndex>(&f);
        report::<Hashbrown>(&f);
        report::<HashbrownWithIds>(&f);
        let mut group = c.benchmark_group("id_index");
        group.throughput(Throughput::Elements(n as u64));
        if n >= 1_000_000 {
            group.sample_size(10).sampling_mode(SamplingMode::Flat);
        }
        for op in ["insert", "find", "remove"] {
            bench_table::<IdIndex>(&mut group, op, &f);
            bench_table::<Hashbrown>(&mut group, op, &f);
            bench_table::<HashbrownWithIds>(&mut group, op, &f);
        }
        group.finish();
    }
}

criterion_group!(benches, id_index);
criterion_main!(benches);
