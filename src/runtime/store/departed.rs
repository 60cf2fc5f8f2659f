//! What a RabbitMQ route's state streams keep of the messages that left
//! recently, and the replay of a generation that finds them.
//!
//! A delivery whose ack did not reach the broker comes back later, flagged
//! redelivered: RabbitMQ keeps a consumer on a node cut off from the queue's
//! leader active for up to a minute, with the deliveries it held. If the
//! owner that stored the message also fired it before its lock moved, the
//! next owner's restore does not see it (a restore reads only the live
//! set), and the late delivery was stored as a new message, under a new id,
//! and fired a second time (the long `node-cut` campaign: 433 such copies).
//!
//! So a restore and a checkpoint keep the newest [`KEPT`] departed messages
//! (a Done read after its Schedule, or a [`Record::Remembered`] carried from
//! an older generation) as `Remembered` records in the new generation, and
//! the new owner registers them with its engine
//! ([`Engine::remember_departed`](crate::engine::Engine::remember_departed)):
//! a late redelivery equal to one of them is then stored again under its
//! identity (a same-id copy, or its twin kept), or, if it was cancelled,
//! not stored at all. A cancel writes its `Remembered` record at once (the
//! Done alone does not say that it was a cancel).

use std::collections::{HashMap, VecDeque};

use delayd_adapters::amqp::state::{
    ApplyRecord, LiveRecord, LiveSet, Record, StateError, StateSession,
};

use crate::engine::{digest, fingerprint};

/// Departed messages a generation keeps. A late redelivery is one an owner
/// stored just before it lost the lock (its ack was cut off with it) and
/// fired before the next owner restored: at most a few seconds of firing,
/// which this covers at several thousand messages a second.
pub const KEPT: usize = 20_000;

/// A message that left: what a redelivery of it is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Departed {
    /// Its identity (the store id).
    pub id: u128,
    pub fingerprint: u64,
    pub digest: [u8; 32],
    pub cancelled: bool,
}

impl Departed {
    /// Message `id` of `route`, stored as `message`.
    pub fn of(route: &str, id: u128, message: &[u8], cancelled: bool) -> Self {
        Self {
            id,
            fingerprint: fingerprint(route, message),
            digest: digest(route, message),
            cancelled,
        }
    }

    pub fn record(&self) -> Record {
        Record::Remembered {
            id: self.id,
            fingerprint: self.fingerprint,
            digest: self.digest,
            cancelled: self.cancelled,
        }
    }
}

/// The newest departed messages, by the order they were noted, at most
/// `kept`. One entry per identity: a cancel anywhere under it sticks.
#[derive(Debug)]
pub struct Newest {
    kept: usize,
    order: VecDeque<u128>,
    by_id: HashMap<u128, Departed>,
}

impl Newest {
    pub fn new(kept: usize) -> Self {
        Self {
            kept,
            order: VecDeque::new(),
            by_id: HashMap::new(),
        }
    }

    pub fn note(&mut self, departed: Departed) {
        if let Some(known) = self.by_id.get_mut(&departed.id) {
            known.cancelled |= departed.cancelled;
            return;
        }
        if self.kept == 0 {
            return;
        }
        if self.order.len() == self.kept {
            if let Some(oldest) = self.order.pop_front() {
                self.by_id.remove(&oldest);
            }
        }
        self.order.push_back(departed.id);
        self.by_id.insert(departed.id, departed);
    }

    /// Oldest first.
    pub fn into_vec(mut self) -> Vec<Departed> {
        self.order
            .iter()
            .filter_map(|id| self.by_id.remove(id))
            .collect()
    }
}

/// A replay of a route's state records, in stream order: the live set, the
/// highest offset of each stream ingress, and the newest departed.
#[derive(Debug)]
pub struct Replay {
    route: String,
    live: LiveSet,
    departed: Newest,
}

impl Replay {
    pub fn new(route: &str, kept: usize) -> Self {
        Self {
            route: route.to_owned(),
            live: LiveSet::default(),
            departed: Newest::new(kept),
        }
    }

    pub fn apply(&mut self, record: Record) {
        if let Record::Remembered {
            id,
            fingerprint,
            digest,
            cancelled,
        } = record
        {
            self.departed.note(Departed {
                id,
                fingerprint,
                digest,
                cancelled,
            });
        } else if let Some(left) = self.live.apply(record) {
            let departed = Departed::of(&self.route, left.identity, &left.message, false);
            self.departed.note(departed);
        }
    }

    /// The live messages' bytes.
    pub fn bytes(&self) -> usize {
        self.live.bytes()
    }

    /// Apply generation stream `stream`'s records; returns how many were read.
    pub async fn read(&mut self, session: &StateSession, stream: &str) -> Result<u64, StateError> {
        session
            .read_all(stream, |record| {
                self.apply(record);
                Ok(())
            })
            .await
    }

    /// The live set in the order first written, the departed (oldest
    /// first), and the offsets.
    pub fn finish(self) -> (Vec<LiveRecord>, Vec<Departed>, HashMap<String, i64>) {
        let (live, offsets) = self.live.finish();
        (live, self.departed.into_vec(), offsets)
    }
}

impl ApplyRecord for Replay {
    fn apply(&mut self, record: Record) {
        Replay::apply(self, record);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(id: u128, body: &str) -> Record {
        Record::Schedule {
            id,
            due_ms: 7,
            message: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_done_after_its_schedule_is_remembered_and_a_live_record_is_not() {
        let mut replay = Replay::new("r", 10);
        replay.apply(schedule(1, "one"));
        replay.apply(schedule(2, "two"));
        replay.apply(Record::Done { id: 1 });
        replay.apply(Record::Done { id: 99 }); // its Schedule is in no generation read
        let (live, departed, _) = replay.finish();
        assert_eq!(live.iter().map(|r| r.id).collect::<Vec<_>>(), [2]);
        assert_eq!(departed, [Departed::of("r", 1, b"one", false)]);
    }

    #[test]
    fn a_cancel_sticks_to_its_identity_whichever_record_comes_first() {
        let mut replay = Replay::new("r", 10);
        let cancelled = Departed::of("r", 1, b"one", true);
        replay.apply(schedule(1, "one"));
        replay.apply(Record::Done { id: 1 });
        replay.apply(cancelled.record());
        // A checkpoint's carry of the same message, not cancelled, later.
        replay.apply(Departed::of("r", 1, b"one", false).record());
        let (_, departed, _) = replay.finish();
        assert_eq!(departed, [cancelled]);
    }

    #[test]
    fn only_the_newest_are_kept() {
        let mut replay = Replay::new("r", 2);
        for id in 1..=3 {
            replay.apply(schedule(id, "m"));
            replay.apply(Record::Done { id });
        }
        let (_, departed, _) = replay.finish();
        assert_eq!(departed.iter().map(|d| d.id).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn the_digest_is_of_the_route_and_the_bytes() {
        let a = Departed::of("r", 1, b"m", false);
        assert_ne!(a.digest, Departed::of("s", 1, b"m", false).digest);
        assert_ne!(a.digest, Departed::of("r", 1, b"n", false).digest);
        assert_eq!(a.fingerprint, fingerprint("r", b"m"));
    }
}
