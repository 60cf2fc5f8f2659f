//! The far tier's files: order, one record per id, cancels, key
//! tombstones, and opening after a crash from the checkpoint alone.

use super::*;
use crate::wal::StdFs;

const HOUR: u64 = 3_600_000;

fn config(dir: &Path) -> FarConfig {
    FarConfig {
        dir: dir.join("far"),
        bucket_ms: HOUR,
        max_frame_len: 1 << 20,
        fs: Arc::new(StdFs),
    }
}

fn record(id: u64, due_ms: u64, key: &str) -> FarRecord {
    FarRecord {
        id,
        due_ms,
        uid: u128::from(id) << 64 | 7,
        route: "orders".into(),
        message: key.as_bytes().to_vec(),
    }
}

/// The whole message is its key: enough for the tombstone tests.
fn whole(message: &[u8]) -> Option<&[u8]> {
    Some(message)
}

fn ids(read: &[FarRecord]) -> Vec<u64> {
    read.iter().map(|r| r.id).collect()
}

#[test]
fn a_bucket_reads_back_in_due_then_id_order_once_per_id_without_cancelled_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
    let b = 11 * HOUR;
    store
        .append(&[
            record(5, b + 9, "a"),
            record(3, b + 9, "b"),
            record(4, b + 1, "c"),
        ])
        .unwrap();
    // Spilled again after a crash lost the WAL's Done: kept once.
    store
        .append(&[record(3, b + 9, "b"), record(9, b + 2, "d")])
        .unwrap();
    store.cancel(b, 9, "orders").unwrap();
    let read = store.read_bucket(b, whole).unwrap();
    assert_eq!(ids(&read.live), [4, 3, 5]);
    assert_eq!(read.live[1], record(3, b + 9, "b"));
    assert!(read.tombstoned.is_empty());
    assert_eq!(
        store.counts()["orders"],
        4,
        "a double spill counts until loaded"
    );
}

#[test]
fn opening_cuts_what_the_checkpoint_does_not_vouch_for_and_reads_no_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let b = 20 * HOUR;
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store.append(&[record(1, b, "a")]).unwrap();
    }
    let path = dir.path().join("far").join(bucket_name(b));
    let good = std::fs::metadata(&path).unwrap().len();
    // A spill that crashed before its checkpoint: bytes past the length,
    // and a bucket the checkpoint never named.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut f, b"torn half-written frame").unwrap();
    let stray = dir.path().join("far").join(bucket_name(30 * HOUR));
    std::fs::write(&stray, b"unnamed").unwrap();

    let store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), good);
    assert!(!stray.exists());
    assert_eq!(
        store.frontier(),
        10 * HOUR,
        "the checkpoint's, not the default"
    );
    assert_eq!(ids(&store.read_bucket(b, whole).unwrap().live), [1]);
}

#[test]
fn a_bucket_shorter_than_its_checkpoint_or_missing_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let b = 20 * HOUR;
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store.append(&[record(1, b, "a")]).unwrap();
    }
    let path = dir.path().join("far").join(bucket_name(b));
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let e = FarStore::open(config(dir.path()), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&path.display().to_string()) && e.contains("shorter"),
        "{e}"
    );
    std::fs::remove_file(&path).unwrap();
    let e = FarStore::open(config(dir.path()), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&path.display().to_string()) && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn a_key_tombstone_cancels_only_messages_stored_before_it_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let b = 20 * HOUR;
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store
            .append(&[record(1, b, "k"), record(2, b, "other"), record(4, b, "k")])
            .unwrap();
        store.add_tombstone("orders", b"k", 3).unwrap();
        store.add_tombstone("payments", b"k", 3).unwrap();
    }
    let mut store = FarStore::open(config(dir.path()), 0).unwrap();
    let read = store.read_bucket(b, whole).unwrap();
    assert_eq!(ids(&read.live), [2, 4]);
    assert_eq!(ids(&read.tombstoned), [1]);
    assert_eq!(store.tombstones(), 1, "no bucket holds a payment");
    store.remove_bucket(b, b + HOUR).unwrap();
    assert_eq!(store.tombstones(), 0, "nothing left could match");
    assert_eq!(store.frontier(), b + HOUR);
    assert!(!dir.path().join("far").join(bucket_name(b)).exists());
}

/// A cancel by key costs one append whatever the number of tombstones
/// kept: the checkpoint is not rewritten, a key cancelled again keeps one
/// entry, and a bucket is read with one lookup a record.
#[test]
fn tombstones_cost_one_append_each_and_one_entry_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let (old, b) = (100 * HOUR, 20 * HOUR);
    let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
    // One message due far out keeps every tombstone below its id alive.
    store.append(&[record(1, old, "far out")]).unwrap();
    store
        .append(&[record(2, b, "k0"), record(3, b, "k1")])
        .unwrap();
    let checkpoint = dir.path().join("far").join(CHECKPOINT);
    let before = std::fs::read(&checkpoint).unwrap();
    for n in 0..500u64 {
        let key = format!("k{}", n % 250);
        store
            .add_tombstone("orders", key.as_bytes(), 10 + n)
            .unwrap();
    }
    assert_eq!(
        std::fs::read(&checkpoint).unwrap(),
        before,
        "a tombstone rewrote the checkpoint"
    );
    assert_eq!(store.tombstones(), 250, "one entry per key");
    let read = store.read_bucket(b, whole).unwrap();
    assert_eq!(ids(&read.tombstoned), [2, 3]);
    drop(store);
    let store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(store.tombstones(), 250, "the log survives reopening");
    assert_eq!(
        ids(&store.read_bucket(b, whole).unwrap().tombstoned),
        [2, 3]
    );
}

/// Tombstones go once no bucket of their route can match, the log is
/// rewritten once most of it is dead, and a torn last line is cut.
#[test]
fn tombstones_are_pruned_and_a_torn_line_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (b, c) = (20 * HOUR, 30 * HOUR);
    let log = dir.path().join("far").join("tombstones.log");
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store.append(&[record(1, b, "k")]).unwrap();
        store.append(&[record(200, c, "k")]).unwrap();
        for n in 0..100u64 {
            store
                .add_tombstone("orders", format!("k{n}").as_bytes(), 2)
                .unwrap();
        }
        store.add_tombstone("orders", b"k", 300).unwrap();
        assert_eq!(store.tombstones(), 101);
        store.remove_bucket(b, b + HOUR).unwrap();
        assert_eq!(
            store.tombstones(),
            1,
            "only bucket c (ids from 200) is left"
        );
        let lines = std::fs::read(&log)
            .unwrap()
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        assert_eq!(lines, 1, "the log was rewritten");
    }
    // A crash cut the last append short.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&log)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"route\":\"ord"))
        .unwrap();
    let mut store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(store.tombstones(), 1);
    assert_eq!(ids(&store.read_bucket(c, whole).unwrap().tombstoned), [200]);
    store.add_tombstone("orders", b"j", 301).unwrap();
    drop(store);
    let store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(
        store.tombstones(),
        2,
        "the torn line was cut before the next append"
    );
}

/// A checkpoint written before `tombstones.log` held its tombstones
/// itself: they are moved to the log, and still cancel.
#[test]
fn tombstones_an_older_checkpoint_held_move_to_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let b = 20 * HOUR;
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store
            .append(&[record(1, b, "k"), record(2, b, "j")])
            .unwrap();
    }
    let far = dir.path().join("far");
    let checkpoint = far.join(CHECKPOINT);
    let mut cp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    cp["tombstones"] = serde_json::json!([{"route": "orders", "key": [107], "before_id": 2}]);
    std::fs::write(&checkpoint, serde_json::to_vec(&cp).unwrap()).unwrap();
    std::fs::remove_file(far.join("tombstones.log")).unwrap();
    let mut store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(store.tombstones(), 1);
    store.append(&[record(3, b + 1, "x")]).unwrap(); // writes the checkpoint
    drop(store);
    let cp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    assert!(cp.get("tombstones").is_none(), "{cp}");
    let store = FarStore::open(config(dir.path()), 0).unwrap();
    assert_eq!(ids(&store.read_bucket(b, whole).unwrap().tombstoned), [1]);
}

/// A tier with no bucket left takes the frontier it is opened with when
/// that is earlier: a whole load (the switch to the broker-kept store)
/// moved it to the last bucket, and spills would wait until then.
#[test]
fn an_empty_tier_takes_the_earlier_frontier() {
    let dir = tempfile::tempdir().unwrap();
    let b = 1000 * HOUR;
    {
        let mut store = FarStore::open(config(dir.path()), 10 * HOUR).unwrap();
        store.append(&[record(1, b, "k")]).unwrap();
        store.remove_bucket(b, b + HOUR).unwrap();
        assert_eq!(store.frontier(), b + HOUR);
    }
    assert_eq!(
        FarStore::open(config(dir.path()), 20 * HOUR)
            .unwrap()
            .frontier(),
        20 * HOUR
    );
    // With a bucket on disk the frontier stays.
    {
        let mut store = FarStore::open(config(dir.path()), 20 * HOUR).unwrap();
        store.append(&[record(2, 30 * HOUR, "k")]).unwrap();
    }
    assert_eq!(
        FarStore::open(config(dir.path()), 10 * HOUR)
            .unwrap()
            .frontier(),
        20 * HOUR
    );
}

/// On a disk that fills up and frees again (`SimFs`).
mod full_disk {
    use super::*;
    use crate::wal::sim::SimFs;

    const DIR: &str = "/vol/wal";

    fn sim_config(fs: &SimFs) -> FarConfig {
        FarConfig {
            dir: PathBuf::from(DIR).join("far"),
            bucket_ms: HOUR,
            max_frame_len: 1 << 20,
            fs: Arc::new(fs.clone()),
        }
    }

    fn full(fs: &SimFs, on: bool) {
        fs.set_full(if on {
            vec![PathBuf::from(DIR)]
        } else {
            Vec::new()
        });
    }

    /// A spill into a new bucket fails on a full disk: the file it created
    /// goes, so the next spill can create it again (it failed with "file
    /// exists" for ever).
    #[test]
    fn a_failed_spill_into_a_new_bucket_leaves_no_file_behind() {
        let fs = SimFs::with_dir(DIR);
        let mut store = FarStore::open(sim_config(&fs), 10 * HOUR).unwrap();
        let b = 11 * HOUR;
        full(&fs, true);
        assert!(store.append(&[record(1, b + 1, "a")]).is_err());
        full(&fs, false);
        store.append(&[record(1, b + 1, "a")]).unwrap();
        let read = store.read_bucket(b, whole).unwrap();
        assert_eq!(ids(&read.live), [1]);
        assert_eq!(store.corrupt_frames(), 0);
    }

    /// A spill into an existing bucket fails half-way through its frames:
    /// they are cut off, and the frames written after space came back read
    /// cleanly (the stale half frame sat inside the next checkpointed
    /// length: corrupt frames, and the records behind it unreadable).
    #[test]
    fn a_failed_spill_into_an_existing_bucket_is_cut_back_and_its_seqs_not_reused() {
        let fs = SimFs::with_dir(DIR);
        let mut store = FarStore::open(sim_config(&fs), 10 * HOUR).unwrap();
        let b = 11 * HOUR;
        store.append(&[record(1, b + 1, "a")]).unwrap();
        full(&fs, true);
        assert!(store
            .append(&[record(2, b + 2, "b"), record(3, b + 3, "c")])
            .is_err());
        full(&fs, false);
        store
            .append(&[record(2, b + 2, "b"), record(3, b + 3, "c")])
            .unwrap();
        let read = store.read_bucket(b, whole).unwrap();
        assert_eq!(ids(&read.live), [1, 2, 3]);
        assert_eq!(store.corrupt_frames(), 0);
        // And so after reopening from the checkpoint.
        let fs = fs.power_loss(crate::wal::sim::PowerLoss::DropUnsynced);
        let store = FarStore::open(sim_config(&fs), 10 * HOUR).unwrap();
        let read = store.read_bucket(b, whole).unwrap();
        assert_eq!(ids(&read.live), [1, 2, 3]);
        assert_eq!(store.corrupt_frames(), 0);
    }

    /// A cut-back that itself fails (the file cannot be opened for
    /// writing, say) leaves stale bytes past the checkpointed length: the
    /// next append cuts them first, and numbers its frames past every seq
    /// handed out before, so no frame's seq ever goes backwards.
    #[test]
    fn stale_bytes_past_the_checkpoint_are_cut_before_the_next_append() {
        let fs = SimFs::with_dir(DIR);
        let mut store = FarStore::open(sim_config(&fs), 10 * HOUR).unwrap();
        let b = 11 * HOUR;
        store.append(&[record(1, b + 1, "a")]).unwrap();
        // A half frame past the checkpointed length, as a failed append
        // whose cut-back failed leaves it.
        let path = store.bucket_path(b);
        fs.append_on_disk(&path, &[0x55; 21]);
        store.append(&[record(2, b + 2, "b")]).unwrap();
        let read = store.read_bucket(b, whole).unwrap();
        assert_eq!(ids(&read.live), [1, 2]);
        assert_eq!(store.corrupt_frames(), 0);
    }
}
