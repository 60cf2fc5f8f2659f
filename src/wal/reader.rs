//! Reading frames back: single records for firing, whole segments for
//! recovery, compaction and inspection.

use std::fs::File;
use std::path::Path;

use super::frame::{self, FrameError, Parsed, Record, RecordRef, Salt};
use super::fs::WalFile;
use super::WalError;

/// Most frames (a message with its headers) fit in this many bytes, so one
/// `pread` usually reads the whole frame; a longer one takes a second.
const FIRST_READ: usize = 4096;
const _: () = assert!(FIRST_READ >= frame::HEADER_BYTES);

/// Where the bytes of a frame may come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Wherever they are: the call blocks while the disk reads them.
    Disk,
    /// Only the page cache (`preadv2` with `RWF_NOWAIT`): a read that would
    /// wait for the disk fails with [`WalError::NotCached`] instead. Lets a
    /// caller on an async thread read recent frames without a hop to a
    /// blocking thread.
    CacheOnly,
}

/// Read the record at `offset` of a segment whose header has `salt`.
pub fn read_frame_at(
    file: &dyn WalFile,
    path: &Path,
    offset: u64,
    max_len: u32,
    salt: Salt,
    source: Source,
) -> Result<Record, WalError> {
    let corrupt = |reason: String| WalError::Corrupt {
        segment: path.to_path_buf(),
        offset,
        reason,
    };
    let io = |e: ReadError| match e {
        ReadError::NotCached => WalError::NotCached,
        ReadError::Io(e) => WalError::io(path, e),
    };
    // On the stack: a heap buffer this size per fired message took glibc's
    // slow path (it is past the per-thread cache) at every fire.
    let mut first = [0u8; FIRST_READ];
    let got = read_up_to(file, &mut first, offset, source).map_err(io)?;
    if got < frame::HEADER_BYTES {
        return Err(corrupt(format!(
            "frame header cut short: {got} of {} bytes",
            frame::HEADER_BYTES
        )));
    }
    let len = u32::from_le_bytes([first[0], first[1], first[2], first[3]]);
    if len < frame::MIN_LEN || len > max_len {
        return Err(corrupt(FrameError::BadLength(len).to_string()));
    }
    let total = frame::HEADER_BYTES + len as usize;
    let longer: Vec<u8>;
    let bytes = if total <= got {
        &first[..total]
    } else {
        // Allocated only for bytes the file holds: a length is believed up
        // to the format's largest (see `frame::MAX_LEN`).
        let size = file.size().map_err(|e| WalError::io(path, e))?;
        if got < FIRST_READ || offset.saturating_add(total as u64) > size {
            return Err(corrupt(format!(
                "frame of {total} bytes runs past the end of its file ({size} bytes)"
            )));
        }
        let mut buf = Vec::with_capacity(total);
        buf.extend_from_slice(&first[..got]);
        buf.resize(total, 0);
        let rest = read_up_to(file, &mut buf[got..], offset + got as u64, source).map_err(io)?;
        if got + rest < total {
            return Err(corrupt(format!(
                "frame cut short: {} of {total} bytes",
                got + rest
            )));
        }
        longer = buf;
        &longer[..]
    };
    match frame::parse(bytes, max_len, salt) {
        Ok((Parsed::Record(record), _)) => Ok(record.to_owned()),
        Ok((Parsed::Commit { .. }, _)) => Err(corrupt("a Commit frame, not a record".into())),
        Err(e) => Err(corrupt(e.to_string())),
    }
}

enum ReadError {
    NotCached,
    Io(std::io::Error),
}

/// Fill `buf` from `offset` as far as the file goes; returns the bytes read.
fn read_up_to(
    file: &dyn WalFile,
    buf: &mut [u8],
    offset: u64,
    source: Source,
) -> Result<usize, ReadError> {
    let mut filled = 0;
    while filled < buf.len() {
        let at = offset + filled as u64;
        let read = match source {
            Source::Disk => file.read_at(&mut buf[filled..], at),
            // A short count means the rest is not cached: the next call
            // says so.
            Source::CacheOnly => match file.read_at_cached(&mut buf[filled..], at) {
                Some(n) => Ok(n),
                None => return Err(ReadError::NotCached),
            },
        };
        match read {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(filled)
}

/// Read a whole segment file into memory.
pub fn read_all(file: &dyn WalFile, path: &Path) -> Result<Vec<u8>, WalError> {
    let len = file.size().map_err(|e| WalError::io(path, e))?;
    let mut buf = vec![0u8; len as usize];
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], filled as u64) {
            Ok(0) => {
                return Err(WalError::io(
                    path,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the file shrank while it was read",
                    ),
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WalError::io(path, e)),
        }
    }
    Ok(buf)
}

/// Every valid frame of a segment with its offset; bad frames are logged and
/// skipped (the segment was already vetted by recovery).
pub fn scan_file(
    file: &dyn WalFile,
    path: &Path,
    max_len: u32,
) -> Result<Vec<(u32, Record)>, WalError> {
    let buf = read_all(file, path)?;
    let mut out = Vec::new();
    for item in Scanner::new(&buf, max_len) {
        match item {
            ScanItem::Frame { offset, record } => out.push((offset as u32, record.to_owned())),
            ScanItem::Commit { .. } => {}
            ScanItem::Bad { offset, reason, .. } => {
                tracing::warn!(segment = %path.display(), offset, %reason, "skipping bad WAL frame")
            }
        }
    }
    Ok(out)
}

pub enum ScanItem<'a> {
    Frame {
        offset: u64,
        record: RecordRef<'a>,
    },
    /// The end of a batch whose first frame had `batch_first_seq`.
    Commit {
        seq: u64,
        batch_first_seq: u64,
    },
    /// A bad frame at `offset`; scanning resumes at `resumes_at` (the next
    /// valid frame) or, if `None`, nothing valid follows.
    Bad {
        offset: u64,
        reason: FrameError,
        resumes_at: Option<u64>,
    },
}

/// Walks the frames of a segment buffer, resynchronising after bad ones.
/// With a salted segment, resynchronising cannot land on frame-shaped bytes
/// inside a message body: their CRC would need the segment's salt.
pub struct Scanner<'a> {
    buf: &'a [u8],
    offset: usize,
    last_seq: u64,
    max_len: u32,
    salt: Salt,
}

impl<'a> Scanner<'a> {
    /// Scan `buf`, a whole segment including its header (whose salt is used;
    /// a header of no known version scans as unsalted).
    pub fn new(buf: &'a [u8], max_len: u32) -> Self {
        Self {
            buf,
            offset: (frame::SEGMENT_HEADER_BYTES as usize).min(buf.len()),
            last_seq: 0,
            max_len,
            salt: frame::header_salt(buf).unwrap_or(Salt::UNSALTED),
        }
    }

    pub fn with_last_seq(mut self, last_seq: u64) -> Self {
        self.last_seq = last_seq;
        self
    }

    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    fn valid_at(&self, at: usize) -> Result<(Parsed<'a>, usize), FrameError> {
        let (record, size) = frame::parse(&self.buf[at..], self.max_len, self.salt)?;
        if record.seq() <= self.last_seq {
            return Err(FrameError::BadPayload("sequence number went backwards"));
        }
        Ok((record, size))
    }
}

impl<'a> Iterator for Scanner<'a> {
    type Item = ScanItem<'a>;

    fn next(&mut self) -> Option<ScanItem<'a>> {
        if self.offset >= self.buf.len() {
            return None;
        }
        let at = self.offset;
        match self.valid_at(at) {
            Ok((parsed, size)) => {
                self.last_seq = parsed.seq();
                self.offset += size;
                let offset = at as u64;
                Some(match parsed {
                    Parsed::Record(record) => ScanItem::Frame { offset, record },
                    Parsed::Commit {
                        seq,
                        batch_first_seq,
                    } => ScanItem::Commit {
                        seq,
                        batch_first_seq,
                    },
                })
            }
            Err(reason) => {
                let resumes_at = (at + 1..self.buf.len()).find(|&j| self.valid_at(j).is_ok());
                self.offset = resumes_at.unwrap_or(self.buf.len());
                Some(ScanItem::Bad {
                    offset: at as u64,
                    reason,
                    resumes_at: resumes_at.map(|j| j as u64),
                })
            }
        }
    }
}

/// Where the last segment's torn tail starts, if its bad bytes are a torn
/// write rather than corruption: the index in `items` of the first bad item.
///
/// Only the last batch can be torn (every earlier one was fsynced before a
/// later one was written), and the kernel may have persisted its pages in
/// any order. So a bad region is a torn tail when nothing valid follows it,
/// or, in a salted segment, when everything valid after it belongs to the
/// last batch: no Commit follows except one, the last frame, whose batch
/// began at or before the bad region (`prev_seq` is the seq before the
/// segment's first frame). Bytes that rotted inside the last batch after it
/// was acknowledged look the same; nothing on disk tells them apart.
pub fn torn_tail(items: &[ScanItem<'_>], salt: Salt, prev_seq: u64) -> Option<usize> {
    let first_bad = items
        .iter()
        .position(|i| matches!(i, ScanItem::Bad { .. }))?;
    let nothing_valid_after = items[first_bad..].iter().all(|i| {
        matches!(
            i,
            ScanItem::Bad {
                resumes_at: None,
                ..
            }
        )
    });
    if nothing_valid_after {
        return Some(first_bad);
    }
    if !salt.is_salted() {
        return None;
    }
    let seq_before = items[..first_bad]
        .iter()
        .rev()
        .find_map(|i| match i {
            ScanItem::Frame { record, .. } => Some(record.seq()),
            ScanItem::Commit { seq, .. } => Some(*seq),
            ScanItem::Bad { .. } => None,
        })
        .unwrap_or(prev_seq);
    // Trailing bytes with nothing valid after them do not count.
    let end = items
        .iter()
        .rposition(|i| {
            !matches!(
                i,
                ScanItem::Bad {
                    resumes_at: None,
                    ..
                }
            )
        })
        .map_or(items.len(), |i| i + 1);
    let commits: Vec<(usize, u64)> = items[first_bad..end]
        .iter()
        .enumerate()
        .filter_map(|(k, i)| match i {
            ScanItem::Commit {
                batch_first_seq, ..
            } => Some((first_bad + k, *batch_first_seq)),
            _ => None,
        })
        .collect();
    match commits.as_slice() {
        [] => Some(first_bad),
        [(at, batch_first_seq)] if *at + 1 == end && *batch_first_seq <= seq_before + 1 => {
            Some(first_bad)
        }
        _ => None,
    }
}

/// One frame of a segment, summarised for `delayd wal inspect`.
#[derive(Debug, Clone)]
pub struct FrameSummary {
    pub id: u64,
    pub due_ms: u64,
    pub size: u32,
    pub route: String,
    /// `Some(target segment)` for a Done.
    pub done: Option<u64>,
}

#[derive(Debug, Default)]
pub struct SegmentScan {
    pub frames: Vec<FrameSummary>,
    pub corruption: Vec<super::Corruption>,
    /// Bytes of a torn tail (only in the last segment; cut on next start).
    pub torn_tail_bytes: u64,
}

/// Read-only scan of one segment file. In the last segment, a bad frame with
/// nothing valid after it is a torn tail, not corruption.
pub fn inspect_segment(path: &Path, max_len: u32, is_last: bool) -> Result<SegmentScan, WalError> {
    let file = File::open(path).map_err(|e| WalError::io(path, e))?;
    let buf = read_all(&file, path)?;
    let mut scan = SegmentScan::default();
    let Some(salt) = frame::header_salt(&buf) else {
        scan.corruption.push(super::Corruption {
            segment: path.to_path_buf(),
            offset: 0,
            reason: "bad segment header".into(),
            skipped_bytes: buf.len() as u64,
        });
        return Ok(scan);
    };
    let items: Vec<ScanItem<'_>> = Scanner::new(&buf, max_len).collect();
    let first_seq = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(super::segments::parse_segment_name)
        .unwrap_or(1);
    let torn = if is_last {
        torn_tail(&items, salt, first_seq.saturating_sub(1))
    } else {
        None
    };
    for (index, item) in items.into_iter().enumerate() {
        if let (Some(cut), ScanItem::Bad { offset, .. }) = (torn, &item) {
            if index == cut {
                scan.torn_tail_bytes = buf.len() as u64 - offset;
            }
        }
        if torn.is_some_and(|cut| index >= cut) {
            continue;
        }
        match item {
            ScanItem::Frame { offset, record } => {
                let next = scan_end(&buf, offset as usize, max_len, salt);
                let size = (next - offset as usize) as u32;
                if matches!(
                    record,
                    RecordRef::Acked { .. } | RecordRef::Remembered { .. }
                ) {
                    continue;
                }
                scan.frames.push(match record {
                    RecordRef::Schedule {
                        id, due_ms, route, ..
                    } => FrameSummary {
                        id,
                        due_ms,
                        size,
                        route: route.to_owned(),
                        done: None,
                    },
                    RecordRef::Done { id, segment, .. } => FrameSummary {
                        id,
                        due_ms: 0,
                        size,
                        route: String::new(),
                        done: Some(segment),
                    },
                    RecordRef::Acked { .. } | RecordRef::Remembered { .. } => {
                        unreachable!("skipped above")
                    }
                });
            }
            ScanItem::Commit { .. } => {}
            ScanItem::Bad {
                offset,
                reason,
                resumes_at,
            } => scan.corruption.push(super::Corruption {
                segment: path.to_path_buf(),
                offset,
                reason: reason.to_string(),
                skipped_bytes: resumes_at.unwrap_or(buf.len() as u64) - offset,
            }),
        }
    }
    Ok(scan)
}

fn scan_end(buf: &[u8], offset: usize, max_len: u32, salt: Salt) -> usize {
    frame::parse(&buf[offset..], max_len, salt)
        .map(|(_, size)| offset + size)
        .unwrap_or(offset)
}
