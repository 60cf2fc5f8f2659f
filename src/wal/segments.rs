//! The in-memory table of segments: files, live counts and the rules for
//! deleting and compacting them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::frame::Salt;
use super::fs::{FileSystem, WalFile};
use super::WalError;

pub fn segment_name(first_seq: u64) -> String {
    format!("wal-{first_seq:020}.log")
}

pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// fsync a directory so that creates and deletes in it are durable.
pub fn sync_dir(fs: &dyn FileSystem, dir: &Path) -> Result<(), WalError> {
    fs.sync_dir(dir).map_err(|source| WalError::Fatal {
        op: "directory fsync",
        path: dir.to_path_buf(),
        source,
    })
}

struct Segment {
    first_seq: u64,
    /// One past the last seq written here: the next segment's first seq,
    /// or what a start's scan read (`u64::MAX` while it is the head).
    end_seq: u64,
    path: PathBuf,
    file: Arc<dyn WalFile>,
    salt: Salt,
    bytes: u64,
    schedules: u64,
    live: u64,
    /// The latest due time of the Schedules written here (0: none).
    latest_due_ms: u64,
    /// first_seq of other segments holding Schedules that this one's Dones retire.
    refs: BTreeSet<u64>,
    /// Acked marks here whose record a restart reads back from a compaction
    /// copy in another segment: (marked id, that segment's ordinal). The
    /// mark's seq names only the record's first segment, so compaction
    /// looks here to move the mark on while the copy stands, fired or not.
    copy_marks: Vec<(u64, u32)>,
    sealed: bool,
    /// Schedules here counted dead by a Done not yet written (a cancel's):
    /// the segment stays until each Done is durable, or has failed and its
    /// Schedule is live again (see [`SegmentTable::hold_retiring`]).
    retiring: u32,
}

#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SpaceReport {
    pub segments: usize,
    pub bytes: u64,
    /// Estimated bytes of live Schedule records (by each segment's live fraction).
    pub live_bytes: u64,
    pub live_records: u64,
}

#[derive(Default)]
pub struct SegmentTable {
    segments: BTreeMap<u32, Segment>,
    by_first_seq: BTreeMap<u64, u32>,
    next_ordinal: u32,
}

/// A segment every one of whose messages was due in the last minute or is
/// due in the next empties by itself as they fire: compacting it copies
/// records that leave a moment later. A burst's release used to copy half
/// the burst that way (two compactions moved 103k of 200k records). One
/// overdue for longer may be held up (its target down), so it is compacted
/// as any other.
pub const DRAINS_WITHIN_MS: u64 = 60_000;

impl SegmentTable {
    pub fn add(
        &mut self,
        first_seq: u64,
        path: PathBuf,
        file: Arc<dyn WalFile>,
        bytes: u64,
        salt: Salt,
    ) -> u32 {
        let ordinal = self.next_ordinal;
        self.next_ordinal += 1;
        // The segment before it ends where it begins, unless a start's
        // scan knew its end.
        if let Some((_, before)) = self.by_first_seq.range(..first_seq).next_back() {
            if let Some(s) = self.segments.get_mut(before) {
                s.end_seq = s.end_seq.min(first_seq);
            }
        }
        self.by_first_seq.insert(first_seq, ordinal);
        self.segments.insert(
            ordinal,
            Segment {
                first_seq,
                end_seq: u64::MAX,
                path,
                file,
                salt,
                bytes,
                schedules: 0,
                live: 0,
                latest_due_ms: 0,
                refs: BTreeSet::new(),
                copy_marks: Vec::new(),
                sealed: false,
                retiring: 0,
            },
        );
        ordinal
    }

    pub fn seal(&mut self, ordinal: u32) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.sealed = true;
        }
    }

    /// The writer took a sealed segment back as its head (at a start).
    pub fn unseal(&mut self, ordinal: u32) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.sealed = false;
        }
    }

    /// A segment's size as far as the log has written it.
    pub fn bytes(&self, ordinal: u32) -> Option<u64> {
        self.segments.get(&ordinal).map(|s| s.bytes)
    }

    pub fn seal_all(&mut self) {
        for s in self.segments.values_mut() {
            s.sealed = true;
        }
    }

    pub fn set_bytes(&mut self, ordinal: u32, bytes: u64) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.bytes = bytes;
        }
    }

    /// A Schedule frame due at `due_ms` landed in `ordinal` and is live.
    pub fn record_schedule(&mut self, ordinal: u32, due_ms: u64) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.schedules += 1;
            s.live += 1;
            s.latest_due_ms = s.latest_due_ms.max(due_ms);
        }
    }

    /// A Done frame landed in `ordinal`, retiring a Schedule in segment `target`.
    pub fn record_done(&mut self, ordinal: u32, target_first_seq: u64) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            if s.first_seq != target_first_seq {
                s.refs.insert(target_first_seq);
            }
        }
    }

    /// An Acked mark for the record with seq `marked` landed in `ordinal`:
    /// it outlives the segment a restart reads that record back from,
    /// `keeps` if the writer of the mark knew it (a compaction copy's
    /// segment), else the one its Schedule was first written to (the one its
    /// seq falls in), while that stays. Lost before, the mark left the
    /// Schedule to a restart as a record in doubt, which took a twin
    /// published after a cancel for its redelivery (sim seed 427,654). A
    /// mark with flag bits is past every seq, and one in the Schedule's own
    /// segment needs nothing.
    pub fn record_mark(&mut self, ordinal: u32, marked: u64, keeps: Option<u32>) {
        let Some(own) = self.segments.get(&ordinal).map(|s| s.first_seq) else {
            return;
        };
        if let Some(kept) = keeps {
            self.keep_mark(ordinal, marked, kept);
            return;
        }
        if marked >= own {
            return;
        }
        if let Some(target) = self.covering(marked) {
            self.record_done(ordinal, target);
        }
    }

    /// Segment `mark` holds an Acked mark for record `marked`, which a
    /// restart reads back from segment `record`: `mark` may not be deleted
    /// before it. If that is a compaction copy's segment (its first seq
    /// after the record's seq), the pair is kept for
    /// [`Self::copy_mark_home`]; a mark with flag bits (past every seq) is
    /// moved by what the engine remembers, not by this.
    pub fn keep_mark(&mut self, mark: u32, marked: u64, record: u32) {
        let Some(target) = self.first_seq(record) else {
            return;
        };
        self.record_done(mark, target);
        if mark != record && target > marked {
            if let Some(s) = self.segments.get_mut(&mark) {
                s.copy_marks.push((marked, record));
            }
        }
    }

    /// The segment, still on disk and other than `mark`, that a restart
    /// reads the compaction copy of the record marked `marked` in segment
    /// `mark` back from, if a pair was kept ([`Self::keep_mark`]).
    pub fn copy_mark_home(&self, mark: u32, marked: u64) -> Option<u32> {
        let s = self.segments.get(&mark)?;
        s.copy_marks
            .iter()
            .rev()
            .find(|&&(id, record)| id == marked && record != mark)
            .map(|&(_, record)| record)
            .filter(|record| self.segments.contains_key(record))
    }

    /// The first seq of the segment that seq `seq` was written to, if it
    /// is still on disk. Until 2026-12-07 the newest older segment stood in
    /// for a gone one (no segment's end was kept): a segment of messages
    /// due in two days then held every ack mark compaction moved on since,
    /// and the segments the moved marks were written to.
    pub fn covering(&self, seq: u64) -> Option<u64> {
        let (&first, ordinal) = self.by_first_seq.range(..=seq).next_back()?;
        let end = self.segments.get(ordinal).map_or(u64::MAX, |s| s.end_seq);
        (seq < end).then_some(first)
    }

    /// A start read segment `ordinal` through: its frames end before
    /// `end`.
    pub fn set_end_seq(&mut self, ordinal: u32, end: u64) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.end_seq = s.end_seq.min(end);
        }
    }

    /// `copy` may not be deleted before `original`, nor before any segment
    /// `original` must outlive (when `original` was itself a copy's home
    /// and is being compacted away, its constraints move on to `copy`).
    pub fn keep_after(&mut self, copy: u32, original: u32) {
        if copy == original {
            return;
        }
        let Some(source) = self.segments.get(&original) else {
            return;
        };
        let mut refs = source.refs.clone();
        refs.insert(source.first_seq);
        if let Some(s) = self.segments.get_mut(&copy) {
            refs.remove(&s.first_seq);
            s.refs.extend(refs);
        }
    }

    pub fn mark_dead(&mut self, ordinal: u32) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.live = s.live.saturating_sub(1);
        }
    }

    /// Count a Schedule in `ordinal` dead ahead of the Done that retires
    /// it, and keep the segment (from garbage collection and compaction)
    /// until [`SegmentTable::release_retiring`]: if the Done fails, the
    /// Schedule is live again and must still be there.
    pub fn hold_retiring(&mut self, ordinal: u32) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.live = s.live.saturating_sub(1);
            s.retiring += 1;
        }
    }

    /// The Done of a [`SegmentTable::hold_retiring`] was written
    /// (`written`), or failed: its Schedule is live again.
    pub fn release_retiring(&mut self, ordinal: u32, written: bool) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.retiring = s.retiring.saturating_sub(1);
            if !written {
                s.live += 1;
            }
        }
    }

    /// Whether a Done held by [`SegmentTable::hold_retiring`] is on its
    /// way for a Schedule in `ordinal`.
    pub fn is_retiring(&self, ordinal: u32) -> bool {
        self.segments.get(&ordinal).is_some_and(|s| s.retiring > 0)
    }

    /// Live Schedules in `ordinal`: written and not yet retired by a Done.
    pub fn live(&self, ordinal: u32) -> u64 {
        self.segments.get(&ordinal).map_or(0, |s| s.live)
    }

    pub fn clear_live(&mut self) {
        for s in self.segments.values_mut() {
            s.live = 0;
        }
    }

    pub fn add_live(&mut self, ordinal: u32) {
        if let Some(s) = self.segments.get_mut(&ordinal) {
            s.live += 1;
        }
    }

    pub fn first_seq(&self, ordinal: u32) -> Option<u64> {
        self.segments.get(&ordinal).map(|s| s.first_seq)
    }

    pub fn ordinal_of(&self, first_seq: u64) -> Option<u32> {
        self.by_first_seq.get(&first_seq).copied()
    }

    /// A segment's file, path and CRC salt, for reading frames.
    pub fn file(&self, ordinal: u32) -> Option<(Arc<dyn WalFile>, PathBuf, Salt)> {
        self.segments
            .get(&ordinal)
            .map(|s| (s.file.clone(), s.path.clone(), s.salt))
    }

    /// Sealed segments with no live Schedule whose Dones are no longer needed.
    pub fn deletable(&self) -> Vec<u32> {
        self.deletable_keeping(&[])
    }

    /// [`SegmentTable::deletable`] with the segments `keep` kept: a segment
    /// that must outlive one of them is kept too (its Dones may be all that
    /// retires a Schedule there).
    pub fn deletable_keeping(&self, keep: &[u32]) -> Vec<u32> {
        self.deletable_among(None, keep)
    }

    /// [`SegmentTable::deletable_keeping`], of the segments `offered` only
    /// (those the caller prepared for deletion); any other is kept.
    pub fn deletable_among(&self, offered: Option<&[u32]>, keep: &[u32]) -> Vec<u32> {
        let kept = |ordinal: &u32| {
            keep.contains(ordinal) || offered.is_some_and(|offered| !offered.contains(ordinal))
        };
        // Deleting one segment can free another (its refs), so iterate to a fixpoint.
        let mut gone: BTreeSet<u64> = BTreeSet::new();
        let mut out = Vec::new();
        loop {
            let before = out.len();
            for (&ordinal, s) in &self.segments {
                if !s.sealed
                    || s.live > 0
                    || s.retiring > 0
                    || gone.contains(&s.first_seq)
                    || kept(&ordinal)
                {
                    continue;
                }
                let refs_ok = s
                    .refs
                    .iter()
                    .all(|r| gone.contains(r) || !self.by_first_seq.contains_key(r));
                if refs_ok {
                    gone.insert(s.first_seq);
                    out.push(ordinal);
                }
            }
            if out.len() == before {
                return out;
            }
        }
    }

    /// The sealed segment with live records whose live fraction is lowest and
    /// under `threshold`, leaving out those that empty by themselves around
    /// `now_ms` (see [`DRAINS_WITHIN_MS`]).
    pub fn compaction_candidate(&self, threshold: f64, now_ms: u64) -> Option<u32> {
        self.segments
            .iter()
            .filter(|(_, s)| s.sealed && s.live > 0 && s.schedules > 0 && s.retiring == 0)
            .filter(|(_, s)| s.latest_due_ms.abs_diff(now_ms) > DRAINS_WITHIN_MS)
            .map(|(&o, s)| (o, s.live as f64 / s.schedules as f64))
            .filter(|&(_, frac)| frac < threshold)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(o, _)| o)
    }

    /// Drop `ordinal` from the table. A segment that had to outlive it
    /// (its Dones named a Schedule there) now has to outlive what it had
    /// to: those Dones may retire other copies of the same Schedules,
    /// which still lie in the segments the removed one was kept after.
    pub fn remove(&mut self, ordinal: u32) -> Option<PathBuf> {
        let s = self.segments.remove(&ordinal)?;
        self.by_first_seq.remove(&s.first_seq);
        let inherited: Vec<u64> = s
            .refs
            .iter()
            .copied()
            .filter(|r| self.by_first_seq.contains_key(r))
            .collect();
        if !inherited.is_empty() {
            for other in self.segments.values_mut() {
                if other.refs.contains(&s.first_seq) {
                    other.refs.extend(inherited.iter().copied());
                }
            }
        }
        Some(s.path)
    }

    /// Whether `ordinal` must outlive a segment that still exists.
    pub fn outlives_existing(&self, ordinal: u32) -> bool {
        self.segments.get(&ordinal).is_some_and(|s| {
            s.refs
                .iter()
                .any(|r| *r != s.first_seq && self.by_first_seq.contains_key(r))
        })
    }

    pub fn space(&self) -> SpaceReport {
        let mut r = SpaceReport {
            segments: self.segments.len(),
            ..SpaceReport::default()
        };
        for s in self.segments.values() {
            r.bytes += s.bytes;
            r.live_records += s.live;
            if s.schedules > 0 {
                r.live_bytes += (s.bytes as f64 * s.live as f64 / s.schedules as f64) as u64;
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(n: u64) -> (SegmentTable, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut t = SegmentTable::default();
        for i in 0..n {
            let path = dir.path().join(segment_name(i * 100 + 1));
            let file = Arc::new(std::fs::File::create(&path).unwrap());
            t.add(i * 100 + 1, path, file, 1000, Salt::UNSALTED);
        }
        (t, dir)
    }

    #[test]
    fn a_seq_is_covered_only_by_the_segment_it_was_written_to() {
        // Segments first at seqs 1, 101, 201, 301.
        let (mut t, _dir) = table_with(4);
        assert_eq!(t.covering(150), Some(101));
        assert_eq!(t.covering(350), Some(301), "the head has no end");
        t.remove(1);
        assert_eq!(t.covering(150), None, "its segment is gone");
        assert_eq!(t.covering(50), Some(1));
        // A start's scan knows where a segment ended, whatever follows it.
        t.set_end_seq(0, 60);
        assert_eq!(t.covering(70), None);
    }

    #[test]
    fn a_mark_knows_its_records_copy_while_the_copy_stands() {
        // Segments first at seqs 1, 101, 201: record 50 was written to the
        // first and copied to the second; its mark is in the third.
        let (mut t, _dir) = table_with(3);
        t.record_mark(2, 50, Some(1));
        assert_eq!(t.copy_mark_home(2, 50), Some(1));
        assert_eq!(t.copy_mark_home(2, 51), None);
        // Read back from its first segment, a record needs no pair: its seq
        // names that segment.
        t.keep_mark(2, 60, 0);
        assert_eq!(t.copy_mark_home(2, 60), None);
        // A flagged mark is past every seq: moved by what the engine
        // remembers, not by this.
        t.keep_mark(2, 50 | 1 << 61, 1);
        assert_eq!(t.copy_mark_home(2, 50 | 1 << 61), None);
        t.remove(1);
        assert_eq!(t.copy_mark_home(2, 50), None, "the copy is gone");
    }

    #[test]
    fn names_round_trip() {
        assert_eq!(parse_segment_name(&segment_name(42)), Some(42));
        assert_eq!(parse_segment_name("wal-42.log"), None);
        assert_eq!(parse_segment_name("other"), None);
    }

    #[test]
    fn dead_segment_waits_for_the_schedules_its_dones_retire() {
        let (mut t, _dir) = table_with(3);
        t.seal(0);
        t.seal(1);
        t.record_schedule(0, 0); // live message in segment 0
        t.record_schedule(0, 0);
        t.mark_dead(0); // one of them done, Done written in segment 1
        t.record_done(1, 1);
        assert_eq!(t.deletable(), Vec::<u32>::new());
        t.mark_dead(0);
        // Both segments free now: 0 has nothing live, 1's Done target goes too.
        let mut d = t.deletable();
        d.sort();
        assert_eq!(d, vec![0, 1]);
    }

    #[test]
    fn a_segment_whose_dones_retire_schedules_in_a_kept_one_is_kept_too() {
        // Sim seed 5: segment 0 kept back for its Remembered frames, and
        // segment 1, whose Done alone retired a cancelled message's
        // Schedule there, deleted: the message came back and fired.
        let (mut t, _dir) = table_with(3);
        t.seal(0);
        t.seal(1);
        t.record_schedule(0, 0);
        t.mark_dead(0);
        t.record_done(1, 1);
        assert_eq!(t.deletable_keeping(&[0]), Vec::<u32>::new());
        assert_eq!(t.deletable_keeping(&[1]), vec![0]);
    }

    #[test]
    fn a_copy_outlives_its_original_also_when_compacted_again() {
        let (mut t, _dir) = table_with(3);
        t.seal_all();
        t.record_schedule(0, 0); // a message that keeps the original alive
                                 // 1 holds a copy of a message whose original 0 still holds; the copy
                                 // is compacted again into 2, and 1 removed.
        t.keep_after(1, 0);
        t.keep_after(2, 1);
        t.remove(1);
        assert_eq!(t.deletable(), Vec::<u32>::new(), "2 went before 0");
        t.mark_dead(0);
        let mut d = t.deletable();
        d.sort();
        assert_eq!(d, vec![0, 2]);
    }

    #[test]
    fn a_segment_whose_dones_named_a_removed_copy_outlives_the_original() {
        // Sim seed 413: 0 holds a Schedule's original, 1 its compaction
        // copy (kept after 0); a Done in 2 names 1; 1 is compacted away.
        let (mut t, _dir) = table_with(3);
        t.seal_all();
        t.record_schedule(0, 0); // something else keeps 0 alive
        t.keep_after(1, 0);
        t.record_done(2, 101);
        assert!(t.outlives_existing(2));
        t.remove(1);
        assert!(
            t.outlives_existing(2),
            "2's Done now retires the original in 0"
        );
        assert_eq!(t.deletable(), Vec::<u32>::new(), "2 went before 0");
        t.mark_dead(0);
        let mut d = t.deletable();
        d.sort();
        assert_eq!(d, vec![0, 2]);
    }

    #[test]
    fn head_is_never_deletable() {
        let (t, _dir) = table_with(1);
        assert!(t.deletable().is_empty());
    }

    #[test]
    fn a_segment_whose_schedule_is_being_retired_stays_until_the_done_settles() {
        let (mut t, _dir) = table_with(2);
        t.seal_all();
        for _ in 0..4 {
            t.record_schedule(0, 0);
        }
        for _ in 0..3 {
            t.mark_dead(0);
        }
        // The last one's Done is on its way: neither collected nor compacted.
        t.hold_retiring(0);
        assert_eq!(t.live(0), 0);
        assert!(!t.deletable().contains(&0));
        assert_eq!(t.compaction_candidate(0.5, DRAINS_WITHIN_MS + 1), None);
        // It failed: the Schedule is live again.
        t.release_retiring(0, false);
        assert_eq!(t.live(0), 1);
        assert!(!t.deletable().contains(&0));
        // Retired again, and written this time: the segment can go.
        t.hold_retiring(0);
        t.release_retiring(0, true);
        assert!(t.deletable().contains(&0));
    }

    #[test]
    fn sparse_segment_is_a_compaction_candidate() {
        let (mut t, _dir) = table_with(3);
        t.seal_all();
        for _ in 0..10 {
            t.record_schedule(0, 0);
            t.record_schedule(1, 0);
        }
        for _ in 0..9 {
            t.mark_dead(0);
        }
        for _ in 0..4 {
            t.mark_dead(1);
        }
        // Due at 0, so long overdue at `LATER`: held up, compacted.
        const LATER: u64 = DRAINS_WITHIN_MS + 1;
        assert_eq!(t.compaction_candidate(0.5, LATER), Some(0));
        assert_eq!(t.compaction_candidate(0.05, LATER), None);
    }

    #[test]
    fn a_sparse_segment_that_empties_by_itself_is_left_alone() {
        let (mut t, _dir) = table_with(2);
        t.seal_all();
        let due = 1_000_000;
        for _ in 0..10 {
            t.record_schedule(0, due);
        }
        for _ in 0..9 {
            t.mark_dead(0);
        }
        // Its last message due within a minute either side: it fires soon.
        for now in [due - DRAINS_WITHIN_MS, due, due + DRAINS_WITHIN_MS] {
            assert_eq!(t.compaction_candidate(0.5, now), None, "at {now}");
        }
        // Due later than that, or overdue longer (held up): compacted.
        for now in [due - DRAINS_WITHIN_MS - 1, due + DRAINS_WITHIN_MS + 1] {
            assert_eq!(t.compaction_candidate(0.5, now), Some(0), "at {now}");
        }
        // One message due in a day keeps the segment a candidate.
        t.record_schedule(0, due + 86_400_000);
        assert_eq!(t.compaction_candidate(0.5, due), Some(0));
    }
}
