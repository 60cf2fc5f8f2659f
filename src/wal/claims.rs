//! Schedules that are durable but not yet taken up by their appender.
//!
//! The engine arms a message once its append resolves, and the appends of
//! one group commit resolve in whatever order their futures are polled. A
//! message stored after its due instant (a burst the intake could not keep
//! up with) fires as soon as it is armed, so without this a later message
//! could be armed, and sent, before an earlier one of the same due time.
//!
//! The writer opens a claim for each such Schedule of a batch before it
//! answers any of them; the appender drops its [`Claim`] once the message is
//! armed (dropping it unarmed, or never receiving it, drops it too). So
//! whenever a message is armed, every earlier Schedule is either armed or
//! still claimed, and [`Claims::first_by_route`] tells the dispatcher what
//! it must not overtake.
//!
//! Claims are kept per route: order is a route's promise, and a burst
//! still being stored on one route must not hold back another's due
//! messages.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// (due, id) of every open claim of a route.
type Open = HashMap<Arc<str>, BTreeSet<(u64, u64)>>;

/// Every open claim, per route.
#[derive(Debug, Default)]
pub struct Claims {
    open: Mutex<Open>,
}

impl Claims {
    /// Open a claim for each of a batch's (route, due, id), all at once.
    pub(super) fn open(
        self: &Arc<Self>,
        keys: impl IntoIterator<Item = (Arc<str>, u64, u64)>,
    ) -> Vec<Claim> {
        let claims: Vec<_> = keys
            .into_iter()
            .map(|(route, due, id)| Claim {
                claims: self.clone(),
                route,
                key: (due, id),
            })
            .collect();
        let mut open = self.set();
        for c in &claims {
            open.entry(c.route.clone()).or_default().insert(c.key);
        }
        claims
    }

    /// The earliest (due, id) still claimed on each route that has one.
    pub fn first_by_route(&self) -> HashMap<Arc<str>, (u64, u64)> {
        self.set()
            .iter()
            .filter_map(|(route, keys)| Some((route.clone(), *keys.first()?)))
            .collect()
    }

    fn set(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().expect("claims poisoned")
    }
}

/// One open claim; closed when dropped.
#[derive(Debug)]
pub struct Claim {
    claims: Arc<Claims>,
    route: Arc<str>,
    key: (u64, u64),
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut open = self.claims.set();
        if let Some(keys) = open.get_mut(&self.route) {
            keys.remove(&self.key);
            if keys.is_empty() {
                open.remove(&self.route);
            }
        }
    }
}
