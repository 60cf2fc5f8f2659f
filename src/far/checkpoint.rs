//! The far tier's checkpoint: what its files hold, written atomically.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::wal::fs::FileSystem;
use crate::wal::WalError;

use super::tombstones::KeyTombstone;
use super::{sync_dir, FarError};

const VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    /// Buckets starting before this are loaded (none is on disk).
    pub frontier: u64,
    /// The seq the next frame gets.
    pub next_seq: u64,
    /// Width of a bucket: fixed when the tier is created (a later horizon
    /// changes when buckets load, not how they are cut).
    pub bucket_ms: u64,
    /// Bucket start -> what the checkpoint vouches for.
    pub buckets: BTreeMap<u64, BucketMeta>,
    /// Key tombstones as checkpoints before `tombstones.log` kept them:
    /// read, moved to the log, and no longer written here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tombstones: Vec<KeyTombstone>,
    /// A load that began and has not removed its bucket yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loading: Option<Loading>,
}

/// Bucket `bucket` is being copied into the WAL, where its copies get ids
/// above `after_id`. Found at the next load of that bucket, it means some
/// copies may already be live there (a crash, or a failed append).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loading {
    pub bucket: u64,
    pub after_id: u64,
}

impl Checkpoint {
    pub fn new(frontier: u64, bucket_ms: u64) -> Self {
        Self {
            version: VERSION,
            frontier,
            next_seq: 1,
            bucket_ms,
            buckets: BTreeMap::new(),
            tombstones: Vec::new(),
            loading: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BucketMeta {
    /// Synced length: anything after it is cut off at open.
    pub bytes: u64,
    pub salt: u32,
    /// The smallest id written here (tombstones are kept while some
    /// bucket could hold an id below theirs).
    pub min_id: u64,
    /// Schedules written per route, less cancels.
    pub routes: BTreeMap<String, u64>,
}

impl BucketMeta {
    pub fn new(salt: u32) -> Self {
        Self {
            bytes: 0,
            salt,
            min_id: u64::MAX,
            routes: BTreeMap::new(),
        }
    }
}

/// The checkpoint at `path`, or `None` if there is none yet.
pub fn read(fs: &dyn FileSystem, path: &Path) -> Result<Option<Checkpoint>, FarError> {
    let file = match fs.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(WalError::io(path, e).into()),
    };
    let bytes = crate::wal::reader::read_all(&*file, path)?;
    let cp: Checkpoint = serde_json::from_slice(&bytes).map_err(|e| FarError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if cp.version != VERSION {
        return Err(FarError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("version {} (this delayd reads {VERSION})", cp.version),
        });
    }
    Ok(Some(cp))
}

/// How many bytes [`write`] would write for `cp` (to `path`).
pub fn encoded_len(cp: &Checkpoint, path: &Path) -> Result<usize, FarError> {
    encode(cp, path).map(|bytes| bytes.len())
}

fn encode(cp: &Checkpoint, path: &Path) -> Result<Vec<u8>, FarError> {
    serde_json::to_vec(cp).map_err(|e| FarError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Write `cp` to `dir/tmp`, sync it, rename it over `dir/name`, sync `dir`.
pub fn write(
    fs: &dyn FileSystem,
    dir: &Path,
    name: &str,
    tmp: &str,
    cp: &Checkpoint,
) -> Result<(), FarError> {
    let tmp = dir.join(tmp);
    let path = dir.join(name);
    let bytes = encode(cp, &path)?;
    match fs.remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(WalError::io(&tmp, e).into()),
    }
    let file = fs.create_new(&tmp).map_err(|e| WalError::io(&tmp, e))?;
    file.append(&bytes).map_err(|e| WalError::io(&tmp, e))?;
    file.sync_all().map_err(|source| WalError::Fatal {
        op: "fsync of the far tier's checkpoint",
        path: tmp.clone(),
        source,
    })?;
    fs.rename(&tmp, &path).map_err(|e| WalError::io(&path, e))?;
    sync_dir(fs, dir)
}
