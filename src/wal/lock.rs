//! One process per WAL directory: an exclusive `flock` on `wal.lock`, held
//! for the life of the log, with the holder's pid written in the file so a
//! refused second process can say who holds it.
//!
//! The lock is advisory and dies with the process (kill -9 included), so a
//! stale `wal.lock` left by a crash never blocks a restart.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use super::WalError;

pub const LOCK_FILE: &str = "wal.lock";

/// Holds the directory's lock until dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<DirLock, WalError> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| WalError::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(WalError::Locked {
                    dir: dir.to_path_buf(),
                    pid: read_pid(&mut file),
                })
            }
            Err(TryLockError::Error(e)) => return Err(WalError::io(&path, e)),
        }
        write_pid(&mut file).map_err(|e| WalError::io(&path, e))?;
        Ok(DirLock { _file: file })
    }
}

fn write_pid(file: &mut File) -> std::io::Result<()> {
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())
}

fn read_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// The pid recorded in `dir`'s lock file if that process is still alive
/// (for `wal inspect`, which reads without taking the lock).
pub fn live_holder(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join(LOCK_FILE)).ok()?;
    let pid: u32 = text.trim().parse().ok()?;
    PathBuf::from(format!("/proc/{pid}"))
        .exists()
        .then_some(pid)
}
