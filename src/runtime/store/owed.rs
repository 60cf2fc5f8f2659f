//! A former owner's Dones (issue #39, item 3).
//!
//! An owner whose session ends (its node stopped, its lock lost, its turn
//! given up) still owes Dones: appended but not confirmed when the
//! connection closed, queued behind them, or owed by publishes that were
//! on the wire at the end and are confirmed after it. Each one left
//! unwritten is a message the next owner restores and fires a second time:
//! most of a rolling restart's same-id copies.
//!
//! So they are written on a connection of their own, without the lock,
//! into the generation stream the session wrote them to, for a lease after
//! the end: the next owner waits out a lease before it reads, so most land
//! before its read. A Done is safe from anyone at any time: its message
//! left (its publish was confirmed), it names only that message's state
//! key, and no later owner writes to that generation (a restore writes a
//! fresh one). One that lands after the next owner read the stream changes
//! nothing; a stream deleted meanwhile returns it, and it is dropped.
//!
//! A restore arms and fires before its fresh generation is written. If that
//! write fails, the pointer still names the generation read, so what fired
//! meanwhile owes its Done to the one after it, which the next restore
//! reads last (after every Schedule it could end).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Records owed to one stream, in the order owed.
pub type ToStream = (String, Vec<Vec<u8>>);

/// What a former owner's sessions still owe.
#[derive(Debug, Default)]
pub struct Owed {
    /// The generation stream the current or last session writes to.
    stream: Option<String>,
    /// Records to write, each with the stream it goes to.
    records: Vec<(String, Vec<u8>)>,
    /// Engine ids that were being published when the session ended, and
    /// their state keys: a Done each once the publish is confirmed.
    leaving: HashMap<u64, u128>,
    /// Until when the owed records are written.
    until: Option<Instant>,
    /// A session lost with its lease held, to hand over once its Dones
    /// are written ([`Owed::hand_over_now`]).
    hand_over: Option<HandOver>,
}

/// A lost session's hand-over: its last own ping back was sent at
/// `last_back_sent`; the `Commit` must be confirmed within a lease of it.
#[derive(Debug, Clone, Copy)]
struct HandOver {
    last_back_sent: Instant,
    /// Publishes still leaving are waited for until then, and no longer:
    /// the notes need the rest.
    stop_waiting: Instant,
    /// Past it, the bound cannot hold.
    give_up: Instant,
}

impl Owed {
    /// A session writes to `stream` now: a Done its writer can no longer
    /// take (the session is ending) is owed to it.
    pub fn writing(&mut self, stream: String) {
        self.stream = Some(stream);
    }

    /// A session that wrote to `stream` ended; its records owed are
    /// written until `until`.
    pub fn ended(&mut self, stream: String, until: Instant) {
        self.stream = Some(stream);
        self.until = Some(self.until.map_or(until, |u| u.max(until)));
    }

    /// The stream the last session wrote to, if a session ended.
    pub fn stream(&self) -> Option<&str> {
        self.stream.as_deref()
    }

    /// Owe `record` to `stream`.
    pub fn owe(&mut self, stream: &str, record: Vec<u8>) {
        self.records.push((stream.to_owned(), record));
    }

    /// Engine id `id`, state key `key`, was being published at the end.
    pub fn leaving(&mut self, id: u64, key: u128) {
        self.leaving.insert(id, key);
    }

    /// The state key of `id` if it was leaving (once: its Done is owed).
    pub fn left(&mut self, id: u64) -> Option<u128> {
        self.leaving.remove(&id)
    }

    /// The session that ended, lost with its lease held, may be handed
    /// over (see `StateSession::hand_over_for`).
    pub fn may_hand_over(&mut self, last_back_sent: Instant, lease: Duration) {
        self.hand_over = Some(HandOver {
            last_back_sent,
            stop_waiting: last_back_sent + lease * 3 / 4,
            give_up: last_back_sent + lease,
        });
    }

    /// A hand-over due now: nothing owed is left to write, and no publish
    /// is still leaving (or there is no time left to wait for them; their
    /// Dones come late, and the next owner fires them again, same id).
    /// Once: the `last_back_sent` to hand over with. Past the bound, the
    /// hand-over is dropped.
    pub fn hand_over_now(&mut self, now: Instant) -> Option<Instant> {
        let h = self.hand_over?;
        if now >= h.give_up {
            self.hand_over = None;
            return None;
        }
        if !self.records.is_empty() || (!self.leaving.is_empty() && now < h.stop_waiting) {
            return None;
        }
        self.hand_over = None;
        Some(h.last_back_sent)
    }

    /// Whether records are owed now (not counting what may still come).
    pub fn owes_records(&self) -> bool {
        !self.records.is_empty()
    }

    /// Whether anything is still to be written, or may come, at `now`.
    pub fn outstanding(&self, now: Instant) -> bool {
        !self.records.is_empty() || self.until.is_some_and(|u| now < u)
    }

    /// The records owed, by stream (in the order owed), and whether the
    /// time to write them is over (then the publishes still leaving are
    /// forgotten: their Dones would come too late to matter).
    pub fn take(&mut self, now: Instant) -> (Vec<ToStream>, bool) {
        let mut by_stream: Vec<ToStream> = Vec::new();
        for (stream, record) in self.records.drain(..) {
            match by_stream.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, records)) => records.push(record),
                None => by_stream.push((stream, vec![record])),
            }
        }
        let over = self.until.is_none_or(|u| now >= u);
        if over {
            self.leaving.clear();
            self.until = None;
            self.hand_over = None;
        }
        (by_stream, over)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn records_are_taken_by_stream_in_the_order_owed() {
        let now = Instant::now();
        let mut owed = Owed::default();
        owed.ended("g1".into(), now + Duration::from_secs(1));
        owed.owe("g1", vec![1]);
        owed.owe("g2", vec![2]);
        owed.owe("g1", vec![3]);
        let (taken, over) = owed.take(now);
        assert!(!over);
        assert_eq!(
            taken,
            vec![
                ("g1".into(), vec![vec![1], vec![3]]),
                ("g2".into(), vec![vec![2]])
            ]
        );
        assert!(owed.take(now).0.is_empty());
    }

    #[test]
    fn a_lost_session_hands_over_once_its_dones_are_written_and_within_the_bound() {
        let lease = Duration::from_secs(1);
        let sent = Instant::now();
        let ms = |n| sent + Duration::from_millis(n);
        let mut owed = Owed::default();
        owed.ended("g".into(), ms(1000));
        owed.may_hand_over(sent, lease);
        owed.owe("g", vec![1]);
        owed.leaving(7, 70);
        assert_eq!(owed.hand_over_now(ms(100)), None, "a Done to write");
        owed.take(ms(100));
        assert_eq!(owed.hand_over_now(ms(100)), None, "a publish leaving");
        assert_eq!(owed.left(7), Some(70));
        assert_eq!(owed.hand_over_now(ms(200)), Some(sent));
        assert_eq!(owed.hand_over_now(ms(200)), None, "once");
        // A publish still leaving is waited for only until three quarters
        // of the lease.
        owed.may_hand_over(sent, lease);
        owed.leaving(8, 80);
        assert_eq!(owed.hand_over_now(ms(749)), None);
        assert_eq!(owed.hand_over_now(ms(750)), Some(sent));
        // Past the lease, never.
        owed.may_hand_over(sent, lease);
        assert_eq!(owed.hand_over_now(ms(1000)), None);
        owed.may_hand_over(sent, lease);
        owed.owe("g", vec![2]);
        assert_eq!(owed.hand_over_now(ms(999)), None);
        owed.take(ms(999));
        assert_eq!(owed.hand_over_now(ms(1001)), None);
    }

    #[test]
    fn a_leaving_publish_owes_its_done_once_and_only_until_the_end() {
        let now = Instant::now();
        let mut owed = Owed::default();
        owed.ended("g".into(), now + Duration::from_secs(1));
        owed.leaving(7, 70);
        owed.leaving(8, 80);
        assert_eq!(owed.left(7), Some(70));
        assert_eq!(owed.left(7), None);
        // A second session's end keeps the later deadline.
        owed.ended("h".into(), now + Duration::from_millis(500));
        assert_eq!(owed.stream(), Some("h"));
        assert!(!owed.take(now + Duration::from_millis(900)).1);
        assert!(owed.outstanding(now + Duration::from_millis(900)));
        assert!(owed.take(now + Duration::from_secs(1)).1);
        assert_eq!(owed.left(8), None, "forgotten once the time is over");
        assert!(!owed.outstanding(now + Duration::from_secs(1)));
        owed.owe("h", vec![9]);
        assert!(owed.outstanding(now + Duration::from_secs(1)));
    }
}
