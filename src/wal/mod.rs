//! The write-ahead log: delayd's only source of truth.
//!
//! # On-disk format
//!
//! The log is a directory of segment files named `wal-<first_seq>.log`, where
//! `first_seq` is the 20-digit, zero-padded sequence number of the segment's
//! first frame, so names sort in log order. Each segment starts with a 16-byte
//! header (`b"DELAYDWL"`, format version `u32` LE, a random `salt u32` LE) and
//! then holds frames back to back:
//!
//! ```text
//! +---------+---------+------+---------+----------------------+
//! | len u32 | crc u32 | type | seq u64 | payload (len-9 bytes) |
//! +---------+---------+------+---------+----------------------+
//! ```
//!
//! All integers are little-endian. `len` counts `type + seq + payload`;
//! `crc` is CRC32C over the segment's `salt`, `len`, `type`, `seq` and
//! `payload`. The salt is drawn at random for each segment and never leaves
//! it, so bytes a producer puts in a message body can never pass for a frame
//! when recovery scans forward after a damaged one. `seq` increases across
//! the whole log (one per frame; a torn tail can leave a gap). Record types:
//!
//! - `4 Schedule`: `id u64 | due_ms u64 | uid u128 | route_len u16 | route |
//!   message`. `id` is the `seq` of the message's first Schedule frame and
//!   never changes, even when compaction copies the record to a newer
//!   segment; it names the message inside this log only. `uid` is the
//!   message's identity across instances and restarts (`x-delayd-id`, see
//!   `crate::id`), which every copy keeps.
//! - `1 Schedule` (read only): the same without `uid`, as written before
//!   messages had one; such a message is known by its `id`.
//! - `2 Done`: `id u64 | segment u64`: the message left delayd (delivered,
//!   cancelled or dead-lettered); `segment` is the `first_seq` of the segment
//!   that held its Schedule frame when it was written.
//! - `3 Commit`: `batch_first_seq u64`: ends every batch the writer writes
//!   (see below), naming the seq of the batch's first frame.
//! - `5 Acked` (version 3): `id u64`: the source's ack of message `id` was
//!   confirmed, so a broker redelivery after a restart cannot be that
//!   message (see `engine::dedup`). Written lazily; not copied by
//!   compaction. With bit 63 set (`engine::dedup::CANCELLED_MARK`; ids
//!   never reach it, and a delayd without the flag ignores the mark as an
//!   unknown id): message `id` was cancelled, so a redelivery that repeats
//!   it must not be stored again. Written just before the cancel's Done in its
//!   batch, so in its segment (or durably, for a far message, before the
//!   far tier's cancel), and copied with that Done by compaction. With
//!   bit 61 set (`engine::dedup::MATCHED_MARK`): a redelivery of message
//!   `id` is stored as its copy, so no later one repeats it; copied by
//!   compaction while the engine remembers it, and after its Schedule's
//!   copy.
//! - `6 Remembered` (version 4): `id u64 | uid u128 | fingerprint u64 |
//!   digest [32] | flags u8` (1: cancelled, 2: left): a message redelivery
//!   detection still remembers (its ack in doubt) whose Schedule's segment
//!   is being deleted. Written, durably, before that segment goes, and again
//!   before its own segment goes, for as long as the engine remembers the
//!   message; a restart reads it back like a Schedule compared by digest
//!   (see `engine::dedup`). It may take the disk reserve's room, like a
//!   Done: the deletion it precedes frees more. If even that fails, the
//!   message is remembered in memory only, as before version 4, and the
//!   segment goes all the same (a full disk must still empty).
//!
//! Version 1 segments (no salt: the CRC starts at `len`; no Commit frames),
//! version 2 segments (no Acked frames) and version 3 (no Remembered) are
//! still read; a start goes on writing only a segment of the current
//! version. A delayd older than a version cannot read a segment of it: to
//! go back to one, drain the WAL first (or hand the messages off,
//! `engine.handoff`).
//!
//! # Writing
//!
//! One writer thread owns the head segment. Appenders send records over a
//! channel; the writer takes every record that is waiting (a batch), writes
//! them and a Commit frame with one `write`, issues one `fdatasync`, and only
//! then tells each appender its record is durable (group commit). With
//! `commit_delay` set, a batch stays open that long after its first record
//! was sent; the writer sleeps through it rather than waking for every
//! record that joins. A delivered message's Done is lazy: it waits,
//! unwritten, for the next batch written anyway (or `done_wait`, 2 ms), so it costs no
//! fdatasync of its own; losing it to a crash sends the message again after
//! the restart (at-least-once), never loses one. A segment is sealed when it
//! passes `segment_bytes`; the new file and the directory are fsynced before
//! any record in it is acknowledged. A start goes on writing the last
//! segment after recovery cut its torn tail (durably), so it needs no disk
//! room of its own; only a last segment with corruption in it, or in an
//! older format version, gets a new head.
//!
//! # Crash rules
//!
//! - Only records whose batch was fsynced were acknowledged, so only the last
//!   batch of the last segment can be torn. On recovery a bad frame (short,
//!   zero length, over-long, bad CRC, sequence going backwards) in the last
//!   segment with no valid frame after it is a torn tail: the file is
//!   truncated there and fsynced. A zero-filled (preallocated) tail is a torn
//!   tail too. The kernel may write a batch's pages back in any order, so the
//!   last batch can also be torn with its later pages on disk and earlier ones
//!   not: a bad frame followed only by frames of the last batch (no Commit
//!   after it, or just the final one, whose batch began at or before the bad
//!   frame) is cut off the same way, whatever `on_corruption` says. Bytes that
//!   rotted inside the last batch after it was acknowledged look the same;
//!   nothing on disk tells the two apart.
//! - A bad frame anywhere else is corruption: it is reported with segment and
//!   offset and counted, then either skipped (delayd resynchronises on the next
//!   valid frame) or refused (recovery fails), as `on_corruption` says. It
//!   never panics.
//! - A write error (for example `ENOSPC`) fails the batch and cuts the file
//!   back to where the batch began, so no half-written batch sits in front of
//!   later records. An `fsync` error is fatal: the log stops accepting writes
//!   and the process must exit. It never retries an `fsync`, because the kernel
//!   may already have dropped the dirty pages.
//! - A message is live from its Schedule until a Done with its id. Recovery
//!   replays frames in order: a later Schedule with the same id (a compaction
//!   copy) replaces the earlier one; a Done removes it.
//!
//! # Space
//!
//! A sealed segment can be deleted once it holds no live Schedule and every
//! segment its Done frames point to is gone (otherwise a deleted Done would let
//! an older Schedule come back). A sealed segment whose live fraction falls
//! under a threshold is compacted: its live Schedules, and the Dones still
//! needed, are appended again at the head, fsynced, and the segment is deleted.
//! The directory is fsynced after every create and delete, and a WAL
//! directory delayd creates (`create_dir`) is fsynced into its parent.
//!
//! # Files
//!
//! Every open, write, sync, cut, rename and remove goes through
//! [`fs::FileSystem`] (`WalConfig::fs`, [`StdFs`] but in tests), so the
//! power-loss tests can run the log on a file system that forgets what was
//! not synced (`sim.rs`, `power_loss.rs`).
//!
//! A crash between a compaction's copy and the deletion leaves a message's
//! Schedule twice on disk. The copy's segment then may not be deleted before
//! the original's (recovery notices the pair; a running compaction records it
//! at once): a Done names only the copy's segment, and deleting it first would
//! let the original come back.
//!
//! A message retired while compaction copies it gets a Done naming the
//! original's segment, then (from the compaction) a second one naming the
//! copy's. A crash between the two leaves a copy retired only by a Done that
//! outlives nothing but the original: recovery notices (a Done for a message
//! whose live Schedule is such a copy, and none naming the copy's segment)
//! and the engine writes the missing Done before it deletes anything.

mod claims;
pub(crate) mod frame;
pub mod fs;
mod halt;
pub mod ledger;
mod lock;
pub(crate) mod reader;
mod recovery;
pub(crate) mod reserve;
mod segments;
#[cfg(test)]
pub(crate) mod sim;
mod writer;

pub use claims::{Claim, Claims};
pub use frame::{Record, RecordRef, Remembered, SCHEDULE_OVERHEAD};
pub use fs::{FileSystem, StdFs, WalFile};
pub use halt::Halt;
pub use lock::{live_holder, LOCK_FILE};
pub use reader::{inspect_segment, FrameSummary, SegmentScan};
pub use recovery::{Corruption, RecoveryReport};
pub use segments::SpaceReport;
pub use writer::Claimed;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use self::ledger::Ledger;
use self::reserve::Reserve;
use self::segments::SegmentTable;
use self::writer::{AppendRequest, Writer};

/// Where a Schedule frame sits: segment ordinal and byte offset of the frame.
/// Ordinals are assigned in log order at open time and never reused in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WalPos {
    pub segment: u32,
    pub offset: u32,
}

/// What to do with a corrupt frame in a sealed segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnCorruption {
    /// Report it, count it, and carry on with the next valid frame.
    Skip,
    /// Refuse to open the log.
    Refuse,
}

#[derive(Debug, Clone)]
pub struct WalConfig {
    pub dir: PathBuf,
    /// A segment is sealed once it grows past this many bytes.
    pub segment_bytes: u64,
    /// Largest encoded message accepted on append.
    pub max_message_bytes: u32,
    /// A sealed segment with fewer live records than this fraction is compacted.
    pub compact_below: f64,
    pub on_corruption: OnCorruption,
    /// Most bytes written per group commit.
    pub max_batch_bytes: usize,
    /// Longest a delivered message's Done waits, unwritten, for a batch
    /// written anyway (see [`Wal::append_fired`]). Default 2 ms: a Done
    /// not yet durable when delayd is killed means a duplicate after the
    /// restart, so the wait is kept short (`wal.done_wait`).
    pub lazy_done_wait: std::time::Duration,
    /// How long a group commit waits for more records after its first one
    /// (0: it starts at once). Fewer fdatasyncs for a later ack; a message's
    /// due time counts from its arrival, so this never delays a delivery.
    pub commit_delay: std::time::Duration,
    /// Create `dir` if it is missing. Off by default: a missing directory
    /// may be a volume that is not mounted, and starting empty there would
    /// silently drop every pending message.
    pub create_dir: bool,
    /// Bytes of the volume a ballast file keeps for the writes that free
    /// space (see [`reserve`]); 0 keeps none.
    pub reserve_bytes: u64,
    /// Remembered frames the ledger of owed frames holds (see [`ledger`]).
    pub owed_frames: usize,
    /// The file layer every file operation of the log goes through:
    /// [`StdFs`] but in tests (see [`fs`]).
    pub fs: Arc<dyn FileSystem>,
}

impl WalConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            segment_bytes: 64 << 20,
            max_message_bytes: 16 << 20,
            compact_below: 0.5,
            on_corruption: OnCorruption::Skip,
            max_batch_bytes: 4 << 20,
            lazy_done_wait: std::time::Duration::from_millis(2),
            commit_delay: std::time::Duration::ZERO,
            create_dir: false,
            reserve_bytes: 0,
            owed_frames: ledger::DEFAULT_FRAMES,
            fs: Arc::new(StdFs),
        }
    }
}

/// Whether a new Schedule is held to `max_message_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeLimit {
    /// A message taken in: refused above the limit.
    Applies,
    /// A stored record's copy (a redelivery stored again under its id):
    /// its bytes were taken in under the limit of their day. Refused under
    /// a lower one, the twin it may be went to the invalid destination
    /// while its record stood for another (sim seed 309,433).
    Waived,
}

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("WAL I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no space left for the WAL in {0} (writes resume when space frees up)")]
    DiskFull(PathBuf),
    #[error("WAL {op} failed on {path}: {source}; the log is stopped and delayd must exit")]
    Fatal {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the WAL is stopped after a fatal error")]
    Stopped,
    #[error("message of {size} bytes exceeds the maximum of {max} bytes")]
    TooLarge { size: usize, max: u32 },
    #[error("corrupt WAL frame in {segment} at offset {offset}: {reason}")]
    Corrupt {
        segment: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("WAL segment ordinal {0} is gone")]
    NoSegment(u32),
    /// From [`Wal::read_cached`]: the frame is not all in the page cache.
    #[error("the WAL frame is not in the page cache")]
    NotCached,
    #[error("{0}")]
    Invalid(String),
    #[error("WAL directory {} does not exist (an unmounted volume?); create it, or set wal.create_dir = true to let delayd create it", .0.display())]
    MissingDir(PathBuf),
    #[error("WAL directory {} is in use by another delayd (pid {}); one process per WAL directory", .dir.display(), .pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string()))]
    Locked { dir: PathBuf, pid: Option<u32> },
}

impl WalError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        if source.raw_os_error() == Some(28) {
            // ENOSPC
            WalError::DiskFull(path.to_path_buf())
        } else {
            WalError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self, WalError::Fatal { .. } | WalError::Stopped)
    }
}

/// A record made durable by an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// The message id (for a Schedule) or the frame's own seq (for a Done).
    pub id: u64,
    pub pos: WalPos,
}

/// Handle to the log. Cheap to clone.
#[derive(Clone)]
pub struct Wal {
    shared: Arc<Shared>,
}

struct Shared {
    config: WalConfig,
    segments: Arc<Mutex<SegmentTable>>,
    writer: Writer,
    claims: Arc<Claims>,
    reserve: Arc<Reserve>,
    /// The Remembered frames owed (see [`ledger`]); `None` while a full
    /// disk keeps it from being made.
    ledger: Mutex<Option<Ledger>>,
    /// Held for as long as any handle to the log exists.
    _lock: Box<dyn fs::DirGuard>,
}

/// The ledger of owed frames, made if missing; none (with a warning) if
/// it cannot be (a full disk): a later [`Wal::hold_owed_frames`] tries
/// again. A failed sync is fatal.
fn open_ledger(config: &WalConfig) -> Result<Option<Ledger>, WalError> {
    match Ledger::open(&*config.fs, &config.dir, config.owed_frames) {
        Ok(ledger) => Ok(Some(ledger)),
        Err(e @ WalError::Fatal { .. }) => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "cannot make the ledger of owed Remembered frames yet; until it is made, a restart after a full disk may take a cancelled message's late redelivery for a new one");
            Ok(None)
        }
    }
}

impl Wal {
    /// Open the log (creating its directory only if `create_dir`), lock its
    /// directory, replay every frame through `visit` in log order, then start
    /// the writer on the last segment (or a fresh one, if it cannot go on).
    pub fn open(
        config: WalConfig,
        visit: impl FnMut(RecordRef<'_>, WalPos),
    ) -> Result<(Wal, RecoveryReport), WalError> {
        let files = config.fs.clone();
        if !files.is_dir(&config.dir) {
            if !config.create_dir {
                return Err(WalError::MissingDir(config.dir.clone()));
            }
            let created = files
                .create_dir_all(&config.dir)
                .map_err(|e| WalError::io(&config.dir, e))?;
            // Each new directory's name is durable only once its parent is
            // synced: else a power loss could take the whole log with it.
            for dir in &created {
                segments::sync_dir(&*files, fs::parent_dir(dir))?;
            }
        }
        // Before recovery: it truncates, deletes and rewrites files.
        let lock = files.lock_dir(&config.dir)?;
        // Its room is recovery's and the new head's.
        let reserve = Arc::new(Reserve::open(
            files.clone(),
            &config.dir,
            config.reserve_bytes,
        )?);
        let recovery::Recovered {
            table,
            report,
            last,
        } = recovery::recover(&config, visit)?;
        let ledger = open_ledger(&config)?;
        let segments = Arc::new(Mutex::new(table));
        let claims = Arc::new(Claims::default());
        let writer = Writer::start(
            config.clone(),
            segments.clone(),
            claims.clone(),
            reserve.clone(),
            report.next_seq,
            last,
        )?;
        Ok((
            Wal {
                shared: Arc::new(Shared {
                    config,
                    segments,
                    writer,
                    claims,
                    reserve,
                    ledger: Mutex::new(ledger),
                    _lock: lock,
                }),
            },
            report,
        ))
    }

    /// Append a new Schedule. Resolves with its id and position once durable.
    pub fn append_schedule(
        &self,
        due_ms: u64,
        uid: u128,
        route: &str,
        message: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.check_size(route, &message)?;
        self.admit()?;
        self.shared
            .writer
            .send(AppendRequest::new_message(due_ms, uid, route, message))
    }

    /// [`Wal::append_schedule`] for an appender that arms the message: it
    /// resolves with a [`Claim`] to drop once the message is armed. Until
    /// then [`Wal::first_claimed_by_route`] names it (see [`claims`]).
    pub fn append_schedule_claimed(
        &self,
        due_ms: u64,
        uid: u128,
        route: &str,
        message: Vec<u8>,
        limit: SizeLimit,
    ) -> Result<oneshot::Receiver<Result<Claimed, WalError>>, WalError> {
        match limit {
            SizeLimit::Applies => self.check_size(route, &message)?,
            SizeLimit::Waived => self.check_route(route)?,
        }
        self.admit()?;
        self.shared
            .writer
            .send_claimed(AppendRequest::new_message(due_ms, uid, route, message))
    }

    /// A new message is taken in only while the disk reserve is held:
    /// otherwise the disk is full, and its room belongs to the writes that
    /// free space (see [`reserve`]).
    fn admit(&self) -> Result<(), WalError> {
        if self.has_room()? {
            Ok(())
        } else {
            Err(WalError::DiskFull(self.shared.config.dir.clone()))
        }
    }

    /// Whether writes that take space (new messages, spills) may go on:
    /// the disk reserve is held, or is made again now that there is room.
    pub fn has_room(&self) -> Result<bool, WalError> {
        self.shared.reserve.restore()
    }

    /// Bytes free on the WAL's volume (the disk reserve's ballast, when
    /// held, is not free).
    pub fn free_bytes(&self) -> Result<u64, WalError> {
        let dir = &self.shared.config.dir;
        let space = self.fs().space(dir).map_err(|e| WalError::io(dir, e))?;
        Ok(space.available)
    }

    /// How many bytes of dead segments may wait for their Remembered frames
    /// (see `engine::compact`): a segment's or the disk reserve's worth,
    /// whichever is more, so a full disk still empties.
    pub fn hold_back_limit(&self) -> u64 {
        let config = &self.shared.config;
        config.reserve_bytes.max(config.segment_bytes)
    }

    /// The size of segment `ordinal` (0 if it is gone).
    pub fn segment_size(&self, ordinal: u32) -> u64 {
        self.segments().bytes(ordinal).unwrap_or(0)
    }

    /// Whether the disk reserve is held (not given out to a full disk).
    pub fn reserve_is_held(&self) -> bool {
        self.shared.reserve.is_held()
    }

    /// The room the disk reserve gives the writes that free space when a
    /// full disk releases it (0: no reserve is kept).
    pub fn reserve_size(&self) -> u64 {
        self.shared.reserve.size()
    }

    /// The Remembered frames a previous run owed (see [`ledger`]), read
    /// before the log is opened so that its replay can apply later marks
    /// to them. None without a ledger.
    pub fn read_owed_frames(config: &WalConfig) -> Result<Vec<Remembered>, WalError> {
        ledger::read_owed(&*config.fs, &config.dir)
    }

    /// Make the ledger of owed frames hold `frames`, durably: returns how
    /// many of them (the first) it holds. 0 while a full disk keeps the
    /// ledger from being made; then they are owed in memory only.
    pub fn hold_owed_frames(&self, frames: &[Remembered]) -> Result<usize, WalError> {
        let mut ledger = self.shared.ledger.lock().expect("ledger lock poisoned");
        if ledger.is_none() {
            if frames.is_empty() {
                return Ok(0);
            }
            *ledger = open_ledger(&self.shared.config).map_err(|e| self.check_fatal(e))?;
        }
        match ledger.as_mut() {
            Some(ledger) => ledger.hold(frames).map_err(|e| self.check_fatal(e)),
            None => Ok(0),
        }
    }

    /// The ids of the frames the ledger of owed frames holds now (fewer
    /// than a start read back if it was made again smaller).
    pub fn owed_frames_held(&self) -> std::collections::HashSet<u64> {
        let ledger = self.shared.ledger.lock().expect("ledger lock poisoned");
        ledger
            .as_ref()
            .map(|l| l.frames().iter().map(|f| f.id).collect())
            .unwrap_or_default()
    }

    /// Keep the disk reserve at least `bytes` large (see
    /// [`reserve::Reserve::keep_at_least`]).
    pub fn keep_reserve_at_least(&self, bytes: u64) {
        self.shared.reserve.keep_at_least(bytes);
    }

    /// A write failed with ENOSPC: give the reserve's room to the writes
    /// that free space. True if there was a reserve to give.
    pub fn release_reserve(&self) -> bool {
        self.shared.reserve.release()
    }

    /// Per route with an open claim, the earliest (due, id) of a durable
    /// Schedule whose appender has not dropped its claim yet.
    pub fn first_claimed_by_route(&self) -> HashMap<Arc<str>, (u64, u64)> {
        self.shared.claims.first_by_route()
    }

    /// Append a Schedule for a message that comes back from elsewhere (the
    /// far tier): a new id, its identity `uid` kept, and no size check (it
    /// was accepted once, under whatever limit applied then).
    pub fn append_returning(
        &self,
        due_ms: u64,
        uid: u128,
        route: &str,
        message: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.shared
            .writer
            .send(AppendRequest::schedule(due_ms, uid, route, message))
    }

    /// Append a compaction copy of an existing Schedule (same id and uid),
    /// with an Acked mark right after it in the same batch if `mark_after`
    /// (a record whose ack is settled: the mark lasts as long as the copy).
    pub fn append_copy(
        &self,
        id: u64,
        due_ms: u64,
        uid: u128,
        route: &str,
        message: Vec<u8>,
        mark_after: Option<u64>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.shared.writer.send(AppendRequest::copy(
            id, due_ms, uid, route, message, mark_after,
        ))
    }

    /// Append a Done for the message whose Schedule sits at `pos`, and count
    /// that Schedule as dead. Durability is not awaited by callers that can
    /// accept a republish after a crash (the at-least-once window).
    pub fn append_done(
        &self,
        id: u64,
        pos: WalPos,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        let first_seq = self.retire_in_table(pos)?;
        self.shared.writer.send(AppendRequest::done(id, first_seq))
    }

    /// [`Wal::append_done`] with Acked `marks` written just before the Done,
    /// in the same batch and so the same segment: they last as long as the
    /// Done (a cancel's marks, `engine::dedup::CANCELLED_MARK` set).
    pub fn append_done_with_marks(
        &self,
        id: u64,
        pos: WalPos,
        marks: Vec<u64>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        let first_seq = self.retire_in_table(pos)?;
        self.shared
            .writer
            .send(AppendRequest::done_with_marks(id, first_seq, marks))
    }

    /// [`Wal::append_done_with_marks`] for a cancel: the Schedule's
    /// segment stays until the Done is durable, and if the Done fails the
    /// Schedule is live again (see [`writer::RetireHold`]), so that the
    /// message the cancel puts back is still on disk.
    pub fn append_retiring_done(
        &self,
        id: u64,
        pos: WalPos,
        marks: Vec<u64>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        let first_seq = self
            .segment_first_seq(pos.segment)
            .ok_or(WalError::NoSegment(pos.segment))?;
        let hold = writer::RetireHold::take(&self.shared.segments, pos.segment);
        self.shared
            .writer
            .send(AppendRequest::retiring_done(id, first_seq, marks, hold))
    }

    /// Acked `marks`, then a Done for `id` naming `segment`, where a
    /// restart reads its record back (its Schedule, retired already, or its
    /// Remembered frame): in one batch, so the marks last as long as that
    /// segment does. `None` if that segment is gone (nothing is written).
    pub fn append_marks_kept_by(
        &self,
        id: u64,
        segment: u32,
        marks: Vec<u64>,
    ) -> Result<Option<oneshot::Receiver<Result<Appended, WalError>>>, WalError> {
        let Some(first_seq) = self.segment_first_seq(segment) else {
            return Ok(None);
        };
        self.append_done_naming(id, first_seq, marks).map(Some)
    }

    /// Count the Schedule at `pos` dead; the first seq of its segment (what
    /// a Done names).
    fn retire_in_table(&self, pos: WalPos) -> Result<u64, WalError> {
        let mut table = self.shared.segments.lock().expect("segment table poisoned");
        table.mark_dead(pos.segment);
        table
            .first_seq(pos.segment)
            .ok_or(WalError::NoSegment(pos.segment))
    }

    /// [`Wal::append_done`] for a message that was delivered: written
    /// without an fdatasync of its own (the next batch that needs one, or
    /// a timer, makes it durable). A crash before that sends the message
    /// again after the restart, which at-least-once allows; every other
    /// Done (cancel, hand-off, compaction) waits for its fdatasync.
    pub fn append_fired(&self, id: u64, pos: WalPos) -> Result<(), WalError> {
        let first_seq = self.retire_in_table(pos)?;
        self.shared
            .writer
            .send(AppendRequest::lazy_done(id, first_seq))
            .map(drop)
    }

    /// Mark stored message `id` as acknowledged to its source (the ack was
    /// confirmed): a restart then no longer takes a redelivery with its
    /// bytes for it. Lazy, like [`Wal::append_fired`]'s Done: a crash that
    /// loses the mark leaves the message among those a restart compares.
    /// `keeps`: the segment a restart reads the record back from, if not
    /// the one its id was written to (a compaction copy's): the mark
    /// outlives it.
    pub fn append_acked(&self, id: u64, keeps: Option<u32>) -> Result<(), WalError> {
        self.shared
            .writer
            .send(AppendRequest::Acked {
                id,
                lazy: true,
                keeps,
            })
            .map(drop)
    }

    /// [`Wal::append_acked`], durable (with whatever was queued before it)
    /// when the returned receiver answers.
    pub fn append_acked_now(
        &self,
        id: u64,
        keeps: Option<u32>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.shared.writer.send(AppendRequest::Acked {
            id,
            lazy: false,
            keeps,
        })
    }

    /// [`SegmentTable::keep_mark`]: a start's replay finds these pairs; the
    /// writer keeps them at run time.
    pub fn keep_mark(&self, mark: u32, marked: u64, record: u32) {
        self.segments().keep_mark(mark, marked, record);
    }

    /// [`SegmentTable::copy_mark_home`].
    pub fn copy_mark_home(&self, mark: u32, marked: u64) -> Option<u32> {
        self.segments().copy_mark_home(mark, marked)
    }

    /// Write what redelivery detection remembers of a message whose
    /// Schedule's (or previous Remembered frame's) segment is about to go;
    /// durable when the receiver answers. On the disk reserve's room if need
    /// be, like a Done (the segment's deletion frees more); if even that
    /// fails, the caller goes on without it (see the module doc).
    pub fn append_remembered(
        &self,
        remembered: Remembered,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.shared
            .writer
            .send(AppendRequest::Remembered(remembered))
    }

    /// Re-append a Done copied out of a segment being compacted.
    pub(crate) fn append_done_copy(
        &self,
        id: u64,
        schedule_segment_first_seq: u64,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.append_done_naming(id, schedule_segment_first_seq, Vec::new())
    }

    /// A Done for the Schedule `id` in the segment whose first seq is
    /// `schedule_segment_first_seq`, with `marks` in its batch (so in its
    /// segment, kept as long as the Done is).
    pub(crate) fn append_done_naming(
        &self,
        id: u64,
        schedule_segment_first_seq: u64,
        marks: Vec<u64>,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        self.shared.writer.send(AppendRequest::done_with_marks(
            id,
            schedule_segment_first_seq,
            marks,
        ))
    }

    /// Keep segment `copy` (and so every Done naming it) until segment
    /// `original` is gone. `copy` holds a compaction copy of a Schedule that
    /// `original` still holds too: if `copy` went first, a Done for that
    /// message would go with it, and the original would come back.
    pub fn keep_after(&self, copy: u32, original: u32) {
        self.segments().keep_after(copy, original);
    }

    /// Count a Schedule as dead without writing a Done (its Done already exists).
    pub fn mark_dead(&self, pos: WalPos) {
        self.segments().mark_dead(pos.segment);
    }

    /// Read the Schedule frame at `pos`. Blocks while the disk reads it.
    pub fn read(&self, pos: WalPos) -> Result<Record, WalError> {
        self.read_from(pos, reader::Source::Disk)
    }

    /// Read the Schedule frame at `pos` if it is all in the page cache, as a
    /// recently written one usually is; `None` if reading it would wait for
    /// the disk (or the file system cannot tell), so it is safe to call on an
    /// async thread.
    pub fn read_cached(&self, pos: WalPos) -> Option<Result<Record, WalError>> {
        match self.read_from(pos, reader::Source::CacheOnly) {
            Err(WalError::NotCached) => None,
            other => Some(other),
        }
    }

    fn read_from(&self, pos: WalPos, source: reader::Source) -> Result<Record, WalError> {
        let (file, path, salt) = self
            .segments()
            .file(pos.segment)
            .ok_or(WalError::NoSegment(pos.segment))?;
        reader::read_frame_at(
            &*file,
            &path,
            pos.offset as u64,
            frame::MAX_LEN,
            salt,
            source,
        )
    }

    /// Every frame of a sealed segment with its offset (for compaction and inspection).
    pub fn scan_segment(&self, segment: u32) -> Result<Vec<(u32, Record)>, WalError> {
        let (file, path, _) = self
            .segments()
            .file(segment)
            .ok_or(WalError::NoSegment(segment))?;
        reader::scan_file(&*file, &path, frame::MAX_LEN)
    }

    /// Set the live-record counts after recovery (the caller knows liveness).
    pub fn set_live_counts(&self, live: impl IntoIterator<Item = WalPos>) {
        let mut table = self.segments();
        table.clear_live();
        for pos in live {
            table.add_live(pos.segment);
        }
    }

    /// Delete every sealed segment that no longer holds anything needed.
    /// Returns how many were deleted.
    pub fn collect_garbage(&self) -> Result<usize, WalError> {
        self.collect_garbage_after(|_| Vec::new())
    }

    /// [`Wal::collect_garbage`], calling `before` with the segments about to
    /// be deleted while they are still readable; it returns those to keep
    /// for now.
    pub fn collect_garbage_after(
        &self,
        before: impl FnOnce(&[u32]) -> Vec<u32>,
    ) -> Result<usize, WalError> {
        let mut deletable = self.segments().deletable();
        if !deletable.is_empty() {
            let keep = before(&deletable);
            if !keep.is_empty() {
                // Not only those: a segment whose Dones retire Schedules in
                // a kept one stays as long (else they would come back). And
                // only of those `before` saw: a segment sealed meanwhile
                // may hold the Remembered frames it wrote just now (sim
                // seed 212,067: deleted in the same round, a restart forgot
                // the record, and its redelivery fired under a new id).
                deletable = self.segments().deletable_among(Some(&deletable), &keep);
            }
        }
        let mut deleted = 0;
        for ordinal in deletable {
            let removed = self.segments().remove(ordinal);
            if let Some(path) = removed {
                self.fs()
                    .remove_file(&path)
                    .map_err(|e| WalError::io(&path, e))?;
                deleted += 1;
            }
        }
        if deleted > 0 {
            segments::sync_dir(self.fs(), &self.shared.config.dir)
                .map_err(|e| self.check_fatal(e))?;
        }
        Ok(deleted)
    }

    /// The sealed segment most worth compacting at `now_ms`, if any is
    /// under the threshold.
    pub fn compaction_candidate(&self, now_ms: u64) -> Option<u32> {
        self.segments()
            .compaction_candidate(self.shared.config.compact_below, now_ms)
    }

    /// Live Schedules in a segment: every one written and not yet retired
    /// by a Done, including those whose appender has not yet seen them
    /// durable.
    pub fn segment_live(&self, segment: u32) -> u64 {
        self.segments().live(segment)
    }

    /// The first_seq of a segment ordinal (for Done references).
    pub fn segment_first_seq(&self, segment: u32) -> Option<u64> {
        self.segments().first_seq(segment)
    }

    /// Whether segment `segment` must outlive a segment that still exists
    /// (its Dones may be all that retires a Schedule copy there).
    pub fn outlives_existing(&self, segment: u32) -> bool {
        self.segments().outlives_existing(segment)
    }

    /// Whether the segment with this first_seq still exists.
    /// The first seq of the segment that seq `seq` was written to, if it is
    /// still on disk (a record's Schedule, by its id, while not compacted).
    pub fn segment_covering(&self, seq: u64) -> Option<u64> {
        self.segments().covering(seq)
    }

    pub fn segment_exists(&self, first_seq: u64) -> bool {
        self.segments().ordinal_of(first_seq).is_some()
    }

    /// Drop a segment after compaction moved everything needed out of it.
    pub fn remove_compacted(&self, segment: u32) -> Result<(), WalError> {
        let removed = {
            let mut table = self.segments();
            // A cancel's Done on its way for a Schedule here: should it
            // fail, that Schedule is live again, so garbage collection
            // deletes the segment once the Done is durable instead.
            match table.is_retiring(segment) {
                true => None,
                false => table.remove(segment),
            }
        };
        if let Some(path) = removed {
            self.fs()
                .remove_file(&path)
                .map_err(|e| WalError::io(&path, e))?;
            segments::sync_dir(self.fs(), &self.shared.config.dir)
                .map_err(|e| self.check_fatal(e))?;
        }
        Ok(())
    }

    pub fn space(&self) -> SpaceReport {
        self.segments().space()
    }

    /// Group commits (fdatasyncs) done since the log was opened.
    pub fn fsyncs(&self) -> u64 {
        self.shared.writer.fsyncs()
    }

    /// True once a fatal error stopped the log: the process must exit.
    /// Every id of a durable record, before and since this start, is below
    /// this; every id handed out from now on is at or above it (the ids of
    /// a batch that failed are not counted: a restart may hand them out).
    pub fn next_id(&self) -> u64 {
        self.shared.writer.next_seq()
    }

    /// The writer has answered every record sent to it.
    pub fn is_idle(&self) -> bool {
        self.shared.writer.is_idle()
    }

    /// Records sent to the writer and not yet answered.
    pub fn unanswered(&self) -> u64 {
        self.shared.writer.unanswered()
    }

    pub fn is_stopped(&self) -> bool {
        self.shared.writer.is_stopped()
    }

    /// The fatal-error latch, to wait on or to read the reason from.
    pub fn halt(&self) -> &Halt {
        self.shared.writer.halt()
    }

    /// Pass an error on, stopping the log first if it is fatal (a failed
    /// directory fsync during garbage collection, say).
    fn check_fatal(&self, e: WalError) -> WalError {
        if let WalError::Fatal { .. } = e {
            tracing::error!(error = %e, "stopping the log");
            self.halt().stop(&e);
        }
        e
    }

    /// Wait for everything sent so far to be durable, then stop the writer.
    pub fn close(&self) -> Result<(), WalError> {
        self.shared.writer.close()
    }

    fn fs(&self) -> &dyn FileSystem {
        &*self.shared.config.fs
    }

    fn segments(&self) -> std::sync::MutexGuard<'_, SegmentTable> {
        self.shared.segments.lock().expect("segment table poisoned")
    }

    fn check_size(&self, route: &str, message: &[u8]) -> Result<(), WalError> {
        let max = self.shared.config.max_message_bytes;
        if message.len() > max as usize {
            return Err(WalError::TooLarge {
                size: message.len(),
                max,
            });
        }
        self.check_route(route)
    }

    fn check_route(&self, route: &str) -> Result<(), WalError> {
        if route.len() > u16::MAX as usize {
            return Err(WalError::Invalid(format!(
                "route name of {} bytes is longer than 65535",
                route.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod power_loss;
#[cfg(test)]
mod tests;

/// Tests only: drop the (clean, fsynced) pages of every segment in `dir`
/// from the page cache, as memory pressure would. False on a file system
/// that keeps files only in memory (tmpfs), where nothing can be dropped.
#[cfg(test)]
pub(crate) fn evict_from_page_cache(dir: &Path) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    if rustix::fs::statfs(dir).expect("statfs").f_type as i64 == TMPFS_MAGIC {
        return false;
    }
    for entry in std::fs::read_dir(dir).expect("read WAL dir") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "log") {
            let file = std::fs::File::open(&path).expect("open segment");
            rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).expect("fadvise");
        }
    }
    true
}
