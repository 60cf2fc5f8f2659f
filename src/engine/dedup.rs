//! Recognising broker redeliveries of messages already stored.
//!
//! A broker redelivers a message whose ack it never saw, with its
//! `redelivered` flag set (Kafka: every record past the last commit). delayd
//! remembers the messages whose ack is not known to have reached the broker:
//! added on store, removed once the ack succeeds (the broker answered a
//! round trip after it). That ack is marked in the WAL (an Acked frame,
//! lazily, like a fired message's Done). After a restart it seeds the set
//! with the newest records of the log ([`Recent`]) less the marked ones:
//! before the marks, every one of the newest was a candidate, and a twin
//! (the same bytes published twice on purpose) redelivered after the
//! restart was taken for its acknowledged sibling and lost (issue #37).
//!
//! On a queue (a delivery bound to a channel session), what is known of a
//! remembered record's ack decides what a byte-equal redelivery is
//! ([`AckState`]):
//! - its ack was never sent: the broker will redeliver it, so the
//!   redelivery is that record (one to one) and is not stored again. The
//!   record stands for that redelivery from then on (its session, its ack
//!   in doubt: the duplicate is acked, and that ack can be lost too);
//! - its ack was sent and not answered (in flight, cut off by the
//!   connection, or read back at a start without an Acked mark): the
//!   redelivery is that record or its twin, and nothing can tell which. It
//!   is stored again under the record's identity: a same-id duplicate if
//!   it is that record, its twin kept (under its sibling's id) if not.
//!   Dropping it lost the twin.
//!
//! Even a confirmed ack is not certain on a queue: the broker applied it,
//! but a classic queue whose node is killed can come back without it (it
//! had not written it yet), and redeliver the message. A delivery
//! of a channel session whose ack was confirmed is therefore kept in doubt
//! among the last [`CONFIRMED_KEPT`] confirmed: its redelivery on a later
//! session is stored under its id, not as a new message (the cluster
//! campaign's `classic-node` saw that as a copy under another id, issue
//! #40). Only in this process: a restart knows it by its Acked mark.
//!
//! A cancelled record is marked so (an Acked mark with [`CANCELLED_MARK`]
//! set, ahead of its Done, so durable with it): a redelivery that repeats
//! it is not stored again whatever is known of the ack, or the cancelled
//! message would fire. A live byte-equal record is preferred to it; if
//! there is none, a twin of it whose ack was in doubt goes with it: the one
//! case where a twin is not kept.
//!
//! A record matches one redelivery only. Once that redelivery is stored as
//! its copy (the in-doubt case above), the record is settled: a
//! [`MATCHED_MARK`] says so, durably before the copy is answered, and
//! compaction moves it on. A later redelivery of the same bytes repeats the
//! copy, or is a twin. Left a candidate after a restart, a record that
//! stayed pending while its copy fired could be cancelled later, and a twin
//! published after that cancel was taken for it and dropped.
//!
//! A Kafka record's or a stream delivery's bytes carry where it was read,
//! so equal bytes are always the same record: a duplicate.
//!
//! A redelivery is a duplicate only if its bytes equal a remembered stored
//! record's, compared in full: the fingerprint below only finds candidates.
//! Dropping on a hash match alone would ack, and so lose, a message that was
//! never stored. A Kafka message's encoding carries its topic, partition and
//! offset, so two records with equal content are never merged; an AMQP
//! message that is published twice on purpose is told from a redelivery by
//! what is known of the ack (above).
//!
//! A remembered record's bytes are read where it was written, which works
//! after it fired until its segment is deleted. Garbage collection and
//! compaction therefore replace a remembered record's position by a SHA-256
//! of its route and bytes before deleting the segment. Without that, a Kafka
//! partition given back after a crash redelivered records whose segment was
//! already gone, and each was stored and sent again under a new id.
//!
//! A record is remembered only once its whole store is durable: the WAL
//! record and, with the broker-kept store, the broker's record too. A
//! redelivery can come sooner: the connection its original came on died
//! while the original was still being written. [`Writing`] counts the
//! stores being written by fingerprint, and a redelivery with one of those
//! waits for them to end before it is compared. Remembered any sooner (once
//! the WAL record alone was durable), a redelivery was called a duplicate
//! and acked while the broker's record could still fail, and the message
//! was then in neither.

use std::collections::{HashMap, VecDeque};

use sha2::{Digest as _, Sha256};

use crate::wal::frame::{REMEMBERED_CANCELLED, REMEMBERED_LEFT};
use crate::wal::{Remembered, WalPos};

/// What a remembered record's bytes are compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evidence {
    /// Where its Schedule was written (readable until its segment is deleted).
    At(WalPos),
    /// [`digest`] of its route and bytes, taken before its segment went.
    Digest([u8; 32]),
}

/// SHA-256 of (route, encoded message): equal digests mean equal bytes.
pub fn digest(route: &str, message: &[u8]) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update((route.len() as u64).to_le_bytes());
    hash.update(route.as_bytes());
    hash.update(message);
    hash.finalize().into()
}

/// A 64-bit bucket key for (route, encoded message): CRC32C of both, and the
/// message length. Only picks candidates; equality is decided on the bytes.
pub fn fingerprint(route: &str, message: &[u8]) -> u64 {
    let crc = crc32c::crc32c_append(crc32c::crc32c(route.as_bytes()), message);
    ((crc as u64) << 32) | (message.len() as u32) as u64
}

/// Set in an Acked mark's id: the message was cancelled, its ack still
/// unconfirmed (see the module doc). WAL ids are sequence numbers and never
/// reach it; a delayd that predates the flag ignores the mark (an unknown
/// id).
pub const CANCELLED_MARK: u64 = 1 << 63;

/// Set in an Acked mark's id: a redelivery matched message `id` and is
/// stored as its copy, under its identity (see [`Unconfirmed::settle`]).
/// The copy stands for it: no later redelivery repeats it, after a restart
/// too. Below [`DEPARTED_IDS`], above any WAL id; a delayd that predates
/// the flag ignores the mark (an unknown id).
pub const MATCHED_MARK: u64 = 1 << 61;

/// Ids given to departed messages remembered from another owner
/// ([`Unconfirmed::add_departed`]): above any WAL id, below
/// [`CANCELLED_MARK`]. Never written anywhere.
const DEPARTED_IDS: u64 = 1 << 62;

/// Whether `id` names a departed message remembered from another owner
/// (no record of it is in this WAL).
pub fn is_departed(id: u64) -> bool {
    (DEPARTED_IDS..CANCELLED_MARK).contains(&id)
}

/// [`Recent`] reads this many times its capacity of the newest records.
pub const RECENT_READ_FACTOR: usize = 2;

/// How many records with a confirmed ack stay in doubt (see the module
/// doc): about the last second of acks at a few thousand a second.
pub const CONFIRMED_KEPT: usize = 4096;

/// What is known of a remembered record's source ack (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckState {
    /// Not sent: the broker will redeliver the record.
    Unsent,
    /// Sent, and not known to have been applied.
    InDoubt,
}

/// A remembered record a redelivery may repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub id: u64,
    pub evidence: Evidence,
    /// Its identity, which a copy stored for an in-doubt match keeps.
    pub uid: u128,
    pub ack: AckState,
    /// It was cancelled: a redelivery must not bring it back.
    pub cancelled: bool,
    /// Its Schedule's segment is gone (it is known by its digest): it
    /// left long ago, and yields to a cancelled record.
    pub left_long_ago: bool,
    /// It left (fired or parked): it yields to a live record.
    pub left: bool,
}

/// One remembered record.
#[derive(Debug, Clone, Copy)]
struct Entry {
    fp: u64,
    evidence: Evidence,
    /// The source session its delivery came on: 0 when not bound to one,
    /// see [`Arrival`].
    session: u64,
    uid: u128,
    ack: AckState,
    cancelled: bool,
    /// It left (fired or parked), or its Done was read back at a start: a
    /// cancel of another record under its identity does not cover it.
    left: bool,
    /// It matched a redelivery that is stored as its copy (one to one):
    /// no candidate any more, but kept so that compaction still moves its
    /// cancel mark on. (One answered "duplicate" is rebound instead.)
    consumed: bool,
    /// That redelivery is stored as its copy, and a [`MATCHED_MARK`] says
    /// so: compaction moves the mark on (see [`Unconfirmed::settle`]).
    settled: bool,
    /// Its ack was confirmed (kept in doubt in this process only).
    confirmed: bool,
    /// The segment of its Remembered frame, once its Schedule's is gone
    /// (see [`Unconfirmed::departing`]).
    frame: Option<u32>,
    /// Its segment went before its Remembered frame could be written (a
    /// full disk): written as soon as there is room, and until then only
    /// the ledger of owed frames knows it (see `wal::ledger`), or memory.
    owed: bool,
    /// Its Remembered frame says it was cancelled. A cancel after the frame
    /// was written is durable only by its cancel mark, whose segment can go
    /// before the frame's (nothing retires a Schedule there any more): so
    /// the frame is written again (sim seed 3123).
    frame_cancelled: bool,
}

/// A remembered record whose Schedule or Remembered frame is in a segment
/// about to be deleted.
#[derive(Debug, Clone, Copy)]
pub struct Departing {
    pub id: u64,
    /// The going segment it is in; `None` if it owes a frame and is in
    /// none (see [`Unconfirmed::owe_frame`]).
    pub from: Option<u32>,
    pub uid: u128,
    pub fp: u64,
    pub evidence: Evidence,
    pub cancelled: bool,
    pub left: bool,
    /// A restart needs it: a Remembered frame is written for it. Not for a
    /// record whose ack was confirmed (a restart knows it only by its
    /// Acked mark, as before) or that matched its redelivery already.
    pub durable: bool,
}

/// Bounded set of stored, unconfirmed messages (by id), oldest evicted first.
#[derive(Debug)]
pub struct Unconfirmed {
    /// Ids in the order they were added; may hold ids removed since (skipped
    /// on eviction, dropped when it grows past twice the live count).
    order: VecDeque<u64>,
    /// Id → what is remembered of it.
    fingerprints: HashMap<u64, Entry>,
    /// Fingerprint → ids with it (almost always one).
    ids: HashMap<u64, Vec<u64>>,
    /// Ids whose ack was confirmed and which stay in doubt, oldest first
    /// (may hold ids removed since).
    confirmed: VecDeque<u64>,
    /// Identity → ids kept under it (more than one: a copy stored for an
    /// in-doubt match, a far load's copy).
    by_uid: HashMap<u128, Vec<u64>>,
    capacity: usize,
    /// Departed messages added so far (their ids count from [`DEPARTED_IDS`]).
    departed: u64,
}

impl Unconfirmed {
    pub fn new(capacity: usize) -> Self {
        Self {
            order: VecDeque::new(),
            fingerprints: HashMap::new(),
            ids: HashMap::new(),
            by_uid: HashMap::new(),
            confirmed: VecDeque::new(),
            capacity,
            departed: 0,
        }
    }

    /// Message `id` (identity `uid`), with this fingerprint, is stored at
    /// `pos` and its ack unconfirmed (`ack`: sent or not); its delivery came
    /// on source session `session` (0: not bound to one, or read back at a
    /// start).
    pub fn add(&mut self, id: u64, uid: u128, fp: u64, pos: WalPos, session: u64, ack: AckState) {
        self.insert(
            id,
            Entry {
                fp,
                evidence: Evidence::At(pos),
                session,
                uid,
                ack,
                cancelled: false,
                left: false,
                consumed: false,
                settled: false,
                confirmed: false,
                frame: None,
                owed: false,
                frame_cancelled: false,
            },
        );
    }

    /// A message (identity `uid`) that left under another owner of its
    /// route, its ack in doubt (see `runtime::store::departed`): a
    /// redelivery equal to it is stored again under `uid`, or, if it was
    /// `cancelled`, not at all. It counts as left: a cancel of a copy made
    /// later does not cover it.
    pub fn add_departed(&mut self, uid: u128, fp: u64, digest: [u8; 32], cancelled: bool) {
        let id = DEPARTED_IDS + self.departed;
        self.departed += 1;
        self.insert(
            id,
            Entry {
                fp,
                evidence: Evidence::Digest(digest),
                session: 0,
                uid,
                ack: AckState::InDoubt,
                cancelled,
                left: true,
                consumed: false,
                settled: false,
                confirmed: false,
                frame: None,
                owed: false,
                frame_cancelled: false,
            },
        );
    }

    /// A record read back at a start (see [`Recent::unacked`]): its ack in
    /// doubt, compared at its Schedule or, if that is gone, by the digest
    /// of its Remembered frame.
    pub fn restore(&mut self, r: &ReadBack) {
        self.insert(
            r.id,
            Entry {
                fp: r.fp,
                evidence: r.evidence,
                session: 0,
                uid: r.uid,
                ack: AckState::InDoubt,
                cancelled: false,
                left: false,
                consumed: r.settled,
                settled: r.settled,
                confirmed: false,
                frame: r.frame,
                owed: r.owed,
                frame_cancelled: r.frame_cancelled,
            },
        );
    }

    fn insert(&mut self, id: u64, entry: Entry) {
        if self.capacity == 0 {
            return;
        }
        while self.fingerprints.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.remove(old);
                }
                None => break,
            }
        }
        let (fp, uid) = (entry.fp, entry.uid);
        if self.fingerprints.insert(id, entry).is_none() {
            self.ids.entry(fp).or_default().push(id);
            self.by_uid.entry(uid).or_default().push(id);
            self.order.push_back(id);
        }
        if self.order.len() > 2 * self.fingerprints.len() + 1024 {
            let live = &self.fingerprints;
            self.order.retain(|id| live.contains_key(id));
        }
    }

    /// The ack of `id` reached the broker (or it was matched): forget it.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some(Entry { fp, uid, .. }) = self.fingerprints.remove(&id) else {
            return false;
        };
        if let Some(ids) = self.ids.get_mut(&fp) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.ids.remove(&fp);
            }
        }
        if let Some(ids) = self.by_uid.get_mut(&uid) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.by_uid.remove(&uid);
            }
        }
        true
    }

    /// Remembered records whose Schedule, or Remembered frame, was
    /// written in one of `segments`: before those go, each is compared by
    /// digest from then on ([`Unconfirmed::set_digest`]), and those a
    /// restart needs get a new Remembered frame
    /// ([`Unconfirmed::set_frame`]). Without the frame, a restart after the
    /// segment went forgot a message that fired with its ack in doubt, and
    /// its late redelivery was stored under a new id (sim seed 3). Those
    /// that owe a frame come too.
    pub fn departing(&self, segments: &[u32]) -> Vec<Departing> {
        let mut departing: Vec<Departing> = self
            .fingerprints
            .iter()
            .filter_map(|(&id, entry)| {
                let schedule = match entry.evidence {
                    Evidence::At(pos) => Some(pos.segment),
                    Evidence::Digest(_) => entry.frame,
                };
                let from = schedule
                    .filter(|s| segments.contains(s))
                    .or(entry.frame.filter(|s| segments.contains(s)));
                let stale = entry.frame.is_some() && entry.cancelled && !entry.frame_cancelled;
                (from.is_some() || entry.owed || stale).then_some((id, from, entry))
            })
            .map(|(id, from, entry)| Departing {
                id,
                from,
                uid: entry.uid,
                fp: entry.fp,
                evidence: entry.evidence,
                cancelled: entry.cancelled,
                left: entry.left,
                durable: !entry.confirmed && !entry.consumed,
            })
            .collect();
        // In log order, whatever the map's: a run is the same every time.
        departing.sort_unstable_by_key(|d| d.id);
        departing
    }

    /// Compare `id` by this digest from now on (its segment is going).
    pub fn set_digest(&mut self, id: u64, digest: [u8; 32]) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.evidence = Evidence::Digest(digest);
        }
    }

    /// `id`'s Remembered frame is now in segment `frame` (`None`: it has
    /// none, and a restart will not know it).
    pub fn set_frame(&mut self, id: u64, frame: Option<u32>) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.frame = frame;
            entry.owed = false;
        }
    }

    /// `id`'s Remembered frame was written in segment `frame`, saying
    /// whether it was `cancelled`.
    pub fn frame_written(&mut self, id: u64, frame: u32, cancelled: bool) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.frame = Some(frame);
            entry.owed = false;
            entry.frame_cancelled = cancelled;
        }
    }

    /// `id`'s segment goes without its Remembered frame (a full disk):
    /// it is written once there is room (see [`Unconfirmed::departing`]).
    pub fn owe_frame(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.frame = None;
            entry.owed = true;
        }
    }

    /// The remembered records that owe a Remembered frame, (id, identity):
    /// a restart knows them only if the ledger of owed frames holds them.
    pub fn frames_owed(&self) -> Vec<(u64, u128)> {
        self.fingerprints
            .iter()
            .filter(|(_, e)| e.owed)
            .map(|(&id, e)| (id, e.uid))
            .collect()
    }

    /// Compaction copied `id`'s Schedule from `old` to `new`: compare it
    /// there (while still remembered at `old`).
    pub fn moved(&mut self, id: u64, old: WalPos, new: WalPos) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            if entry.evidence == Evidence::At(old) {
                entry.evidence = Evidence::At(new);
            }
        }
    }

    /// The ack of `id` is being sent (or was, with no answer): from now on
    /// a byte-equal redelivery may be its twin.
    pub fn ack_sent(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.ack = AckState::InDoubt;
        }
    }

    /// The ack of `id` was confirmed. A delivery bound to a channel session
    /// stays in doubt among the last [`CONFIRMED_KEPT`] (see the module
    /// doc); any other is forgotten. True if it was remembered unconfirmed.
    pub fn confirm(&mut self, id: u64) -> bool {
        let Some(entry) = self.fingerprints.get_mut(&id) else {
            return false;
        };
        if entry.session == 0 {
            return self.remove(id);
        }
        entry.ack = AckState::InDoubt;
        entry.confirmed = true;
        self.confirmed.push_back(id);
        while self.confirmed.len() > CONFIRMED_KEPT {
            if let Some(old) = self.confirmed.pop_front() {
                // Not one that stands for a later delivery since.
                if self.fingerprints.get(&old).is_some_and(|e| e.confirmed) {
                    self.remove(old);
                }
            }
        }
        true
    }

    /// `id` matched a redelivery on source session `session` that was
    /// answered "duplicate": it stands for that delivery now, whose ack is
    /// sent and not known to arrive. Consumed instead, a redelivery of that
    /// delivery (its ack lost with the channel) found no record and was
    /// stored under a new id, or, the record cancelled, fired after the
    /// cancel; and the record's segment went with no Remembered frame, so
    /// a restart forgot it too (sim seed 6,572). A redelivery on a later
    /// session repeats it, as it would the delivery it stood for before.
    pub fn rebind(&mut self, id: u64, session: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.consumed = false;
            entry.session = session;
            entry.ack = AckState::InDoubt;
            entry.confirmed = false;
        }
    }

    /// `id` matched a redelivery: no candidate any more (see `Entry`).
    pub fn consume(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.consumed = true;
        }
    }

    /// The redelivery `id` matched is stored as its copy: it is settled
    /// for good, and marked so in the WAL ([`MATCHED_MARK`]). Left a
    /// candidate after a restart, a record that stayed pending while its
    /// copy fired could be cancelled later, and a twin published after the
    /// cancel was taken for it and dropped (sim seed 9,242,409).
    pub fn settle(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.consumed = true;
            entry.settled = true;
        }
    }

    /// Whether `id` is settled (see [`Unconfirmed::settle`]).
    pub fn is_settled(&self, id: u64) -> bool {
        self.fingerprints.get(&id).is_some_and(|e| e.settled)
    }

    /// The redelivery `id` matched was not stored after all: a candidate
    /// again.
    pub fn unconsume(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.consumed = false;
        }
    }

    /// The segment a restart reads remembered record `id` back from: its
    /// Schedule's while that is on disk, else its Remembered frame's.
    pub fn read_back_from(&self, id: u64) -> Option<u32> {
        let entry = self.fingerprints.get(&id)?;
        match entry.evidence {
            Evidence::At(pos) => Some(pos.segment),
            Evidence::Digest(_) => entry.frame,
        }
    }

    /// The Acked mark a compaction copy of stored record `id` is followed
    /// by: a restart reads the copy as the newest record under its id, and
    /// only a mark after it says what is known of its ack. A settled record
    /// gets its [`MATCHED_MARK`]; one whose ack was confirmed, or that is
    /// no candidate here any more, a plain mark; one in doubt none.
    pub fn mark_for_copy(&self, id: u64) -> Option<u64> {
        match self.fingerprints.get(&id) {
            None => Some(id),
            Some(e) if e.settled => Some(id | MATCHED_MARK),
            Some(e) if e.confirmed => Some(id),
            Some(_) => None,
        }
    }

    /// Whether a record under identity `uid` is a candidate for a
    /// redelivery (remembered, not matched yet).
    pub fn has_candidate(&self, uid: u128) -> bool {
        self.by_uid.get(&uid).is_some_and(|ids| {
            ids.iter()
                .any(|id| self.fingerprints.get(id).is_some_and(|e| !e.consumed))
        })
    }

    /// Whether `id` is remembered.
    pub fn contains(&self, id: u64) -> bool {
        self.fingerprints.contains_key(&id)
    }

    /// `id` was cancelled.
    pub fn cancel(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.cancelled = true;
        }
    }

    /// `id` left delayd (fired or parked): a cancel of a copy of it made
    /// later owes it nothing (see [`Unconfirmed::cancel_all`]).
    pub fn left(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.left = true;
        }
    }

    /// Far message `id` was loaded back under a new id: its message is
    /// pending again, so a cancel of that copy covers it (a restart took
    /// its spill's Done for a departure).
    pub fn pending_again(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.left = false;
        }
    }

    /// Message `id`, identity `uid`, was cancelled: so is every record
    /// remembered under that identity that has not left (the same message,
    /// as far as a cancel goes). One that fired already is not: the cancel
    /// owes it nothing, and a twin of it redelivered beside the cancelled
    /// record's redelivery would otherwise be taken for the second of two
    /// cancelled records and lost (seed 40028). Returns their ids, `id`
    /// first, for the WAL's marks.
    pub fn cancel_all(&mut self, id: u64, uid: Option<u128>) -> Vec<u64> {
        let mut ids = vec![id];
        if let Some(others) = uid.and_then(|uid| self.by_uid.get(&uid)) {
            let fingerprints = &self.fingerprints;
            ids.extend(
                others.iter().copied().filter(|&other| {
                    other != id && fingerprints.get(&other).is_some_and(|e| !e.left)
                }),
            );
        }
        for &id in &ids {
            self.cancel(id);
        }
        ids
    }

    /// The ack of `id` was certainly not sent (its channel was gone).
    pub fn ack_unsent(&mut self, id: u64) {
        if let Some(entry) = self.fingerprints.get_mut(&id) {
            entry.ack = AckState::Unsent;
        }
    }

    /// Remembered records whose fingerprint is `fp` and that a redelivery
    /// on source session `session` can repeat: candidates to compare, those
    /// whose ack was never sent first (see the module doc). A broker
    /// redelivers only what an earlier session left unsettled, so a record
    /// whose delivery came on that same session (or a later one) is none.
    pub fn candidates(&self, fp: u64, session: u64) -> Vec<Candidate> {
        let Some(ids) = self.ids.get(&fp) else {
            return Vec::new();
        };
        let mut found: Vec<Candidate> = ids
            .iter()
            .filter_map(|&id| {
                let entry = self.fingerprints.get(&id)?;
                let repeatable = session == 0 || entry.session < session;
                (repeatable && !entry.consumed).then_some(Candidate {
                    id,
                    evidence: entry.evidence,
                    uid: entry.uid,
                    ack: entry.ack,
                    cancelled: entry.cancelled,
                    left_long_ago: matches!(entry.evidence, Evidence::Digest(_)),
                    left: entry.left,
                })
            })
            .collect();
        // A live record first, then one that fired lately, then a
        // cancelled one, then one known by its digest alone: a twin
        // repeats a live record if any (sim seed 5232 with sockets: a
        // twin's redelivery was taken for a fired record of a cancelled
        // identity rather than for its own record, and fired after the
        // cancel), or one that fired lately (seed 40028); a message known
        // by its Remembered frame alone yields to a cancel (seed 2152: the
        // one redelivery of a message that fired as a far load's copy and
        // was cancelled later under its first id went with the fired copy
        // and fired again).
        found.sort_by_key(|c| {
            let rank = match (c.cancelled, c.left_long_ago, c.left) {
                (false, false, false) => 0,
                (false, false, true) => 1,
                (true, _, _) => 2,
                (false, true, _) => 3,
            };
            (rank, c.ack == AckState::InDoubt)
        });
        found
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.fingerprints.len()
    }
}

/// How a delivery came in, as far as redelivery detection cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Arrival {
    /// The broker says it may have delivered it before.
    pub redelivered: bool,
    /// The source's channel session it came on, counting from 1 (see
    /// `Delivery::session`); 0 when it is bound to none (Kafka, whose stored
    /// bytes carry the record's offset; callers that only know the flag):
    /// such a redelivery may repeat any stored record.
    pub session: u64,
}

impl From<bool> for Arrival {
    fn from(redelivered: bool) -> Self {
        Arrival {
            redelivered,
            session: 0,
        }
    }
}

#[derive(Debug)]
struct RecentEntry {
    id: u64,
    uid: u128,
    fp: u64,
    evidence: Evidence,
    /// Read from a Remembered frame in this segment: its Schedule is gone.
    frame: Option<u32>,
    /// The frame says it left (fired or parked).
    left: bool,
    /// The frame says it was cancelled.
    frame_cancelled: bool,
    /// Read from the ledger of owed frames: its Schedule is gone and no
    /// frame in the log carries it.
    owed: bool,
    acked: bool,
    cancelled: bool,
    /// A [`MATCHED_MARK`] was read for it.
    settled: bool,
    /// When its Done was read (see [`Recent::retire`]).
    retired_at: Option<u64>,
    /// A compaction copy of it was read later (see [`Recent::push`]).
    superseded: bool,
}

/// A record read back at a start whose ack is not known to have been
/// applied.
#[derive(Debug)]
pub struct ReadBack {
    pub id: u64,
    pub uid: u128,
    pub fp: u64,
    /// Its Schedule, or the digest of its Remembered frame.
    pub evidence: Evidence,
    /// The segment of that frame.
    pub frame: Option<u32>,
    /// That frame says it was cancelled.
    pub frame_cancelled: bool,
    /// It owes its frame (read from the ledger, see `wal::ledger`).
    pub owed: bool,
    pub cancelled: bool,
    /// Its Done was read and no record of its identity is live: it fired,
    /// was cancelled, or waits in the far tier (which the load that brings
    /// it back says, [`Unconfirmed::pending_again`]).
    pub left: bool,
    /// The newest id read under its identity (a far tier whose buckets all
    /// hold larger ids holds none of them).
    pub newest: u64,
    /// Its Remembered frame says it left (fired or parked): the far tier
    /// cannot hold it.
    pub surely_left: bool,
    /// A redelivery matched it and was stored as its copy
    /// ([`MATCHED_MARK`]): no candidate.
    pub settled: bool,
}

/// The newest Schedules a restart reads, to seed [`Unconfirmed`] with: the
/// last `capacity` × [`RECENT_READ_FACTOR`] in log order, less those an
/// Acked mark says were acknowledged to their source (a redelivery can no
/// longer be one of them; taking a twin published on purpose for it would
/// lose the twin). [`Unconfirmed`] keeps the newest `capacity` of them.
///
/// More than `capacity` are read because the running engine forgets a
/// record in doubt only after `capacity` newer ones it remembers, and
/// records whose acks were confirmed (a compaction's copies, up to half a
/// segment at once) are not among those: read back only the last
/// `capacity` of all, a record in doubt was pushed out by them and its
/// redelivery stored as a new message, a copy under another id.
#[derive(Debug)]
pub struct Recent {
    capacity: usize,
    /// Oldest first.
    entries: VecDeque<RecentEntry>,
    /// The running number of `entries[0]`.
    first: u64,
    /// Id -> the running number of its newest entry.
    index: HashMap<u64, u64>,
    /// Frames read so far: when a Done or a cancel mark was read.
    read: u64,
    /// Identity -> when the first cancel mark of one of its records was read.
    cancelled_at: HashMap<u128, u64>,
    /// The frames the ledger says are owed, by id (see [`Recent::expect_owed`]),
    /// with the marks read for them while they have no entry.
    owed: HashMap<u64, OwedFrame>,
}

impl RecentEntry {
    /// The segment it was read from (none for a frame from the ledger).
    fn segment(&self) -> Option<u32> {
        match self.evidence {
            Evidence::At(pos) => Some(pos.segment),
            Evidence::Digest(_) => self.frame,
        }
    }
}

/// A frame from the ledger of owed frames, and what the log says of it.
#[derive(Debug)]
struct OwedFrame {
    frame: Remembered,
    acked: bool,
    cancelled: bool,
    settled: bool,
}

impl Recent {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: VecDeque::with_capacity(capacity.min(1 << 16)),
            first: 0,
            index: HashMap::new(),
            read: 0,
            cancelled_at: HashMap::new(),
            owed: HashMap::new(),
        }
    }

    /// Before the log is read: the frames the ledger holds. Marks read for
    /// them where no entry has their id apply to them
    /// ([`Recent::push_owed`]): the cancel of a record whose frame is owed
    /// is written after the frame went to the ledger.
    pub fn expect_owed(&mut self, frames: &[Remembered]) {
        for frame in frames {
            self.owed.insert(
                frame.id,
                OwedFrame {
                    frame: *frame,
                    acked: false,
                    cancelled: false,
                    settled: false,
                },
            );
        }
    }

    /// After the log is read: the ledger's frames, newest of all. One whose
    /// id has an entry (the frame was written after all, or an older frame
    /// of it is still on disk) only adds its cancel to it.
    pub fn push_owed(&mut self) {
        let mut owed: Vec<OwedFrame> = std::mem::take(&mut self.owed).into_values().collect();
        owed.sort_unstable_by_key(|o| o.frame.id);
        for o in owed {
            let r = o.frame;
            let frame_cancelled = r.flags & REMEMBERED_CANCELLED != 0;
            if let Some(entry) = self.entry_mut(r.id) {
                entry.cancelled |= frame_cancelled;
                continue;
            }
            // Its cancel covers itself; a cancel mark read for it has
            // covered its identity where the mark stands (`mark`).
            self.push_entry(RecentEntry {
                id: r.id,
                uid: r.uid,
                fp: r.fp,
                evidence: Evidence::Digest(r.digest),
                frame: None,
                left: r.flags & REMEMBERED_LEFT != 0,
                frame_cancelled,
                owed: true,
                acked: o.acked,
                cancelled: frame_cancelled || o.cancelled,
                settled: o.settled,
                retired_at: None,
                superseded: false,
            });
        }
    }

    /// A Schedule, read in log order. A compaction copy (its id read
    /// before) takes the place of the record it copies, with what the
    /// marks read so far said of it: a copy's mark may be in a segment
    /// before the copy's (its ack was confirmed while it was copied), and
    /// the original, left on disk by a compaction cut short, is no second
    /// record in doubt.
    pub fn push(&mut self, id: u64, uid: u128, fp: u64, pos: WalPos) {
        let (mut acked, mut cancelled, mut settled) = (false, false, false);
        if let Some(original) = self.entry_mut(id).filter(|e| e.frame.is_none() && !e.owed) {
            original.superseded = true;
            acked = original.acked;
            cancelled = original.cancelled;
            settled = original.settled;
        }
        self.push_entry(RecentEntry {
            id,
            uid,
            fp,
            evidence: Evidence::At(pos),
            frame: None,
            left: false,
            frame_cancelled: false,
            owed: false,
            acked,
            cancelled,
            settled,
            retired_at: None,
            superseded: false,
        });
    }

    /// A Remembered frame at `pos`, read in log order: a record whose
    /// Schedule is gone, compared by digest. It takes the place of what
    /// was read of the same record before (its Schedule, or an older frame
    /// of it: a frame is written again each time its segment goes), with
    /// what the marks read so far said of it. Left beside it, the older
    /// entry kept its marks as they stood then: a record cancelled, then
    /// its ack confirmed, came back in doubt through the frame its cancel
    /// mark had covered (sim seed 678,318), and a redelivered twin would
    /// have been taken for it and dropped.
    pub fn push_remembered(&mut self, r: &Remembered, pos: WalPos) {
        let frame_cancelled = r.flags & REMEMBERED_CANCELLED != 0;
        let (mut acked, mut cancelled, mut settled) = (false, frame_cancelled, false);
        if let Some(older) = self.entry_mut(r.id).filter(|e| !e.owed) {
            older.superseded = true;
            acked = older.acked;
            cancelled |= older.cancelled;
            settled = older.settled;
        }
        self.push_entry(RecentEntry {
            id: r.id,
            uid: r.uid,
            fp: r.fp,
            evidence: Evidence::Digest(r.digest),
            frame: Some(pos.segment),
            left: r.flags & REMEMBERED_LEFT != 0,
            frame_cancelled,
            owed: false,
            acked,
            cancelled,
            settled,
            retired_at: None,
            superseded: false,
        });
    }

    fn push_entry(&mut self, entry: RecentEntry) {
        if self.capacity == 0 {
            return;
        }
        self.read += 1;
        if self.entries.len() >= self.capacity.saturating_mul(RECENT_READ_FACTOR) {
            if let Some(old) = self.entries.pop_front() {
                if self.index.get(&old.id) == Some(&self.first) {
                    self.index.remove(&old.id);
                }
            }
            self.first += 1;
        }
        self.index
            .insert(entry.id, self.first + self.entries.len() as u64);
        self.entries.push_back(entry);
    }

    /// A Done, read in log order.
    pub fn retire(&mut self, id: u64) {
        self.read += 1;
        let read = self.read;
        if let Some(entry) = self.entry_mut(id) {
            entry.retired_at.get_or_insert(read);
        }
    }

    fn entry_mut(&mut self, id: u64) -> Option<&mut RecentEntry> {
        let n = *self.index.get(&id)?;
        self.entries.get_mut((n - self.first) as usize)
    }

    /// An Acked mark (its id perhaps with [`CANCELLED_MARK`]), read in log
    /// order (after its Schedule). A mark whose Schedule is no longer among
    /// the newest does not matter. A plain or [`CANCELLED_MARK`] mark
    /// returns the segment its record was read from: the mark's segment
    /// must outlive it (a compaction copy's segment, which the writer knew
    /// and its seq does not say; a cancel's mark that compaction moved
    /// away from its Done).
    pub fn mark(&mut self, marked: u64) -> Option<u32> {
        self.read += 1;
        let read = self.read;
        if marked & CANCELLED_MARK == 0 && marked & MATCHED_MARK != 0 {
            let id = marked & !MATCHED_MARK;
            if let Some(entry) = self.entry_mut(id) {
                entry.settled = true;
                return entry.segment();
            } else if let Some(owed) = self.owed.get_mut(&id) {
                owed.settled = true;
            }
            return None;
        }
        let id = marked & !CANCELLED_MARK;
        let Some(entry) = self.entry_mut(id) else {
            if let Some(owed) = self.owed.get_mut(&id) {
                if marked & CANCELLED_MARK == 0 {
                    owed.acked = true;
                } else {
                    owed.cancelled = true;
                    let uid = owed.frame.uid;
                    self.cancelled_at.entry(uid).or_insert(read);
                }
            }
            return None;
        };
        if marked & CANCELLED_MARK == 0 {
            entry.acked = true;
            return entry.segment();
        }
        entry.cancelled = true;
        let uid = entry.uid;
        let segment = entry.segment();
        self.cancelled_at.entry(uid).or_insert(read);
        // A cancel's mark outlives the record's segment too: one that a
        // compaction moved away from its Done has nothing else to keep it
        // (sim seed 636,755).
        segment
    }

    /// The newest Schedules whose ack is not known. Whether their acks
    /// were sent is not known either: they are in doubt.
    /// A cancel mark covers every record under its identity that was not
    /// retired before it (as [`Unconfirmed::cancel_all`] does: one that
    /// fired is owed nothing).
    pub fn unacked(self) -> impl Iterator<Item = ReadBack> {
        let cancelled_at = self.cancelled_at;
        // A far load's copy is a new id under the same identity: the spilled
        // record's Done was no departure (seed 733). A Remembered frame is
        // no record at all.
        let live: std::collections::HashSet<u128> = self
            .entries
            .iter()
            .filter(|e| e.retired_at.is_none() && e.frame.is_none() && !e.owed)
            .map(|e| e.uid)
            .collect();
        let mut newest: HashMap<u128, u64> = HashMap::new();
        for e in &self.entries {
            let id = newest.entry(e.uid).or_default();
            *id = (*id).max(e.id);
        }
        self.entries
            .into_iter()
            .filter(|e| !e.acked && !e.superseded)
            .map(move |e| {
                // One that left is owed nothing by a later cancel.
                let covered = !e.left
                    && cancelled_at
                        .get(&e.uid)
                        .is_some_and(|&at| e.retired_at.is_none_or(|r| r > at));
                // A frame's Schedule was retired (or it would not be written).
                let retired = e.retired_at.is_some() || e.frame.is_some() || e.owed;
                ReadBack {
                    id: e.id,
                    uid: e.uid,
                    fp: e.fp,
                    evidence: e.evidence,
                    frame: e.frame,
                    frame_cancelled: e.frame_cancelled,
                    owed: e.owed,
                    cancelled: e.cancelled || covered,
                    left: e.left || (retired && !live.contains(&e.uid)),
                    surely_left: e.left,
                    settled: e.settled,
                    newest: newest.get(&e.uid).copied().unwrap_or(e.id),
                }
            })
    }
}

/// Stores queued for the WAL and not yet durable, by fingerprint. A stored
/// message is remembered only once durable, so a redelivery that arrives
/// while its original is still being written (the connection it came on
/// died meanwhile) must wait for that write before it is compared.
#[derive(Debug, Default)]
pub struct Writing {
    counts: HashMap<u64, u32>,
    /// Redeliveries waiting for some fingerprint's writes to end.
    waiters: usize,
}

impl Writing {
    /// A store with this fingerprint was queued.
    pub fn begin(&mut self, fp: u64) {
        *self.counts.entry(fp).or_default() += 1;
    }

    /// One ended (durable or failed). True if it was the last with `fp` and
    /// a redelivery waits (someone must be woken).
    pub fn end(&mut self, fp: u64) -> bool {
        match self.counts.get_mut(&fp) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.counts.remove(&fp);
                self.waiters > 0
            }
            None => false,
        }
    }

    /// Is a store with this fingerprint being written?
    pub fn contains(&self, fp: u64) -> bool {
        self.counts.contains_key(&fp)
    }

    pub fn add_waiter(&mut self) {
        self.waiters += 1;
    }

    pub fn remove_waiter(&mut self) {
        self.waiters = self.waiters.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: WalPos = WalPos {
        segment: 0,
        offset: 16,
    };

    fn ids(c: Vec<Candidate>) -> Vec<u64> {
        c.into_iter().map(|c| c.id).collect()
    }

    #[test]
    fn removed_ids_are_no_candidates() {
        let mut u = Unconfirmed::new(10);
        let fp = fingerprint("r", b"m");
        u.add(1, 0, fp, P, 0, AckState::Unsent);
        assert_eq!(ids(u.candidates(fp, 0)), vec![1]);
        assert!(u.remove(1));
        assert!(u.candidates(fp, 0).is_empty());
        assert!(!u.remove(1));
    }

    #[test]
    fn a_redelivery_repeats_only_a_record_of_an_earlier_session() {
        let mut u = Unconfirmed::new(10);
        u.add(1, 0, 7, P, 0, AckState::Unsent); // read back at a start
        u.add(2, 0, 7, P, 3, AckState::Unsent); // stored from a delivery of session 3
        assert_eq!(ids(u.candidates(7, 3)), vec![1]);
        assert_eq!(ids(u.candidates(7, 4)), vec![1, 2]);
        assert_eq!(
            ids(u.candidates(7, 0)),
            vec![1, 2],
            "not bound to a session"
        );
    }

    #[test]
    fn equal_fingerprints_keep_every_id() {
        let mut u = Unconfirmed::new(10);
        u.add(1, 0, 7, P, 0, AckState::Unsent);
        u.add(2, 0, 7, P, 0, AckState::Unsent);
        assert_eq!(ids(u.candidates(7, 0)), vec![1, 2]);
        u.remove(1);
        assert_eq!(ids(u.candidates(7, 0)), vec![2]);
    }

    #[test]
    fn capacity_evicts_oldest_still_remembered() {
        let mut u = Unconfirmed::new(2);
        u.add(1, 0, 10, P, 0, AckState::Unsent);
        u.add(2, 0, 20, P, 0, AckState::Unsent);
        u.remove(1);
        u.add(3, 0, 30, P, 0, AckState::Unsent);
        assert_eq!(u.len(), 2);
        u.add(4, 0, 40, P, 0, AckState::Unsent);
        assert!(u.candidates(20, 0).is_empty(), "2 was the oldest left");
        assert_eq!(ids(u.candidates(30, 0)), vec![3]);
        assert_eq!(ids(u.candidates(40, 0)), vec![4]);
    }

    #[test]
    fn never_sent_acks_are_matched_first_and_cancelled_records_last() {
        let mut u = Unconfirmed::new(10);
        u.add(1, 11, 7, P, 1, AckState::InDoubt);
        u.add(2, 12, 7, P, 1, AckState::Unsent);
        u.add(3, 13, 7, P, 1, AckState::Unsent);
        u.cancel_all(3, Some(13));
        assert_eq!(ids(u.candidates(7, 2)), vec![2, 1, 3]);
        u.ack_sent(2);
        assert_eq!(ids(u.candidates(7, 2)), vec![1, 2, 3]);
        u.ack_unsent(1);
        assert_eq!(ids(u.candidates(7, 2))[0], 1);
    }

    #[test]
    fn a_cancel_covers_every_record_under_the_identity() {
        let mut u = Unconfirmed::new(10);
        u.add(1, 42, 7, P, 1, AckState::InDoubt);
        u.add(2, 42, 8, P, 2, AckState::Unsent);
        u.add(3, 43, 9, P, 2, AckState::Unsent);
        assert_eq!(u.cancel_all(1, Some(42)), vec![1, 2]);
        assert!(u.candidates(8, 3)[0].cancelled);
        assert!(!u.candidates(9, 3)[0].cancelled);
    }

    #[test]
    fn a_confirmed_queue_delivery_stays_in_doubt_among_the_last_confirmed() {
        let mut u = Unconfirmed::new(2 * CONFIRMED_KEPT);
        u.add(1, 1, 7, P, 1, AckState::Unsent);
        u.add(2, 2, 8, P, 0, AckState::Unsent);
        assert!(u.confirm(1));
        assert!(u.confirm(2));
        assert_eq!(u.candidates(7, 2)[0].ack, AckState::InDoubt);
        assert!(u.candidates(8, 0).is_empty(), "not bound to a session");
        for id in 10..10 + CONFIRMED_KEPT as u64 {
            u.add(id, id as u128, id, P, 1, AckState::Unsent);
            u.confirm(id);
        }
        assert!(u.candidates(7, 2).is_empty(), "the oldest confirmed goes");
    }

    #[test]
    fn the_order_queue_stays_bounded_when_acks_confirm() {
        let mut u = Unconfirmed::new(100);
        for id in 0..100_000 {
            u.add(id, 0, id, P, 0, AckState::Unsent);
            u.remove(id);
        }
        assert_eq!(u.len(), 0);
        assert!(u.order.len() <= 1024 + 1);
    }

    #[test]
    fn fingerprint_depends_on_route_and_bytes() {
        assert_ne!(fingerprint("a", b"m"), fingerprint("b", b"m"));
        assert_ne!(fingerprint("a", b"m"), fingerprint("a", b"n"));
        assert_eq!(fingerprint("a", b"m"), fingerprint("a", b"m"));
    }

    #[test]
    fn digest_depends_on_route_bytes_and_where_one_ends() {
        let d = digest("a", b"m");
        assert_eq!(d, digest("a", b"m"));
        assert_ne!(d, digest("b", b"m"));
        assert_ne!(d, digest("a", b"n"));
        // The route's length is hashed: ("ab", "c") is not ("a", "bc").
        assert_ne!(digest("ab", b"c"), digest("a", b"bc"));
        assert_ne!(d, [0; 32]);
        assert_ne!(d, [1; 32]);
    }

    #[test]
    fn records_in_going_segments_get_a_digest_once_and_their_frame_is_followed() {
        let mut u = Unconfirmed::new(10);
        let in_0 = P;
        let in_1 = WalPos {
            segment: 1,
            offset: 16,
        };
        u.add(1, 0, 10, in_0, 0, AckState::Unsent);
        u.add(2, 0, 20, in_1, 0, AckState::Unsent);
        u.add(3, 0, 30, in_1, 1, AckState::Unsent);
        u.confirm(3);
        let going = |u: &Unconfirmed, segments: &[u32]| {
            let mut ids: Vec<(u64, bool)> = u
                .departing(segments)
                .into_iter()
                .map(|d| (d.id, d.durable))
                .collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(
            going(&u, &[1]),
            vec![(2, true), (3, false)],
            "a confirmed ack needs no frame"
        );
        u.set_digest(2, [7; 32]);
        u.set_frame(2, Some(5));
        assert_eq!(
            u.candidates(20, 0)
                .into_iter()
                .map(|c| (c.id, c.evidence))
                .collect::<Vec<_>>(),
            vec![(2, Evidence::Digest([7; 32]))]
        );
        assert_eq!(going(&u, &[1]), vec![(3, false)], "2 left segment 1");
        assert_eq!(going(&u, &[5]), vec![(2, true)], "its frame's segment");
        u.set_frame(2, None);
        assert!(going(&u, &[5]).is_empty(), "no frame any more");
        assert_eq!(going(&u, &[0]), vec![(1, true)]);
        assert!(going(&u, &[2]).is_empty());
        // A compaction copy is compared where it was copied to.
        u.moved(1, in_0, in_1);
        assert_eq!(going(&u, &[1]), vec![(1, true), (3, false)]);
        // An id no longer remembered gets no digest (and is not brought back).
        u.remove(3);
        u.set_digest(3, [9; 32]);
        assert!(u.candidates(30, 0).is_empty());
    }

    #[test]
    fn writes_are_counted_per_fingerprint_and_the_last_end_wakes_waiters() {
        let mut w = Writing::default();
        w.begin(7);
        w.begin(7);
        w.begin(8);
        assert!(w.contains(7) && w.contains(8) && !w.contains(9));
        assert!(!w.end(7), "one write of 7 is still going");
        assert!(w.contains(7));
        assert!(!w.end(7), "nobody waits");
        assert!(!w.contains(7));
        w.add_waiter();
        assert!(w.end(8), "the last write of 8 ended and a redelivery waits");
        assert!(!w.end(8), "already ended");
        w.remove_waiter();
        w.remove_waiter();
        w.begin(9);
        assert!(!w.end(9), "no waiter left");
    }

    #[test]
    fn capacity_zero_remembers_nothing() {
        let mut u = Unconfirmed::new(0);
        u.add(1, 0, 10, P, 0, AckState::Unsent);
        assert_eq!(u.len(), 0);
        assert!(u.candidates(10, 0).is_empty());
    }

    /// Rebuilding the order queue costs O(live ids); each rebuild waits for
    /// at least as many stale ids as there are live ones, so adds stay O(1)
    /// amortized however many messages are unconfirmed.
    #[test]
    fn the_order_queue_is_rebuilt_only_after_as_many_stale_ids_as_live() {
        let live = 5_000u64;
        let mut u = Unconfirmed::new(10_000);
        for id in 0..live {
            u.add(id, 0, id, P, 0, AckState::Unsent);
        }
        let churn = 40_000u64;
        let mut rebuilds = 0;
        for id in live..live + churn {
            let before = u.order.len();
            u.add(id, 0, id, P, 0, AckState::Unsent);
            if u.order.len() < before {
                rebuilds += 1;
            }
            u.remove(id);
        }
        assert_eq!(u.len(), live as usize);
        assert!(rebuilds >= 1, "stale ids are dropped eventually");
        assert!(
            rebuilds <= churn / live,
            "{rebuilds} rebuilds in {churn} adds with {live} live ids"
        );
    }

    #[test]
    fn stale_ids_left_by_removals_go_at_the_next_add() {
        let mut u = Unconfirmed::new(10_000);
        for id in 0..2_000 {
            u.add(id, 0, id, P, 0, AckState::Unsent);
        }
        for id in 0..2_000 {
            u.remove(id);
        }
        assert_eq!(u.order.len(), 2_000);
        u.add(5_000, 0, 1, P, 0, AckState::Unsent);
        assert_eq!(u.order.iter().copied().collect::<Vec<_>>(), [5_000]);
    }

    /// A cancel owes nothing to a record of its identity that fired before
    /// it (seed 40028): not in memory, not after a restart.
    #[test]
    fn a_cancel_does_not_cover_a_record_of_its_identity_that_fired_before_it() {
        let mut u = Unconfirmed::new(10);
        u.add(1, 9, 7, P, 1, AckState::InDoubt);
        u.add(2, 9, 7, P, 2, AckState::InDoubt);
        u.add(3, 9, 7, P, 2, AckState::InDoubt);
        u.left(1);
        assert_eq!(u.cancel_all(2, Some(9)), vec![2, 3], "1 fired before");
        let cancelled: Vec<(u64, bool)> = u
            .candidates(7, 3)
            .into_iter()
            .map(|c| (c.id, c.cancelled))
            .collect();
        assert_eq!(cancelled, [(1, false), (2, true), (3, true)]);

        // The same log read back: 1's Done before the mark, 3's after it.
        let mut r = Recent::new(10);
        r.push(1, 9, 7, P);
        r.retire(1);
        r.push(2, 9, 7, P);
        r.push(3, 9, 7, P);
        r.mark(2 | CANCELLED_MARK);
        r.retire(2);
        r.retire(3);
        let back: Vec<(u64, bool, bool)> =
            r.unacked().map(|b| (b.id, b.cancelled, b.left)).collect();
        assert_eq!(back, [(1, false, true), (2, true, true), (3, true, true)]);

        // A spilled record (its Done) whose load copy is live has not left
        // (seed 733); a load after the restart says so in memory.
        let mut r = Recent::new(10);
        r.push(4, 8, 7, P);
        r.retire(4);
        r.push(5, 8, 7, P);
        r.push(6, 6, 7, P);
        r.retire(6);
        let left: Vec<(u64, bool, u64)> = r.unacked().map(|b| (b.id, b.left, b.newest)).collect();
        // `newest`: a far tier whose buckets hold only larger ids holds none
        // of an identity's records (a load's copy spilled again included).
        assert_eq!(left, [(4, false, 5), (5, false, 5), (6, true, 6)]);
        u.add(6, 6, 7, P, 0, AckState::InDoubt);
        u.add(16, 6, 7, P, 0, AckState::InDoubt);
        u.left(6);
        u.pending_again(6);
        assert_eq!(u.cancel_all(16, Some(6)), vec![16, 6]);
    }

    /// A compaction copy read back takes its original's place, and what
    /// the marks said of it: neither is in doubt once either is marked,
    /// and a copy's mark says where the copy was read from.
    #[test]
    fn a_compaction_copy_takes_its_originals_marks_and_place() {
        let at = |segment: u32| WalPos {
            segment,
            offset: 16,
        };
        // The mark read before the copy (its ack confirmed while it was
        // copied), and the original left by a compaction cut short.
        let mut r = Recent::new(10);
        r.push(1, 9, 7, at(1));
        assert_eq!(r.mark(1), Some(1));
        r.push(1, 9, 7, at(3));
        // The mark read after the copy.
        r.push(2, 8, 7, at(1));
        r.push(2, 8, 7, at(3));
        assert_eq!(r.mark(2), Some(3), "the copy's segment");
        // Settled, then copied; and cancelled, then copied.
        r.push(4, 6, 7, at(1));
        r.mark(4 | MATCHED_MARK);
        r.push(4, 6, 7, at(3));
        r.push(5, 5, 7, at(1));
        r.mark(5 | CANCELLED_MARK);
        r.push(5, 5, 7, at(3));
        // In doubt, and copied: one record in doubt, read from the copy.
        r.push(6, 4, 7, at(1));
        r.push(6, 4, 7, at(3));
        let back: Vec<(u64, Evidence, bool, bool)> = r
            .unacked()
            .map(|b| (b.id, b.evidence, b.settled, b.cancelled))
            .collect();
        assert_eq!(
            back,
            [
                (4, Evidence::At(at(3)), true, false),
                (5, Evidence::At(at(3)), false, true),
                (6, Evidence::At(at(3)), false, false),
            ]
        );
    }

    /// The ledger's frames are read back as owed, with the marks the log
    /// wrote for them after they went there; one whose id the log still
    /// has a frame for only adds its cancel to it.
    #[test]
    fn frames_from_the_ledger_take_the_logs_later_marks() {
        let frame = |id: u64, flags: u8| Remembered {
            id,
            uid: u128::from(id) + 100,
            fp: 7,
            digest: [id as u8; 32],
            flags,
        };
        let mut r = Recent::new(10);
        r.expect_owed(&[
            frame(1, 0),
            frame(2, 0),
            frame(3, REMEMBERED_CANCELLED),
            frame(4, 0),
        ]);
        // An older frame of 3 is still in the log, not cancelled.
        r.push_remembered(&frame(3, 0), P);
        r.mark(1 | CANCELLED_MARK);
        r.mark(2);
        r.mark(4 | MATCHED_MARK);
        r.push_owed();
        let back: Vec<(u64, bool, bool, bool)> = r
            .unacked()
            .map(|b| (b.id, b.owed, b.cancelled, b.settled))
            .collect();
        // 2 was acked: not in doubt.
        assert_eq!(
            back,
            [
                (3, false, true, false),
                (1, true, true, false),
                (4, true, false, true),
            ]
        );
    }
}
