//! The file layer under the WAL: every open, write, sync, rename and remove
//! the log makes goes through [`FileSystem`] and [`WalFile`], so a test can
//! put a file system underneath that forgets what was never synced (see
//! `sim.rs`, tests only) and check that nothing acknowledged depended on it.
//! Modelled on raft-engine's `FileSystem` trait, as trait objects: one
//! virtual call per write, sync or read, next to a system call each.
//!
//! What the log relies on, and what a simulated power loss takes away when
//! it was not done:
//!
//! - bytes written to a file survive only once the file is synced
//!   ([`WalFile::sync_data`] or [`WalFile::sync_all`]); `sync_data` also
//!   makes the file's size durable, as `fdatasync` does;
//! - a created, renamed or removed name survives only once its directory is
//!   synced ([`FileSystem::sync_dir`]), and so does a created directory, in
//!   its parent.
//!
//! [`StdFs`] is the real one: `std::fs`, `fdatasync`, `fsync` of the
//! directory, an `flock` per WAL directory.

use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSliceMut, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::io::{Errno, ReadWriteFlags};

use super::WalError;

/// An open file of the log: a segment, read and (for the head) appended to.
pub trait WalFile: Send + Sync + Debug {
    /// Append all of `buf` at the end of the file.
    fn append(&self, buf: &[u8]) -> io::Result<()>;
    /// Read from `offset`; fewer bytes than `buf` holds at the end of the file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// [`WalFile::read_at`] from the page cache only: `None` when reading
    /// would wait for the disk (or the file system cannot tell).
    fn read_at_cached(&self, buf: &mut [u8], offset: u64) -> Option<usize>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Cut (or extend) the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Write all of `buf` at `offset`, inside the file's size (opened with
    /// [`FileSystem::open_write`]): the blocks are the file's already, so a
    /// full disk does not refuse it (on a file system that overwrites in
    /// place, which a copy-on-write one does not).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// `fdatasync`: the file's bytes and size are durable when it returns.
    fn sync_data(&self) -> io::Result<()>;
    /// `fsync`: the same, and every other attribute of the file.
    fn sync_all(&self) -> io::Result<()>;
}

/// A volume's size and free room, in bytes (see [`FileSystem::space`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeSpace {
    pub total: u64,
    pub available: u64,
}

/// Held for as long as a WAL directory is in use (see [`FileSystem::lock_dir`]).
pub trait DirGuard: Send + Sync + Debug {}

/// The directory operations of the log. Paths are full paths.
pub trait FileSystem: Send + Sync + Debug {
    fn is_dir(&self, path: &Path) -> bool;
    /// The size of `dir`'s volume, and what an unprivileged writer may
    /// still write on it.
    fn space(&self, dir: &Path) -> io::Result<VolumeSpace>;
    /// Create `dir` and any missing parent; returns the directories created,
    /// outermost first (each needs its parent synced to be durable).
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// The files in `dir`, in no particular order.
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// Create a file that must not exist yet, to append to and read from.
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    /// Open an existing file to read.
    fn open(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    /// Open an existing file to cut it ([`WalFile::set_len`]).
    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    /// Open an existing file to append to and read from.
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// `fsync` the directory: names created, renamed or removed in it (and
    /// directories created in it) are durable when it returns.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// One process per WAL directory: the guard holds `dir` until dropped.
    fn lock_dir(&self, dir: &Path) -> Result<Box<dyn DirGuard>, WalError>;
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdFs;

impl WalFile for File {
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        // Opened with O_APPEND: every write lands at the end.
        (&*self).write_all(buf)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }

    fn read_at_cached(&self, buf: &mut [u8], offset: u64) -> Option<usize> {
        // `preadv2` with RWF_NOWAIT: a short count means the rest is not
        // cached. Any failure (EAGAIN, or EOPNOTSUPP on a file system
        // without RWF_NOWAIT) is left to the blocking read.
        loop {
            let mut slices = [IoSliceMut::new(buf)];
            match rustix::io::preadv2(self, &mut slices, offset, ReadWriteFlags::NOWAIT) {
                Ok(n) => return Some(n),
                Err(Errno::INTR) => continue,
                Err(_) => return None,
            }
        }
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let size = self.metadata()?.len();
        if offset + buf.len() as u64 > size {
            return Err(io::Error::other(format!(
                "a write in place of {} bytes at {offset} passes the file's end ({size})",
                buf.len()
            )));
        }
        FileExt::write_all_at(self, buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn sync_all(&self) -> io::Result<()> {
        File::sync_all(self)
    }
}

impl DirGuard for super::lock::DirLock {}

impl FileSystem for StdFs {
    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn space(&self, dir: &Path) -> io::Result<VolumeSpace> {
        let stat = rustix::fs::statvfs(dir)?;
        Ok(VolumeSpace {
            total: stat.f_blocks.saturating_mul(stat.f_frsize),
            available: stat.f_bavail.saturating_mul(stat.f_frsize),
        })
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let missing: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(dir)?;
        Ok(missing.into_iter().rev().collect())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        std::fs::read_dir(dir)?
            .map(|entry| entry.map(|e| e.path()))
            .collect()
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .read(true)
            .open(path)?;
        Ok(Box::new(file))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        Ok(Box::new(File::open(path)?))
    }

    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        Ok(Box::new(OpenOptions::new().write(true).open(path)?))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let file = OpenOptions::new().append(true).read(true).open(path)?;
        Ok(Box::new(file))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn lock_dir(&self, dir: &Path) -> Result<Box<dyn DirGuard>, WalError> {
        Ok(Box::new(super::lock::DirLock::acquire(dir)?))
    }
}

/// The parent whose sync makes `path`'s name durable (`.` for a bare name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn std_fs_creates_lists_reads_cuts_and_removes() {
        let dir = tempfile::tempdir().unwrap();
        let fs = StdFs;
        let nested = dir.path().join("a/b");
        assert_eq!(
            fs.create_dir_all(&nested).unwrap(),
            vec![dir.path().join("a"), nested.clone()]
        );
        assert!(fs.create_dir_all(&nested).unwrap().is_empty());
        assert!(fs.is_dir(&nested));
        let path = nested.join("f");
        let file = fs.create_new(&path).unwrap();
        assert!(fs.create_new(&path).is_err(), "exists already");
        file.append(b"hello ").unwrap();
        file.append(b"world").unwrap();
        file.sync_data().unwrap();
        file.sync_all().unwrap();
        fs.sync_dir(&nested).unwrap();
        assert_eq!(file.size().unwrap(), 11);
        let reader = fs.open(&path).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(reader.read_at(&mut buf, 6).unwrap(), 5);
        assert_eq!(&buf[..5], b"world");
        // Just written: in the page cache (unless the file system cannot tell).
        if let Some(n) = reader.read_at_cached(&mut buf, 0) {
            assert_eq!(&buf[..n], &b"hello world"[..n]);
        }
        fs.open_write(&path).unwrap().set_len(5).unwrap();
        assert_eq!(reader.size().unwrap(), 5);
        assert_eq!(fs.list(&nested).unwrap(), vec![path.clone()]);
        let moved = nested.join("g");
        fs.rename(&path, &moved).unwrap();
        assert_eq!(fs.list(&nested).unwrap(), vec![moved.clone()]);
        fs.remove_file(&moved).unwrap();
        assert!(fs.list(&nested).unwrap().is_empty());
        assert!(fs.open(&moved).is_err());
        let _guard = fs.lock_dir(&nested).unwrap();
        assert!(matches!(
            StdFs.lock_dir(&nested),
            Err(WalError::Locked { .. })
        ));
        assert_eq!(parent_dir(Path::new("x")), Path::new("."));
        assert_eq!(parent_dir(&moved), nested.as_path());
    }
}
