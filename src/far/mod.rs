//! The far tier: messages due beyond the engine's horizon, kept on disk only.
//!
//! A message due within the horizon (an hour by default) waits in the timing
//! wheel, its record in the WAL. One due later is *spilled*: its record is
//! copied into the bucket file for its due time and its WAL record retired,
//! so it costs no RAM and holds no WAL segment. As the horizon reaches a
//! bucket the engine *loads* it: the records go back into the WAL and the
//! wheel in (due, id) order, and the file is deleted. The models are Pulsar's
//! PIP-195 buckets and RocketMQ's TimerLog; unlike both, a bucket holds the
//! messages themselves, so loading one reads one file front to back.
//!
//! # Files
//!
//! `<wal.dir>/far/` holds:
//!
//! - `bucket-<start_ms>.log` (20 digits): every message due in
//!   `[start, start + bucket_ms)`, in the WAL's segment format (salted
//!   header, CRC frames, see `crate::wal`). A Schedule frame is a message as
//!   the WAL stored it, with its WAL id; a Done frame cancels that id in
//!   this bucket. Frame seqs increase across the whole tier, so each file's
//!   do, as the WAL's scanner requires.
//! - `checkpoint`: JSON. The frontier (buckets before it are loaded), the
//!   next frame seq, every bucket's durable length, salt, smallest id and
//!   count per route. Written to `checkpoint.tmp`, synced, renamed, and the
//!   directory synced.
//! - `tombstones.log`: the cancels by key still to apply, a line each,
//!   appended and synced; one entry per key in memory (`tombstones.rs`).
//!   One is dropped once no bucket holds a message of its route with a
//!   smaller id.
//!
//! # Crash rules
//!
//! - A spill writes the frames, syncs each file it touched, writes the
//!   checkpoint, and only then retires the messages in the WAL. Bytes past a
//!   bucket's checkpointed length (or a bucket the checkpoint does not name)
//!   were never counted, and the WAL still holds them live: opening cuts them
//!   off and the engine spills those messages again. Opening therefore reads
//!   the checkpoint and one `stat` per bucket, never a bucket's contents.
//! - A crash after the checkpoint and before the WAL's Done spills the
//!   message a second time. Reading a bucket keeps one record per id.
//! - A load appends a bucket's records to the WAL under new ids (their
//!   identity, the `x-delayd-id`, kept; the old ids are retired there, and
//!   compaction may copy a retiring Done past a record that reused one),
//!   waits for them to be durable, writes the checkpoint without the bucket
//!   and deletes it, and only then arms them. Before the first copy it
//!   checkpoints a `loading` marker: the bucket, and an id every copy is
//!   above. A crash (or a failed append) between the copies and the
//!   bucket's removal leaves both, and the marker: the next load of that
//!   bucket skips each record whose copy (same `x-delayd-id` and due time,
//!   an id above the marker's) is live in the WAL or was spilled back into
//!   the bucket, so each message fires once.
//! - A bad frame inside a bucket's checkpointed length is corruption: it is
//!   logged and counted like the WAL's, and the frames after it are read.
//! - A failed append is cut back in every bucket it touched (a new bucket
//!   removed), its frame seqs are never handed out again, and an append
//!   first cuts whatever lies past the checkpointed length. A failed fsync
//!   anywhere here is fatal, as the WAL's is.
//!
//! # Memory
//!
//! A bucket is never read whole: `stream.rs` walks it through a window and
//! keeps an index of its live records without their bytes (about 40 bytes
//! each), and a load copies a chunk of records at a time
//! (`FarSettings::load_chunk_bytes`), each durable before the next is read.

mod checkpoint;
mod stream;
#[cfg(test)]
mod tests;
mod tombstones;

pub use stream::Entry;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::wal::frame::{self, Salt, Schedule};
use crate::wal::fs::{parent_dir, FileSystem, WalFile};
use crate::wal::WalError;

use self::checkpoint::{BucketMeta, Checkpoint, Loading};
use self::tombstones::{KeyTombstone, Tombstones};

/// Where the far tier lives and how wide a bucket is.
#[derive(Debug, Clone)]
pub struct FarConfig {
    pub dir: PathBuf,
    /// Width of a bucket in due time for a new tier (the engine uses its
    /// horizon); an existing tier keeps the width its checkpoint names.
    pub bucket_ms: u64,
    /// Longest frame accepted when reading (the WAL's limit).
    pub max_frame_len: u32,
    pub fs: Arc<dyn FileSystem>,
}

/// A message as the WAL stored it, moving to or from the far tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FarRecord {
    pub id: u64,
    pub due_ms: u64,
    pub uid: u128,
    pub route: String,
    pub message: Vec<u8>,
}

/// Reads the lookup key out of a stored message (see `EngineConfig::key_of`).
pub type KeyOf = fn(&[u8]) -> Option<&[u8]>;

/// A bucket's live records, in (due, id) order, and those a key tombstone
/// cancelled (to be reported, never loaded).
#[derive(Debug, Default)]
pub struct BucketRead {
    pub live: Vec<FarRecord>,
    pub tombstoned: Vec<FarRecord>,
}

#[derive(Debug, thiserror::Error)]
pub enum FarError {
    #[error(transparent)]
    Io(#[from] WalError),
    #[error("far tier checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("far tier bucket {path} is shorter ({found} bytes) than its checkpoint says ({expected}): bytes that were synced are gone")]
    Shrunk {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("far tier bucket {0} is named in the checkpoint but missing")]
    Missing(PathBuf),
}

/// The far tier's files and what the checkpoint says of them.
pub struct FarStore {
    config: FarConfig,
    cp: Checkpoint,
    tombstones: Tombstones,
    /// Bad frames met inside checkpointed lengths since opening.
    corrupt_frames: std::sync::atomic::AtomicU64,
}

const CHECKPOINT: &str = "checkpoint";
const CHECKPOINT_TMP: &str = "checkpoint.tmp";

fn bucket_name(start: u64) -> String {
    format!("bucket-{start:020}.log")
}

fn parse_bucket_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("bucket-")?.strip_suffix(".log")?;
    (digits.len() == 20).then(|| digits.parse().ok())?
}

impl FarStore {
    /// Open (or create) the tier. `frontier` is used for a new one: the
    /// first bucket start not yet loaded, i.e. where the wheel's part ends.
    /// Cuts every bucket to its checkpointed length; reads no bucket.
    pub fn open(config: FarConfig, frontier: u64) -> Result<FarStore, FarError> {
        let fs = &*config.fs;
        let dir = config.dir.clone();
        if !fs.is_dir(&dir) {
            let created = fs.create_dir_all(&dir).map_err(|e| WalError::io(&dir, e))?;
            for d in created {
                sync_dir(fs, parent_dir(&d))?;
            }
        }
        let mut cp = match checkpoint::read(fs, &dir.join(CHECKPOINT))? {
            Some(cp) => cp,
            None => Checkpoint::new(frontier, config.bucket_ms),
        };
        // An older checkpoint's tombstones move to the log (synced there
        // before the next checkpoint drops them).
        let tombstones = Tombstones::open(config.fs.clone(), &dir, &cp.tombstones)?;
        cp.tombstones.clear();
        if cp.buckets.is_empty() {
            // Nothing is on disk, so no bucket lies before any frontier: one
            // a whole load moved far out (the switch to the broker-kept
            // store) comes back, or nothing would spill until then.
            // A bucket's start, in the tier's width (the horizon that
            // computed `frontier` may have changed since).
            cp.frontier = cp.frontier.min(frontier.next_multiple_of(cp.bucket_ms));
        }
        let mut store = FarStore {
            config,
            cp,
            tombstones,
            corrupt_frames: Default::default(),
        };
        store.trim()?;
        Ok(store)
    }

    /// Make the files agree with the checkpoint: cut what follows each
    /// bucket's checkpointed length, remove buckets it does not name.
    fn trim(&mut self) -> Result<(), FarError> {
        let fs = &*self.config.fs;
        let dir = &self.config.dir;
        let mut seen = HashSet::new();
        let mut removed = false;
        for path in fs.list(dir).map_err(|e| WalError::io(dir, e))? {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name == CHECKPOINT_TMP {
                fs.remove_file(&path).map_err(|e| WalError::io(&path, e))?;
                removed = true;
                continue;
            }
            let Some(start) = parse_bucket_name(name) else {
                continue;
            };
            let Some(meta) = self.cp.buckets.get(&start) else {
                tracing::info!(bucket = %path.display(), "removing a far bucket written after the last checkpoint; its messages are still in the WAL");
                fs.remove_file(&path).map_err(|e| WalError::io(&path, e))?;
                removed = true;
                continue;
            };
            seen.insert(start);
            let file = fs.open_write(&path).map_err(|e| WalError::io(&path, e))?;
            let size = file.size().map_err(|e| WalError::io(&path, e))?;
            if size < meta.bytes {
                return Err(FarError::Shrunk {
                    path,
                    found: size,
                    expected: meta.bytes,
                });
            }
            if size > meta.bytes {
                file.set_len(meta.bytes)
                    .map_err(|e| WalError::io(&path, e))?;
                file.sync_data().map_err(|source| WalError::Fatal {
                    op: "fsync after truncation",
                    path: path.clone(),
                    source,
                })?;
            }
        }
        if let Some(&start) = self.cp.buckets.keys().find(|s| !seen.contains(s)) {
            return Err(FarError::Missing(self.bucket_path(start)));
        }
        if removed {
            sync_dir(fs, dir)?;
        }
        Ok(())
    }

    pub fn bucket_ms(&self) -> u64 {
        self.cp.bucket_ms
    }

    /// The start of the bucket `due_ms` falls in.
    pub fn bucket_of(&self, due_ms: u64) -> u64 {
        due_ms - due_ms % self.cp.bucket_ms
    }

    /// The first bucket start not yet loaded: messages due at or after it
    /// belong here, earlier ones in the wheel.
    pub fn frontier(&self) -> u64 {
        self.cp.frontier
    }

    /// The earliest bucket on disk.
    pub fn first_bucket(&self) -> Option<u64> {
        self.cp.buckets.keys().next().copied()
    }

    /// Bucket starts on disk, in order, from the one holding `from` on.
    pub fn buckets_from(&self, from: u64) -> Vec<u64> {
        let first = self.bucket_of(from);
        self.cp.buckets.range(first..).map(|(&s, _)| s).collect()
    }

    pub fn contains_bucket(&self, start: u64) -> bool {
        self.cp.buckets.contains_key(&start)
    }

    /// Messages per route (a message spilled twice by a crash counts twice
    /// until its bucket is loaded; one cancelled by a key tombstone counts
    /// until then too).
    pub fn counts(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for meta in self.cp.buckets.values() {
            for (route, &n) in &meta.routes {
                *out.entry(route.clone()).or_default() += n;
            }
        }
        out
    }

    /// Each bucket's start and its counts per route.
    pub fn bucket_counts(&self) -> impl Iterator<Item = (u64, &BTreeMap<String, u64>)> {
        self.cp
            .buckets
            .iter()
            .map(|(&start, meta)| (start, &meta.routes))
    }

    /// Bytes on disk in bucket files.
    pub fn bytes(&self) -> u64 {
        self.cp.buckets.values().map(|m| m.bytes).sum()
    }

    /// Bad frames met inside checkpointed lengths since opening.
    pub fn corrupt_frames(&self) -> u64 {
        self.corrupt_frames
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn bucket_count(&self) -> usize {
        self.cp.buckets.len()
    }

    fn bucket_path(&self, start: u64) -> PathBuf {
        self.config.dir.join(bucket_name(start))
    }

    /// The smallest WAL id any bucket holds (`u64::MAX`: none): a record
    /// with a smaller id is in no bucket.
    pub fn min_id(&self) -> u64 {
        self.cp
            .buckets
            .values()
            .map(|m| m.min_id)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The checkpoint's size once `records` are appended, at its largest
    /// (every number at its widest, a load's marker in it): a load after a
    /// full disk must still be able to write it on the disk reserve's room.
    pub fn checkpoint_bytes_after(&self, records: &[FarRecord]) -> Result<usize, FarError> {
        let mut cp = self.cp.clone();
        for r in records {
            let meta = cp
                .buckets
                .entry(self.bucket_of(r.due_ms))
                .or_insert_with(|| BucketMeta::new(u32::MAX));
            meta.bytes = u64::MAX;
            meta.min_id = u64::MAX;
            meta.routes.insert(r.route.clone(), u64::MAX);
        }
        cp.next_seq = u64::MAX;
        cp.loading = Some(Loading {
            bucket: u64::MAX,
            after_id: u64::MAX,
        });
        checkpoint::encoded_len(&cp, &self.config.dir.join(CHECKPOINT))
    }

    /// Append `records` (each due at or after the frontier) to their
    /// buckets, sync every file touched, then write the checkpoint. On an
    /// error nothing is counted and each touched file is cut back.
    pub fn append(&mut self, records: &[FarRecord]) -> Result<(), FarError> {
        if records.is_empty() {
            return Ok(());
        }
        let mut by_bucket: BTreeMap<u64, Vec<&FarRecord>> = BTreeMap::new();
        for r in records {
            debug_assert!(r.due_ms >= self.cp.frontier, "spilling behind the frontier");
            by_bucket
                .entry(self.bucket_of(r.due_ms))
                .or_default()
                .push(r);
        }
        let mut next_seq = self.cp.next_seq;
        let mut written: Vec<(u64, BucketMeta)> = Vec::with_capacity(by_bucket.len());
        // Every bucket written to, the one that failed included.
        let mut touched = Vec::with_capacity(by_bucket.len());
        let mut result = Ok(());
        for (start, recs) in by_bucket {
            let mut meta = self.cp.buckets.get(&start).cloned();
            touched.push(start);
            match self.write_frames(start, meta.as_mut(), &recs, &mut next_seq) {
                Ok(m) => written.push((start, m)),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Seqs handed out are never handed out again, whatever happens to
        // their frames: a stale frame a failed cut-back left behind can
        // then never follow a newer one with a higher seq.
        self.cp.next_seq = next_seq;
        if result.is_ok() {
            let before: Vec<(u64, Option<BucketMeta>)> = written
                .iter()
                .map(|(start, meta)| (*start, self.cp.buckets.insert(*start, meta.clone())))
                .collect();
            result = self.write_checkpoint();
            if result.is_err() {
                for (start, meta) in before {
                    match meta {
                        Some(meta) => self.cp.buckets.insert(start, meta),
                        None => self.cp.buckets.remove(&start),
                    };
                }
            }
        }
        match result {
            Err(e) => Err(self.cut_back(touched.into_iter(), e)),
            ok => ok,
        }
    }

    /// Open bucket `start` to append to, first cutting what lies past its
    /// checkpointed length (a failed append whose cut-back failed too);
    /// `None`: a new bucket, created (a file the checkpoint does not name
    /// holds nothing counted, and goes first).
    fn open_bucket(
        &self,
        start: u64,
        meta: Option<&BucketMeta>,
    ) -> Result<Box<dyn WalFile>, FarError> {
        let fs = &*self.config.fs;
        let path = self.bucket_path(start);
        let io = |e| WalError::io(&path, e);
        let Some(meta) = meta else {
            match fs.remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(e).into()),
            }
            return Ok(fs.create_new(&path).map_err(io)?);
        };
        let file = fs.open_append(&path).map_err(io)?;
        if file.size().map_err(io)? > meta.bytes {
            file.set_len(meta.bytes).map_err(io)?;
            file.sync_data().map_err(|source| WalError::Fatal {
                op: "fsync after cutting a far bucket back",
                path: path.clone(),
                source,
            })?;
        }
        Ok(file)
    }

    /// Write `recs` to bucket `start` (created if `meta` is `None`) and sync
    /// it; returns the bucket's new metadata (not yet checkpointed).
    fn write_frames(
        &self,
        start: u64,
        meta: Option<&mut BucketMeta>,
        recs: &[&FarRecord],
        next_seq: &mut u64,
    ) -> Result<BucketMeta, FarError> {
        let fs = &*self.config.fs;
        let path = self.bucket_path(start);
        let file = self.open_bucket(start, meta.as_deref())?;
        let (mut meta, created) = match meta {
            Some(meta) => (meta.clone(), false),
            None => {
                let salt = Salt::random();
                file.append(&frame::bucket_header(salt.value()))
                    .map_err(|e| WalError::io(&path, e))?;
                (BucketMeta::new(salt.value()), true)
            }
        };
        let salt = Salt::new(meta.salt);
        let mut buf = Vec::with_capacity(
            recs.iter()
                .map(|r| 64 + r.route.len() + r.message.len())
                .sum(),
        );
        for r in recs {
            frame::put_schedule(
                &mut buf,
                salt,
                *next_seq,
                &Schedule {
                    id: r.id,
                    due_ms: r.due_ms,
                    uid: r.uid,
                    route: &r.route,
                    message: &r.message,
                },
            );
            *next_seq += 1;
            *meta.routes.entry(r.route.clone()).or_default() += 1;
            meta.min_id = meta.min_id.min(r.id);
        }
        meta.bytes = append_synced(&*file, &buf, &path)?;
        if created {
            sync_dir(fs, &self.config.dir)?;
        }
        Ok(meta)
    }

    /// After a failed append: cut each touched bucket back to its
    /// checkpointed length (a new one is removed). Best effort (opening,
    /// and the next append to the bucket, cut too), but a failed fsync is
    /// fatal as everywhere else: that error replaces `failed`.
    fn cut_back(&self, starts: impl Iterator<Item = u64>, failed: FarError) -> FarError {
        let fs = &*self.config.fs;
        let warn = |path: &Path, e: std::io::Error| {
            tracing::warn!(bucket = %path.display(), error = %e, "cannot cut a far bucket back after a failed spill; the next append to it or the next start will");
        };
        for start in starts {
            let path = self.bucket_path(start);
            let Some(meta) = self.cp.buckets.get(&start) else {
                if let Err(e) = fs.remove_file(&path) {
                    warn(&path, e);
                }
                continue;
            };
            let cut = fs
                .open_write(&path)
                .and_then(|f| f.set_len(meta.bytes).map(|()| f));
            let file = match cut {
                Ok(file) => file,
                Err(e) => {
                    warn(&path, e);
                    continue;
                }
            };
            if let Err(source) = file.sync_data() {
                return FarError::Io(WalError::Fatal {
                    op: "fsync of a far bucket cut back",
                    path,
                    source,
                });
            }
        }
        failed
    }

    /// Cancel message `id` of `route` in bucket `start`: a Done frame,
    /// synced and checkpointed.
    pub fn cancel(&mut self, start: u64, id: u64, route: &str) -> Result<(), FarError> {
        self.cancel_many(start, &[(id, route)])
    }

    /// Cancel each `(id, route)` in bucket `start`: their Done frames in one
    /// append, one fsync and one checkpoint.
    pub fn cancel_many(&mut self, start: u64, cancels: &[(u64, &str)]) -> Result<(), FarError> {
        let Some(meta) = self.cp.buckets.get(&start).cloned() else {
            return Ok(());
        };
        if cancels.is_empty() {
            return Ok(());
        }
        let path = self.bucket_path(start);
        let mut buf = Vec::new();
        for &(id, _) in cancels {
            frame::put_done(&mut buf, Salt::new(meta.salt), self.cp.next_seq, id, 0);
            // Never handed out again (see `append`).
            self.cp.next_seq += 1;
        }
        let write = || -> Result<u64, FarError> {
            let file = self.open_bucket(start, Some(&meta))?;
            append_synced(&*file, &buf, &path)
        };
        let bytes = match write() {
            Ok(b) => b,
            Err(e) => return Err(self.cut_back(std::iter::once(start), e)),
        };
        let mut updated = meta.clone();
        updated.bytes = bytes;
        for &(_, route) in cancels {
            if let Some(n) = updated.routes.get_mut(route) {
                *n = n.saturating_sub(1);
            }
        }
        self.cp.buckets.insert(start, updated);
        if let Err(e) = self.write_checkpoint() {
            self.cp.buckets.insert(start, meta);
            return Err(self.cut_back(std::iter::once(start), e));
        }
        Ok(())
    }

    /// Remember durably that every message of `route` with lookup key `key`
    /// and an id below `before_id` is cancelled: applied as buckets are
    /// read. A no-op when no bucket could hold such a message. Costs one
    /// append to the tombstone log, whatever the number kept.
    pub fn add_tombstone(
        &mut self,
        route: &str,
        key: &[u8],
        before_id: u64,
    ) -> Result<(), FarError> {
        if !self.tombstone_needed(route, before_id) {
            return Ok(());
        }
        self.tombstones.add(KeyTombstone {
            route: route.to_owned(),
            key: key.to_vec(),
            before_id,
        })
    }

    /// Whether some bucket holds a message of `route` with an id below
    /// `before_id`.
    fn tombstone_needed(&self, route: &str, before_id: u64) -> bool {
        self.cp
            .buckets
            .values()
            .any(|m| m.min_id < before_id && m.routes.get(route).is_some_and(|&n| n > 0))
    }

    pub fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    /// Whether a cancel by key covers message `id` of `route` with lookup
    /// key `key`.
    pub fn key_cancels(&self, id: u64, route: &str, key: Option<&[u8]>) -> bool {
        self.tombstones.cancels(id, route, key)
    }

    /// Bucket `start`'s live records in (due, id) order: one per id,
    /// without cancelled ones; those a key tombstone cancels apart. All in
    /// memory: a load reads a bucket through [`FarStore::reader`] instead.
    pub fn read_bucket(&self, start: u64, key_of: KeyOf) -> Result<BucketRead, FarError> {
        let Some(reader) = self.reader(start)? else {
            return Ok(BucketRead::default());
        };
        let index = reader.index(key_of)?;
        let read = |entries: &[Entry]| -> Result<Vec<FarRecord>, FarError> {
            entries.iter().map(|e| reader.read(e)).collect()
        };
        Ok(BucketRead {
            live: read(&index.live)?,
            tombstoned: read(&index.tombstoned)?,
        })
    }

    /// A reader of bucket `start` (`None`: no such bucket).
    pub fn reader(&self, start: u64) -> Result<Option<BucketReader<'_>>, FarError> {
        let Some(meta) = self.cp.buckets.get(&start) else {
            return Ok(None);
        };
        let path = self.bucket_path(start);
        let file = self
            .config
            .fs
            .open(&path)
            .map_err(|e| WalError::io(&path, e))?;
        Ok(Some(BucketReader {
            store: self,
            file,
            path,
            end: meta.bytes,
            salt: Salt::new(meta.salt),
        }))
    }

    /// A load cut short: (its bucket, the id every copy it made is above).
    pub fn loading(&self) -> Option<(u64, u64)> {
        self.cp.loading.map(|l| (l.bucket, l.after_id))
    }

    /// Checkpoint that bucket `start` is being copied into the WAL under
    /// ids above `after_id`. If an earlier load of it never finished,
    /// nothing is written and its marker's `after_id` is returned: copies
    /// above it may be live already.
    pub fn begin_load(&mut self, start: u64, after_id: u64) -> Result<Option<u64>, FarError> {
        if let Some(l) = self.cp.loading.filter(|l| l.bucket == start) {
            return Ok(Some(l.after_id));
        }
        let before = self.cp.loading.replace(Loading {
            bucket: start,
            after_id,
        });
        if let Err(e) = self.write_checkpoint() {
            self.cp.loading = before;
            return Err(e);
        }
        Ok(None)
    }

    /// Bucket `start` was loaded into the WAL: delete it, move the
    /// frontier to `frontier`, drop tombstones nothing left can match, and
    /// write the checkpoint. Returns the bucket's counts per route.
    pub fn remove_bucket(
        &mut self,
        start: u64,
        frontier: u64,
    ) -> Result<BTreeMap<String, u64>, FarError> {
        let meta = self.cp.buckets.remove(&start);
        let loading = self.cp.loading.take_if(|l| l.bucket == start);
        let old_frontier = self.cp.frontier;
        self.cp.frontier = self.cp.frontier.max(frontier);
        // The checkpoint goes first: a bucket it still named could not be
        // missing at the next open.
        if let Err(e) = self.write_checkpoint() {
            if let Some(meta) = meta {
                self.cp.buckets.insert(start, meta);
            }
            self.cp.frontier = old_frontier;
            self.cp.loading = loading.or(self.cp.loading);
            return Err(e);
        }
        // Tombstones nothing left can match go; keeping one longer is
        // harmless (ids are never handed out again), so this comes after.
        let mut min_id: BTreeMap<&str, u64> = BTreeMap::new();
        for m in self.cp.buckets.values() {
            for (route, _) in m.routes.iter().filter(|(_, &n)| n > 0) {
                let low = min_id.entry(route.as_str()).or_insert(u64::MAX);
                *low = (*low).min(m.min_id);
            }
        }
        self.tombstones
            .prune(|route, before_id| min_id.get(route).is_some_and(|&m| m < before_id))?;
        if meta.is_some() {
            let fs = &*self.config.fs;
            let path = self.bucket_path(start);
            fs.remove_file(&path).map_err(|e| WalError::io(&path, e))?;
            sync_dir(fs, &self.config.dir)?;
        }
        Ok(meta.map(|m| m.routes).unwrap_or_default())
    }

    /// Move the frontier without loading anything (no bucket before it).
    /// Kept in memory; written with the next checkpoint.
    pub fn advance_frontier(&mut self, frontier: u64) {
        debug_assert!(
            self.cp.buckets.range(..frontier).next().is_none(),
            "moving the frontier past a bucket not loaded"
        );
        self.cp.frontier = self.cp.frontier.max(frontier);
    }

    fn write_checkpoint(&self) -> Result<(), FarError> {
        checkpoint::write(
            &*self.config.fs,
            &self.config.dir,
            CHECKPOINT,
            CHECKPOINT_TMP,
            &self.cp,
        )
    }
}

/// One bucket, read a record at a time.
pub struct BucketReader<'s> {
    store: &'s FarStore,
    file: Box<dyn WalFile>,
    path: PathBuf,
    end: u64,
    salt: Salt,
}

impl BucketReader<'_> {
    /// The bucket's live records, without their bytes, in (due, id) order
    /// (see [`stream::BucketIndex`]). Streams the file: a window in memory.
    pub fn index(&self, key_of: KeyOf) -> Result<stream::BucketIndex, FarError> {
        let tombstones = &self.store.tombstones;
        let stream = stream::FrameStream::new(
            &*self.file,
            &self.path,
            self.end,
            self.salt,
            self.store.config.max_frame_len,
        );
        stream::BucketIndex::build(
            stream,
            |id, route, message| tombstones.cancels(id, route, key_of(message)),
            |offset, reason| {
                self.store
                    .corrupt_frames
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                metrics::counter!("delayd_far_corrupt_frames_total").increment(1);
                tracing::error!(bucket = %self.path.display(), offset, %reason, "corrupt frame in a far bucket; reading on after it");
            },
        )
    }

    /// The record an index entry points at.
    pub fn read(&self, entry: &Entry) -> Result<FarRecord, FarError> {
        stream::read_record(
            &*self.file,
            &self.path,
            self.end,
            self.salt,
            self.store.config.max_frame_len,
            entry.offset,
        )
    }
}

/// Append `buf` to a bucket and sync it; its new length.
fn append_synced(file: &dyn WalFile, buf: &[u8], path: &Path) -> Result<u64, FarError> {
    file.append(buf).map_err(|e| WalError::io(path, e))?;
    file.sync_data().map_err(|source| WalError::Fatal {
        op: "fsync of a far bucket",
        path: path.to_path_buf(),
        source,
    })?;
    Ok(file.size().map_err(|e| WalError::io(path, e))?)
}

fn sync_dir(fs: &dyn FileSystem, dir: &Path) -> Result<(), FarError> {
    fs.sync_dir(dir).map_err(|source| {
        FarError::Io(WalError::Fatal {
            op: "fsync of the far tier's directory",
            path: dir.to_path_buf(),
            source,
        })
    })
}
