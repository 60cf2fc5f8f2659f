//! Recognising broker redeliveries of messages already stored.
//!
//! A broker redelivers a message whose ack it never saw, with its
//! `redelivered` flag set. delayd keeps the fingerprints (64-bit hashes of
//! route and encoded message) of records whose ack is not known to have
//! reached the broker: added on store, removed when the ack succeeds. After a
//! restart it seeds the set with the newest records of the log, since their
//! acks are unknown. Only a delivery flagged `redelivered` is checked, so two
//! identical messages published on purpose are both kept unless the second
//! is a redelivery within that window (documented at-least-once caveat).

use std::collections::{HashMap, VecDeque};

pub fn fingerprint(route: &str, message: &[u8]) -> u64 {
    let a = crc32c::crc32c_append(crc32c::crc32c(route.as_bytes()), message);
    let b = crc32c::crc32c_append(0x9e37_79b9 ^ message.len() as u32, message);
    ((a as u64) << 32) | b as u64
}

/// Bounded multiset of unconfirmed fingerprints, oldest evicted first.
#[derive(Debug)]
pub struct Unconfirmed {
    order: VecDeque<u64>,
    counts: HashMap<u64, u32>,
    capacity: usize,
}

impl Unconfirmed {
    pub fn new(capacity: usize) -> Self {
        Self {
            order: VecDeque::new(),
            counts: HashMap::new(),
            capacity,
        }
    }

    pub fn add(&mut self, fp: u64) {
        if self.capacity == 0 {
            return;
        }
        while self.order.len() >= self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.forget(old);
            }
        }
        self.order.push_back(fp);
        *self.counts.entry(fp).or_default() += 1;
    }

    /// The ack reached the broker: this fingerprint can no longer come back.
    pub fn confirm(&mut self, fp: u64) {
        if self.forget(fp) {
            if let Some(i) = self.order.iter().rposition(|&x| x == fp) {
                self.order.remove(i);
            }
        }
    }

    /// Is this a redelivery of a stored message? Consumes the match.
    pub fn take(&mut self, fp: u64) -> bool {
        let found = self.counts.contains_key(&fp);
        self.confirm(fp);
        found
    }

    fn forget(&mut self, fp: u64) -> bool {
        match self.counts.get_mut(&fp) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                self.counts.remove(&fp);
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirmed_fingerprints_are_not_duplicates() {
        let mut u = Unconfirmed::new(10);
        let fp = fingerprint("r", b"m");
        u.add(fp);
        u.confirm(fp);
        assert!(!u.take(fp));
    }

    #[test]
    fn unconfirmed_fingerprint_matches_once() {
        let mut u = Unconfirmed::new(10);
        let fp = fingerprint("r", b"m");
        u.add(fp);
        assert!(u.take(fp));
        assert!(!u.take(fp));
    }

    #[test]
    fn capacity_evicts_oldest() {
        let mut u = Unconfirmed::new(2);
        u.add(1);
        u.add(2);
        u.add(3);
        assert!(!u.take(1));
        assert!(u.take(2));
        assert!(u.take(3));
        assert!(u.is_empty());
    }

    #[test]
    fn fingerprint_depends_on_route_and_bytes() {
        assert_ne!(fingerprint("a", b"m"), fingerprint("b", b"m"));
        assert_ne!(fingerprint("a", b"m"), fingerprint("a", b"n"));
        assert_eq!(fingerprint("a", b"m"), fingerprint("a", b"m"));
    }
}
