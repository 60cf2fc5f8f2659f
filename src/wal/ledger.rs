//! The Remembered frames the log owes, kept where a full disk cannot
//! refuse them.
//!
//! Before a segment goes, redelivery detection writes a Remembered frame
//! for each record there whose ack is in doubt (see `engine::dedup`). On a
//! disk that refuses every write, with the disk reserve out, the segment
//! must go all the same (a full disk must still empty: sim seed 420), and
//! its frames are owed until there is room. Kept in memory only, a crash
//! before then forgot them: a cancelled message's late redelivery was
//! stored as new and fired after its cancel was answered (sim seeds
//! 400,004, 400,260 and 401,035).
//!
//! So the owed frames are written here first: `owed-frames` in the WAL
//! directory, a file of fixed size made at the start (like the reserve's
//! ballast) and only ever overwritten in place, which needs no new blocks.
//! It has two halves; each write goes to the one not holding the newest
//! valid copy, with a generation and a CRC, so a write cut by a power loss
//! leaves the previous copy readable. A start reads the newest valid half
//! back, before the log (see [`read_owed`]).
//!
//! It holds `wal.owed_frames` frames ([`DEFAULT_FRAMES`], 32 KiB on
//! disk). More owed at once are kept in memory only, with a warning: a
//! restart then takes a late redelivery of such a message for a new one.

use std::io;
use std::path::{Path, PathBuf};

use super::frame::Remembered;
use super::fs::{FileSystem, WalFile};
use super::WalError;

/// The ledger's name in the WAL directory.
pub const LEDGER_FILE: &str = "owed-frames";
const LEDGER_TMP: &str = "owed-frames.tmp";
/// Frames it holds unless configured otherwise: a full disk's owed frames
/// are the records whose ack is in doubt in the going segments, a few
/// hundred at most after a restart.
pub const DEFAULT_FRAMES: usize = 250;
const MAGIC: &[u8; 8] = b"DELAYDOF";
/// Magic, CRC, generation, count.
const HEADER: usize = 8 + 4 + 8 + 4;

/// Bytes of each half, for `frames` frames.
fn half_bytes(frames: usize) -> usize {
    HEADER + frames * Remembered::BYTES
}

/// The open ledger, and what it holds now.
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    file: Box<dyn WalFile>,
    /// Frames a half holds.
    capacity: usize,
    /// The newest valid half's generation (0: none yet).
    generation: u64,
    /// What that half holds.
    frames: Vec<Remembered>,
}

/// What a start reads back: the newest valid half's frames (none if there
/// is no ledger). Read before the log is replayed, so that the replay can
/// apply later marks to them.
pub fn read_owed(fs: &dyn FileSystem, dir: &Path) -> Result<Vec<Remembered>, WalError> {
    let path = dir.join(LEDGER_FILE);
    let file = match fs.open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(WalError::io(&path, e)),
    };
    Ok(newest(&*file, &path)?.map(|(_, f)| f).unwrap_or_default())
}

/// The newest valid half: its generation and frames. The halves split the
/// file in two, whatever size it was made at.
fn newest(file: &dyn WalFile, path: &Path) -> Result<Option<(u64, Vec<Remembered>)>, WalError> {
    let size = file.size().map_err(|e| WalError::io(path, e))?;
    let mut bytes = vec![0u8; size as usize];
    let mut read = 0;
    while read < bytes.len() {
        let n = file
            .read_at(&mut bytes[read..], read as u64)
            .map_err(|e| WalError::io(path, e))?;
        if n == 0 {
            break;
        }
        read += n;
    }
    let half = (read / 2).max(1);
    Ok(bytes[..read]
        .chunks(half)
        .filter_map(decode_half)
        .max_by_key(|(generation, _)| *generation))
}

fn decode_half(half: &[u8]) -> Option<(u64, Vec<Remembered>)> {
    if half.len() < HEADER || &half[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(half[8..12].try_into().ok()?);
    let generation = u64::from_le_bytes(half[12..20].try_into().ok()?);
    let count = u32::from_le_bytes(half[20..24].try_into().ok()?) as usize;
    let end = HEADER.checked_add(count.checked_mul(Remembered::BYTES)?)?;
    if half.len() < end || crc32c::crc32c(&half[12..end]) != crc {
        return None;
    }
    let frames = half[HEADER..end]
        .chunks(Remembered::BYTES)
        .map(Remembered::decode)
        .collect::<Option<Vec<_>>>()?;
    Some((generation, frames))
}

fn encode_half(generation: u64, frames: &[Remembered]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + frames.len() * Remembered::BYTES);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&(frames.len() as u32).to_le_bytes());
    for frame in frames {
        frame.encode(&mut out);
    }
    let crc = crc32c::crc32c(&out[12..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    out
}

impl Ledger {
    /// Open the ledger in `dir` to hold `capacity` frames, making it if
    /// there is none or it was made for another capacity. What it held is
    /// carried into the new one, all of it: a smaller one is made large
    /// enough for what it holds (cut to the new size, a crash before those
    /// frames were written to the log forgot them: sim seed 449,977), and
    /// made again at `capacity` by a start once they are. Called with the
    /// directory locked; on a full disk the making fails, and the caller
    /// goes on without one.
    pub fn open(fs: &dyn FileSystem, dir: &Path, capacity: usize) -> Result<Ledger, WalError> {
        // A make cut short by a crash: never the ledger (only a rename
        // makes that), and left alone it held its room for good.
        let tmp = dir.join(LEDGER_TMP);
        match fs.remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(WalError::io(&tmp, e)),
        }
        let path = dir.join(LEDGER_FILE);
        let (mut generation, frames, made) = match fs.open(&path) {
            Ok(file) => {
                let (generation, frames) = newest(&*file, &path)?.unwrap_or_default();
                let made = file.size().map_err(|e| WalError::io(&path, e))?;
                (generation, frames, Some(made))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (0, Vec::new(), None),
            Err(e) => return Err(WalError::io(&path, e)),
        };
        let capacity = capacity.max(frames.len());
        if made != Some(2 * half_bytes(capacity) as u64) {
            generation += 1;
            make(fs, dir, &path, capacity, generation, &frames)?;
        }
        let file = fs.open_write(&path).map_err(|e| WalError::io(&path, e))?;
        Ok(Ledger {
            path,
            file,
            capacity,
            generation,
            frames,
        })
    }

    /// What it holds now.
    pub fn frames(&self) -> &[Remembered] {
        &self.frames
    }

    /// Make it hold `frames` (as many of them as it can, the first),
    /// durably, before returning; returns how many it holds. Nothing is
    /// written if it holds them already. A failed sync is fatal, as the
    /// log's are: the kernel may have dropped the pages it could not write.
    pub fn hold(&mut self, frames: &[Remembered]) -> Result<usize, WalError> {
        let kept = &frames[..frames.len().min(self.capacity)];
        if kept == self.frames.as_slice() {
            return Ok(kept.len());
        }
        let generation = self.generation + 1;
        let offset = (generation % 2) * half_bytes(self.capacity) as u64;
        let bytes = encode_half(generation, kept);
        let path = &self.path;
        // ENOSPC (a copy-on-write file system takes new blocks even here)
        // is `DiskFull`.
        self.file
            .write_at(&bytes, offset)
            .map_err(|e| WalError::io(path, e))?;
        self.file.sync_data().map_err(|source| WalError::Fatal {
            op: "fsync",
            path: path.clone(),
            source,
        })?;
        self.generation = generation;
        self.frames = kept.to_vec();
        Ok(kept.len())
    }
}

/// Write the file, `frames` in the half `generation` picks and zeros in
/// the other, under a temporary name, sync it, and name it: a power loss
/// leaves the ledger as it was or the whole new one.
fn make(
    fs: &dyn FileSystem,
    dir: &Path,
    path: &Path,
    capacity: usize,
    generation: u64,
    frames: &[Remembered],
) -> Result<(), WalError> {
    let half = half_bytes(capacity);
    let mut bytes = vec![0u8; 2 * half];
    let at = (generation % 2) as usize * half;
    let encoded = encode_half(generation, frames);
    bytes[at..at + encoded.len()].copy_from_slice(&encoded);
    let tmp = dir.join(LEDGER_TMP);
    match fs.remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(WalError::io(&tmp, e)),
    }
    // A failed sync is fatal, as anywhere in the log.
    let fatal = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| WalError::Fatal { op, path, source }
    };
    let written = (|| {
        let file = fs.create_new(&tmp).map_err(|e| WalError::io(&tmp, e))?;
        file.append(&bytes).map_err(|e| match e.raw_os_error() {
            Some(28) => WalError::DiskFull(dir.to_path_buf()),
            _ => WalError::io(&tmp, e),
        })?;
        file.sync_data().map_err(fatal("fsync", &tmp))?;
        fs.rename(&tmp, path).map_err(|e| WalError::io(&tmp, e))?;
        fs.sync_dir(dir).map_err(fatal("directory fsync", dir))
    })();
    if written.is_err() {
        let _ = fs.remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::sim::{PowerLoss, SimFs};

    const DIR: &str = "/vol/wal";

    fn frame(id: u64, flags: u8) -> Remembered {
        Remembered {
            id,
            uid: u128::from(id) << 64 | 7,
            fp: id * 31,
            digest: [id as u8; 32],
            flags,
        }
    }

    #[test]
    fn what_it_holds_is_read_back_after_a_power_loss() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        assert!(read_owed(&fs, dir).unwrap().is_empty(), "no ledger yet");
        let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        assert_eq!(ledger.hold(&[frame(1, 0), frame(2, 1)]).unwrap(), 2);
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(read_owed(&fs, dir).unwrap(), vec![frame(1, 0), frame(2, 1)]);
        let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        assert_eq!(ledger.frames(), &[frame(1, 0), frame(2, 1)]);
        ledger.hold(&[frame(2, 3)]).unwrap();
        ledger.hold(&[]).unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert!(read_owed(&fs, dir).unwrap().is_empty());
    }

    /// A crash while a start made the ledger left its temporary file; a
    /// later start that finds the ledger made at its size did not make it
    /// again, and the file stayed for good (sim seed 616,036: 8,845 bytes
    /// of a 10,373-byte disk that filled up, and a far load never fit).
    #[test]
    fn a_start_removes_a_make_cut_short() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        drop(Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap());
        let tmp = dir.join(LEDGER_TMP);
        fs.create_new(&tmp).unwrap().append(&[0; 4096]).unwrap();
        let ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        assert!(ledger.frames().is_empty());
        let left: Vec<_> = fs.list(dir).unwrap();
        assert!(!left.contains(&tmp), "{left:?}");
    }

    #[test]
    fn a_full_disk_does_not_refuse_it() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        fs.set_full(vec![dir.to_path_buf()]);
        fs.set_capacity(Some(fs.used_bytes()));
        assert_eq!(ledger.hold(&[frame(9, 1)]).unwrap(), 1);
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(read_owed(&fs, dir).unwrap(), vec![frame(9, 1)]);
    }

    /// On a copy-on-write file system an overwrite takes new blocks: a
    /// full disk refuses it, as disk full (the caller then lets the
    /// segments go with their frames owed in memory, as a full disk must
    /// still empty), and the copy before it stays.
    #[test]
    fn a_full_copy_on_write_disk_refuses_it_as_disk_full() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        fs.set_copy_on_write(true);
        let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        ledger.hold(&[frame(1, 0)]).unwrap();
        fs.set_full(vec![dir.to_path_buf()]);
        let refused = ledger.hold(&[frame(2, 1)]);
        assert!(matches!(refused, Err(WalError::DiskFull(_))), "{refused:?}");
        assert_eq!(ledger.frames(), &[frame(1, 0)]);
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(read_owed(&fs, dir).unwrap(), vec![frame(1, 0)]);
    }

    #[test]
    fn a_write_cut_short_leaves_the_copy_before_it() {
        for seed in 0..32 {
            let fs = SimFs::with_dir(DIR);
            let dir = Path::new(DIR);
            let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
            ledger.hold(&[frame(1, 0)]).unwrap();
            // The second write's sync never happens.
            fs.crash_after(2);
            assert!(ledger.hold(&[frame(1, 1), frame(2, 0)]).is_err());
            let fs = fs.power_loss(PowerLoss::Torn { seed });
            let read = read_owed(&fs, dir).unwrap();
            assert!(
                read == vec![frame(1, 0)] || read == vec![frame(1, 1), frame(2, 0)],
                "seed {seed}: {read:?}"
            );
        }
    }

    #[test]
    fn more_than_it_holds_keeps_the_first() {
        let fs = SimFs::with_dir(DIR);
        let mut ledger = Ledger::open(&fs, Path::new(DIR), 4).unwrap();
        let many: Vec<Remembered> = (0..9).map(|i| frame(i, 0)).collect();
        assert_eq!(ledger.hold(&many).unwrap(), 4);
        assert_eq!(ledger.frames(), &many[..4]);
    }

    #[test]
    fn another_capacity_carries_what_it_held() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        let mut ledger = Ledger::open(&fs, dir, 4).unwrap();
        ledger
            .hold(&[frame(1, 0), frame(2, 1), frame(3, 0)])
            .unwrap();
        let held = [frame(1, 1), frame(2, 1), frame(3, 0)];
        ledger.hold(&held).unwrap();
        drop(ledger);
        // Made smaller: it still holds all three until they are written.
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        let ledger = Ledger::open(&fs, dir, 2).unwrap();
        assert_eq!(ledger.frames(), &held);
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(read_owed(&fs, dir).unwrap(), held.to_vec());
        let mut ledger = Ledger::open(&fs, dir, 2).unwrap();
        assert_eq!(ledger.frames(), &held);
        ledger.hold(&[]).unwrap();
        drop(ledger);
        // Then the next start makes it at the size configured.
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        Ledger::open(&fs, dir, 2).unwrap();
        assert_eq!(fs.file_len(&dir.join(LEDGER_FILE)), 2 * half_bytes(2));
        let mut ledger = Ledger::open(&fs, dir, 8).unwrap();
        ledger.hold(&[frame(5, 0)]).unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(read_owed(&fs, dir).unwrap(), vec![frame(5, 0)]);
    }

    #[test]
    fn a_damaged_half_is_not_read() {
        let fs = SimFs::with_dir(DIR);
        let dir = Path::new(DIR);
        let mut ledger = Ledger::open(&fs, dir, DEFAULT_FRAMES).unwrap();
        ledger.hold(&[frame(1, 0)]).unwrap();
        ledger.hold(&[frame(2, 0)]).unwrap();
        // The newest half (generation 3: the making was 1) loses a byte.
        let path = dir.join(LEDGER_FILE);
        let writer = crate::wal::FileSystem::open_write(&fs, &path).unwrap();
        let newest = half_bytes(DEFAULT_FRAMES) + HEADER + 3;
        writer.write_at(&[0xff], newest as u64).unwrap();
        assert_eq!(read_owed(&fs, dir).unwrap(), vec![frame(1, 0)]);
    }
}
