//! Sharing a partitioned route's partitions between instances (broker
//! store, RabbitMQ; see `config::partitions`). Each partition is a route
//! with its own lock. Each instance counts the instances present through a
//! presence queue (one consumer each) and competes for a partition's lock
//! only while it owns fewer than its share, `ceil(partitions / instances)`;
//! an instance above its share gives partitions up, one lock per partition
//! in excess, to the instances waiting for them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::amqp::state::Presence;
use delayd_adapters::amqp::Broker;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How often the instances present are counted.
const COUNT_EVERY: Duration = Duration::from_secs(1);

/// One partitioned route, as seen from this instance.
pub struct PartitionGroup {
    pub name: String,
    count: u32,
    /// Instances present, this one included (at least 1).
    members: AtomicU32,
    /// Partitions whose lock this instance holds.
    owned: AtomicU32,
    /// Of those, partitions giving their lock up to even the share out.
    yielding: AtomicU32,
    changed: Notify,
}

impl PartitionGroup {
    pub fn new(name: &str, count: u16) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            count: u32::from(count),
            members: AtomicU32::new(1),
            owned: AtomicU32::new(0),
            yielding: AtomicU32::new(0),
            changed: Notify::new(),
        })
    }

    /// How many partitions this instance should own.
    pub fn fair_share(&self) -> u32 {
        self.count
            .div_ceil(self.members.load(Ordering::Acquire).max(1))
    }

    pub fn owned(&self) -> u32 {
        self.owned.load(Ordering::Acquire)
    }

    pub fn has_room(&self) -> bool {
        self.owned() < self.fair_share()
    }

    /// A partition's lock was taken here.
    pub fn took(&self) {
        self.owned.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// A partition's lock was given up (lost, or `yielding`).
    pub fn gave_up(&self, yielding: bool) {
        self.owned.fetch_sub(1, Ordering::AcqRel);
        if yielding {
            self.yielding.fetch_sub(1, Ordering::AcqRel);
        }
        self.changed.notify_waiters();
    }

    /// Wait until this instance owns fewer than its share (false), or
    /// `stop` (true).
    pub async fn wait_for_room(&self, stop: &CancellationToken) -> bool {
        loop {
            let changed = self.changed.notified();
            if self.has_room() {
                return false;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(COUNT_EVERY) => {}
                _ = stop.cancelled() => return true,
            }
        }
    }

    /// Resolves once this instance owns its share: a candidate for one
    /// more lock stands down then.
    pub async fn full(&self) {
        loop {
            let changed = self.changed.notified();
            if !self.has_room() {
                return;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(COUNT_EVERY) => {}
            }
        }
    }

    /// Resolves once one more of this instance's partitions should give
    /// its lock up (it owns more than its share), claiming that turn.
    pub async fn yield_turn(&self) {
        loop {
            let changed = self.changed.notified();
            if self.claim_yield() {
                return;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(COUNT_EVERY) => {}
            }
        }
    }

    fn claim_yield(&self) -> bool {
        let fair = self.fair_share();
        let owned = self.owned();
        self.yielding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |y| {
                (owned.saturating_sub(y) > fair).then_some(y + 1)
            })
            .is_ok()
    }

    fn set_members(&self, n: u32) {
        if self.members.swap(n.max(1), Ordering::AcqRel) != n.max(1) {
            tracing::info!(route = %self.name, instances = n, share = self.fair_share(), "instances sharing the partitioned route");
            self.changed.notify_waiters();
        }
    }

    /// Be present on `queue` and count the instances there until `stop`,
    /// reconnecting as needed.
    pub async fn run_presence(
        self: Arc<Self>,
        broker: Broker,
        queue: String,
        stop: CancellationToken,
    ) {
        loop {
            let joined = async {
                let connection = broker
                    .open_dedicated()
                    .await
                    .map_err(delayd_adapters::amqp::state::StateError::from)?;
                Presence::join(connection, &queue).await
            };
            let presence = tokio::select! {
                p = joined => p,
                _ = stop.cancelled() => return,
            };
            match presence {
                Ok(presence) => {
                    while presence.is_alive() {
                        match presence.count().await {
                            Ok(n) => self.set_members(n),
                            Err(e) => {
                                tracing::warn!(route = %self.name, error = %e, "cannot count the instances sharing the route");
                                break;
                            }
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(COUNT_EVERY) => {}
                            _ = stop.cancelled() => {
                                presence.leave().await;
                                return;
                            }
                        }
                    }
                    presence.leave().await;
                }
                Err(e) => {
                    tracing::warn!(route = %self.name, error = %e, "cannot join the instances sharing the route; trying again");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(COUNT_EVERY) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_above_its_share_yields_the_excess_once_each() {
        let g = PartitionGroup::new("orders", 6);
        for _ in 0..6 {
            g.took();
        }
        assert_eq!(g.fair_share(), 6);
        assert!(!g.claim_yield());
        g.set_members(2);
        assert_eq!(g.fair_share(), 3);
        assert!(g.claim_yield() && g.claim_yield() && g.claim_yield());
        assert!(!g.claim_yield(), "three in excess, three turns");
        for _ in 0..3 {
            g.gave_up(true);
        }
        assert_eq!((g.owned(), g.has_room()), (3, false));
        g.set_members(4);
        assert_eq!(g.fair_share(), 2);
        assert!(g.claim_yield());
        assert!(!g.claim_yield());
        g.gave_up(false); // lost one meanwhile: the yield still counts
        assert_eq!(g.owned(), 2);
    }
}
