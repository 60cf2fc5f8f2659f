//! Reading a bucket without holding it in memory: its frames one at a
//! time through a window of the file ([`FrameStream`]), an index of its
//! live records ([`BucketIndex`]: a few dozen bytes a message), and any
//! one record read back by its offset.

use std::collections::HashSet;
use std::path::Path;

use crate::wal::frame::{self, FrameError, Parsed, Salt};
use crate::wal::fs::WalFile;
use crate::wal::{RecordRef, WalError};

use super::{FarError, FarRecord};

/// Bytes read from a bucket at once (more when one frame is bigger).
const WINDOW: usize = 1 << 20;

/// A bucket's frames in file order, up to its checkpointed length. A bad
/// frame is reported and skipped: the stream resynchronises at the next
/// frame that parses, as the WAL's scanner does.
pub struct FrameStream<'f> {
    file: &'f dyn WalFile,
    path: &'f Path,
    end: u64,
    salt: Salt,
    max_len: u32,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    buf_at: u64,
    pos: u64,
    last_seq: u64,
}

/// One item of a [`FrameStream`].
pub enum Item<'a> {
    Frame { offset: u64, record: RecordRef<'a> },
    Bad { offset: u64, reason: FrameError },
}

impl<'f> FrameStream<'f> {
    pub fn new(file: &'f dyn WalFile, path: &'f Path, end: u64, salt: Salt, max_len: u32) -> Self {
        Self {
            file,
            path,
            end,
            salt,
            max_len,
            buf: Vec::new(),
            buf_at: 0,
            pos: frame::SEGMENT_HEADER_BYTES,
            last_seq: 0,
        }
    }

    /// Make `[at, at + len)` (cut at `end`) readable in `buf`.
    fn fill(&mut self, at: u64, len: usize) -> Result<(), FarError> {
        let want_end = (at + len as u64).min(self.end);
        if at >= self.buf_at && want_end <= self.buf_at + self.buf.len() as u64 {
            return Ok(());
        }
        let size = ((self.end - at) as usize).min(len.max(WINDOW));
        self.buf.resize(size, 0);
        self.buf_at = at;
        let mut filled = 0;
        while filled < size {
            match self
                .file
                .read_at(&mut self.buf[filled..], at + filled as u64)
            {
                Ok(0) => {
                    return Err(WalError::io(
                        self.path,
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "a far bucket shrank while it was read",
                        ),
                    )
                    .into())
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(WalError::io(self.path, e).into()),
            }
        }
        Ok(())
    }

    /// The frame at `at`, parsed: (its record or commit, its size).
    fn parse_at(&mut self, at: u64) -> Result<Result<(u64, usize), FrameError>, FarError> {
        self.fill(at, frame::HEADER_BYTES)?;
        let from = (at - self.buf_at) as usize;
        let len = match self.buf.get(from..from + 4) {
            Some(b) => u32::from_le_bytes(b.try_into().expect("4 bytes")),
            None => return Ok(Err(FrameError::Short)),
        };
        let total = frame::HEADER_BYTES + len.min(self.max_len) as usize;
        self.fill(at, total)?;
        let from = (at - self.buf_at) as usize;
        Ok(
            match frame::parse(&self.buf[from..], self.max_len, self.salt) {
                Ok((parsed, size)) => {
                    let seq = match parsed {
                        Parsed::Record(r) => r.seq(),
                        Parsed::Commit { seq, .. } => seq,
                    };
                    if seq <= self.last_seq {
                        Err(FrameError::BadPayload("sequence number went backwards"))
                    } else {
                        Ok((seq, size))
                    }
                }
                Err(e) => Err(e),
            },
        )
    }

    /// Call `each` with every frame (and every bad one) in file order.
    pub fn for_each(
        mut self,
        mut each: impl FnMut(Item<'_>) -> Result<(), FarError>,
    ) -> Result<(), FarError> {
        while self.pos < self.end {
            let at = self.pos;
            match self.parse_at(at)? {
                Ok((seq, size)) => {
                    self.last_seq = seq;
                    self.pos += size as u64;
                    let from = (at - self.buf_at) as usize;
                    let (parsed, _) = frame::parse(&self.buf[from..], self.max_len, self.salt)
                        .expect("parsed just now");
                    if let Parsed::Record(record) = parsed {
                        each(Item::Frame { offset: at, record })?;
                    }
                }
                Err(reason) => {
                    each(Item::Bad { offset: at, reason })?;
                    // The next offset where a frame parses, if any.
                    let mut next = at + 1;
                    while next < self.end && self.parse_at(next)?.is_err() {
                        next += 1;
                    }
                    self.pos = next;
                }
            }
        }
        Ok(())
    }
}

/// What a load or a lookup needs to know of one live record, without its
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub offset: u64,
    pub id: u64,
    pub due_ms: u64,
    pub uid: u128,
}

/// A bucket's live records in (due, id) order, one per id, without the
/// cancelled ones; those a key tombstone cancels apart.
#[derive(Debug, Default)]
pub struct BucketIndex {
    pub live: Vec<Entry>,
    pub tombstoned: Vec<Entry>,
}

impl BucketIndex {
    /// Index a stream's frames. `tombstoned(id, route, message)` says
    /// whether a key tombstone cancels a record.
    pub fn build(
        stream: FrameStream<'_>,
        mut tombstoned: impl FnMut(u64, &str, &[u8]) -> bool,
        mut bad: impl FnMut(u64, &FrameError),
    ) -> Result<BucketIndex, FarError> {
        let mut live = Vec::new();
        let mut cancelled = HashSet::new();
        let mut gone = Vec::new();
        let mut seen = HashSet::new();
        stream.for_each(|item| {
            match item {
                Item::Frame {
                    offset,
                    record:
                        RecordRef::Schedule {
                            id,
                            due_ms,
                            uid,
                            route,
                            message,
                            ..
                        },
                } => {
                    // Spilled twice (a crash before the WAL's Done): once.
                    if !seen.insert(id) {
                        return Ok(());
                    }
                    let entry = Entry {
                        offset,
                        id,
                        due_ms,
                        uid,
                    };
                    if tombstoned(id, route, message) {
                        gone.push(entry);
                    } else {
                        live.push(entry);
                    }
                }
                Item::Frame {
                    record: RecordRef::Done { id, .. },
                    ..
                } => {
                    cancelled.insert(id);
                }
                // Never written in a bucket.
                Item::Frame {
                    record: RecordRef::Acked { .. } | RecordRef::Remembered { .. },
                    ..
                } => {}
                Item::Bad { offset, reason } => bad(offset, &reason),
            }
            Ok(())
        })?;
        live.retain(|e| !cancelled.contains(&e.id));
        live.sort_by_key(|e| (e.due_ms, e.id));
        gone.retain(|e| !cancelled.contains(&e.id));
        Ok(BucketIndex {
            live,
            tombstoned: gone,
        })
    }
}

/// The record at `offset` of a bucket (an [`Entry`]'s).
pub fn read_record(
    file: &dyn WalFile,
    path: &Path,
    end: u64,
    salt: Salt,
    max_len: u32,
    offset: u64,
) -> Result<FarRecord, FarError> {
    let mut stream = FrameStream::new(file, path, end, salt, max_len);
    let bad = |reason: String| FarError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("the record at offset {offset} no longer reads: {reason}"),
    };
    stream.parse_at(offset)?.map_err(|e| bad(e.to_string()))?;
    let from = (offset - stream.buf_at) as usize;
    match frame::parse(&stream.buf[from..], max_len, salt) {
        Ok((
            Parsed::Record(RecordRef::Schedule {
                id,
                due_ms,
                uid,
                route,
                message,
                ..
            }),
            _,
        )) => Ok(FarRecord {
            id,
            due_ms,
            uid,
            route: route.to_owned(),
            message: message.to_vec(),
        }),
        _ => Err(bad("not a Schedule".into())),
    }
}
