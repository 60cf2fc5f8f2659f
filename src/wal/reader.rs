//! Reading frames back: single records for firing, whole segments for
//! recovery, compaction and inspection.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::frame::{self, FrameError, Record, RecordRef};
use super::WalError;

/// Most frames (a message with its headers) fit in this many bytes, so one
/// `pread` usually reads the whole frame; a longer one takes a second.
const FIRST_READ: usize = 4096;

/// Read the frame at `offset` of a segment.
pub fn read_frame_at(
    file: &File,
    path: &Path,
    offset: u64,
    max_len: u32,
) -> Result<Record, WalError> {
    let corrupt = |reason: String| WalError::Corrupt {
        segment: path.to_path_buf(),
        offset,
        reason,
    };
    let mut buf = vec![0u8; FIRST_READ.max(frame::HEADER_BYTES)];
    let got = read_up_to(file, &mut buf, offset).map_err(|e| WalError::io(path, e))?;
    if got < frame::HEADER_BYTES {
        return Err(corrupt(format!(
            "frame header cut short: {got} of {} bytes",
            frame::HEADER_BYTES
        )));
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len < frame::MIN_LEN || len > max_len {
        return Err(corrupt(FrameError::BadLength(len).to_string()));
    }
    let total = frame::HEADER_BYTES + len as usize;
    if total > got {
        buf.resize(total, 0);
        file.read_exact_at(&mut buf[got..], offset + got as u64)
            .map_err(|e| WalError::io(path, e))?;
    }
    let (record, _) = frame::parse(&buf[..total], max_len).map_err(|e| corrupt(e.to_string()))?;
    Ok(record.to_owned())
}

/// Fill `buf` from `offset` as far as the file goes; returns the bytes read.
fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Read a whole segment file into memory.
pub fn read_all(file: &File, path: &Path) -> Result<Vec<u8>, WalError> {
    let len = file.metadata().map_err(|e| WalError::io(path, e))?.len();
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, 0)
        .map_err(|e| WalError::io(path, e))?;
    Ok(buf)
}

/// Every valid frame of a segment with its offset; bad frames are logged and
/// skipped (the segment was already vetted by recovery).
pub fn scan_file(file: &File, path: &Path, max_len: u32) -> Result<Vec<(u32, Record)>, WalError> {
    let buf = read_all(file, path)?;
    let mut out = Vec::new();
    for item in Scanner::new(&buf, max_len) {
        match item {
            ScanItem::Frame { offset, record } => out.push((offset as u32, record.to_owned())),
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
    /// A bad frame at `offset`; scanning resumes at `resumes_at` (the next
    /// valid frame) or, if `None`, nothing valid follows.
    Bad {
        offset: u64,
        reason: FrameError,
        resumes_at: Option<u64>,
    },
}

/// Walks the frames of a segment buffer, resynchronising after bad ones.
pub struct Scanner<'a> {
    buf: &'a [u8],
    offset: usize,
    last_seq: u64,
    max_len: u32,
}

impl<'a> Scanner<'a> {
    /// Scan `buf`, a whole segment including its header.
    pub fn new(buf: &'a [u8], max_len: u32) -> Self {
        Self {
            buf,
            offset: (frame::SEGMENT_HEADER_BYTES as usize).min(buf.len()),
            last_seq: 0,
            max_len,
        }
    }

    pub fn with_last_seq(mut self, last_seq: u64) -> Self {
        self.last_seq = last_seq;
        self
    }

    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    fn valid_at(&self, at: usize) -> Result<(RecordRef<'a>, usize), FrameError> {
        let (record, size) = frame::parse(&self.buf[at..], self.max_len)?;
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
            Ok((record, size)) => {
                self.last_seq = record.seq();
                self.offset += size;
                Some(ScanItem::Frame {
                    offset: at as u64,
                    record,
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
    let header_ok =
        buf.len() >= frame::SEGMENT_HEADER_BYTES as usize && &buf[..8] == frame::SEGMENT_MAGIC;
    if !header_ok {
        scan.corruption.push(super::Corruption {
            segment: path.to_path_buf(),
            offset: 0,
            reason: "bad segment header".into(),
            skipped_bytes: buf.len() as u64,
        });
        return Ok(scan);
    }
    for item in Scanner::new(&buf, max_len) {
        match item {
            ScanItem::Frame { offset, record } => {
                let next = scan_end(&buf, offset as usize, max_len);
                let size = (next - offset as usize) as u32;
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
                });
            }
            ScanItem::Bad {
                offset,
                resumes_at: None,
                ..
            } if is_last => scan.torn_tail_bytes = buf.len() as u64 - offset,
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

fn scan_end(buf: &[u8], offset: usize, max_len: u32) -> usize {
    frame::parse(&buf[offset..], max_len)
        .map(|(_, size)| offset + size)
        .unwrap_or(offset)
}
