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
//! still claimed, and [`Claims::first`] tells the dispatcher what it must
//! not overtake.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// (due, id) of every open claim.
#[derive(Debug, Default)]
pub struct Claims {
    open: Mutex<BTreeSet<(u64, u64)>>,
}

impl Claims {
    /// Open a claim for each of a batch's (due, id), all at once.
    pub(super) fn open(self: &Arc<Self>, keys: impl IntoIterator<Item = (u64, u64)>) -> Vec<Claim> {
        let claims: Vec<_> = keys
            .into_iter()
            .map(|key| Claim {
                claims: self.clone(),
                key,
            })
            .collect();
        self.set().extend(claims.iter().map(|c| c.key));
        claims
    }

    /// The earliest (due, id) still claimed.
    pub fn first(&self) -> Option<(u64, u64)> {
        self.set().first().copied()
    }

    fn set(&self) -> std::sync::MutexGuard<'_, BTreeSet<(u64, u64)>> {
        self.open.lock().expect("claims poisoned")
    }
}

/// One open claim; closed when dropped.
#[derive(Debug)]
pub struct Claim {
    claims: Arc<Claims>,
    key: (u64, u64),
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.claims.set().remove(&self.key);
    }
}
