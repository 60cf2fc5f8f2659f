//! Several state records in one stream message.
//!
//! The broker-kept store's writer appends a round of records at a time
//! (every Schedule and Done queued since the last round). Published one
//! message each, the broker's work per message (the channel, the stream's
//! writer, a confirm) was most of what a broker-kept route cost. A round is
//! now packed into as few messages as fit [`PACK_BYTES`]:
//!
//! ```text
//! version 2 | kind 1 | (length u32 BE | a version-1 record)*
//! ```
//!
//! A round of one record, or a record too big to share a message, is
//! published bare, as before. A delayd that reads only version 1 refuses a
//! packed message as a newer format (it never skips it: a skipped Schedule
//! would be a lost message).

/// The version byte of a packed message.
pub const PACKED_VERSION: u8 = 2;
/// Its kind byte (the only kind of version 2).
const PACKED: u8 = 1;
/// At most this many bytes of records share one message: about a hundred
/// Schedules of small messages, so a round costs a publish or two. Kept
/// small because a reader's prefetch counts messages, not bytes (AMQP
/// 0-9-1 has no byte limit RabbitMQ honours): 2,000 packs in flight to a
/// restore are 64 MiB at most.
pub const PACK_BYTES: usize = 32 << 10;

/// `records` (each one encoded) as the messages to publish, in order.
pub fn pack(records: &[Vec<u8>]) -> Vec<Vec<u8>> {
    pack_within(records, PACK_BYTES)
}

fn pack_within(records: &[Vec<u8>], limit: usize) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    let mut group: &[Vec<u8>] = &[];
    let mut start = 0;
    let mut bytes = 0;
    for (i, record) in records.iter().enumerate() {
        let size = 4 + record.len();
        if !group.is_empty() && bytes + size > limit {
            messages.push(one_message(group));
            start = i;
            bytes = 0;
        }
        bytes += size;
        group = &records[start..=i];
    }
    if !group.is_empty() {
        messages.push(one_message(group));
    }
    messages
}

fn one_message(group: &[Vec<u8>]) -> Vec<u8> {
    if let [only] = group {
        return only.clone();
    }
    let total: usize = group.iter().map(|r| 4 + r.len()).sum();
    let mut out = Vec::with_capacity(2 + total);
    out.extend_from_slice(&[PACKED_VERSION, PACKED]);
    for record in group {
        let len = u32::try_from(record.len()).expect("a record under 4 GiB");
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(record);
    }
    out
}

/// The records a message holds: itself if it is not packed, the records it
/// packs if it is, `None` if it says it is packed but is cut short.
pub fn unpack(message: &[u8]) -> Option<Vec<&[u8]>> {
    let Some(rest) = message.strip_prefix(&[PACKED_VERSION, PACKED]) else {
        return Some(vec![message]);
    };
    let mut records = Vec::new();
    let mut rest = rest;
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        if tail.len() < len {
            return None;
        }
        let (record, tail) = tail.split_at(len);
        records.push(record);
        rest = tail;
    }
    Some(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u8, len: usize) -> Vec<u8> {
        let mut r = vec![1, n];
        r.resize(len, n);
        r
    }

    #[test]
    fn a_round_packs_into_messages_within_the_limit_and_unpacks_in_order() {
        let records: Vec<Vec<u8>> = (0..10).map(|n| record(n, 10 + n as usize)).collect();
        let messages = pack_within(&records, 60);
        assert!(messages.len() > 1, "split by the limit");
        let mut back = Vec::new();
        for m in &messages {
            assert!(m.len() <= 60 + 2 || unpack(m).unwrap().len() == 1, "{m:?}");
            back.extend(unpack(m).unwrap().into_iter().map(<[u8]>::to_vec));
        }
        assert_eq!(back, records);
    }

    #[test]
    fn one_record_or_one_too_big_goes_bare() {
        let only = vec![record(1, 30)];
        assert_eq!(pack_within(&only, 100), only, "a round of one");
        let big = record(2, 500);
        let messages = pack_within(&[record(1, 10), big.clone(), record(3, 10)], 100);
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[1], big, "too big to share: bare");
        assert_eq!(messages[0], record(1, 10));
        assert_eq!(unpack(&big).unwrap(), vec![&big[..]]);
        assert!(pack(&[]).is_empty());
    }

    #[test]
    fn a_packed_message_cut_short_is_refused() {
        let messages = pack_within(&[record(1, 10), record(2, 10)], 100);
        assert_eq!(messages.len(), 1);
        let whole = &messages[0];
        assert_eq!(&whole[..2], &[PACKED_VERSION, PACKED]);
        for cut in 3..whole.len() {
            if cut == 2 + 4 + 10 {
                // Ends between the two records: a valid pack of one.
                assert_eq!(unpack(&whole[..cut]).unwrap().len(), 1);
                continue;
            }
            assert_eq!(unpack(&whole[..cut]), None, "cut at {cut}");
        }
    }
}
