//! The reference model: what delayd was given, what it answered, and what
//! it may and must hand out because of that.

use std::collections::{BTreeMap, BTreeSet};

use crate::engine::Fired;

/// A message as the producer published it. A redelivery is the same
/// message; a twin (the same bytes published again) is another one.
#[derive(Debug)]
pub struct Msg {
    pub route: &'static str,
    pub key: Option<u8>,
    pub bytes: Vec<u8>,
    pub due: u64,
    /// Ids it was stored under (a store that returned, or that a crash
    /// cut short and may have reached the disk). A redelivery stored again
    /// under a byte-equal message's id (its ack was in doubt) shares it.
    pub uids: Vec<u128>,
    /// Its ack reached, or may have reached, the broker: it must fire.
    pub acked: bool,
    /// A cancel covering it was answered, or failed (and so may have
    /// taken effect): it need not fire.
    pub cancelled: bool,
    /// A cancel covering it was answered after it fired: the engine may
    /// have cancelled its record all the same (pending again after a crash
    /// lost the fire's Done), so a redelivery with its bytes may go with
    /// that cancel (see [`Model::check_complete`]).
    pub cancelled_after_fire: bool,
    pub fired: BTreeMap<u128, u32>,
    /// Taken in, and a cancel of every id it had, before it fired at all,
    /// was answered:
    /// those ids. It must never fire, under them or under an id a later
    /// redelivery of it was stored under (see
    /// [`Model::fired_after_their_cancel`]).
    pub cancel_answered: Option<Vec<u128>>,
    /// The source session of each store that began (by id), except those
    /// answered "duplicate": a process start begins a new channel session.
    pub stored_on: BTreeMap<u128, u64>,
    /// Sessions on which a delivery of it was answered "duplicate".
    pub duplicate_on: Vec<u64>,
    /// A store of it failed: it may have reached the disk anyway, and as a
    /// redelivery under a byte-equal message's id (`Stored::Copy`), which
    /// the failure does not name.
    pub failed_store: bool,
}

#[derive(Debug, Default)]
pub struct Model {
    pub msgs: Vec<Msg>,
    /// Id -> the messages stored under it (more than one: byte-equal
    /// messages, see [`Msg::uids`]).
    owner: BTreeMap<u128, Vec<usize>>,
    /// Ids whose cancel was answered: they never fire again.
    cancelled: BTreeSet<u128>,
    pub fires: u64,
}

impl Model {
    pub fn add(&mut self, route: &'static str, key: Option<u8>, bytes: Vec<u8>, due: u64) -> usize {
        self.msgs.push(Msg {
            route,
            key,
            bytes,
            due,
            uids: Vec::new(),
            acked: false,
            cancelled: false,
            cancelled_after_fire: false,
            fired: BTreeMap::new(),
            cancel_answered: None,
            stored_on: BTreeMap::new(),
            duplicate_on: Vec::new(),
            failed_store: false,
        });
        self.msgs.len() - 1
    }

    /// `msg` may be stored under `uid` (a store began on source session
    /// `session`).
    pub fn stored(&mut self, msg: usize, uid: u128, session: u64) {
        let owners = self.owner.entry(uid).or_default();
        if !owners.contains(&msg) {
            owners.push(msg);
        }
        self.msgs[msg].uids.push(uid);
        self.msgs[msg].stored_on.insert(uid, session);
    }

    /// The store [`Model::stored`] noted under `asked` kept `msg` under
    /// `kept` instead (the id of a byte-equal message whose ack was in
    /// doubt).
    pub fn stored_as(&mut self, msg: usize, asked: u128, kept: u128, session: u64) {
        if let Some(owners) = self.owner.get_mut(&asked) {
            owners.retain(|&m| m != msg);
        }
        let m = &mut self.msgs[msg];
        m.uids.retain(|&u| u != asked);
        m.stored_on.remove(&asked);
        self.stored(msg, kept, session);
    }

    /// A cancel of `uid` was answered "cancelled". For a message that fired
    /// already it found a leftover copy (a spill whose WAL Done failed); the
    /// copy that fired may come back after a crash (its Done lost), which
    /// at-least-once allows, so that message is only owed no more fires
    /// (seed 2983), as [`Model::cancel_where`] has it.
    pub fn cancel_uid(&mut self, uid: u128) {
        let owners = self.owner.get(&uid).cloned().unwrap_or_default();
        let unfired = owners.iter().all(|&m| self.msgs[m].fired.is_empty());
        if unfired {
            self.cancelled.insert(uid);
        }
        for m in owners {
            let m = &mut self.msgs[m];
            m.cancelled = true;
            let all_cancelled = m.uids.iter().all(|u| self.cancelled.contains(u));
            // Only a message taken in: one whose store failed comes again
            // as a new delivery, which a cancel before it does not cover.
            let taken_in = m.acked && !m.failed_store;
            if unfired && all_cancelled && taken_in && m.cancel_answered.is_none() {
                m.cancel_answered = Some(m.uids.clone());
            }
        }
    }

    /// A cancel of `uid` failed: it may have taken effect, or not.
    pub fn maybe_cancel_uid(&mut self, uid: u128) {
        for &m in self.owner.get(&uid).into_iter().flatten() {
            self.msgs[m].cancelled = true;
        }
    }

    /// [`Model::maybe_cancel_uid`] for every message matching `covered`.
    pub fn maybe_cancel_where(&mut self, covered: impl Fn(&Msg) -> bool) {
        for m in &mut self.msgs {
            if covered(m) {
                m.cancelled = true;
            }
        }
    }

    /// Every stored message matching `covered` was answered cancelled, but
    /// those that fired already: one whose Done was lost may be pending
    /// again (a copy under its id), or not, and the answer names neither.
    /// An id shared with a byte-equal message the cancel did not cover (a
    /// twin kept under its sibling's id, with its own due time) is not
    /// cancelled as a whole: only the covered messages are.
    pub fn cancel_where(&mut self, covered: impl Fn(&Msg) -> bool) {
        for m in &mut self.msgs {
            if !m.fired.is_empty() && covered(m) {
                m.cancelled_after_fire = true;
            }
        }
        let hit: Vec<usize> = (0..self.msgs.len())
            .filter(|&m| self.msgs[m].fired.is_empty() && covered(&self.msgs[m]))
            .collect();
        let uids: BTreeSet<u128> = hit
            .iter()
            .flat_map(|&m| self.msgs[m].uids.clone())
            .collect();
        for uid in uids {
            let owners = self.owner.get(&uid).cloned().unwrap_or_default();
            if owners.iter().all(|&m| covered(&self.msgs[m])) {
                self.cancel_uid(uid);
            } else {
                for &m in &hit {
                    if self.msgs[m].uids.contains(&uid) {
                        self.msgs[m].cancelled = true;
                    }
                }
            }
        }
    }

    /// Check one message the engine handed out.
    pub fn fired(&mut self, f: &Fired) -> Result<(), String> {
        self.fires += 1;
        let uid = f.uid.as_u128();
        let Some(owners) = self.owner.get(&uid) else {
            return Err(format!("fired id {uid:032x}, which no store was given"));
        };
        // A failed store's record under a byte-equal message's id: none of
        // the id's owners was due, but that message is.
        let first = owners[0];
        if !owners.iter().any(|&m| self.msgs[m].due <= f.fired_ms) {
            let copied = (0..self.msgs.len()).find(|&j| {
                let t = &self.msgs[j];
                t.failed_store
                    && t.due <= f.fired_ms
                    && t.route == self.msgs[first].route
                    && t.bytes == self.msgs[first].bytes
            });
            if let Some(j) = copied {
                let session = self.msgs[j].stored_on.values().copied().max().unwrap_or(0);
                self.stored(j, uid, session);
            }
        }
        let owners = &self.owner[&uid];
        // Byte-equal messages sharing an id: each fire counts for one that
        // has not fired under it yet, if any.
        // (Their due times may differ: the first that was due.)
        let due = |m: &usize| self.msgs[*m].due <= f.fired_ms;
        let unfired = |m: &usize| !self.msgs[*m].fired.contains_key(&uid);
        let m = owners
            .iter()
            .copied()
            .filter(due)
            .filter(unfired)
            .min_by_key(|&m| self.msgs[m].cancelled)
            .or_else(|| owners.iter().copied().find(due))
            .unwrap_or(owners[0]);
        let msg = &mut self.msgs[m];
        if f.message != msg.bytes || *f.route != *msg.route {
            return Err(format!(
                "id {uid:032x} fired with other bytes or route than message {m} had"
            ));
        }
        if f.fired_ms < msg.due {
            return Err(format!(
                "message {m} fired {} ms early (due {}, fired at {})",
                msg.due - f.fired_ms,
                msg.due,
                f.fired_ms
            ));
        }
        if self.cancelled.contains(&uid) {
            return Err(format!(
                "message {m} (id {uid:032x}) fired after its cancel was answered"
            ));
        }
        *msg.fired.entry(uid).or_default() += 1;
        Ok(())
    }

    /// At the end: every acknowledged message not cancelled fired. A
    /// message lost because a byte-equal twin was taken for its redelivery
    /// (issue #37) fails too, but for two cases: the twin was cancelled
    /// (or covered by a cancel after it fired: its record may have been
    /// pending again, sim seed 224385), its ack in doubt, and this one's
    /// redelivery, which may have been the twin's, was answered
    /// "duplicate" (`engine::dedup`: it goes with the cancel); or it was
    /// answered "duplicate" and its byte-equal group delivered as many
    /// messages as it owes (fires per id counted up to the messages stored
    /// under that id).
    pub fn check_complete(&self) -> Result<(), String> {
        for (i, m) in self.msgs.iter().enumerate() {
            if !m.acked || m.cancelled || !m.fired.is_empty() {
                continue;
            }
            let byte_equal =
                |(j, t): &(usize, &Msg)| *j != i && t.route == m.route && t.bytes == m.bytes;
            let twins = self.msgs.iter().enumerate().filter(byte_equal).count();
            let with_a_cancel = !m.duplicate_on.is_empty()
                && self
                    .msgs
                    .iter()
                    .enumerate()
                    .filter(byte_equal)
                    .any(|(_, t)| t.cancelled || t.cancelled_after_fire);
            if with_a_cancel {
                continue;
            }
            // Its redelivery was taken for a twin's record whose ack was
            // never sent, and the twin's own redelivery then stored as new,
            // or as a copy under another twin's id (release mode, seeds
            // 1701 and 3031): the route got as many messages with these
            // bytes as were published. The consumer cannot tell them
            // apart; the model's attribution is the guess. Fires count
            // per id up to the messages stored under it, and beyond that
            // only for messages answered "duplicate", so a same-id copy
            // stands in for a lost twin only where the engine took the
            // twin for a record.
            let group: Vec<usize> = (0..self.msgs.len())
                .filter(|&j| j == i || byte_equal(&(j, &self.msgs[j])))
                .collect();
            let owed = group
                .iter()
                .filter(|&&j| self.msgs[j].acked && !self.msgs[j].cancelled)
                .count();
            let mut fires: BTreeMap<u128, usize> = BTreeMap::new();
            for &j in &group {
                for (&uid, &n) in &self.msgs[j].fired {
                    *fires.entry(uid).or_default() += n as usize;
                }
            }
            let (mut delivered, mut extra) = (0, 0);
            for (uid, &n) in &fires {
                let stored = self
                    .owners(*uid)
                    .iter()
                    .filter(|o| group.contains(o))
                    .count();
                delivered += n.min(stored);
                extra += n.saturating_sub(stored);
            }
            // A message answered "duplicate" may have gone out as any extra
            // fire of its group: a record taken for its redelivery is read
            // back in doubt after a restart, and a later redelivery of its
            // own message is stored again under its id (seed 3031, 120
            // operations).
            let answered = group
                .iter()
                .filter(|&&j| !self.msgs[j].duplicate_on.is_empty())
                .count();
            delivered += extra.min(answered);
            if !m.duplicate_on.is_empty() && delivered >= owed {
                continue;
            }
            return Err(format!(
                "message {i} ({} due {}, {} ids, {twins} byte-equal twins, answered \"duplicate\" on sessions {:?}) was acknowledged and never fired",
                m.route,
                m.due,
                m.uids.len(),
                m.duplicate_on,
            ));
        }
        Ok(())
    }

    /// The messages stored under `uid`.
    pub fn owners(&self, uid: u128) -> Vec<usize> {
        self.owner.get(&uid).cloned().unwrap_or_default()
    }

    /// Copies beyond the first: (under the same id, under another id).
    pub fn duplicates(&self) -> (u64, u64) {
        let mut same = 0;
        let mut other = 0;
        for m in &self.msgs {
            same += m.fired.values().map(|&n| u64::from(n - 1)).sum::<u64>();
            other += (m.fired.len() as u64).saturating_sub(1);
        }
        (same, other)
    }

    /// Messages with no byte-equal twin that fired after a cancel of every
    /// id they had was answered: under one of those ids (also caught as
    /// it fires) or under an id a later redelivery of theirs was stored
    /// under, which the engine should have taken for the cancelled record.
    /// Twins are left out: which one a redelivery was is the model's guess.
    pub fn fired_after_their_cancel(&self) -> Vec<usize> {
        (0..self.msgs.len())
            .filter(|&i| {
                let m = &self.msgs[i];
                m.cancel_answered.is_some() && !m.fired.is_empty() && !self.twinned(i)
            })
            .collect()
    }

    fn twinned(&self, i: usize) -> bool {
        let m = &self.msgs[i];
        self.msgs
            .iter()
            .enumerate()
            .any(|(j, o)| j != i && o.route == m.route && o.bytes == m.bytes)
    }

    /// Copies under another id of messages with no byte-equal twin: the
    /// model's attribution of a fire to one of several byte-equal messages
    /// is a guess, so only these are certain.
    pub fn lone_other_id_copies(&self) -> Vec<usize> {
        (0..self.msgs.len())
            .filter(|&i| self.msgs[i].fired.len() > 1 && !self.twinned(i))
            .collect()
    }
}
