use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::level::{level_for, slot_for, slot_start, LEVELS};
use super::{DuplicateId, Expired, Node, Slab, TimingWheel};

/// A 12-byte payload like delayd's WAL position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos {
    seg: u32,
    off: u32,
    route: u16,
}

fn pos(n: u64) -> Pos {
    Pos {
        seg: n as u32,
        off: (n >> 32) as u32,
        route: n as u16,
    }
}

fn poll_all(w: &mut TimingWheel<Pos>, now: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    w.poll_expired(now, usize::MAX, &mut out);
    out.iter().map(|e| (e.deadline, e.id)).collect()
}

const YEAR: u64 = 365 * 24 * 3600 * 1000;

#[test]
fn arithmetic() {
    assert_eq!(level_for(0, 0), 0);
    assert_eq!(level_for(0, 63), 0);
    assert_eq!(level_for(0, 64), 1);
    assert_eq!(level_for(63, 64), 1);
    assert_eq!(level_for(64, 127), 0);
    assert_eq!(level_for(0, 4096), 2);
    assert_eq!(level_for(0, u64::MAX), LEVELS - 1);
    assert_eq!(slot_for(4096 * 3 + 64 * 5 + 7, 0), 7);
    assert_eq!(slot_for(4096 * 3 + 64 * 5 + 7, 1), 5);
    assert_eq!(slot_for(4096 * 3 + 64 * 5 + 7, 2), 3);
    assert_eq!(slot_for(u64::MAX, LEVELS - 1), 15);
    assert_eq!(slot_start(4096 + 70, 1, 5), 4096 + 64 * 5);
    assert_eq!(slot_start(4096 + 70, 0, 9), 4096 + 64 + 9);
    assert_eq!(slot_start(5, LEVELS - 1, 15), 15 << 60);
}

#[test]
fn node_is_32_bytes_with_12_byte_payload() {
    assert_eq!(std::mem::size_of::<Pos>(), 12);
    assert_eq!(std::mem::size_of::<Node<Pos>>(), 32);
}

#[test]
fn empty_wheel() {
    let mut w = TimingWheel::<Pos>::new(10);
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
    assert_eq!(poll_all(&mut w, u64::MAX), vec![]);
    assert_eq!(w.now(), u64::MAX);
    assert_eq!(w.cancel(1), None);
}

#[test]
fn expires_in_deadline_then_insertion_order() {
    let mut w = TimingWheel::new(1000);
    for (id, d) in [
        (1, 1500),
        (2, 1001),
        (3, 1500),
        (4, 90_000),
        (5, 1001),
        (6, 1000),
    ] {
        w.insert(id, d, pos(id)).unwrap();
    }
    assert_eq!(w.len(), 6);
    assert_eq!(w.next_deadline(), Some(1000));
    assert_eq!(poll_all(&mut w, 1000), vec![(1000, 6)]);
    assert_eq!(w.next_deadline(), Some(1001));
    assert_eq!(poll_all(&mut w, 1499), vec![(1001, 2), (1001, 5)]);
    assert_eq!(w.next_deadline(), Some(1500));
    assert_eq!(
        poll_all(&mut w, 100_000),
        vec![(1500, 1), (1500, 3), (90_000, 4)]
    );
    assert!(w.is_empty());
    assert_eq!(w.now(), 100_000);
}

#[test]
fn equal_deadlines_inserted_at_different_levels_keep_insertion_order() {
    let d = 10 * YEAR + 12_345;
    let mut w = TimingWheel::new(0);
    w.insert(1, d, pos(1)).unwrap(); // top levels
    let mut out = Vec::new();
    // Walk time towards d so later inserts of the same deadline land ever lower.
    let mut id = 2;
    for now in [YEAR, 9 * YEAR, d - 300_000, d - 5_000, d - 100, d - 1] {
        assert_eq!(w.poll_expired(now, usize::MAX, &mut out), 0);
        w.insert(id, d, pos(id)).unwrap();
        w.insert(id + 1, d + 1, pos(id + 1)).unwrap();
        id += 2;
    }
    w.insert(100, d, pos(100)).unwrap();
    assert_eq!(w.next_deadline(), Some(d));
    let got = poll_all(&mut w, d + 1);
    let want: Vec<_> = [1, 2, 4, 6, 8, 10, 12, 100]
        .into_iter()
        .map(|i| (d, i))
        .chain([3, 5, 7, 9, 11, 13].into_iter().map(|i| (d + 1, i)))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn past_deadlines_come_first_in_order() {
    let mut w = TimingWheel::new(1_000_000);
    w.insert(1, 1_000_000, pos(1)).unwrap();
    w.insert(2, 5, pos(2)).unwrap();
    w.insert(3, 0, pos(3)).unwrap();
    w.insert(4, 5, pos(4)).unwrap();
    w.insert(5, 999_999, pos(5)).unwrap();
    assert_eq!(w.next_deadline(), Some(0));
    assert_eq!(
        poll_all(&mut w, 0), // time does not go back
        vec![(0, 3), (5, 2), (5, 4), (999_999, 5), (1_000_000, 1)]
    );
    assert_eq!(w.now(), 1_000_000);
}

#[test]
fn max_leaves_the_rest_first_in_line() {
    let mut w = TimingWheel::new(0);
    for id in 0..10 {
        w.insert(id, 100 + id % 2, pos(id)).unwrap();
    }
    let mut out = Vec::new();
    assert_eq!(w.poll_expired(200, 3, &mut out), 3);
    assert_eq!(w.poll_expired(200, 0, &mut out), 0);
    // Same deadline as the leftovers: after them. Earlier deadline: before them.
    w.insert(50, 100, pos(50)).unwrap();
    w.insert(51, 99, pos(51)).unwrap();
    w.insert(52, 150, pos(52)).unwrap();
    assert_eq!(w.next_deadline(), Some(99));
    while w.poll_expired(200, 2, &mut out) > 0 {}
    let ids: Vec<_> = out.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![0, 2, 4, 51, 6, 8, 50, 1, 3, 5, 7, 9, 52]);
}

#[test]
fn duplicate_cancel_get() {
    let mut w = TimingWheel::new(0);
    w.insert(7, 5000, pos(7)).unwrap();
    assert_eq!(w.insert(7, 1, pos(0)), Err(DuplicateId(7)));
    assert_eq!(
        DuplicateId(7).to_string(),
        "timer id 7 is already scheduled"
    );
    let e7 = Expired {
        id: 7,
        deadline: 5000,
        data: pos(7),
    };
    assert_eq!(w.get(7), Some(e7));
    assert!(w.contains(7) && !w.contains(8));
    w.get_mut(7).unwrap().off = 99;
    assert_eq!(w.get(7).unwrap().data.off, 99);
    assert_eq!(w.get_mut(8), None);
    assert_eq!(w.cancel(7).map(|e| e.id), Some(7));
    assert_eq!(w.cancel(7), None);
    assert_eq!(w.next_deadline(), None);
    w.insert(7, 10, pos(7)).unwrap();
    assert_eq!(poll_all(&mut w, 10), vec![(10, 7)]);
    assert_eq!(w.get(7), None);
}

#[test]
fn far_future_and_u64_max() {
    let mut w = TimingWheel::new(0);
    w.insert(1, u64::MAX, pos(1)).unwrap();
    w.insert(2, 100 * YEAR, pos(2)).unwrap();
    w.insert(3, u64::MAX - 1, pos(3)).unwrap();
    w.insert(4, u64::MAX, pos(4)).unwrap();
    assert_eq!(w.next_deadline(), Some(100 * YEAR));
    assert_eq!(poll_all(&mut w, 100 * YEAR - 1), vec![]);
    assert_eq!(poll_all(&mut w, 100 * YEAR), vec![(100 * YEAR, 2)]);
    assert_eq!(w.next_deadline(), Some(u64::MAX - 1));
    assert_eq!(poll_all(&mut w, u64::MAX - 2), vec![]);
    assert_eq!(
        poll_all(&mut w, u64::MAX),
        vec![(u64::MAX - 1, 3), (u64::MAX, 1), (u64::MAX, 4)]
    );
    w.insert(5, 3, pos(5)).unwrap();
    assert_eq!(poll_all(&mut w, u64::MAX), vec![(3, 5)]);
}

#[test]
fn many_cancels_compact_slots_and_keep_order() {
    let mut w = TimingWheel::new(0);
    for id in 0..1000 {
        w.insert(id, 500_000 + id % 3, pos(id)).unwrap();
    }
    for id in (0..1000).filter(|id| id % 5 != 0) {
        assert!(w.cancel(id).is_some());
    }
    assert_eq!(w.len(), 200);
    let got = poll_all(&mut w, 600_000);
    let mut want: Vec<_> = (0..1000)
        .filter(|id| id % 5 == 0)
        .map(|id| (500_000 + id % 3, id))
        .collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn growth_iter_and_reuse() {
    let mut w = TimingWheel::new(0);
    for round in 0..3u64 {
        let base = round * 10_000_000;
        for id in 0..20_000 {
            let id = round * 1_000_000 + id;
            w.insert(id, base + (id * 7919) % 3_600_000, pos(id))
                .unwrap();
        }
        assert_eq!(w.iter().count(), 20_000);
        assert!(w.iter().all(|e| e.data == pos(e.id)));
        let got = poll_all(&mut w, base + 3_600_000);
        assert_eq!(got.len(), 20_000);
        assert!(got.windows(2).all(|p| p[0] <= p[1]));
        // Freed nodes are reused: the slab does not grow past the peak.
        assert!(w.nodes.len() <= 20_000);
    }
}

#[test]
fn long_jumps_with_few_entries_are_fast() {
    let mut w = TimingWheel::new(0);
    let mut out = Vec::new();
    let start = std::time::Instant::now();
    for i in 0..10_000u64 {
        w.insert(i, (i + 1) * YEAR, pos(i)).unwrap();
        w.poll_expired((i + 1) * YEAR, usize::MAX, &mut out);
    }
    assert_eq!(out.len(), 10_000);
    assert!(start.elapsed().as_secs() < 5);
}

/// Reference model: pending entries ordered by (deadline, insertion sequence).
#[derive(Default)]
struct Model {
    now: u64,
    seq: u64,
    order: BTreeMap<(u64, u64), u64>,
    by_id: HashMap<u64, (u64, u64)>,
}

#[derive(Debug, Clone)]
enum Op {
    /// Deadline is `now + delta`, saturating; `past` subtracts instead.
    Insert {
        id: u64,
        delta: u64,
        past: bool,
    },
    Cancel {
        id: u64,
    },
    Advance {
        delta: u64,
        max: usize,
    },
}

fn delta() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0..70u64,
        3 => 0..5_000u64,
        2 => 0..1_000_000u64,
        1 => 0..100 * YEAR,
        1 => any::<u64>(),
        1 => Just(u64::MAX),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0..40u64;
    prop_oneof![
        6 => (id.clone(), delta(), prop::bool::weighted(0.15))
            .prop_map(|(id, delta, past)| Op::Insert { id, delta, past }),
        2 => id.prop_map(|id| Op::Cancel { id }),
        3 => (delta(), prop_oneof![Just(0usize), Just(1), 1..5usize, Just(usize::MAX)])
            .prop_map(|(delta, max)| Op::Advance { delta: delta / 4, max }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn matches_model(start in prop_oneof![Just(0u64), any::<u64>(), 0..YEAR], ops in prop::collection::vec(op(), 1..120)) {
        let mut w = TimingWheel::new(start);
        let mut m = Model { now: start, ..Model::default() };
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Insert { id, delta, past } => {
                    let deadline = if past { m.now.saturating_sub(delta) } else { m.now.saturating_add(delta) };
                    let got = w.insert(id, deadline, pos(id ^ deadline));
                    if m.by_id.contains_key(&id) {
                        prop_assert_eq!(got, Err(DuplicateId(id)));
                    } else {
                        prop_assert_eq!(got, Ok(()));
                        m.seq += 1;
                        m.order.insert((deadline, m.seq), id);
                        m.by_id.insert(id, (deadline, m.seq));
                    }
                }
                Op::Cancel { id } => {
                    let want = m.by_id.remove(&id).map(|(deadline, seq)| {
                        m.order.remove(&(deadline, seq));
                        Expired { id, deadline, data: pos(id ^ deadline) }
                    });
                    prop_assert_eq!(w.cancel(id), want);
                }
                Op::Advance { delta, max } => {
                    m.now = m.now.saturating_add(delta);
                    out.clear();
                    let n = w.poll_expired(m.now, max, &mut out);
                    prop_assert_eq!(n, out.len());
                    let mut want = Vec::new();
                    while want.len() < max {
                        match m.order.first_key_value() {
                            Some((&(deadline, seq), &id)) if deadline <= m.now => {
                                m.order.remove(&(deadline, seq));
                                m.by_id.remove(&id);
                                want.push(Expired { id, deadline, data: pos(id ^ deadline) });
                            }
                            _ => break,
                        }
                    }
                    prop_assert_eq!(&out, &want);
                    prop_assert_eq!(w.now(), m.now);
                }
            }
            prop_assert_eq!(w.len(), m.order.len());
            prop_assert_eq!(w.next_deadline(), m.order.keys().next().map(|k| k.0));
            for id in 0..40u64 {
                let want = m.by_id.get(&id).map(|&(deadline, _)| deadline);
                prop_assert_eq!(w.get(id).map(|e| e.deadline), want);
            }
        }
        let mut all: Vec<_> = w.iter().map(|e| e.id).collect();
        all.sort_unstable();
        let mut want: Vec<_> = m.by_id.keys().copied().collect();
        want.sort_unstable();
        prop_assert_eq!(all, want);
        // Drain everything: the full remaining order must match too.
        out.clear();
        w.poll_expired(u64::MAX, usize::MAX, &mut out);
        let got: Vec<_> = out.iter().map(|e| e.id).collect();
        let want: Vec<_> = m.order.values().copied().collect();
        prop_assert_eq!(got, want);
        prop_assert!(w.is_empty());
    }
}

#[test]
fn id_index_handles_patterns_growth_and_saturated_displacements() {
    use super::index::IdIndex;
    // `slab[i]` is the id stored at slab index i.
    let mut slab: Vec<u64> = Vec::new();
    let mut index = IdIndex::with_capacity(0);
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut ids: Vec<u64> = (0..20_000u64).collect(); // sequential
    ids.extend((1..20_000u64).map(|i| i << 16)); // strided: same low bits
    ids.extend((1..20_000u64).map(|i| (i << 40) | 7));
    ids.extend((0..100_000).map(|_| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng | 1 << 63 // disjoint from the patterns above
    }));
    for &id in &ids {
        index.reserve_one(|i| slab[i as usize]);
        let Err(vacant) = index.probe(id, |i| slab[i as usize]) else {
            panic!("duplicate id {id}");
        };
        index.fill(vacant, slab.len() as u32);
        slab.push(id);
    }
    assert_eq!(index.len(), ids.len());
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(index.find(id, |i| slab[i as usize]), Some(i as u32));
    }
    // Remove every third id; the rest must stay reachable past the shifted cells.
    for (i, &id) in ids.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        assert_eq!(index.remove(id, |i| slab[i as usize]), Some(i as u32));
        assert_eq!(index.remove(id, |i| slab[i as usize]), None);
    }
    for (i, &id) in ids.iter().enumerate() {
        let want = (i % 3 != 0).then_some(i as u32);
        assert_eq!(index.find(id, |i| slab[i as usize]), want);
    }
    assert_eq!(index.iter().count(), index.len());
}

#[test]
fn cancelled_nodes_are_swept_and_reused() {
    // Far-future entries cancelled one by one stay in their slots until swept; the slab
    // must still stay close to the peak number of pending entries.
    let mut w = TimingWheel::new(0);
    for id in 0..100 {
        w.insert(id, 10 * YEAR + id, pos(id)).unwrap();
    }
    for round in 0..200u64 {
        for k in 0..50 {
            let id = 1_000 + round * 50 + k;
            w.insert(id, 20 * YEAR + id % 7, pos(id)).unwrap();
        }
        for k in 0..50 {
            let id = 1_000 + round * 50 + k;
            assert_eq!(w.cancel(id).map(|e| e.id), Some(id));
        }
        assert_eq!(w.len(), 100);
        assert!(w.nodes.len() <= 150 * 8 / 7 + 1, "slab {}", w.nodes.len());
    }
    assert_eq!(w.next_deadline(), Some(10 * YEAR));
    let got = poll_all(&mut w, u64::MAX);
    let want: Vec<_> = (0..100).map(|id| (10 * YEAR + id, id)).collect();
    assert_eq!(got, want);
    assert!(w.is_empty());
}

#[test]
fn cascades_reconstruct_deadlines_across_32_bit_boundaries() {
    // Deadlines whose low 32 bits wrap between insertion and expiry.
    let base = (1u64 << 32) - 5_000;
    let mut w = TimingWheel::new(base);
    let deadlines = [
        base + 4_999,
        base + 5_000,
        base + 5_001,
        base + 70_000,
        3 << 32,
    ];
    for (id, &d) in deadlines.iter().enumerate() {
        w.insert(id as u64, d, pos(id as u64)).unwrap();
    }
    let got = poll_all(&mut w, 3 << 32);
    let want: Vec<_> = deadlines
        .iter()
        .enumerate()
        .map(|(i, &d)| (d, i as u64))
        .collect();
    assert_eq!(got, want);
}

/// A scan in steps, with inserts, cancels and expiries between the steps,
/// sees every entry pending throughout exactly once and nothing that was
/// never pending.
#[test]
fn a_scan_in_steps_sees_each_entry_pending_throughout_once() {
    let mut w = TimingWheel::new(0);
    for id in 0..5000u64 {
        w.insert(id, 10 + id % 700, pos(id)).unwrap();
    }
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut touched = std::collections::HashSet::new();
    let mut next_id = 10_000u64;
    let mut from = Some(0);
    let mut now = 0;
    while let Some(start) = from {
        from = w.scan(start, 97, |e| *seen.entry(e.id).or_default() += 1);
        // Between steps: some fire, some are cancelled, new ones arrive
        // (reusing freed nodes).
        now += 3;
        let mut fired = Vec::new();
        w.poll_expired(now, 20, &mut fired);
        touched.extend(fired.iter().map(|e| e.id));
        for id in (start as u64..start as u64 + 5).filter(|id| id % 2 == 0) {
            if w.cancel(id).is_some() {
                touched.insert(id);
            }
        }
        for _ in 0..7 {
            w.insert(next_id, now + 50, pos(next_id)).unwrap();
            touched.insert(next_id);
            next_id += 1;
        }
    }
    for id in 0..5000u64 {
        if !touched.contains(&id) {
            assert_eq!(seen.get(&id), Some(&1), "id {id}");
        }
    }
    for (id, n) in &seen {
        assert_eq!(*n, 1, "id {id} seen {n} times");
        assert!(*id < 5000 || touched.contains(id), "id {id} never pending");
    }
}

/// The slab is most of the wheel's memory: it grows by 1/8 while small and
/// by 1/64 once past 65536 nodes, so its spare room stays a small fraction
/// of what it holds (never the doubling of a plain Vec), and in few enough
/// steps that an insert stays amortised O(1).
#[test]
fn the_slab_grows_by_a_small_fraction_in_few_steps() {
    let mut w = TimingWheel::new(0);
    let (mut last_cap, mut grew) = (w.slab_capacity(), 0);
    for id in 0..200_000u64 {
        w.insert(id, 1_000 + id, pos(id)).unwrap();
        let cap = w.slab_capacity();
        if cap != last_cap {
            grew += 1;
            let held = id as usize + 1;
            let spare = cap - held;
            let allowed = if held > 1 << 16 { held / 64 } else { held / 8 } + 16;
            assert!(spare <= allowed + held / 512, "{held} held, room for {cap}");
            last_cap = cap;
        }
    }
    // About 70 steps of 1/8 up to 65536, then about 70 of 1/64.
    assert!(grew <= 200, "the slab grew {grew} times for 200000 inserts");
}

/// `heap_bytes` is what the RAM figures are built on: it counts at least the
/// slab's nodes, and the whole wheel stays within delayd's budget of 64
/// bytes per pending message.
#[test]
fn heap_bytes_counts_the_nodes_and_stays_within_budget() {
    let mut w = TimingWheel::new(0);
    assert!(w.is_empty());
    let n = 100_000u64;
    for id in 0..n {
        w.insert(id, 1_000 + id * 37, pos(id)).unwrap();
    }
    assert!(!w.is_empty());
    let bytes = w.heap_bytes();
    let nodes = n as usize * std::mem::size_of::<Node<Pos>>();
    assert!(
        bytes >= nodes,
        "{bytes} bytes for {nodes} bytes of nodes alone"
    );
    assert!(
        bytes <= 64 * n as usize,
        "{} bytes per entry",
        bytes / n as usize
    );
    let shown = format!("{w:?}");
    assert!(shown.contains("len: 100000"), "{shown}");
}

/// Every part of the wheel counts in `heap_bytes`: the levels of an empty
/// wheel, the slab and the id index with entries, the slots' items, and the
/// overdue map once entries fall behind the wheel's time.
#[test]
fn heap_bytes_grows_with_every_part() {
    // Room for every entry of the test, so growth does not blur the sums.
    let mut w = TimingWheel::with_capacity(1_000_000, 21_000);
    let empty = w.heap_bytes();
    assert!(
        empty >= LEVELS * std::mem::size_of::<super::Level>(),
        "{empty}"
    );
    let n = 20_000u64;
    for id in 0..n {
        w.insert(id, 2_000_000 + id * 1_000, pos(id)).unwrap();
    }
    let filled = w.heap_bytes();
    // The slab and index were sized in advance: the slots' items are new.
    assert!(filled >= empty + n as usize * 8, "{filled} for {n} entries");
    // At least a node, an index cell and a slot item for each entry, all told.
    let per_entry = std::mem::size_of::<Node<Pos>>() + 4 + 8;
    assert!(filled >= n as usize * per_entry, "{filled} for {n} entries");
    // Entries behind the wheel's time wait in the overdue map, which counts:
    // each distinct deadline is a map entry with a slot of its own.
    let mut out = Vec::new();
    w.poll_expired(3_000_000, usize::MAX, &mut out);
    assert_eq!(out.len(), 1001);
    let before = w.heap_bytes();
    for id in n..n + 100 {
        w.insert(id, 1_500_000 + id, pos(id)).unwrap(); // distinct, behind time
    }
    let after = w.heap_bytes();
    // A map entry counts as its share of a half-full B-tree node.
    let overdue_entry = 2 * std::mem::size_of::<(u64, super::level::Slot)>();
    assert!(after >= before + 100 * overdue_entry, "{after} vs {before}");
    // ...and no more than a small slot and a map entry each.
    assert!(after <= before + 100 * 200, "{after} vs {before}");
}

/// The slab's heap counts its nodes and its bitmap of cancelled nodes (one
/// bit per node, in 64-bit words).
#[test]
fn slab_heap_bytes_counts_nodes_and_the_cancelled_bitmap() {
    let mut slab = Slab::with_capacity(0);
    let n = 6400u64;
    for id in 0..n {
        slab.alloc(Node {
            id,
            deadline: id,
            data: pos(id),
        });
    }
    let nodes = slab.nodes.capacity() * std::mem::size_of::<Node<Pos>>();
    let bitmap = (n as usize / 64) * 8;
    assert!(slab.heap_bytes() >= nodes + bitmap, "{}", slab.heap_bytes());
    assert!(
        slab.heap_bytes() <= nodes + 2 * bitmap + 64,
        "{}",
        slab.heap_bytes()
    );
}

/// Cancelled entries stay in their far-away slots until swept; when they
/// make up 1/8 of the slab and it would grow, all slots are swept first,
/// so churn (insert one, cancel an old one) never grows the slab past
/// about 8/7 of the most entries ever pending at once.
#[test]
fn churn_of_cancelled_entries_does_not_grow_the_slab() {
    let mut w = TimingWheel::new(0);
    let live = 10_000u64;
    for id in 0..live {
        w.insert(id, YEAR + id, pos(id)).unwrap();
    }
    for id in live..live * 20 {
        w.insert(id, YEAR + id, pos(id)).unwrap();
        assert!(w.cancel(id - live).is_some());
    }
    assert_eq!(w.len(), live as usize);
    let nodes = w.nodes.len();
    assert!(
        nodes as u64 <= live * 8 / 7 + 64,
        "{nodes} slab nodes for at most {live} pending entries"
    );
}

/// A slot emptied by expiry keeps a small allocation for its next entries
/// (no reallocation when it fills again), and gives a large one back.
#[test]
fn an_emptied_slot_keeps_a_small_allocation_and_frees_a_large_one() {
    let mut w = TimingWheel::new(0);
    for id in 0..4 {
        w.insert(id, 5, pos(id)).unwrap();
    }
    let before = w.heap_bytes();
    assert_eq!(poll_all(&mut w, 5).len(), 4);
    assert_eq!(w.heap_bytes(), before, "the slot's allocation is kept");
    for id in 0..5_000 {
        w.insert(100 + id, 9, pos(id)).unwrap();
    }
    let before = w.heap_bytes();
    assert_eq!(poll_all(&mut w, 9).len(), 5_000);
    assert!(w.heap_bytes() < before, "the large allocation is freed");
}
