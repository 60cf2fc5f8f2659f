//! A planned stop's hand-over (#39): an owner that stops on purpose tells
//! the next candidate so, and the candidate skips the rest of its lease
//! wait. Without it, a SIGTERM of the owner (every redeploy) left the route
//! without an owner for the lease and its margin (5.25 s by default).
//!
//! The stopping owner, fenced (it fires and writes nothing more), gives up
//! its lock consumer, publishes [`Note::Handover`] with a fresh nonce into
//! the lock queue and waits for the confirm. Only if the confirm came
//! within a lease of the send of its last own ping that came back
//! ([`may_commit`]) does it publish [`Note::Commit`] with that nonce.
//!
//! Why that bound: the owner had the turn when that ping was delivered,
//! after it was sent, and the `Handover` was enqueued before its confirm.
//! So any other tenure between the two lasted less than a lease, and fired
//! nothing: a candidate fires only after a lease and a margin. A later
//! enqueue cannot be told apart, hence the `Commit`, sent once the bound
//! is known to hold. A candidate that gets both while it waits (in the
//! lock queue's order) goes straight to its last check: a ping with a
//! fresh nonce, sent now, must come back, so one that lost the turn
//! meanwhile does not pass. The lock model (`lock_model.rs`,
//! `WaitRule::UnbrokenWithHandover`) checks this against every
//! interleaving it draws; without the bound it finds two owners.

use std::time::{Duration, Instant};

/// What a stopping owner leaves in the lock queue. Pings are 4 or 16
/// bytes; a note is 32, a tag and a nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// The owner with this nonce has stopped and fenced itself.
    Handover(u128),
    /// Its `Handover` was confirmed within a lease of its last own ping's
    /// send ([`may_commit`]).
    Commit(u128),
}

const HANDOVER: &[u8; 16] = b"delayd.handover\0";
const COMMIT: &[u8; 16] = b"delayd.commit\0\0\0";

impl Note {
    pub fn encode(&self) -> [u8; 32] {
        let (tag, nonce) = match self {
            Note::Handover(n) => (HANDOVER, n),
            Note::Commit(n) => (COMMIT, n),
        };
        let mut body = [0; 32];
        body[..16].copy_from_slice(tag);
        body[16..].copy_from_slice(&nonce.to_be_bytes());
        body
    }

    pub fn decode(body: &[u8]) -> Option<Note> {
        if body.len() != 32 {
            return None;
        }
        let nonce = u128::from_be_bytes(body[16..].try_into().ok()?);
        match &body[..16] {
            tag if tag == HANDOVER => Some(Note::Handover(nonce)),
            tag if tag == COMMIT => Some(Note::Commit(nonce)),
            _ => None,
        }
    }
}

/// Whether a `Handover` confirmed at `confirmed` may be committed: its
/// owner's last own ping that came back was sent at `last_back_sent`.
pub fn may_commit(last_back_sent: Instant, confirmed: Instant, lease: Duration) -> bool {
    confirmed.saturating_duration_since(last_back_sent) <= lease
}

/// What a waiting candidate has seen of a hand-over.
#[derive(Debug, Default)]
pub struct Seen {
    handover: Option<u128>,
}

impl Seen {
    /// A delivery came: true once it is the `Commit` of a `Handover` seen
    /// before it in this wait.
    pub fn committed(&mut self, body: &[u8]) -> bool {
        match Note::decode(body) {
            Some(Note::Handover(n)) => {
                self.handover = Some(n);
                false
            }
            Some(Note::Commit(n)) => self.handover == Some(n),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_round_trip_and_pings_are_not_notes() {
        for note in [Note::Handover(7), Note::Commit(u128::MAX)] {
            assert_eq!(Note::decode(&note.encode()), Some(note));
        }
        assert_eq!(Note::decode(b"ping"), None);
        assert_eq!(Note::decode(&[0; 16]), None);
        let mut other = Note::Handover(1).encode();
        other[0] = b'x';
        assert_eq!(Note::decode(&other), None);
    }

    #[test]
    fn only_a_commit_after_its_own_handover_counts() {
        let mut seen = Seen::default();
        assert!(
            !seen.committed(&Note::Commit(1).encode()),
            "no Handover yet"
        );
        assert!(!seen.committed(&Note::Handover(1).encode()));
        assert!(!seen.committed(&Note::Commit(2).encode()), "another nonce");
        assert!(!seen.committed(b"ping"));
        assert!(seen.committed(&Note::Commit(1).encode()));
        // A later Handover replaces the one seen.
        assert!(!seen.committed(&Note::Handover(3).encode()));
        assert!(!seen.committed(&Note::Commit(1).encode()));
    }

    #[test]
    fn a_handover_commits_only_within_a_lease_of_the_last_ping_back() {
        let lease = Duration::from_secs(1);
        let sent = Instant::now();
        assert!(may_commit(sent, sent + lease, lease));
        assert!(!may_commit(
            sent,
            sent + lease + Duration::from_millis(1),
            lease
        ));
        assert!(
            may_commit(sent + lease, sent, lease),
            "a clock read earlier"
        );
    }
}
