//! Frame encoding and validation. See the module doc of `wal` for the layout.

/// `len u32 | crc u32`, before the bytes that `len` counts.
pub const HEADER_BYTES: usize = 8;
/// `type u8 | seq u64`: the smallest possible `len`.
pub const MIN_LEN: u32 = 9;
/// Bytes of a Schedule payload before route and message: id, due, route_len.
pub const SCHEDULE_OVERHEAD: usize = 8 + 8 + 2;

pub const SEGMENT_MAGIC: &[u8; 8] = b"DELAYDWL";
pub const SEGMENT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: u64 = 16;

const TYPE_SCHEDULE: u8 = 1;
const TYPE_DONE: u8 = 2;

/// An owned record, as read back from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Schedule {
        seq: u64,
        id: u64,
        due_ms: u64,
        route: String,
        message: Vec<u8>,
    },
    Done {
        seq: u64,
        id: u64,
        segment: u64,
    },
}

/// A record borrowed from a read buffer (recovery avoids copying payloads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordRef<'a> {
    Schedule {
        seq: u64,
        id: u64,
        due_ms: u64,
        route: &'a str,
        message: &'a [u8],
    },
    Done {
        seq: u64,
        id: u64,
        segment: u64,
    },
}

impl RecordRef<'_> {
    pub fn seq(&self) -> u64 {
        match self {
            RecordRef::Schedule { seq, .. } | RecordRef::Done { seq, .. } => *seq,
        }
    }

    pub fn to_owned(self) -> Record {
        match self {
            RecordRef::Schedule {
                seq,
                id,
                due_ms,
                route,
                message,
            } => Record::Schedule {
                seq,
                id,
                due_ms,
                route: route.to_owned(),
                message: message.to_vec(),
            },
            RecordRef::Done { seq, id, segment } => Record::Done { seq, id, segment },
        }
    }
}

/// Append a Schedule frame to `out`.
pub fn put_schedule(
    out: &mut Vec<u8>,
    seq: u64,
    id: u64,
    due_ms: u64,
    route: &str,
    message: &[u8],
) {
    let len = MIN_LEN as usize + SCHEDULE_OVERHEAD + route.len() + message.len();
    let start = begin(out, len, TYPE_SCHEDULE, seq);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&due_ms.to_le_bytes());
    out.extend_from_slice(&(route.len() as u16).to_le_bytes());
    out.extend_from_slice(route.as_bytes());
    out.extend_from_slice(message);
    finish(out, start);
}

/// Append a Done frame to `out`.
pub fn put_done(out: &mut Vec<u8>, seq: u64, id: u64, segment: u64) {
    let start = begin(out, MIN_LEN as usize + 16, TYPE_DONE, seq);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&segment.to_le_bytes());
    finish(out, start);
}

fn begin(out: &mut Vec<u8>, len: usize, kind: u8, seq: u64) -> usize {
    let start = out.len();
    out.reserve(HEADER_BYTES + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]); // crc, filled in by `finish`
    out.push(kind);
    out.extend_from_slice(&seq.to_le_bytes());
    start
}

fn finish(out: &mut [u8], start: usize) {
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[start..start + 4]), &out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Why bytes at an offset are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Fewer bytes left than a header or than `len` says.
    Short,
    /// `len == 0`: a zero-filled (preallocated or never written) region.
    Zero,
    /// `len` below the minimum or above `max_len`.
    BadLength(u32),
    BadCrc,
    BadType(u8),
    BadPayload(&'static str),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Short => write!(f, "frame cut short"),
            FrameError::Zero => write!(f, "zero-filled region"),
            FrameError::BadLength(n) => write!(f, "implausible frame length {n}"),
            FrameError::BadCrc => write!(f, "CRC32C mismatch"),
            FrameError::BadType(t) => write!(f, "unknown record type {t}"),
            FrameError::BadPayload(why) => write!(f, "malformed payload: {why}"),
        }
    }
}

/// Parse the frame at the start of `buf`. Returns the record and the frame's
/// total size in bytes.
pub fn parse(buf: &[u8], max_len: u32) -> Result<(RecordRef<'_>, usize), FrameError> {
    if buf.len() < HEADER_BYTES {
        return Err(if buf.iter().all(|&b| b == 0) {
            FrameError::Zero
        } else {
            FrameError::Short
        });
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes"));
    if len == 0 {
        return Err(FrameError::Zero);
    }
    if len < MIN_LEN || len > max_len {
        return Err(FrameError::BadLength(len));
    }
    let total = HEADER_BYTES + len as usize;
    if buf.len() < total {
        return Err(FrameError::Short);
    }
    let stored_crc = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    let crc = crc32c::crc32c_append(crc32c::crc32c(&buf[0..4]), &buf[8..total]);
    if crc != stored_crc {
        return Err(FrameError::BadCrc);
    }
    let kind = buf[8];
    let seq = u64::from_le_bytes(buf[9..17].try_into().expect("8 bytes"));
    let payload = &buf[17..total];
    let record = match kind {
        TYPE_SCHEDULE => parse_schedule(seq, payload)?,
        TYPE_DONE => {
            if payload.len() != 16 {
                return Err(FrameError::BadPayload("Done payload is not 16 bytes"));
            }
            RecordRef::Done {
                seq,
                id: u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes")),
                segment: u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes")),
            }
        }
        other => return Err(FrameError::BadType(other)),
    };
    Ok((record, total))
}

fn parse_schedule(seq: u64, payload: &[u8]) -> Result<RecordRef<'_>, FrameError> {
    if payload.len() < SCHEDULE_OVERHEAD {
        return Err(FrameError::BadPayload("Schedule payload too short"));
    }
    let id = u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes"));
    let due_ms = u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes"));
    let route_len = u16::from_le_bytes(payload[16..18].try_into().expect("2 bytes")) as usize;
    let rest = &payload[SCHEDULE_OVERHEAD..];
    if rest.len() < route_len {
        return Err(FrameError::BadPayload("route longer than payload"));
    }
    let route = std::str::from_utf8(&rest[..route_len])
        .map_err(|_| FrameError::BadPayload("route is not UTF-8"))?;
    Ok(RecordRef::Schedule {
        seq,
        id,
        due_ms,
        route,
        message: &rest[route_len..],
    })
}

pub fn segment_header() -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES as usize];
    h[..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_round_trip() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, 7, 5, 1234, "orders", b"hello");
        let (rec, size) = parse(&buf, 1 << 20).unwrap();
        assert_eq!(size, buf.len());
        assert_eq!(
            rec,
            RecordRef::Schedule {
                seq: 7,
                id: 5,
                due_ms: 1234,
                route: "orders",
                message: b"hello"
            }
        );
    }

    #[test]
    fn done_round_trip() {
        let mut buf = Vec::new();
        put_done(&mut buf, 9, 5, 1);
        let (rec, _) = parse(&buf, 1 << 20).unwrap();
        assert_eq!(
            rec,
            RecordRef::Done {
                seq: 9,
                id: 5,
                segment: 1
            }
        );
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, 1, 1, 99, "r", b"payload bytes");
        for bit in 0..buf.len() * 8 {
            let mut bad = buf.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(parse(&bad, 1 << 20).is_err(), "bit {bit} not detected");
        }
    }

    #[test]
    fn zeros_and_short_input() {
        assert_eq!(parse(&[0; 32], 1024).unwrap_err(), FrameError::Zero);
        assert_eq!(parse(&[0; 3], 1024).unwrap_err(), FrameError::Zero);
        let mut buf = Vec::new();
        put_done(&mut buf, 1, 1, 1);
        for cut in 1..buf.len() {
            assert!(parse(&buf[..cut], 1024).is_err());
        }
    }
}
