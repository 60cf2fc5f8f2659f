//! Key tombstones: cancels by key that far messages stored before them obey
//! when their bucket is read.
//!
//! In memory, a map from route and key to the id bound: a later cancel of a
//! key covers an earlier one, so there is one entry per key, and a record is
//! judged with one lookup whatever the number kept. On disk,
//! `tombstones.log`: one line of JSON per cancel, appended and synced, so a
//! cancel costs one append, never a rewrite of everything kept. The log is
//! rewritten (to a temporary file, synced, renamed) when pruning has left
//! fewer than half its lines alive.
//!
//! A line is durable once synced. A crash can leave a last line cut short
//! (no newline): it was never acknowledged, and opening cuts it off. A
//! failed append is cut back at once; if that fails too, the error is fatal.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::wal::fs::{FileSystem, WalFile};
use crate::wal::WalError;

use super::{sync_dir, FarError};

const LOG: &str = "tombstones.log";
const LOG_TMP: &str = "tombstones.tmp";
/// Below this many lines the log is never rewritten: not worth the fsyncs.
const REWRITE_MIN_LINES: usize = 64;

/// A cancel by key (a Kafka tombstone, or the admin API) that far messages
/// stored before it must obey when their bucket is read. Also the form the
/// checkpoint kept them in before `tombstones.log`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyTombstone {
    pub route: String,
    pub key: Vec<u8>,
    /// Applies to ids below this: those stored before the cancel.
    pub before_id: u64,
}

pub struct Tombstones {
    fs: std::sync::Arc<dyn FileSystem>,
    dir: PathBuf,
    /// Route -> key -> the bound: ids below it are cancelled.
    map: HashMap<String, HashMap<Vec<u8>, u64>>,
    /// Lines in the log, alive or not.
    lines: usize,
    /// Synced length of the log.
    bytes: u64,
    file: Box<dyn WalFile>,
}

impl Tombstones {
    /// Open (or create) the log in `dir`, cutting a torn last line;
    /// `legacy` are tombstones an older checkpoint held, folded in.
    pub fn open(
        fs: std::sync::Arc<dyn FileSystem>,
        dir: &Path,
        legacy: &[KeyTombstone],
    ) -> Result<Tombstones, FarError> {
        let path = dir.join(LOG);
        let tmp = dir.join(LOG_TMP);
        match fs.remove_file(&tmp) {
            Ok(()) => sync_dir(&*fs, dir)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(WalError::io(&tmp, e).into()),
        }
        let file = match fs.open_append(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let f = fs.create_new(&path).map_err(|e| WalError::io(&path, e))?;
                sync_dir(&*fs, dir)?;
                f
            }
            Err(e) => return Err(WalError::io(&path, e).into()),
        };
        let buf = crate::wal::reader::read_all(&*file, &path)?;
        let mut out = Tombstones {
            fs,
            dir: dir.to_path_buf(),
            map: HashMap::new(),
            lines: 0,
            bytes: 0,
            file,
        };
        let mut end = 0;
        for line in buf.split_inclusive(|&b| b == b'\n') {
            if line.last() != Some(&b'\n') {
                break; // torn: never acknowledged
            }
            end += line.len();
            out.lines += 1;
            match serde_json::from_slice::<KeyTombstone>(&line[..line.len() - 1]) {
                Ok(t) => out.insert(t),
                Err(e) => {
                    // A whole line that will not decode was synced and then
                    // damaged: say so, and keep the others.
                    tracing::error!(log = %path.display(), offset = end - line.len(), error = %e, "a key tombstone that will not decode; skipped");
                }
            }
        }
        if end < buf.len() {
            tracing::warn!(log = %path.display(), bytes = buf.len() - end, "cutting a torn last line of the key tombstones");
            out.cut_to(end as u64)?;
        }
        out.bytes = end as u64;
        if !legacy.is_empty() {
            for t in legacy {
                out.insert(t.clone());
            }
            out.rewrite()?;
        }
        Ok(out)
    }

    fn insert(&mut self, t: KeyTombstone) {
        let bound = self
            .map
            .entry(t.route)
            .or_default()
            .entry(t.key)
            .or_default();
        *bound = (*bound).max(t.before_id);
    }

    /// Keys kept.
    pub fn len(&self) -> usize {
        self.map.values().map(HashMap::len).sum()
    }

    /// Whether message `id` of `route` with lookup key `key` is cancelled.
    pub fn cancels(&self, id: u64, route: &str, key: Option<&[u8]>) -> bool {
        let Some(key) = key else { return false };
        self.map
            .get(route)
            .and_then(|keys| keys.get(key))
            .is_some_and(|&bound| id < bound)
    }

    /// Durably add a cancel of `route`'s `key` for ids below `before_id`.
    pub fn add(&mut self, t: KeyTombstone) -> Result<(), FarError> {
        let path = self.dir.join(LOG);
        let mut line = serde_json::to_vec(&t).expect("a tombstone encodes");
        line.push(b'\n');
        if let Err(e) = self.file.append(&line) {
            self.cut_to(self.bytes)?;
            return Err(WalError::io(&path, e).into());
        }
        self.file.sync_data().map_err(|source| WalError::Fatal {
            op: "fsync of the far tier's key tombstones",
            path: path.clone(),
            source,
        })?;
        self.bytes += line.len() as u64;
        self.lines += 1;
        self.insert(t);
        Ok(())
    }

    /// Drop every tombstone `needed(route, before_id)` says nothing left
    /// can match; rewrite the log once most of its lines are dead.
    pub fn prune(&mut self, needed: impl Fn(&str, u64) -> bool) -> Result<(), FarError> {
        for (route, keys) in &mut self.map {
            keys.retain(|_, &mut bound| needed(route, bound));
        }
        self.map.retain(|_, keys| !keys.is_empty());
        if self.lines >= REWRITE_MIN_LINES && self.len() * 2 < self.lines {
            self.rewrite()?;
        }
        Ok(())
    }

    /// Write what the map holds to a new log and put it in place.
    fn rewrite(&mut self) -> Result<(), FarError> {
        let fs = &*self.fs;
        let tmp = self.dir.join(LOG_TMP);
        let path = self.dir.join(LOG);
        let mut buf = Vec::new();
        for (route, keys) in &self.map {
            for (key, &before_id) in keys {
                let t = KeyTombstone {
                    route: route.clone(),
                    key: key.clone(),
                    before_id,
                };
                serde_json::to_writer(&mut buf, &t).expect("a tombstone encodes");
                buf.push(b'\n');
            }
        }
        match fs.remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(WalError::io(&tmp, e).into()),
        }
        let file = fs.create_new(&tmp).map_err(|e| WalError::io(&tmp, e))?;
        file.append(&buf).map_err(|e| WalError::io(&tmp, e))?;
        file.sync_all().map_err(|source| WalError::Fatal {
            op: "fsync of the far tier's key tombstones",
            path: tmp.clone(),
            source,
        })?;
        fs.rename(&tmp, &path).map_err(|e| WalError::io(&path, e))?;
        sync_dir(fs, &self.dir)?;
        self.file = fs.open_append(&path).map_err(|e| WalError::io(&path, e))?;
        self.bytes = buf.len() as u64;
        self.lines = self.len();
        Ok(())
    }

    /// Cut the log back to `len` bytes, durably; fatal if it cannot be.
    fn cut_to(&self, len: u64) -> Result<(), FarError> {
        let path = self.dir.join(LOG);
        let cut = self.fs.open_write(&path).and_then(|f| {
            f.set_len(len)?;
            f.sync_data()
        });
        cut.map_err(|source| {
            WalError::Fatal {
                op: "cutting back the far tier's key tombstones",
                path,
                source,
            }
            .into()
        })
    }
}
