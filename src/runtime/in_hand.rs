//! Deliveries in hand: taken from an AMQP queue and not yet settled (being
//! stored, or held to be stored again after a failure). One identity per
//! message depends on it.
//!
//! A delivery's channel can close while delayd still holds it: a node of
//! the cluster dies, a connection is cut. The broker then redelivers the
//! message on the new channel while the first copy is still here, perhaps
//! held after a failed store (the broker-kept store's record could not be
//! written as the node went). Minting a new identity for the redelivery
//! while the first copy is stored again under its own gave one message two
//! `x-delayd-id`s (the cluster fault campaign saw it). Worse, the first
//! copy's broker record may have been written even though its confirm was
//! lost, and a later restore brings it back under the first identity.
//!
//! So a redelivery whose bytes equal a delivery in hand from an earlier
//! channel session takes that delivery's identity, and the held copy is
//! superseded: it is not stored again (its channel is gone; the redelivery
//! is the copy that counts). Only an earlier session's: a broker redelivers
//! what a closed channel left unsettled, so a delivery of the same session
//! with equal bytes is another message (the same bytes published twice).
//! Matching those too chained twins onto one identity: twin 1's
//! redelivery took twin 1's id, twin 1's own first copy left, and twin 2's
//! redelivery then matched twin 1's redelivery (issue #37).
//! The engine's redelivery detection then merges the two where both reach
//! the store, and a copy that slips through is a same-id duplicate.
//!
//! Bytes are compared in full: a fingerprint match alone could give two
//! different messages one identity. Kafka deliveries are not registered:
//! their identity follows from where they were read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::id::MessageId;

/// One route's deliveries in hand, by fingerprint.
#[derive(Default)]
pub struct InHand {
    entries: Mutex<HashMap<u64, Vec<Entry>>>,
    next_token: AtomicU64,
}

struct Entry {
    token: u64,
    /// The channel session it came on (see `Delivery::session`).
    session: u64,
    bytes: Arc<[u8]>,
    uid: MessageId,
    superseded: Arc<AtomicBool>,
}

/// A delivery's place in [`InHand`]; leaves it on drop (the delivery was
/// settled or given back).
pub struct Ticket {
    in_hand: Arc<InHand>,
    fp: u64,
    token: u64,
    superseded: Arc<AtomicBool>,
}

impl InHand {
    fn entries(&self) -> MutexGuard<'_, HashMap<u64, Vec<Entry>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register a delivery with these encoded `bytes`, taken in on channel
    /// `session`. A `redelivered` one equal to a delivery in hand from an
    /// earlier session takes its identity and supersedes it; any other gets
    /// `fresh()`. Returns the identity and the ticket.
    pub fn take_in(
        self: &Arc<Self>,
        bytes: Arc<[u8]>,
        redelivered: bool,
        session: u64,
        fresh: impl FnOnce() -> MessageId,
    ) -> (MessageId, Ticket) {
        let fp = fingerprint(&bytes);
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let superseded = Arc::new(AtomicBool::new(false));
        let mut entries = self.entries();
        let same = entries.entry(fp).or_default();
        let earlier = redelivered
            .then(|| {
                same.iter().find(|e| {
                    e.session < session
                        && !e.superseded.load(Ordering::Acquire)
                        && *e.bytes == *bytes
                })
            })
            .flatten();
        let uid = match earlier {
            Some(e) => {
                e.superseded.store(true, Ordering::Release);
                e.uid
            }
            None => fresh(),
        };
        same.push(Entry {
            token,
            session,
            bytes,
            uid,
            superseded: superseded.clone(),
        });
        drop(entries);
        let ticket = Ticket {
            in_hand: self.clone(),
            fp,
            token,
            superseded,
        };
        (uid, ticket)
    }

    /// How many deliveries are in hand.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries().values().map(Vec::len).sum()
    }
}

impl Ticket {
    /// A redelivery of this delivery took over: it must not be stored again.
    pub fn superseded(&self) -> bool {
        self.superseded.load(Ordering::Acquire)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut entries = self.in_hand.entries();
        if let Some(same) = entries.get_mut(&self.fp) {
            same.retain(|e| e.token != self.token);
            if same.is_empty() {
                entries.remove(&self.fp);
            }
        }
    }
}

/// CRC32C and length: picks candidates only.
fn fingerprint(bytes: &[u8]) -> u64 {
    (u64::from(crc32c::crc32c(bytes)) << 32) | (bytes.len() as u32) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(s: &str) -> Arc<[u8]> {
        Arc::from(s.as_bytes())
    }

    #[test]
    fn a_redelivery_of_a_delivery_in_hand_takes_its_identity_and_supersedes_it() {
        let in_hand = Arc::new(InHand::default());
        let (first, held) = in_hand.take_in(bytes("order 7"), false, 1, MessageId::mint);
        let (again, copy) = in_hand.take_in(bytes("order 7"), true, 2, MessageId::mint);
        assert_eq!(again, first, "one message, one identity");
        assert!(held.superseded(), "the held copy must not be stored again");
        assert!(!copy.superseded());
        // A third copy, once that channel closed too, takes the identity
        // from the one now in hand.
        let (third, _) = in_hand.take_in(bytes("order 7"), true, 3, MessageId::mint);
        assert_eq!(third, first);
        assert!(copy.superseded());
    }

    #[test]
    fn only_a_redelivery_of_equal_bytes_shares_an_identity() {
        let in_hand = Arc::new(InHand::default());
        let (first, held) = in_hand.take_in(bytes("order 7"), false, 1, MessageId::mint);
        // Published twice on purpose: a new message.
        let (twin, _t) = in_hand.take_in(bytes("order 7"), false, 1, MessageId::mint);
        assert_ne!(twin, first);
        let (other, _o) = in_hand.take_in(bytes("order 8"), true, 2, MessageId::mint);
        assert_ne!(other, first);
        assert!(!held.superseded());
    }

    #[test]
    fn equal_fingerprints_with_different_bytes_are_different_messages() {
        let in_hand = Arc::new(InHand::default());
        let (first, held) = in_hand.take_in(bytes("a"), false, 1, MessageId::mint);
        // Forge a colliding entry: same fingerprint, other bytes.
        let fp = fingerprint(b"a");
        in_hand.entries().get_mut(&fp).unwrap()[0].bytes = bytes("b");
        let (copy, _c) = in_hand.take_in(bytes("a"), true, 2, MessageId::mint);
        assert_ne!(copy, first);
        assert!(!held.superseded());
    }

    #[test]
    fn a_settled_delivery_leaves_and_its_redelivery_is_new() {
        let in_hand = Arc::new(InHand::default());
        let (first, held) = in_hand.take_in(bytes("order 7"), false, 1, MessageId::mint);
        drop(held);
        assert_eq!(in_hand.len(), 0);
        let (again, _t) = in_hand.take_in(bytes("order 7"), true, 2, MessageId::mint);
        assert_ne!(again, first);
        assert_eq!(in_hand.len(), 1);
    }

    /// Two messages with equal bytes (published twice on purpose), both in
    /// hand when their channel closed. Twin 1's redelivery takes twin 1's
    /// identity; twin 1's first copy leaves (settled), and so does twin
    /// 2's; twin 2's redelivery must not take the identity of twin 1's
    /// redelivery, which came on its own channel session. Fails without
    /// the session check: two messages, one identity (issue #37).
    #[test]
    fn twins_redelivered_together_keep_two_identities() {
        let in_hand = Arc::new(InHand::default());
        let (one, one_held) = in_hand.take_in(bytes("recompute 42"), false, 1, MessageId::mint);
        let (two, two_held) = in_hand.take_in(bytes("recompute 42"), false, 1, MessageId::mint);
        assert_ne!(one, two);
        let (one_again, _a) = in_hand.take_in(bytes("recompute 42"), true, 2, MessageId::mint);
        assert!(one_held.superseded());
        drop(one_held);
        drop(two_held);
        let (two_again, _b) = in_hand.take_in(bytes("recompute 42"), true, 2, MessageId::mint);
        assert_eq!(one_again, one);
        assert_ne!(two_again, one, "twin 2 took twin 1's identity");
    }
}
