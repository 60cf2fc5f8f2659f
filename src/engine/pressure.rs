//! Backpressure limits: `max_pending` messages and `max_disk` WAL bytes.
//!
//! The intake asks for an [`Admission`] before it stores a delivery. The
//! count of admissions being stored is added to the pending count, so with
//! any number of concurrent stores the pending count never passes
//! `max_pending`. A refused delivery is held unacked (see the intake) and the
//! intake pauses its source until [`Engine::relieved`]: below 90% of each limit,
//! so it does not flap around the limit.

use std::sync::Arc;

use super::{Engine, Inner};

/// Why delayd stops consuming for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pressure {
    /// `engine.max_pending` reached.
    MaxPending,
    /// `engine.max_disk` reached.
    MaxDisk,
    /// A WAL write failed with ENOSPC.
    DiskFull,
}

impl Pressure {
    pub fn as_str(self) -> &'static str {
        match self {
            Pressure::MaxPending => "max_pending",
            Pressure::MaxDisk => "max_disk",
            Pressure::DiskFull => "disk_full",
        }
    }
}

impl std::fmt::Display for Pressure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Room for one delivery being stored; released when dropped (by then the
/// stored message counts as pending, or the store failed).
pub struct Admission {
    inner: Arc<Inner>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.inner.state().unreserve();
    }
}

impl Engine {
    /// Room to store one more delivery, or the limit that is reached.
    pub fn admit(&self) -> Result<Admission, Pressure> {
        let max_disk = self.inner.config.max_disk;
        if max_disk > 0 && self.inner.disk_bytes() >= max_disk {
            return Err(Pressure::MaxDisk);
        }
        let max_pending = self.inner.config.max_pending;
        if !self.state().reserve(max_pending) {
            return Err(Pressure::MaxPending);
        }
        Ok(Admission {
            inner: self.inner.clone(),
        })
    }

    /// The limit reached right now, if any.
    pub fn pressure(&self) -> Option<Pressure> {
        let max_pending = self.inner.config.max_pending;
        if max_pending > 0 && self.state().pending_and_reserved() >= max_pending {
            return Some(Pressure::MaxPending);
        }
        let max_disk = self.inner.config.max_disk;
        if max_disk > 0 && self.inner.disk_bytes() >= max_disk {
            return Some(Pressure::MaxDisk);
        }
        None
    }

    /// Below the low-water mark (90%) of every limit: consuming may resume.
    pub fn relieved(&self) -> bool {
        let low = |max: u64| max - (max / 10).max(1);
        let max_pending = self.inner.config.max_pending;
        if max_pending > 0 && self.state().pending_and_reserved() > low(max_pending) {
            return false;
        }
        let max_disk = self.inner.config.max_disk;
        !(max_disk > 0 && self.inner.disk_bytes() > low(max_disk))
    }

    /// The configured limits (0 = none): (max_pending, max_disk).
    pub fn limits(&self) -> (u64, u64) {
        (self.inner.config.max_pending, self.inner.config.max_disk)
    }
}
