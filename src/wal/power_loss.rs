//! Power-loss tests: the log runs on [`SimFs`], which forgets at a simulated
//! power loss whatever was not synced, and every record the log
//! acknowledged (an append whose reply came back `Ok`: what delayd waits
//! for before it acks the source) must be there after recovery.
//!
//! Each of these fails if the `fdatasync`, `fsync` or directory sync it
//! names is taken out of the log (see docs/testing.md for which catches
//! which).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::sim::{PowerLoss, SimFs};
use super::*;

const DIR: &str = "/vol/wal";

/// What an acknowledged Schedule must read back as.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    due_ms: u64,
    uid: u128,
    route: String,
    message: Vec<u8>,
}

type Live = BTreeMap<u64, Expected>;

/// A log just opened: what recovery replayed as live, and where.
struct Opened {
    wal: Wal,
    live: Live,
    report: RecoveryReport,
}

fn config(fs: &SimFs) -> WalConfig {
    WalConfig {
        // Small segments: the log rotates (creates files) all the time.
        segment_bytes: 4096,
        // Recovery must find no corruption, only at most a torn tail.
        on_corruption: OnCorruption::Refuse,
        lazy_done_wait: Duration::from_millis(5),
        fs: Arc::new(fs.clone()),
        ..WalConfig::new(DIR)
    }
}

fn open(cfg: WalConfig) -> Result<Opened, WalError> {
    let mut live = Live::new();
    let (wal, report) = Wal::open(cfg, |rec, _| match rec {
        RecordRef::Schedule {
            id,
            due_ms,
            uid,
            route,
            message,
            ..
        } => {
            live.insert(
                id,
                Expected {
                    due_ms,
                    uid,
                    route: route.to_owned(),
                    message: message.to_vec(),
                },
            );
        }
        RecordRef::Done { id, .. } => {
            live.remove(&id);
        }
        RecordRef::Acked { .. } | RecordRef::Remembered { .. } => {}
    })?;
    Ok(Opened { wal, live, report })
}

/// The `n`th test message: sizes from a few bytes to over a page, so
/// batches straddle page and segment boundaries.
fn message(n: u64) -> Expected {
    let len = (n * 97 % 5000) as usize + 1;
    Expected {
        due_ms: 1_000_000 + n,
        uid: (1u128 << 127) | u128::from(n),
        route: format!("route-{}", n % 3),
        message: (0..len).map(|i| (i as u64 * 31 + n) as u8).collect(),
    }
}

fn append(wal: &Wal, m: &Expected) -> Result<Appended, WalError> {
    wal.append_schedule(m.due_ms, m.uid, &m.route, m.message.clone())?
        .blocking_recv()
        .map_err(|_| WalError::Stopped)?
}

/// [`check`] with nothing cancelled and nothing in flight.
fn check_acked(live: &Live, acked: &BTreeMap<u64, Expected>, what: &str) {
    check(live, acked, &BTreeSet::new(), &BTreeSet::new(), what);
}

/// Every acknowledged Schedule is live with its exact bytes, every
/// acknowledged cancel stayed cancelled (but for messages whose fate was
/// still open: `open_ids`), and whatever else is live is a message the
/// test appended, intact.
fn check(
    live: &Live,
    acked: &BTreeMap<u64, Expected>,
    cancelled: &BTreeSet<u64>,
    open_ids: &BTreeSet<u64>,
    what: &str,
) {
    for (id, expected) in acked {
        if cancelled.contains(id) {
            assert!(
                !live.contains_key(id),
                "{what}: message {id} was cancelled (acknowledged) and came back"
            );
        } else if !open_ids.contains(id) {
            assert_eq!(
                live.get(id),
                Some(expected),
                "{what}: acknowledged message {id} lost or changed"
            );
        }
    }
    // Anything else live was appended but never acknowledged (its batch
    // reached the disk without its sync, which the source then redelivers):
    // allowed, if intact.
    for (id, record) in live {
        if !acked.contains_key(id) && !open_ids.contains(id) {
            let n = (record.uid & !(1u128 << 127)) as u64;
            assert_eq!(
                record,
                &message(n),
                "{what}: unacknowledged message {id} damaged"
            );
        }
    }
}

/// Appends acknowledged, cancels acknowledged, fired (lazy) Dones and
/// deleted segments, then the power goes with nothing left to write:
/// everything acknowledged is there, byte for byte. Fails without the
/// `fdatasync` of each batch (every record is lost) and without the
/// directory sync after a segment is created (the newer segments vanish).
#[test]
fn every_acknowledged_record_survives_a_power_loss() {
    let fs = SimFs::with_dir(DIR);
    let wal = open(config(&fs)).unwrap().wal;
    let mut acked = BTreeMap::new();
    let mut positions = BTreeMap::new();
    // From four threads at once, so batches hold several records.
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let wal = wal.clone();
                s.spawn(move || {
                    (0..100u64)
                        .map(|i| {
                            let m = message(t * 100 + i);
                            let a = append(&wal, &m).expect("append");
                            (a, m)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for t in threads {
            for (a, m) in t.join().unwrap() {
                positions.insert(a.id, a.pos);
                acked.insert(a.id, m);
            }
        }
    });
    let (mut cancelled, mut fired) = (BTreeSet::new(), BTreeSet::new());
    for (&id, &pos) in &positions {
        if id % 5 == 0 {
            wal.append_done(id, pos)
                .unwrap()
                .blocking_recv()
                .unwrap()
                .unwrap();
            cancelled.insert(id);
        } else if id % 7 == 0 {
            // Delivered: a lazy Done, which a power loss may take back.
            wal.append_fired(id, pos).unwrap();
            fired.insert(id);
        }
    }
    wal.collect_garbage().unwrap();
    let segments = wal.space().segments;
    assert!(segments > 20, "{segments} segments: the test must rotate");

    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    drop(wal);
    let after = open(config(&fs)).unwrap();
    assert!(after.report.corruptions.is_empty());
    check(
        &after.live,
        &acked,
        &cancelled,
        &fired,
        "after the power loss",
    );
}

/// The power is cut before each file operation in turn (every write, sync,
/// create, remove and directory sync of a run: appenders and a canceller
/// at once, lazy Dones, segments rotated and deleted), once with nothing
/// unsynced kept and once with a random part of it on disk (pages of the
/// last batch, a prefix of the directory changes). Each time, whatever was
/// acknowledged before the cut is there, recovery finds no corruption (the
/// log is opened with `on_corruption = refuse`), and so does a second boot
/// after a clean stop and another power loss: what recovery cut off or
/// removed stayed so.
#[test]
fn power_cut_before_every_file_operation_loses_nothing_acknowledged() {
    // How many operations an uninterrupted run makes.
    let total = {
        let fs = SimFs::with_dir(DIR);
        let wal = open(config(&fs)).unwrap().wal;
        let book = run(&wal, 0);
        assert!(book.cancelled.len() >= 10, "the run cancels");
        wal.close().unwrap();
        fs.ops()
    };
    assert!(total > 100, "{total} operations");
    let (mut unsynced_cuts, mut torn_tails) = (0, 0);
    for k in 1..=total {
        for loss in [PowerLoss::DropUnsynced, PowerLoss::Torn { seed: k }] {
            let what = format!("power cut before operation {k} of {total}, {loss:?}");
            let fs = SimFs::with_dir(DIR);
            fs.crash_after(k);
            // The cut may come while the log opens.
            let book = match open(config(&fs)) {
                Ok(opened) => run(&opened.wal, 0),
                Err(_) => Book::default(),
            };
            unsynced_cuts += usize::from(fs.unsynced().0 > 0);
            let fs = fs.power_loss(loss);
            let first = open(config(&fs)).unwrap_or_else(|e| panic!("{what}: recovery: {e}"));
            check(&first.live, &book.acked, &book.cancelled, &book.open, &what);
            assert!(first.report.corruptions.is_empty(), "{what}");
            torn_tails += usize::from(first.report.truncated_bytes > 0);
            // A clean stop of the recovered log, then a power loss.
            first.wal.close().unwrap();
            let fs = fs.power_loss(PowerLoss::DropUnsynced);
            drop(first);
            let second =
                open(config(&fs)).unwrap_or_else(|e| panic!("{what}: second recovery: {e}"));
            assert!(second.report.corruptions.is_empty(), "{what}, second boot");
            assert_eq!(second.report.truncated_bytes, 0, "{what}, second boot");
            check(
                &second.live,
                &book.acked,
                &book.cancelled,
                &book.open,
                &what,
            );
        }
    }
    // The cuts must also have landed between a batch's write and its sync
    // (about a third of all operations are such syncs), and some of those
    // must have left a torn tail.
    assert!(
        unsynced_cuts >= 2 * total as usize / 5,
        "{unsynced_cuts} of {} cuts with unsynced bytes",
        2 * total
    );
    assert!(torn_tails > 0, "no torn tail cut off");
}

/// What the writers of [`run`] were told.
#[derive(Default)]
struct Book {
    acked: BTreeMap<u64, Expected>,
    positions: BTreeMap<u64, WalPos>,
    cancelled: BTreeSet<u64>,
    /// Cancels sent but not acknowledged, and delivered messages (lazy
    /// Dones): either way after a power loss.
    open: BTreeSet<u64>,
}

/// Two appenders (30 messages each) and a canceller that cancels or fires
/// what was appended and deletes dead segments, all at once, until they are
/// done or the log stops (the power went). What each was told.
fn run(wal: &Wal, first: u64) -> Book {
    let book = Arc::new(Mutex::new(Book::default()));
    let appenders: Vec<_> = (0..2u64)
        .map(|t| {
            let (wal, book) = (wal.clone(), book.clone());
            std::thread::spawn(move || {
                for i in 0..30 {
                    let m = message(first + t * 1000 + i);
                    let Ok(a) = append(&wal, &m) else { return };
                    let mut book = book.lock().unwrap();
                    book.positions.insert(a.id, a.pos);
                    book.acked.insert(a.id, m);
                }
            })
        })
        .collect();
    let appended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let canceller = {
        let (wal, book, appended) = (wal.clone(), book.clone(), appended.clone());
        std::thread::spawn(move || {
            let mut round = 0u64;
            while round < 30 {
                let next = {
                    let book = book.lock().unwrap();
                    book.positions
                        .iter()
                        .find(|(id, _)| !book.cancelled.contains(id) && !book.open.contains(id))
                        .map(|(id, pos)| (*id, *pos))
                };
                let Some((id, pos)) = next else {
                    if appended.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    std::thread::yield_now();
                    continue;
                };
                round += 1;
                book.lock().unwrap().open.insert(id);
                if round % 3 == 2 {
                    // Delivered: a lazy Done, never waited for.
                    if wal.append_fired(id, pos).is_err() {
                        return;
                    }
                    continue;
                }
                let Ok(rx) = wal.append_done(id, pos) else {
                    return;
                };
                let Ok(Ok(_)) = rx.blocking_recv() else {
                    return;
                };
                let mut b = book.lock().unwrap();
                b.open.remove(&id);
                b.cancelled.insert(id);
                drop(b);
                if wal.collect_garbage().is_err() {
                    return;
                }
            }
        })
    };
    for t in appenders {
        t.join().unwrap();
    }
    appended.store(true, std::sync::atomic::Ordering::Release);
    canceller.join().unwrap();
    // Every reply that came back `Ok` was sent after its sync, and no sync
    // succeeds after the cut: all of them must survive.
    let mut book = book.lock().unwrap();
    std::mem::take(&mut *book)
}

/// The segments of the log, oldest first.
fn segment_files(fs: &SimFs) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs
        .list(Path::new(DIR))
        .unwrap()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    files.sort();
    files
}

fn append_all(wal: &Wal, from: u64, to: u64, acked: &mut BTreeMap<u64, Expected>) {
    for n in from..to {
        let m = message(n);
        acked.insert(append(wal, &m).unwrap().id, m);
    }
}

/// A log whose directory delayd created (`create_dir = true`) keeps its
/// records through a power loss: the new directory's name was synced into
/// its parent. Fails without that sync (the log's directory is gone).
#[test]
fn a_log_in_a_directory_it_created_survives_a_power_loss() {
    let fs = SimFs::with_dir("/vol");
    let cfg = |fs: &SimFs, create_dir| WalConfig {
        dir: PathBuf::from("/vol/data/wal"),
        create_dir,
        ..config(fs)
    };
    let wal = open(cfg(&fs, true)).unwrap().wal;
    let mut acked = BTreeMap::new();
    append_all(&wal, 0, 5, &mut acked);
    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    let after = open(cfg(&fs, false)).expect("the directory survived");
    check_acked(&after.live, &acked, "created dir");
}

/// The torn tail recovery cuts off stays cut: after a power loss (the cut
/// segment is sealed by then) recovery finds no half-written frame in the
/// middle of the log. Fails without the fsync after the truncation
/// (`on_corruption = refuse` then refuses to open).
#[test]
fn a_torn_tail_cut_at_recovery_stays_cut() {
    let fs = SimFs::with_dir(DIR);
    let cfg = |fs: &SimFs| WalConfig {
        segment_bytes: 1 << 20,
        ..config(fs)
    };
    let wal = open(cfg(&fs)).unwrap().wal;
    let mut acked = BTreeMap::new();
    append_all(&wal, 0, 10, &mut acked);
    // The start of a batch reached the disk; its fdatasync never came.
    let head = segment_files(&fs).pop().unwrap();
    let mut torn = 200u32.to_le_bytes().to_vec();
    torn.extend((1..=26).map(|b: u8| b.wrapping_mul(37)));
    fs.append_on_disk(&head, &torn);
    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    drop(wal);
    let first = open(cfg(&fs)).unwrap();
    assert_eq!(first.report.truncated_bytes, torn.len() as u64);
    check_acked(&first.live, &acked, "first boot");
    append_all(&first.wal, 10, 20, &mut acked);
    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    drop(first);
    let second = open(cfg(&fs)).unwrap_or_else(|e| panic!("the cut did not last: {e}"));
    assert_eq!(second.report.truncated_bytes, 0);
    check_acked(&second.live, &acked, "second boot");
}

/// A write that fails half-way (a full disk) is cut back, and the cut is
/// durable before anything else happens: after a clean restart seals the
/// segment, a power loss brings no half batch back into it. Fails without
/// the fsync after the cut (`on_corruption = refuse` refuses to open).
#[test]
fn a_failed_write_is_cut_back_for_good() {
    let fs = SimFs::with_dir(DIR);
    let cfg = |fs: &SimFs| WalConfig {
        segment_bytes: 1 << 20,
        ..config(fs)
    };
    let wal = open(cfg(&fs)).unwrap().wal;
    let mut acked = BTreeMap::new();
    append_all(&wal, 0, 5, &mut acked);
    // Part of the next batch reaches the disk, then the disk is full.
    fs.fail_next_append(40);
    let full = append(&wal, &message(5)).unwrap_err();
    assert!(matches!(full, WalError::DiskFull(_)), "{full}");
    wal.close().unwrap();
    drop(wal);
    // A clean restart on the same disk: the segment is sealed now.
    let restarted = open(cfg(&fs)).unwrap();
    check_acked(&restarted.live, &acked, "restart");
    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    drop(restarted);
    let after = open(cfg(&fs)).unwrap_or_else(|e| panic!("half a batch came back: {e}"));
    check_acked(&after.live, &acked, "power loss");
}

/// A 128 KiB volume: an eighth of it holds the 8 KiB reserve.
fn small_volume_with_a_reserve() -> (SimFs, Wal) {
    let fs = SimFs::with_dir(DIR);
    fs.set_capacity(Some(128 << 10));
    let cfg = WalConfig {
        segment_bytes: 1 << 20,
        reserve_bytes: 8 << 10,
        ..config(&fs)
    };
    let wal = open(cfg).unwrap().wal;
    (fs, wal)
}

/// Another process fills the small volume to the last byte; returns its file.
fn fill_the_volume(fs: &SimFs) -> PathBuf {
    let filler = Path::new(DIR).join("filler");
    let room = 128 * 1024 - fs.used_bytes();
    fs.create_new(&filler)
        .unwrap()
        .append(&vec![0; room])
        .unwrap();
    filler
}

/// The disk reserve on a disk that fills up: the first ENOSPC releases it;
/// a batch of new messages is not tried again on its room (the intake
/// waits), a Done is, and succeeds; new messages are taken again only once
/// twice the reserve is free. Without the `new` check the failed message
/// was stored on the reserve's room.
#[test]
fn a_full_disk_gives_the_reserve_to_dones_never_to_new_messages() {
    let (fs, wal) = small_volume_with_a_reserve();
    let first = append(&wal, &message(0)).unwrap();
    append(&wal, &message(1)).unwrap();
    let reserve = Path::new(DIR).join("reserve");
    assert_eq!(fs.file_len(&reserve), 8 << 10);
    let filler = fill_the_volume(&fs);
    let full = append(&wal, &message(3)).unwrap_err();
    assert!(matches!(full, WalError::DiskFull(_)), "{full}");
    assert_eq!(fs.file_len(&reserve), 0, "released");
    // The intake waits: nothing more is written for new messages.
    let used = fs.used_bytes();
    let refused = append(&wal, &message(4)).unwrap_err();
    assert!(matches!(refused, WalError::DiskFull(_)), "{refused}");
    assert_eq!(
        fs.used_bytes(),
        used,
        "a new message took the reserve's room"
    );
    // A Done still fits.
    wal.append_done(first.id, first.pos)
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    // Twice the reserve free again: the intake resumes.
    fs.open_write(&filler).unwrap().set_len(0).unwrap();
    append(&wal, &message(5)).unwrap();
    assert_eq!(fs.file_len(&reserve), 8 << 10);
}

/// A new message admitted while the reserve was held, and written after
/// another write's ENOSPC released it (the far tier's, or a batch just
/// before), must not land on the reserve's room: the writer checks again.
/// Without the check the early seal makes a new head in the freed room
/// and the message fits there (the operations test's "a full disk took 1
/// message in").
#[test]
fn a_message_admitted_before_the_reserve_went_is_not_written_on_its_room() {
    let (fs, wal) = small_volume_with_a_reserve();
    append(&wal, &message(0)).unwrap();
    fill_the_volume(&fs);
    // Admitted while the reserve was held...
    assert!(wal.has_room().unwrap());
    // ...then another write's ENOSPC releases it...
    assert!(wal.release_reserve());
    // ...and only then does the writer take the message.
    let m = message(1);
    let written = wal
        .shared
        .writer
        .send(AppendRequest::new_message(
            m.due_ms,
            m.uid,
            &m.route,
            m.message.clone(),
        ))
        .unwrap()
        .blocking_recv()
        .unwrap();
    assert!(
        matches!(written, Err(WalError::DiskFull(_))),
        "a new message took the reserve's room: {written:?}"
    );
}

/// A compaction copy frees space only once its whole compaction is done:
/// on the reserve's room it would take what the fired messages' Dones and
/// the far tier's loads need to empty the disk. Its ENOSPC releases the
/// reserve (for those), and it is not tried again there. Without that it
/// was (sim seed 9104734: a drain's compaction spent the room a far load's
/// checkpoint needed, and the disk never emptied).
#[test]
fn a_full_disk_never_gives_the_reserve_to_a_compaction_copy() {
    let (fs, wal) = small_volume_with_a_reserve();
    let m = message(0);
    let first = append(&wal, &m).unwrap();
    fill_the_volume(&fs);
    let reserve = Path::new(DIR).join("reserve");
    let without_reserve = fs.used_bytes() - fs.file_len(&reserve);
    let copy = wal
        .append_copy(first.id, m.due_ms, m.uid, &m.route, m.message.clone(), None)
        .unwrap()
        .blocking_recv()
        .unwrap();
    assert!(matches!(copy, Err(WalError::DiskFull(_))), "{copy:?}");
    assert_eq!(fs.file_len(&reserve), 0, "released");
    assert_eq!(
        fs.used_bytes(),
        without_reserve,
        "a compaction copy took the reserve's room"
    );
    // Refused at once while the reserve is out, and a Done still fits.
    let again = wal
        .append_copy(first.id, m.due_ms, m.uid, &m.route, m.message.clone(), None)
        .unwrap()
        .blocking_recv()
        .unwrap();
    assert!(matches!(again, Err(WalError::DiskFull(_))), "{again:?}");
    assert_eq!(fs.used_bytes(), without_reserve);
    wal.append_done(first.id, first.pos)
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
}

/// A start needs no room of its own: on a disk full to the last byte (the
/// reserve spent), the log opens and goes on in its last segment, and what
/// it appends there once there is room survives a power loss. Fails
/// without the resumed head (sim seed 2658: the new head segment's
/// creation failed, and delayd could not start).
#[test]
fn a_start_on_a_full_disk_goes_on_in_the_last_segment() {
    let fs = SimFs::with_dir(DIR);
    let cfg = |fs: &SimFs| WalConfig {
        segment_bytes: 1 << 20,
        reserve_bytes: 0,
        ..config(fs)
    };
    let wal = open(cfg(&fs)).unwrap().wal;
    let mut acked = BTreeMap::new();
    append_all(&wal, 0, 3, &mut acked);
    drop(wal);
    let segments = segment_files(&fs);
    fs.set_capacity(Some(fs.used_bytes()));
    let reopened = open(cfg(&fs)).unwrap_or_else(|e| panic!("a full disk refused the start: {e}"));
    check_acked(&reopened.live, &acked, "full disk");
    assert_eq!(segment_files(&fs), segments, "a start made a new segment");
    fs.set_capacity(None);
    append_all(&reopened.wal, 3, 6, &mut acked);
    assert_eq!(segment_files(&fs), segments);
    let fs = fs.power_loss(PowerLoss::DropUnsynced);
    drop(reopened);
    let after = open(cfg(&fs)).unwrap();
    check_acked(&after.live, &acked, "after the power loss");
}

/// A start on a full disk goes on in its last segment; while the reserve
/// cannot be made again, that segment is sealed early (once there is room
/// for a new head), so that once its records are dead it is deleted and
/// the disk empties. Fails without the early seal after a start (sim seed
/// 2934: the resumed head of dead records held the disk full for good).
#[test]
fn a_resumed_head_is_sealed_early_while_the_reserve_is_not_held() {
    let fs = SimFs::with_dir(DIR);
    let cfg = |fs: &SimFs| WalConfig {
        segment_bytes: 1 << 20,
        reserve_bytes: 4096,
        ..config(fs)
    };
    let wal = open(cfg(&fs)).unwrap().wal;
    // Some 50 KB: a volume whose eighth holds the whole 4 KiB ballast.
    append_all(&wal, 0, 20, &mut BTreeMap::new());
    drop(wal);
    let before = segment_files(&fs);
    // Room for a header and a few Dones, not for the reserve twice over
    // (the ballast the first run made goes at the start).
    let ballast = fs.file_len(&Path::new(DIR).join("reserve"));
    fs.set_capacity(Some(fs.used_bytes() - ballast + 2048));
    let mut positions = Vec::new();
    let (wal, _) = Wal::open(cfg(&fs), |rec, pos| {
        if let RecordRef::Schedule { id, .. } = rec {
            positions.push((id, pos));
        }
    })
    .unwrap();
    assert!(!wal.has_room().unwrap(), "the reserve cannot be made");
    wal.set_live_counts(positions.iter().map(|&(_, pos)| pos));
    for &(id, pos) in &positions {
        wal.append_done(id, pos)
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap();
    }
    assert_eq!(
        wal.collect_garbage().unwrap(),
        before.len(),
        "the resumed head was never sealed: its dead records hold the disk"
    );
    assert!(!segment_files(&fs).iter().any(|s| before.contains(s)));
}
