//! Crash and recovery tests for the WAL: torn tails at every offset, flipped
//! bits, zero-filled tails, and live-set equivalence after reopening.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;

type Live = BTreeMap<u64, (u64, String, Vec<u8>)>;

fn config(dir: &Path) -> WalConfig {
    WalConfig {
        segment_bytes: 4096,
        ..WalConfig::new(dir)
    }
}

/// Open the log and replay it into the set of live messages.
fn open_live(cfg: WalConfig) -> Result<(Wal, Live, RecoveryReport), WalError> {
    let mut live = Live::new();
    let (wal, report) = Wal::open(cfg, |rec, _| match rec {
        RecordRef::Schedule {
            id,
            due_ms,
            route,
            message,
            ..
        } => {
            live.insert(id, (due_ms, route.to_owned(), message.to_vec()));
        }
        RecordRef::Done { id, .. } => {
            live.remove(&id);
        }
        RecordRef::Acked { .. } | RecordRef::Remembered { .. } => {}
    })?;
    Ok((wal, live, report))
}

/// A uid for a test message: distinct per due time, never 0.
fn uid_of(due: u64) -> u128 {
    (1u128 << 127) | u128::from(due)
}

fn schedule(wal: &Wal, due: u64, msg: &[u8]) -> Appended {
    wal.append_schedule(due, uid_of(due), "r", msg.to_vec())
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap()
}

/// Flush and drop the handle, releasing the directory lock (a clean stop).
fn close(wal: Wal) {
    wal.close().unwrap();
}

fn segments_of(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    v.sort();
    v
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for p in segments_of(from) {
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// A cancel's marks are written just before its Done, in its batch and so
/// its segment, each with a seq of its own (seed 339: a mark written apart
/// went to a segment that was deleted while the Schedule stayed).
#[test]
fn marks_with_a_done_share_its_segment_and_come_first() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let a = schedule(&wal, 10, b"a");
    let marks = vec![a.id | (1 << 63), 77 | (1 << 63)];
    let done = wal
        .append_done_with_marks(a.id, a.pos, marks.clone())
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    let after = schedule(&wal, 20, b"b");
    let records: Vec<Record> = wal
        .scan_segment(done.pos.segment)
        .unwrap()
        .into_iter()
        .map(|(_, r)| r)
        .filter(|r| !matches!(r, Record::Schedule { .. }))
        .collect();
    let seqs: Vec<u64> = records
        .iter()
        .map(|r| match r {
            Record::Acked { seq, .. } | Record::Done { seq, .. } => *seq,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(matches!(
        records.as_slice(),
        [Record::Acked { id: m0, .. }, Record::Acked { id: m1, .. }, Record::Done { id, .. }]
            if [*m0, *m1] == *marks && *id == a.id
    ));
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert!(after.id > seqs[2], "seqs go on past them");
    close(wal);
    let (_, live, report) = open_live(config(dir.path())).unwrap();
    assert!(report.corruptions.is_empty());
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), [after.id]);
}

#[test]
fn appended_records_come_back_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, live, _) = open_live(config(dir.path())).unwrap();
    assert!(live.is_empty());
    let a = schedule(&wal, 10, b"a");
    let b = schedule(&wal, 20, b"b");
    assert!(b.id > a.id);
    wal.append_done(a.id, a.pos)
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    assert_eq!(
        wal.read(b.pos).unwrap(),
        Record::Schedule {
            seq: b.id,
            id: b.id,
            due_ms: 20,
            uid: uid_of(20),
            route: "r".into(),
            message: b"b".to_vec()
        }
    );
    close(wal);
    let (wal, live, report) = open_live(config(dir.path())).unwrap();
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), vec![b.id]);
    assert!(report.corruptions.is_empty());
    // New ids keep increasing across restarts.
    let c = schedule(&wal, 30, b"c");
    assert!(c.id > b.id);
}

/// A log whose segments (1 MiB) hold everything a test writes.
fn open_one_segment(dir: &Path) -> Wal {
    let cfg = WalConfig {
        segment_bytes: 1 << 20,
        ..WalConfig::new(dir)
    };
    open_live(cfg).unwrap().0
}

/// The Schedule `read` gave for `a`: checks its id, returns its message.
fn schedule_message(a: &Appended, read: Record) -> Vec<u8> {
    match read {
        Record::Schedule { id, message, .. } => {
            assert_eq!(id, a.id);
            message
        }
        other => panic!("read a {other:?}"),
    }
}

/// A frame dropped from the page cache is not read by `read_cached` (which
/// must not block an async thread on the disk), and `read` still reads it.
#[test]
fn a_cached_read_of_a_frame_only_on_disk_gives_up() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open_one_segment(dir.path());
    let small = schedule(&wal, 1, b"small");
    let big_body: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    let big = schedule(&wal, 2, &big_body);
    // All cached reads first: a disk read brings in its neighbours too. A
    // page can outlive an eviction on a busy machine: evict until neither
    // frame reads from the cache (the last checked first, so a readahead
    // cannot bring it back), within a deadline.
    let frames = [(small, b"small".to_vec()), (big, big_body)];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        if !evict_from_page_cache(dir.path()) {
            eprintln!("skipped: the WAL is on tmpfs, nothing leaves the page cache");
            return;
        }
        if frames
            .iter()
            .rev()
            .all(|(a, _)| wal.read_cached(a.pos).is_none())
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "read from the disk: the frames stayed in the page cache through 3 s of evictions"
        );
    }
    for (a, body) in frames {
        assert_eq!(schedule_message(&a, wal.read(a.pos).unwrap()), body);
    }
}

/// Frames shorter and longer than the first read, including the last frame
/// of the file (where the first read stops at the end of the file).
#[test]
fn frames_of_every_size_read_back_byte_equal() {
    let dir = tempfile::tempdir().unwrap();
    let wal = open_one_segment(dir.path());
    let sizes = [0usize, 1, 100, 4000, 4096, 4097, 10_000, 65_536, 3];
    let appended: Vec<(Appended, Vec<u8>)> = sizes
        .iter()
        .map(|&n| {
            let msg: Vec<u8> = (0..n).map(|i| (i * 7 + n) as u8).collect();
            (schedule(&wal, n as u64, &msg), msg)
        })
        .collect();
    for (a, msg) in &appended {
        let read = wal.read(a.pos).unwrap();
        // Just written, so in the page cache: read there, the same record.
        let cached = wal.read_cached(a.pos).expect("just written, still cached");
        assert_eq!(cached.unwrap(), read, "message of {} bytes", msg.len());
        let message = schedule_message(a, read);
        assert_eq!(&message, msg, "message of {} bytes", msg.len());
    }
}

#[test]
fn torn_tail_at_every_byte_offset_keeps_every_complete_frame() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        segment_bytes: 1 << 20,
        ..WalConfig::new(dir.path())
    };
    let (wal, _, _) = open_live(cfg.clone()).unwrap();
    let mut ends = Vec::new(); // (frame end offset, id)
    for i in 0..6u64 {
        let a = schedule(&wal, 100 + i, &vec![i as u8; 7 * i as usize + 1]);
        ends.push(a.id);
    }
    close(wal);
    let seg = segments_of(dir.path()).pop().unwrap();
    let full = std::fs::read(&seg).unwrap();
    // Where each frame ends, from a clean parse: (end, Some(id)) for a
    // Schedule, (end, None) for the Commit that ends each batch.
    let salt = frame::header_salt(&full).unwrap();
    let (mut frame_ends, mut all_ends) = (Vec::new(), Vec::new());
    let mut at = frame::SEGMENT_HEADER_BYTES as usize;
    while at < full.len() {
        let (parsed, size) = frame::parse(&full[at..], frame::MAX_LEN, salt).unwrap();
        at += size;
        all_ends.push(at);
        if let frame::Parsed::Record(record) = parsed {
            frame_ends.push((at, record.seq()));
        }
    }
    let tail_start = frame_ends[2].0; // cut anywhere in the last frames
    for cut in tail_start..=full.len() {
        let trial = tempfile::tempdir().unwrap();
        let path = trial.path().join(seg.file_name().unwrap());
        std::fs::write(&path, &full[..cut]).unwrap();
        let (wal, live, report) = open_live(WalConfig {
            dir: trial.path().to_path_buf(),
            ..cfg.clone()
        })
        .unwrap();
        let expect: Vec<u64> = frame_ends
            .iter()
            .filter(|(end, _)| *end <= cut)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(
            live.keys().copied().collect::<Vec<_>>(),
            expect,
            "cut at {cut}"
        );
        assert!(
            report.corruptions.is_empty(),
            "cut at {cut}: {:?}",
            report.corruptions
        );
        let complete = all_ends
            .iter()
            .copied()
            .filter(|e| *e <= cut)
            .max()
            .unwrap_or(16);
        assert_eq!(
            report.truncated_bytes,
            (cut - complete) as u64,
            "cut at {cut}"
        );
        // The log accepts appends after the cut, and they survive.
        let d = schedule(&wal, 1, b"after");
        close(wal);
        let (_, live, _) = open_live(WalConfig {
            dir: trial.path().to_path_buf(),
            ..cfg.clone()
        })
        .unwrap();
        assert!(live.contains_key(&d.id));
    }
}

#[test]
fn zero_filled_tail_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        segment_bytes: 1 << 20,
        ..WalConfig::new(dir.path())
    };
    let (wal, _, _) = open_live(cfg.clone()).unwrap();
    let ids: Vec<u64> = (0..5).map(|i| schedule(&wal, i, b"x").id).collect();
    close(wal);
    let seg = segments_of(dir.path()).pop().unwrap();
    let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all(&vec![0u8; 1 << 16]).unwrap();
    drop(f);
    let (_, live, report) = open_live(cfg).unwrap();
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), ids);
    assert_eq!(report.truncated_bytes, 1 << 16);
    assert!(report.corruptions.is_empty());
}

/// Build a log of several sealed segments; return the ids and the dir.
fn multi_segment_log(dir: &Path) -> Vec<u64> {
    let (wal, _, _) = open_live(config(dir)).unwrap();
    let ids = (0..60)
        .map(|i| schedule(&wal, i, &[i as u8; 200]).id)
        .collect();
    close(wal);
    assert!(segments_of(dir).len() >= 3);
    ids
}

#[test]
fn flipped_bit_in_sealed_segment_is_reported_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let ids = multi_segment_log(dir.path());
    let first = segments_of(dir.path())[0].clone();
    let mut bytes = std::fs::read(&first).unwrap();
    let flip_at = 16 + 8 + 9 + 30; // inside the first frame's payload
    bytes[flip_at] ^= 0x10;
    std::fs::write(&first, &bytes).unwrap();

    let (_, live, report) = open_live(config(dir.path())).unwrap();
    assert_eq!(report.corruptions.len(), 1);
    let c = &report.corruptions[0];
    assert_eq!(c.segment, first);
    assert_eq!(c.offset, 16);
    // Skipped: the damaged frame, up to the next one.
    let len = u32::from_le_bytes(bytes[16..20].try_into().unwrap());
    assert_eq!(c.skipped_bytes, 8 + u64::from(len));
    // Exactly the damaged record is lost; everything else is recovered.
    let expect: Vec<u64> = ids[1..].to_vec();
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), expect);
}

#[test]
fn flipped_bit_with_refuse_policy_fails_to_open_naming_segment_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    multi_segment_log(dir.path());
    let first = segments_of(dir.path())[0].clone();
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[16 + 2] ^= 1; // the first frame's length
    std::fs::write(&first, &bytes).unwrap();
    let cfg = WalConfig {
        on_corruption: OnCorruption::Refuse,
        ..config(dir.path())
    };
    match open_live(cfg) {
        Err(WalError::Corrupt {
            segment, offset, ..
        }) => {
            assert_eq!(segment, first);
            assert_eq!(offset, 16);
        }
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("opened a corrupt log"),
    }
}

/// Every single bit flip in the first frames of a sealed segment, and every
/// flip in the headers of all its other frames (the last one included) plus
/// a fixed sample of their payload bits, is reported and costs at most the
/// one record it hit: every other message is recovered (the scan
/// resynchronises on the next frame).
#[test]
fn every_single_bit_flip_in_a_sealed_segment_is_caught_and_costs_one_record() {
    let dir = tempfile::tempdir().unwrap();
    let ids = multi_segment_log(dir.path());
    let first = segments_of(dir.path())[0].clone();
    let clean = std::fs::read(&first).unwrap();
    // Frame boundaries of the whole segment (Schedules and Commits).
    let salt = frame::header_salt(&clean).unwrap();
    let mut frames = Vec::new(); // (start, end, Some(id) for a Schedule)
    let mut at = frame::SEGMENT_HEADER_BYTES as usize;
    while at < clean.len() {
        let (parsed, size) = frame::parse(&clean[at..], 1 << 20, salt).unwrap();
        let id = match parsed {
            frame::Parsed::Record(RecordRef::Schedule { id, .. }) => Some(id),
            _ => None,
        };
        frames.push((at, at + size, id));
        at += size;
    }
    assert!(frames.len() > 8, "only {} frames", frames.len());
    // Every bit of the first four frames; the header bits and 16 payload
    // bits (xorshift, fixed seed) of each later frame.
    let mut bits: Vec<usize> = ((frames[0].0 * 8)..(frames[3].1 * 8)).collect();
    const HEAD: usize = frame::HEADER_BYTES + 9; // len, crc, type, seq
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for &(start, end, _) in &frames[4..] {
        bits.extend((start * 8)..((start + HEAD) * 8));
        for _ in 0..16 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let payload_bits = (end - start - HEAD) * 8;
            bits.push((start + HEAD) * 8 + (rng as usize) % payload_bits);
        }
    }
    for bit in bits {
        let trial = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), trial.path());
        let mut bytes = clean.clone();
        bytes[bit / 8] ^= 1 << (bit % 8);
        std::fs::write(trial.path().join(first.file_name().unwrap()), &bytes).unwrap();
        let (_, live, report) = open_live(config(trial.path())).unwrap();
        assert!(!report.corruptions.is_empty(), "bit {bit} went unnoticed");
        let hit = frames
            .iter()
            .find(|(start, end, _)| (*start..*end).contains(&(bit / 8)))
            .and_then(|f| f.2);
        let expect: Vec<u64> = ids.iter().copied().filter(|id| Some(*id) != hit).collect();
        assert_eq!(
            live.keys().copied().collect::<Vec<_>>(),
            expect,
            "bit {bit} cost more than the record it hit"
        );
    }
}

#[test]
fn fully_done_segments_are_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let recs: Vec<Appended> = (0..60).map(|i| schedule(&wal, i, &[0u8; 200])).collect();
    let before = wal.space().segments;
    assert!(before >= 3);
    for a in &recs[..50] {
        wal.append_done(a.id, a.pos)
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap();
    }
    let deleted = wal.collect_garbage().unwrap();
    assert!(deleted >= 1, "nothing deleted");
    close(wal);
    let (_, live, _) = open_live(config(dir.path())).unwrap();
    let expect: Vec<u64> = recs[50..].iter().map(|a| a.id).collect();
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), expect);
}

/// Garbage collection hands the segments it will delete to `before`, which
/// writes the Remembered frames of the records they hold. A segment sealed
/// while it wrote them holds nothing live either; if `before` keeps one
/// segment back, the set is worked out again, and that new segment was
/// deleted with the frames just written in it (sim seed 212,067: a restart
/// forgot a message, whose redelivery fired under a new id).
#[test]
fn garbage_collection_deletes_only_the_segments_it_offered() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let recs: Vec<Appended> = (0..40).map(|i| schedule(&wal, i, &[0u8; 200])).collect();
    for a in &recs {
        wal.append_done(a.id, a.pos)
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap();
    }
    let frames = 100u64;
    let before = |offered: &[u32]| {
        assert!(offered.len() >= 2, "offered {offered:?}");
        for id in 0..frames {
            let frame = frame::Remembered {
                id: 1_000 + id,
                uid: uid_of(id),
                fp: id,
                digest: [7; 32],
                flags: 0,
            };
            wal.append_remembered(frame)
                .unwrap()
                .blocking_recv()
                .unwrap()
                .unwrap();
        }
        vec![offered[0]]
    };
    wal.collect_garbage_after(before).unwrap();
    close(wal);
    let mut read = 0;
    Wal::open(config(dir.path()), |rec, _| {
        if let RecordRef::Remembered { .. } = rec {
            read += 1;
        }
    })
    .unwrap();
    assert_eq!(read, frames, "Remembered frames were deleted");
}

#[test]
fn oversized_record_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        max_message_bytes: 1024,
        ..config(dir.path())
    };
    let (wal, _, _) = open_live(cfg).unwrap();
    assert!(matches!(
        wal.append_schedule(1, 1, "r", vec![0; 2048]),
        Err(WalError::TooLarge { .. })
    ));
}

#[derive(Debug, Clone)]
enum Op {
    Schedule(u8),
    Done(usize),
    Reopen,
    Gc,
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<u8>().prop_map(Op::Schedule),
        4 => any::<usize>().prop_map(Op::Done),
        1 => Just(Op::Reopen),
        1 => Just(Op::Gc),
        2 => Just(Op::Compact),
    ]
}

/// Live messages of the model: id -> (where its Schedule is, due, bytes).
type Model = BTreeMap<u64, (WalPos, u64, Vec<u8>)>;

/// Compact the sealed segment the log proposes, if any, as the engine does
/// (`engine::compact`): append a copy of every live Schedule in it and every
/// Done it holds for a Schedule in another segment still on disk, wait for
/// them, move the model's positions to the copies, then delete the segment.
/// Returns whether a segment was compacted.
fn compact(wal: &Wal, model: &mut Model) -> bool {
    // Long after every due time: no segment is left to empty by itself.
    let Some(segment) = wal.compaction_candidate(u64::MAX) else {
        return false;
    };
    let first_seq = wal.segment_first_seq(segment).unwrap();
    let mut copies = Vec::new();
    let mut done_copies = Vec::new();
    for (offset, record) in wal.scan_segment(segment).unwrap() {
        let at = WalPos { segment, offset };
        match record {
            Record::Schedule {
                id,
                due_ms,
                uid,
                route,
                message,
                ..
            } => {
                if model.get(&id).is_some_and(|(pos, _, _)| *pos == at) {
                    let copy = wal
                        .append_copy(id, due_ms, uid, &route, message, None)
                        .unwrap();
                    copies.push((id, at, copy));
                }
            }
            Record::Done {
                id,
                segment: target,
                ..
            } => {
                if target != first_seq && wal.segment_exists(target) {
                    done_copies.push(wal.append_done_copy(id, target).unwrap());
                }
            }
            Record::Acked { .. } | Record::Remembered { .. } => {}
        }
    }
    for (id, old, copy) in copies {
        let new = copy.blocking_recv().unwrap().unwrap().pos;
        assert_ne!(new.segment, old.segment, "a copy went into its own segment");
        model.get_mut(&id).unwrap().0 = new;
        wal.mark_dead(old);
        wal.keep_after(new.segment, old.segment);
    }
    for done in done_copies {
        done.blocking_recv().unwrap().unwrap();
    }
    wal.remove_compacted(segment).unwrap();
    true
}

/// Close the log, open it again and compare what it replays with the model.
/// Returns the reopened log and the model with the positions recovery
/// found (segment ordinals are renumbered on open).
fn reopen_and_compare(
    wal: Wal,
    cfg: &WalConfig,
    model: &Model,
) -> Result<(Wal, Model), TestCaseError> {
    close(wal);
    let mut positions = Model::new();
    let (reopened, report) = Wal::open(cfg.clone(), |rec, pos| match rec {
        RecordRef::Schedule {
            id,
            due_ms,
            message,
            ..
        } => {
            positions.insert(id, (pos, due_ms, message.to_vec()));
        }
        RecordRef::Done { id, .. } => {
            positions.remove(&id);
        }
        RecordRef::Acked { .. } | RecordRef::Remembered { .. } => {}
    })
    .unwrap();
    prop_assert!(report.corruptions.is_empty());
    let got: Vec<(u64, u64, &Vec<u8>)> = positions.iter().map(|(k, v)| (*k, v.1, &v.2)).collect();
    let want: Vec<(u64, u64, &Vec<u8>)> = model.iter().map(|(k, v)| (*k, v.1, &v.2)).collect();
    prop_assert_eq!(got, want);
    reopened.set_live_counts(positions.values().map(|v| v.0));
    Ok((reopened, positions))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// After any mix of appends, Dones, garbage collection, compactions and
    /// reopens, the live set read back equals the model, at every reopen and
    /// once more at the end.
    #[test]
    fn recovery_equivalence(ops in proptest::collection::vec(op(), 1..120)) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = WalConfig { segment_bytes: 1024, ..WalConfig::new(dir.path()) };
        let (mut wal, _, _) = open_live(cfg.clone()).unwrap();
        let mut model = Model::new();
        for op in ops {
            match op {
                Op::Schedule(n) => {
                    let msg = vec![n; n as usize];
                    let due = 1_000 + u64::from(n) * 7;
                    let a = schedule(&wal, due, &msg);
                    model.insert(a.id, (a.pos, due, msg));
                }
                Op::Done(i) if !model.is_empty() => {
                    let id = *model.keys().nth(i % model.len()).unwrap();
                    let (pos, _, _) = model.remove(&id).unwrap();
                    wal.append_done(id, pos).unwrap().blocking_recv().unwrap().unwrap();
                }
                Op::Done(_) => {}
                Op::Gc => { wal.collect_garbage().unwrap(); }
                Op::Compact => { compact(&wal, &mut model); }
                Op::Reopen => {
                    (wal, model) = reopen_and_compare(wal, &cfg, &model)?;
                }
            }
        }
        reopen_and_compare(wal, &cfg, &model)?;
    }
}

/// The compaction step of `recovery_equivalence` does compact: sparse
/// sealed segments are rewritten into copies, and what they held survives
/// a reopen.
#[test]
fn the_model_compaction_moves_live_records_and_removes_segments() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        segment_bytes: 1024,
        ..WalConfig::new(dir.path())
    };
    let (wal, _, _) = open_live(cfg.clone()).unwrap();
    let mut model = Model::new();
    for n in 0..40u8 {
        let msg = vec![n; 100];
        let a = schedule(&wal, u64::from(n), &msg);
        model.insert(a.id, (a.pos, u64::from(n), msg));
    }
    // Keep one in five: every sealed segment falls under the threshold.
    let ids: Vec<u64> = model.keys().copied().collect();
    for (i, id) in ids.iter().enumerate() {
        if i % 5 != 0 {
            let (pos, _, _) = model.remove(id).unwrap();
            wal.append_done(*id, pos)
                .unwrap()
                .blocking_recv()
                .unwrap()
                .unwrap();
        }
    }
    let before = model.clone();
    let mut compacted = 0;
    while compact(&wal, &mut model) {
        compacted += 1;
        assert!(compacted < 100, "compaction does not converge");
    }
    assert!(compacted > 0, "nothing was compacted");
    let moved = model
        .iter()
        .filter(|(id, (pos, _, _))| before[*id].0 != *pos)
        .count();
    assert!(moved > 0, "no live record was moved");
    reopen_and_compare(wal, &cfg, &model).unwrap();
}

#[test]
fn a_second_open_of_a_locked_directory_is_refused_with_the_holders_pid() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _, _) = open_live(config(dir.path())).unwrap();
    schedule(&first, 10, b"kept");
    let err = open_live(config(dir.path()))
        .err()
        .expect("second open refused");
    assert!(
        matches!(&err, WalError::Locked { pid: Some(pid), .. } if *pid == std::process::id()),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&dir.path().display().to_string())
            && text.contains(&std::process::id().to_string()),
        "{text}"
    );
    // The refused open touched nothing: the first log still works.
    schedule(&first, 20, b"more");
    first.close().unwrap();
    drop(first);
    let (_, live, _) = open_live(config(dir.path())).unwrap();
    assert_eq!(live.len(), 2, "the lock is released with the last handle");
}

#[test]
fn a_missing_directory_is_refused_unless_create_dir() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("wal");
    let err = open_live(config(&dir)).err().expect("missing dir refused");
    let text = err.to_string();
    assert!(
        text.contains(&dir.display().to_string()) && text.contains("wal.create_dir"),
        "{text}"
    );
    assert!(!dir.exists(), "refusing must not create it");
    let (wal, live, _) = open_live(WalConfig {
        create_dir: true,
        ..config(&dir)
    })
    .unwrap();
    assert!(live.is_empty());
    schedule(&wal, 1, b"x");
}

/// Bytes shaped like a v1 frame (CRC over len, type, seq, payload; no salt)
/// holding a Schedule with a huge seq: what a producer can put in a body.
fn forged_frame(seq: u64, id: u64) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&id.to_le_bytes());
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&1u16.to_le_bytes());
    payload.extend_from_slice(b"r");
    payload.extend_from_slice(b"forged");
    let len = (1 + 8 + payload.len()) as u32;
    let mut rest = vec![1u8];
    rest.extend_from_slice(&seq.to_le_bytes());
    rest.extend_from_slice(&payload);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len.to_le_bytes()), &rest);
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&rest);
    out
}

/// A damaged frame makes recovery resynchronise byte by byte. A frame a
/// producer embedded in a message body must not be taken for a real one: it
/// would add a message nobody sent, and its huge seq would make every later
/// frame look like it went backwards.
#[test]
fn a_frame_forged_inside_a_message_body_is_never_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let mut body = b"prefix".to_vec();
    body.extend_from_slice(&forged_frame(u64::MAX - 10, 777_777));
    body.extend_from_slice(b"suffix");
    let carrier = schedule(&wal, 5, &body).id;
    let after: Vec<u64> = (0..30).map(|i| schedule(&wal, i, &[7; 100]).id).collect();
    close(wal);
    // Damage the carrier's CRC: its frame is bad, the scan resynchronises.
    let first = segments_of(dir.path())[0].clone();
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[16 + 4] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();

    let (_, live, report) = open_live(config(dir.path())).unwrap();
    assert!(
        !live.contains_key(&777_777),
        "the forged message was recovered"
    );
    assert!(!live.contains_key(&carrier));
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), after);
    assert_eq!(report.corruptions.len(), 1, "{:?}", report.corruptions);
}

/// The last batch can be torn with its later pages on disk and its earlier
/// ones not (the kernel writes pages back in any order). That batch was never
/// acknowledged, so recovery cuts it off, under `refuse` too. A bad frame in
/// an earlier, acknowledged batch is still corruption.
#[test]
fn a_torn_last_batch_with_later_pages_on_disk_recovers_under_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        segment_bytes: 1 << 20,
        on_corruption: OnCorruption::Refuse,
        ..WalConfig::new(dir.path())
    };
    let (wal, _, _) = open_live(cfg.clone()).unwrap();
    let kept: Vec<u64> = (0..5).map(|i| schedule(&wal, i, b"small").id).collect();
    let before_last = std::fs::metadata(segments_of(dir.path()).pop().unwrap())
        .unwrap()
        .len() as usize;
    schedule(&wal, 9, &[b'x'; 10_000]);
    close(wal);
    let seg = segments_of(dir.path()).pop().unwrap();
    let clean = std::fs::read(&seg).unwrap();

    // The last batch's first page never reached the disk; the rest did.
    let trial = tempfile::tempdir().unwrap();
    let mut torn = clean.clone();
    torn[before_last..before_last + 4096].fill(0);
    std::fs::write(trial.path().join(seg.file_name().unwrap()), &torn).unwrap();
    let trial_cfg = WalConfig {
        dir: trial.path().to_path_buf(),
        ..cfg.clone()
    };
    let (wal, live, report) =
        open_live(trial_cfg.clone()).expect("a torn last batch is no corruption");
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), kept);
    assert_eq!(report.truncated_bytes, (clean.len() - before_last) as u64);
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);
    let after = schedule(&wal, 1, b"after").id;
    close(wal);
    let (_, live, _) = open_live(trial_cfg).unwrap();
    assert!(live.contains_key(&after));

    // The same damage in the second batch, which later batches follow.
    let trial = tempfile::tempdir().unwrap();
    let mut rotten = clean.clone();
    let second = frame::SEGMENT_HEADER_BYTES as usize + (before_last - 16) / 5;
    rotten[second..second + 8].fill(0);
    std::fs::write(trial.path().join(seg.file_name().unwrap()), &rotten).unwrap();
    match open_live(WalConfig {
        dir: trial.path().to_path_buf(),
        ..cfg
    }) {
        Err(WalError::Corrupt { .. }) => {}
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("corruption in an acknowledged batch was cut off as a torn tail"),
    }
}

#[test]
fn a_fired_done_waits_for_the_next_batch_and_costs_no_fsync_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // Long enough that only the next batch can carry the lazy Done.
    let cfg = WalConfig {
        lazy_done_wait: std::time::Duration::from_secs(3600),
        ..config(dir.path())
    };
    let (wal, _, _) = open_live(cfg).unwrap();
    let a = schedule(&wal, 10, b"a");
    let b = schedule(&wal, 20, b"b");
    let fsyncs = wal.fsyncs();
    wal.append_fired(a.id, a.pos).unwrap();
    // Not written yet: a copy of the files now still has `a` live.
    let early = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), early.path());
    let (copy, live, _) = open_live(config(early.path())).unwrap();
    assert!(
        live.contains_key(&a.id),
        "the lazy Done was written at once"
    );
    close(copy);
    // The next batch carries it, with one fdatasync for both.
    let c = schedule(&wal, 30, b"c");
    assert_eq!(
        wal.fsyncs(),
        fsyncs + 1,
        "one fsync for the batch and the lazy Done"
    );
    let later = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), later.path());
    let (copy, live, _) = open_live(config(later.path())).unwrap();
    assert_eq!(live.keys().copied().collect::<Vec<_>>(), vec![b.id, c.id]);
    close(copy);
    close(wal);
}

/// With a commit delay the writer sleeps through a batch's wait instead of
/// waking for each record. A Schedule that joins a batch of lazy Dones must
/// still be written once its own commit delay is up, not when the Dones'
/// far longer wait is; and records sent within one delay share one fsync.
#[test]
fn a_schedule_joining_lazy_dones_waits_only_its_commit_delay() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WalConfig {
        lazy_done_wait: std::time::Duration::from_secs(3600),
        commit_delay: std::time::Duration::from_millis(200),
        ..config(dir.path())
    };
    let (wal, _, _) = open_live(cfg).unwrap();
    let a = schedule(&wal, 10, b"a");
    let fsyncs = wal.fsyncs();
    wal.append_fired(a.id, a.pos).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let replies: Vec<_> = (0..3u64)
        .map(|i| wal.append_schedule(20 + i, 1, "r", vec![b'b'; 10]).unwrap())
        .collect();
    for mut reply in replies {
        loop {
            match reply.try_recv() {
                Ok(appended) => {
                    appended.unwrap();
                    break;
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
                Err(e) => panic!("{e}"),
            };
            assert!(
                std::time::Instant::now() < deadline,
                "the Schedules wait as long as the lazy Done may"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    assert_eq!(wal.fsyncs(), fsyncs + 1, "one fsync for all four records");
    close(wal);
}

#[test]
fn a_fired_done_alone_is_written_within_the_lazy_interval() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let a = schedule(&wal, 10, b"a");
    let fsyncs = wal.fsyncs();
    wal.append_fired(a.id, a.pos).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal.fsyncs() == fsyncs {
        assert!(
            std::time::Instant::now() < deadline,
            "the lazy Done was never written"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Durable without a close: a copy of the files (a crash now) has it.
    let copy_dir_ = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), copy_dir_.path());
    let (copy, live, _) = open_live(config(copy_dir_.path())).unwrap();
    assert!(live.is_empty(), "the Done was not on disk");
    close(copy);
    close(wal);
}

/// The report counts what recovery replayed, and the next seq follows every
/// frame on disk: a log reopened twice keeps its records and ids apart.
#[test]
fn the_recovery_report_counts_what_was_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let appended: Vec<Appended> = (0..30)
        .map(|i| schedule(&wal, i, &[i as u8; 200]))
        .collect();
    let mut last_done = 0;
    for a in &appended[..10] {
        last_done = wal
            .append_done(a.id, a.pos)
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap()
            .id;
    }
    close(wal);
    let on_disk = segments_of(dir.path()).len();
    assert!(on_disk >= 2);
    let (wal, live, report) = open_live(config(dir.path())).unwrap();
    assert_eq!((report.schedules, report.dones), (30, 10));
    assert!((2..=on_disk).contains(&report.segments), "{report:?}");
    assert_eq!(report.truncated_bytes, 0);
    assert!(report.corruptions.is_empty());
    assert_eq!(live.len(), 20);
    assert!(report.next_seq > last_done);
    let next = schedule(&wal, 99, b"after");
    assert!(next.id >= report.next_seq);
    close(wal);
    let (_, live, report) = open_live(config(dir.path())).unwrap();
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);
    assert_eq!((report.schedules, report.dones), (31, 10));
    assert_eq!(live.len(), 21);
    assert!(live.contains_key(&next.id));
}

/// An unreadable segment header: zeros on the last segment are a header that
/// never reached the disk (the segment goes, nothing is reported); anything
/// else is corruption, the whole segment skipped (or the open refused).
#[test]
fn unreadable_segment_headers() {
    // Overwrites the header of the first or the last segment and reopens.
    let open_with_header = |last: bool, header: [u8; 16], policy: OnCorruption| {
        let dir = tempfile::tempdir().unwrap();
        multi_segment_log(dir.path());
        let segments = segments_of(dir.path());
        let path = if last {
            segments[segments.len() - 1].clone()
        } else {
            segments[0].clone()
        };
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..16].copy_from_slice(&header);
        std::fs::write(&path, &bytes).unwrap();
        let cfg = WalConfig {
            on_corruption: policy,
            ..config(dir.path())
        };
        let opened = open_live(cfg).map(|(_, _, report)| report);
        (opened, path, bytes.len() as u64)
    };
    let (report, _, _) = open_with_header(true, [0; 16], OnCorruption::Skip);
    let report = report.unwrap();
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);

    let (report, path, len) = open_with_header(false, [0; 16], OnCorruption::Skip);
    let report = report.unwrap();
    assert_eq!(report.corruptions.len(), 1, "{report:?}");
    let c = &report.corruptions[0];
    assert_eq!((&c.segment, c.offset, c.skipped_bytes), (&path, 0, len));
    assert_eq!(c.reason, "bad segment header");

    let (opened, path, _) = open_with_header(true, *b"not a WAL header", OnCorruption::Refuse);
    match opened {
        Err(WalError::Corrupt {
            segment, offset, ..
        }) => {
            assert_eq!((segment, offset), (path, 0));
        }
        other => panic!("a garbled last header must be refused: {other:?}"),
    }
}

/// A garbled (not zeroed) header on the last segment under `skip`: the
/// segment is reported and left alone, and the log still opens and takes
/// appends (its new head segment was named like the skipped one, and the
/// open failed with "file exists").
#[test]
fn a_garbled_last_header_is_skipped_and_the_log_still_opens() {
    let dir = tempfile::tempdir().unwrap();
    multi_segment_log(dir.path());
    let segments = segments_of(dir.path());
    let last = segments[segments.len() - 1].clone();
    let mut bytes = std::fs::read(&last).unwrap();
    bytes[..16].copy_from_slice(b"not a WAL header");
    std::fs::write(&last, &bytes).unwrap();
    let cfg = WalConfig {
        on_corruption: OnCorruption::Skip,
        ..config(dir.path())
    };
    let (wal, _, report) = open_live(cfg.clone()).expect("the log opens");
    assert_eq!(report.corruptions.len(), 1, "{report:?}");
    assert_eq!(report.corruptions[0].segment, last);
    let a = schedule(&wal, 5, b"after");
    close(wal);
    // Reopened: the skipped segment is reported again, the new record kept.
    let (wal, live, report) = open_live(cfg).expect("the log opens again");
    assert_eq!(report.corruptions.len(), 1, "{report:?}");
    assert!(
        live.contains_key(&a.id),
        "the record written after the skip"
    );
    close(wal);
}

/// A segment shorter than a header (its creation's header write was cut
/// short: a full disk, then a crash before the failed segment was removed)
/// holds nothing: the next open removes it without reporting corruption,
/// even under `refuse`. Found by the engine simulator (seed 17).
#[test]
fn a_segment_cut_inside_its_header_is_removed_as_torn() {
    let dir = tempfile::tempdir().unwrap();
    multi_segment_log(dir.path());
    let segments = segments_of(dir.path());
    let last = segments[segments.len() - 1].clone();
    let bytes = std::fs::read(&last).unwrap();
    let torn = segments[0].with_file_name("wal-09999999999999999999.log");
    std::fs::write(&torn, &bytes[..8]).unwrap();
    let cfg = WalConfig {
        on_corruption: OnCorruption::Refuse,
        ..config(dir.path())
    };
    let (wal, _, report) = open_live(cfg.clone()).expect("the log opens");
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);
    // Kept while it is the last (its name bounds the seqs handed out), and
    // removed once a newer head is named past it.
    let a = schedule(&wal, 5, b"after");
    assert!(
        a.id > 9_999_999_999_999_999_999,
        "ids go on past the torn segment's name"
    );
    close(wal);
    let (wal, live, report) = open_live(cfg).expect("the log opens again");
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);
    assert!(!torn.exists(), "the torn segment is removed");
    assert!(live.contains_key(&a.id));
    close(wal);
}

/// A Done's wait is what a kill -9 turns into same-id copies: the writer,
/// asleep through a Schedule's commit delay, must still write a Done that
/// joins within the Done's own wait (`lazy_done_wait`), not at the end of
/// the Schedule's delay (#39's kill loop, docs/fault-campaign.md).
#[test]
fn a_done_joining_a_schedules_batch_waits_only_the_dones_wait() {
    let dir = tempfile::tempdir().unwrap();
    let a = {
        let (wal, _, _) = open_live(config(dir.path())).unwrap();
        let a = schedule(&wal, 10, b"a");
        close(wal);
        a
    };
    let cfg = WalConfig {
        // Only a Done can end this batch's wait within the test's deadline.
        commit_delay: std::time::Duration::from_secs(3600),
        ..config(dir.path())
    };
    let mut a_pos = None;
    let (wal, _) = Wal::open(cfg, |rec, pos| {
        if let RecordRef::Schedule { id, .. } = rec {
            if id == a.id {
                a_pos = Some(pos);
            }
        }
    })
    .unwrap();
    let fsyncs = wal.fsyncs();
    let mut b = wal
        .append_schedule(20, uid_of(20), "r", b"b".to_vec())
        .unwrap();
    // Give the writer time to take the Schedule alone and fall asleep in
    // its delay. Were the Done to arrive first, both would be taken at once
    // and the test would pass without showing anything; it cannot fail
    // for that reason.
    std::thread::sleep(std::time::Duration::from_millis(20));
    wal.append_fired(a.id, a_pos.expect("a replayed")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal.fsyncs() == fsyncs {
        assert!(
            std::time::Instant::now() < deadline,
            "the Done waited out the Schedule's commit delay"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    b.try_recv()
        .expect("the Schedule rode the Done's batch")
        .unwrap();
    close(wal);
}

/// `wal.max_message_bytes` lowered between restarts: the messages already
/// stored above the new limit were acknowledged, and must come back.
#[test]
fn a_lower_max_message_bytes_keeps_the_larger_messages_already_stored() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let big = vec![7u8; 200 << 10];
    let stored = schedule(&wal, 10, &big);
    let small = schedule(&wal, 20, b"small");
    close(wal);
    let lower = WalConfig {
        max_message_bytes: 64 << 10,
        ..config(dir.path())
    };
    let (wal, live, report) = open_live(lower).unwrap();
    assert!(report.corruptions.is_empty(), "{:?}", report.corruptions);
    assert_eq!(live.get(&stored.id).map(|m| m.2.len()), Some(big.len()));
    assert!(live.contains_key(&small.id));
    assert!(
        matches!(wal.read(stored.pos).unwrap(), Record::Schedule { message, .. } if message == big)
    );
}

/// A length is believed up to the format's largest (`frame::MAX_LEN`), so
/// a corrupt one at a record's position is refused for running past the
/// file, before anything that size is allocated.
#[test]
fn a_corrupt_length_past_the_file_is_refused_without_allocating_it() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let wal = open_one_segment(dir.path());
    let a = schedule(&wal, 10, &[1; 100]);
    let seg = segments_of(dir.path()).pop().unwrap();
    let f = OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(&0xF000_0000u32.to_le_bytes(), u64::from(a.pos.offset))
        .unwrap();
    let err = wal.read(a.pos).unwrap_err();
    assert!(
        err.to_string().contains("runs past the end of its file"),
        "{err}"
    );
}

/// An ack's mark written in a later segment than its Schedule outlives the
/// Schedule's segment, at run time and after a restart: deleted first, it
/// left a settled record to a restart as one in doubt (sim seed 427,654).
#[test]
fn an_acks_mark_outlives_the_segment_of_its_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _, _) = open_live(config(dir.path())).unwrap();
    let marked = schedule(&wal, 1, &[1u8; 100]);
    // Keeps the Schedule's segment on disk.
    let _stays = schedule(&wal, 2, &[2u8; 100]);
    let fill = |wal: &Wal| -> Vec<Appended> {
        (0..12)
            .map(|i| schedule(wal, 100 + i, &[3u8; 400]))
            .collect()
    };
    let mut dead = fill(&wal);
    wal.append_acked_now(marked.id, None)
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    dead.extend(fill(&wal));
    dead.push(marked);
    for a in &dead {
        wal.append_done(a.id, a.pos)
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap();
    }
    let marks_on_disk = |dir: &Path| {
        let mut marks = 0;
        let mut live = std::collections::HashMap::new();
        let (wal, _) = Wal::open(config(dir), |rec, pos| match rec {
            RecordRef::Acked { id, .. } if id == marked.id => marks += 1,
            RecordRef::Schedule { id, .. } => {
                live.insert(id, pos);
            }
            RecordRef::Done { id, .. } => {
                live.remove(&id);
            }
            _ => {}
        })
        .unwrap();
        wal.set_live_counts(live.into_values());
        (wal, marks)
    };
    wal.collect_garbage().unwrap();
    close(wal);
    let (wal, marks) = marks_on_disk(dir.path());
    assert_eq!(marks, 1, "the mark went while its Schedule stayed");
    // The restart's table knows it too.
    wal.collect_garbage().unwrap();
    close(wal);
    let (wal, marks) = marks_on_disk(dir.path());
    assert_eq!(
        marks, 1,
        "after a restart, the mark went while its Schedule stayed"
    );
    close(wal);
}
