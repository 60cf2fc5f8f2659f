//! Which offsets may be committed (a Kafka partition's, or a RabbitMQ
//! stream's, whose checkpoint delayd keeps itself): per partition, the lowest offset handed
//! out and not yet settled (or one past the highest handed out when all are
//! settled). Offsets are therefore committed in order per partition, and
//! only once every earlier record is durable in delayd.
//!
//! An ack resolves only when a commit covering its offset succeeded, so the
//! core's redelivery window ("stored, ack not yet confirmed") matches what
//! Kafka would hand out again after a crash.
//!
//! A partition that is revoked, or rewound to redeliver a record, starts a
//! new epoch: acks from the old epoch are stale and fail, so a record handed
//! out again can't be settled by its earlier copy.

use std::collections::{BTreeMap, HashMap};

use tokio::sync::oneshot;

/// (topic, partition)
pub type TopicPartition = (String, i32);

/// Resolved when the ack is committed (`Ok`) or can no longer be (`Err`).
pub type Waiter = oneshot::Sender<Result<(), String>>;

#[derive(Default)]
struct PartitionOffsets {
    epoch: u64,
    /// Handed out, not settled: offset → epoch it was handed out in.
    outstanding: BTreeMap<i64, u64>,
    /// One past the highest offset handed out in this epoch.
    next: Option<i64>,
    /// Lowest record dropped before the core saw it: commits stop there.
    abandoned: Option<i64>,
    /// Highest offset committed (the next record to read after a restart).
    committed: i64,
    /// Highest offset a commit was requested for.
    requested: i64,
    /// Settled acks waiting for a commit past their offset.
    waiters: Vec<(i64, Waiter)>,
}

impl PartitionOffsets {
    fn committable(&self) -> Option<i64> {
        let lowest = self.outstanding.keys().next().copied();
        match (lowest, self.abandoned) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b).or(self.next),
        }
    }
}

#[derive(Default)]
pub struct OffsetTracker {
    partitions: HashMap<TopicPartition, PartitionOffsets>,
}

impl OffsetTracker {
    /// A record was handed out; returns the epoch its ack must present.
    pub fn delivered(&mut self, tp: &TopicPartition, offset: i64) -> u64 {
        let p = self.partitions.entry(tp.clone()).or_default();
        p.outstanding.insert(offset, p.epoch);
        p.next = Some(p.next.map_or(offset + 1, |n| n.max(offset + 1)));
        p.epoch
    }

    /// The record is durable in delayd. `waiter` resolves once it is committed.
    pub fn settle(&mut self, tp: &TopicPartition, offset: i64, epoch: u64, waiter: Waiter) {
        match self.partitions.get_mut(tp) {
            Some(p) if p.outstanding.get(&offset) == Some(&epoch) => {
                p.outstanding.remove(&offset);
                p.waiters.push((offset, waiter));
            }
            _ => {
                let _ = waiter.send(Err(format!(
                    "{}[{}]@{offset}: partition revoked or rewound; the record will be consumed again",
                    tp.0, tp.1
                )));
            }
        }
    }

    /// A record was dropped before the core saw it (a local backlog given
    /// up): nothing waits for it, and no commit may pass it.
    pub fn abandon(&mut self, tp: &TopicPartition, offset: i64, epoch: u64) {
        if let Some(p) = self.partitions.get_mut(tp) {
            if p.outstanding.get(&offset) == Some(&epoch) {
                p.outstanding.remove(&offset);
                p.abandoned = Some(p.abandoned.map_or(offset, |a| a.min(offset)));
            }
        }
    }

    /// Is any record of these partitions handed out and not settled?
    pub fn has_outstanding(&self, tps: &[TopicPartition]) -> bool {
        tps.iter().any(|tp| {
            self.partitions
                .get(tp)
                .is_some_and(|p| !p.outstanding.is_empty())
        })
    }

    /// Offsets worth committing now (past what was already requested), and
    /// marks them requested.
    pub fn take_commits(&mut self) -> Vec<(TopicPartition, i64)> {
        let mut out = Vec::new();
        for (tp, p) in &mut self.partitions {
            if let Some(offset) = p.committable() {
                // Only worth a round trip when it settles some ack.
                if offset > p.requested && p.waiters.iter().any(|(o, _)| *o < offset) {
                    p.requested = offset;
                    out.push((tp.clone(), offset));
                }
            }
        }
        out
    }

    /// Offsets to commit for these partitions before they are given up.
    pub fn final_commits(&self, tps: &[TopicPartition]) -> Vec<(TopicPartition, i64)> {
        tps.iter()
            .filter_map(|tp| {
                let p = self.partitions.get(tp)?;
                let offset = p.committable()?;
                (offset > p.committed).then(|| (tp.clone(), offset))
            })
            .collect()
    }

    /// Every partition's commit point, for a final commit at shutdown.
    pub fn all_final_commits(&self) -> Vec<(TopicPartition, i64)> {
        let tps: Vec<_> = self.partitions.keys().cloned().collect();
        self.final_commits(&tps)
    }

    /// The broker stored `offset` for `tp`: acks below it are done.
    pub fn committed(&mut self, tp: &TopicPartition, offset: i64) {
        if let Some(p) = self.partitions.get_mut(tp) {
            p.committed = p.committed.max(offset);
            let committed = p.committed;
            let (done, keep): (Vec<_>, Vec<_>) =
                p.waiters.drain(..).partition(|(o, _)| *o < committed);
            p.waiters = keep;
            for (_, w) in done {
                let _ = w.send(Ok(()));
            }
        }
    }

    /// A commit request failed: ask again next time.
    pub fn commit_failed(&mut self, tp: &TopicPartition) {
        if let Some(p) = self.partitions.get_mut(tp) {
            p.requested = p.committed;
        }
    }

    /// No commit will come for `tp` (what stores the offsets is gone): the
    /// acks waiting for one fail now, and the next commit is asked anew.
    pub fn fail_waiters(&mut self, tp: &TopicPartition, why: &str) {
        if let Some(p) = self.partitions.get_mut(tp) {
            p.requested = p.committed;
            for (offset, w) in p.waiters.drain(..) {
                let _ = w.send(Err(format!("{}[{}]@{offset}: {why}", tp.0, tp.1)));
            }
        }
    }

    /// The partition is given up: unsettled and uncommitted acks fail.
    pub fn revoke(&mut self, tp: &TopicPartition) {
        if let Some(p) = self.partitions.remove(tp) {
            for (offset, w) in p.waiters {
                let _ = w.send(Err(format!(
                    "{}[{}]@{offset}: partition revoked before the commit",
                    tp.0, tp.1
                )));
            }
        }
    }

    /// Records from `offset` on will be read again: a new epoch for them.
    pub fn rewind(&mut self, tp: &TopicPartition, offset: i64) {
        if let Some(p) = self.partitions.get_mut(tp) {
            p.epoch += 1;
            p.outstanding.retain(|o, _| *o < offset);
            p.abandoned = p.abandoned.filter(|a| *a < offset);
            // Keep the old epochs of records below `offset`: their acks still count.
            p.next = Some(offset);
        }
    }

    /// One past the highest offset handed out in the current epoch.
    pub fn next(&self, tp: &TopicPartition) -> Option<i64> {
        self.partitions.get(tp).and_then(|p| p.next)
    }

    /// The epoch a rewind request must match (see [`OffsetTracker::rewind`]).
    pub fn is_current(&self, tp: &TopicPartition, offset: i64, epoch: u64) -> bool {
        self.partitions
            .get(tp)
            .is_some_and(|p| p.outstanding.get(&offset) == Some(&epoch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp() -> TopicPartition {
        ("t".into(), 0)
    }

    fn settle(
        t: &mut OffsetTracker,
        offset: i64,
        epoch: u64,
    ) -> oneshot::Receiver<Result<(), String>> {
        let (tx, rx) = oneshot::channel();
        t.settle(&tp(), offset, epoch, tx);
        rx
    }

    #[test]
    fn commits_only_below_the_lowest_unsettled_offset() {
        let mut t = OffsetTracker::default();
        let e: Vec<u64> = (10..15).map(|o| t.delivered(&tp(), o)).collect();
        let mut r12 = settle(&mut t, 12, e[2]);
        let mut r11 = settle(&mut t, 11, e[1]);
        // 10 is still being stored: nothing may be committed yet.
        assert_eq!(t.take_commits(), vec![]);
        let mut r10 = settle(&mut t, 10, e[0]);
        assert_eq!(t.take_commits(), vec![(tp(), 13)]);
        assert_eq!(t.take_commits(), vec![], "already requested");
        t.committed(&tp(), 13);
        for r in [&mut r10, &mut r11, &mut r12] {
            assert_eq!(r.try_recv().unwrap(), Ok(()));
        }
        let mut r14 = settle(&mut t, 14, e[4]);
        drop(settle(&mut t, 13, e[3]));
        assert_eq!(t.take_commits(), vec![(tp(), 15)]);
        t.committed(&tp(), 15);
        assert_eq!(r14.try_recv().unwrap(), Ok(()));
    }

    #[test]
    fn a_failed_commit_is_requested_again() {
        let mut t = OffsetTracker::default();
        let e = t.delivered(&tp(), 0);
        let _r = settle(&mut t, 0, e);
        assert_eq!(t.take_commits(), vec![(tp(), 1)]);
        t.commit_failed(&tp());
        assert_eq!(t.take_commits(), vec![(tp(), 1)]);
    }

    #[test]
    fn revoke_fails_uncommitted_acks_and_stale_acks() {
        let mut t = OffsetTracker::default();
        let e0 = t.delivered(&tp(), 0);
        let e1 = t.delivered(&tp(), 1);
        let mut r0 = settle(&mut t, 0, e0);
        assert_eq!(t.final_commits(&[tp()]), vec![(tp(), 1)]);
        t.revoke(&tp());
        assert!(r0.try_recv().unwrap().is_err());
        // The record at 1 settles after the partition is gone.
        let mut r1 = settle(&mut t, 1, e1);
        assert!(r1.try_recv().unwrap().is_err());
    }

    #[test]
    fn rewind_makes_the_old_copy_stale() {
        let mut t = OffsetTracker::default();
        let e0 = t.delivered(&tp(), 0);
        let e1 = t.delivered(&tp(), 1);
        t.rewind(&tp(), 1);
        let e1b = t.delivered(&tp(), 1);
        assert_ne!(e1, e1b);
        let mut stale = settle(&mut t, 1, e1);
        assert!(stale.try_recv().unwrap().is_err());
        let _ok0 = settle(&mut t, 0, e0);
        let _ok1 = settle(&mut t, 1, e1b);
        assert_eq!(t.take_commits(), vec![(tp(), 2)]);
    }

    #[test]
    fn abandoned_records_are_not_waited_for_nor_committed_past() {
        let mut t = OffsetTracker::default();
        let e0 = t.delivered(&tp(), 0);
        let e1 = t.delivered(&tp(), 1);
        let e2 = t.delivered(&tp(), 2);
        let _r0 = settle(&mut t, 0, e0);
        t.abandon(&tp(), 1, e1);
        let _r2 = settle(&mut t, 2, e2);
        assert!(!t.has_outstanding(&[tp()]));
        assert_eq!(t.take_commits(), vec![(tp(), 1)]);
        assert_eq!(t.final_commits(&[tp()]), vec![(tp(), 1)]);
    }
}
