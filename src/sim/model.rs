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
    /// cut short and may have reached the disk).
    pub uids: Vec<u128>,
    /// Its ack reached, or may have reached, the broker: it must fire.
    pub acked: bool,
    /// A cancel covering it was answered, or failed (and so may have
    /// taken effect): it need not fire.
    pub cancelled: bool,
    pub fired: BTreeMap<u128, u32>,
    /// The source session of each store that began (by id), except those
    /// answered "duplicate": a process start begins a new channel session.
    pub stored_on: BTreeMap<u128, u64>,
    /// Sessions on which a delivery of it was answered "duplicate".
    pub duplicate_on: Vec<u64>,
}

#[derive(Debug, Default)]
pub struct Model {
    /// Issue #37 is open: a message lost because its byte-equal twin was
    /// taken for its redelivery is counted ([`Model::check_complete`]), not
    /// failed, unless this is set.
    pub strict_twins: bool,
    pub msgs: Vec<Msg>,
    owner: BTreeMap<u128, usize>,
    /// Ids whose cancel was answered: they never fire again.
    cancelled: BTreeSet<u128>,
    pub fires: u64,
}

impl Model {
    pub fn new(strict_twins: bool) -> Self {
        Model {
            strict_twins,
            ..Model::default()
        }
    }

    pub fn add(&mut self, route: &'static str, key: Option<u8>, bytes: Vec<u8>, due: u64) -> usize {
        self.msgs.push(Msg {
            route,
            key,
            bytes,
            due,
            uids: Vec::new(),
            acked: false,
            cancelled: false,
            fired: BTreeMap::new(),
            stored_on: BTreeMap::new(),
            duplicate_on: Vec::new(),
        });
        self.msgs.len() - 1
    }

    /// `msg` may be stored under `uid` (a store began on source session
    /// `session`).
    pub fn stored(&mut self, msg: usize, uid: u128, session: u64) {
        self.owner.insert(uid, msg);
        self.msgs[msg].uids.push(uid);
        self.msgs[msg].stored_on.insert(uid, session);
    }

    /// A cancel of `uid` was answered "cancelled". For a message that fired
    /// already it found a leftover copy (a spill whose WAL Done failed); the
    /// copy that fired may come back after a crash (its Done lost), which
    /// at-least-once allows, so that message is only owed no more fires
    /// (seed 2983), as [`Model::cancel_where`] has it.
    pub fn cancel_uid(&mut self, uid: u128) {
        let Some(&m) = self.owner.get(&uid) else {
            self.cancelled.insert(uid);
            return;
        };
        if self.msgs[m].fired.is_empty() {
            self.cancelled.insert(uid);
        }
        self.msgs[m].cancelled = true;
    }

    /// A cancel of `uid` failed: it may have taken effect, or not.
    pub fn maybe_cancel_uid(&mut self, uid: u128) {
        if let Some(&m) = self.owner.get(&uid) {
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
    pub fn cancel_where(&mut self, covered: impl Fn(&Msg) -> bool) {
        let uids: Vec<u128> = self
            .msgs
            .iter()
            .filter(|m| m.fired.is_empty() && covered(m))
            .flat_map(|m| m.uids.clone())
            .collect();
        for uid in uids {
            self.cancel_uid(uid);
        }
    }

    /// Check one message the engine handed out.
    pub fn fired(&mut self, f: &Fired) -> Result<(), String> {
        self.fires += 1;
        let uid = f.uid.as_u128();
        let Some(&m) = self.owner.get(&uid) else {
            return Err(format!("fired id {uid:032x}, which no store was given"));
        };
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

    /// At the end: every acknowledged message not cancelled fired. Returns
    /// how many did not because a byte-equal twin was taken for their
    /// redelivery (issue #37: redelivery detection by bytes cannot tell a
    /// twin whose ack is in doubt from a redelivery; fencing the acks will
    /// close it). Every other miss is a failure.
    pub fn check_complete(&self) -> Result<u64, String> {
        let mut twin_losses = 0;
        for (i, m) in self.msgs.iter().enumerate() {
            if !m.acked || m.cancelled || !m.fired.is_empty() {
                continue;
            }
            // A byte-equal message stored too: its record may have been
            // taken for this one's redelivery.
            let twins: Vec<&Msg> = self
                .msgs
                .iter()
                .enumerate()
                .filter(|(j, t)| {
                    *j != i && t.route == m.route && t.bytes == m.bytes && !t.uids.is_empty()
                })
                .map(|(_, t)| t)
                .collect();
            let twin = !twins.is_empty();
            // A broker redelivers only what an earlier session left
            // unsettled: a twin stored on the same session as this one's
            // "duplicate" answer cannot have been its original.
            if twin && m.stored_on.is_empty() && !m.duplicate_on.is_empty() {
                let excusable = m
                    .duplicate_on
                    .iter()
                    .any(|&d| twins.iter().any(|t| t.stored_on.values().any(|&s| s < d)));
                if !excusable {
                    return Err(format!(
                        "message {i} ({} due {}) was answered \"duplicate\" on sessions {:?}, but every byte-equal twin was stored on a session no earlier (the broker redelivers only an earlier session's deliveries)",
                        m.route, m.due, m.duplicate_on
                    ));
                }
            }
            if twin && !self.strict_twins {
                twin_losses += 1;
                continue;
            }
            return Err(format!(
                "message {i} ({} due {}, {} ids) was acknowledged and never fired",
                m.route,
                m.due,
                m.uids.len()
            ));
        }
        Ok(twin_losses)
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
}
