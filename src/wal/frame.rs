//! Frame encoding and validation. See the module doc of `wal` for the layout.

/// `len u32 | crc u32`, before the bytes that `len` counts.
pub const HEADER_BYTES: usize = 8;
/// `type u8 | seq u64`: the smallest possible `len`.
pub const MIN_LEN: u32 = 9;
/// Bytes of a Schedule payload before route and message: id, due, uid,
/// route_len.
pub const SCHEDULE_OVERHEAD: usize = 8 + 8 + 16 + 2;
/// The same for a Schedule written before messages had a uid (type 1).
const SCHEDULE_V1_OVERHEAD: usize = 8 + 8 + 2;
/// The longest `len` a reader believes: any frame a delayd may have
/// written, whatever `wal.max_message_bytes` was then. Not the limit
/// configured now: lowered between restarts, it made the larger messages
/// stored before it "implausible" and recovery skipped them, acknowledged
/// (`wal::tests::a_lower_max_message_bytes_keeps_the_larger_messages_already_stored`).
/// A frame is still bounded by the bytes that follow it, and checked by
/// its CRC.
pub const MAX_LEN: u32 = u32::MAX;
/// The longest frame that is not a Schedule (a Remembered one): a longer
/// `len` with another type is not tried against its CRC, which keeps a
/// resynchronisation through a corrupt message's bytes cheap.
const MAX_SMALL_LEN: u32 = MIN_LEN + REMEMBERED_PAYLOAD as u32;

pub const SEGMENT_MAGIC: &[u8; 8] = b"DELAYDWL";
/// Version 2 salts every frame's CRC and ends each batch with a Commit frame;
/// version 3 adds Acked frames and version 4 Remembered frames (the same
/// layout otherwise). Versions 1 (no salt, no Commit) to 3 are still read;
/// a delayd that predates a version refuses its segments (an unknown frame
/// type would read as corruption).
pub const SEGMENT_VERSION: u32 = 4;
pub const SEGMENT_HEADER_BYTES: u64 = 16;

/// A Schedule without a uid (written before identities existed; read only).
const TYPE_SCHEDULE_V1: u8 = 1;
const TYPE_DONE: u8 = 2;
const TYPE_COMMIT: u8 = 3;
/// A Schedule with the message's uid (what is written now).
const TYPE_SCHEDULE: u8 = 4;
/// The source's ack of a stored message was confirmed (version 3).
const TYPE_ACKED: u8 = 5;
/// What redelivery detection keeps of a message whose Schedule's segment
/// goes (version 4).
const TYPE_REMEMBERED: u8 = 6;
/// A Remembered payload: id, uid, fingerprint, digest, flags.
const REMEMBERED_PAYLOAD: usize = 8 + 16 + 8 + 32 + 1;
/// [`Remembered::flags`]: it was cancelled.
pub const REMEMBERED_CANCELLED: u8 = 1;
/// [`Remembered::flags`]: it left (fired or parked).
pub const REMEMBERED_LEFT: u8 = 2;

/// The segment's CRC salt: a random `u32` from the header of a version 2
/// segment, mixed into every frame's CRC so that bytes a producer wrote into
/// a message body can never pass for a frame (the producer cannot know the
/// salt). `None` for version 1 segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Salt(Option<u32>);

impl Salt {
    pub const UNSALTED: Salt = Salt(None);

    pub fn new(salt: u32) -> Self {
        Salt(Some(salt))
    }

    /// A fresh random salt for a new segment.
    pub fn random() -> Self {
        use std::hash::BuildHasher;
        // RandomState is keyed from the OS's random source; hashing the
        // time through it gives a value no producer can predict.
        let hash = std::hash::RandomState::new().hash_one(std::time::SystemTime::now());
        Salt(Some((hash ^ (hash >> 32)) as u32))
    }

    /// The salt as written in a header (0 for none).
    pub fn value(self) -> u32 {
        self.0.unwrap_or(0)
    }

    pub fn is_salted(self) -> bool {
        self.0.is_some()
    }

    /// CRC32C over (salt, if any), `len` and the bytes `len` counts.
    fn crc(self, len: &[u8], rest: &[u8]) -> u32 {
        let start = match self.0 {
            Some(salt) => crc32c::crc32c_append(crc32c::crc32c(&salt.to_le_bytes()), len),
            None => crc32c::crc32c(len),
        };
        crc32c::crc32c_append(start, rest)
    }
}

/// An owned record, as read back from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Schedule {
        seq: u64,
        id: u64,
        due_ms: u64,
        /// The message's identity ([`crate::id::MessageId`]); 0 for a
        /// record written before identities existed.
        uid: u128,
        route: String,
        message: Vec<u8>,
    },
    Done {
        seq: u64,
        id: u64,
        segment: u64,
    },
    Acked {
        seq: u64,
        id: u64,
    },
    Remembered {
        seq: u64,
        remembered: Remembered,
    },
}

/// A message redelivery detection still remembers after its Schedule's
/// segment is gone (see `engine::dedup`): a restart compares a redelivery
/// with its digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remembered {
    pub id: u64,
    pub uid: u128,
    /// `engine::dedup::fingerprint` of its route and bytes.
    pub fp: u64,
    /// `engine::dedup::digest` of its route and bytes.
    pub digest: [u8; 32],
    /// [`REMEMBERED_CANCELLED`], [`REMEMBERED_LEFT`].
    pub flags: u8,
}

impl Remembered {
    /// Bytes of its payload.
    pub const BYTES: usize = REMEMBERED_PAYLOAD;

    /// Append its payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.fp.to_le_bytes());
        out.extend_from_slice(&self.digest);
        out.push(self.flags);
    }

    /// Read a payload back; `None` if it is not [`Remembered::BYTES`] long.
    pub fn decode(payload: &[u8]) -> Option<Remembered> {
        if payload.len() != REMEMBERED_PAYLOAD {
            return None;
        }
        Some(Remembered {
            id: u64::from_le_bytes(payload[0..8].try_into().ok()?),
            uid: u128::from_le_bytes(payload[8..24].try_into().ok()?),
            fp: u64::from_le_bytes(payload[24..32].try_into().ok()?),
            digest: payload[32..64].try_into().ok()?,
            flags: payload[64],
        })
    }
}

/// A record borrowed from a read buffer (recovery avoids copying payloads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordRef<'a> {
    Schedule {
        seq: u64,
        id: u64,
        due_ms: u64,
        uid: u128,
        route: &'a str,
        message: &'a [u8],
    },
    Done {
        seq: u64,
        id: u64,
        segment: u64,
    },
    /// The source's ack of stored message `id` was confirmed: a broker
    /// redelivery can no longer be that message (see `engine::dedup`).
    Acked {
        seq: u64,
        id: u64,
    },
    /// A departed message's identity and digest, carried while remembered.
    Remembered {
        seq: u64,
        remembered: Remembered,
    },
}

impl RecordRef<'_> {
    pub fn seq(&self) -> u64 {
        match self {
            RecordRef::Schedule { seq, .. }
            | RecordRef::Done { seq, .. }
            | RecordRef::Acked { seq, .. }
            | RecordRef::Remembered { seq, .. } => *seq,
        }
    }

    pub fn to_owned(self) -> Record {
        match self {
            RecordRef::Schedule {
                seq,
                id,
                due_ms,
                uid,
                route,
                message,
            } => Record::Schedule {
                seq,
                id,
                due_ms,
                uid,
                route: route.to_owned(),
                message: message.to_vec(),
            },
            RecordRef::Done { seq, id, segment } => Record::Done { seq, id, segment },
            RecordRef::Acked { seq, id } => Record::Acked { seq, id },
            RecordRef::Remembered { seq, remembered } => Record::Remembered { seq, remembered },
        }
    }
}

/// The fields of a Schedule frame.
#[derive(Debug, Clone, Copy)]
pub struct Schedule<'a> {
    pub id: u64,
    pub due_ms: u64,
    pub uid: u128,
    pub route: &'a str,
    pub message: &'a [u8],
}

/// Append a Schedule frame to `out`.
pub fn put_schedule(out: &mut Vec<u8>, salt: Salt, seq: u64, schedule: &Schedule<'_>) {
    let Schedule {
        id,
        due_ms,
        uid,
        route,
        message,
    } = *schedule;
    let len = MIN_LEN as usize + SCHEDULE_OVERHEAD + route.len() + message.len();
    let start = begin(out, len, TYPE_SCHEDULE, seq);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&due_ms.to_le_bytes());
    out.extend_from_slice(&uid.to_le_bytes());
    out.extend_from_slice(&(route.len() as u16).to_le_bytes());
    out.extend_from_slice(route.as_bytes());
    out.extend_from_slice(message);
    finish(out, start, salt);
}

/// Append a Done frame to `out`.
pub fn put_done(out: &mut Vec<u8>, salt: Salt, seq: u64, id: u64, segment: u64) {
    let start = begin(out, MIN_LEN as usize + 16, TYPE_DONE, seq);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&segment.to_le_bytes());
    finish(out, start, salt);
}

/// Append an Acked frame to `out`.
pub fn put_acked(out: &mut Vec<u8>, salt: Salt, seq: u64, id: u64) {
    let start = begin(out, MIN_LEN as usize + 8, TYPE_ACKED, seq);
    out.extend_from_slice(&id.to_le_bytes());
    finish(out, start, salt);
}

/// Append a Remembered frame to `out`.
pub fn put_remembered(out: &mut Vec<u8>, salt: Salt, seq: u64, r: &Remembered) {
    let start = begin(
        out,
        MIN_LEN as usize + REMEMBERED_PAYLOAD,
        TYPE_REMEMBERED,
        seq,
    );
    r.encode(out);
    finish(out, start, salt);
}

/// Append the Commit frame that ends a batch whose first frame has
/// `batch_first_seq`.
pub fn put_commit(out: &mut Vec<u8>, salt: Salt, seq: u64, batch_first_seq: u64) {
    let start = begin(out, MIN_LEN as usize + 8, TYPE_COMMIT, seq);
    out.extend_from_slice(&batch_first_seq.to_le_bytes());
    finish(out, start, salt);
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

fn finish(out: &mut [u8], start: usize, salt: Salt) {
    let crc = salt.crc(&out[start..start + 4], &out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// A parsed frame: a record, or the Commit that ends a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    Record(RecordRef<'a>),
    Commit { seq: u64, batch_first_seq: u64 },
}

impl Parsed<'_> {
    pub fn seq(&self) -> u64 {
        match self {
            Parsed::Record(r) => r.seq(),
            Parsed::Commit { seq, .. } => *seq,
        }
    }
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

/// Parse the frame at the start of `buf`, in a segment with `salt`. Returns
/// the frame and its total size in bytes.
pub fn parse(buf: &[u8], max_len: u32, salt: Salt) -> Result<(Parsed<'_>, usize), FrameError> {
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
    let kind = buf[8];
    if len > MAX_SMALL_LEN && kind != TYPE_SCHEDULE && kind != TYPE_SCHEDULE_V1 {
        return Err(FrameError::BadType(kind));
    }
    let stored_crc = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    let crc = salt.crc(&buf[0..4], &buf[8..total]);
    if crc != stored_crc {
        return Err(FrameError::BadCrc);
    }
    let seq = u64::from_le_bytes(buf[9..17].try_into().expect("8 bytes"));
    let payload = &buf[17..total];
    let parsed = match kind {
        TYPE_SCHEDULE => Parsed::Record(parse_schedule(seq, payload, true)?),
        TYPE_SCHEDULE_V1 => Parsed::Record(parse_schedule(seq, payload, false)?),
        TYPE_DONE => {
            if payload.len() != 16 {
                return Err(FrameError::BadPayload("Done payload is not 16 bytes"));
            }
            Parsed::Record(RecordRef::Done {
                seq,
                id: u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes")),
                segment: u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes")),
            })
        }
        TYPE_ACKED if salt.is_salted() => {
            if payload.len() != 8 {
                return Err(FrameError::BadPayload("Acked payload is not 8 bytes"));
            }
            Parsed::Record(RecordRef::Acked {
                seq,
                id: u64::from_le_bytes(payload.try_into().expect("8 bytes")),
            })
        }
        TYPE_REMEMBERED if salt.is_salted() => {
            if payload.len() != REMEMBERED_PAYLOAD {
                return Err(FrameError::BadPayload("Remembered payload is not 65 bytes"));
            }
            Parsed::Record(RecordRef::Remembered {
                seq,
                remembered: Remembered::decode(payload).expect("65 bytes"),
            })
        }
        TYPE_COMMIT if salt.is_salted() => {
            if payload.len() != 8 {
                return Err(FrameError::BadPayload("Commit payload is not 8 bytes"));
            }
            Parsed::Commit {
                seq,
                batch_first_seq: u64::from_le_bytes(payload.try_into().expect("8 bytes")),
            }
        }
        other => return Err(FrameError::BadType(other)),
    };
    Ok((parsed, total))
}

/// A Schedule's payload; `with_uid` for type 4 (type 1 has none: uid 0).
fn parse_schedule(seq: u64, payload: &[u8], with_uid: bool) -> Result<RecordRef<'_>, FrameError> {
    let overhead = if with_uid {
        SCHEDULE_OVERHEAD
    } else {
        SCHEDULE_V1_OVERHEAD
    };
    if payload.len() < overhead {
        return Err(FrameError::BadPayload("Schedule payload too short"));
    }
    let id = u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes"));
    let due_ms = u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes"));
    let uid = if with_uid {
        u128::from_le_bytes(payload[16..32].try_into().expect("16 bytes"))
    } else {
        0
    };
    let at = overhead - 2;
    let route_len = u16::from_le_bytes(payload[at..overhead].try_into().expect("2 bytes")) as usize;
    let rest = &payload[overhead..];
    if rest.len() < route_len {
        return Err(FrameError::BadPayload("route longer than payload"));
    }
    let route = std::str::from_utf8(&rest[..route_len])
        .map_err(|_| FrameError::BadPayload("route is not UTF-8"))?;
    Ok(RecordRef::Schedule {
        seq,
        id,
        due_ms,
        uid,
        route,
        message: &rest[route_len..],
    })
}

/// The far tier's buckets hold no Remembered frames: they stay at version
/// 3, which a delayd one version back still reads.
pub const BUCKET_VERSION: u32 = 3;

pub fn segment_header(salt: u32) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    header(SEGMENT_VERSION, salt)
}

/// A far bucket's header (see [`BUCKET_VERSION`]).
pub fn bucket_header(salt: u32) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    header(BUCKET_VERSION, salt)
}

fn header(version: u32, salt: u32) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES as usize];
    h[..8].copy_from_slice(SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&salt.to_le_bytes());
    h
}

/// The salt a segment header declares, or `None` if it is not a header of
/// a version this code reads.
pub fn header_salt(buf: &[u8]) -> Option<Salt> {
    if buf.len() < SEGMENT_HEADER_BYTES as usize || &buf[..8] != SEGMENT_MAGIC {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
    match word(8) {
        1 => Some(Salt::UNSALTED),
        2..=4 => Some(Salt::new(word(12))),
        _ => None,
    }
}

/// The format version a segment header declares (0 if it is no header).
pub fn header_version(buf: &[u8]) -> u32 {
    if buf.len() < SEGMENT_HEADER_BYTES as usize || &buf[..8] != SEGMENT_MAGIC {
        return 0;
    }
    u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SALT: Salt = Salt(Some(0x5eed_1234));
    const UID: u128 = 0x8000_0000_0000_0001_0000_0000_0000_0002;

    fn sched<'a>(id: u64, due_ms: u64, route: &'a str, message: &'a [u8]) -> Schedule<'a> {
        Schedule {
            id,
            due_ms,
            uid: UID,
            route,
            message,
        }
    }

    fn record(buf: &[u8], salt: Salt) -> Result<(RecordRef<'_>, usize), FrameError> {
        match parse(buf, 1 << 20, salt)? {
            (Parsed::Record(r), size) => Ok((r, size)),
            (other, _) => panic!("not a record: {other:?}"),
        }
    }

    #[test]
    fn schedule_round_trip() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, SALT, 7, &sched(5, 1234, "orders", b"hello"));
        let (rec, size) = record(&buf, SALT).unwrap();
        assert_eq!(size, buf.len());
        assert_eq!(
            rec,
            RecordRef::Schedule {
                seq: 7,
                id: 5,
                due_ms: 1234,
                uid: UID,
                route: "orders",
                message: b"hello"
            }
        );
    }

    #[test]
    fn done_and_commit_round_trip() {
        let mut buf = Vec::new();
        put_done(&mut buf, SALT, 9, 5, 1);
        let (rec, size) = record(&buf, SALT).unwrap();
        assert_eq!(
            rec,
            RecordRef::Done {
                seq: 9,
                id: 5,
                segment: 1
            }
        );
        put_commit(&mut buf, SALT, 10, 9);
        assert_eq!(
            parse(&buf[size..], 1 << 20, SALT).unwrap().0,
            Parsed::Commit {
                seq: 10,
                batch_first_seq: 9
            }
        );
    }

    /// A type 1 Schedule, as delayd wrote them before messages had a uid,
    /// spelled out byte by byte (not made with today's writer), still reads,
    /// with uid 0.
    #[test]
    fn a_schedule_without_uid_still_reads() {
        let mut frame = Vec::new();
        frame.extend_from_slice(&(9u32 + 18 + 1 + 2).to_le_bytes()); // len
        frame.extend_from_slice(&[0; 4]); // crc, below
        frame.push(1); // type: Schedule without uid
        frame.extend_from_slice(&7u64.to_le_bytes()); // seq
        frame.extend_from_slice(&5u64.to_le_bytes()); // id
        frame.extend_from_slice(&1234u64.to_le_bytes()); // due_ms
        frame.extend_from_slice(&1u16.to_le_bytes()); // route_len
        frame.extend_from_slice(b"r");
        frame.extend_from_slice(b"hi");
        let crc = crc32c::crc32c_append(
            crc32c::crc32c_append(crc32c::crc32c(&0x5eed_1234u32.to_le_bytes()), &frame[..4]),
            &frame[8..],
        );
        frame[4..8].copy_from_slice(&crc.to_le_bytes());
        let (rec, size) = record(&frame, SALT).unwrap();
        assert_eq!(size, frame.len());
        assert_eq!(
            rec,
            RecordRef::Schedule {
                seq: 7,
                id: 5,
                due_ms: 1234,
                uid: 0,
                route: "r",
                message: b"hi"
            }
        );
    }

    #[test]
    fn a_frame_from_another_salt_or_none_is_rejected() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, SALT, 1, &sched(1, 99, "r", b"payload"));
        assert_eq!(
            parse(&buf, 1 << 20, Salt::new(0x5eed_1235)).unwrap_err(),
            FrameError::BadCrc
        );
        assert_eq!(
            parse(&buf, 1 << 20, Salt::UNSALTED).unwrap_err(),
            FrameError::BadCrc
        );
        // Version 1 frames (no salt) still read.
        let mut v1 = Vec::new();
        put_done(&mut v1, Salt::UNSALTED, 3, 2, 1);
        assert!(record(&v1, Salt::UNSALTED).is_ok());
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, SALT, 1, &sched(1, 99, "r", b"payload bytes"));
        for bit in 0..buf.len() * 8 {
            let mut bad = buf.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(
                parse(&bad, 1 << 20, SALT).is_err(),
                "bit {bit} not detected"
            );
        }
    }

    #[test]
    fn zeros_and_short_input() {
        assert_eq!(parse(&[0; 32], 1024, SALT).unwrap_err(), FrameError::Zero);
        assert_eq!(parse(&[0; 3], 1024, SALT).unwrap_err(), FrameError::Zero);
        let mut buf = Vec::new();
        put_done(&mut buf, SALT, 1, 1, 1);
        for cut in 1..buf.len() {
            assert!(parse(&buf[..cut], 1024, SALT).is_err());
        }
    }

    #[test]
    fn header_declares_the_salt() {
        let h = segment_header(42);
        assert_eq!(header_salt(&h), Some(Salt::new(42)));
        let mut v1 = h;
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(header_salt(&v1), Some(Salt::UNSALTED));
        let mut v9 = h;
        v9[8..12].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(header_salt(&v9), None);
        assert_eq!(header_salt(&h[..8]), None);
    }

    #[test]
    fn fresh_salts_differ_and_headers_carry_their_value() {
        let (a, b) = (Salt::random(), Salt::random());
        assert!(a.is_salted() && b.is_salted());
        assert_ne!(a, b, "two segments' salts");
        assert_eq!(Salt::new(0x5eed).value(), 0x5eed);
        assert_eq!(Salt::UNSALTED.value(), 0);
        assert!(!Salt::UNSALTED.is_salted());
        let mut bad_magic = segment_header(7);
        bad_magic[0] = b'X';
        assert_eq!(header_salt(&bad_magic), None);
    }

    #[test]
    fn records_know_their_seq_and_own_their_bytes() {
        let mut buf = Vec::new();
        put_schedule(&mut buf, SALT, 41, &sched(5, 1234, "orders", b"hello"));
        let first = buf.len();
        put_done(&mut buf, SALT, 42, 5, 3);
        put_commit(&mut buf, SALT, 43, 41);
        let (schedule, size) = parse(&buf, 1 << 20, SALT).unwrap();
        assert_eq!(size, first);
        assert_eq!(schedule.seq(), 41);
        let Parsed::Record(schedule) = schedule else {
            panic!("{schedule:?}");
        };
        assert_eq!(schedule.seq(), 41);
        assert_eq!(
            schedule.to_owned(),
            Record::Schedule {
                seq: 41,
                id: 5,
                due_ms: 1234,
                uid: UID,
                route: "orders".into(),
                message: b"hello".to_vec()
            }
        );
        let (done, done_size) = record(&buf[first..], SALT).unwrap();
        assert_eq!(done.seq(), 42);
        assert_eq!(
            done.to_owned(),
            Record::Done {
                seq: 42,
                id: 5,
                segment: 3
            }
        );
        let (commit, _) = parse(&buf[first + done_size..], 1 << 20, SALT).unwrap();
        assert_eq!(commit.seq(), 43);
    }

    #[test]
    fn the_smallest_and_largest_lengths_are_framed() {
        // Empty route and message: the shortest Schedule payload.
        let mut buf = Vec::new();
        put_schedule(&mut buf, SALT, 1, &sched(2, 3, "", b""));
        let (rec, size) = record(&buf, SALT).unwrap();
        assert_eq!(size, HEADER_BYTES + MIN_LEN as usize + SCHEDULE_OVERHEAD);
        assert_eq!(
            rec,
            RecordRef::Schedule {
                seq: 1,
                id: 2,
                due_ms: 3,
                uid: UID,
                route: "",
                message: b""
            }
        );
        // A frame exactly `max_len` long is accepted, one byte over is not.
        let len = (size - HEADER_BYTES) as u32;
        assert!(parse(&buf, len, SALT).is_ok());
        assert_eq!(
            parse(&buf, len - 1, SALT).unwrap_err(),
            FrameError::BadLength(len)
        );
        // `len == MIN_LEN` is a valid frame shape with an empty payload.
        let mut bare = Vec::new();
        let start = begin(&mut bare, MIN_LEN as usize, TYPE_DONE, 9);
        finish(&mut bare, start, SALT);
        assert_eq!(
            parse(&bare, 1 << 20, SALT).unwrap_err(),
            FrameError::BadPayload("Done payload is not 16 bytes")
        );
        // A zero length with a non-zero CRC is still a zero-filled region.
        let header = [0, 0, 0, 0, 1, 2, 3, 4];
        assert_eq!(parse(&header, 1024, SALT).unwrap_err(), FrameError::Zero);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        for (e, text) in [
            (FrameError::Short, "frame cut short"),
            (FrameError::Zero, "zero-filled region"),
            (FrameError::BadLength(3), "implausible frame length 3"),
            (FrameError::BadCrc, "CRC32C mismatch"),
            (FrameError::BadType(7), "unknown record type 7"),
            (
                FrameError::BadPayload("route is not UTF-8"),
                "malformed payload: route is not UTF-8",
            ),
        ] {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn a_commit_in_an_unsalted_segment_is_an_unknown_type() {
        // Version 1 segments have no Commit frames.
        let mut v1 = Vec::new();
        put_commit(&mut v1, Salt::UNSALTED, 2, 1);
        assert_eq!(
            parse(&v1, 1 << 20, Salt::UNSALTED).unwrap_err(),
            FrameError::BadType(TYPE_COMMIT)
        );
    }
}
