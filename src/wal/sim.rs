//! A file system in memory that forgets, at a simulated power loss, what was
//! never made durable (tests only). Under it the WAL's tests can cut the
//! power at any moment and check that every record it acknowledged is still
//! there, which a kill -9 cannot show: the kernel keeps a killed process's
//! unsynced writes.
//!
//! What survives a [`SimFs::power_loss`] (see [`super::fs`] for the rules):
//!
//! - of each file, the bytes and size it had at its last `sync_data` or
//!   `sync_all`, and (with [`PowerLoss::Torn`]) some of what was written
//!   since, as the kernel may have written back any of its dirty pages;
//! - of each directory, the names (files and directories) it held at its
//!   last `sync_dir`, and (with [`PowerLoss::Torn`]) a prefix, in order, of
//!   the changes made since, as a journal commits them.
//!
//! A power loss also ends the process that was using the file system: the
//! handle it had, and every file it opened, fail from then on, so a writer
//! thread still running cannot touch what the next "boot" reads. The next
//! boot uses the handle [`SimFs::power_loss`] returns.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use delayd_adapters::split_mix::SplitMix64 as Rng;

use super::fs::{parent_dir, DirGuard, FileSystem, VolumeSpace, WalFile};
use super::WalError;

/// How much of what was not synced a power loss leaves on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerLoss {
    /// The process dies, the machine does not (kill -9): every write and
    /// name change stays, synced or not, as the kernel still holds it.
    ProcessCrash,
    /// Nothing: every unsynced byte, and every name change whose directory
    /// was not synced since, is gone.
    DropUnsynced,
    /// A random part of it, drawn from `seed`: per file, the size it had
    /// at its last sync or after any write since (a write's size change is
    /// atomic), and within the unsynced range each 4 KiB page either
    /// written back or still zeros; per file system, a prefix of the
    /// unsynced name changes.
    Torn { seed: u64 },
}

const PAGE: usize = 4096;

/// The file system, as one process sees it. Clones share it.
#[derive(Clone)]
pub struct SimFs {
    state: Arc<Mutex<State>>,
    /// The boot this handle belongs to: it fails once the power is lost.
    epoch: u64,
    /// See [`SimFs::hold_appends`].
    gate: Arc<Gate>,
}

/// Appends wait here while a test holds them, so that it can act while a
/// batch is on its way to the disk (see [`SimFs::hold_appends`]).
#[derive(Default)]
struct Gate {
    /// (held, appends waiting)
    state: Mutex<(bool, usize)>,
    opened: std::sync::Condvar,
}

impl Gate {
    fn pass(&self) {
        let mut state = self.state.lock().expect("sim fs gate poisoned");
        if !state.0 {
            return;
        }
        state.1 += 1;
        while state.0 {
            state = self.opened.wait(state).expect("sim fs gate poisoned");
        }
        state.1 -= 1;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    File(usize),
    Dir,
}

/// Names set (`Some`) or removed (`None`) by one operation, and the
/// directories whose sync makes it durable.
#[derive(Debug)]
struct Change {
    dirs: Vec<PathBuf>,
    names: Vec<(PathBuf, Option<Entry>)>,
}

#[derive(Debug, Default)]
struct Inode {
    /// What reads see.
    data: Vec<u8>,
    /// What a power loss keeps for sure.
    synced: Vec<u8>,
    /// Changed other than by appending since the last sync.
    rewritten: bool,
    /// The size after each append since the last sync.
    ends: Vec<usize>,
    /// Bytes a failed sync dropped: reads still see them (the kernel
    /// marked their pages clean), the disk never gets them.
    lost: Vec<std::ops::Range<usize>>,
}

#[derive(Debug, Default)]
struct State {
    epoch: u64,
    inodes: Vec<Inode>,
    /// The namespace the running process sees.
    names: BTreeMap<PathBuf, Entry>,
    /// The namespace as of each directory's last sync.
    durable: BTreeMap<PathBuf, Entry>,
    /// Name changes not yet made durable, in order.
    journal: Vec<Change>,
    locks: BTreeSet<PathBuf>,
    syncs: u64,
    /// See [`SimFs::set_full`]: writes under these fail with `ENOSPC`.
    full: Vec<PathBuf>,
    /// See [`SimFs::set_capacity`]: the disk's size in bytes.
    capacity: Option<usize>,
    /// See [`SimFs::fail_next_sync`].
    fail_sync: bool,
    /// Syncs that failed so far.
    failed_syncs: u64,
    /// See [`SimFs::fail_next_append`].
    fail_append: Option<usize>,
    /// See [`SimFs::set_copy_on_write`].
    copy_on_write: bool,
    /// Operations that changed the disk so far (see [`SimFs::crash_after`]).
    ops: u64,
    crash_at: Option<u64>,
    /// The power went at `crash_at`: nothing works until the next boot.
    frozen: bool,
}

/// In `0..=max` (torn writes draw from a seed a test can print).
fn up_to(rng: &mut Rng, max: usize) -> usize {
    rng.below(max as u64 + 1) as usize
}

fn dead() -> io::Error {
    io::Error::other("simulated power loss: this process is gone")
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} not found", path.display()),
    )
}

impl State {
    /// By the path's text, so a prefix of a file name counts (`wal-`).
    fn is_full(&self, path: &Path) -> bool {
        let path = path.to_string_lossy();
        self.full
            .iter()
            .any(|d| path.starts_with(&*d.to_string_lossy()))
    }

    /// Bytes the named files hold (what a disk of [`SimFs::set_capacity`]
    /// counts; a file removed while open is not counted).
    fn used(&self) -> usize {
        self.names
            .values()
            .filter_map(|e| match e {
                Entry::File(ino) => Some(self.inodes[*ino].data.len()),
                Entry::Dir => None,
            })
            .sum()
    }

    /// Bytes an append may still write under the capacity.
    fn room(&self) -> usize {
        self.capacity
            .map_or(usize::MAX, |c| c.saturating_sub(self.used()))
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.parent().is_none() || self.names.get(path) == Some(&Entry::Dir)
    }

    fn change(&mut self, dirs: Vec<PathBuf>, names: Vec<(PathBuf, Option<Entry>)>) {
        for (name, entry) in &names {
            match entry {
                Some(e) => self.names.insert(name.clone(), *e),
                None => self.names.remove(name),
            };
        }
        self.journal.push(Change { dirs, names });
    }

    fn apply(durable: &mut BTreeMap<PathBuf, Entry>, change: &Change) {
        for (name, entry) in &change.names {
            match entry {
                Some(e) => durable.insert(name.clone(), *e),
                None => durable.remove(name),
            };
        }
    }

    fn file(&self, path: &Path) -> io::Result<usize> {
        match self.names.get(path) {
            Some(Entry::File(ino)) => Ok(*ino),
            Some(Entry::Dir) => Err(io::Error::other(format!(
                "{} is a directory",
                path.display()
            ))),
            None => Err(not_found(path)),
        }
    }

    /// What the disk holds of `inode` after the power is cut.
    fn surviving(inode: &Inode, rng: Option<&mut Rng>) -> Vec<u8> {
        let Some(rng) = rng else {
            return inode.synced.clone();
        };
        if inode.rewritten {
            return if rng.below(2) == 1 {
                inode.data.clone()
            } else {
                inode.synced.clone()
            };
        }
        let synced = inode.synced.len();
        let end = match up_to(rng, inode.ends.len()) {
            0 => synced,
            k => inode.ends[k - 1],
        };
        let mut out = inode.synced.clone();
        out.resize(end, 0);
        let mut page_start = synced / PAGE * PAGE;
        while page_start < end {
            let from = page_start.max(synced);
            let to = (page_start + PAGE).min(end);
            if rng.below(2) == 1 {
                out[from..to].copy_from_slice(&inode.data[from..to]);
            }
            page_start += PAGE;
        }
        out
    }
}

impl SimFs {
    /// An empty file system with the directory `dir` (and its parents)
    /// already durable, as a mounted volume would be.
    pub fn with_dir(dir: impl AsRef<Path>) -> SimFs {
        let mut state = State::default();
        for d in dir.as_ref().ancestors().filter(|d| d.parent().is_some()) {
            state.names.insert(d.to_path_buf(), Entry::Dir);
            state.durable.insert(d.to_path_buf(), Entry::Dir);
        }
        SimFs {
            state: Arc::new(Mutex::new(state)),
            epoch: 0,
            gate: Arc::default(),
        }
    }

    /// The state, if this handle's process is still alive.
    fn live(&self) -> io::Result<MutexGuard<'_, State>> {
        let state = self.state.lock().expect("sim fs poisoned");
        if state.epoch != self.epoch || state.frozen {
            return Err(dead());
        }
        Ok(state)
    }

    /// The state, for an operation that changes the disk: counted, and
    /// the power goes instead if it is the one [`SimFs::crash_after`] named.
    fn mutating(&self) -> io::Result<MutexGuard<'_, State>> {
        let mut state = self.live()?;
        state.ops += 1;
        if state.crash_at == Some(state.ops) {
            state.frozen = true;
            return Err(dead());
        }
        Ok(state)
    }

    /// Cut the power just before the `n`th operation from now that would
    /// change the disk (a write, a cut, a sync, a create, a rename, a
    /// remove): it and everything after it fail, as in a process whose
    /// machine went dark. [`SimFs::power_loss`] then boots the next one
    /// with what the disk held at that moment.
    pub fn crash_after(&self, n: u64) {
        let mut state = self.live().expect("a live handle");
        state.crash_at = Some(state.ops + n);
    }

    /// A [`SimFs::crash_after`] was called for this boot (it may not have
    /// come yet).
    pub fn crash_armed(&self) -> bool {
        self.state
            .lock()
            .expect("sim fs poisoned")
            .crash_at
            .is_some()
    }

    /// The power went at [`SimFs::crash_after`]'s call: this boot is over.
    pub fn is_frozen(&self) -> bool {
        self.state.lock().expect("sim fs poisoned").frozen
    }

    /// File syncs that failed so far (see [`SimFs::fail_next_sync`]).
    pub fn failed_syncs(&self) -> u64 {
        self.state.lock().expect("sim fs poisoned").failed_syncs
    }

    /// Forget a [`SimFs::crash_after`] that has not come yet.
    pub fn cancel_crash(&self) {
        self.state.lock().expect("sim fs poisoned").crash_at = None;
    }

    /// Operations that changed the disk so far.
    pub fn ops(&self) -> u64 {
        self.state.lock().expect("sim fs poisoned").ops
    }

    /// Cut the power: every handle and file opened so far fails from now
    /// on, and the disk keeps what `loss` says. Returns the handle of the
    /// next boot.
    pub fn power_loss(&self, loss: PowerLoss) -> SimFs {
        let mut state = self.state.lock().expect("sim fs poisoned");
        if loss == PowerLoss::ProcessCrash {
            // Everything written is what the next boot reads.
            for inode in &mut state.inodes {
                SimFile::write_back(inode);
            }
            let journal = std::mem::take(&mut state.journal);
            for change in &journal {
                State::apply(&mut state.durable, change);
            }
        }
        let mut rng = match loss {
            PowerLoss::DropUnsynced | PowerLoss::ProcessCrash => None,
            PowerLoss::Torn { seed } => Some(Rng(seed)),
        };
        let journal = std::mem::take(&mut state.journal);
        let kept = rng.as_mut().map_or(0, |r| up_to(r, journal.len()));
        let mut names = std::mem::take(&mut state.durable);
        for change in &journal[..kept] {
            State::apply(&mut names, change);
        }
        // A name whose directory did not survive went with it.
        let dirs: BTreeSet<PathBuf> = names
            .iter()
            .filter(|(_, e)| **e == Entry::Dir)
            .map(|(p, _)| p.clone())
            .collect();
        names.retain(|p, _| {
            p.ancestors()
                .skip(1)
                .filter(|a| a.parent().is_some())
                .all(|a| dirs.contains(a))
        });
        for ino in 0..state.inodes.len() {
            let data = State::surviving(&state.inodes[ino], rng.as_mut());
            state.inodes[ino] = Inode {
                synced: data.clone(),
                data,
                ..Inode::default()
            };
        }
        state.names = names.clone();
        state.durable = names;
        state.locks.clear();
        state.fail_sync = false;
        state.frozen = false;
        state.crash_at = None;
        state.epoch += 1;
        SimFs {
            gate: Arc::default(),
            state: self.state.clone(),
            epoch: state.epoch,
        }
    }

    /// Bytes at the end of `path` that reached the disk although their
    /// write was never acknowledged: part of the batch a process was
    /// writing when the power went.
    pub fn append_on_disk(&self, path: &Path, bytes: &[u8]) {
        let mut state = self.live().expect("a live handle");
        let ino = state.file(path).expect("an existing file");
        let inode = &mut state.inodes[ino];
        inode.data.extend_from_slice(bytes);
        inode.synced.extend_from_slice(bytes);
    }

    /// Writes in place take new blocks, as on btrfs or ZFS: a full disk
    /// refuses them too (ENOSPC, nothing written).
    pub fn set_copy_on_write(&self, on: bool) {
        self.state.lock().expect("sim fs poisoned").copy_on_write = on;
    }

    /// From now on every append waits (in the writer's thread) until
    /// [`SimFs::release_appends`]: a test can then act while a batch is on
    /// its way, deterministically. [`SimFs::appends_waiting`] tells when
    /// one has arrived.
    pub fn hold_appends(&self) {
        self.gate.state.lock().expect("sim fs gate poisoned").0 = true;
    }

    /// Let held appends go on (see [`SimFs::hold_appends`]).
    pub fn release_appends(&self) {
        self.gate.state.lock().expect("sim fs gate poisoned").0 = false;
        self.gate.opened.notify_all();
    }

    /// Appends waiting at [`SimFs::hold_appends`]'s gate.
    pub fn appends_waiting(&self) -> usize {
        self.gate.state.lock().expect("sim fs gate poisoned").1
    }

    /// Make the next append write only `written` bytes of its buffer, which
    /// reach the disk (as if the kernel wrote their pages back at once),
    /// then fail with `ENOSPC`.
    pub fn fail_next_append(&self, written: usize) {
        self.live().expect("a live handle").fail_append = Some(written);
    }

    /// Fill the disk under each of `dirs` (none: space again): appends
    /// there fail with `ENOSPC` after writing half their buffer, as a real
    /// short write does. A new file is still created (an inode, no data).
    /// Survives a power loss: the disk is still full.
    pub fn set_full(&self, dirs: Vec<PathBuf>) {
        self.state.lock().expect("sim fs poisoned").full = dirs;
    }

    /// Make the disk `bytes` large (none: unbounded): an append past it
    /// writes what fits, then fails with `ENOSPC`, as on a real disk that
    /// fills up. Survives a power loss.
    pub fn set_capacity(&self, bytes: Option<usize>) {
        self.state.lock().expect("sim fs poisoned").capacity = bytes;
    }

    /// The size of `path` as the running process sees it (0 if absent).
    pub fn file_len(&self, path: &Path) -> usize {
        let state = self.state.lock().expect("sim fs poisoned");
        state
            .file(path)
            .map_or(0, |ino| state.inodes[ino].data.len())
    }

    /// Bytes the named files hold now.
    pub fn used_bytes(&self) -> usize {
        self.state.lock().expect("sim fs poisoned").used()
    }

    /// Make the next file sync fail with `EIO` (the kernel may have
    /// dropped the dirty pages it could not write).
    pub fn fail_next_sync(&self) {
        self.state.lock().expect("sim fs poisoned").fail_sync = true;
    }

    /// The bytes of `path` as the running process reads them.
    pub fn read(&self, path: &Path) -> Vec<u8> {
        let state = self.live().expect("a live handle");
        let ino = state.file(path).expect("an existing file");
        state.inodes[ino].data.clone()
    }

    /// File syncs and directory syncs made so far.
    pub fn syncs(&self) -> u64 {
        self.state.lock().expect("sim fs poisoned").syncs
    }

    /// Bytes written but not synced, and name changes not synced.
    pub fn unsynced(&self) -> (usize, usize) {
        let state = self.state.lock().expect("sim fs poisoned");
        let bytes = state
            .inodes
            .iter()
            .map(|i| {
                if i.rewritten {
                    i.data.len().max(1)
                } else {
                    i.data.len() - i.synced.len()
                }
            })
            .sum();
        (bytes, state.journal.len())
    }
}

impl fmt::Debug for SimFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimFs(boot {})", self.epoch)
    }
}

/// An open file of a [`SimFs`].
#[derive(Debug)]
struct SimFile {
    fs: SimFs,
    ino: usize,
    writable: bool,
    /// Where it was opened (for [`SimFs::set_full`]).
    path: PathBuf,
}

impl SimFile {
    fn with<T>(&self, f: impl FnOnce(&mut Inode) -> T) -> io::Result<T> {
        let mut state = self.fs.live()?;
        Ok(f(&mut state.inodes[self.ino]))
    }

    fn sync(&self) -> io::Result<()> {
        let mut state = self.fs.mutating()?;
        if std::mem::take(&mut state.fail_sync) {
            // As Linux does: the dirty pages are marked clean unwritten,
            // and a later sync succeeds without them.
            let inode = &mut state.inodes[self.ino];
            // A cut is no dirty page: what follows the shorter of the two
            // sizes is what was written since.
            let from = inode.synced.len().min(inode.data.len());
            let lost = from..inode.data.len();
            inode.lost.push(lost);
            state.failed_syncs += 1;
            return Err(io::Error::from_raw_os_error(5)); // EIO
        }
        state.syncs += 1;
        Self::write_back(&mut state.inodes[self.ino]);
        Ok(())
    }

    /// Every byte written so far is on the disk.
    fn write_back(inode: &mut Inode) {
        inode.ends.clear();
        if inode.rewritten {
            inode.synced = inode.data.clone();
            inode.rewritten = false;
        } else {
            let at = inode.synced.len();
            let Inode { data, synced, .. } = inode;
            synced.extend_from_slice(&data[at..]);
        }
        let Inode { synced, lost, .. } = inode;
        for range in lost.iter() {
            let end = range.end.min(synced.len());
            if range.start < end {
                synced[range.start..end].fill(0);
            }
        }
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "file opened read-only",
            ))
        }
    }
}

impl WalFile for SimFile {
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        self.check_writable()?;
        self.fs.gate.pass();
        let mut state = self.fs.mutating()?;
        if state.is_full(&self.path) {
            // A short write of half the buffer, then ENOSPC.
            let inode = &mut state.inodes[self.ino];
            inode.data.extend_from_slice(&buf[..buf.len() / 2]);
            let end = inode.data.len();
            inode.ends.push(end);
            return Err(enospc());
        }
        let room = state.room();
        if buf.len() > room {
            // What fits, then ENOSPC.
            let inode = &mut state.inodes[self.ino];
            inode.data.extend_from_slice(&buf[..room]);
            let end = inode.data.len();
            inode.ends.push(end);
            return Err(enospc());
        }
        let fail = state.fail_append.take();
        let inode = &mut state.inodes[self.ino];
        if let Some(written) = fail {
            inode.data.extend_from_slice(&buf[..written.min(buf.len())]);
            Self::write_back(inode);
            return Err(enospc());
        }
        inode.data.extend_from_slice(buf);
        let end = inode.data.len();
        inode.ends.push(end);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.with(|i| {
            let from = (offset as usize).min(i.data.len());
            let n = buf.len().min(i.data.len() - from);
            buf[..n].copy_from_slice(&i.data[from..from + n]);
            n
        })
    }

    fn read_at_cached(&self, buf: &mut [u8], offset: u64) -> Option<usize> {
        self.read_at(buf, offset).ok()
    }

    fn size(&self) -> io::Result<u64> {
        self.with(|i| i.data.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check_writable()?;
        let mut state = self.fs.mutating()?;
        let inode = &mut state.inodes[self.ino];
        inode.rewritten = true;
        inode.data.resize(len as usize, 0);
        // What is cut off is no longer lost: a later write lands anew.
        let len = len as usize;
        inode.lost.retain(|r| r.start < len);
        for r in &mut inode.lost {
            r.end = r.end.min(len);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_writable()?;
        let mut state = self.fs.mutating()?;
        if state.copy_on_write && (state.is_full(&self.path) || state.room() < buf.len()) {
            return Err(enospc());
        }
        let inode = &mut state.inodes[self.ino];
        let from = offset as usize;
        let Some(to) = from
            .checked_add(buf.len())
            .filter(|&to| to <= inode.data.len())
        else {
            return Err(io::Error::other("a write in place passes the file's end"));
        };
        // In the file's own blocks: a full disk does not refuse it. Until
        // synced, a power loss keeps all of it or none (see `surviving`).
        inode.rewritten = true;
        inode.data[from..to].copy_from_slice(buf);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.sync()
    }

    fn sync_all(&self) -> io::Result<()> {
        self.sync()
    }
}

#[derive(Debug)]
struct SimLock {
    fs: SimFs,
    dir: PathBuf,
}

impl DirGuard for SimLock {}

impl Drop for SimLock {
    fn drop(&mut self) {
        if let Ok(mut state) = self.fs.live() {
            state.locks.remove(&self.dir);
        }
    }
}

impl FileSystem for SimFs {
    fn is_dir(&self, path: &Path) -> bool {
        self.live().is_ok_and(|s| s.is_dir(path))
    }

    fn space(&self, dir: &Path) -> io::Result<VolumeSpace> {
        let state = self.live()?;
        let bytes = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        Ok(VolumeSpace {
            total: state.capacity.map_or(u64::MAX, bytes),
            available: if state.is_full(dir) {
                0
            } else {
                bytes(state.room())
            },
        })
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut state = self.mutating()?;
        let mut missing: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !state.is_dir(d))
            .map(Path::to_path_buf)
            .collect();
        missing.reverse();
        for d in &missing {
            if state.names.contains_key(d) {
                return Err(io::Error::other(format!("{} is a file", d.display())));
            }
            state.change(
                vec![parent_dir(d).to_path_buf()],
                vec![(d.clone(), Some(Entry::Dir))],
            );
        }
        Ok(missing)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let state = self.live()?;
        if !state.is_dir(dir) {
            return Err(not_found(dir));
        }
        Ok(state
            .names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect())
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let mut state = self.mutating()?;
        let dir = parent_dir(path).to_path_buf();
        if !state.is_dir(&dir) {
            return Err(not_found(&dir));
        }
        if state.names.contains_key(path) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists", path.display()),
            ));
        }
        let ino = state.inodes.len();
        state.inodes.push(Inode::default());
        state.change(
            vec![dir],
            vec![(path.to_path_buf(), Some(Entry::File(ino)))],
        );
        Ok(Box::new(SimFile {
            fs: self.clone(),
            ino,
            writable: true,
            path: path.to_path_buf(),
        }))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let ino = self.live()?.file(path)?;
        Ok(Box::new(SimFile {
            fs: self.clone(),
            ino,
            writable: false,
            path: path.to_path_buf(),
        }))
    }

    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let ino = self.live()?.file(path)?;
        Ok(Box::new(SimFile {
            fs: self.clone(),
            ino,
            writable: true,
            path: path.to_path_buf(),
        }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        self.open_write(path)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut state = self.mutating()?;
        state.file(path)?;
        state.change(
            vec![parent_dir(path).to_path_buf()],
            vec![(path.to_path_buf(), None)],
        );
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut state = self.mutating()?;
        let ino = state.file(from)?;
        if !state.is_dir(parent_dir(to)) {
            return Err(not_found(parent_dir(to)));
        }
        let dirs = vec![parent_dir(from).to_path_buf(), parent_dir(to).to_path_buf()];
        state.change(
            dirs,
            vec![
                (to.to_path_buf(), Some(Entry::File(ino))),
                (from.to_path_buf(), None),
            ],
        );
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.mutating()?;
        if !state.is_dir(dir) {
            return Err(not_found(dir));
        }
        state.syncs += 1;
        let journal = std::mem::take(&mut state.journal);
        let (done, left): (Vec<Change>, Vec<Change>) = journal
            .into_iter()
            .partition(|c| c.dirs.iter().any(|d| d == dir));
        for change in &done {
            State::apply(&mut state.durable, change);
        }
        state.journal = left;
        Ok(())
    }

    fn lock_dir(&self, dir: &Path) -> Result<Box<dyn DirGuard>, WalError> {
        let mut state = self.live().map_err(|e| WalError::io(dir, e))?;
        if !state.locks.insert(dir.to_path_buf()) {
            return Err(WalError::Locked {
                dir: dir.to_path_buf(),
                pid: Some(std::process::id()),
            });
        }
        Ok(Box::new(SimLock {
            fs: self.clone(),
            dir: dir.to_path_buf(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        PathBuf::from("/vol/wal")
    }

    fn file_in(fs: &SimFs, name: &str) -> (PathBuf, Box<dyn WalFile>) {
        let path = dir().join(name);
        let file = fs.create_new(&path).unwrap();
        (path, file)
    }

    #[test]
    fn unsynced_bytes_are_lost_and_synced_ones_kept() {
        let fs = SimFs::with_dir(dir());
        let (path, file) = file_in(&fs, "a");
        fs.sync_dir(&dir()).unwrap();
        file.append(b"kept").unwrap();
        file.sync_data().unwrap();
        file.append(b" lost").unwrap();
        assert_eq!(fs.read(&path), b"kept lost");
        assert_eq!(fs.unsynced(), (5, 0));
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"kept");
        assert_eq!(fs.unsynced(), (0, 0));
    }

    #[test]
    fn a_name_lasts_only_once_its_directory_is_synced() {
        let fs = SimFs::with_dir(dir());
        let (created, file) = file_in(&fs, "created");
        file.append(b"data").unwrap();
        file.sync_all().unwrap(); // the file's bytes, not its name
        let (kept, _) = file_in(&fs, "kept");
        fs.sync_dir(&dir()).unwrap();
        let (late, _) = file_in(&fs, "late");
        // Removed and renamed without a sync: both undone.
        fs.remove_file(&kept).unwrap();
        fs.rename(&created, &dir().join("renamed")).unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.list(&dir()).unwrap(), vec![created.clone(), kept]);
        assert_eq!(fs.read(&created), b"data");
        assert!(fs.open(&late).is_err());
        // Once synced, a rename and a remove last.
        fs.rename(&created, &dir().join("renamed")).unwrap();
        fs.remove_file(&dir().join("kept")).unwrap();
        fs.sync_dir(&dir()).unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.list(&dir()).unwrap(), vec![dir().join("renamed")]);
    }

    #[test]
    fn a_created_directory_needs_its_parent_synced() {
        let fs = SimFs::with_dir("/vol");
        let made = fs.create_dir_all(Path::new("/vol/a/b")).unwrap();
        assert_eq!(
            made,
            vec![PathBuf::from("/vol/a"), PathBuf::from("/vol/a/b")]
        );
        let path = PathBuf::from("/vol/a/b/f");
        let f = fs.create_new(&path).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(Path::new("/vol/a/b")).unwrap();
        fs.sync_dir(Path::new("/vol/a")).unwrap();
        // `/vol/a` itself was never made durable in `/vol`.
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert!(!fs.is_dir(Path::new("/vol/a")));
        assert!(fs.open(&path).is_err());
        fs.create_dir_all(Path::new("/vol/a/b")).unwrap();
        fs.sync_dir(Path::new("/vol")).unwrap();
        fs.sync_dir(Path::new("/vol/a")).unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert!(fs.is_dir(Path::new("/vol/a/b")));
    }

    #[test]
    fn a_dead_process_can_no_longer_touch_the_disk() {
        let fs = SimFs::with_dir(dir());
        let (path, file) = file_in(&fs, "a");
        let _lock = fs.lock_dir(&dir()).unwrap();
        assert!(matches!(fs.lock_dir(&dir()), Err(WalError::Locked { .. })));
        let next = fs.power_loss(PowerLoss::DropUnsynced);
        assert!(file.append(b"x").is_err());
        assert!(file.sync_data().is_err());
        assert!(fs.create_new(&dir().join("b")).is_err());
        assert!(fs.sync_dir(&dir()).is_err());
        assert!(!fs.is_dir(&dir()));
        // The lock died with the process; the file's name was never synced.
        let _relock = next.lock_dir(&dir()).unwrap();
        assert!(next.open(&path).is_err());
    }

    #[test]
    fn a_torn_loss_keeps_synced_bytes_and_whole_pages_of_the_rest() {
        let data: Vec<u8> = (0..5 * PAGE + 100).map(|i| (i % 251) as u8 + 1).collect();
        let mut seen_sizes = BTreeSet::new();
        for seed in 0..64 {
            let fs = SimFs::with_dir(dir());
            let (path, file) = file_in(&fs, "a");
            fs.sync_dir(&dir()).unwrap();
            file.append(&data[..PAGE + 10]).unwrap();
            file.sync_data().unwrap();
            let mut ends = vec![PAGE + 10];
            for chunk in data[PAGE + 10..].chunks(700) {
                file.append(chunk).unwrap();
                ends.push(ends.last().unwrap() + chunk.len());
            }
            let fs = fs.power_loss(PowerLoss::Torn { seed });
            let got = fs.read(&path);
            seen_sizes.insert(got.len());
            assert!(ends.contains(&got.len()), "a size no write left");
            assert_eq!(&got[..PAGE + 10], &data[..PAGE + 10], "synced bytes");
            // Every page of the rest is either all written or all zeros.
            for (n, page) in got.chunks(PAGE).enumerate() {
                let from = (n * PAGE).max(PAGE + 10);
                let to = (n * PAGE + page.len()).max(from);
                let part = &got[from..to];
                assert!(
                    part == &data[from..to] || part.iter().all(|&b| b == 0),
                    "seed {seed}: page {n} is neither written nor zeros"
                );
            }
        }
        assert!(seen_sizes.len() > 10, "sizes drawn: {seen_sizes:?}");
    }

    #[test]
    fn a_torn_loss_keeps_a_prefix_of_the_name_changes() {
        for seed in 0..32 {
            let fs = SimFs::with_dir(dir());
            for name in ["1", "2", "3", "4"] {
                file_in(&fs, name);
            }
            let fs = fs.power_loss(PowerLoss::Torn { seed });
            let names = fs.list(&dir()).unwrap();
            let expected: Vec<PathBuf> = ["1", "2", "3", "4"][..names.len()]
                .iter()
                .map(|n| dir().join(n))
                .collect();
            assert_eq!(names, expected, "seed {seed}");
        }
    }

    #[test]
    fn a_cut_is_undone_unless_synced() {
        let fs = SimFs::with_dir(dir());
        let (path, file) = file_in(&fs, "a");
        fs.sync_dir(&dir()).unwrap();
        file.append(b"0123456789").unwrap();
        file.sync_data().unwrap();
        let cut = fs.open_write(&path).unwrap();
        cut.set_len(4).unwrap();
        assert!(fs.open(&path).unwrap().set_len(1).is_err(), "read-only");
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"0123456789");
        let cut = fs.open_write(&path).unwrap();
        cut.set_len(4).unwrap();
        cut.sync_all().unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"0123");
        fs.append_on_disk(&path, b"torn");
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"0123torn");
        assert!(fs.syncs() >= 2);
    }

    #[test]
    fn a_crash_point_stops_the_disk_before_that_operation() {
        let fs = SimFs::with_dir(dir());
        let (path, file) = file_in(&fs, "a");
        fs.sync_dir(&dir()).unwrap();
        assert_eq!(fs.ops(), 2);
        fs.crash_after(3);
        file.append(b"one").unwrap();
        file.sync_data().unwrap();
        assert!(file.append(b"two").is_err(), "the third operation");
        assert!(file.read_at(&mut [0; 3], 0).is_err(), "nothing works after");
        assert!(fs.sync_dir(&dir()).is_err());
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"one");
        file_in(&fs, "b"); // the next boot works
    }

    #[test]
    fn a_failed_append_leaves_what_it_wrote_on_disk() {
        let fs = SimFs::with_dir(dir());
        let (path, file) = file_in(&fs, "a");
        fs.sync_dir(&dir()).unwrap();
        file.append(b"ok").unwrap();
        fs.fail_next_append(3);
        let e = file.append(b"half of it").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(28));
        assert_eq!(fs.unsynced(), (0, 0));
        file.append(b"!").unwrap();
        let fs = fs.power_loss(PowerLoss::DropUnsynced);
        assert_eq!(fs.read(&path), b"okhal");
    }
}
