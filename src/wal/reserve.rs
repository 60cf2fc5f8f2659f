//! Room kept on the WAL's volume for the writes that free space.
//!
//! A disk full of delayd's own messages must still be able to empty: a
//! fired message's Done, a new head segment (so that a dead one can go),
//! the far tier's checkpoint and a bucket's load all need a little space
//! themselves. So a ballast file, `reserve` in the WAL directory, holds
//! `wal.reserve_bytes` of the volume while new messages are taken in.
//!
//! - The first ENOSPC of any write removes it ([`Reserve::release`]); the
//!   writes that retire messages then use the room it leaves.
//! - It takes at most an eighth of the volume, so that a small volume (a
//!   test's tmpfs) is not all reserve.
//! - New messages ([`super::Wal::append_schedule`]), spills and
//!   compactions, which free space only once whole segments are dead,
//!   wait until the ballast is back ([`Reserve::restore`]); the writer
//!   never puts a new message or a compaction copy on its room. Making it again needs twice its size
//!   free, so the intake does not take back at once what the retiring
//!   writes have just freed.
//! - A spill also waits while the far checkpoint it would write is larger
//!   than the ballast ([`Reserve::size`]): every load rewrites that
//!   checkpoint, on a full disk in the ballast's room (a load's checkpoint
//!   write that meets ENOSPC releases the ballast and tries once more).
//!   A start makes the ballast at least as large as the checkpoint on
//!   disk ([`Reserve::keep_at_least`]): it was held to the ballast of its
//!   day, which a lower `wal.reserve_bytes` would not hold.
//! - While it is not held (released, or not made again since a start),
//!   the WAL's writer seals its head segment early, once, so that a head
//!   whose records all left (spilled, fired) can be deleted: a head is
//!   otherwise sealed only once it is full, which a full disk never lets
//!   it be. A start goes on in its last segment, so this covers that one
//!   too.
//! - A start removes the ballast a previous run left: its room is the
//!   start's (recovery's cut-backs, a new head segment).
//!
//! The ballast is written with bytes that do not compress, as a sparse or
//! compressed file would hold no room at all. It is never synced: a crash
//! loses nothing of value, since the next start removes it anyway.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::fs::FileSystem;
use super::WalError;

/// The ballast's name in the WAL directory.
pub const RESERVE_FILE: &str = "reserve";
const RESERVE_TMP: &str = "reserve.tmp";
/// The reserve takes at most 1/this of its volume.
const VOLUME_SHARE: u64 = 8;
/// Bytes written per call while making the ballast.
const CHUNK: usize = 64 << 10;

pub struct Reserve {
    dir: PathBuf,
    bytes: u64,
    fs: Arc<dyn FileSystem>,
    /// The ballast is on disk (always, when `bytes` is 0: no reserve).
    held: AtomicBool,
    /// The ballast's size when it was last made (`bytes`, or an eighth of
    /// a small volume); `bytes` until then.
    size: AtomicU64,
    /// The least size it is made at, whatever the volume's eighth and
    /// `bytes` (see [`Reserve::keep_at_least`]).
    floor: AtomicU64,
    /// Serialises releasing and making it.
    change: Mutex<()>,
}

impl std::fmt::Debug for Reserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserve")
            .field("bytes", &self.bytes)
            .field("held", &self.is_held())
            .finish()
    }
}

impl Reserve {
    /// At a start: remove what a previous run left (its room is the
    /// start's). `bytes` 0 keeps no reserve.
    pub fn open(fs: Arc<dyn FileSystem>, dir: &Path, bytes: u64) -> Result<Self, WalError> {
        let mut removed = false;
        for name in [RESERVE_FILE, RESERVE_TMP] {
            let path = dir.join(name);
            match fs.remove_file(&path) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(WalError::io(&path, e)),
            }
        }
        if removed {
            // Only the freed room matters, not whether the removal is durable.
            let _ = fs.sync_dir(dir);
        }
        let reserve = Self {
            dir: dir.to_path_buf(),
            bytes,
            fs,
            held: AtomicBool::new(bytes == 0),
            size: AtomicU64::new(bytes),
            floor: AtomicU64::new(0),
            change: Mutex::new(()),
        };
        reserve.publish();
        Ok(reserve)
    }

    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The room a release gives: the ballast's size (0: no reserve).
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Make the ballast at least `floor` bytes from now on (no effect
    /// when no reserve is kept). The far tier's checkpoint is rewritten by
    /// every load, on a full disk in the ballast's room, and a checkpoint
    /// written under a larger ballast (a larger volume, a larger
    /// `wal.reserve_bytes` before a restart) must still fit (sim seed
    /// 335474). A ballast held smaller is given up, to be made again at
    /// the new size.
    pub fn keep_at_least(&self, floor: u64) {
        if self.bytes == 0 {
            return;
        }
        let _change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        self.floor.store(floor, Ordering::Release);
        if floor <= self.size() {
            return;
        }
        if self.is_held() {
            let path = self.dir.join(RESERVE_FILE);
            if let Err(e) = self.fs.remove_file(&path) {
                tracing::error!(path = %path.display(), error = %e, "cannot remove the disk reserve to make it larger");
                return;
            }
            self.held.store(false, Ordering::Release);
            self.publish();
        }
        self.size.store(floor, Ordering::Release);
    }

    /// A write failed with ENOSPC: remove the ballast, if it is there, to
    /// give its room to the writes that free space. True if it was there
    /// (the failed write may try once more).
    pub fn release(&self) -> bool {
        let _change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        if self.bytes == 0 || !self.is_held() {
            return false;
        }
        let path = self.dir.join(RESERVE_FILE);
        match self.fs.remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot remove the disk reserve");
                return false;
            }
        }
        self.held.store(false, Ordering::Release);
        metrics::counter!("delayd_disk_reserve_released_total").increment(1);
        self.publish();
        tracing::warn!(
            "DISK FULL: the disk reserve ({}) is released to the writes that free space; \
             no new message is taken in until twice its size is free again",
            path.display()
        );
        true
    }

    /// Make the ballast again if twice its size is free. True once it is
    /// held (at once, if it was).
    pub fn restore(&self) -> Result<bool, WalError> {
        if self.is_held() {
            return Ok(true);
        }
        let _change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_held() {
            return Ok(true);
        }
        let space = self
            .fs
            .space(&self.dir)
            .map_err(|e| WalError::io(&self.dir, e))?;
        let eighth = self.bytes.min(space.total / VOLUME_SHARE);
        let bytes = eighth.max(self.floor.load(Ordering::Acquire));
        if bytes > self.bytes {
            tracing::warn!(
                bytes,
                configured = self.bytes,
                "the disk reserve is made larger than wal.reserve_bytes: the far tier's checkpoint needs that room to load on a full disk"
            );
        }
        if space.available < bytes.saturating_mul(2) {
            return Ok(false);
        }
        let tmp = self.dir.join(RESERVE_TMP);
        match self.write_ballast(&tmp, bytes) {
            Ok(()) => {}
            Err(e) => {
                let _ = self.fs.remove_file(&tmp);
                return match WalError::io(&tmp, e) {
                    // Taken by someone else since the count: not yet.
                    WalError::DiskFull(_) => Ok(false),
                    other => Err(other),
                };
            }
        }
        let path = self.dir.join(RESERVE_FILE);
        self.fs
            .rename(&tmp, &path)
            .map_err(|e| WalError::io(&path, e))?;
        self.size.store(bytes, Ordering::Release);
        self.held.store(true, Ordering::Release);
        self.publish();
        tracing::info!(
            bytes,
            "the disk reserve is back; new messages are taken in again"
        );
        Ok(true)
    }

    fn write_ballast(&self, tmp: &Path, bytes: u64) -> io::Result<()> {
        match self.fs.remove_file(tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let file = self.fs.create_new(tmp)?;
        let mut chunk = vec![0u8; CHUNK];
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ bytes;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            for word in chunk[..n].chunks_mut(8) {
                // xorshift: bytes no file system compresses away.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                word.copy_from_slice(&state.to_le_bytes()[..word.len()]);
            }
            file.append(&chunk[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    fn publish(&self) {
        metrics::gauge!("delayd_disk_reserve_held").set(if self.is_held() { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::sim::SimFs;

    fn sim() -> (SimFs, PathBuf) {
        let dir = PathBuf::from("/wal");
        (SimFs::with_dir(&dir), dir)
    }

    #[test]
    fn the_ballast_is_made_released_and_made_again_only_with_twice_its_room() {
        let (fs, dir) = sim();
        let reserve = Reserve::open(Arc::new(fs.clone()), &dir, 4096).unwrap();
        assert!(!reserve.is_held(), "made on first need, not at a start");
        assert!(reserve.restore().unwrap());
        assert_eq!(fs.read(&dir.join(RESERVE_FILE)).len(), 4096);
        assert!(reserve.release());
        assert!(!reserve.release(), "released once");
        assert!(fs.list(&dir).unwrap().is_empty());
        // A 64 KiB volume (an eighth is twice the ballast): 7 KiB free is
        // less than twice the ballast, 8 KiB is not.
        fs.set_capacity(Some(64 << 10));
        let filler = dir.join("filler");
        fs.create_new(&filler)
            .unwrap()
            .append(&[0; 57 << 10])
            .unwrap();
        assert!(!reserve.restore().unwrap());
        fs.open_write(&filler).unwrap().set_len(56 << 10).unwrap();
        assert!(reserve.restore().unwrap());
        assert_eq!(fs.read(&dir.join(RESERVE_FILE)).len(), 4096);
    }

    #[test]
    fn the_ballast_takes_at_most_an_eighth_of_the_volume() {
        let (fs, dir) = sim();
        fs.set_capacity(Some(16 << 10));
        let reserve = Reserve::open(Arc::new(fs.clone()), &dir, 1 << 20).unwrap();
        assert!(reserve.restore().unwrap());
        assert_eq!(fs.read(&dir.join(RESERVE_FILE)).len(), 2 << 10);
        assert_eq!(reserve.size(), 2 << 10);
    }

    #[test]
    fn a_floor_makes_the_ballast_larger_than_the_volumes_eighth() {
        let (fs, dir) = sim();
        fs.set_capacity(Some(16 << 10));
        let reserve = Reserve::open(Arc::new(fs.clone()), &dir, 1 << 10).unwrap();
        assert!(reserve.restore().unwrap());
        assert_eq!(reserve.size(), 1 << 10);
        // Held smaller than the floor: given up, and made again at it.
        reserve.keep_at_least(3 << 10);
        assert!(!reserve.is_held());
        assert!(fs.list(&dir).unwrap().is_empty());
        assert_eq!(reserve.size(), 3 << 10, "the room a release would give");
        assert!(reserve.restore().unwrap());
        assert_eq!(fs.read(&dir.join(RESERVE_FILE)).len(), 3 << 10);
        // A lower floor changes nothing held.
        reserve.keep_at_least(1);
        assert!(reserve.is_held());
        assert_eq!(reserve.size(), 3 << 10);
    }

    #[test]
    fn a_start_removes_the_ballast_a_previous_run_left() {
        let (fs, dir) = sim();
        let first = Reserve::open(Arc::new(fs.clone()), &dir, 4096).unwrap();
        assert!(first.restore().unwrap());
        let second = Reserve::open(Arc::new(fs.clone()), &dir, 4096).unwrap();
        assert!(!second.is_held());
        assert!(fs.list(&dir).unwrap().is_empty());
    }

    #[test]
    fn no_reserve_is_always_held() {
        let (fs, dir) = sim();
        let reserve = Reserve::open(Arc::new(fs.clone()), &dir, 0).unwrap();
        assert!(reserve.is_held());
        assert!(!reserve.release());
        assert!(reserve.restore().unwrap());
        assert!(fs.list(&dir).unwrap().is_empty());
    }
}
