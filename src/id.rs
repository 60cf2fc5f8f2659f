//! A message's identity: the `x-delayd-id` it carries out, and the id the
//! admin API and CLI take.
//!
//! 128 bits, assigned once when delayd accepts a delivery and stored with
//! the message (the WAL's Schedule record, the RabbitMQ state stream's
//! Schedule, a hand-off copy's header), so every copy delayd makes keeps it:
//! a retried publish, a compaction copy, a restore from the broker store, a
//! hand-off, a failover. Two different messages never share one.
//!
//! - From Kafka: derived from the record's source topic, partition, offset and
//!   timestamp, so a record read twice (a crash before the offset commit, a
//!   rebalance) keeps its id even when it is stored twice. The timestamp keeps
//!   a topic that was deleted and created again, whose offsets start over,
//!   from reusing the ids of its former records.
//! - From a RabbitMQ stream: derived from the stream, the offset and the
//!   message's bytes, so it too keeps its id when read again.
//! - Otherwise: a random 64-bit prefix drawn once per process, then a
//!   counter. A new process draws a new prefix, so restarts and replicas
//!   never collide (two of 2^64 prefixes meeting is the only way).
//!
//! The high half of a minted id is never 0. A WAL record written before
//! identities existed has none; its message is shown under its WAL sequence
//! number, in decimal, as before ([`MessageId::legacy`]). Minted ids are 32
//! hex digits, so the two forms never meet.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use sha2::{Digest as _, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(u128);

/// The bit set in every minted id's high half, so it is never 0.
const MINTED: u64 = 1 << 63;

impl MessageId {
    /// A new id for a message accepted by this process.
    pub fn mint() -> MessageId {
        static PREFIX: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let prefix = *PREFIX.get_or_init(random_u64);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        MessageId((u128::from(prefix | MINTED) << 64) | u128::from(n))
    }

    /// The id of a Kafka record, the same every time the record is read.
    pub fn of_kafka_record(
        topic: &str,
        partition: i32,
        offset: i64,
        timestamp_ms: Option<i64>,
    ) -> MessageId {
        let mut hash = Sha256::new();
        hash.update((topic.len() as u64).to_le_bytes());
        hash.update(topic.as_bytes());
        hash.update(partition.to_le_bytes());
        hash.update(offset.to_le_bytes());
        hash.update(timestamp_ms.unwrap_or(i64::MIN).to_le_bytes());
        let digest = hash.finalize();
        let high = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes")) | MINTED;
        let low = u64::from_be_bytes(digest[8..16].try_into().expect("8 bytes"));
        MessageId((u128::from(high) << 64) | u128::from(low))
    }

    /// The id of a message read from a RabbitMQ stream at `offset`, the
    /// same every time it is read (`encoded`: its stored bytes).
    pub fn of_stream_record(stream: &str, offset: i64, encoded: &[u8]) -> MessageId {
        let mut hash = Sha256::new();
        hash.update(b"stream\0");
        hash.update((stream.len() as u64).to_le_bytes());
        hash.update(stream.as_bytes());
        hash.update(offset.to_le_bytes());
        hash.update(Sha256::digest(encoded));
        let digest = hash.finalize();
        let high = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes")) | MINTED;
        let low = u64::from_be_bytes(digest[8..16].try_into().expect("8 bytes"));
        MessageId((u128::from(high) << 64) | u128::from(low))
    }

    /// The id of a message stored before identities existed: its WAL
    /// sequence number.
    pub fn legacy(seq: u64) -> MessageId {
        MessageId(u128::from(seq))
    }

    /// The stored form (0 in a WAL record means "none": see [`Self::or_legacy`]).
    pub fn from_u128(raw: u128) -> MessageId {
        MessageId(raw)
    }

    pub fn as_u128(self) -> u128 {
        self.0
    }

    /// A stored id, or for a record that has none (0), the legacy one.
    pub fn or_legacy(raw: u128, seq: u64) -> MessageId {
        if raw == 0 {
            MessageId::legacy(seq)
        } else {
            MessageId(raw)
        }
    }

    /// Whether this is a legacy id (a WAL sequence number).
    pub fn is_legacy(self) -> bool {
        self.0 >> 64 == 0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_legacy() {
            write!(f, "{}", self.0 as u64)
        } else {
            write!(f, "{:032x}", self.0)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a delayd message id (32 hex digits, or a decimal WAL sequence number)")]
pub struct BadId(pub String);

impl FromStr for MessageId {
    type Err = BadId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadId(s.to_owned());
        if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            let raw = u128::from_str_radix(s, 16).map_err(|_| bad())?;
            let id = MessageId(raw);
            return if id.is_legacy() { Err(bad()) } else { Ok(id) };
        }
        if !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse::<u64>().map(MessageId::legacy).map_err(|_| bad());
        }
        Err(bad())
    }
}

/// 64 random bits from the OS-seeded hasher keys, mixed with the time and
/// the process id (no extra dependency for one draw per process).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn minted_ids_are_distinct_and_never_legacy() {
        let ids: HashSet<MessageId> = (0..10_000).map(|_| MessageId::mint()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|id| !id.is_legacy()));
    }

    #[test]
    fn ids_print_and_parse_back() {
        let minted = MessageId::mint();
        let text = minted.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(text.parse::<MessageId>(), Ok(minted));
        let legacy = MessageId::legacy(42);
        assert_eq!(legacy.to_string(), "42");
        assert_eq!("42".parse::<MessageId>(), Ok(legacy));
        assert!("".parse::<MessageId>().is_err());
        assert!("x1".parse::<MessageId>().is_err());
        // 32 hex digits with a zero high half would print as decimal.
        assert!(format!("{:032x}", 42u128).parse::<MessageId>().is_err());
        assert!("99999999999999999999".parse::<MessageId>().is_err());
    }

    #[test]
    fn a_kafka_record_keeps_its_id_and_others_differ() {
        let a = MessageId::of_kafka_record("t", 0, 7, Some(1_000));
        assert_eq!(a, MessageId::of_kafka_record("t", 0, 7, Some(1_000)));
        assert!(!a.is_legacy());
        for other in [
            MessageId::of_kafka_record("u", 0, 7, Some(1_000)),
            MessageId::of_kafka_record("t", 1, 7, Some(1_000)),
            MessageId::of_kafka_record("t", 0, 8, Some(1_000)),
            // The topic deleted and created again: offset 7 once more.
            MessageId::of_kafka_record("t", 0, 7, Some(2_000)),
            MessageId::of_kafka_record("t", 0, 7, None),
        ] {
            assert_ne!(a, other);
        }
    }

    #[test]
    fn a_stored_zero_is_the_legacy_sequence_number() {
        assert_eq!(MessageId::or_legacy(0, 9), MessageId::legacy(9));
        let minted = MessageId::mint();
        assert_eq!(MessageId::or_legacy(minted.as_u128(), 9), minted);
    }
}
